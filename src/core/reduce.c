/* Reduction kernels: dst = op over k sources, for every dtype and op (see reduce.h).
 *
 * How: the data is processed in blocks of BLOCK elements. For each block, source 0 is loaded into
 * a small accumulator that stays in L1, every further source is combined into it in order, AVG
 * divides once, and the finished block is written to each destination. Because a whole block is
 * read from every source before any destination byte of that block is written, a destination may
 * be one of the sources (in place). Every loop is a plain element-wise loop over arrays the
 * compiler vectorises; the same loops are compiled three times, for baseline x86-64, with
 * target("avx2,f16c") (F16C converts halves eight at a time) and with AVX-512 F/BW/VL as well
 * (opmasks and a narrowing move make bf16's rounding half as many instructions), and the variant
 * is chosen once at run time. Element-wise IEEE operations give the same bits at any vector
 * width and no FMA is used (no loop multiplies and adds in one expression), so every variant
 * produces identical results. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "core/cpu.h"
#include "core/half.h"
#include "core/internal.h"
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

#define BLOCK 1024
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

static _Atomic int kernels_chosen = -1; /* -1 unknown, else a variant (reduce.h) */

static int best_variant(void)
{
#if DDP_REDUCE_X86
    if (ddp__cpu_has_avx512()) return 2;
    if (ddp__cpu_has_avx2_f16c()) return 1;
#endif
    return 0;
}

static int choose(void)
{
    int v = atomic_load_explicit(&kernels_chosen, memory_order_relaxed);
    if (v >= 0) return v;
    v = best_variant();
    atomic_store_explicit(&kernels_chosen, v, memory_order_relaxed);
    return v;
}

const char *ddp__reduce_variant(void)
{
    static const char *const names[] = {"baseline", "avx2+f16c", "avx512"};
    return names[choose()];
}

int ddp__reduce_force_variant(int variant)
{
    atomic_store_explicit(&kernels_chosen, -1, memory_order_relaxed);
    if (variant < 0) return 0;
    if (variant > best_variant()) return -1;
    atomic_store_explicit(&kernels_chosen, variant, memory_order_relaxed);
    return 0;
}

static kernel_fn kernel_for(ddp_dtype_t dtype)
{
    const int v = choose();
    (void)v;
    switch (dtype) {
#if DDP_REDUCE_X86
    case DDP_F32: return v == 2 ? reduce_f32_avx512 : v ? reduce_f32_avx2 : reduce_f32_base;
    case DDP_F64: return v == 2 ? reduce_f64_avx512 : v ? reduce_f64_avx2 : reduce_f64_base;
    case DDP_F16: return v == 2 ? reduce_f16_avx512 : v ? reduce_f16_avx2 : reduce_f16_base;
    case DDP_BF16: return v == 2 ? reduce_bf16_avx512 : v ? reduce_bf16_avx2 : reduce_bf16_base;
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

/* ---- f32 and bf16 sums streamed to every destination ---------------------------------------
 * The streamed results of a large allreduce (every destination written with non-temporal
 * stores) go to memory at the rate of the loop that writes them. The block kernels above finish
 * a block in L1 and then stream it to one destination after another, 16 bytes a store: on the
 * Intel Xeon of issue #27 that moved 6.5-7.3 GB/s per core where two cores' memcpy moves 9-10
 * (2 ranks, 128 MiB, both cores at once, cma-probe's "reduce streamed" against "memcpy x2").
 * Here each 128 bytes of every source are summed in registers and stored at once to every
 * destination in whole lines, and STREAM_PAGES 4 KiB pages are walked side by side, as glibc's
 * large memcpy does, so that more sequential streams are in flight for the hardware
 * prefetchers: 9.5-10.5 GB/s in the same test, at or above memcpy's. The sums are the block
 * kernels' (source 0, then + each next source in order, AVG divided once at the end), so the
 * bits are the same whichever kernel ran. */
#define STREAM_PAGES 4
#define STREAM_PAGE_BYTES 4096
#define STREAM_MAX_SRCS 16
#define STREAM_MAX_DSTS 32

#if DDP_REDUCE_X86
#define SUM_STREAM_KERNEL(NAME, ATTR, VEC, LANES, LOAD, ADD, DIV, SET1, STORE)                   \
    ATTR static inline __attribute__((always_inline)) void NAME##_step(                            \
        const reduce_args_t *a, size_t i, int avg, VEC div)                                       \
    {                                                                                             \
        const float *s0 = (const float *)a->srcs[0] + i;                                          \
        VEC x0 = LOAD(s0), x1 = LOAD(s0 + LANES);                                                 \
        _mm_prefetch((const char *)s0 + 512, _MM_HINT_T0);                                        \
        for (int s = 1; s < a->nsrcs; s++) {                                                      \
            const float *p = (const float *)a->srcs[s] + i;                                       \
            _mm_prefetch((const char *)p + 512, _MM_HINT_T0);                                     \
            x0 = ADD(x0, LOAD(p));                                                                \
            x1 = ADD(x1, LOAD(p + LANES));                                                        \
        }                                                                                         \
        if (avg) {                                                                                \
            x0 = DIV(x0, div);                                                                    \
            x1 = DIV(x1, div);                                                                    \
        }                                                                                         \
        for (int d = 0; d < a->ndsts; d++) {                                                      \
            float *q = (float *)a->dsts[d] + i;                                                   \
            STORE(q, x0);                                                                         \
            STORE(q + LANES, x1);                                                                 \
        }                                                                                         \
    }                                                                                             \
    /* Elements [0, n), n a multiple of 2 * LANES, every destination aligned to the vector. */   \
    ATTR static void NAME(const reduce_args_t *a, size_t n)                                       \
    {                                                                                             \
        const int avg = a->op == DDP_AVG;                                                         \
        const VEC div = SET1((float)a->nsrcs);                                                    \
        const size_t step = 2 * LANES, page = STREAM_PAGE_BYTES / sizeof(float);                 \
        const size_t group = STREAM_PAGES * page;                                                 \
        size_t i = 0;                                                                             \
        for (; i + group <= n; i += group)                                                        \
            for (size_t o = 0; o < page; o += step)                                               \
                for (size_t k = 0; k < STREAM_PAGES; k++)                                         \
                    NAME##_step(a, i + k * page + o, avg, div);                                   \
        for (; i < n; i += step) NAME##_step(a, i, avg, div);                                     \
    }

SUM_STREAM_KERNEL(sum_f32_stream_avx512, DDP_TARGET_AVX512, __m512, 16, _mm512_loadu_ps,
                  _mm512_add_ps, _mm512_div_ps, _mm512_set1_ps, _mm512_stream_ps)
SUM_STREAM_KERNEL(sum_f32_stream_avx2, DDP_TARGET_AVX2, __m256, 8, _mm256_loadu_ps,
                  _mm256_add_ps, _mm256_div_ps, _mm256_set1_ps, _mm256_stream_ps)

/* bf16 (AVX-512 only): 16 elements widened to f32 (exact), summed in f32 in source order, AVG
 * divided once, rounded to nearest even with NaNs kept quiet: f32_to_bf16_inline, sixteen at a
 * time. 32 elements (one 64-byte line) per step. */
DDP_TARGET_AVX512 INLINE __m512 bf16x16_widen(const uint16_t *p)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
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

DDP_TARGET_AVX512 INLINE void sum_bf16_stream_avx512_step(const reduce_args_t *a, size_t i,
                                                          int avg, __m512 div)
{
    const uint16_t *s0 = (const uint16_t *)a->srcs[0] + i;
    __m512 x0 = bf16x16_widen(s0), x1 = bf16x16_widen(s0 + 16);
    _mm_prefetch((const char *)s0 + 512, _MM_HINT_T0);
    for (int s = 1; s < a->nsrcs; s++) {
        const uint16_t *p = (const uint16_t *)a->srcs[s] + i;
        _mm_prefetch((const char *)p + 512, _MM_HINT_T0);
        x0 = _mm512_add_ps(x0, bf16x16_widen(p));
        x1 = _mm512_add_ps(x1, bf16x16_widen(p + 16));
    }
    if (avg) {
        x0 = _mm512_div_ps(x0, div);
        x1 = _mm512_div_ps(x1, div);
    }
    const __m512i line =
        _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16_narrow(x0)), bf16x16_narrow(x1), 1);
    for (int d = 0; d < a->ndsts; d++)
        _mm512_stream_si512((__m512i *)((uint16_t *)a->dsts[d] + i), line);
}

DDP_TARGET_AVX512 static void sum_bf16_stream_avx512(const reduce_args_t *a, size_t n)
{
    const int avg = a->op == DDP_AVG;
    const __m512 div = _mm512_set1_ps((float)a->nsrcs);
    const size_t step = 32, page = STREAM_PAGE_BYTES / sizeof(uint16_t);
    const size_t group = STREAM_PAGES * page;
    size_t i = 0;
    for (; i + group <= n; i += group)
        for (size_t o = 0; o < page; o += step)
            for (size_t k = 0; k < STREAM_PAGES; k++)
                sum_bf16_stream_avx512_step(a, i + k * page + o, avg, div);
    for (; i < n; i += step) sum_bf16_stream_avx512_step(a, i, avg, div);
}
#endif

/* The register kernels on what they can take of a (f32 or, with AVX-512, bf16; SUM or AVG;
 * every destination streamed and all equally aligned): returns how many elements they did, from
 * element *head on (the elements before the destinations' vector alignment are left to the
 * block kernel), or 0. */
static size_t sum_streamed(const reduce_args_t *a, ddp_dtype_t dtype, size_t *head)
{
    *head = 0;
#if DDP_REDUCE_X86
    const int v = choose();
    const unsigned every = a->ndsts >= 32 ? ~0u : (1u << a->ndsts) - 1u;
    if (v == 0 || !(dtype == DDP_F32 || (dtype == DDP_BF16 && v == 2)) ||
        (a->op != DDP_SUM && a->op != DDP_AVG) || a->nsrcs > STREAM_MAX_SRCS ||
        a->ndsts > STREAM_MAX_DSTS || (a->stream & every) != every)
        return 0;
    const size_t esize = dtype == DDP_F32 ? 4 : 2, align = v == 2 ? 64 : 32;
    const size_t step = (dtype == DDP_F32 ? 2 * align : align) / esize;
    const uintptr_t mis = (uintptr_t)a->dsts[0] % align;
    if (mis % esize) return 0;
    for (int d = 1; d < a->ndsts; d++)
        if ((uintptr_t)a->dsts[d] % align != mis) return 0;
    const size_t h = mis ? (align - mis) / esize : 0;
    if (h >= a->count || a->count - h < step) return 0;
    const size_t n = (a->count - h) / step * step;
    const void *srcs[STREAM_MAX_SRCS];
    void *dsts[STREAM_MAX_DSTS];
    for (int s = 0; s < a->nsrcs; s++) srcs[s] = (const char *)a->srcs[s] + h * esize;
    for (int d = 0; d < a->ndsts; d++) dsts[d] = (char *)a->dsts[d] + h * esize;
    reduce_args_t b = *a;
    b.srcs = srcs;
    b.dsts = dsts;
    if (dtype == DDP_BF16) sum_bf16_stream_avx512(&b, n);
    else if (v == 2) sum_f32_stream_avx512(&b, n);
    else sum_f32_stream_avx2(&b, n);
    *head = h;
    return n;
#else
    (void)a;
    (void)dtype;
    return 0;
#endif
}

void ddp__reduce_multi_stream(void *const *dsts, int ndsts, unsigned stream,
                              const void *const *srcs, int nsrcs, size_t count, ddp_dtype_t dtype,
                              ddp_reduce_op_t op)
{
    if (count == 0 || nsrcs < 1 || ndsts < 1) return;
    kernel_fn fn = kernel_for(dtype);
    if (!fn) return;
    reduce_args_t a = {dsts, ndsts, srcs, nsrcs, count, op, stream};
    size_t head = 0, done = stream ? sum_streamed(&a, dtype, &head) : 0;
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
            const size_t skip = from * ddp_dtype_size(dtype);
            for (int s = 0; s < nsrcs; s++) s2[s] = (const char *)srcs[s] + skip;
            for (int d = 0; d < ndsts; d++) d2[d] = (char *)dsts[d] + skip;
            reduce_args_t t = {d2, ndsts, s2, nsrcs, count - from, op, stream};
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

/* ---- non-temporal copies -------------------------------------------------------------------- */

#if DDP_REDUCE_X86
/* Whole vectors as the register kernels store them, 4 pages side by side (see above): on the
 * Intel Xeon of issue #27, both cores copying 128 MiB at once, 10.1-10.6 GB/s each against
 * 8.0-8.6 for 16-byte stores in one stream and 9.7-10.2 for glibc's memcpy. */
#define COPY_STREAM_KERNEL(NAME, ATTR, VEC, LOAD, STORE)                                          \
    ATTR static inline __attribute__((always_inline)) void NAME##_step(char *d, const char *s)    \
    {                                                                                             \
        _mm_prefetch(s + 512, _MM_HINT_T0);                                                       \
        _mm_prefetch(s + 576, _MM_HINT_T0);                                                       \
        for (size_t v = 0; v < 128; v += sizeof(VEC)) STORE((VEC *)(d + v), LOAD((const VEC *)(s + v))); \
    }                                                                                             \
    /* bytes a multiple of 128, d aligned to the vector. */                                       \
    ATTR static void NAME(char *d, const char *s, size_t bytes)                                   \
    {                                                                                             \
        const size_t group = STREAM_PAGES * STREAM_PAGE_BYTES;                                    \
        size_t i = 0;                                                                             \
        for (; i + group <= bytes; i += group)                                                    \
            for (size_t o = 0; o < STREAM_PAGE_BYTES; o += 128)                                   \
                for (size_t k = 0; k < STREAM_PAGES; k++)                                         \
                    NAME##_step(d + i + k * STREAM_PAGE_BYTES + o, s + i + k * STREAM_PAGE_BYTES + o); \
        for (; i < bytes; i += 128) NAME##_step(d + i, s + i);                                    \
    }

COPY_STREAM_KERNEL(copy_stream_avx512, DDP_TARGET_AVX512, __m512i, _mm512_loadu_si512,
                   _mm512_stream_si512)
COPY_STREAM_KERNEL(copy_stream_avx2, DDP_TARGET_AVX2, __m256i, _mm256_loadu_si256,
                   _mm256_stream_si256)
#endif

void ddp__copy_stream_nofence(void *dst, const void *src, size_t bytes)
{
#if DDP_REDUCE_X86
    const int v = choose();
    if (v > 0 && bytes >= 1024) {
        const size_t align = v == 2 ? 64 : 32;
        char *d = dst;
        const char *s = src;
        size_t head = (align - ((uintptr_t)d & (align - 1))) & (align - 1);
        memcpy(d, s, head);
        d += head;
        s += head;
        bytes -= head;
        size_t body = bytes & ~(size_t)127;
        if (v == 2) copy_stream_avx512(d, s, body);
        else copy_stream_avx2(d, s, body);
        memcpy(d + body, s + body, bytes - body);
        return;
    }
    if (bytes >= 256) {
        char *d = dst;
        const char *s = src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        bytes -= head;
        size_t body = bytes & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), x0);
            _mm_stream_si128((__m128i *)(d + i + 16), x1);
            _mm_stream_si128((__m128i *)(d + i + 32), x2);
            _mm_stream_si128((__m128i *)(d + i + 48), x3);
        }
        memcpy(d + body, s + body, bytes - body);
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

void ddp__stream_fence(void)
{
#if DDP_REDUCE_X86
    _mm_sfence();
#else
    atomic_thread_fence(memory_order_seq_cst);
#endif
}

void ddp__copy_stream(void *dst, const void *src, size_t bytes)
{
    ddp__copy_stream_nofence(dst, src, bytes);
    ddp__stream_fence();
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
