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
 * sends) DDP_ERR_MISMATCH on both sides instead of a hang. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/group_private.h"

#define TRY(expr)                                                                                 \
    do {                                                                                          \
        ddp_status_t try_status_ = (expr);                                                        \
        if (try_status_ != DDP_OK) return try_status_;                                            \
    } while (0)

typedef enum kind {
    K_REDUCE = 1,
    K_GATHER,
    K_SCATTER,
    K_ALLTOALL,
    K_ALLGATHERV,
    K_REDUCE_SCATTERV,
    K_ALLTOALLV,
    K_ALLREDUCE_COALESCED,
    K_BROADCAST_COALESCED,
    K_SEND,
    K_RECV,
} kind_t;

static const char *kind_name(int k)
{
    switch (k) {
    case K_REDUCE: return "reduce";
    case K_GATHER: return "gather";
    case K_SCATTER: return "scatter";
    case K_ALLTOALL: return "alltoall";
    case K_ALLGATHERV: return "allgatherv";
    case K_REDUCE_SCATTERV: return "reduce_scatterv";
    case K_ALLTOALLV: return "alltoallv";
    case K_ALLREDUCE_COALESCED: return "allreduce_coalesced";
    case K_BROADCAST_COALESCED: return "broadcast_coalesced";
    case K_SEND: return "send";
    case K_RECV: return "recv";
    }
    return "unknown";
}

static int kind_has_op(int k)
{
    return k == K_REDUCE || k == K_REDUCE_SCATTERV || k == K_ALLREDUCE_COALESCED;
}

static int kind_has_root(int k)
{
    return k == K_REDUCE || k == K_GATHER || k == K_SCATTER || k == K_BROADCAST_COALESCED;
}

/* What every rank must agree on; exchanged as bytes (one build, one byte order). */
typedef struct header {
    uint32_t magic;
    int32_t kind, dtype, op, root, tag;
    uint64_t count;
    uint64_t counts_hash; /* FNV-1a of the count array (variable-count and coalesced kinds) */
    int32_t from, to;      /* send/recv: global ranks of sender and receiver */
} header_t;

#define HEADER_MAGIC 0xddc011ecu

/* One operation, with copies of the caller's arrays (they need not outlive the call). */
typedef struct op_args {
    kind_t kind;
    const void *send;
    void *recv;
    size_t count;
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    int root; /* rooted kinds; peer for send/recv */
    int tag;
    size_t nbufs;
    void **bufs;         /* coalesced */
    size_t *counts;      /* coalesced: per buffer; v kinds: per rank (alltoallv: send counts) */
    size_t *displs;      /* v kinds: per rank, elements (alltoallv: send displacements) */
    size_t *rcounts;     /* alltoallv: receive counts */
    size_t *rdispls;     /* alltoallv: receive displacements */
    int *source;         /* recv from any source (root < 0): where the sender's rank goes */
} op_args_t;

static void free_args(void *p)
{
    op_args_t *a = p;
    if (!a) return;
    free(a->bufs);
    free(a->counts);
    free(a->displs);
    free(a->rcounts);
    free(a->rdispls);
    free(a);
}

static uint64_t hash_counts(const size_t *v, size_t n, uint64_t h)
{
    if (!h) h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = (uint64_t)v[i];
        for (int b = 0; b < 8; b++) {
            h ^= (x >> (8 * b)) & 0xff;
            h *= 1099511628211ULL;
        }
    }
    return h;
}

static void describe(const header_t *h, char *buf, size_t size)
{
    if (h->magic != HEADER_MAGIC) {
        snprintf(buf, size, "a different collective (no %s header)", "libddp");
        return;
    }
    if (h->kind == K_SEND || h->kind == K_RECV) {
        snprintf(buf, size, "%s %s count %llu tag %d from rank %d to rank %d", kind_name(h->kind),
                 ddp_dtype_name((ddp_dtype_t)h->dtype), (unsigned long long)h->count, h->tag,
                 h->from, h->to);
        return;
    }
    char root[32] = "";
    if (kind_has_root(h->kind)) snprintf(root, sizeof root, " root %d", h->root);
    snprintf(buf, size, "%s %s %s count %llu%s counts hash %016llx", kind_name(h->kind),
             ddp_dtype_name((ddp_dtype_t)h->dtype),
             kind_has_op(h->kind) ? ddp_reduce_op_name((ddp_reduce_op_t)h->op) : "-",
             (unsigned long long)h->count, root, (unsigned long long)h->counts_hash);
}

/* Breaks the group with a mismatch and returns it as this thread's error. */
static ddp_status_t fail_mismatch(ddp_group_t *g, const char *text)
{
    ddp__group_fail(g, DDP_ERR_MISMATCH, text, 0);
    return ddp__error(DDP_ERR_MISMATCH, "%s", text);
}

static header_t header_of(const op_args_t *a, uint64_t hash)
{
    header_t h;
    memset(&h, 0, sizeof h);
    h.magic = HEADER_MAGIC;
    h.kind = (int32_t)a->kind;
    h.dtype = (int32_t)a->dtype;
    h.op = kind_has_op(a->kind) ? (int32_t)a->op : 0;
    h.root = kind_has_root(a->kind) ? a->root : 0;
    h.count = a->count;
    h.counts_hash = hash;
    return h;
}

/* Allgathers `mine` (header then `extra` bytes) into *all (world records, malloc'd) and checks
 * every header against rank 0's. */
static ddp_status_t agree(ddp_group_t *g, const header_t *mine, const void *extra,
                          size_t extra_bytes, unsigned char **all_out)
{
    int world = ddp_group_size(g);
    size_t rec = sizeof(header_t) + extra_bytes;
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
    header_t h0;
    memcpy(&h0, all, sizeof h0);
    for (int r = 1; r < world; r++) {
        header_t hr;
        memcpy(&hr, all + (size_t)r * rec, sizeof hr);
        if (memcmp(&h0, &hr, sizeof h0) != 0) {
            char d0[256], dr[256], text[700];
            describe(&h0, d0, sizeof d0);
            describe(&hr, dr, sizeof dr);
            snprintf(text, sizeof text,
                     "collective mismatch (seen on rank %d): rank 0 called %s but rank %d called %s",
                     ddp_group_rank(g), d0, r, dr);
            free(all);
            return fail_mismatch(g, text);
        }
    }
    if (all_out) *all_out = all;
    else free(all);
    return DDP_OK;
}

static void *scratch(size_t bytes)
{
    return ddp__malloc(bytes ? bytes : 1, "collective scratch memory");
}

/* ---- the tasks ----------------------------------------------------------------------------- */

static size_t esize_of(const op_args_t *a) { return ddp_dtype_size(a->dtype); }

static ddp_status_t task(ddp_group_t *g, void *arg)
{
    op_args_t *a = arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = esize_of(a);
    ddp_status_t s = DDP_OK;
    void *tmp = NULL, *tmp2 = NULL;
    unsigned char *all = NULL;
    /* Count arrays every rank must share: per buffer (coalesced) or per rank (allgatherv,
     * reduce_scatterv). alltoallv's differ by rank and are checked as a matrix below. */
    uint64_t hash = 0;
    if (a->kind == K_ALLREDUCE_COALESCED || a->kind == K_BROADCAST_COALESCED)
        hash = hash_counts(a->counts, a->nbufs, 0);
    else if (a->kind == K_ALLGATHERV || a->kind == K_REDUCE_SCATTERV)
        hash = hash_counts(a->counts, (size_t)world, 0);
    header_t h = header_of(a, hash);

    switch (a->kind) {
    case K_REDUCE: {
        TRY(agree(g, &h, NULL, 0, NULL));
        void *out = a->recv;
        if (rank != a->root) {
            out = tmp = scratch(a->count * es);
            if (!tmp) return DDP_ERR_NO_MEMORY;
        }
        s = ddp_group_allreduce(g, a->send, out, a->count, a->dtype, a->op);
        break;
    }
    case K_GATHER: {
        TRY(agree(g, &h, NULL, 0, NULL));
        void *out = a->recv;
        if (rank != a->root) {
            out = tmp = scratch(a->count * es * (size_t)world);
            if (!tmp) return DDP_ERR_NO_MEMORY;
        }
        s = ddp_group_allgather(g, a->send, out, a->count, a->dtype);
        break;
    }
    case K_SCATTER: {
        TRY(agree(g, &h, NULL, 0, NULL));
        size_t block = a->count * es;
        if (rank == a->root) {
            /* The root's send is only read by a broadcast. */
            s = ddp_group_broadcast(g, (void *)a->send, a->count * (size_t)world, a->dtype, a->root);
            const char *mine = (const char *)a->send + (size_t)rank * block;
            if (s == DDP_OK && (const void *)mine != a->recv && block) memmove(a->recv, mine, block);
        } else {
            tmp = scratch(block * (size_t)world);
            if (!tmp) return DDP_ERR_NO_MEMORY;
            s = ddp_group_broadcast(g, tmp, a->count * (size_t)world, a->dtype, a->root);
            if (s == DDP_OK && block) memcpy(a->recv, (char *)tmp + (size_t)rank * block, block);
        }
        break;
    }
    case K_ALLTOALL: {
        TRY(agree(g, &h, NULL, 0, NULL));
        /* Every rank's whole send buffer reaches every rank (world * world * count elements):
         * simple and right on every transport; each rank keeps its column. */
        size_t row = a->count * es * (size_t)world;
        tmp = scratch(row * (size_t)world);
        if (!tmp) return DDP_ERR_NO_MEMORY;
        s = ddp_group_allgather(g, a->send, tmp, a->count * (size_t)world, a->dtype);
        if (s == DDP_OK)
            for (int j = 0; j < world; j++)
                memcpy((char *)a->recv + (size_t)j * a->count * es,
                       (char *)tmp + (size_t)j * row + (size_t)rank * a->count * es, a->count * es);
        break;
    }
    case K_ALLGATHERV: {
        TRY(agree(g, &h, NULL, 0, NULL));
        size_t max = 0;
        int uniform = 1;
        for (int r = 0; r < world; r++) {
            if (a->counts[r] > max) max = a->counts[r];
            if (a->counts[r] != a->counts[0] || a->displs[r] != (size_t)r * a->counts[0]) uniform = 0;
        }
        if (uniform) {
            s = ddp_group_allgather(g, a->send, a->recv, a->counts[0], a->dtype);
            break;
        }
        /* Unequal counts: every block padded to the largest, one allgather, then unpacked. */
        tmp = scratch(max * es);
        tmp2 = scratch(max * es * (size_t)world);
        if (!tmp || !tmp2) {
            s = DDP_ERR_NO_MEMORY;
            break;
        }
        memset(tmp, 0, max * es);
        if (a->counts[rank]) memcpy(tmp, a->send, a->counts[rank] * es);
        s = ddp_group_allgather(g, tmp, tmp2, max, a->dtype);
        if (s == DDP_OK)
            for (int r = 0; r < world; r++)
                if (a->counts[r])
                    memmove((char *)a->recv + a->displs[r] * es, (char *)tmp2 + (size_t)r * max * es,
                            a->counts[r] * es);
        break;
    }
    case K_REDUCE_SCATTERV: {
        TRY(agree(g, &h, NULL, 0, NULL));
        size_t max = 0;
        int uniform = 1;
        for (int r = 0; r < world; r++) {
            if (a->counts[r] > max) max = a->counts[r];
            if (a->counts[r] != a->counts[0]) uniform = 0;
        }
        if (uniform) {
            s = ddp_group_reduce_scatter(g, a->send, a->recv, a->counts[0], a->dtype, a->op);
            break;
        }
        /* Unequal counts: every rank's block padded to the largest, one reduce_scatter. */
        tmp = scratch(max * es * (size_t)world);
        tmp2 = scratch(max * es);
        if (!tmp || !tmp2) {
            s = DDP_ERR_NO_MEMORY;
            break;
        }
        memset(tmp, 0, max * es * (size_t)world);
        size_t off = 0;
        for (int r = 0; r < world; r++) {
            if (a->counts[r])
                memcpy((char *)tmp + (size_t)r * max * es, (const char *)a->send + off * es,
                       a->counts[r] * es);
            off += a->counts[r];
        }
        s = ddp_group_reduce_scatter(g, tmp, tmp2, max, a->dtype, a->op);
        if (s == DDP_OK && a->counts[rank]) memcpy(a->recv, tmp2, a->counts[rank] * es);
        break;
    }
    case K_ALLTOALLV: {
        /* Every rank's send and receive counts go to every rank with the header, so every rank
         * checks the whole matrix (rank i's receive count from j must be j's send count to i)
         * and reaches the same verdict. */
        size_t row = 2 * (size_t)world * sizeof(uint64_t);
        uint64_t *mine = ddp__malloc(row, "alltoallv counts");
        if (!mine) return DDP_ERR_NO_MEMORY;
        for (int j = 0; j < world; j++) {
            mine[j] = a->counts[j];
            mine[world + j] = a->rcounts[j];
        }
        s = agree(g, &h, mine, row, &all);
        free(mine);
        if (s != DDP_OK) return s;
        size_t rec = sizeof(header_t) + row;
        uint64_t *S = ddp__malloc(row * (size_t)world, "alltoallv count matrix");
        if (!S) {
            free(all);
            return DDP_ERR_NO_MEMORY;
        }
        for (int i = 0; i < world; i++) memcpy(S + (size_t)i * 2 * world, all + (size_t)i * rec + sizeof(header_t), row);
        free(all);
        all = NULL;
#define SEND_COUNT(i, j) S[(size_t)(i) * 2 * world + (size_t)(j)]
#define RECV_COUNT(i, j) S[(size_t)(i) * 2 * world + (size_t)world + (size_t)(j)]
        for (int i = 0; i < world && s == DDP_OK; i++)
            for (int j = 0; j < world; j++)
                if (RECV_COUNT(i, j) != SEND_COUNT(j, i)) {
                    char text[400];
                    snprintf(text, sizeof text,
                             "alltoallv mismatch (seen on rank %d): rank %d expects %llu elements "
                             "from rank %d, which sends it %llu",
                             rank, i, (unsigned long long)RECV_COUNT(i, j), j,
                             (unsigned long long)SEND_COUNT(j, i));
                    s = fail_mismatch(g, text);
                    break;
                }
        if (s != DDP_OK) {
            free(S);
            return s;
        }
        /* Each rank packs what it sends, in destination order, padded to the largest total. */
        size_t max = 0;
        for (int i = 0; i < world; i++) {
            size_t t = 0;
            for (int j = 0; j < world; j++) t += SEND_COUNT(i, j);
            if (t > max) max = t;
        }
        tmp = scratch(max * es);
        tmp2 = scratch(max * es * (size_t)world);
        if (!tmp || !tmp2) {
            free(S);
            s = DDP_ERR_NO_MEMORY;
            break;
        }
        memset(tmp, 0, max * es);
        size_t off = 0;
        for (int j = 0; j < world; j++) {
            if (a->counts[j])
                memcpy((char *)tmp + off * es, (const char *)a->send + a->displs[j] * es,
                       a->counts[j] * es);
            off += a->counts[j];
        }
        s = ddp_group_allgather(g, tmp, tmp2, max, a->dtype);
        if (s == DDP_OK)
            for (int j = 0; j < world; j++) {
                size_t at = 0;
                for (int k = 0; k < rank; k++) at += SEND_COUNT(j, k);
                if (a->rcounts[j])
                    memcpy((char *)a->recv + a->rdispls[j] * es,
                           (char *)tmp2 + ((size_t)j * max + at) * es, a->rcounts[j] * es);
            }
#undef SEND_COUNT
#undef RECV_COUNT
        free(S);
        break;
    }
    case K_ALLREDUCE_COALESCED:
    case K_BROADCAST_COALESCED: {
        TRY(agree(g, &h, NULL, 0, NULL));
        /* One collective over the buffers packed end to end. */
        tmp = scratch(a->count * es);
        if (!tmp) return DDP_ERR_NO_MEMORY;
        int packs = a->kind == K_ALLREDUCE_COALESCED || rank == a->root;
        size_t off = 0;
        if (packs)
            for (size_t i = 0; i < a->nbufs; i++) {
                if (a->counts[i]) memcpy((char *)tmp + off * es, a->bufs[i], a->counts[i] * es);
                off += a->counts[i];
            }
        if (a->kind == K_ALLREDUCE_COALESCED)
            s = ddp_group_allreduce(g, tmp, tmp, a->count, a->dtype, a->op);
        else
            s = ddp_group_broadcast(g, tmp, a->count, a->dtype, a->root);
        off = 0;
        if (s == DDP_OK && !(a->kind == K_BROADCAST_COALESCED && rank == a->root))
            for (size_t i = 0; i < a->nbufs; i++) {
                if (a->counts[i]) memcpy(a->bufs[i], (char *)tmp + off * es, a->counts[i] * es);
                off += a->counts[i];
            }
        break;
    }
    case K_SEND:
    case K_RECV: {
        int peer = a->root;
        ddp_group_t *pair = NULL;
        /* From any source: the peer whose announced sends to this rank outnumber the recvs from
         * it has its next message to this rank waiting (group.c); the recv is then a named one. */
        if (peer < 0) s = ddp__group_p2p_any_source(g, a->tag, &peer);
        /* Announced before the pair is made: a first message's pair needs the receiver, which
         * learns of it from the announcement. */
        if (s == DDP_OK) s = ddp__group_p2p_count(g, peer, a->kind == K_SEND);
        if (s == DDP_OK) s = ddp__group_pair(g, peer, &pair);
        if (s == DDP_OK && a->source) *a->source = peer;
        if (s != DDP_OK) {
            char text[DDP_ERROR_TEXT_MAX];
            snprintf(text, sizeof text, "%s", ddp_last_error());
            ddp__group_fail(g, s, text, 1);
            return ddp__error(s, "%s", text);
        }
        header_t mine = h;
        mine.tag = a->tag;
        mine.from = a->kind == K_SEND ? rank : peer;
        mine.to = a->kind == K_SEND ? peer : rank;
        header_t both[2];
        s = ddp_group_allgather(pair, &mine, both, sizeof mine, DDP_U8);
        int sender_in_pair = (a->kind == K_SEND) == (rank < peer) ? 0 : 1;
        if (s == DDP_OK && (both[0].kind == both[1].kind || both[0].dtype != both[1].dtype ||
                            both[0].count != both[1].count || both[0].tag != both[1].tag ||
                            both[0].magic != HEADER_MAGIC || both[1].magic != HEADER_MAGIC)) {
            char d0[256], d1[256], text[700];
            describe(&both[0], d0, sizeof d0);
            describe(&both[1], d1, sizeof d1);
            int lo = rank < peer ? rank : peer, hi = rank < peer ? peer : rank;
            snprintf(text, sizeof text,
                     "point-to-point mismatch (seen on rank %d): rank %d called %s but rank %d "
                     "called %s",
                     rank, lo, d0, hi, d1);
            /* Both sides of the pair know; the parent's other ranks learn through its abort. */
            ddp__group_fail(pair, DDP_ERR_MISMATCH, text, 0);
            ddp__group_fail(g, DDP_ERR_MISMATCH, text, 1);
            return ddp__error(DDP_ERR_MISMATCH, "%s", text);
        }
        if (s == DDP_OK)
            s = ddp_group_broadcast(pair, a->kind == K_SEND ? (void *)a->send : a->recv, a->count,
                                    a->dtype, sender_in_pair);
        if (s != DDP_OK) {
            /* The pair's text numbers its ranks 0 and 1: say who they are. */
            char text[DDP_ERROR_TEXT_MAX];
            int lo = rank < peer ? rank : peer, hi = rank < peer ? peer : rank;
            snprintf(text, sizeof text,
                     "%s %s rank %d (tag %d) failed on rank %d (in its pair group rank 0 is "
                     "rank %d, rank 1 is rank %d): %s",
                     kind_name(a->kind), a->kind == K_SEND ? "to" : "from", peer, a->tag, rank, lo,
                     hi, ddp_last_error());
            ddp__group_fail(g, s, text, 1);
            return ddp__error(s, "%s", text);
        }
        break;
    }
    }
    free(tmp);
    free(tmp2);
    free(all);
    return s;
}

/* ---- argument checks and issuing ----------------------------------------------------------- */

static ddp_status_t check_common(ddp_group_t *g, ddp_dtype_t dtype, const char *fn)
{
    if (!g) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: group is NULL", fn);
    if ((unsigned)dtype >= DDP_DTYPE_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a valid ddp_dtype_t", fn,
                          (int)dtype);
    return DDP_OK;
}

static ddp_status_t check_op(ddp_reduce_op_t op, const char *fn)
{
    if ((unsigned)op >= DDP_OP_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a valid ddp_reduce_op_t", fn,
                          (int)op);
    return DDP_OK;
}

static ddp_status_t check_root(ddp_group_t *g, int root, const char *fn, const char *what)
{
    if (root < 0 || root >= ddp_group_size(g))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s %d is out of range [0, %d)", fn, what,
                          root, ddp_group_size(g));
    return DDP_OK;
}

/* n elements (times `times`) of dtype must have a byte count far from overflow. */
static ddp_status_t check_size(size_t n, size_t times, ddp_dtype_t dtype, const char *fn,
                               const char *name)
{
    if (times == 0) times = 1;
    if (n > (SIZE_MAX / 4) / ddp_dtype_size(dtype) / times)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s %zu is too large", fn, name, n);
    return DDP_OK;
}

static ddp_status_t check_buffer(const void *p, size_t count, const char *fn, const char *name)
{
    if (count > 0 && !p)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with %zu elements", fn, name,
                          count);
    return DDP_OK;
}

static op_args_t *new_args(kind_t kind, ddp_dtype_t dtype)
{
    op_args_t *a = ddp__calloc(1, sizeof *a, "a collective's arguments");
    if (a) {
        a->kind = kind;
        a->dtype = dtype;
    }
    return a;
}

static size_t *copy_sizes(const size_t *v, size_t n)
{
    size_t *c = ddp__malloc((n ? n : 1) * sizeof *c, "a copy of a count array");
    if (c && n) memcpy(c, v, n * sizeof *c);
    return c;
}

/* Issues (work != NULL) or runs (work == NULL) the task; frees `a` either way. */
static ddp_status_t launch(ddp_group_t *g, op_args_t *a, ddp_work_t **work)
{
    return ddp__group_task(g, task, a, free_args, work);
}

static ddp_status_t do_p2p(ddp_group_t *g, kind_t kind, const void *send, void *recv,
                           size_t count, ddp_dtype_t dtype, int peer, int tag, ddp_work_t **work,
                           const char *fn)
{
    ddp__clear_error();
    TRY(check_common(g, dtype, fn));
    TRY(check_size(count, 1, dtype, fn, "count"));
    TRY(check_buffer(kind == K_SEND ? send : recv, count, fn, "buf"));
    TRY(check_root(g, peer, fn, "peer"));
    if (peer == ddp_group_rank(g))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: peer %d is this rank (a message to itself would wait for its own "
                          "matching call, which issue order puts after it)", fn, peer);
    op_args_t *a = new_args(kind, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    a->root = peer;
    a->tag = tag;
    return launch(g, a, work);
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
    TRY(check_common(g, dtype, fn));
    TRY(check_size(count, 1, dtype, fn, "count"));
    TRY(check_buffer(recv, count, fn, "buf"));
    if (!source) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: source is NULL", fn);
    if (ddp_group_size(g) < 2)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: a group of one rank has no other rank to receive from", fn);
    if (!ddp__group_recv_any_enabled(g))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s (tag %d) on rank %d: the group was not enabled for it "
                          "(ddp_group_enable_recv_any on every rank before its first send)",
                          fn, tag, ddp_group_rank(g));
    op_args_t *a = new_args(K_RECV, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->recv = recv;
    a->count = count;
    a->root = -1;
    a->tag = tag;
    a->source = source;
    return launch(g, a, work);
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

static ddp_status_t do_reduce(ddp_group_t *g, const void *send, void *recv, size_t count,
                              ddp_dtype_t dtype, ddp_reduce_op_t op, int root, ddp_work_t **work,
                              const char *fn)
{
    ddp__clear_error();
    TRY(check_common(g, dtype, fn));
    TRY(check_op(op, fn));
    TRY(check_size(count, 1, dtype, fn, "count"));
    TRY(check_root(g, root, fn, "root"));
    TRY(check_buffer(send, count, fn, "send"));
    if (ddp_group_rank(g) == root) TRY(check_buffer(recv, count, fn, "recv (on the root)"));
    op_args_t *a = new_args(K_REDUCE, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    a->op = op;
    a->root = root;
    return launch(g, a, work);
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

static ddp_status_t do_rooted(ddp_group_t *g, kind_t kind, const void *send, void *recv,
                              size_t count, ddp_dtype_t dtype, int root, ddp_work_t **work,
                              const char *fn)
{
    ddp__clear_error();
    TRY(check_common(g, dtype, fn));
    TRY(check_size(count, (size_t)ddp_group_size(g), dtype, fn, "count"));
    TRY(check_root(g, root, fn, "root"));
    int is_root = ddp_group_rank(g) == root;
    size_t world = (size_t)ddp_group_size(g);
    if (kind == K_GATHER) {
        TRY(check_buffer(send, count, fn, "send"));
        if (is_root) TRY(check_buffer(recv, count * world, fn, "recv (on the root)"));
    } else {
        TRY(check_buffer(recv, count, fn, "recv"));
        if (is_root) TRY(check_buffer(send, count * world, fn, "send (on the root)"));
    }
    op_args_t *a = new_args(kind, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    a->root = root;
    return launch(g, a, work);
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
    TRY(check_common(g, dtype, fn));
    size_t world = (size_t)ddp_group_size(g);
    TRY(check_size(count, world * world, dtype, fn, "count"));
    TRY(check_buffer(send, count * world, fn, "send"));
    TRY(check_buffer(recv, count * world, fn, "recv"));
    op_args_t *a = new_args(K_ALLTOALL, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->send = send;
    a->recv = recv;
    a->count = count;
    return launch(g, a, work);
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
        TRY(check_size(counts[r], 1, dtype, fn, cname));
        sum += counts[r];
        TRY(check_size(sum, 1, dtype, fn, "the sum of counts"));
    }
    size_t *c = copy_sizes(counts, (size_t)world);
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
        if (displs && check_size(displs[r] + counts[r], 1, dtype, fn, "displacement") != DDP_OK) {
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
    TRY(check_common(g, dtype, fn));
    op_args_t *a = new_args(K_ALLGATHERV, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t total = 0;
    ddp_status_t s = copy_v(g, recv_counts, displs, dtype, fn, "recv_counts", &a->counts,
                            &a->displs, &total);
    if (s == DDP_OK && recv_counts[ddp_group_rank(g)] != send_count)
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                       "%s: send_count %zu differs from recv_counts[%d] = %zu (this rank's entry)",
                       fn, send_count, ddp_group_rank(g), recv_counts[ddp_group_rank(g)]);
    if (s == DDP_OK) s = check_buffer(send, send_count, fn, "send");
    if (s == DDP_OK) s = check_buffer(recv, total, fn, "recv");
    if (s != DDP_OK) {
        free_args(a);
        return s;
    }
    a->send = send;
    a->recv = recv;
    a->count = total;
    return launch(g, a, work);
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
    TRY(check_common(g, dtype, fn));
    TRY(check_op(op, fn));
    op_args_t *a = new_args(K_REDUCE_SCATTERV, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t total = 0;
    ddp_status_t s = copy_v(g, recv_counts, NULL, dtype, fn, "recv_counts", &a->counts,
                            &a->displs, &total);
    if (s == DDP_OK) s = check_buffer(send, total, fn, "send");
    if (s == DDP_OK) s = check_buffer(recv, recv_counts[ddp_group_rank(g)], fn, "recv");
    if (s != DDP_OK) {
        free_args(a);
        return s;
    }
    a->send = send;
    a->recv = recv;
    a->count = total;
    a->op = op;
    return launch(g, a, work);
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
    TRY(check_common(g, dtype, fn));
    op_args_t *a = new_args(K_ALLTOALLV, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    size_t stotal = 0, rtotal = 0;
    ddp_status_t s = copy_v(g, send_counts, send_displs, dtype, fn, "send_counts", &a->counts,
                            &a->displs, &stotal);
    if (s == DDP_OK)
        s = copy_v(g, recv_counts, recv_displs, dtype, fn, "recv_counts", &a->rcounts,
                   &a->rdispls, &rtotal);
    if (s == DDP_OK) s = check_buffer(send, stotal, fn, "send");
    if (s == DDP_OK) s = check_buffer(recv, rtotal, fn, "recv");
    if (s == DDP_OK && send && recv && send == recv && stotal)
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: send == recv (alltoallv is not in place)", fn);
    if (s != DDP_OK) {
        free_args(a);
        return s;
    }
    a->send = send;
    a->recv = recv;
    return launch(g, a, work);
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

static ddp_status_t do_coalesced(ddp_group_t *g, kind_t kind, void *const *bufs,
                                 const size_t *counts, size_t nbufs, ddp_dtype_t dtype,
                                 ddp_reduce_op_t op, int root, ddp_work_t **work, const char *fn)
{
    ddp__clear_error();
    TRY(check_common(g, dtype, fn));
    if (kind == K_ALLREDUCE_COALESCED) TRY(check_op(op, fn));
    else TRY(check_root(g, root, fn, "root"));
    if (nbufs > 0 && (!bufs || !counts))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bufs or counts is NULL with nbufs %zu", fn,
                          nbufs);
    size_t total = 0;
    for (size_t i = 0; i < nbufs; i++) {
        TRY(check_size(counts[i], 1, dtype, fn, "a count"));
        if (counts[i] > 0 && !bufs[i])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bufs[%zu] is NULL with count %zu", fn,
                              i, counts[i]);
        total += counts[i];
        TRY(check_size(total, 1, dtype, fn, "the sum of counts"));
    }
    op_args_t *a = new_args(kind, dtype);
    if (!a) return DDP_ERR_NO_MEMORY;
    a->bufs = ddp__malloc((nbufs ? nbufs : 1) * sizeof *a->bufs, "a copy of the buffer list");
    a->counts = copy_sizes(counts, nbufs);
    if (!a->bufs || !a->counts) {
        free_args(a);
        return DDP_ERR_NO_MEMORY;
    }
    if (nbufs) memcpy(a->bufs, bufs, nbufs * sizeof *a->bufs);
    a->nbufs = nbufs;
    a->count = total;
    a->op = op;
    a->root = root;
    return launch(g, a, work);
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
