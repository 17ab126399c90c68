/* What the reduction kernels share between reduce.c (the block kernels, dispatch) and
 * reduce_stream.c (the streamed kernels and copies): the x86 target attributes, the arguments of
 * a kernel, the variant chosen at run time. Private to src/core. */
#ifndef DDP_CORE_REDUCE_KERNELS_H
#define DDP_CORE_REDUCE_KERNELS_H

#include <stddef.h>

#include "core/reduce.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DDP_REDUCE_X86 1
#define DDP_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define DDP_TARGET_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl")))
#else
#define DDP_REDUCE_X86 0
#define DDP_TARGET_AVX2
#define DDP_TARGET_AVX512
#endif

#define INLINE static inline __attribute__((always_inline))

typedef struct reduce_args {
    void *const *dsts;
    int ndsts;
    const void *const *srcs;
    int nsrcs;
    size_t count;
    ddp_reduce_op_t op;
    unsigned stream; /* bit d: destination d is written with non-temporal stores */
} reduce_args_t;

/* The register kernels' limits (reduce_stream.c); beyond them the block kernels run. */
#define STREAM_MAX_SRCS 16
#define STREAM_MAX_DSTS 32

/* a from element `first` on, `count` elements of `esize` bytes: the moved pointers go into srcs
 * and dsts (room for a->nsrcs and a->ndsts). */
static inline reduce_args_t reduce_args_from(const reduce_args_t *a, size_t first, size_t count,
                                             size_t esize, const void **srcs, void **dsts)
{
    for (int s = 0; s < a->nsrcs; s++) srcs[s] = (const char *)a->srcs[s] + first * esize;
    for (int d = 0; d < a->ndsts; d++) dsts[d] = (char *)a->dsts[d] + first * esize;
    reduce_args_t b = *a;
    b.srcs = srcs;
    b.dsts = dsts;
    b.count = count;
    return b;
}

/* The kernel variant in use: 0 baseline, 1 AVX2+F16C, 2 AVX-512 (ddp__reduce_force_variant). */
int ddp__reduce_choose(void);

/* The streamed register kernels on what they can take of a (reduce_stream.c): f32 or, with
 * AVX-512, bf16; SUM or AVG; every destination streamed and all equally aligned. Returns how
 * many elements they did, from element *head on (the elements before the destinations' vector
 * alignment are left to the block kernel), or 0. */
size_t ddp__reduce_sum_streamed(const reduce_args_t *a, ddp_dtype_t dtype, size_t *head);

#endif
