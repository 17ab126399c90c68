/* The rooted derived collectives and alltoall (collectives.h): reduce, gather, scatter and
 * alltoall, each one agreement then one of the transports' kinds (allreduce, allgather,
 * broadcast) into the caller's buffer or a scratch one; alltoall is the transport's own where it
 * has one. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

ddp_status_t ddp__coll_run_reduce(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    void *tmp = NULL, *out = a->recv;
    if (ddp_group_rank(g) != a->root) {
        out = tmp = ddp__scratch(a->count, ddp_dtype_size(a->dtype), 1);
        if (!tmp) return DDP_ERR_NO_MEMORY;
    }
    ddp_status_t s = ddp_group_allreduce(g, a->send, out, a->count, a->dtype, a->op);
    free(tmp);
    return s;
}

ddp_status_t ddp__coll_run_gather(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    void *tmp = NULL, *out = a->recv;
    if (ddp_group_rank(g) != a->root) {
        out = tmp = ddp__scratch(a->count, ddp_dtype_size(a->dtype), (size_t)ddp_group_size(g));
        if (!tmp) return DDP_ERR_NO_MEMORY;
    }
    ddp_status_t s = ddp_group_allgather(g, a->send, out, a->count, a->dtype);
    free(tmp);
    return s;
}

ddp_status_t ddp__coll_run_scatter(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t block = a->count * ddp_dtype_size(a->dtype);
    ddp_status_t s;
    if (rank == a->root) {
        /* The root's send is only read by a broadcast. */
        s = ddp_group_broadcast(g, (void *)a->send, a->count * (size_t)world, a->dtype, a->root);
        const char *mine = (const char *)a->send + (size_t)rank * block;
        if (s == DDP_OK && (const void *)mine != a->recv && block) memmove(a->recv, mine, block);
        return s;
    }
    void *tmp = ddp__scratch(block, (size_t)world, 1);
    if (!tmp) return DDP_ERR_NO_MEMORY;
    s = ddp_group_broadcast(g, tmp, a->count * (size_t)world, a->dtype, a->root);
    if (s == DDP_OK && block) memcpy(a->recv, (char *)tmp + (size_t)rank * block, block);
    free(tmp);
    return s;
}

/* Two ranks: one allgather of the block each rank sends the other, straight into recv, then this
 * rank's own block over what it contributed; the bytes of a pairwise exchange and no temporary
 * (unless send overlaps recv). */
static ddp_status_t alltoall_of_two(ddp_group_t *g, const coll_args_t *a)
{
    const int rank = ddp_group_rank(g);
    const size_t block = a->count * ddp_dtype_size(a->dtype);
    const char *send = a->send;
    char *recv = a->recv, *copy = NULL;
    if (ddp__overlaps(send, 2 * block, recv, 2 * block)) {
        send = copy = ddp__malloc(2 * block, "a copy of alltoall's send (it overlaps recv)");
        if (!copy) return DDP_ERR_NO_MEMORY;
        memcpy(copy, a->send, 2 * block);
    }
    ddp_status_t s = ddp_group_allgather(g, send + (size_t)(1 - rank) * block, recv, a->count,
                                         a->dtype);
    if (s == DDP_OK) memcpy(recv + (size_t)rank * block, send + (size_t)rank * block, block);
    free(copy);
    return s;
}

/* One collective of the transport when it has alltoall (shm, self). Otherwise built from
 * allgather: at two ranks exactly (above); at more, every rank's whole send buffer reaches every
 * rank (world * world * count elements) and each rank keeps its column: right on every
 * transport, and world times the bytes a pairwise exchange would move. */
ddp_status_t ddp__coll_run_alltoall(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    if (ddp__group_has_alltoall(g))
        return ddp__group_alltoall(g, a->send, a->recv, a->count, a->dtype, NULL);
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    if (world == 2 && a->count) return alltoall_of_two(g, a);
    size_t es = ddp_dtype_size(a->dtype);
    size_t row = a->count * es * (size_t)world;
    void *tmp = ddp__scratch(row, (size_t)world, 1);
    if (!tmp) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp_group_allgather(g, a->send, tmp, a->count * (size_t)world, a->dtype);
    if (s == DDP_OK)
        for (int j = 0; j < world; j++)
            memcpy((char *)a->recv + (size_t)j * a->count * es,
                   (char *)tmp + (size_t)j * row + (size_t)rank * a->count * es, a->count * es);
    free(tmp);
    return s;
}
