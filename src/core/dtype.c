/* Element types, reduction operator names and the half-precision conversions used everywhere
 * f16/bf16 are accumulated in f32. */
#include <string.h>

#include "core/internal.h"

static const char *const dtype_names[DDP_DTYPE_COUNT] = {"f32", "f64", "f16", "bf16",
                                                         "i32", "i64", "u8"};
static const size_t dtype_sizes[DDP_DTYPE_COUNT] = {4, 8, 2, 2, 4, 8, 1};
static const char *const op_names[DDP_OP_COUNT] = {"sum", "avg", "min", "max", "prod"};

size_t ddp_dtype_size(ddp_dtype_t dtype)
{
    return ((unsigned)dtype < DDP_DTYPE_COUNT) ? dtype_sizes[dtype] : 0;
}

const char *ddp_dtype_name(ddp_dtype_t dtype)
{
    return ((unsigned)dtype < DDP_DTYPE_COUNT) ? dtype_names[dtype] : "invalid";
}

ddp_status_t ddp_dtype_parse(const char *name, ddp_dtype_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "name is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    for (int i = 0; i < DDP_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_names[i]) == 0) {
            *out = (ddp_dtype_t)i;
            return DDP_OK;
        }
    }
    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                      "unknown dtype '%s' (expected f32, f64, f16, bf16, i32, i64 or u8)", name);
}

const char *ddp_reduce_op_name(ddp_reduce_op_t op)
{
    return ((unsigned)op < DDP_OP_COUNT) ? op_names[op] : "invalid";
}

ddp_status_t ddp_reduce_op_parse(const char *name, ddp_reduce_op_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "name is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    for (int i = 0; i < DDP_OP_COUNT; i++) {
        if (strcmp(name, op_names[i]) == 0) {
            *out = (ddp_reduce_op_t)i;
            return DDP_OK;
        }
    }
    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                      "unknown reduce op '%s' (expected sum, avg, min, max or prod)", name);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float ddp_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf / nan */
    if (exp == 0) {
        /* Zero or subnormal: value = mant * 2^-24, exact in f32. */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t ddp_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7fffffffu;
    if (abs >= 0x7f800000u) { /* inf or nan; keep nan quiet and non-zero */
        return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0));
    }
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) {
        /* Result is subnormal or zero: value / 2^-24 rounded to nearest even. */
        if (abs < 0x33000000u) return sign; /* below half the smallest subnormal */
        uint32_t exp = abs >> 23;
        uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exp; /* 14..24 */
        uint32_t q = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u); /* round to nearest even at bit 13 */
    return (uint16_t)(sign | (((rounded >> 13) - (112u << 10)) & 0x7fffu));
}

float ddp_bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

uint16_t ddp_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet nan */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
