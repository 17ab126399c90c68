/* The collectives built from the transports' five: send/recv, reduce, gather, scatter, alltoall,
 * allgatherv, reduce_scatterv, alltoallv and the coalesced forms.
 *
 * Each runs as an internal task of the group (group_private.h), so it keeps the group's strict
 * issue order and its inner collectives take the next sequence numbers on every rank. Agreement
 * comes first: every rank contributes a small header (kind, dtype, op, root, count and a hash of
 * any count array) to one allgather, and every rank compares all of them with rank 0's. All
 * ranks see the same headers, so all reach the same verdict: DDP_ERR_MISMATCH on every rank,
 * naming both sides, and the group is broken as after any mismatch. The data then moves through
 * allreduce, reduce_scatter, allgather or broadcast, whose results are bitwise identical on every
 * rank and whose f16/bf16 sums are accumulated in f32 (their kernels in core/reduce.h); the
 * transports' checks (timeouts naming ranks, dead peers, aborts) apply to every step.
 *
 * Point-to-point messages travel in a two-rank group per pair of ranks (made through the store
 * at the pair's first message), as collectives of two in issue order, like NCCL's send/recv:
 * a send and its recv must be at the same position in both ranks' sequences of point-to-point
 * calls to each other; the header check makes a mismatched pair (count, dtype, tag, or two
 * sends) DDP_ERR_MISMATCH on both sides instead of a hang.
 *
 * This file holds the table of the kinds' functions and the task that runs one operation
 * through it. The public calls are in coll_issue.c, the kinds' functions by family in
 * coll_rooted.c, coll_vector.c, coll_coalesced.c and coll_p2p.c, and what they share (the rows
 * of the kinds, the header agreement) in coll_common.c (collectives.h). Calls go one way:
 * issue -> this file -> the families -> common. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

/* Each kind's function, indexed by kind (collectives.h lists the kinds and their rows). */
static const coll_run_fn runs[K_COUNT] = {
    [K_REDUCE] = ddp__coll_run_reduce,
    [K_GATHER] = ddp__coll_run_gather,
    [K_SCATTER] = ddp__coll_run_scatter,
    [K_ALLTOALL] = ddp__coll_run_alltoall,
    [K_ALLGATHERV] = ddp__coll_run_allgatherv,
    [K_REDUCE_SCATTERV] = ddp__coll_run_reduce_scatterv,
    [K_ALLTOALLV] = ddp__coll_run_alltoallv,
    [K_ALLREDUCE_COALESCED] = ddp__coll_run_coalesced,
    [K_BROADCAST_COALESCED] = ddp__coll_run_coalesced,
    [K_SEND] = ddp__coll_run_p2p,
    [K_RECV] = ddp__coll_run_p2p,
    [K_REDUCE_SCATTER_APPLY] = ddp__coll_run_reduce_scatter_apply,
};

/* The task: one operation through its kind's row. */
static ddp_status_t task(ddp_group_t *g, void *arg)
{
    const coll_args_t *a = arg;
    coll_header_t h = ddp__coll_header_of(g, a);
    return runs[a->kind](g, a, &h);
}

ddp_status_t ddp__coll_launch(ddp_group_t *g, coll_args_t *a, ddp_work_t **work)
{
    return ddp__group_task(g, task, a, ddp__coll_free_args, work);
}
