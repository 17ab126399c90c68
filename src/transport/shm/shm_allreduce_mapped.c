/* Registered memory in the shared-memory allreduce (issue #18): the hints a rank publishes for
 * buffers in registered memory (shm_map.c keeps the registrations and the views of peers'), the
 * agreement on views after the first phase, and the mapped allreduce, which reads and writes
 * every rank's buffers through those views. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* The smallest collective whose buffers DDP_SHM_MAP=auto registers: a page (a range registers
 * its whole pages). Which sizes ask at all is each path's own threshold (ddp__shm_pull_min,
 * MAPPED_ALLREDUCE_MIN_PER_RANK, the one-shot size); since registered memory is watched they
 * go down to 4-8 KiB at 2 ranks. It was 32 KiB from the Intel Xeon of issue #27 on (2 ranks'
 * default allgather, alltoall, broadcast and reduce_scatter of 32-64 KiB took 3.7-9.7 us
 * through the stage and 2.0-3.6 us registered automatically), 128 KiB before. A table full of
 * small registrations does not keep a larger buffer out (shm_map.c). */
#define MAP_AUTO_MIN ((size_t)4 << 10)

/* Publishes this process's live registrations when they changed (before a first phase). */
static void publish_live(shm_state_t *S)
{
    shm_rank_t *me = &S->ranks[S->rank];
    uint32_t gens[DDP__SHM_MAP_SLOTS];
    uint32_t epoch = ddp__shm_map_live(gens);
    if (epoch == atomic_load_explicit(&me->live_epoch, memory_order_relaxed)) return;
    memcpy(me->live_gen, gens, sizeof gens);
    atomic_store_explicit(&me->live_epoch, epoch, memory_order_relaxed);
}

/* After a first phase: drops the views of peers' registrations that are gone. */
void ddp__shm_prune_views(shm_state_t *S)
{
    for (int k = 0; k < S->world; k++) {
        if (k == S->rank) continue;
        uint32_t epoch = atomic_load_explicit(&S->ranks[k].live_epoch, memory_order_relaxed);
        if (epoch == S->live_seen[k]) continue;
        ddp__shm_views_prune(&S->views, k, S->ranks[k].live_gen);
        S->live_seen[k] = epoch;
    }
}

/* The export holding buffer p of a collective, registering it first under DDP_SHM_MAP=auto. */
static int map_lookup(shm_state_t *S, const void *p, size_t bytes, size_t moved,
                      ddp__shm_map_hint_t *hint)
{
    if (ddp__shm_map_find(p, bytes, hint)) return 1;
    return S->map_wanted == MAP_AUTO && moved >= MAP_AUTO_MIN && ddp__shm_map_auto(p, bytes) &&
           ddp__shm_map_find(p, bytes, hint);
}

int ddp__shm_map_one(shm_state_t *S, const void *p, size_t bytes, size_t moved, size_t esize,
                     ddp__shm_map_hint_t *hint)
{
    hint->slot = -1;
    if (!S->map_wanted || S->world < 2) return 0;
    publish_live(S);
    if ((uintptr_t)p % esize || !map_lookup(S, p, bytes, moved, hint)) {
        hint->slot = -1;
        return 0;
    }
    return 1;
}

/* This rank's hints for c's buffers in fp->map (publishing its live registrations first), or
 * slot -1 in both; returns whether both are registered. */
int ddp__shm_map_buffers(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                         shm_fingerprint_t *fp)
{
    if (fp->buffer_id >= 0) return 0;
    const size_t esize = ddp_dtype_size(c->dtype);
    if ((uintptr_t)c->recv % esize) return 0;
    if (!ddp__shm_map_one(S, c->send, bytes, bytes, esize, &fp->map[0])) return 0;
    if (c->recv == c->send) {
        fp->map[1] = fp->map[0];
    } else if (!map_lookup(S, c->recv, bytes, bytes, &fp->map[1])) {
        fp->map[0].slot = fp->map[1].slot = -1;
        return 0;
    }
    return 1;
}

/* Whether every rank published registered buffers in the first phase of parity q. */
int ddp__shm_all_registered(const shm_state_t *S, unsigned q)
{
    for (int k = 0; k < S->world; k++)
        if (S->ranks[k].map_hints[q][0].slot < 0 || S->ranks[k].map_hints[q][1].slot < 0)
            return 0;
    return 1;
}

/* map_buffers, and the edges of send for the peers that reduce them (written at the parity the
 * collective uses if it is mapped; if it is not, the staged path overwrites them). */
void ddp__shm_map_hints_of(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                           shm_fingerprint_t *fp)
{
    if (!ddp__shm_map_buffers(S, c, bytes, fp)) return;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t lo, hi;
    ddp__shm_covered(&fp->map[0], c->count, esize, &lo, &hi);
    char *stage = stage_of(S, S->rank, (unsigned)(S->use & 1));
    memcpy(stage + EDGE_SEND_HEAD, c->send, lo * esize);
    memcpy(stage + EDGE_SEND_TAIL, (const char *)c->send + hi * esize, (c->count - hi) * esize);
}

/* After the first phase, every rank having passed registered memory: whether the agreed views
 * let the mapped path run now, mapping what is missing (one more phase, where every rank says
 * whether it could). The same answer on every rank. */
int ddp__shm_decide_mapped(shm_state_t *S, const ddp__collective_t *c, unsigned fparity,
                           int nbuf, ddp__shm_map_hint_t *hints, ddp_status_t *status)
{
    const int p = S->world;
    *status = DDP_OK;
    for (int k = 0; k < p; k++)
        for (int b = 0; b < nbuf; b++) hints[nbuf * k + b] = S->ranks[k].map_hints[fparity][b];
    int ready = ddp__shm_views_ready(&S->views, hints, nbuf);
    if (ready != 0) return ready > 0;
    int pids[DDP__SHM_MAX_WORLD];
    for (int k = 0; k < p; k++) pids[k] = atomic_load_explicit(&S->ranks[k].pid, memory_order_relaxed);
    S->ranks[S->rank].map_verdict = ddp__shm_views_prepare(&S->views, hints, nbuf, pids);
    *status = ddp__shm_sync_all(S, c, c->deadline_ns);
    if (*status != DDP_OK) return 0;
    int all_ok = 1;
    for (int k = 0; k < p; k++) all_ok &= S->ranks[k].map_verdict == 1;
    ddp__shm_views_settle(&S->views, hints, nbuf, all_ok);
    if (!all_ok && S->rank == 0)
        DDP_LOG(DDP_LOG_INFO, "shm: a rank could not map its peers' registered memory: those "
                              "buffers are reduced the staged way (DDP_LOG_LEVEL=info on every "
                              "rank says which)");
    return all_ok;
}

/* Copies elements [a, b) of src (rank-local buffer offsets) to dst, except [lo, hi). */
static void copy_except(char *dst, const char *src, size_t a, size_t b, size_t lo, size_t hi,
                        size_t esize)
{
    if (a < lo) memcpy(dst + a * esize, src + a * esize, ((b < lo ? b : lo) - a) * esize);
    if (b > hi) {
        size_t from = a > hi ? a : hi;
        memcpy(dst + from * esize, src + from * esize, (b - from) * esize);
    }
}

void ddp__shm_copy_edges(char *recv, const char *stage, size_t n, size_t lo, size_t hi,
                         size_t own_lo, size_t own_hi, size_t esize)
{
    copy_except(recv, stage + EDGE_RECV_HEAD, 0, lo, own_lo, own_hi, esize);
    copy_except(recv + hi * esize, stage + EDGE_RECV_TAIL, 0, n - hi,
                own_lo > hi ? own_lo - hi : 0, own_hi > hi ? own_hi - hi : 0, esize);
}

/* Mapped allreduce (every rank's send and recv in registered memory, every view agreed): rank r
 * reduces slice r reading every rank's send where it lies (its export, through this rank's
 * view; its edges, from its stage) and writes the result into every rank's recv (its export, or
 * the edge area of its stage); one phase ends it, after which each rank copies its own edge
 * results in. Each rank reads every input once and writes every output once; the same kernel in
 * the same rank order as every other path, so the bytes are the same whichever ran. In place is
 * safe for the reason the zero-copy path is: element i is read and written only by its slice's
 * owner, in one pass. */
ddp_status_t ddp__shm_allreduce_mapped(shm_state_t *S, const ddp__collective_t *c,
                                       const shm_plan_t *plan)
{
    const ddp__shm_map_hint_t *hints = plan->hints;
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), n = c->count;
    const unsigned q = (unsigned)(S->use++ & 1);
    size_t lo_of[DDP__SHM_MAX_WORLD][2], hi_of[DDP__SHM_MAX_WORLD][2];
    size_t cuts[4 * DDP__SHM_MAX_WORLD + 2];
    size_t lo, hi;
    slice_of(n, p, me, esize, &lo, &hi);
    int ncuts = 0;
    cuts[ncuts++] = lo;
    cuts[ncuts++] = hi;
    for (int k = 0; k < p; k++) {
        for (int b = 0; b < 2; b++) {
            ddp__shm_covered(&hints[2 * k + b], n, esize, &lo_of[k][b], &hi_of[k][b]);
            if (lo_of[k][b] > lo && lo_of[k][b] < hi) cuts[ncuts++] = lo_of[k][b];
            if (hi_of[k][b] > lo && hi_of[k][b] < hi) cuts[ncuts++] = hi_of[k][b];
        }
    }
    ddp__shm_sort_cuts(cuts, ncuts);
    /* Non-temporal stores for the results (every destination) from MAPPED_STREAM_MIN_BYTES where
     * S->mapped_stream (DDP_SHM_MAPPED_STORES; by default on Intel CPUs only). On the AMD EPYC
     * VM streaming was slower or no faster at 128 KiB-128 MiB (2 ranks: 8 MiB 25-38 against
     * 52-57 GB/s, 128 MiB 10-17 against 19); on the Intel Xeon of issue #27 it is faster from
     * 32 MiB (2 ranks, two runs each: 32 MiB 6.2 -> 3.2-3.5 ms, 128 MiB 25.8-27.7 -> 18.6-19.4 ms;
     * 2-8 MiB even), and with the register kernel of reduce_stream.c from 1 MiB (the threshold
     * is at 2 MiB: shm_internal.h). Every rank reducing everything into its own recv (no remote
     * writes) was slower on the EPYC too (2 MiB 33 against 46 GB/s). */
    const unsigned stream = S->mapped_stream && n * esize >= MAPPED_STREAM_MIN_BYTES ? ~0u : 0u;
    for (int i = 0; i + 1 < ncuts; i++) {
        const size_t x = cuts[i], y = cuts[i + 1];
        if (y <= x) continue;
        const void *srcs[DDP__SHM_MAX_WORLD];
        void *dsts[DDP__SHM_MAX_WORLD];
        int nd = 0;
        dsts[nd++] = (char *)c->recv + x * esize; /* own first: the fan-out reads it from cache */
        for (int k = 0; k < p; k++) {
            const ddp__shm_map_hint_t *hs = &hints[2 * k], *hr = &hints[2 * k + 1];
            char *stage = stage_of(S, k, q);
            if (k == me) {
                srcs[k] = (const char *)c->send + x * esize;
                continue;
            }
            if (x >= lo_of[k][0] && y <= hi_of[k][0])
                srcs[k] = ddp__shm_view_at(&S->views, k, hs, hs->addr + x * esize);
            else if (y <= lo_of[k][0])
                srcs[k] = stage + EDGE_SEND_HEAD + x * esize;
            else
                srcs[k] = stage + EDGE_SEND_TAIL + (x - hi_of[k][0]) * esize;
            if (x >= lo_of[k][1] && y <= hi_of[k][1])
                dsts[nd++] = ddp__shm_view_at(&S->views, k, hr, hr->addr + x * esize);
            else if (y <= lo_of[k][1])
                dsts[nd++] = stage + EDGE_RECV_HEAD + x * esize;
            else
                dsts[nd++] = stage + EDGE_RECV_TAIL + (x - hi_of[k][1]) * esize;
        }
        ddp__reduce_multi_stream(dsts, nd, stream, srcs, p, y - x, c->dtype, c->op);
    }
    ddp_status_t s = ddp__shm_sync_all(S, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    /* My recv's edges: the others' slices of them are in my stage. */
    ddp__shm_copy_edges(c->recv, stage_of(S, me, q), n, lo_of[me][1], hi_of[me][1], lo, hi,
                        esize);
    return DDP_OK;
}
