/* Reduction kernels shared by every transport: dst = op over k sources, element by element.
 *
 * Sources are combined strictly in the order given (source 0, then 1, ...), so a transport that
 * passes the ranks' data in rank order gets results that are bitwise identical on every rank.
 * f16 and bf16 are widened to f32, reduced in f32 and rounded once (never summed in half
 * precision). AVG sums, then divides once by the number of sources; integers divide with
 * truncation toward zero. Integer sums and products wrap (two's complement) instead of invoking
 * undefined behaviour; i32 and u8 sums are accumulated in 64 bits, so AVG of i32/u8 is exact
 * (e.g. u8 avg of 200 and 100 is 150), while i64 AVG divides the wrapped 64-bit sum. MIN and MAX
 * use (a < b ? a : b) semantics, i.e. the result for a NaN operand depends on its position. */
#ifndef DDP_CORE_REDUCE_H
#define DDP_CORE_REDUCE_H

#include <stddef.h>

#include "core/internal.h"
#include "ddp/types.h"

/* dsts[d][i] = op over s of srcs[s][i], for i < count and every d < ndsts (every destination
 * receives the very same bytes). A destination may be identical to a source (in place), but must
 * not partially overlap one. nsrcs >= 1, ndsts >= 1, dtype and op valid (callers validate). */
void ddp__reduce_multi(void *const *dsts, int ndsts, const void *const *srcs, int nsrcs,
                       size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op);

/* ddp__reduce_multi with non-temporal stores to the destinations whose bit is set in `stream`
 * (bit d: dsts[d]): for destinations another core will read next, or that do not fit in the
 * caches. Ends with a store fence. Same results as ddp__reduce_multi. */
void ddp__reduce_multi_stream(void *const *dsts, int ndsts, unsigned stream,
                              const void *const *srcs, int nsrcs, size_t count, ddp_dtype_t dtype,
                              ddp_reduce_op_t op);

/* memcpy with non-temporal stores (plain memcpy below 256 bytes or off x86-64): the destination
 * lines are not read first and do not displace the cache. The _nofence form needs a later
 * ddp__stream_fence before another thread or process may read the destination. */
void ddp__copy_stream(void *dst, const void *src, size_t bytes);
void ddp__copy_stream_nofence(void *dst, const void *src, size_t bytes);
void ddp__stream_fence(void);

/* The common case: one destination. */
void ddp__reduce(void *dst, const void *const *srcs, int nsrcs, size_t count, ddp_dtype_t dtype,
                 ddp_reduce_op_t op);

/* ---- the rules of a reduction done in steps ---------------------------------------------------
 * A transport that reduces in several steps (a ring, recursive doubling, shm then tcp, MPI)
 * carries partial results in an accumulation type, so that the result is rounded once, exactly
 * as ddp__reduce does in one step: f16/bf16 in f32, and for AVG the i32 and u8 sums in i64 (u8
 * avg of 200 and 100 is 150, not a wrapped sum divided). AVG is a SUM in every step and one
 * division by the number of ranks at the end, on identical bytes on every rank. These are the
 * only definitions of those rules; every transport and the reducer call them. */

/* The type partial results of `op` over `dtype` travel and are combined in. */
DDP_MODULE_API ddp_dtype_t ddp__acc_dtype(ddp_dtype_t dtype, ddp_reduce_op_t op);

/* widen: dtype -> its accumulation type (f32 for f16/bf16, i64 for i32/u8); narrow: back
 * (halves rounded to nearest even, integers truncated); other dtypes are left alone. */
DDP_MODULE_API void ddp__acc_widen(void *dst, const void *src, size_t count, ddp_dtype_t dtype);
DDP_MODULE_API void ddp__acc_narrow(void *dst, const void *src, size_t count, ddp_dtype_t dtype);

/* One step: dst[i] = x[i] op y[i] (x first) for `count` elements of an accumulation dtype (f32,
 * f64, i32, i64, u8); AVG combines as SUM. dst may alias x or y. */
void ddp__acc_combine(void *dst, const void *x, const void *y, size_t count,
                      ddp_dtype_t acc_dtype, ddp_reduce_op_t op);

/* data[i] /= n in place: f32 and f64 in their own precision, f16/bf16 through f32 rounded once
 * to nearest even, integers truncated toward zero. AVG's division, and the reducer's prescaling
 * of a bucket before a summing hook. n >= 1. */
DDP_MODULE_API void ddp__divide_by(void *data, size_t count, ddp_dtype_t dtype, int n);

/* The last step: `acc` holds `count` reduced elements in `acc_dtype` (ddp__acc_dtype, or a wider
 * type of the same family a transport chose); divides them by n for AVG (in place in acc), then
 * writes them to `out` in `dtype` (narrowing, or copying when out != acc). */
DDP_MODULE_API void ddp__acc_finish(void *out, void *acc, size_t count, ddp_dtype_t dtype,
                                    ddp_dtype_t acc_dtype, ddp_reduce_op_t op, int n);

/* Name of the kernel variant chosen at run time ("avx512+bf16", "avx512", "avx2+f16c" or
 * "baseline"), for benchmarks. */
const char *ddp__reduce_variant(void);

/* The highest variant ddp__reduce_force_variant knows. */
#define DDP__REDUCE_VARIANT_MAX 3

/* Tests only: force the baseline (0), AVX2+F16C (1), AVX-512 (2) or AVX-512 with BF16 (3)
 * kernels; -1 goes back to choosing by CPU. Returns -1 (and chooses by CPU) when the CPU lacks
 * that variant's instructions. Not thread-safe with concurrent reductions. */
int ddp__reduce_force_variant(int variant);

#endif
