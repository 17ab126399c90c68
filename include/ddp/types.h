/* Element types, reduction operators and half-precision conversions. */
#ifndef DDP_TYPES_H
#define DDP_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ddp_dtype {
    DDP_F32 = 0,
    DDP_F64 = 1,
    DDP_F16 = 2,  /* IEEE binary16; reduced in f32 and rounded once */
    DDP_BF16 = 3, /* bfloat16; reduced in f32 and rounded once */
    DDP_I32 = 4,
    DDP_I64 = 5,
    DDP_U8 = 6,
    DDP_DTYPE_COUNT
} ddp_dtype_t;

typedef enum ddp_reduce_op {
    DDP_SUM = 0,
    DDP_AVG = 1, /* sum / world size; integers divide with truncation toward zero */
    DDP_MIN = 2,
    DDP_MAX = 3,
    DDP_PROD = 4,
    DDP_OP_COUNT
} ddp_reduce_op_t;

/* Bytes per element; 0 for an invalid dtype. */
DDP_API size_t ddp_dtype_size(ddp_dtype_t dtype);
/* "f32", "f64", "f16", "bf16", "i32", "i64", "u8"; "invalid" for anything else. */
DDP_API const char *ddp_dtype_name(ddp_dtype_t dtype);
/* Parses a name as printed by ddp_dtype_name. */
DDP_API ddp_status_t ddp_dtype_parse(const char *name, ddp_dtype_t *out);
/* "sum", "avg", "min", "max", "prod"; "invalid" for anything else. */
DDP_API const char *ddp_reduce_op_name(ddp_reduce_op_t op);
DDP_API ddp_status_t ddp_reduce_op_parse(const char *name, ddp_reduce_op_t *out);

/* Conversions with round-to-nearest-even; NaN stays NaN, overflow becomes infinity. */
DDP_API float ddp_f16_to_f32(uint16_t h);
DDP_API uint16_t ddp_f32_to_f16(float f);
DDP_API float ddp_bf16_to_f32(uint16_t b);
DDP_API uint16_t ddp_f32_to_bf16(float f);

#ifdef __cplusplus
}
#endif
#endif
