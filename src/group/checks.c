/* The group's argument checks (checks.h): one place for what group.c's collectives and
 * collectives.c's derived ones refuse, so that their limits cannot drift apart again. */
#include <stdint.h>

#include "core/internal.h"
#include "group/checks.h"

/* The largest byte count a buffer may have: PTRDIFF_MAX on every platform we build for. */
#define MAX_BYTES (SIZE_MAX / 2)

ddp_status_t ddp__check_group(const ddp_group_t *g, const char *fn)
{
    if (!g) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: group is NULL", fn);
    return DDP_OK;
}

ddp_status_t ddp__check_dtype(ddp_dtype_t dtype, const char *fn)
{
    if ((unsigned)dtype >= DDP_DTYPE_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a valid ddp_dtype_t", fn,
                          (int)dtype);
    return DDP_OK;
}

ddp_status_t ddp__check_op(ddp_reduce_op_t op, const char *fn)
{
    if ((unsigned)op >= DDP_OP_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a valid ddp_reduce_op_t", fn,
                          (int)op);
    return DDP_OK;
}

ddp_status_t ddp__check_rank(int world, int rank, const char *fn, const char *what)
{
    if (rank < 0 || rank >= world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s %d is out of range [0, %d)", fn, what,
                          rank, world);
    return DDP_OK;
}

ddp_status_t ddp__check_count(size_t count, size_t multiplier, ddp_dtype_t dtype, const char *fn,
                              const char *name)
{
    if (multiplier == 0) multiplier = 1;
    if (count > MAX_BYTES / ddp_dtype_size(dtype) / multiplier)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s %zu is too large", fn, name, count);
    return DDP_OK;
}

ddp_status_t ddp__check_buffer(const void *p, size_t count, const char *fn, const char *name,
                               const char *count_name)
{
    if (count == 0 || p) return DDP_OK;
    if (count_name)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with %s %zu", fn, name,
                          count_name, count);
    return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with %zu elements", fn, name,
                      count);
}

void *ddp__scratch(size_t a, size_t b, size_t c)
{
    if ((b && a > MAX_BYTES / b) || (c && a * b > MAX_BYTES / c)) {
        ddp__error(DDP_ERR_NO_MEMORY, "collective scratch memory of %zu x %zu x %zu bytes is "
                   "more than any buffer can hold", a, b, c);
        return NULL;
    }
    size_t bytes = a * b * c;
    return ddp__malloc(bytes ? bytes : 1, "collective scratch memory");
}
