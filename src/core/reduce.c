/* Reduction kernels: dst = op over k sources, for every dtype and op (see reduce.h).
 *
 * How: the data is processed in blocks of BLOCK elements. For each block, source 0 is loaded into
 * a small accumulator that stays in L1, every further source is combined into it in order, AVG
 * divides once, and the finished block is written to each destination. Because a whole block is
 * read from every source before any destination byte of that block is written, a destination may
 * be one of the sources (in place). Every loop is a plain element-wise loop over arrays the
 * compiler vectorises; the same loops are compiled three times, for baseline x86-64, with
 * target("avx2,f16c") (F16C converts halves eight at a time) and with AVX-512 F/BW/VL as well
 * (opmasks and a narrowing move make bf16's rounding half as many instructions); where the CPU
 * has AVX-512 BF16 as well, bf16 sums and averages have a register kernel of their own that
 * rounds with VCVTNE2PS2BF16 (reduce_bf16_avx512_bf16, element by element: in place too). The
 * variant is chosen once at run time. Element-wise IEEE operations give the same bits at any
 * vector width and no FMA is used (no loop multiplies and adds in one expression), so every
 * variant produces identical results. The variant is chosen in reduce_variant.c; the register
 * kernels for streamed f32/bf16 sums and the non-temporal copies are in reduce_stream.c. */
#include <stdint.h>
#include <string.h>

#include "core/half.h"
#include "core/internal.h"
#include "core/reduce.h"
#include "core/reduce_kernels.h"

#define BLOCK 1024

/* Copies a finished block from `block` (destination 0's block, or an L1 accumulator) to every
 * destination that is not `block` itself, streaming to those flagged in a->stream. */
INLINE void fan_out_from(const reduce_args_t *a, const void *block, size_t byte_offset,
                         size_t bytes)
{
    for (int d = 0; d < a->ndsts; d++) {
        char *dst = (char *)a->dsts[d] + byte_offset;
        if (dst == (const char *)block) continue;
        if (a->stream & (1u << d))
            ddp__copy_stream_nofence(dst, block, bytes);
        else
            memcpy(dst, block, bytes);
    }
}

INLINE void fan_out(const reduce_args_t *a, size_t byte_offset, size_t bytes)
{
    fan_out_from(a, (const char *)a->dsts[0] + byte_offset, byte_offset, bytes);
}

/* ---- f32 and f64: accumulated in their own type ------------------------------------------ */

#define COMBINE_LOOP(T, acc, x, n, op)                                                            \
    do {                                                                                          \
        switch (op) {                                                                             \
        case DDP_SUM:                                                                             \
        case DDP_AVG:                                                                             \
            for (size_t i = 0; i < (n); i++) (acc)[i] = (acc)[i] + (x)[i];                        \
            break;                                                                                \
        case DDP_MIN:                                                                             \
            for (size_t i = 0; i < (n); i++) (acc)[i] = (acc)[i] < (x)[i] ? (acc)[i] : (x)[i];    \
            break;                                                                                \
        case DDP_MAX:                                                                             \
            for (size_t i = 0; i < (n); i++) (acc)[i] = (acc)[i] > (x)[i] ? (acc)[i] : (x)[i];    \
            break;                                                                                \
        default:                                                                                  \
            for (size_t i = 0; i < (n); i++) (acc)[i] = (acc)[i] * (x)[i];                        \
            break;                                                                                \
        }                                                                                         \
    } while (0)

/* dst = a op b in one pass (two sources, the most common case): no accumulator copy. */
#define COMBINE2_LOOP(T, dst, a, b, n, op)                                                        \
    do {                                                                                          \
        switch (op) {                                                                             \
        case DDP_SUM:                                                                             \
            for (size_t i = 0; i < (n); i++) (dst)[i] = (a)[i] + (b)[i];                          \
            break;                                                                                \
        case DDP_AVG:                                                                             \
            for (size_t i = 0; i < (n); i++) (dst)[i] = ((a)[i] + (b)[i]) / (T)2;                 \
            break;                                                                                \
        case DDP_MIN:                                                                             \
            for (size_t i = 0; i < (n); i++) (dst)[i] = (a)[i] < (b)[i] ? (a)[i] : (b)[i];        \
            break;                                                                                \
        case DDP_MAX:                                                                             \
            for (size_t i = 0; i < (n); i++) (dst)[i] = (a)[i] > (b)[i] ? (a)[i] : (b)[i];        \
            break;                                                                                \
        default:                                                                                  \
            for (size_t i = 0; i < (n); i++) (dst)[i] = (a)[i] * (b)[i];                          \
            break;                                                                                \
        }                                                                                         \
    } while (0)

#define FLOAT_KERNEL(NAME, T, ATTR)                                                               \
    ATTR static void NAME(const reduce_args_t *a)                                                 \
    {                                                                                             \
        T acc[BLOCK];                                                                             \
        for (size_t base = 0; base < a->count; base += BLOCK) {                                   \
            size_t n = a->count - base < BLOCK ? a->count - base : BLOCK;                         \
            /* A streamed destination 0 is computed in L1 and streamed out with the others. */ \
            T *d0 = (a->stream & 1u) ? acc : (T *)a->dsts[0] + base;                              \
            const T *s0 = (const T *)a->srcs[0] + base;                                           \
            if (a->nsrcs == 2) {                                                                  \
                const T *s1 = (const T *)a->srcs[1] + base;                                       \
                COMBINE2_LOOP(T, d0, s0, s1, n, a->op);                                           \
            } else {                                                                              \
                memcpy(acc, s0, n * sizeof(T));                                                   \
                for (int s = 1; s < a->nsrcs; s++) {                                              \
                    const T *x = (const T *)a->srcs[s] + base;                                    \
                    COMBINE_LOOP(T, acc, x, n, a->op);                                            \
                }                                                                                 \
                if (a->op == DDP_AVG) {                                                           \
                    T div = (T)a->nsrcs;                                                          \
                    for (size_t i = 0; i < n; i++) acc[i] = acc[i] / div;                         \
                }                                                                                 \
                if (d0 != acc) memcpy(d0, acc, n * sizeof(T));                                    \
            }                                                                                     \
            fan_out_from(a, d0, base * sizeof(T), n * sizeof(T));                                 \
        }                                                                                         \
    }

FLOAT_KERNEL(reduce_f32_base, float, )
FLOAT_KERNEL(reduce_f64_base, double, )
#if DDP_REDUCE_X86
FLOAT_KERNEL(reduce_f32_avx2, float, DDP_TARGET_AVX2)
FLOAT_KERNEL(reduce_f64_avx2, double, DDP_TARGET_AVX2)
FLOAT_KERNEL(reduce_f32_avx512, float, DDP_TARGET_AVX512)
FLOAT_KERNEL(reduce_f64_avx512, double, DDP_TARGET_AVX512)
#endif

/* ---- f16 and bf16: widened to f32, reduced, rounded once ---------------------------------- */

/* Branch-free binary16 -> f32 (exact), written so that it vectorises: the exponent is rebiased,
 * infinities/NaNs get the maximal exponent, and subnormals are normalised with one float
 * subtraction (the classic "magic number" trick). */
INLINE float f16_to_f32_inline(uint16_t h)
{
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = o & shifted_exp;
    o += (uint32_t)(127 - 15) << 23;
    uint32_t is_special = exp == shifted_exp;
    uint32_t is_sub = exp == 0;
    o += is_special ? (uint32_t)(128 - 16) << 23 : 0u;
    float f;
    uint32_t sub_bits = o + (1u << 23);
    float sub;
    memcpy(&sub, &sub_bits, 4);
    sub -= 6.103515625e-05f; /* 2^-14 */
    memcpy(&f, &o, 4);
    f = is_sub ? sub : f;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits |= ((uint32_t)h & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

INLINE float bf16_to_f32_inline(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 -> bf16 with round-to-nearest-even; NaN stays a quiet NaN. Same as ddp_f32_to_bf16. */
INLINE uint16_t f32_to_bf16_inline(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#if DDP_REDUCE_X86
DDP_TARGET_AVX2 INLINE void widen_f16_avx2(float *out, const uint16_t *in, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    for (; i < n; i++) out[i] = f16_to_f32_inline(in[i]);
}

DDP_TARGET_AVX2 INLINE void narrow_f16_avx2(uint16_t *out, const float *in, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = ddp_f32_to_f16(in[i]);
}
#endif

/* One element combined into an f32 accumulator, in the order acc op x. */
#define COMBINE1(op, acc, x)                                                                      \
    ((op) == DDP_SUM || (op) == DDP_AVG ? (acc) + (x)                                            \
     : (op) == DDP_MIN                  ? ((acc) < (x) ? (acc) : (x))                             \
     : (op) == DDP_MAX                  ? ((acc) > (x) ? (acc) : (x))                             \
                                        : (acc) * (x))

/* f16 with F16C: widened eight at a time into a block, then combined (F16C has no per-element
 * form the compiler would vectorise). */
#define HALF_KERNEL(NAME, WIDEN, NARROW, ATTR)                                                    \
    ATTR static void NAME(const reduce_args_t *a)                                                 \
    {                                                                                             \
        float acc[BLOCK];                                                                         \
        float x[BLOCK];                                                                           \
        uint16_t out[BLOCK];                                                                      \
        for (size_t base = 0; base < a->count; base += BLOCK) {                                   \
            size_t n = a->count - base < BLOCK ? a->count - base : BLOCK;                         \
            WIDEN(acc, (const uint16_t *)a->srcs[0] + base, n);                                   \
            for (int s = 1; s < a->nsrcs; s++) {                                                  \
                WIDEN(x, (const uint16_t *)a->srcs[s] + base, n);                                 \
                COMBINE_LOOP(float, acc, x, n, a->op);                                            \
            }                                                                                     \
            if (a->op == DDP_AVG) {                                                               \
                float div = (float)a->nsrcs;                                                      \
                for (size_t i = 0; i < n; i++) acc[i] = acc[i] / div;                             \
            }                                                                                     \
            uint16_t *d0 = (a->stream & 1u) ? out : (uint16_t *)a->dsts[0] + base;                \
            NARROW(d0, acc, n);                                                                   \
            fan_out_from(a, d0, base * 2, n * 2);                                                 \
        }                                                                                         \
    }

/* Halves whose widening is a plain per-element function (bf16 always, f16 without F16C):
 * widening, combining and, for two sources, rounding happen in one pass per source, each loop
 * vectorised by the compiler. Same arithmetic, in the same order, as HALF_KERNEL: every source
 * widened exactly, combined into f32 in order, AVG divided once, rounded once. bf16 sum of two
 * sources, 65536 elements in L2, on the Intel Xeon of issue #27: 2.3 Gelem/s in three passes,
 * 2.3-2.7 in one pass with AVX2 (the rounding dominates), 4.7 with the AVX-512 variant. */
#define HALF_FUSED_KERNEL(NAME, W, NARROW1, ATTR)                                                 \
    ATTR static void NAME(const reduce_args_t *a)                                                 \
    {                                                                                             \
        float acc[BLOCK];                                                                         \
        uint16_t out[BLOCK];                                                                      \
        const ddp_reduce_op_t op = a->op;                                                         \
        for (size_t base = 0; base < a->count; base += BLOCK) {                                   \
            size_t n = a->count - base < BLOCK ? a->count - base : BLOCK;                         \
            uint16_t *d0 = (a->stream & 1u) ? out : (uint16_t *)a->dsts[0] + base;                \
            const uint16_t *s0 = (const uint16_t *)a->srcs[0] + base;                             \
            if (a->nsrcs == 2) {                                                                  \
                const uint16_t *s1 = (const uint16_t *)a->srcs[1] + base;                         \
                switch (op) {                                                                     \
                case DDP_SUM:                                                                     \
                    for (size_t i = 0; i < n; i++) d0[i] = NARROW1(W(s0[i]) + W(s1[i]));          \
                    break;                                                                        \
                case DDP_AVG:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        d0[i] = NARROW1((W(s0[i]) + W(s1[i])) / 2.0f);                            \
                    break;                                                                        \
                case DDP_MIN:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        d0[i] = NARROW1(COMBINE1(DDP_MIN, W(s0[i]), W(s1[i])));                   \
                    break;                                                                        \
                case DDP_MAX:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        d0[i] = NARROW1(COMBINE1(DDP_MAX, W(s0[i]), W(s1[i])));                   \
                    break;                                                                        \
                default:                                                                          \
                    for (size_t i = 0; i < n; i++) d0[i] = NARROW1(W(s0[i]) * W(s1[i]));          \
                    break;                                                                        \
                }                                                                                 \
            } else {                                                                              \
                for (size_t i = 0; i < n; i++) acc[i] = W(s0[i]);                                 \
                for (int s = 1; s < a->nsrcs; s++) {                                              \
                    const uint16_t *x = (const uint16_t *)a->srcs[s] + base;                      \
                    switch (op) {                                                                 \
                    case DDP_SUM:                                                                 \
                    case DDP_AVG:                                                                 \
                        for (size_t i = 0; i < n; i++) acc[i] = acc[i] + W(x[i]);                 \
                        break;                                                                    \
                    case DDP_MIN:                                                                 \
                        for (size_t i = 0; i < n; i++)                                            \
                            acc[i] = COMBINE1(DDP_MIN, acc[i], W(x[i]));                          \
                        break;                                                                    \
                    case DDP_MAX:                                                                 \
                        for (size_t i = 0; i < n; i++)                                            \
                            acc[i] = COMBINE1(DDP_MAX, acc[i], W(x[i]));                          \
                        break;                                                                    \
                    default:                                                                      \
                        for (size_t i = 0; i < n; i++) acc[i] = acc[i] * W(x[i]);                 \
                        break;                                                                    \
                    }                                                                             \
                }                                                                                 \
                if (op == DDP_AVG) {                                                              \
                    float div = (float)a->nsrcs;                                                  \
                    for (size_t i = 0; i < n; i++) d0[i] = NARROW1(acc[i] / div);                 \
                } else {                                                                          \
                    for (size_t i = 0; i < n; i++) d0[i] = NARROW1(acc[i]);                       \
                }                                                                                 \
            }                                                                                     \
            fan_out_from(a, d0, base * 2, n * 2);                                                 \
        }                                                                                         \
    }

HALF_FUSED_KERNEL(reduce_f16_base, f16_to_f32_inline, ddp_f32_to_f16, )
HALF_FUSED_KERNEL(reduce_bf16_base, bf16_to_f32_inline, f32_to_bf16_inline, )
#if DDP_REDUCE_X86
HALF_KERNEL(reduce_f16_avx2, widen_f16_avx2, narrow_f16_avx2, DDP_TARGET_AVX2)
HALF_FUSED_KERNEL(reduce_bf16_avx2, bf16_to_f32_inline, f32_to_bf16_inline, DDP_TARGET_AVX2)
HALF_KERNEL(reduce_f16_avx512, widen_f16_avx2, narrow_f16_avx2, DDP_TARGET_AVX512)
HALF_FUSED_KERNEL(reduce_bf16_avx512, bf16_to_f32_inline, f32_to_bf16_inline, DDP_TARGET_AVX512)

/* bf16 SUM and AVG with AVX-512 BF16 (the other ops take reduce_bf16_avx512): 32 elements a
 * step in registers, each source widened and added in order, AVG divided once, rounded once by
 * VCVTNE2PS2BF16 (bf16x32_narrow_native): the bits of the kernels above. The
 * compiler's vectorisation of f32_to_bf16_inline takes ~19 instructions per 16 elements, most
 * of them on the two ports AVX-512 has; this loop ~7. On the Intel Xeon of issue #27, variants
 * forced alternately, 2 sources: 2048 elements 4.1 -> 9.5 Gelem/s, 131072 4.3 -> 8.6; 3 and 4
 * sources 1.7-2.1x (bench/results/2026-11-29-0700-bf16-native-ab.txt). */
DDP_TARGET_AVX512_BF16 static void reduce_bf16_avx512_bf16(const reduce_args_t *a)
{
    if (a->op != DDP_SUM && a->op != DDP_AVG) {
        reduce_bf16_avx512(a);
        return;
    }
    uint16_t out[BLOCK];
    const int avg = a->op == DDP_AVG, k = a->nsrcs;
    const uint16_t *const *src = (const uint16_t *const *)a->srcs;
    const __m512 div = _mm512_set1_ps((float)k);
    for (size_t base = 0; base < a->count; base += BLOCK) {
        const size_t n = a->count - base < BLOCK ? a->count - base : BLOCK;
        uint16_t *d0 = (a->stream & 1u) ? out : (uint16_t *)a->dsts[0] + base;
        size_t i = 0;
        /* 32 elements a step as one vector a source: the even-numbered ones widened by a shift,
         * the odd-numbered ones by a mask (no widening across lanes), rounded together and put
         * back in order by one permutation. The rest sixteen at a time, masked. */
        for (; i + 32 <= n; i += 32) {
            __m512i x = _mm512_loadu_si512(src[0] + base + i);
            __m512 even = bf16x32_even(x), odd = bf16x32_odd(x);
            for (int s = 1; s < k; s++) {
                x = _mm512_loadu_si512(src[s] + base + i);
                even = _mm512_add_ps(even, bf16x32_even(x));
                odd = _mm512_add_ps(odd, bf16x32_odd(x));
            }
            if (avg) {
                even = _mm512_div_ps(even, div);
                odd = _mm512_div_ps(odd, div);
            }
            _mm512_storeu_si512(d0 + i, bf16x32_narrow_native(even, odd));
        }
        for (; i < n; i += 16) {
            const __mmask16 m =
                n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            __m512 x = bf16x16_widen_masked(src[0] + base + i, m);
            for (int s = 1; s < k; s++)
                x = _mm512_add_ps(x, bf16x16_widen_masked(src[s] + base + i, m));
            if (avg) x = _mm512_div_ps(x, div);
            _mm256_mask_storeu_epi16(d0 + i, m, bf16x16_narrow_native(x));
        }
        fan_out_from(a, d0, base * 2, n * 2);
    }
}
#endif

/* ---- integers: accumulated in 64 bits with wrapping arithmetic ------------------------------ */

#define INT_KERNEL(NAME, T)                                                                       \
    static void NAME(const reduce_args_t *a)                                                      \
    {                                                                                             \
        int64_t acc[BLOCK];                                                                       \
        for (size_t base = 0; base < a->count; base += BLOCK) {                                   \
            size_t n = a->count - base < BLOCK ? a->count - base : BLOCK;                         \
            const T *s0 = (const T *)a->srcs[0] + base;                                           \
            for (size_t i = 0; i < n; i++) acc[i] = (int64_t)s0[i];                               \
            for (int s = 1; s < a->nsrcs; s++) {                                                  \
                const T *x = (const T *)a->srcs[s] + base;                                        \
                switch (a->op) {                                                                  \
                case DDP_SUM:                                                                     \
                case DDP_AVG:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        acc[i] = (int64_t)((uint64_t)acc[i] + (uint64_t)(int64_t)x[i]);           \
                    break;                                                                        \
                case DDP_MIN:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        acc[i] = acc[i] < (int64_t)x[i] ? acc[i] : (int64_t)x[i];                 \
                    break;                                                                        \
                case DDP_MAX:                                                                     \
                    for (size_t i = 0; i < n; i++)                                                \
                        acc[i] = acc[i] > (int64_t)x[i] ? acc[i] : (int64_t)x[i];                 \
                    break;                                                                        \
                default:                                                                          \
                    for (size_t i = 0; i < n; i++)                                                \
                        acc[i] = (int64_t)((uint64_t)acc[i] * (uint64_t)(int64_t)x[i]);           \
                    break;                                                                        \
                }                                                                                 \
            }                                                                                     \
            if (a->op == DDP_AVG) {                                                               \
                int64_t div = a->nsrcs;                                                           \
                for (size_t i = 0; i < n; i++) acc[i] = acc[i] / div;                             \
            }                                                                                     \
            T *d0 = (T *)a->dsts[0] + base;                                                       \
            for (size_t i = 0; i < n; i++) d0[i] = (T)acc[i];                                     \
            fan_out(a, base * sizeof(T), n * sizeof(T));                                          \
        }                                                                                         \
    }

INT_KERNEL(reduce_i32, int32_t)
INT_KERNEL(reduce_i64, int64_t)
INT_KERNEL(reduce_u8, uint8_t)

/* ---- dispatch ------------------------------------------------------------------------------- */

typedef void (*kernel_fn)(const reduce_args_t *a);

static kernel_fn kernel_for(ddp_dtype_t dtype)
{
    const int v = ddp__reduce_choose();
    (void)v;
    switch (dtype) {
#if DDP_REDUCE_X86
    case DDP_F32: return v >= 2 ? reduce_f32_avx512 : v ? reduce_f32_avx2 : reduce_f32_base;
    case DDP_F64: return v >= 2 ? reduce_f64_avx512 : v ? reduce_f64_avx2 : reduce_f64_base;
    case DDP_F16: return v >= 2 ? reduce_f16_avx512 : v ? reduce_f16_avx2 : reduce_f16_base;
    case DDP_BF16:
        return v == 3   ? reduce_bf16_avx512_bf16
               : v == 2 ? reduce_bf16_avx512
               : v      ? reduce_bf16_avx2
                        : reduce_bf16_base;
#else
    case DDP_F32: return reduce_f32_base;
    case DDP_F64: return reduce_f64_base;
    case DDP_F16: return reduce_f16_base;
    case DDP_BF16: return reduce_bf16_base;
#endif
    case DDP_I32: return reduce_i32;
    case DDP_I64: return reduce_i64;
    case DDP_U8: return reduce_u8;
    default: return NULL;
    }
}

void ddp__reduce_multi_stream(void *const *dsts, int ndsts, unsigned stream,
                              const void *const *srcs, int nsrcs, size_t count, ddp_dtype_t dtype,
                              ddp_reduce_op_t op)
{
    if (count == 0 || nsrcs < 1 || ndsts < 1) return;
    kernel_fn fn = kernel_for(dtype);
    if (!fn) return;
    reduce_args_t a = {dsts, ndsts, srcs, nsrcs, count, op, stream};
    size_t head = 0, done = stream ? ddp__reduce_sum_streamed(&a, dtype, &head) : 0;
    if (!done) {
        fn(&a);
    } else {
        /* The block kernel takes the head and the tail. */
        if (head) {
            a.count = head;
            fn(&a);
        }
        const size_t from = head + done;
        if (from < count) {
            const void *s2[STREAM_MAX_SRCS];
            void *d2[STREAM_MAX_DSTS];
            const reduce_args_t t =
                reduce_args_from(&a, from, count - from, ddp_dtype_size(dtype), s2, d2);
            fn(&t);
        }
    }
    if (stream) ddp__stream_fence();
}

void ddp__reduce_multi(void *const *dsts, int ndsts, const void *const *srcs, int nsrcs,
                       size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    ddp__reduce_multi_stream(dsts, ndsts, 0, srcs, nsrcs, count, dtype, op);
}

void ddp__reduce(void *dst, const void *const *srcs, int nsrcs, size_t count, ddp_dtype_t dtype,
                 ddp_reduce_op_t op)
{
    void *dsts[1] = {dst};
    ddp__reduce_multi(dsts, 1, srcs, nsrcs, count, dtype, op);
}

/* ---- accumulation types and AVG's division (the rules of reduce.h, written once) ------------ */

ddp_dtype_t ddp__acc_dtype(ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    if (dtype == DDP_F16 || dtype == DDP_BF16) return DDP_F32;
    if (op == DDP_AVG && (dtype == DDP_I32 || dtype == DDP_U8)) return DDP_I64;
    return dtype;
}

void ddp__acc_combine(void *dst, const void *x, const void *y, size_t count, ddp_dtype_t acc_dtype,
                      ddp_reduce_op_t op)
{
    /* The kernels above (vectorised where the CPU allows), two sources in this order. AVG is
     * reduced as SUM: the division happens once, at the end (ddp__acc_finish). */
    const void *srcs[2] = {x, y};
    ddp__reduce(dst, srcs, 2, count, acc_dtype, op == DDP_AVG ? DDP_SUM : op);
}

void ddp__divide_by(void *data, size_t count, ddp_dtype_t dtype, int n)
{
    /* x / w rather than x * (1 / w): the division is exact where the quotient is representable,
     * and every caller must give the same bits as the kernels' in-block AVG. */
    switch (dtype) {
    case DDP_F32: {
        float *x = data, w = (float)n;
        for (size_t i = 0; i < count; i++) x[i] = x[i] / w;
        break;
    }
    case DDP_F64: {
        double *x = data, w = (double)n;
        for (size_t i = 0; i < count; i++) x[i] = x[i] / w;
        break;
    }
    case DDP_F16: {
        uint16_t *x = data;
        float w = (float)n;
        for (size_t i = 0; i < count; i++) x[i] = ddp_f32_to_f16(ddp_f16_to_f32(x[i]) / w);
        break;
    }
    case DDP_BF16: {
        uint16_t *x = data;
        float w = (float)n;
        for (size_t i = 0; i < count; i++) x[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(x[i]) / w);
        break;
    }
    case DDP_I32: {
        int32_t *x = data;
        for (size_t i = 0; i < count; i++) x[i] = x[i] / n;
        break;
    }
    case DDP_I64: {
        int64_t *x = data;
        for (size_t i = 0; i < count; i++) x[i] = x[i] / n;
        break;
    }
    case DDP_U8: {
        uint8_t *x = data;
        for (size_t i = 0; i < count; i++) x[i] = (uint8_t)(x[i] / n);
        break;
    }
    default: break;
    }
}

void ddp__acc_finish(void *out, void *acc, size_t count, ddp_dtype_t dtype, ddp_dtype_t acc_dtype,
                     ddp_reduce_op_t op, int n)
{
    if (op == DDP_AVG) ddp__divide_by(acc, count, acc_dtype, n);
    if (acc_dtype != dtype) ddp__acc_narrow(out, acc, count, dtype);
    else if (out != acc) memcpy(out, acc, count * ddp_dtype_size(dtype));
}

void ddp__acc_widen(void *dst, const void *src, size_t count, ddp_dtype_t dtype)
{
    switch (dtype) {
    case DDP_F16:
    case DDP_BF16: ddp__half_to_f32(dtype, src, dst, count); break;
    case DDP_I32:
        for (size_t i = 0; i < count; i++) ((int64_t *)dst)[i] = ((const int32_t *)src)[i];
        break;
    case DDP_U8:
        for (size_t i = 0; i < count; i++) ((int64_t *)dst)[i] = ((const uint8_t *)src)[i];
        break;
    default: break;
    }
}

void ddp__acc_narrow(void *dst, const void *src, size_t count, ddp_dtype_t dtype)
{
    switch (dtype) {
    case DDP_F16:
    case DDP_BF16: ddp__f32_to_half(dtype, src, dst, count); break;
    case DDP_I32:
        for (size_t i = 0; i < count; i++) ((int32_t *)dst)[i] = (int32_t)((const int64_t *)src)[i];
        break;
    case DDP_U8:
        for (size_t i = 0; i < count; i++) ((uint8_t *)dst)[i] = (uint8_t)((const int64_t *)src)[i];
        break;
    default: break;
    }
}
