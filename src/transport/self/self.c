/* The "self" transport of a world of one rank: every collective is a copy (or nothing). It keeps
 * groups of size 1 on the same code path as larger ones (queue, works, tasks, errors). */
#include <string.h>

#include "core/internal.h"
#include "transport/transport.h"

static ddp_status_t self_create(ddp_store_t *store, const char *group_name, int rank, int world,
                                int timeout_ms, void **state)
{
    (void)store;
    (void)group_name;
    (void)rank;
    (void)world;
    (void)timeout_ms;
    *state = NULL;
    return DDP_OK;
}

static ddp_status_t self_run(void *state, const ddp__collective_t *c)
{
    (void)state;
    size_t bytes = c->count * ddp_dtype_size(c->dtype);
    switch (c->kind) {
    case DDP__ALLREDUCE:
    case DDP__REDUCE_SCATTER:
        /* Every op of a single value is that value, bit for bit (x / 1 is exact, and an f16 or
         * bf16 widened to f32 narrows back to itself), so one rank's reduction is a copy or
         * nothing. Through the reduce kernel it cost a Reducer with world 1 a full pass and a
         * division per element: 1 ms per step for the trainer's 7 MiB of gradients. */
    case DDP__ALLGATHER:
    case DDP__ALLTOALL:
        if (bytes > 0 && c->send != c->recv) memmove(c->recv, c->send, bytes);
        break;
    case DDP__BROADCAST:
    case DDP__BARRIER:
        break;
    case DDP__REDUCE_SCATTER_APPLY: /* the group builds it: the table does not set the flag */
        return ddp__error(DDP_ERR_UNSUPPORTED, "self: reduce_scatter_apply is not one of its kinds");
    }
    return DDP_OK;
}

static void self_destroy(void *state) { (void)state; }

const ddp__transport_ops_t ddp__transport_self = {
    .name = "self",
    .create = self_create,
    .run = self_run,
    .alloc_buffer = NULL,
    .free_buffer = NULL,
    .abort = NULL,
    .destroy = self_destroy,
    .alltoall = 1,
};
