/* The public calls of the derived collectives (ddp/group.h): each checks its arguments with
 * checks.h, copies the caller's arrays into an operation record and issues it (or runs it) as a
 * task of the group through collectives.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

/* ---- point to point ---- */


static ddp_status_t do_p2p(ddp_group_t *g, coll_kind_t kind, const void *send, void *recv,
                           size_t count, ddp_dtype_t dtype, int peer, int tag, ddp_work_t **work,
                           const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_count(count, 1, dtype, fn, "count"));
    TRY(ddp__check_buffer(kind == K_SEND ? send : recv, count, fn, "buf", NULL));
    TRY(ddp__check_rank(ddp_group_size(g), peer, fn, "peer"));
    if (peer == ddp_group_rank(g))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: peer %d is this rank (a message to itself would wait for its own "
                          "matching call, which issue order puts after it)", fn, peer);
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = kind, .dtype = dtype, .send = send,
                                                      .recv = recv, .count = count, .root = peer,
                                                      .tag = tag});
    if (!a) return DDP_ERR_NO_MEMORY;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_send_async(ddp_group_t *group, const void *buf, size_t count,
                                  ddp_dtype_t dtype, int peer, int tag, ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "send_async: work is NULL");
    return do_p2p(group, K_SEND, buf, NULL, count, dtype, peer, tag, work, "send_async");
}

ddp_status_t ddp_group_recv_async(ddp_group_t *group, void *buf, size_t count, ddp_dtype_t dtype,
                                  int peer, int tag, ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "recv_async: work is NULL");
    return do_p2p(group, K_RECV, NULL, buf, count, dtype, peer, tag, work, "recv_async");
}

static ddp_status_t do_recv_any(ddp_group_t *g, void *recv, size_t count, ddp_dtype_t dtype,
                                int tag, int *source, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_count(count, 1, dtype, fn, "count"));
    TRY(ddp__check_buffer(recv, count, fn, "buf", NULL));
    if (!source) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: source is NULL", fn);
    if (ddp_group_size(g) < 2)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: a group of one rank has no other rank to receive from", fn);
    if (!ddp__group_recv_any_enabled(g))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s (tag %d) on rank %d: the group was not enabled for it "
                          "(ddp_group_enable_recv_any on every rank before its first send)",
                          fn, tag, ddp_group_rank(g));
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = K_RECV, .dtype = dtype, .recv = recv,
                                                      .count = count, .root = -1, .tag = tag,
                                                      .source = source});
    if (!a) return DDP_ERR_NO_MEMORY;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_recv_any_async(ddp_group_t *group, void *buf, size_t count,
                                      ddp_dtype_t dtype, int tag, int *source, ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "recv_any_async: work is NULL");
    return do_recv_any(group, buf, count, dtype, tag, source, work, "recv_any_async");
}

ddp_status_t ddp_group_recv_any(ddp_group_t *group, void *buf, size_t count, ddp_dtype_t dtype,
                                int tag, int *source)
{
    return do_recv_any(group, buf, count, dtype, tag, source, NULL, "recv_any");
}

ddp_status_t ddp_group_send(ddp_group_t *group, const void *buf, size_t count, ddp_dtype_t dtype,
                            int peer, int tag)
{
    return do_p2p(group, K_SEND, buf, NULL, count, dtype, peer, tag, NULL, "send");
}

ddp_status_t ddp_group_recv(ddp_group_t *group, void *buf, size_t count, ddp_dtype_t dtype,
                            int peer, int tag)
{
    return do_p2p(group, K_RECV, NULL, buf, count, dtype, peer, tag, NULL, "recv");
}


/* ---- rooted and alltoall ---- */


static ddp_status_t do_reduce(ddp_group_t *g, const void *send, void *recv, size_t count,
                              ddp_dtype_t dtype, ddp_reduce_op_t op, int root, ddp_work_t **work,
                              const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_op(op, fn));
    TRY(ddp__check_count(count, 1, dtype, fn, "count"));
    TRY(ddp__check_rank(ddp_group_size(g), root, fn, "root"));
    TRY(ddp__check_buffer(send, count, fn, "send", NULL));
    if (ddp_group_rank(g) == root) TRY(ddp__check_buffer(recv, count, fn, "recv (on the root)", NULL));
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = K_REDUCE, .dtype = dtype,
                                                      .send = send, .recv = recv, .count = count,
                                                      .op = op, .root = root});
    if (!a) return DDP_ERR_NO_MEMORY;
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
    TRY(ddp__check_rank(ddp_group_size(g), root, fn, "root"));
    int is_root = ddp_group_rank(g) == root;
    size_t world = (size_t)ddp_group_size(g);
    if (kind == K_GATHER) {
        TRY(ddp__check_buffer(send, count, fn, "send", NULL));
        if (is_root) TRY(ddp__check_buffer(recv, count * world, fn, "recv (on the root)", NULL));
    } else {
        TRY(ddp__check_buffer(recv, count, fn, "recv", NULL));
        if (is_root) TRY(ddp__check_buffer(send, count * world, fn, "send (on the root)", NULL));
    }
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = kind, .dtype = dtype, .send = send,
                                                      .recv = recv, .count = count, .root = root});
    if (!a) return DDP_ERR_NO_MEMORY;
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
    /* The transport's own alltoall goes the way the five kinds go, without an operation record
     * and a task around it: a small alltoall cost 2-3x a small allgather through them. */
    if (ddp__group_has_alltoall(g)) return ddp__group_alltoall(g, send, recv, count, dtype, work);
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = K_ALLTOALL, .dtype = dtype,
                                                      .send = send, .recv = recv, .count = count});
    if (!a) return DDP_ERR_NO_MEMORY;
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

static ddp_status_t do_reduce_scatter_apply(ddp_group_t *g, const void *send, void *recv,
                                            size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                            ddp_apply_fn fn, void *arg, ddp_work_t **work,
                                            const char *name)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, name));
    TRY(ddp__check_dtype(dtype, name));
    TRY(ddp__check_op(op, name));
    if (!fn) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fn is NULL", name);
    size_t world = (size_t)ddp_group_size(g);
    TRY(ddp__check_count(count, world, dtype, name, "count"));
    TRY(ddp__check_buffer(send, count * world, name, "send", "count"));
    TRY(ddp__check_buffer(recv, count * world, name, "recv", "count"));
    size_t bytes = count * world * ddp_dtype_size(dtype);
    if (send != recv && ddp__overlaps(send, bytes, recv, bytes))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: send and recv overlap without being "
                          "equal (in place needs send == recv)", name);
    /* The transport's own goes without an operation record and a task, as alltoall does. */
    if (ddp__group_has_reduce_scatter_apply(g))
        return ddp__group_reduce_scatter_apply(g, send, recv, count, dtype, op, fn, arg, work);
    coll_args_t *a = ddp__coll_new_args(
        (coll_args_t){.kind = K_REDUCE_SCATTER_APPLY, .dtype = dtype, .op = op, .send = send,
                      .recv = recv, .count = count, .apply = fn, .apply_arg = arg});
    if (!a) return DDP_ERR_NO_MEMORY;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_reduce_scatter_apply_async(ddp_group_t *group, const void *send,
                                                  void *recv, size_t count, ddp_dtype_t dtype,
                                                  ddp_reduce_op_t op, ddp_apply_fn fn, void *arg,
                                                  ddp_work_t **work)
{
    if (!work)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce_scatter_apply_async: work is NULL");
    return do_reduce_scatter_apply(group, send, recv, count, dtype, op, fn, arg, work,
                                   "reduce_scatter_apply_async");
}

ddp_status_t ddp_group_reduce_scatter_apply(ddp_group_t *group, const void *send, void *recv,
                                            size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                            ddp_apply_fn fn, void *arg)
{
    return do_reduce_scatter_apply(group, send, recv, count, dtype, op, fn, arg, NULL,
                                   "reduce_scatter_apply");
}

/* ---- variable counts ---- */


/* Checks a per-rank count array (and displacements, NULL: packed) and returns their copies and
 * the total in elements. */
static ddp_status_t copy_v(ddp_group_t *g, const size_t *counts, const size_t *displs,
                           ddp_dtype_t dtype, const char *fn, const char *cname, size_t **cout,
                           size_t **dout, size_t *total)
{
    int world = ddp_group_size(g);
    if (!counts) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, cname);
    size_t sum = 0;
    for (int r = 0; r < world; r++) {
        TRY(ddp__check_count(counts[r], 1, dtype, fn, cname));
        sum += counts[r];
        TRY(ddp__check_count(sum, 1, dtype, fn, "the sum of counts"));
    }
    size_t *c = ddp__coll_copy_sizes(counts, (size_t)world);
    size_t *d = ddp__malloc((size_t)world * sizeof *d, "displacements");
    if (!c || !d) {
        free(c);
        free(d);
        return DDP_ERR_NO_MEMORY;
    }
    size_t off = 0;
    for (int r = 0; r < world; r++) {
        d[r] = displs ? displs[r] : off;
        off += counts[r];
        if (displs && ddp__check_count(displs[r] + counts[r], 1, dtype, fn, "displacement") != DDP_OK) {
            free(c);
            free(d);
            return DDP_ERR_INVALID_ARGUMENT;
        }
    }
    *cout = c;
    *dout = d;
    *total = sum;
    return DDP_OK;
}

static ddp_status_t do_allgatherv(ddp_group_t *g, const void *send, size_t send_count, void *recv,
                                  const size_t *recv_counts, const size_t *displs,
                                  ddp_dtype_t dtype, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    coll_args_t *a = ddp__coll_new_args(
        (coll_args_t){.kind = K_ALLGATHERV, .dtype = dtype, .send = send, .recv = recv});
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t total = 0;
    ddp_status_t s = copy_v(g, recv_counts, displs, dtype, fn, "recv_counts", &a->counts,
                            &a->displs, &total);
    if (s == DDP_OK && recv_counts[ddp_group_rank(g)] != send_count)
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                       "%s: send_count %zu differs from recv_counts[%d] = %zu (this rank's entry)",
                       fn, send_count, ddp_group_rank(g), recv_counts[ddp_group_rank(g)]);
    if (s == DDP_OK) s = ddp__check_buffer(send, send_count, fn, "send", NULL);
    if (s == DDP_OK) s = ddp__check_buffer(recv, total, fn, "recv", NULL);
    if (s != DDP_OK) {
        ddp__coll_free_args(a);
        return s;
    }
    a->count = total;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_allgatherv_async(ddp_group_t *group, const void *send, size_t send_count,
                                        void *recv, const size_t *recv_counts,
                                        const size_t *displs, ddp_dtype_t dtype,
                                        ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "allgatherv_async: work is NULL");
    return do_allgatherv(group, send, send_count, recv, recv_counts, displs, dtype, work,
                         "allgatherv_async");
}

ddp_status_t ddp_group_allgatherv(ddp_group_t *group, const void *send, size_t send_count,
                                  void *recv, const size_t *recv_counts, const size_t *displs,
                                  ddp_dtype_t dtype)
{
    return do_allgatherv(group, send, send_count, recv, recv_counts, displs, dtype, NULL,
                         "allgatherv");
}

static ddp_status_t do_reduce_scatterv(ddp_group_t *g, const void *send, void *recv,
                                       const size_t *recv_counts, ddp_dtype_t dtype,
                                       ddp_reduce_op_t op, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    TRY(ddp__check_op(op, fn));
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = K_REDUCE_SCATTERV, .dtype = dtype,
                                                      .send = send, .recv = recv, .op = op});
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t total = 0;
    ddp_status_t s = copy_v(g, recv_counts, NULL, dtype, fn, "recv_counts", &a->counts,
                            &a->displs, &total);
    if (s == DDP_OK) s = ddp__check_buffer(send, total, fn, "send", NULL);
    if (s == DDP_OK) s = ddp__check_buffer(recv, recv_counts[ddp_group_rank(g)], fn, "recv", NULL);
    if (s != DDP_OK) {
        ddp__coll_free_args(a);
        return s;
    }
    a->count = total;
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_reduce_scatterv_async(ddp_group_t *group, const void *send, void *recv,
                                             const size_t *recv_counts, ddp_dtype_t dtype,
                                             ddp_reduce_op_t op, ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce_scatterv_async: work is NULL");
    return do_reduce_scatterv(group, send, recv, recv_counts, dtype, op, work,
                              "reduce_scatterv_async");
}

ddp_status_t ddp_group_reduce_scatterv(ddp_group_t *group, const void *send, void *recv,
                                       const size_t *recv_counts, ddp_dtype_t dtype,
                                       ddp_reduce_op_t op)
{
    return do_reduce_scatterv(group, send, recv, recv_counts, dtype, op, NULL, "reduce_scatterv");
}

static ddp_status_t do_alltoallv(ddp_group_t *g, const void *send, const size_t *send_counts,
                                 const size_t *send_displs, void *recv, const size_t *recv_counts,
                                 const size_t *recv_displs, ddp_dtype_t dtype, ddp_work_t **work,
                                 const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    coll_args_t *a = ddp__coll_new_args(
        (coll_args_t){.kind = K_ALLTOALLV, .dtype = dtype, .send = send, .recv = recv});
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t stotal = 0, rtotal = 0;
    ddp_status_t s = copy_v(g, send_counts, send_displs, dtype, fn, "send_counts", &a->counts,
                            &a->displs, &stotal);
    if (s == DDP_OK)
        s = copy_v(g, recv_counts, recv_displs, dtype, fn, "recv_counts", &a->rcounts,
                   &a->rdispls, &rtotal);
    if (s == DDP_OK) s = ddp__check_buffer(send, stotal, fn, "send", NULL);
    if (s == DDP_OK) s = ddp__check_buffer(recv, rtotal, fn, "recv", NULL);
    if (s == DDP_OK && send && recv && send == recv && stotal)
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: send == recv (alltoallv is not in place)", fn);
    if (s != DDP_OK) {
        ddp__coll_free_args(a);
        return s;
    }
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_alltoallv_async(ddp_group_t *group, const void *send,
                                       const size_t *send_counts, const size_t *send_displs,
                                       void *recv, const size_t *recv_counts,
                                       const size_t *recv_displs, ddp_dtype_t dtype,
                                       ddp_work_t **work)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alltoallv_async: work is NULL");
    return do_alltoallv(group, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                        dtype, work, "alltoallv_async");
}

ddp_status_t ddp_group_alltoallv(ddp_group_t *group, const void *send, const size_t *send_counts,
                                 const size_t *send_displs, void *recv, const size_t *recv_counts,
                                 const size_t *recv_displs, ddp_dtype_t dtype)
{
    return do_alltoallv(group, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                        dtype, NULL, "alltoallv");
}


/* ---- coalesced ---- */


static ddp_status_t do_coalesced(ddp_group_t *g, coll_kind_t kind, void *const *bufs,
                                 const size_t *counts, size_t nbufs, ddp_dtype_t dtype,
                                 ddp_reduce_op_t op, int root, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    if (kind == K_ALLREDUCE_COALESCED) TRY(ddp__check_op(op, fn));
    else TRY(ddp__check_rank(ddp_group_size(g), root, fn, "root"));
    if (nbufs > 0 && (!bufs || !counts))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bufs or counts is NULL with nbufs %zu", fn,
                          nbufs);
    size_t total = 0;
    for (size_t i = 0; i < nbufs; i++) {
        TRY(ddp__check_count(counts[i], 1, dtype, fn, "a count"));
        if (counts[i] > 0 && !bufs[i])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bufs[%zu] is NULL with count %zu", fn,
                              i, counts[i]);
        total += counts[i];
        TRY(ddp__check_count(total, 1, dtype, fn, "the sum of counts"));
    }
    coll_args_t *a = ddp__coll_new_args((coll_args_t){.kind = kind, .dtype = dtype, .nbufs = nbufs,
                                                      .count = total, .op = op, .root = root});
    if (!a) return DDP_ERR_NO_MEMORY;
    a->bufs = ddp__malloc((nbufs ? nbufs : 1) * sizeof *a->bufs, "a copy of the buffer list");
    a->counts = ddp__coll_copy_sizes(counts, nbufs);
    if (!a->bufs || !a->counts) {
        ddp__coll_free_args(a);
        return DDP_ERR_NO_MEMORY;
    }
    if (nbufs) memcpy(a->bufs, bufs, nbufs * sizeof *a->bufs);
    return ddp__coll_launch(g, a, work);
}

ddp_status_t ddp_group_allreduce_coalesced_async(ddp_group_t *group, void *const *bufs,
                                                 const size_t *counts, size_t nbufs,
                                                 ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                 ddp_work_t **work)
{
    if (!work)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "allreduce_coalesced_async: work is NULL");
    return do_coalesced(group, K_ALLREDUCE_COALESCED, bufs, counts, nbufs, dtype, op, 0, work,
                        "allreduce_coalesced_async");
}

ddp_status_t ddp_group_allreduce_coalesced(ddp_group_t *group, void *const *bufs,
                                           const size_t *counts, size_t nbufs, ddp_dtype_t dtype,
                                           ddp_reduce_op_t op)
{
    return do_coalesced(group, K_ALLREDUCE_COALESCED, bufs, counts, nbufs, dtype, op, 0, NULL,
                        "allreduce_coalesced");
}

ddp_status_t ddp_group_broadcast_coalesced_async(ddp_group_t *group, void *const *bufs,
                                                 const size_t *counts, size_t nbufs,
                                                 ddp_dtype_t dtype, int root, ddp_work_t **work)
{
    if (!work)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "broadcast_coalesced_async: work is NULL");
    return do_coalesced(group, K_BROADCAST_COALESCED, bufs, counts, nbufs, dtype, 0, root, work,
                        "broadcast_coalesced_async");
}

ddp_status_t ddp_group_broadcast_coalesced(ddp_group_t *group, void *const *bufs,
                                           const size_t *counts, size_t nbufs, ddp_dtype_t dtype,
                                           int root)
{
    return do_coalesced(group, K_BROADCAST_COALESCED, bufs, counts, nbufs, dtype, 0, root, NULL,
                        "broadcast_coalesced");
}
