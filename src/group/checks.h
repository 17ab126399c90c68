/* The argument checks every public call of the group makes (group.c's five collectives and
 * collectives.c's derived ones), and the one TRY they return through. One set, so that the same
 * mistake gets the same answer from every call. Group-private: not for the layers above. */
#ifndef DDP_GROUP_CHECKS_H
#define DDP_GROUP_CHECKS_H

#include <stddef.h>

#include "ddp/ddp.h"

/* Returns the status of `expr` from the calling function when it is not DDP_OK. */
#define TRY(expr)                                                                                 \
    do {                                                                                          \
        ddp_status_t try_status_ = (expr);                                                        \
        if (try_status_ != DDP_OK) return try_status_;                                            \
    } while (0)

/* Each returns DDP_OK or DDP_ERR_INVALID_ARGUMENT with a text that starts with `fn` (the public
 * call's name) and names the argument. */
ddp_status_t ddp__check_group(const ddp_group_t *g, const char *fn);
ddp_status_t ddp__check_dtype(ddp_dtype_t dtype, const char *fn);
ddp_status_t ddp__check_op(ddp_reduce_op_t op, const char *fn);
/* rank (a root or a peer, called `what`) in [0, world). */
ddp_status_t ddp__check_rank(int world, int rank, const char *fn, const char *what);

/* count elements of dtype, times `multiplier` (0 counts as 1), must make a byte count of at
 * most SIZE_MAX / 2 (PTRDIFF_MAX): no object can be larger, and the buffers' offsets are then
 * differences of pointers. `name` is the argument's name. */
ddp_status_t ddp__check_count(size_t count, size_t multiplier, ddp_dtype_t dtype, const char *fn,
                              const char *name);

/* A buffer `name` may be NULL only when it holds no element. The text says "with <count_name>
 * <count>", or "with <count> elements" when count_name is NULL. */
ddp_status_t ddp__check_buffer(const void *p, size_t count, const char *fn, const char *name,
                               const char *count_name);


/* malloc(a * b * c) (at least one byte), or NULL with DDP_ERR_NO_MEMORY recorded when the
 * product is more than SIZE_MAX / 2: scratch sizes derived from checked counts (a block per rank
 * padded to the largest) can still exceed it, and must fail rather than wrap. */
void *ddp__scratch(size_t a, size_t b, size_t c);

#endif
