/* The coalesced collectives (collectives.h): allreduce and broadcast over a list of buffers,
 * packed end to end into one scratch buffer so that they cost one collective of the transport. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

ddp_status_t ddp__coll_run_coalesced(ddp_group_t *g, const coll_args_t *a,
                                     const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g);
    size_t es = ddp_dtype_size(a->dtype);
    int is_allreduce = a->kind == K_ALLREDUCE_COALESCED;
    void *tmp = ddp__scratch(a->count, es, 1);
    if (!tmp) return DDP_ERR_NO_MEMORY;
    size_t off = 0;
    if (is_allreduce || rank == a->root)
        for (size_t i = 0; i < a->nbufs; i++) {
            if (a->counts[i]) memcpy((char *)tmp + off * es, a->bufs[i], a->counts[i] * es);
            off += a->counts[i];
        }
    ddp_status_t s = is_allreduce ? ddp_group_allreduce(g, tmp, tmp, a->count, a->dtype, a->op)
                                  : ddp_group_broadcast(g, tmp, a->count, a->dtype, a->root);
    off = 0;
    if (s == DDP_OK && (is_allreduce || rank != a->root))
        for (size_t i = 0; i < a->nbufs; i++) {
            if (a->counts[i]) memcpy(a->bufs[i], (char *)tmp + off * es, a->counts[i] * es);
            off += a->counts[i];
        }
    free(tmp);
    return s;
}

/* ---- issuing ------------------------------------------------------------------------------ */

static ddp_status_t do_coalesced(ddp_group_t *g, coll_kind_t kind, void *const *bufs,
                                 const size_t *counts, size_t nbufs, ddp_dtype_t dtype,
                                 ddp_reduce_op_t op, int root, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(ddp__check_group(g, fn));
    TRY(ddp__check_dtype(dtype, fn));
    if (kind == K_ALLREDUCE_COALESCED) TRY(ddp__check_op(op, fn));
    else TRY(ddp__check_rank(g, root, fn, "root"));
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
    coll_args_t *a = ddp__coll_new_args(kind, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->bufs = ddp__malloc((nbufs ? nbufs : 1) * sizeof *a->bufs, "a copy of the buffer list");
    a->counts = ddp__coll_copy_sizes(counts, nbufs);
    if (!a->bufs || !a->counts) {
        ddp__coll_free_args(a);
        return DDP_ERR_NO_MEMORY;
    }
    if (nbufs) memcpy(a->bufs, bufs, nbufs * sizeof *a->bufs);
    a->nbufs = nbufs;
    a->count = total;
    a->op = op;
    a->root = root;
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
