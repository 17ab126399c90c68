/* Element-wise reduction kernels for the TCP transport's accumulation types. Half-precision
 * data never reaches these loops: the transport widens f16/bf16 to f32 first, reduces in f32 and
 * rounds once at the end, as ddp/types.h promises. */
#include <string.h>

#include "transport/tcp/tcp.h"

/* min/max follow src/core/reduce.h: (a < b ? a : b), a NaN's effect depends on its position. */
#define COMBINE_LOOP(T)                                                                           \
    do {                                                                                          \
        T *d = dst;                                                                               \
        const T *a = x, *b = y;                                                                   \
        switch (op) {                                                                             \
        case DDP_SUM:                                                                             \
        case DDP_AVG:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = (T)(a[i] + b[i]);                          \
            break;                                                                                \
        case DDP_PROD:                                                                            \
            for (size_t i = 0; i < count; i++) d[i] = (T)(a[i] * b[i]);                          \
            break;                                                                                \
        case DDP_MIN:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = a[i] < b[i] ? a[i] : b[i];                 \
            break;                                                                                \
        case DDP_MAX:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = a[i] > b[i] ? a[i] : b[i];                 \
            break;                                                                                \
        default: break;                                                                           \
        }                                                                                         \
    } while (0)

/* Integer sums and products wrap modulo 2^bits (computed unsigned: signed overflow is
 * undefined in C). */
#define COMBINE_INT_LOOP(T, U)                                                                    \
    do {                                                                                          \
        T *d = dst;                                                                               \
        const T *a = x, *b = y;                                                                   \
        switch (op) {                                                                             \
        case DDP_SUM:                                                                             \
        case DDP_AVG:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = (T)((U)a[i] + (U)b[i]);                    \
            break;                                                                                \
        case DDP_PROD:                                                                            \
            for (size_t i = 0; i < count; i++) d[i] = (T)((U)a[i] * (U)b[i]);                    \
            break;                                                                                \
        case DDP_MIN:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = a[i] < b[i] ? a[i] : b[i];                 \
            break;                                                                                \
        case DDP_MAX:                                                                             \
            for (size_t i = 0; i < count; i++) d[i] = a[i] > b[i] ? a[i] : b[i];                 \
            break;                                                                                \
        default: break;                                                                           \
        }                                                                                         \
    } while (0)

void ddp__tcp_combine(void *dst, const void *x, const void *y, size_t count, ddp_dtype_t dtype,
                      ddp_reduce_op_t op)
{
    switch (dtype) {
    case DDP_F32: COMBINE_LOOP(float); break;
    case DDP_F64: COMBINE_LOOP(double); break;
    case DDP_I32: COMBINE_INT_LOOP(int32_t, uint32_t); break;
    case DDP_I64: COMBINE_INT_LOOP(int64_t, uint64_t); break;
    case DDP_U8: COMBINE_INT_LOOP(uint8_t, unsigned); break;
    default: break;
    }
}

void ddp__tcp_divide(void *acc, size_t count, ddp_dtype_t dtype, int world)
{
    switch (dtype) {
    case DDP_F32: {
        float *p = acc;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / (float)world;
        break;
    }
    case DDP_F64: {
        double *p = acc;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / (double)world;
        break;
    }
    case DDP_I32: {
        int32_t *p = acc;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / world;
        break;
    }
    case DDP_I64: {
        int64_t *p = acc;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / world;
        break;
    }
    case DDP_U8: {
        uint8_t *p = acc;
        for (size_t i = 0; i < count; i++) p[i] = (uint8_t)(p[i] / world);
        break;
    }
    default: break;
    }
}
