/* What the reduction kernels share between reduce.c (the block kernels, dispatch) and
 * reduce_stream.c (the streamed kernels and copies): the x86 target attributes, the arguments of
 * a kernel, the variant chosen at run time. Private to src/core. */
#ifndef DDP_CORE_REDUCE_KERNELS_H
#define DDP_CORE_REDUCE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "core/reduce.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DDP_REDUCE_X86 1
#define DDP_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define DDP_TARGET_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl")))
#define DDP_TARGET_AVX512_BF16                                                                    \
    __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define DDP_REDUCE_X86 0
#define DDP_TARGET_AVX2
#define DDP_TARGET_AVX512
#define DDP_TARGET_AVX512_BF16
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

#if DDP_REDUCE_X86
/* bf16 sixteen at a time (the register kernels): widened to f32 exactly (a shift), and f32
 * rounded to bf16 by the rule of every variant (f32_to_bf16_inline in reduce.c): to nearest
 * even, NaNs kept and made quiet. */
DDP_TARGET_AVX512 INLINE __m512 bf16x16_widen_masked(const uint16_t *p, __mmask16 m)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

DDP_TARGET_AVX512 INLINE __m512 bf16x16_widen(const uint16_t *p)
{
    return bf16x16_widen_masked(p, (__mmask16)0xffff);
}

DDP_TARGET_AVX512 INLINE __m256i bf16x16_narrow(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* The same bits with AVX-512 BF16: VCVTNEPS2BF16 rounds to nearest even and quiets NaNs exactly
 * so, but flushes denormals to zero; the lanes whose f32 value is denormal (fpclass 0x20: a
 * result below 2^-126, rare) are rounded by the integer rule instead. */
DDP_TARGET_AVX512_BF16 INLINE __m256i bf16x16_narrow_native(__m512 x)
{
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    const __mmask16 denormal = _mm512_fpclass_ps_mask(x, 0x20);
    if (denormal) r = _mm256_mask_mov_epi16(r, denormal, bf16x16_narrow(x));
    return r;
}

/* 32 bf16 in one vector, as 16 f32 each: the even-numbered elements and the odd-numbered ones
 * (each 32-bit lane holds one of each), widened exactly without leaving the lane. */
DDP_TARGET_AVX512 INLINE __m512 bf16x32_even(__m512i x)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

DDP_TARGET_AVX512 INLINE __m512 bf16x32_odd(__m512i x)
{
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The inverse: even- and odd-numbered f32 rounded as bf16x16_narrow_native does, back in
 * element order. */
DDP_TARGET_AVX512_BF16 INLINE __m512i bf16x32_narrow_native(__m512 even, __m512 odd)
{
    /* Word j of the conversion is even[j] for j < 16 and odd[j - 16] after: element 2i comes
     * from word i, element 2i + 1 from word 16 + i. */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    __m512i r = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    const __mmask16 de = _mm512_fpclass_ps_mask(even, 0x20);
    const __mmask16 dodd = _mm512_fpclass_ps_mask(odd, 0x20);
    if (de | dodd) {
        const __m512i fixed = _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16_narrow(even)),
                                                 bf16x16_narrow(odd), 1);
        r = _mm512_mask_mov_epi16(r, (__mmask32)de | ((__mmask32)dodd << 16), fixed);
    }
    return _mm512_permutexvar_epi16(order, r);
}
#endif

/* The kernel variant in use: 0 baseline, 1 AVX2+F16C, 2 AVX-512, 3 AVX-512 with BF16 (the
 * AVX-512 kernels, bf16 narrowed by VCVTNEPS2BF16) (ddp__reduce_force_variant). */
int ddp__reduce_choose(void);

/* The streamed register kernels on what they can take of a (reduce_stream.c): f32 or, with
 * AVX-512, bf16; SUM or AVG; every destination streamed and all equally aligned. Returns how
 * many elements they did, from element *head on (the elements before the destinations' vector
 * alignment are left to the block kernel), or 0. */
size_t ddp__reduce_sum_streamed(const reduce_args_t *a, ddp_dtype_t dtype, size_t *head);

#endif
