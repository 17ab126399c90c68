/* Broadcast, allgather, alltoall and reduce-scatter from registered memory (issue #27): when
 * every rank's source (a broadcast's buffer, the others' send) is in registered memory and the
 * views of it are agreed, each rank reads what it needs of its peers' sources where they lie:
 * one copy per byte (a reduce-scatter: one read of each input) instead of a copy into the stage
 * and one out of it (rounds) or a system call per peer (single copy). The edges outside an
 * export's whole pages come from the owner's stage, as in the mapped allreduce.
 *
 * Whether to try is agreed state, per size class: every call while tries find every source
 * registered; after m misses in a row (a try costs its one phase when it misses), 2^(m-1) - 1
 * calls untried, at most 63. So a buffer registered now and then goes mapped when it comes,
 * DDP_SHM_MAP=auto (which registers a buffer the second time it sees it) gets its chance, and a
 * class whose sources are never registered pays a phase once in 64 calls. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* Copies elements [a, b) of rank k's source (n elements, hint h) into dst: the pages through
 * this rank's view of its export, the edges from its stage of parity q. */
static void pull(shm_state_t *S, int k, const ddp__shm_map_hint_t *h, unsigned q, char *dst,
                 size_t n, size_t a, size_t b, size_t esize, int stream)
{
    size_t lo, hi;
    ddp__shm_covered(h, n, esize, &lo, &hi);
    const char *stage = stage_of(S, k, q);
    size_t x = a, y = b < lo ? b : lo; /* the head edge */
    if (y > x) memcpy(dst, stage + EDGE_SEND_HEAD + x * esize, (y - x) * esize);
    x = a > lo ? a : lo; /* the pages */
    y = b < hi ? b : hi;
    if (y > x)
        copy_out(dst + (x - a) * esize, ddp__shm_view_at(&S->views, k, h, h->addr + x * esize),
                 (y - x) * esize, stream);
    x = a > hi ? a : hi; /* the tail edge */
    if (b > x)
        memcpy(dst + (x - a) * esize, stage + EDGE_SEND_TAIL + (x - hi) * esize, (b - x) * esize);
}

/* A mapped broadcast with the copying shared out (every rank's buffer is registered and
 * agreed: the root's is read, the others' are written): each receiver's exported pages are cut
 * into `world` slices, and slice s of receiver r is copied from the root by rank (r + s) % world,
 * the root and the other receivers included, so every rank copies (world - 1) / world of the
 * buffer instead of the receivers copying all of it while the root waits. Two ranks on two
 * cores: two copies of half the buffer at once rather than one of all of it. A receiver also
 * copies the edges of its own buffer outside its pages (no view reaches them). The caller's
 * closing phase orders the writes before anyone returns. */
static void broadcast_shared(shm_state_t *S, const ddp__collective_t *c,
                             const ddp__shm_map_hint_t *hints, unsigned q, size_t esize,
                             int stream)
{
    const int p = S->world, me = S->rank, root = c->root;
    const size_t n = c->count;
    if (me != root) {
        size_t lo, hi;
        ddp__shm_covered(&hints[me], n, esize, &lo, &hi);
        pull(S, root, &hints[root], q, c->recv, n, 0, lo, esize, 0);
        pull(S, root, &hints[root], q, (char *)c->recv + hi * esize, n, hi, n, esize, 0);
    }
    for (int j = 0; j < p; j++) { /* receivers from this rank on: not all on one at once */
        const int r = (me + j) % p;
        if (r == root) continue;
        size_t lo, hi, a, b;
        ddp__shm_covered(&hints[r], n, esize, &lo, &hi);
        slice_of(hi - lo, p, (me - r + p) % p, esize, &a, &b);
        if (b <= a) continue;
        /* (Own buffer, r == me: the view is the buffer itself.) */
        char *dst = ddp__shm_view_at(&S->views, r, &hints[r], hints[r].addr + (lo + a) * esize);
        if (me == root)
            copy_out(dst, (const char *)c->recv + (lo + a) * esize, (b - a) * esize, stream);
        else
            pull(S, root, &hints[root], q, dst, n, lo + a, lo + b, esize, stream);
    }
}

/* Where element x of rank k's send (hint h, its pages [lo, hi)) lies for this rank: its own
 * buffer, a view of rank k's export, or an edge in rank k's stage of parity q. Elements from x to
 * the next cut point lie in the same place. */
static const void *source_at(shm_state_t *S, const ddp__collective_t *c, int k,
                             const ddp__shm_map_hint_t *h, size_t lo, size_t hi, unsigned q,
                             size_t x, size_t esize)
{
    const char *stage = stage_of(S, k, q);
    if (k == S->rank) return (const char *)c->send + x * esize;
    if (x < lo) return stage + EDGE_SEND_HEAD + x * esize;
    if (x < hi) return ddp__shm_view_at(&S->views, k, h, h->addr + x * esize);
    return stage + EDGE_SEND_TAIL + (x - hi) * esize;
}

/* Reduces block [a, a + n) of every rank's source (total elements each) into c->recv, in rank
 * order with the kernel every other path uses (the same bytes whichever ran): between two cut
 * points every rank's elements lie in one place, its export's pages or an edge in its stage. */
static void reduce_block(shm_state_t *S, const ddp__collective_t *c,
                         const ddp__shm_map_hint_t *hints, unsigned q, size_t total, size_t a,
                         size_t n, size_t esize)
{
    const int p = S->world;
    size_t lo_of[DDP__SHM_MAX_WORLD], hi_of[DDP__SHM_MAX_WORLD];
    size_t cuts[2 * DDP__SHM_MAX_WORLD + 2];
    int ncuts = 0;
    cuts[ncuts++] = a;
    cuts[ncuts++] = a + n;
    for (int k = 0; k < p; k++) {
        ddp__shm_covered(&hints[k], total, esize, &lo_of[k], &hi_of[k]);
        if (lo_of[k] > a && lo_of[k] < a + n) cuts[ncuts++] = lo_of[k];
        if (hi_of[k] > a && hi_of[k] < a + n) cuts[ncuts++] = hi_of[k];
    }
    ddp__shm_sort_cuts(cuts, ncuts);
    for (int i = 0; i + 1 < ncuts; i++) {
        const size_t x = cuts[i], y = cuts[i + 1];
        if (y <= x) continue;
        const void *srcs[DDP__SHM_MAX_WORLD];
        for (int k = 0; k < p; k++)
            srcs[k] = source_at(S, c, k, &hints[k], lo_of[k], hi_of[k], q, x, esize);
        ddp__reduce((char *)c->recv + (x - a) * esize, srcs, p, y - x, c->dtype, c->op);
    }
}

/* Stages this rank's edges of src (n elements, hint h) for the peers that pull it. */
static void stage_edges(shm_state_t *S, const ddp__shm_map_hint_t *h, const char *src, size_t n,
                        size_t esize)
{
    size_t lo, hi;
    ddp__shm_covered(h, n, esize, &lo, &hi);
    char *stage = stage_of(S, S->rank, (unsigned)(S->use & 1));
    if (lo) memcpy(stage + EDGE_SEND_HEAD, src, lo * esize);
    if (n > hi) memcpy(stage + EDGE_SEND_TAIL, src + hi * esize, (n - hi) * esize);
}

/* The try policy of a size class (see the top of the file): whether this call tries, and the
 * outcome of a try. */
static int should_try(shm_state_t *S, int key)
{
    if (!S->pull_skip[key]) return 1;
    S->pull_skip[key]--;
    return 0;
}

static void tried(shm_state_t *S, int key, int mapped)
{
    if (mapped) {
        S->pull_misses[key] = 0;
        return;
    }
    if (S->pull_misses[key] < 7) S->pull_misses[key]++;
    S->pull_skip[key] = (1u << (S->pull_misses[key] - 1)) - 1;
}

/* The first phase of a try, with this rank's hints for its first nbuf buffers in fp: whether
 * every rank published registered memory for all of them and the views are agreed (*mapped,
 * the same on every rank; hints[nbuf * k + b] then holds rank k's), recorded for the policy. */
static ddp_status_t agree_mapped(shm_state_t *S, const ddp__collective_t *c,
                                 const shm_fingerprint_t *fp, int nbuf, int key,
                                 ddp__shm_map_hint_t *hints, int *mapped)
{
    unsigned fparity;
    ddp_status_t s = ddp__shm_first_sync_data(S, c, fp, NULL, 0, 0, &fparity);
    if (s != DDP_OK) return s;
    ddp__shm_prune_views(S);
    int all = 1;
    for (int k = 0; k < S->world; k++)
        for (int b = 0; b < nbuf; b++) all &= S->ranks[k].map_hints[fparity][b].slot >= 0;
    *mapped = all && ddp__shm_decide_mapped(S, c, fparity, nbuf, hints, &s);
    if (s != DDP_OK) return s;
    tried(S, key, *mapped);
    if (*mapped) set_algorithm(S, DDP__SHM_ALG_MAPPED);
    return DDP_OK;
}

ddp_status_t ddp__shm_try_pulled(shm_state_t *S, const ddp__collective_t *c, int key, int *ran)
{
    *ran = 0;
    if (!should_try(S, key)) return DDP_OK;
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), n = c->count, block = n * esize;
    /* The source and its elements: a broadcast's buffer on every rank (the root's is read, the
     * others' need not be registered, but asking every rank keeps one rule); an allgather's
     * send; an alltoall's or reduce-scatter's whole send, of which each peer reads its block. */
    const char *src = c->kind == DDP__BROADCAST ? (const char *)c->recv : (const char *)c->send;
    const int blocks = c->kind == DDP__ALLTOALL || c->kind == DDP__REDUCE_SCATTER;
    const size_t total = blocks ? n * (size_t)p : n;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    /* An alltoall whose recv overlaps its send would overwrite what peers read: not mapped. */
    const int apart = c->kind != DDP__ALLTOALL ||
                      !ddp__overlaps(c->send, total * esize, c->recv, total * esize);
    const size_t moved = c->kind == DDP__ALLGATHER ? block * (size_t)p : total * esize;
    if (apart && ddp__shm_map_one(S, src, total * esize, moved, esize, &fp.map[0]))
        stage_edges(S, &fp.map[0], src, total, esize);
    ddp__shm_map_hint_t hints[DDP__SHM_MAX_WORLD];
    ddp_status_t s = agree_mapped(S, c, &fp, 1, key, hints, ran);
    if (s != DDP_OK || !*ran) return s;
    const unsigned q = (unsigned)(S->use++ & 1);
    const int streams_from_2m = c->kind == DDP__ALLGATHER || c->kind == DDP__ALLTOALL;
    const size_t stream_min = !S->mapped_stream           ? STREAM_MIN_BYTES
                              : c->kind == DDP__BROADCAST ? PULLED_BROADCAST_STREAM_MIN_BYTES
                              : streams_from_2m           ? MAPPED_STREAM_MIN_BYTES
                                                          : STREAM_MIN_BYTES;
    const int stream = block * (size_t)(c->kind == DDP__BROADCAST ? 1 : p) >= stream_min;
    char *recv = c->recv;
    /* An allgather's or alltoall's own block: copied after the closing arrival (below). */
    const char *own = NULL;
    if (c->kind == DDP__BROADCAST) {
        broadcast_shared(S, c, hints, q, esize, stream);
    } else if (c->kind == DDP__REDUCE_SCATTER) {
        /* In place (recv is this rank's block of send) is safe: peers read the other blocks. */
        reduce_block(S, c, hints, q, total, (size_t)me * n, n, esize);
    } else {
        /* Allgather: block k of recv is rank k's send; alltoall: rank k's block `me`. */
        const size_t a = c->kind == DDP__ALLTOALL ? (size_t)me * n : 0;
        for (int j = 1; j < p; j++) { /* peers from the next rank on: not all on one at once */
            const int k = (me + j) % p;
            pull(S, k, &hints[k], q, recv + (size_t)k * block, total, a, a + n, esize, stream);
        }
        own = (const char *)c->send + a * esize;
        if (own == recv + (size_t)me * block) own = NULL;
    }
    /* No rank changes its source until every rank has read it. This rank has read every peer's
     * source: it says so first, then copies its own block (no peer reads this rank's recv) while
     * the peers finish, and then waits. Against the copy before the closing phase, 2 ranks, 2 x
     * 6-8 alternating runs, medians: 64-256 KiB 0.89-1.07x the time, most cells 0.92-0.96x; 512
     * KiB-1 MiB even (bench/results/2026-11-29-0155-pulled-own-copy-ab.txt). */
    const uint64_t read_all = ddp__shm_arrive(S);
    if (own) memcpy(recv + (size_t)me * block, own, block);
    return ddp__shm_wait_all(S, read_all, c, c->deadline_ns);
}

/* ---- reduce_scatter_apply ----------------------------------------------------------------- */

/* The piece reduce_scatter_apply reduces, hands to the caller's function and fans out at once:
 * with the function's own arrays (an optimizer's parameter and moments) it stays in L2. */
#define APPLY_TILE_BYTES ((size_t)32 << 10)

/* Rank me's block, the mapped way: every rank's send and recv registered, views agreed (hints:
 * send and recv of each rank). Each piece of the block is reduced from every rank's send where
 * it lies, passed through the function (which writes this rank's recv) and copied from there
 * into every peer's recv: its pages through the view, its edges into the peer's stage, which
 * the peer copies in after the closing phase. */
static ddp_status_t apply_mapped(shm_state_t *S, const ddp__collective_t *c,
                                 const ddp__shm_map_hint_t *hints)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), total = c->count * (size_t)p;
    const size_t a = (size_t)me * c->count, b = a + c->count;
    const unsigned q = (unsigned)(S->use++ & 1);
    size_t lo_of[DDP__SHM_MAX_WORLD][2], hi_of[DDP__SHM_MAX_WORLD][2];
    size_t cuts[4 * DDP__SHM_MAX_WORLD + 2];
    int ncuts = 0;
    cuts[ncuts++] = a;
    cuts[ncuts++] = b;
    for (int k = 0; k < p; k++)
        for (int j = 0; j < 2; j++) {
            ddp__shm_covered(&hints[2 * k + j], total, esize, &lo_of[k][j], &hi_of[k][j]);
            if (lo_of[k][j] > a && lo_of[k][j] < b) cuts[ncuts++] = lo_of[k][j];
            if (hi_of[k][j] > a && hi_of[k][j] < b) cuts[ncuts++] = hi_of[k][j];
        }
    ddp__shm_sort_cuts(cuts, ncuts);
    _Alignas(64) unsigned char tile[APPLY_TILE_BYTES];
    const size_t per = APPLY_TILE_BYTES / esize;
    char *recv = c->recv;
    for (int i = 0; i + 1 < ncuts; i++) {
        const size_t x = cuts[i], y = cuts[i + 1];
        if (y <= x) continue;
        const char *srcs[DDP__SHM_MAX_WORLD];
        char *dsts[DDP__SHM_MAX_WORLD];
        for (int k = 0; k < p; k++) {
            srcs[k] = source_at(S, c, k, &hints[2 * k], lo_of[k][0], hi_of[k][0], q, x, esize);
            const ddp__shm_map_hint_t *hr = &hints[2 * k + 1];
            char *stage = stage_of(S, k, q);
            if (k == me)
                dsts[k] = NULL;
            else if (x < lo_of[k][1])
                dsts[k] = stage + EDGE_RECV_HEAD + x * esize;
            else if (x < hi_of[k][1])
                dsts[k] = ddp__shm_view_at(&S->views, k, hr, hr->addr + x * esize);
            else
                dsts[k] = stage + EDGE_RECV_TAIL + (x - hi_of[k][1]) * esize;
        }
        for (size_t t = x; t < y; t += per) {
            const size_t n = y - t < per ? y - t : per, off = (t - x) * esize;
            const void *from[DDP__SHM_MAX_WORLD];
            for (int k = 0; k < p; k++) from[k] = srcs[k] + off;
            ddp__reduce(tile, from, p, n, c->dtype, c->op);
            c->apply(c->apply_arg, t, tile, n);
            for (int j = 1; j < p; j++) { /* peers from the next rank on */
                const int k = (me + j) % p;
                memcpy(dsts[k] + off, recv + t * esize, n * esize);
            }
        }
    }
    /* Nobody changes a send or reads a recv before every rank has written its block. */
    ddp_status_t s = ddp__shm_sync_all(S, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    /* My recv's edges, but for my own block: the others wrote them into my stage. */
    const char *stage = stage_of(S, me, q);
    ddp__shm_copy_edges(recv, stage, total, lo_of[me][1], hi_of[me][1], a, b, esize);
    return DDP_OK;
}

ddp_status_t ddp__shm_try_apply(shm_state_t *S, const ddp__collective_t *c, int key, int *ran)
{
    *ran = 0;
    if (!should_try(S, key)) return DDP_OK;
    const int p = S->world;
    const size_t esize = ddp_dtype_size(c->dtype), total = c->count * (size_t)p;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    const size_t bytes = total * esize;
    if (ddp__shm_map_one(S, c->send, bytes, bytes, esize, &fp.map[0])) {
        if (c->recv == c->send)
            fp.map[1] = fp.map[0];
        else if (!ddp__shm_map_one(S, c->recv, bytes, bytes, esize, &fp.map[1]))
            fp.map[0].slot = -1;
        if (fp.map[0].slot >= 0) stage_edges(S, &fp.map[0], c->send, total, esize);
    }
    ddp__shm_map_hint_t hints[2 * DDP__SHM_MAX_WORLD];
    ddp_status_t s = agree_mapped(S, c, &fp, 2, key, hints, ran);
    if (s != DDP_OK || !*ran) return s;
    return apply_mapped(S, c, hints);
}
