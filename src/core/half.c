/* Bulk half-precision conversions. They run on every element twice per half-precision
 * reduction, so they must cost less than the halved traffic saves: f16 uses F16C (eight
 * elements per instruction, round to nearest even like the scalar ddp_f32_to_f16) when the CPU
 * has it; bf16 uses AVX-512 (sixteen at a time, rounded by VCVTNEPS2BF16 with the scalar's bits
 * where the CPU has AVX-512 BF16: reduce_kernels.h), else a few integer operations the compiler
 * vectorises. */
#include <string.h>

#include "core/cpu.h"
#include "core/half.h"
#include "core/internal.h"
#include "core/reduce_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HALF_HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static size_t f32_to_f16_f16c(const float *in, uint16_t *out,
                                                                  size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

__attribute__((target("avx,f16c"))) static size_t f16_to_f32_f16c(const uint16_t *in, float *out,
                                                                  size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    return i;
}

DDP_TARGET_AVX512_BF16 static size_t f32_to_bf16_avx512_bf16(const float *in, uint16_t *out,
                                                             size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16_narrow_native(_mm512_loadu_ps(in + i)));
    return i;
}

DDP_TARGET_AVX512 static size_t bf16_to_f32_avx512(const uint16_t *in, float *out, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, bf16x16_widen(in + i));
    return i;
}
#endif

void ddp__f32_to_half(ddp_dtype_t half, const float *src, uint16_t *dst, size_t n)
{
    size_t i = 0;
    if (half == DDP_BF16) {
#ifdef HALF_HAVE_F16C_PATH
        if (ddp__cpu_has_avx512_bf16()) i = f32_to_bf16_avx512_bf16(src, dst, n);
#endif
        for (; i < n; i++) {
            uint32_t u;
            memcpy(&u, &src[i], sizeof u); /* the aliasing-safe bit cast */
            uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            /* NaN stays a quiet NaN instead of rounding into infinity. */
            dst[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
        }
        return;
    }
#ifdef HALF_HAVE_F16C_PATH
    if (ddp__cpu_has_avx_f16c()) i = f32_to_f16_f16c(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ddp_f32_to_f16(src[i]);
}

void ddp__half_to_f32(ddp_dtype_t half, const uint16_t *src, float *dst, size_t n)
{
    size_t i = 0;
    if (half == DDP_BF16) {
#ifdef HALF_HAVE_F16C_PATH
        if (ddp__cpu_has_avx512()) i = bf16_to_f32_avx512(src, dst, n);
#endif
        for (; i < n; i++) {
            uint32_t u = (uint32_t)src[i] << 16;
            memcpy(&dst[i], &u, sizeof u);
        }
        return;
    }
#ifdef HALF_HAVE_F16C_PATH
    if (ddp__cpu_has_avx_f16c()) i = f16_to_f32_f16c(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = ddp_f16_to_f32(src[i]);
}
