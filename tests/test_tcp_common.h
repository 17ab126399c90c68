/* Helpers shared by the TCP transport tests: deterministic inputs per rank, a float64 reference,
 * tolerant comparison per dtype and a hash for bitwise comparisons across ranks. */
#ifndef DDP_TEST_TCP_COMMON_H
#define DDP_TEST_TCP_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"

/* Input element i of `rank` as a double, already representable in dtype (so the reference
 * starts from exactly what the rank sends). Integers are small; products over many ranks wrap,
 * and the reference wraps the same way. */
static double tcp_test_value(ddp_dtype_t dt, int rank, size_t i, unsigned salt)
{
    unsigned long long st = (unsigned long long)rank * 1000003ULL + i * 7919ULL + salt * 104729ULL;
    double x = ddp_test_random(&st);
    switch (dt) {
    case DDP_F32: return (double)(float)x;
    case DDP_F64: return x;
    case DDP_F16: return (double)ddp_f16_to_f32(ddp_f32_to_f16((float)x));
    case DDP_BF16: return (double)ddp_bf16_to_f32(ddp_f32_to_bf16((float)x));
    case DDP_I32: return (double)(long long)(x * 40.0);
    case DDP_I64: return (double)(long long)(x * 40.0);
    case DDP_U8: return (double)(long long)((x + 1.0) * 1.9); /* 0..3 */
    default: return 0;
    }
}

static int tcp_test_is_int(ddp_dtype_t dt) { return dt == DDP_I32 || dt == DDP_I64 || dt == DDP_U8; }

/* Reference reduction over the ranks' values of element i: float64 for floating types; for
 * integers exact arithmetic that wraps like the library's (two's complement in the element's
 * width), with AVG exact (sum of i32/u8 accumulated wide, divided with truncation). */
static double tcp_test_reference(ddp_dtype_t dt, ddp_reduce_op_t op, int world, size_t i,
                                 unsigned salt)
{
    if (tcp_test_is_int(dt)) {
        int64_t acc = (int64_t)tcp_test_value(dt, 0, i, salt);
        for (int r = 1; r < world; r++) {
            int64_t v = (int64_t)tcp_test_value(dt, r, i, salt);
            switch (op) {
            case DDP_SUM:
            case DDP_AVG: acc += v; break;
            case DDP_PROD: acc *= v; break;
            case DDP_MIN: acc = v < acc ? v : acc; break;
            case DDP_MAX: acc = v > acc ? v : acc; break;
            default: break;
            }
            if (op != DDP_AVG && dt == DDP_U8) acc = (int64_t)(uint8_t)acc;
            if (op != DDP_AVG && dt == DDP_I32) acc = (int64_t)(int32_t)(uint32_t)acc;
        }
        if (op == DDP_AVG) acc /= world;
        return (double)acc;
    }
    double acc = tcp_test_value(dt, 0, i, salt);
    for (int r = 1; r < world; r++) acc = ddp_test_fold(op, acc, tcp_test_value(dt, r, i, salt));
    if (op == DDP_AVG) acc = acc / world;
    return acc;
}

/* Absolute tolerance for |result - reference| (values are O(1); products of up to 4 values). */
static double tcp_test_tolerance(ddp_dtype_t dt)
{
    switch (dt) {
    case DDP_F32: return 1e-5;
    case DDP_F64: return 1e-12;
    case DDP_F16: return 4e-3;
    case DDP_BF16: return 3e-2;
    default: return 0;
    }
}

static uint64_t tcp_test_hash(const void *buf, size_t bytes)
{
    const unsigned char *p = buf;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < bytes; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

#endif
