/* The rooted derived collectives and alltoall (collectives.h): reduce, gather, scatter and
 * alltoall, each one agreement then one of the transports' kinds (allreduce, allgather,
 * broadcast) into the caller's buffer or a scratch one. */
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

/* Every rank's whole send buffer reaches every rank (world * world * count elements): simple
 * and right on every transport; each rank keeps its column. */
ddp_status_t ddp__coll_run_alltoall(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
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

/* ---- issuing ------------------------------------------------------------------------------ */

static ddp_status_t do_reduce(ddp_group_t *g, const void *send, void *recv, size_t count,
                              ddp_dtype_t dtype, ddp_reduce_op_t op, int root, ddp_work_t **work,
                              const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_op(op, fn));
    TRY(ddp__check_count(count, 1, dtype, fn, "count"));
    TRY(ddp__check_rank(g, root, fn, "root"));
    TRY(ddp__check_buffer(send, count, fn, "send", NULL));
    if (ddp_group_rank(g) == root) TRY(ddp__check_buffer(recv, count, fn, "recv (on the root)", NULL));
    coll_args_t *a = ddp__coll_new_args(K_REDUCE, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    a->op = op;
    a->root = root;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_reduce_async(ddp_group_t *group, const void *send, void *recv,
                                    size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op, int root,
                                    ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce_async: work is NULL");
    return do_reduce(group, send, recv, count, dtype, op, root, work, "reduce_async");
}

ddp_status_t ddp_group_reduce(ddp_group_t *group, const void *send, void *recv, size_t count,
                              ddp_dtype_t dtype, ddp_reduce_op_t op, int root)
{
    return do_reduce(group, send, recv, count, dtype, op, root, NULL, "reduce");
}

static ddp_status_t do_rooted(ddp_group_t *g, coll_kind_t kind, const void *send, void *recv,
                              size_t count, ddp_dtype_t dtype, int root, ddp_work_t **work,
                              const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_count(count, (size_t)ddp_group_size(g), dtype, fn, "count"));
    TRY(ddp__check_rank(g, root, fn, "root"));
    int is_root = ddp_group_rank(g) == root;
    size_t world = (size_t)ddp_group_size(g);
    if (kind == K_GATHER) {
        TRY(ddp__check_buffer(send, count, fn, "send", NULL));
        if (is_root) TRY(ddp__check_buffer(recv, count * world, fn, "recv (on the root)", NULL));
    } else {
        TRY(ddp__check_buffer(recv, count, fn, "recv", NULL));
        if (is_root) TRY(ddp__check_buffer(send, count * world, fn, "send (on the root)", NULL));
    }
    coll_args_t *a = ddp__coll_new_args(kind, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    a->root = root;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_gather_async(ddp_group_t *group, const void *send, void *recv,
                                    size_t send_count, ddp_dtype_t dtype, int root,
                                    ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "gather_async: work is NULL");
    return do_rooted(group, K_GATHER, send, recv, send_count, dtype, root, work, "gather_async");
}

ddp_status_t ddp_group_gather(ddp_group_t *group, const void *send, void *recv, size_t send_count,
                              ddp_dtype_t dtype, int root)
{
    return do_rooted(group, K_GATHER, send, recv, send_count, dtype, root, NULL, "gather");
}

ddp_status_t ddp_group_scatter_async(ddp_group_t *group, const void *send, void *recv,
                                     size_t recv_count, ddp_dtype_t dtype, int root,
                                     ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "scatter_async: work is NULL");
    return do_rooted(group, K_SCATTER, send, recv, recv_count, dtype, root, work, "scatter_async");
}

ddp_status_t ddp_group_scatter(ddp_group_t *group, const void *send, void *recv,
                               size_t recv_count, ddp_dtype_t dtype, int root)
{
    return do_rooted(group, K_SCATTER, send, recv, recv_count, dtype, root, NULL, "scatter");
}

static ddp_status_t do_alltoall(ddp_group_t *g, const void *send, void *recv, size_t count,
                                ddp_dtype_t dtype, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    size_t world = (size_t)ddp_group_size(g);
    TRY(ddp__check_count(count, world * world, dtype, fn, "count"));
    TRY(ddp__check_buffer(send, count * world, fn, "send", NULL));
    TRY(ddp__check_buffer(recv, count * world, fn, "recv", NULL));
    coll_args_t *a = ddp__coll_new_args(K_ALLTOALL, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_alltoall_async(ddp_group_t *group, const void *send, void *recv,
                                      size_t count, ddp_dtype_t dtype, ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alltoall_async: work is NULL");
    return do_alltoall(group, send, recv, count, dtype, work, "alltoall_async");
}

ddp_status_t ddp_group_alltoall(ddp_group_t *group, const void *send, void *recv, size_t count,
                                ddp_dtype_t dtype)
{
    return do_alltoall(group, send, recv, count, dtype, NULL, "alltoall");
}

