/* Bulk f16/bf16 <-> f32 conversions, shared by everything that widens half precision for an f32
 * reduction and rounds it back once (the fp16/bf16 hooks, the MPI transport). */
#ifndef DDP_CORE_HALF_H
#define DDP_CORE_HALF_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/types.h"

/* dst[i] = f32 value of src[i]; `half` is DDP_F16 or DDP_BF16. Exact. */
void ddp__half_to_f32(ddp_dtype_t half, const uint16_t *src, float *dst, size_t n);

/* dst[i] = src[i] rounded to nearest even in `half` (DDP_F16 or DDP_BF16): the same bits as
 * ddp_f32_to_f16 / ddp_f32_to_bf16 for every non-NaN input; NaN stays a quiet NaN. */
void ddp__f32_to_half(ddp_dtype_t half, const float *src, uint16_t *dst, size_t n);

#endif
