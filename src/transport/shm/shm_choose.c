/* Choosing how a shared-memory collective runs, in one place: an allreduce's algorithm
 * (choose_allreduce); mapped (from registered memory, run_pulled_or), else rounds or single
 * copy (run_rounds_or_single) for broadcast, allgather, reduce_scatter and alltoall; each once
 * per call, with the tuner (shm_tune.c) where it has a say; then the dispatch of a collective
 * to the function that runs the choice. */
#include <stdlib.h>
#include <string.h>

#include "transport/shm/shm_internal.h"

/* The one-shot variant is a candidate of the tuner below this size (every rank reduces
 * everything: p times the work of a slice, worth it only while synchronisation dominates). */
#define TUNE_ONESHOT_MAX ((size_t)256 << 10)
/* Single copy is a candidate from this size (below it, a system call per peer and piece costs
 * more than the staging it saves). */
#define TUNE_CMA_MIN ((size_t)256 << 10)

/* ---- allreduce ---------------------------------------------------------------------------- */

/* The tuner's candidates for an allreduce of `bytes` (above the one-shot threshold): a function
 * of agreed data only (the size, rank 0's knobs in the header, the create-time CMA verdict). */
static unsigned allreduce_candidates(const shm_state_t *S, size_t bytes)
{
    unsigned set = 0;
    const int nt = !(S->fixed & FIXED_STORES_PLAIN), plain = !(S->fixed & FIXED_STORES_NT);
    /* Both round sizes only where they cut the message differently (it is longer than the
     * shorter round); else the variant that goes with the stores by default. */
    const size_t shorter = S->round_bytes < S->allreduce_round_bytes ? S->round_bytes
                                                                    : S->allreduce_round_bytes;
    const int both = S->round_bytes != S->allreduce_round_bytes && bytes > shorter;
    /* -1: tuned; 1 or 0: DDP_SHM_STAGED_ROUNDS=long or short. */
    const int want_long = S->fixed & FIXED_ROUNDS_LONG    ? 1
                          : S->fixed & FIXED_ROUNDS_SHORT ? 0
                                                          : -1;
    if (nt && want_long != 0) set |= 1u << DDP__SHM_ALG_STAGED_NT;
    if (nt && (want_long == 0 || (want_long < 0 && both))) set |= 1u << DDP__SHM_ALG_STAGED_NT_SHORT;
    if (plain && want_long != 1) set |= 1u << DDP__SHM_ALG_STAGED_PLAIN;
    if (plain && (want_long == 1 || (want_long < 0 && both)))
        set |= 1u << DDP__SHM_ALG_STAGED_PLAIN_LONG;
    if (!(S->fixed & FIXED_ONESHOT) && bytes < TUNE_ONESHOT_MAX)
        set |= 1u << DDP__SHM_ALG_ONESHOT;
    if (S->cma_enabled) {
        if (!(S->fixed & FIXED_CMA) && bytes >= TUNE_CMA_MIN) set |= 1u << DDP__SHM_ALG_CMA;
        /* Threshold set explicitly: single copy exactly from it, and only it. */
        if ((S->fixed & FIXED_CMA) && bytes >= S->cma_bytes) set = 1u << DDP__SHM_ALG_CMA;
    }
    return set;
}

/* The tuner's pick for an allreduce above the one-shot size, among its candidates; with tuning
 * off the static rule: single copy from DDP_SHM_CMA_BYTES when every rank allowed it, else the
 * staged stores asked for (nt by default) with the rounds asked for (by default those that go
 * with the stores). Counts the call. */
static int tuner_pick(shm_state_t *S, size_t bytes, int *key, unsigned *candidates_out)
{
    const int cls = ddp__shm_tune_key(0, bytes);
    unsigned candidates = allreduce_candidates(S, bytes);
    /* Registered memory everywhere in this class before: it goes the mapped way, which the
     * one-shot variant would bypass. */
    if (S->map_class[cls] && (candidates & ~(1u << DDP__SHM_ALG_ONESHOT)))
        candidates &= ~(1u << DDP__SHM_ALG_ONESHOT);
    const int plain = (S->fixed & FIXED_STORES_PLAIN) != 0;
    const int long_rounds = S->fixed & FIXED_ROUNDS_LONG    ? 1
                            : S->fixed & FIXED_ROUNDS_SHORT ? 0
                                                            : !plain;
    const int staged = plain ? (long_rounds ? DDP__SHM_ALG_STAGED_PLAIN_LONG
                                            : DDP__SHM_ALG_STAGED_PLAIN)
                             : (long_rounds ? DDP__SHM_ALG_STAGED_NT
                                            : DDP__SHM_ALG_STAGED_NT_SHORT);
    const int fallback = S->cma_enabled && bytes >= S->cma_bytes ? DDP__SHM_ALG_CMA : staged;
    *key = cls;
    *candidates_out = candidates;
    return ddp__shm_tune_pick(&S->tune, cls, candidates, fallback);
}

/* Registered allreduces from this many bytes a rank go the mapped way below the one-shot size
 * too (unless DDP_SHM_ONESHOT_BYTES was set: one-shot exactly up to it). On the Intel Xeon of
 * issue #27, page-aligned buffers, two runs each (29 Nov 2026, 06:45 UTC): 2 ranks, mapped
 * against one-shot, f32 4 KiB 1.72-1.74 us against 2.02-2.10, 8 KiB 1.79-1.80 against
 * 3.15-3.29, 16 KiB 2.12-2.14 against 5.47-5.55; bf16 4 KiB 1.84-1.86 against 3.45-3.73, 16 KiB
 * 2.83-2.90 against 11.0-11.7; 2 KiB lost (1.94-1.96 against 1.50-1.54). 4 ranks on the 2
 * cores: 8 KiB won (f32 7.5-7.7 against 8.5-8.8), 4 KiB lost (7.4-7.5 against 5.9). One-shot's
 * every rank reads every rank's freshly staged copy from another core's cache, ~4-5 GB/s here;
 * the mapped way reads each source where it lies, once. */
#define MAPPED_ALLREDUCE_MIN_PER_RANK ((size_t)2 << 10)

static int mapped_below_oneshot(const shm_state_t *S, size_t bytes)
{
    return S->map_wanted && S->world > 1 && !(S->fixed & FIXED_ONESHOT) &&
           bytes >= MAPPED_ALLREDUCE_MIN_PER_RANK * (size_t)S->world;
}

/* One-shot's first phase: stage the whole input, publish (with the registered-memory hints when
 * the tuner picked it, or the size may go mapped below the one-shot size), wait. When every
 * rank passed registered memory, this size class goes the mapped way from the next call on
 * (one-shot stops being a candidate, the same on every rank). */
static ddp_status_t oneshot_first_phase(shm_state_t *S, const ddp__collective_t *c,
                                        shm_plan_t *plan, shm_fingerprint_t *fp, size_t bytes)
{
    const int hint = plan->variant >= 0 || mapped_below_oneshot(S, bytes);
    if (hint) ddp__shm_map_buffers(S, c, bytes, fp);
    plan->stage_parity = (unsigned)(S->use++ & 1);
    uint64_t target = ddp__shm_early_arrival(S, 1, bytes);
    if (bytes) memcpy(stage_of(S, S->rank, plan->stage_parity), c->send, bytes);
    if (!target) target = ddp__shm_first_arrive(S);
    ddp_status_t s = ddp__shm_first_publish(S, c, fp, NULL, 0, target, 1, &plan->fparity);
    if (s != DDP_OK || bytes == 0) return s;
    if (hint && S->map_wanted && S->world > 1) {
        ddp__shm_prune_views(S);
        if (ddp__shm_all_registered(S, plan->fparity))
            S->map_class[ddp__shm_tune_key(0, bytes)] = 1;
    }
    return DDP_OK;
}

/* Before the first phase of a larger allreduce: where this rank's buffers are (one segment
 * buffer: the zero-copy hints; registered memory: the mapped hints, and send's edges staged),
 * the staged rounds' size, and either single copy's addresses or round 0 staged. A rank that may
 * go the zero-copy or the mapped way does not stage round 0 before the first phase; if in the
 * end nobody can, every rank stages it after. */
static void prepare_first_phase(shm_state_t *S, const ddp__collective_t *c, shm_plan_t *plan,
                                shm_fingerprint_t *fp, size_t bytes, int cma)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t send_off = 0, recv_off = 0;
    shm_buffer_t *buf = ddp__shm_find_buffer(S, c->send, bytes, &send_off);
    if (buf && ddp__shm_find_buffer(S, c->recv, bytes, &recv_off) == buf) {
        fp->buffer_id = buf->id;
        fp->send_offset = send_off;
        fp->recv_offset = recv_off;
    }
    plan->buf = buf;
    plan->send_off = send_off;
    plan->recv_off = recv_off;
    ddp__shm_map_hints_of(S, c, bytes, fp);
    const int hoping = fp->buffer_id >= 0 || fp->map[0].slot >= 0;
    const size_t line_elems = LINE / esize;
    /* Two knobs, each tuned (docs/shm-transport.md, "Self-tuning"): the stores that write the
     * stage, and the round size. By default streamed stores go with whole-stage rounds (fewer
     * synchronisations) and plain ones with L2-sized rounds (the staging stays in L2). */
    plan->stream_stage = ddp__shm_algorithm_streams(plan->variant);
    plan->long_rounds = ddp__shm_algorithm_long_rounds(plan->variant);
    const size_t round = plan->long_rounds ? S->allreduce_round_bytes : S->round_bytes;
    size_t chunk = round / esize / (size_t)p / line_elems * line_elems;
    chunk *= (size_t)p;
    if (chunk == 0) chunk = (size_t)p * line_elems;
    plan->chunk = chunk;
    plan->precopied = 0;
    plan->stage_parity = (unsigned)(S->use & 1);
    if (cma) {
        shm_rank_t *mine = &S->ranks[me];
        mine->cma_send = (uint64_t)(uintptr_t)c->send;
        mine->cma_recv = (uint64_t)(uintptr_t)c->recv;
        if (!hoping) {
            S->untimed_ns += ddp__shm_cma_register(&S->cma, c->send, bytes);
            if (c->recv != c->send)
                S->untimed_ns += ddp__shm_cma_register(&S->cma, c->recv, bytes);
        }
    } else if (!hoping) {
        size_t n0 = c->count < chunk ? c->count : chunk;
        ddp__shm_copy_in_others(S, stage_of(S, me, plan->stage_parity), c->send, n0, esize,
                                plan->stream_stage);
        plan->precopied = 1;
    }
}

/* After the first phase: whether every rank's send and recv are in the same segment buffer at
 * the same offsets as this rank's (zero copy), and in *any whether some rank published a
 * zero-copy or a registered-memory hint (then it did not stage round 0). */
static int agreed_zero_copy(shm_state_t *S, const shm_fingerprint_t *fp, unsigned fparity,
                            int *any)
{
    int all = 1;
    *any = 0;
    for (int j = 0; j < S->world; j++) {
        const shm_hints_t *fj = &S->ranks[j].hints[fparity];
        if (fj->buffer_id >= 0 || S->ranks[j].map_hints[fparity][0].slot >= 0) *any = 1;
        if (fj->buffer_id < 0 || fj->buffer_id != fp->buffer_id ||
            fj->send_offset != fp->send_offset || fj->recv_offset != fp->recv_offset)
            all = 0;
    }
    return all;
}

/* The one place an allreduce's algorithm is chosen, once per call (the functions of
 * shm_allreduce*.c then run it). In order:
 *   1. up to MAILBOX_DATA bytes: mailbox (the data rides in the first phase's line);
 *   2. up to DDP_SHM_ONESHOT_BYTES: one-shot, by the static rule, untimed, unless the size
 *      class found every rank's buffers registered before (mapped_below_oneshot): then as 3;
 *   3. above: the tuner's pick (tuner_pick), timed from here. The one-shot pick runs one-shot.
 *      Any other: the first phase publishes where this rank's buffers are, and what every rank
 *      published decides, in this order: zero copy (every rank's send and recv at the same
 *      offsets of one segment buffer); mapped (every rank passed registered memory and the
 *      views of it are agreed: ddp__shm_decide_mapped, one more phase when views had to be
 *      mapped); single copy if that was the pick; else the staged variant picked.
 * Every input is agreed (the size, checked by the fingerprint; rank 0's knobs in the header; the
 * tuner's state; what every rank published), so every rank chooses the same. What is prepared
 * before the first phase depends on the tentative choice, so the first phase runs here; *plan
 * carries what the chosen function needs. set_algorithm records the choice as it is made. */
static ddp_status_t choose_allreduce(shm_state_t *S, const ddp__collective_t *c, shm_plan_t *plan)
{
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    plan->variant = -1;
    if (bytes <= MAILBOX_DATA) {
        plan->algorithm = DDP__SHM_ALG_MAILBOX;
        set_algorithm(S, plan->algorithm);
        return ddp__shm_first_sync_data(S, c, &fp, c->send, bytes, 1, &plan->fparity);
    }
    /* Agreed on every rank: the size, and whether this class found registered memory
     * everywhere before. */
    if (bytes > S->oneshot_bytes ||
        (mapped_below_oneshot(S, bytes) && S->map_class[ddp__shm_tune_key(0, bytes)])) {
        plan->variant = tuner_pick(S, bytes, &plan->key, &plan->candidates);
        S->untimed_ns = 0;
        plan->start_ns = ddp__now_ns();
    }
    if (plan->variant < 0 || plan->variant == DDP__SHM_ALG_ONESHOT) {
        plan->algorithm = DDP__SHM_ALG_ONESHOT;
        set_algorithm(S, plan->algorithm);
        return oneshot_first_phase(S, c, plan, &fp, bytes);
    }
    /* Agreed before the first phase: single copy is picked only where every rank allowed it at
     * create. Buffers in one segment buffer everywhere still go the zero-copy way. */
    const int cma = plan->variant == DDP__SHM_ALG_CMA;
    prepare_first_phase(S, c, plan, &fp, bytes, cma);
    ddp_status_t s = ddp__shm_first_sync_data(S, c, &fp, NULL, 0, 0, &plan->fparity);
    if (s != DDP_OK) return s;
    if (agreed_zero_copy(S, &fp, plan->fparity, &plan->any_zero_copy)) {
        plan->algorithm = DDP__SHM_ALG_ZERO_COPY;
        set_algorithm(S, plan->algorithm);
        return DDP_OK;
    }
    if (plan->any_zero_copy) ddp__shm_prune_views(S);
    if (plan->any_zero_copy && ddp__shm_all_registered(S, plan->fparity)) {
        S->map_class[ddp__shm_tune_key(0, bytes)] = 1;
        int mapped = ddp__shm_decide_mapped(S, c, plan->fparity, 2, plan->hints, &s);
        if (s != DDP_OK) return s;
        if (mapped) {
            plan->algorithm = DDP__SHM_ALG_MAPPED;
            set_algorithm(S, plan->algorithm);
            return DDP_OK;
        }
    }
    plan->algorithm = cma ? DDP__SHM_ALG_CMA : plan->variant;
    set_algorithm(S, plan->algorithm);
    return DDP_OK;
}

/* Allreduce: choose (which runs the first phase), run the choice; a tuner's pick is told how
 * long the call took, unless the buffers' placement overrode it (zero copy, mapped: not a
 * sample of the pick). */
static ddp_status_t run_allreduce(shm_state_t *S, const ddp__collective_t *c)
{
    shm_plan_t plan;
    ddp_status_t s = choose_allreduce(S, c, &plan);
    if (s != DDP_OK) return s;
    switch (plan.algorithm) {
    case DDP__SHM_ALG_MAILBOX: s = ddp__shm_allreduce_mailbox(S, c, &plan); break;
    case DDP__SHM_ALG_ONESHOT: s = ddp__shm_allreduce_oneshot(S, c, &plan); break;
    case DDP__SHM_ALG_ZERO_COPY: s = ddp__shm_allreduce_zero_copy(S, c, &plan); break;
    case DDP__SHM_ALG_MAPPED: s = ddp__shm_allreduce_mapped(S, c, &plan); break;
    case DDP__SHM_ALG_CMA: s = ddp__shm_allreduce_cma(S, c); break;
    default: s = ddp__shm_allreduce_staged(S, c, &plan); break;
    }
    if (s == DDP_OK && plan.variant >= 0 && plan.algorithm != DDP__SHM_ALG_ZERO_COPY &&
        plan.algorithm != DDP__SHM_ALG_MAPPED)
        ddp__shm_tune_record(&S->tune, plan.key, plan.variant, plan.candidates,
                             c->count * ddp_dtype_size(c->dtype),
                             ddp__now_ns() - plan.start_ns - S->untimed_ns);
    return s;
}

/* ---- broadcast, allgather, reduce_scatter, barrier ---------------------------------------- */

/* Broadcast, allgather, reduce_scatter: rounds through the stage or single copy, chosen by the
 * tuner like the allreduce's variants (kind: the tuner's collective index; bytes: the size
 * ddp-bench calls SIZE). */
typedef ddp_status_t (*shm_collective_fn)(shm_state_t *, const ddp__collective_t *);

static ddp_status_t run_rounds_or_single(shm_state_t *S, const ddp__collective_t *c, int kind,
                                         size_t bytes, shm_collective_fn rounds,
                                         shm_collective_fn single)
{
    unsigned candidates = 1u << DDP__SHM_ALG_ROUNDS;
    if (S->cma_enabled && bytes) {
        if (!(S->fixed & FIXED_CMA) && bytes >= TUNE_CMA_MIN) candidates |= 1u << DDP__SHM_ALG_CMA;
        if ((S->fixed & FIXED_CMA) && bytes >= S->cma_bytes) candidates = 1u << DDP__SHM_ALG_CMA;
    }
    const int key = ddp__shm_tune_key(kind, bytes);
    const int variant = ddp__shm_tune_pick(&S->tune, key, candidates, DDP__SHM_ALG_ROUNDS);
    set_algorithm(S, variant);
    /* Timed only where there is a choice: two precise clock reads are ~60 ns of a 270 ns
     * broadcast of a few bytes (perf, 2 ranks), which has rounds as its only candidate. */
    if (!(candidates & (candidates - 1)))
        return variant == DDP__SHM_ALG_CMA ? single(S, c) : rounds(S, c);
    S->untimed_ns = 0;
    const int64_t start = ddp__now_ns();
    ddp_status_t s = variant == DDP__SHM_ALG_CMA ? single(S, c) : rounds(S, c);
    if (s == DDP_OK)
        ddp__shm_tune_record(&S->tune, key, variant, candidates, bytes,
                             ddp__now_ns() - start - S->untimed_ns);
    return s;
}

/* Broadcast, allgather, reduce-scatter, alltoall: from registered memory where every rank's
 * source is (shm_pulled.c), else rounds or single copy. */
static ddp_status_t run_pulled_or(shm_state_t *S, const ddp__collective_t *c, int kind,
                                  size_t bytes, shm_collective_fn rounds, shm_collective_fn single)
{
    if (S->world > 1 && bytes >= ddp__shm_pull_min(S->world)) {
        int ran;
        ddp_status_t s = ddp__shm_try_pulled(S, c, ddp__shm_tune_key(kind, bytes), &ran);
        if (s != DDP_OK || ran) return s;
    }
    return run_rounds_or_single(S, c, kind, bytes, rounds, single);
}

/* reduce_scatter_apply: mapped (shm_pulled.c) when every rank registered its send and recv;
 * else reduce_scatter into scratch, the function, allgather in place, each rounds or single
 * copy (not the pulled way: a try just found a rank unregistered). */
static ddp_status_t run_reduce_scatter_apply(shm_state_t *S, const ddp__collective_t *c)
{
    const size_t esize = ddp_dtype_size(c->dtype), block = c->count * esize;
    const size_t bytes = block * (size_t)S->world;
    if (S->world > 1 && bytes >= ddp__shm_pull_min(S->world)) {
        int ran;
        ddp_status_t s = ddp__shm_try_apply(S, c, ddp__shm_tune_key(5, bytes), &ran);
        if (s != DDP_OK || ran) return s;
    }
    void *reduced = ddp__malloc(block ? block : 1, "reduce_scatter_apply's block");
    if (!reduced) return DDP_ERR_NO_MEMORY;
    ddp__collective_t rs = *c;
    rs.kind = DDP__REDUCE_SCATTER;
    rs.recv = reduced;
    ddp_status_t s = run_rounds_or_single(S, &rs, 3, bytes, ddp__shm_reduce_scatter_rounds,
                                          ddp__shm_reduce_scatter_cma);
    if (s == DDP_OK) {
        const size_t first = (size_t)S->rank * c->count;
        if (c->count) c->apply(c->apply_arg, first, reduced, c->count);
        ddp__collective_t ag = *c;
        ag.kind = DDP__ALLGATHER;
        ag.op = 0;
        ag.send = (char *)c->recv + first * esize;
        s = run_rounds_or_single(S, &ag, 2, bytes, ddp__shm_allgather_rounds,
                                 ddp__shm_allgather_cma);
    }
    free(reduced);
    return s;
}

ddp_status_t ddp__shm_run(void *state, const ddp__collective_t *c)
{
    shm_state_t *S = state;
    atomic_store_explicit(&S->ranks[S->rank].seq, c->seq, memory_order_relaxed);
    const size_t esize = ddp_dtype_size(c->dtype);
    ddp_status_t s;
    switch (c->kind) {
    case DDP__ALLREDUCE: s = run_allreduce(S, c); break;
    case DDP__BROADCAST:
        s = run_pulled_or(S, c, 1, c->count * esize, ddp__shm_broadcast_rounds,
                          ddp__shm_broadcast_cma);
        break;
    case DDP__ALLGATHER:
        s = run_pulled_or(S, c, 2, c->count * esize * (size_t)S->world,
                          ddp__shm_allgather_rounds, ddp__shm_allgather_cma);
        break;
    case DDP__REDUCE_SCATTER:
        s = run_pulled_or(S, c, 3, c->count * esize * (size_t)S->world,
                          ddp__shm_reduce_scatter_rounds, ddp__shm_reduce_scatter_cma);
        break;
    case DDP__ALLTOALL:
        s = run_pulled_or(S, c, 4, c->count * esize * (size_t)S->world,
                          ddp__shm_alltoall_rounds, ddp__shm_alltoall_cma);
        break;
    case DDP__REDUCE_SCATTER_APPLY: s = run_reduce_scatter_apply(S, c); break;
    case DDP__BARRIER: {
        set_algorithm(S, DDP__SHM_ALG_BARRIER);
        shm_fingerprint_t fp;
        ddp__shm_fingerprint_of(c, &fp);
        s = ddp__shm_first_sync(S, c, &fp);
        break;
    }
    default:
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "shm: unknown collective kind %d", (int)c->kind);
    }
    if (s != DDP_OK) S->last_status = s;
    return s;
}
