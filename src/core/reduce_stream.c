/* Streamed stores (see reduce.h): the register kernels for f32 and bf16 sums whose every
 * destination is written with non-temporal stores, and the non-temporal copies. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "core/reduce_kernels.h"

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

/* The walk every loop here takes over [0, n) in units of `step` (n a multiple of it): groups of
 * STREAM_PAGES runs of `page` units, one step of each run in turn, then the rest in order.
 * STEP(args..., offset) does one step. */
#define STREAM_WALK(n, step, page, STEP, ...)                                                     \
    do {                                                                                          \
        const size_t group_ = STREAM_PAGES * (page);                                              \
        size_t i_ = 0;                                                                            \
        for (; i_ + group_ <= (n); i_ += group_)                                                  \
            for (size_t o_ = 0; o_ < (page); o_ += (step))                                        \
                for (size_t k_ = 0; k_ < STREAM_PAGES; k_++)                                      \
                    STEP(__VA_ARGS__, i_ + k_ * (page) + o_);                                     \
        for (; i_ < (n); i_ += (step)) STEP(__VA_ARGS__, i_);                                     \
    } while (0)

#if DDP_REDUCE_X86
#define SUM_STREAM_KERNEL(NAME, ATTR, VEC, LANES, LOAD, ADD, DIV, SET1, STORE)                   \
    ATTR static inline __attribute__((always_inline)) void NAME##_step(                            \
        const reduce_args_t *a, int avg, VEC div, size_t i)                                       \
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
        STREAM_WALK(n, 2 * LANES, STREAM_PAGE_BYTES / sizeof(float), NAME##_step, a, avg, div);  \
    }

SUM_STREAM_KERNEL(sum_f32_stream_avx512, DDP_TARGET_AVX512, __m512, 16, _mm512_loadu_ps,
                  _mm512_add_ps, _mm512_div_ps, _mm512_set1_ps, _mm512_stream_ps)
SUM_STREAM_KERNEL(sum_f32_stream_avx2, DDP_TARGET_AVX2, __m256, 8, _mm256_loadu_ps,
                  _mm256_add_ps, _mm256_div_ps, _mm256_set1_ps, _mm256_stream_ps)

/* bf16 (AVX-512 only): 16 elements widened to f32 (exact), summed in f32 in source order, AVG
 * divided once, rounded to nearest even with NaNs kept quiet (bf16x16_narrow, or the same bits
 * from VCVTNEPS2BF16 with AVX-512 BF16). 32 elements (one 64-byte line) per step. */
#define BF16_STREAM_KERNEL(NAME, ATTR, NARROW)                                                    \
    ATTR static inline __attribute__((always_inline)) void NAME##_step(                            \
        const reduce_args_t *a, int avg, __m512 div, size_t i)                                    \
    {                                                                                             \
        const uint16_t *s0 = (const uint16_t *)a->srcs[0] + i;                                    \
        __m512 x0 = bf16x16_widen(s0), x1 = bf16x16_widen(s0 + 16);                               \
        _mm_prefetch((const char *)s0 + 512, _MM_HINT_T0);                                        \
        for (int s = 1; s < a->nsrcs; s++) {                                                      \
            const uint16_t *p = (const uint16_t *)a->srcs[s] + i;                                 \
            _mm_prefetch((const char *)p + 512, _MM_HINT_T0);                                     \
            x0 = _mm512_add_ps(x0, bf16x16_widen(p));                                             \
            x1 = _mm512_add_ps(x1, bf16x16_widen(p + 16));                                        \
        }                                                                                         \
        if (avg) {                                                                                \
            x0 = _mm512_div_ps(x0, div);                                                          \
            x1 = _mm512_div_ps(x1, div);                                                          \
        }                                                                                         \
        const __m512i line =                                                                      \
            _mm512_inserti64x4(_mm512_castsi256_si512(NARROW(x0)), NARROW(x1), 1);                \
        for (int d = 0; d < a->ndsts; d++)                                                        \
            _mm512_stream_si512((__m512i *)((uint16_t *)a->dsts[d] + i), line);                   \
    }                                                                                             \
    ATTR static void NAME(const reduce_args_t *a, size_t n)                                       \
    {                                                                                             \
        const int avg = a->op == DDP_AVG;                                                         \
        const __m512 div = _mm512_set1_ps((float)a->nsrcs);                                       \
        STREAM_WALK(n, 32, STREAM_PAGE_BYTES / sizeof(uint16_t), NAME##_step, a, avg, div);      \
    }

BF16_STREAM_KERNEL(sum_bf16_stream_avx512, DDP_TARGET_AVX512, bf16x16_narrow)
BF16_STREAM_KERNEL(sum_bf16_stream_avx512_bf16, DDP_TARGET_AVX512_BF16, bf16x16_narrow_native)
#endif

/* The register kernels on what they can take of a (f32 or, with AVX-512, bf16; SUM or AVG;
 * every destination streamed and all equally aligned): returns how many elements they did, from
 * element *head on (the elements before the destinations' vector alignment are left to the
 * block kernel), or 0. */
size_t ddp__reduce_sum_streamed(const reduce_args_t *a, ddp_dtype_t dtype, size_t *head)
{
    *head = 0;
#if DDP_REDUCE_X86
    const int v = ddp__reduce_choose();
    const unsigned every = a->ndsts >= 32 ? ~0u : (1u << a->ndsts) - 1u;
    if (v == 0 || !(dtype == DDP_F32 || (dtype == DDP_BF16 && v >= 2)) ||
        (a->op != DDP_SUM && a->op != DDP_AVG) || a->nsrcs > STREAM_MAX_SRCS ||
        a->ndsts > STREAM_MAX_DSTS || (a->stream & every) != every)
        return 0;
    const size_t esize = dtype == DDP_F32 ? 4 : 2, align = v >= 2 ? 64 : 32;
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
    const reduce_args_t b = reduce_args_from(a, h, n, esize, srcs, dsts);
    if (dtype == DDP_BF16 && v == 3) sum_bf16_stream_avx512_bf16(&b, n);
    else if (dtype == DDP_BF16) sum_bf16_stream_avx512(&b, n);
    else if (v >= 2) sum_f32_stream_avx512(&b, n);
    else sum_f32_stream_avx2(&b, n);
    *head = h;
    return n;
#else
    (void)a;
    (void)dtype;
    return 0;
#endif
}

/* ---- non-temporal copies -------------------------------------------------------------------- */

#if DDP_REDUCE_X86
/* Whole vectors as the register kernels store them, 4 pages side by side (see above): on the
 * Intel Xeon of issue #27, both cores copying 128 MiB at once, 10.1-10.6 GB/s each against
 * 8.0-8.6 for 16-byte stores in one stream and 9.7-10.2 for glibc's memcpy. */
#define COPY_STREAM_KERNEL(NAME, ATTR, VEC, LOAD, STORE)                                          \
    ATTR static inline __attribute__((always_inline)) void NAME##_step(char *d, const char *s,    \
                                                                         size_t i)                \
    {                                                                                             \
        d += i;                                                                                   \
        s += i;                                                                                   \
        _mm_prefetch(s + 512, _MM_HINT_T0);                                                       \
        _mm_prefetch(s + 576, _MM_HINT_T0);                                                       \
        for (size_t v = 0; v < 128; v += sizeof(VEC)) STORE((VEC *)(d + v), LOAD((const VEC *)(s + v))); \
    }                                                                                             \
    /* bytes a multiple of 128, d aligned to the vector. */                                       \
    ATTR static void NAME(char *d, const char *s, size_t bytes)                                   \
    {                                                                                             \
        STREAM_WALK(bytes, 128, STREAM_PAGE_BYTES, NAME##_step, d, s);                            \
    }

COPY_STREAM_KERNEL(copy_stream_avx512, DDP_TARGET_AVX512, __m512i, _mm512_loadu_si512,
                   _mm512_stream_si512)
COPY_STREAM_KERNEL(copy_stream_avx2, DDP_TARGET_AVX2, __m256i, _mm256_loadu_si256,
                   _mm256_stream_si256)
#endif

void ddp__copy_stream_nofence(void *dst, const void *src, size_t bytes)
{
#if DDP_REDUCE_X86
    const int v = ddp__reduce_choose();
    if (v > 0 && bytes >= 1024) {
        const size_t align = v >= 2 ? 64 : 32;
        char *d = dst;
        const char *s = src;
        size_t head = (align - ((uintptr_t)d & (align - 1))) & (align - 1);
        memcpy(d, s, head);
        d += head;
        s += head;
        bytes -= head;
        size_t body = bytes & ~(size_t)127;
        if (v >= 2) copy_stream_avx512(d, s, body);
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
