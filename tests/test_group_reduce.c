/* The reduction kernels alone (src/core/reduce.c): every dtype x op x number of sources against
 * a float64 reference, f16/bf16 accumulated in f32 and rounded once, AVG dividing once, integer
 * wrap-around, in-place and several destinations, and the baseline and AVX2+F16C variants giving
 * identical bytes (NaN, infinities and subnormals included). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/reduce.h"
#include "harness.h"

static unsigned long long rng = 12345;

static double rnd(void) { return ddp_test_random(&rng); }

static void fill_random(void *buf, ddp_dtype_t dt, size_t n, int specials, double scale)
{
    for (size_t i = 0; i < n; i++) {
        double v = rnd() * scale;
        if (specials && i % 97 == 3) v = INFINITY;
        if (specials && i % 89 == 5) v = NAN;
        if (specials && i % 83 == 7) v = 1e-6; /* subnormal in f16 */
        if (specials && i % 79 == 9) v = -0.0;
        if (specials && i % 73 == 11) v = 3e-39; /* subnormal in f32 and bf16 */
        switch (dt) {
        case DDP_F32: ((float *)buf)[i] = (float)v; break;
        case DDP_F64: ((double *)buf)[i] = v; break;
        case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)v); break;
        case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)v); break;
        case DDP_I32: ((int32_t *)buf)[i] = (int32_t)(rnd() * 2e9); break;
        case DDP_I64: ((int64_t *)buf)[i] = (int64_t)(rnd() * 9e18); break;
        case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)(rnd() * 128 + 128); break;
        default: break;
        }
    }
}

/* Half precision: sequential f16 sums would lose the small terms; f32 accumulation keeps them. */
static void test_rounded_once(void)
{
    uint16_t a = ddp_f32_to_f16(2048.0f), b = ddp_f32_to_f16(1.0f), out;
    const void *srcs[3] = {&a, &b, &b};
    ddp__reduce(&out, srcs, 3, 1, DDP_F16, DDP_SUM);
    CHECK_MSG(ddp_f16_to_f32(out) == 2050.0f, "f16 2048+1+1 = %g, want 2050", ddp_f16_to_f32(out));
    uint16_t c = ddp_f32_to_bf16(256.0f), d = ddp_f32_to_bf16(1.0f), o2;
    const void *s2[3] = {&c, &d, &d};
    ddp__reduce(&o2, s2, 3, 1, DDP_BF16, DDP_SUM);
    CHECK_MSG(ddp_bf16_to_f32(o2) == 258.0f, "bf16 256+1+1 = %g", ddp_bf16_to_f32(o2));
    /* AVG divides once at the end: (1 + 2 + 2) / 3 in f32, rounded to f16 once. */
    uint16_t one = ddp_f32_to_f16(1.0f), two = ddp_f32_to_f16(2.0f), avg;
    const void *s3[3] = {&one, &two, &two};
    ddp__reduce(&avg, s3, 3, 1, DDP_F16, DDP_AVG);
    CHECK(avg == ddp_f32_to_f16(5.0f / 3.0f));
    /* Integer AVG truncates toward zero and does not overflow for i32/u8. */
    int32_t i1 = -1, i2 = -2, iavg;
    const void *s4[2] = {&i1, &i2};
    ddp__reduce(&iavg, s4, 2, 1, DDP_I32, DDP_AVG);
    CHECK(iavg == -1);
    int32_t big = INT32_MAX, bavg;
    const void *s5[2] = {&big, &big};
    ddp__reduce(&bavg, s5, 2, 1, DDP_I32, DDP_AVG);
    CHECK(bavg == INT32_MAX);
    uint8_t u1 = 200, u2 = 100, uavg, usum, uprod;
    const void *s6[2] = {&u1, &u2};
    ddp__reduce(&uavg, s6, 2, 1, DDP_U8, DDP_AVG);
    ddp__reduce(&usum, s6, 2, 1, DDP_U8, DDP_SUM);
    ddp__reduce(&uprod, s6, 2, 1, DDP_U8, DDP_PROD);
    CHECK(uavg == 150 && usum == (uint8_t)300 && uprod == (uint8_t)(20000 & 0xff));
    int32_t w1 = INT32_MAX, w2 = 1, wsum;
    const void *s7[2] = {&w1, &w2};
    ddp__reduce(&wsum, s7, 2, 1, DDP_I32, DDP_SUM);
    CHECK(wsum == INT32_MIN); /* wraps, no undefined behaviour */
}

/* Float types, finite values: compare with a float64 reference within the rounding of the type. */
static void test_against_reference(void)
{
    const size_t sizes[] = {1, 7, 1023, 1024, 1025, 4099};
    const ddp_dtype_t floats[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16};
    for (int k = 1; k <= 5; k++) {
        for (int fi = 0; fi < 4; fi++) {
            ddp_dtype_t dt = floats[fi];
            size_t es = ddp_dtype_size(dt);
            for (int op = 0; op < DDP_OP_COUNT; op++) {
                for (size_t si = 0; si < 6; si++) {
                    size_t n = sizes[si];
                    void *src[5];
                    for (int s = 0; s < k; s++) {
                        src[s] = malloc(n * es);
                        fill_random(src[s], dt, n, 0, op == DDP_PROD ? 2.0 : 100.0);
                    }
                    void *out = malloc(n * es);
                    ddp__reduce(out, (const void *const *)src, k, n, dt, (ddp_reduce_op_t)op);
                    double rel = dt == DDP_F16 ? 2e-3 : dt == DDP_BF16 ? 1.6e-2 : dt == DDP_F32 ? 1e-6 : 1e-14;
                    for (size_t i = 0; i < n; i++) {
                        double acc = ddp_test_get(dt, src[0], i);
                        double mag = fabs(acc);
                        for (int s = 1; s < k; s++) {
                            double x = ddp_test_get(dt, src[s], i);
                            mag += fabs(x);
                            acc = ddp_test_fold((ddp_reduce_op_t)op, acc, x);
                        }
                        if (op == DDP_AVG) acc /= k, mag /= k;
                        if (op == DDP_PROD) mag = fabs(acc);
                        double got = ddp_test_get(dt, out, i);
                        double tol = rel * (mag > 1e-3 ? mag : 1e-3) * (op == DDP_PROD ? k : 1);
                        CHECK_MSG(fabs(got - acc) <= tol, "%s %s k=%d n=%zu [%zu]: %.9g vs %.9g",
                                  ddp_dtype_name(dt), ddp_reduce_op_name((ddp_reduce_op_t)op), k, n, i, got, acc);
                    }
                    for (int s = 0; s < k; s++) free(src[s]);
                    free(out);
                }
            }
        }
    }
}

/* Which vectorised variants (bit v) this CPU let test_variants_and_aliasing compare. */
static int variants_compared;

/* In place (destination = a source, any position) and several destinations give the same bytes
 * as out of place; every kernel variant the CPU has gives the baseline's bytes, specials
 * (infinities, NaNs, subnormals, -0) included. */
static void test_variants_and_aliasing(void)
{
    size_t n = 5000;
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (int op = 0; op < DDP_OP_COUNT; op++) {
            for (int k = 1; k <= 4; k++) {
                void *src[4], *copy[4];
                for (int s = 0; s < k; s++) {
                    src[s] = malloc(n * es);
                    copy[s] = malloc(n * es);
                    fill_random(src[s], (ddp_dtype_t)dt, n, 1, 100.0);
                }
                void *ref = malloc(n * es), *alt = malloc(n * es), *d2 = malloc(n * es);
                ddp__reduce_force_variant(0);
                ddp__reduce(ref, (const void *const *)src, k, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                for (int v = 1; v <= DDP__REDUCE_VARIANT_MAX; v++) {
                    if (ddp__reduce_force_variant(v) != 0) continue; /* not on this CPU */
                    variants_compared |= 1 << v;
                    ddp__reduce(alt, (const void *const *)src, k, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                    CHECK_MSG(memcmp(ref, alt, n * es) == 0, "variant %d differs from baseline: %s %s k=%d",
                              v, ddp_dtype_name((ddp_dtype_t)dt), ddp_reduce_op_name((ddp_reduce_op_t)op), k);
                }
                ddp__reduce_force_variant(-1);
                for (int pos = 0; pos < k; pos++) {
                    for (int s = 0; s < k; s++) memcpy(copy[s], src[s], n * es);
                    void *dsts[2] = {copy[pos], d2};
                    ddp__reduce_multi(dsts, 2, (const void *const *)copy, k, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                    CHECK_MSG(memcmp(copy[pos], ref, n * es) == 0 && memcmp(d2, ref, n * es) == 0,
                              "in place at source %d differs: %s %s k=%d", pos,
                              ddp_dtype_name((ddp_dtype_t)dt), ddp_reduce_op_name((ddp_reduce_op_t)op), k);
                }
                for (int s = 0; s < k; s++) {
                    free(src[s]);
                    free(copy[s]);
                }
                free(ref);
                free(alt);
                free(d2);
            }
        }
    }
}

/* Streamed destinations (ddp__reduce_multi_stream, all of them non-temporal: the large
 * allreduce's case, with a register kernel of its own for f32 SUM and AVG) give the baseline's
 * bytes in every variant: destinations at every alignment, equal or not, in place, counts with
 * a head before the alignment and a tail after the 4-page groups. */
static void test_streamed(void)
{
    const size_t counts[] = {1, 31, 64, 4096 + 77, 3 * 4096 + 33, 40000};
    const size_t pad = 32;
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (int op = 0; op < DDP_OP_COUNT; op++) {
            for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
                size_t n = counts[ci];
                int k = 1 + (int)((ci + (size_t)op) % 4), nd = 1 + (int)((ci + (size_t)dt) % 3);
                void *src[4];
                for (int s = 0; s < k; s++) {
                    src[s] = malloc(n * es);
                    fill_random(src[s], (ddp_dtype_t)dt, n, 1, 100.0);
                }
                void *ref = malloc(n * es);
                ddp__reduce_force_variant(0);
                ddp__reduce(ref, (const void *const *)src, k, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                char *area[3];
                /* aligned_alloc wants a size that is a multiple of the alignment */
                const size_t area_bytes = ((n + 2 * pad) * es + 64 + 63) / 64 * 64;
                for (int d = 0; d < 3; d++) area[d] = aligned_alloc(64, area_bytes);
                for (int v = 0; v <= DDP__REDUCE_VARIANT_MAX; v++) {
                    if (ddp__reduce_force_variant(v) != 0) continue;
                    for (size_t shift = 0; shift < 17; shift += 5) {
                        void *dsts[3];
                        for (int d = 0; d < nd; d++)
                            /* equal alignment, then (shift 5 and 15) unequal */
                            dsts[d] = area[d] + (shift + (shift % 2 ? (size_t)d : 0)) * es;
                        ddp__reduce_multi_stream(dsts, nd, (1u << nd) - 1u, (const void *const *)src,
                                                 k, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                        for (int d = 0; d < nd; d++)
                            CHECK_MSG(memcmp(dsts[d], ref, n * es) == 0,
                                      "streamed, variant %d: %s %s k=%d n=%zu dst %d shift %zu "
                                      "differs from the baseline", v,
                                      ddp_dtype_name((ddp_dtype_t)dt),
                                      ddp_reduce_op_name((ddp_reduce_op_t)op), k, n, d, shift);
                    }
                    /* In place: destination 0 is the last source. */
                    void *copy = malloc(n * es);
                    memcpy(copy, src[k - 1], n * es);
                    void *srcs2[4];
                    for (int s = 0; s < k; s++) srcs2[s] = s == k - 1 ? copy : src[s];
                    void *dsts[1] = {copy};
                    ddp__reduce_multi_stream(dsts, 1, 1u, (const void *const *)srcs2, k, n,
                                             (ddp_dtype_t)dt, (ddp_reduce_op_t)op);
                    CHECK_MSG(memcmp(copy, ref, n * es) == 0,
                              "streamed in place, variant %d: %s %s k=%d n=%zu differs", v,
                              ddp_dtype_name((ddp_dtype_t)dt),
                              ddp_reduce_op_name((ddp_reduce_op_t)op), k, n);
                    free(copy);
                }
                ddp__reduce_force_variant(-1);
                for (int d = 0; d < 3; d++) free(area[d]);
                for (int s = 0; s < k; s++) free(src[s]);
                free(ref);
            }
        }
    }
}

/* ddp__copy_stream copies exactly [dst, dst + bytes) in every variant: sizes around the
 * 1 KiB, 128-byte and 16 KiB (4-page) steps, source and destination at every offset mod 64. */
static void test_copy_stream(void)
{
    const size_t sizes[] = {0, 1, 255, 256, 1023, 1024, 1025, 4096 + 127, 16384, 16384 + 129,
                            3 * 16384 + 4095, 200000};
    const size_t guard = 64, most = 200000 + 2 * guard + 64; /* a multiple of 64 */
    unsigned char *src = aligned_alloc(64, most), *dst = aligned_alloc(64, most);
    for (size_t i = 0; i < most; i++) src[i] = (unsigned char)(i * 131 + 7);
    for (int v = 0; v <= DDP__REDUCE_VARIANT_MAX; v++) {
        if (ddp__reduce_force_variant(v) != 0) continue;
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            for (size_t so = 0; so < 64; so += 13) {
                for (size_t dof = 0; dof < 64; dof += 9) {
                    size_t n = sizes[si];
                    memset(dst, 0xee, most);
                    ddp__copy_stream(dst + guard + dof, src + so, n);
                    CHECK_MSG(memcmp(dst + guard + dof, src + so, n) == 0,
                              "copy_stream, variant %d: %zu bytes from offset %zu to %zu differ",
                              v, n, so, dof);
                    for (size_t i = 0; i < guard + dof; i++)
                        CHECK_MSG(dst[i] == 0xee, "copy_stream wrote before its destination");
                    for (size_t i = guard + dof + n; i < most; i++)
                        CHECK_MSG(dst[i] == 0xee, "copy_stream, variant %d, %zu bytes: wrote "
                                  "byte %zu after its destination", v, n, i - guard - dof - n);
                }
            }
        }
    }
    ddp__reduce_force_variant(-1);
    free(src);
    free(dst);
}

int main(void)
{
    printf("reduce kernels: %s\n", ddp__reduce_variant());
    test_rounded_once();
    test_against_reference();
    test_variants_and_aliasing();
    test_streamed();
    test_copy_stream();
    printf("variants compared with the baseline:%s%s%s\n",
           variants_compared & 2 ? " avx2+f16c" : "", variants_compared & 4 ? " avx512" : "",
           variants_compared & 8 ? " avx512+bf16" : "");
    printf("test_group_reduce: ok\n");
    return 0;
}
