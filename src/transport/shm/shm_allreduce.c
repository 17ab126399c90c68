/* The shared-memory allreduce algorithms, one function each (the mapped one is in
 * shm_allreduce_mapped.c). Each runs after the collective's first phase, which shm_choose.c ran
 * when it chose the algorithm, and executes the plan it filled. Every algorithm reduces with the
 * same kernel in the same rank order, so the bytes are the same whichever ran. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* Tiny (up to MAILBOX_DATA bytes): the data travelled in the mailbox line with the
 * fingerprint; every rank reduces every rank's line in rank order. */
ddp_status_t ddp__shm_allreduce_mailbox(shm_state_t *S, const ddp__collective_t *c,
                                        const shm_plan_t *plan)
{
    if (c->count == 0) return DDP_OK;
    const void *srcs[DDP__SHM_MAX_WORLD];
    for (int j = 0; j < S->world; j++) srcs[j] = S->ranks[j].mailbox[plan->fparity].data;
    ddp__reduce(c->recv, srcs, S->world, c->count, c->dtype, c->op);
    return DDP_OK;
}

/* One-shot: every rank staged its whole input before the first phase, the only
 * synchronisation; every rank reduces all stages in rank order. */
ddp_status_t ddp__shm_allreduce_oneshot(shm_state_t *S, const ddp__collective_t *c,
                                        const shm_plan_t *plan)
{
    if (c->count == 0) return DDP_OK;
    const void *srcs[DDP__SHM_MAX_WORLD];
    for (int j = 0; j < S->world; j++) srcs[j] = stage_of(S, j, plan->stage_parity);
    ddp__reduce(c->recv, srcs, S->world, c->count, c->dtype, c->op);
    return DDP_OK;
}

/* Zero copy (send and recv in one segment buffer at the same offsets on every rank): rank r
 * reduces slice r straight from every rank's region and writes the result into slice r of every
 * rank's region; one barrier ends it. */
ddp_status_t ddp__shm_allreduce_zero_copy(shm_state_t *S, const ddp__collective_t *c,
                                          const shm_plan_t *plan)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    shm_buffer_t *buf = plan->buf;
    const size_t send_off = plan->send_off, recv_off = plan->recv_off;
    size_t lo, hi;
    slice_of(c->count, p, me, esize, &lo, &hi);
    if (hi > lo) {
        const void *srcs[DDP__SHM_MAX_WORLD];
        void *dsts[DDP__SHM_MAX_WORLD];
        for (int j = 0; j < p; j++) {
            char *region = buf->base + (size_t)j * buf->region;
            srcs[j] = region + send_off + lo * esize;
            dsts[j] = region + recv_off + lo * esize;
        }
        /* Own destination first so the fan-out copies read from this rank's cache. */
        void *tmp = dsts[0];
        dsts[0] = dsts[me];
        dsts[me] = tmp;
        /* Results that their owner reads only later (advise_cold_results: gradients) go to
         * other ranks' regions with non-temporal stores. Ordinary stores would take each
         * line from the owner's cache, dirty it here, and make the owner fetch it back;
         * streamed, the owner finds it in memory (measured in docs/shm-transport.md). On
         * a buffer reduced again and again while hot in the caches (a benchmark loop) it
         * costs, so it is not the default. */
        unsigned stream =
            p < 32 && atomic_load_explicit(&buf->cold_results, memory_order_relaxed)
                ? ((1u << p) - 1u) & ~1u
                : 0u;
        ddp__reduce_multi_stream(dsts, p, stream, srcs, p, hi - lo, c->dtype, c->op);
    }
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}

/* Staged rounds: copy a chunk in, reduce my slice of it (into my stage, and into my recv),
 * synchronise, copy the other slices out. The copy-in of round t+1 is done between publishing
 * "reduced t" and waiting for everyone's "reduced t", so it overlaps with the peers' reductions
 * instead of idling (safe: that stage parity was last read in round t-1, which every rank
 * finished before arriving at round t). Round 0 was staged before the first phase, unless some
 * rank hoped for zero copy or mapped (plan->any_zero_copy): then it is staged now, everywhere,
 * with one more phase. */
ddp_status_t ddp__shm_allreduce_staged(shm_state_t *S, const ddp__collective_t *c,
                                       const shm_plan_t *plan)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), bytes = c->count * esize;
    const size_t chunk = plan->chunk;
    const int stream_stage = plan->stream_stage;
    const unsigned parity0 = plan->stage_parity;
    ddp_status_t s;
    const char *send = c->send;
    char *recv = c->recv;
    const int stream = bytes >= STREAM_MIN_BYTES;
    if (plan->any_zero_copy) {
        /* Some rank did not stage round 0 (it hoped for zero copy): stage it now, everywhere. */
        if (!plan->precopied) {
            size_t n0 = c->count < chunk ? c->count : chunk;
            ddp__shm_copy_in_others(S, stage_of(S, me, parity0), send, n0, esize, stream_stage);
        }
        s = ddp__shm_sync_all(S, c, c->deadline_ns);
        if (s != DDP_OK) return s;
    }
    unsigned q = (unsigned)(S->use++ & 1);
    if (q != parity0) return ddp__error(DDP_ERR_SYSTEM, "shm: internal error: stage parity drifted");
    size_t o = 0;
    for (;;) {
        size_t n = c->count - o < chunk ? c->count - o : chunk;
        char *mine = stage_of(S, me, q);
        size_t lo, hi;
        slice_of(n, p, me, esize, &lo, &hi);
        if (hi > lo) {
            /* My own slice comes straight from send: it was never copied in. The result goes
             * to recv (streamed when the output is too large for the caches) and, streamed, to
             * my stage for the others to copy. */
            const void *srcs[DDP__SHM_MAX_WORLD];
            for (int j = 0; j < p; j++) srcs[j] = stage_of(S, j, q) + lo * esize;
            srcs[me] = send + (o + lo) * esize;
            void *dsts[2] = {recv + (o + lo) * esize, mine + lo * esize};
            ddp__reduce_multi_stream(dsts, 2, (stream ? 1u : 0u) | (stream_stage ? 2u : 0u), srcs,
                                     p, hi - lo, c->dtype, c->op);
        }
        uint64_t reduced = ddp__shm_arrive(S);
        size_t next = o + n;
        unsigned next_q = 0;
        if (next < c->count) {
            size_t n2 = c->count - next < chunk ? c->count - next : chunk;
            next_q = (unsigned)(S->use++ & 1);
            ddp__shm_copy_in_others(S, stage_of(S, me, next_q), send + next * esize, n2, esize,
                                    stream_stage);
        }
        s = ddp__shm_wait_all(S, reduced, c, c->deadline_ns);
        if (s != DDP_OK) return s;
        for (int j = 0; j < p; j++) {
            if (j == me) continue;
            size_t jlo, jhi;
            slice_of(n, p, j, esize, &jlo, &jhi);
            if (jhi > jlo)
                copy_out(recv + (o + jlo) * esize, stage_of(S, j, q) + jlo * esize,
                         (jhi - jlo) * esize, stream);
        }
        if (next >= c->count) break;
        s = ddp__shm_sync_all(S, c, c->deadline_ns); /* round t+1 staged everywhere */
        if (s != DDP_OK) return s;
        o = next;
        q = next_q;
    }
    return DDP_OK;
}

/* Stages the slices of n elements that the other ranks reduce (this rank's own slice is read
 * from the caller's buffer directly), with non-temporal stores: the other ranks read these lines
 * and wrote nothing into them, and a plain store would first pull each line back from the
 * caches of the ranks that read the previous round (measured: the staged allreduce got ~2x
 * faster at 512 KiB - 128 MiB). */
void ddp__shm_copy_in_others(shm_state_t *S, char *stage, const char *src, size_t n, size_t esize,
                             int stream)
{
    for (int j = 0; j < S->world; j++) {
        if (j == S->rank) continue;
        size_t lo, hi;
        slice_of(n, S->world, j, esize, &lo, &hi);
        if (hi > lo && stream)
            ddp__copy_stream_nofence(stage + lo * esize, src + lo * esize, (hi - lo) * esize);
        else if (hi > lo)
            memcpy(stage + lo * esize, src + lo * esize, (hi - lo) * esize);
    }
    if (stream) ddp__stream_fence();
}

/* Single-copy allreduce (user buffers, every rank agreed at create that it can read its peers):
 *   1. rank r reads slice r of every peer's send buffer (process_vm_readv, piece by piece into
 *      scratch) and reduces it with its own, in rank order, into slice r of its recv;
 *   2. phase A: every slice is final in its owner's recv;
 *   3. rank r reads every other slice j from rank j's recv straight into its own recv;
 *   4. phase B: nobody reads anyone's buffers any more, so each may return and reuse them.
 * Each rank reads every input once and writes its output once. In place (send == recv) is safe:
 * in step 1 rank r writes only slice r of its buffer, which no peer reads (they read the other
 * slices of it); in step 3 rank r overwrites slices j != r of its buffer, whose inputs rank j
 * finished reading before phase A, and reads slice j of rank j's buffer, which rank j no longer
 * writes. Phase 0 (the fingerprint) tells every rank where the others' buffers are; the previous
 * collective's last phase guarantees no peer still reads them. Same kernel, same order as the
 * staged path, so the bytes are identical whichever ran (tests/test_shm_tune.c). */
ddp_status_t ddp__shm_allreduce_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), bytes = c->count * esize;
    int pids[DDP__SHM_MAX_WORLD];
    uintptr_t sends[DDP__SHM_MAX_WORLD], recvs[DDP__SHM_MAX_WORLD];
    for (int j = 0; j < p; j++) {
        pids[j] = atomic_load_explicit(&S->ranks[j].pid, memory_order_relaxed);
        sends[j] = (uintptr_t)S->ranks[j].cma_send;
        recvs[j] = (uintptr_t)S->ranks[j].cma_recv;
    }
    const int stream = bytes >= STREAM_MIN_BYTES;
    /* At debug, each step's time (what limits single copy at a size: docs/shm-transport.md). */
    const int profile = ddp__log_level() >= DDP_LOG_DEBUG;
    int64_t t[5] = {0};
    if (profile) t[0] = ddp__now_ns();
    size_t lo, hi;
    slice_of(c->count, p, me, esize, &lo, &hi);
    ddp_status_t s = DDP_OK;
    if (hi > lo)
        s = ddp__shm_cma_reduce(&S->cma, pids, sends, me, p, (const char *)c->send + lo * esize,
                                (char *)c->recv + lo * esize, lo, hi - lo, c->dtype, c->op,
                                stream);
    if (s != DDP_OK) return ddp__shm_cma_failed(S, c, s);
    if (profile) t[1] = ddp__now_ns();
    s = ddp__shm_sync_all(S, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    if (profile) t[2] = ddp__now_ns();
    for (int j = 0; j < p; j++) {
        size_t jlo, jhi;
        slice_of(c->count, p, j, esize, &jlo, &jhi);
        if (j == me || jhi <= jlo) continue;
        int err;
        s = ddp__shm_cma_read(pids[j], (char *)c->recv + jlo * esize, recvs[j] + jlo * esize,
                              (jhi - jlo) * esize, "a peer's result", &err);
        if (s != DDP_OK)
            return ddp__shm_cma_failed(S, c, ddp__error_context(s, "rank %d's slice", j));
    }
    if (profile) t[3] = ddp__now_ns();
    s = ddp__shm_sync_all(S, c, c->deadline_ns);
    if (profile && s == DDP_OK) {
        t[4] = ddp__now_ns();
        DDP_LOG(DDP_LOG_DEBUG,
                "shm: rank %d single copy of %zu bytes: reduce %.1f us (%.2f GB/s of slice), "
                "wait %.1f, gather %.1f us (%.2f GB/s), wait %.1f",
                me, bytes, (double)(t[1] - t[0]) / 1e3,
                (double)((hi - lo) * esize) / (double)(t[1] - t[0] + 1),
                (double)(t[2] - t[1]) / 1e3, (double)(t[3] - t[2]) / 1e3,
                (double)(bytes - (hi - lo) * esize) / (double)(t[3] - t[2] + 1),
                (double)(t[4] - t[3]) / 1e3);
    }
    return s;
}
