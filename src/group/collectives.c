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
 * This file holds what every kind shares: the table of kinds, the header check and the task
 * that runs one operation through its kind's row. The kinds themselves live by family in
 * coll_rooted.c, coll_vector.c, coll_coalesced.c and coll_p2p.c (collectives.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

const coll_kind_info_t ddp__coll_kinds[K_COUNT] = {
    /* name, has_op, has_root, hashes_counts, run */
    [K_REDUCE] = {"reduce", 1, 1, 0, ddp__coll_run_reduce},
    [K_GATHER] = {"gather", 0, 1, 0, ddp__coll_run_gather},
    [K_SCATTER] = {"scatter", 0, 1, 0, ddp__coll_run_scatter},
    [K_ALLTOALL] = {"alltoall", 0, 0, 0, ddp__coll_run_alltoall},
    [K_ALLGATHERV] = {"allgatherv", 0, 0, 1, ddp__coll_run_allgatherv},
    [K_REDUCE_SCATTERV] = {"reduce_scatterv", 1, 0, 1, ddp__coll_run_reduce_scatterv},
    [K_ALLTOALLV] = {"alltoallv", 0, 0, 0, ddp__coll_run_alltoallv},
    [K_ALLREDUCE_COALESCED] = {"allreduce_coalesced", 1, 0, 1, ddp__coll_run_coalesced},
    [K_BROADCAST_COALESCED] = {"broadcast_coalesced", 0, 1, 1, ddp__coll_run_coalesced},
    [K_SEND] = {"send", 0, 0, 0, ddp__coll_run_p2p},
    [K_RECV] = {"recv", 0, 0, 0, ddp__coll_run_p2p},
};

static const coll_kind_info_t *kind_info(int k)
{
    return k > 0 && k < K_COUNT ? &ddp__coll_kinds[k] : NULL;
}

static uint64_t hash_counts(const size_t *v, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = (uint64_t)v[i];
        for (int b = 0; b < 8; b++) {
            h ^= (x >> (8 * b)) & 0xff;
            h *= 1099511628211ULL;
        }
    }
    return h;
}

void ddp__coll_describe(const coll_header_t *h, char *buf, size_t size)
{
    const coll_kind_info_t *k = kind_info(h->kind);
    const char *name = k ? k->name : "unknown";
    if (h->magic != COLL_HEADER_MAGIC) {
        snprintf(buf, size, "a different collective (no %s header)", "libddp");
        return;
    }
    if (h->kind == K_SEND || h->kind == K_RECV) {
        snprintf(buf, size, "%s %s count %llu tag %d from rank %d to rank %d", name,
                 ddp_dtype_name((ddp_dtype_t)h->dtype), (unsigned long long)h->count, h->tag,
                 h->from, h->to);
        return;
    }
    char root[32] = "";
    if (k && k->has_root) snprintf(root, sizeof root, " root %d", h->root);
    snprintf(buf, size, "%s %s %s count %llu%s counts hash %016llx", name,
             ddp_dtype_name((ddp_dtype_t)h->dtype),
             k && k->has_op ? ddp_reduce_op_name((ddp_reduce_op_t)h->op) : "-",
             (unsigned long long)h->count, root, (unsigned long long)h->counts_hash);
}

ddp_status_t ddp__coll_fail_mismatch(ddp_group_t *g, const char *text)
{
    ddp__group_fail(g, DDP_ERR_MISMATCH, text, 0);
    return ddp__error(DDP_ERR_MISMATCH, "%s", text);
}

/* This rank's header for `a`: the count arrays every rank must share are hashed (per buffer for
 * the coalesced kinds, per rank for allgatherv and reduce_scatterv); alltoallv's differ by rank
 * and its runner checks them as a matrix. */
static coll_header_t header_of(ddp_group_t *g, const coll_args_t *a)
{
    const coll_kind_info_t *k = &ddp__coll_kinds[a->kind];
    coll_header_t h;
    memset(&h, 0, sizeof h);
    h.magic = COLL_HEADER_MAGIC;
    h.kind = (int32_t)a->kind;
    h.dtype = (int32_t)a->dtype;
    h.op = k->has_op ? (int32_t)a->op : 0;
    h.root = k->has_root ? a->root : 0;
    h.count = a->count;
    int coalesced = a->kind == K_ALLREDUCE_COALESCED || a->kind == K_BROADCAST_COALESCED;
    if (k->hashes_counts)
        h.counts_hash = hash_counts(a->counts, coalesced ? a->nbufs : (size_t)ddp_group_size(g));
    return h;
}

ddp_status_t ddp__coll_agree(ddp_group_t *g, const coll_header_t *mine, const void *extra,
                             size_t extra_bytes, unsigned char **all_out)
{
    int world = ddp_group_size(g);
    size_t rec = sizeof(coll_header_t) + extra_bytes;
    unsigned char *send = ddp__malloc(rec, "a collective's header");
    unsigned char *all = ddp__malloc(rec * (size_t)world, "the headers of every rank");
    if (!send || !all) {
        free(send);
        free(all);
        return DDP_ERR_NO_MEMORY;
    }
    memcpy(send, mine, sizeof *mine);
    if (extra_bytes) memcpy(send + sizeof *mine, extra, extra_bytes);
    ddp_status_t s = ddp_group_allgather(g, send, all, rec, DDP_U8);
    free(send);
    if (s != DDP_OK) {
        free(all);
        return s;
    }
    coll_header_t h0;
    memcpy(&h0, all, sizeof h0);
    for (int r = 1; r < world; r++) {
        coll_header_t hr;
        memcpy(&hr, all + (size_t)r * rec, sizeof hr);
        if (memcmp(&h0, &hr, sizeof h0) != 0) {
            char d0[256], dr[256], text[700];
            ddp__coll_describe(&h0, d0, sizeof d0);
            ddp__coll_describe(&hr, dr, sizeof dr);
            snprintf(text, sizeof text,
                     "collective mismatch (seen on rank %d): rank 0 called %s but rank %d called %s",
                     ddp_group_rank(g), d0, r, dr);
            free(all);
            return ddp__coll_fail_mismatch(g, text);
        }
    }
    if (all_out) *all_out = all;
    else free(all);
    return DDP_OK;
}

/* The task: one operation through its kind's row. */
static ddp_status_t task(ddp_group_t *g, void *arg)
{
    const coll_args_t *a = arg;
    coll_header_t h = header_of(g, a);
    return ddp__coll_kinds[a->kind].run(g, a, &h);
}

coll_args_t *ddp__coll_new_args(coll_kind_t kind, ddp_dtype_t dtype)
{
    coll_args_t *a = ddp__calloc(1, sizeof *a, "a collective's arguments");
    if (a) {
        a->kind = kind;
        a->dtype = dtype;
    }
    return a;
}

void ddp__coll_free_args(void *p)
{
    coll_args_t *a = p;
    if (!a) return;
    free(a->bufs);
    free(a->counts);
    free(a->displs);
    free(a->rcounts);
    free(a->rdispls);
    free(a);
}

size_t *ddp__coll_copy_sizes(const size_t *v, size_t n)
{
    size_t *c = ddp__malloc((n ? n : 1) * sizeof *c, "a copy of a count array");
    if (c && n) memcpy(c, v, n * sizeof *c);
    return c;
}

ddp_status_t ddp__coll_launch(ddp_group_t *g, coll_args_t *a, ddp_work_t **work)
{
    return ddp__group_task(g, task, a, ddp__coll_free_args, work);
}
