/* Element-wise reductions of the TCP transport's accumulation types, on top of the shared kernels
 * of src/core/reduce.h. Half-precision data never reaches them: the transport widens f16/bf16 to
 * f32 first, reduces in f32 and rounds once at the end, as ddp/types.h promises. */
#include <string.h>

#include "core/reduce.h"
#include "transport/tcp/tcp.h"

void ddp__tcp_combine(void *dst, const void *x, const void *y, size_t count, ddp_dtype_t dtype,
                      ddp_reduce_op_t op)
{
    /* The shared kernels (vectorised where the CPU allows), two sources in this order. AVG is
     * reduced as SUM here: the division by the world size happens once, at the end. */
    const void *srcs[2] = {x, y};
    ddp__reduce(dst, srcs, 2, count, dtype, op == DDP_AVG ? DDP_SUM : op);
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

ddp_dtype_t ddp__tcp_acc_type(ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    if (dtype == DDP_F16 || dtype == DDP_BF16) return DDP_F32;
    if (op == DDP_AVG && (dtype == DDP_I32 || dtype == DDP_U8)) return DDP_I64;
    return dtype;
}
