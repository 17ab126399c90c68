/* The TCP transport's algorithms (tcp_private.h): the pipelined ring (allreduce, and its halves
 * reduce_scatter and allgather), recursive doubling for small allreduces, and the broadcast
 * chain, each a sequence of the engine's exchanges (tcp_engine.c). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/reduce.h"
#include "transport/tcp/tcp_private.h"

static _Atomic size_t chunk_bytes = 512 * 1024;

void ddp__tcp_set_chunk_bytes(size_t bytes) { chunk_bytes = bytes < 64 ? 64 : bytes; }

/* ---- the ring -------------------------------------------------------------------------------
 * Segment j of the vector has seg_cnt[j] elements at seg_off[j]. At reduce-scatter step s rank r
 * sends segment (r - s + shift) and receives (r - s - 1 + shift) from r - 1, combining it with its
 * own; after n - 1 steps it owns segment (r + 1 + shift), fully reduced. Allgather steps then
 * pass owned segments on: at step s rank r sends (own - s) and receives (own - s - 1). Every
 * step's outgoing segment is the previous step's incoming one, chunk by chunk: that is what the
 * `after` links express. */
typedef struct ring {
    tcp_state_t *t;
    const ddp__collective_t *c;
    int n;
    size_t *seg_off, *seg_cnt;
    size_t chunk; /* elements */
    /* reduce-scatter: my contribution `src`, partial sums `acc`, incoming chunks `tmp` */
    const char *src;
    char *acc;
    char *tmp;
    ddp_dtype_t at;
    size_t as;
    /* the owned segment, finished, goes to final (element i of the owned segment at
     * final + (i - final_from) * out size) */
    char *final;
    size_t final_from;
    /* allgather: the output vector */
    char *out;
    size_t os;
    /* per incoming piece: what it is */
    struct rinfo {
        int rs;   /* 1: a reduce-scatter chunk to combine; 0: allgather, already in place */
        int last; /* last reduce-scatter step: finish the chunk */
        size_t elem, count;
    } *info;
} ring_t;

static void ring_on_recv(void *ctx, size_t i)
{
    ring_t *g = ctx;
    const struct rinfo *ri = &g->info[i];
    if (!ri->rs) return;
    char *acc = g->acc + ri->elem * g->as;
    /* Combine as (incoming partial) op (mine): the same order on every rank for a segment. */
    ddp__acc_combine(acc, g->tmp, g->src + ri->elem * g->as, ri->count, g->at, g->c->op);
    if (ri->last && g->final)
        ddp__acc_finish(g->final + (ri->elem - g->final_from) * ddp_dtype_size(g->c->dtype), acc,
                        ri->count, g->c->dtype, g->at, g->c->op, g->n);
}

static size_t nchunks(size_t count, size_t chunk) { return (count + chunk - 1) / chunk; }

/* rs_steps and ag_steps are each 0 or n - 1. */
static ddp_status_t ring_run(ring_t *g, int rs_steps, int ag_steps, int shift)
{
    tcp_state_t *t = g->t;
    int n = g->n, r = t->rank;
    int steps = rs_steps + ag_steps;
    int own = ((r + 1 + shift) % n + n) % n;
    if (rs_steps == 0) own = ((r + shift) % n + n) % n;
    int *sseg = malloc(sizeof(int) * 2 * (size_t)steps);
    size_t *rbase = malloc(sizeof(size_t) * ((size_t)steps + 1));
    if (!sseg || !rbase) {
        free(sseg);
        free(rbase);
        return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: ring plan");
    }
    int *rseg = sseg + steps;
    size_t nsend = 0, nrecv = 0;
    for (int s = 0; s < steps; s++) {
        if (s < rs_steps) {
            sseg[s] = (((r - s + shift) % n) + n) % n;
            rseg[s] = (((r - s - 1 + shift) % n) + n) % n;
        } else {
            int a = s - rs_steps;
            sseg[s] = (((own - a) % n) + n) % n;
            rseg[s] = (((own - a - 1) % n) + n) % n;
        }
        rbase[s] = nrecv;
        nsend += nchunks(g->seg_cnt[sseg[s]], g->chunk);
        nrecv += nchunks(g->seg_cnt[rseg[s]], g->chunk);
    }
    rbase[steps] = nrecv;
    piece_t *sp = calloc(nsend + 1, sizeof *sp);
    piece_t *rp = calloc(nrecv + 1, sizeof *rp);
    g->info = calloc(nrecv + 1, sizeof *g->info);
    ddp_status_t status = DDP_OK;
    if (!sp || !rp || !g->info) {
        status = ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: ring plan");
        goto done;
    }
    size_t si = 0, ri = 0;
    for (int s = 0; s < steps; s++) {
        int rs = s < rs_steps;
        size_t esz = rs ? g->as : g->os;
        /* outgoing */
        int seg = sseg[s];
        size_t k = 0;
        for (size_t e = 0; e < g->seg_cnt[seg]; e += g->chunk, k++) {
            size_t cnt = g->seg_cnt[seg] - e < g->chunk ? g->seg_cnt[seg] - e : g->chunk;
            size_t elem = g->seg_off[seg] + e;
            const char *base = rs ? (s == 0 ? g->src : g->acc) : g->out;
            sp[si].buf = (char *)base + elem * esz;
            sp[si].bytes = cnt * esz;
            sp[si].after = s == 0 ? -1 : (long)(rbase[s - 1] + k);
            si++;
        }
        /* incoming */
        seg = rseg[s];
        for (size_t e = 0; e < g->seg_cnt[seg]; e += g->chunk) {
            size_t cnt = g->seg_cnt[seg] - e < g->chunk ? g->seg_cnt[seg] - e : g->chunk;
            size_t elem = g->seg_off[seg] + e;
            rp[ri].buf = rs ? g->tmp : g->out + elem * esz;
            rp[ri].bytes = cnt * esz;
            rp[ri].after = -1;
            g->info[ri].rs = rs;
            g->info[ri].last = rs && s == rs_steps - 1;
            g->info[ri].elem = elem;
            g->info[ri].count = cnt;
            ri++;
        }
    }
    flow_t out = {(r + 1) % n, DDP_TCP_FRAME_DATA, sp, nsend, 0, 0, {0}};
    flow_t in = {(r - 1 + n) % n, DDP_TCP_FRAME_DATA, rp, nrecv, 0, 0, {0}};
    status = ddp__tcp_exchange(t, g->c, &out, &in, ring_on_recv, g);
done:
    free(sp);
    free(rp);
    free(g->info);
    g->info = NULL;
    free(sseg);
    free(rbase);
    return status;
}

/* Splits `count` elements into n segments, the first count % n one element longer. */
static ddp_status_t split(size_t count, int n, size_t **off, size_t **cnt)
{
    *off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!*off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    *cnt = *off + n;
    size_t base = count / (size_t)n, extra = count % (size_t)n, at = 0;
    for (int j = 0; j < n; j++) {
        (*cnt)[j] = base + ((size_t)j < extra ? 1 : 0);
        (*off)[j] = at;
        at += (*cnt)[j];
    }
    return DDP_OK;
}

static size_t chunk_elems(size_t esize)
{
    size_t c = chunk_bytes / esize;
    return c ? c : 1;
}

ddp_status_t ddp__tcp_allreduce_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = t->world;
    g.at = at;
    g.as = as;
    g.os = es;
    g.out = c->recv;
    g.final = c->recv;
    g.final_from = 0;
    g.chunk = chunk_elems(as > es ? as : es);
    ddp_status_t s = ddp__tcp_ensure(&t->tmp, &t->tmp_bytes, g.chunk * as, "an incoming chunk");
    if (s != DDP_OK) return s;
    g.tmp = t->tmp;
    if (at != c->dtype) {
        s = ddp__tcp_ensure(&t->work, &t->work_bytes, c->count * as, "wider accumulation");
        if (s != DDP_OK) return s;
        ddp__acc_widen(t->work, c->send, c->count, c->dtype);
        g.src = t->work;
        g.acc = t->work;
    } else {
        /* Each segment is combined at most once on a rank, so partial sums can be written
         * straight into recv while `send` stays the source of this rank's contribution. */
        g.src = c->send;
        g.acc = c->recv;
    }
    s = split(c->count, g.n, &g.seg_off, &g.seg_cnt);
    if (s != DDP_OK) return s;
    s = ring_run(&g, g.n - 1, g.n - 1, 0);
    free(g.seg_off);
    return s;
}

ddp_status_t ddp__tcp_reduce_scatter_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world;
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    size_t total = c->count * (size_t)n;
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = n;
    g.at = at;
    g.as = as;
    g.os = es;
    g.chunk = chunk_elems(as);
    g.final = c->recv;
    g.final_from = c->count * (size_t)t->rank;
    ddp_status_t s = ddp__tcp_ensure(&t->tmp, &t->tmp_bytes, g.chunk * as, "an incoming chunk");
    if (s != DDP_OK) return s;
    g.tmp = t->tmp;
    s = ddp__tcp_ensure(&t->work, &t->work_bytes, total * as, "reduce-scatter partial sums");
    if (s != DDP_OK) return s;
    if (at != c->dtype) {
        ddp__acc_widen(t->work, c->send, total, c->dtype);
        g.src = t->work;
    } else {
        g.src = c->send;
    }
    g.acc = t->work;
    g.seg_off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!g.seg_off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    g.seg_cnt = g.seg_off + n;
    for (int j = 0; j < n; j++) {
        g.seg_off[j] = c->count * (size_t)j;
        g.seg_cnt[j] = c->count;
    }
    /* shift -1: rank r ends up owning segment r. */
    s = ring_run(&g, n - 1, 0, -1);
    free(g.seg_off);
    (void)es;
    return s;
}

ddp_status_t ddp__tcp_allgather_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world;
    size_t es = ddp_dtype_size(c->dtype);
    char *mine = (char *)c->recv + c->count * (size_t)t->rank * es;
    if (c->send != mine && c->count) memmove(mine, c->send, c->count * es);
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = n;
    g.os = es;
    g.as = es;
    g.out = c->recv;
    g.chunk = chunk_elems(es);
    g.seg_off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!g.seg_off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    g.seg_cnt = g.seg_off + n;
    for (int j = 0; j < n; j++) {
        g.seg_off[j] = c->count * (size_t)j;
        g.seg_cnt[j] = c->count;
    }
    ddp_status_t s = ring_run(&g, 0, n - 1, 0);
    free(g.seg_off);
    return s;
}

/* ---- recursive doubling (small allreduce) ---------------------------------------------------- */
static ddp_status_t swap_with(tcp_state_t *t, const ddp__collective_t *c, int peer, char *send,
                              size_t sbytes, char *recv, size_t rbytes)
{
    piece_t sp = {send, sbytes, -1}, rp = {recv, rbytes, -1};
    flow_t out = {peer, DDP_TCP_FRAME_DATA, &sp, send ? 1u : 0u, 0, 0, {0}};
    flow_t in = {peer, DDP_TCP_FRAME_DATA, &rp, recv ? 1u : 0u, 0, 0, {0}};
    return ddp__tcp_exchange(t, c, send ? &out : NULL, recv ? &in : NULL, NULL, NULL);
}

ddp_status_t ddp__tcp_allreduce_doubling(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world, r = t->rank;
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    size_t abytes = c->count * as;
    ddp_status_t s = ddp__tcp_ensure(&t->work, &t->work_bytes, 2 * abytes, "recursive doubling");
    if (s != DDP_OK) return s;
    char *acc = t->work, *tmp = t->work + abytes;
    if (at != c->dtype) ddp__acc_widen(acc, c->send, c->count, c->dtype);
    else memcpy(acc, c->send, abytes);

    int p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    int extra = n - p2;
    if (r >= p2) {
        /* Fold into rank r - p2, then receive the finished result from it. */
        s = swap_with(t, c, r - p2, acc, abytes, NULL, 0);
        if (s != DDP_OK) return s;
        return swap_with(t, c, r - p2, NULL, 0, c->recv, c->count * es);
    }
    if (r < extra) {
        s = swap_with(t, c, r + p2, NULL, 0, tmp, abytes);
        if (s != DDP_OK) return s;
        ddp__acc_combine(acc, acc, tmp, c->count, at, c->op);
    }
    for (int mask = 1; mask < p2; mask *= 2) {
        int peer = r ^ mask;
        s = swap_with(t, c, peer, acc, abytes, tmp, abytes);
        if (s != DDP_OK) return s;
        if (r < peer) ddp__acc_combine(acc, acc, tmp, c->count, at, c->op);
        else ddp__acc_combine(acc, tmp, acc, c->count, at, c->op);
    }
    ddp__acc_finish(c->recv, acc, c->count, c->dtype, at, c->op, n);
    if (r < extra) return swap_with(t, c, r + p2, c->recv, c->count * es, NULL, 0);
    return DDP_OK;
}

/* ---- broadcast: a pipelined chain from the root ---------------------------------------------- */
ddp_status_t ddp__tcp_broadcast_chain(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world, r = t->rank;
    size_t es = ddp_dtype_size(c->dtype);
    size_t bytes = c->count * es;
    char *buf = c->recv;
    int pos = (r - c->root + n) % n;
    if (pos == 0 && c->send && c->send != c->recv && bytes) memmove(buf, c->send, bytes);
    size_t chunk = chunk_elems(es) * es;
    size_t np = nchunks(bytes, chunk);
    piece_t *pieces = calloc(2 * np + 1, sizeof *pieces);
    if (!pieces) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: broadcast plan");
    piece_t *sp = pieces, *rp = pieces + np;
    for (size_t k = 0; k < np; k++) {
        size_t off = k * chunk;
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        rp[k].buf = sp[k].buf = buf + off;
        rp[k].bytes = sp[k].bytes = len;
        rp[k].after = -1;
        sp[k].after = pos == 0 ? -1 : (long)k;
    }
    flow_t out = {(r + 1) % n, DDP_TCP_FRAME_DATA, sp, np, 0, 0, {0}};
    flow_t in = {(r - 1 + n) % n, DDP_TCP_FRAME_DATA, rp, np, 0, 0, {0}};
    ddp_status_t s = ddp__tcp_exchange(t, c, pos == n - 1 ? NULL : &out, pos == 0 ? NULL : &in, NULL,
                              NULL);
    free(pieces);
    return s;
}

