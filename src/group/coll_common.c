/* What the derived collectives share (collectives.h): the rows of the kinds, the header every
 * rank agrees on and its agreement through one allgather, and the operation records. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

const coll_kind_info_t ddp__coll_kinds[K_COUNT] = {
    /* name, has_op, has_root, hashes_counts */
    [K_REDUCE] = {"reduce", 1, 1, 0},
    [K_GATHER] = {"gather", 0, 1, 0},
    [K_SCATTER] = {"scatter", 0, 1, 0},
    [K_ALLTOALL] = {"alltoall", 0, 0, 0},
    [K_ALLGATHERV] = {"allgatherv", 0, 0, 1},
    [K_REDUCE_SCATTERV] = {"reduce_scatterv", 1, 0, 1},
    [K_ALLTOALLV] = {"alltoallv", 0, 0, 0},
    [K_ALLREDUCE_COALESCED] = {"allreduce_coalesced", 1, 0, 1},
    [K_BROADCAST_COALESCED] = {"broadcast_coalesced", 0, 1, 1},
    [K_SEND] = {"send", 0, 0, 0},
    [K_RECV] = {"recv", 0, 0, 0},
    [K_REDUCE_SCATTER_APPLY] = {"reduce_scatter_apply", 1, 0, 0},
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
coll_header_t ddp__coll_header_of(ddp_group_t *g, const coll_args_t *a)
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

coll_args_t *ddp__coll_new_args(coll_args_t fields)
{
    coll_args_t *a = ddp__malloc(sizeof *a, "a collective's arguments");
    if (a) *a = fields;
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

