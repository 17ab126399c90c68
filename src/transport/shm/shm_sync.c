/* Synchronisation of the shared-memory transport: one counter per rank ("step"): a rank
 * publishes step s when it has done its part of a phase, and waits until every rank's step is
 * >= s. Waiting spins briefly, yields, then sleeps on a futex in the segment; while asleep it
 * wakes every 100 ms to check deadlines, peers' abort flags and whether the ranks it waits for
 * are still alive. A rank that gives up poisons the steps of the ranks not yet in, so that every
 * rank's outcome of a phase is the same (docs/shm-transport.md has the argument). */
#include <errno.h>
#include <linux/futex.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "transport/shm/shm.h"
#include "transport/shm/shm_internal.h"

static void futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts = {(time_t)(timeout_ns / 1000000000LL), (long)(timeout_ns % 1000000000LL)};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

/* Wakes sleepers after this rank published something (a step or an abort). */
static void wake_peers(shm_state_t *S)
{
    if (atomic_load(&S->hdr->sleepers) > 0) {
        atomic_fetch_add(&S->hdr->wake, 1);
        futex_wake_all(&S->hdr->wake);
    }
}

/* A peer is dead when its pid is gone or a zombie. */
static int peer_dead(int pid)
{
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

static void describe(const ddp__collective_t *c, char *buf, size_t size)
{
    if (c) ddp__fingerprint_describe(c, buf, size);
    else snprintf(buf, size, "rendezvous");
}

static _Atomic int64_t nap_override_ns;

/* ---- agreement: arrivals and give-ups exclude each other ---------------------------------- */

/* A rank that gives up on a phase (timeout, a peer's death or abort) must not leave a late rank
 * to complete it: every rank's outcome of a collective is the same. The decision is taken on the
 * step words themselves. A rank arrives at step t with a compare-and-swap of its own step from
 * t-1 to t; a rank that gives up at t swaps every step that is still below t to a poison value
 * naming itself and keeping the step the word held (so a rank still waiting for an earlier phase
 * sees that the poisoned rank did reach it). Exactly one of the two swaps wins on each word, so either every rank
 * arrived (nobody can poison any more: the collective completes everywhere, and the rank that
 * wanted to give up goes on waiting) or some rank's step is poisoned (it can never arrive: every
 * waiter and the late rank itself fail). The argument is written out in docs/shm-transport.md. */
#define POISON_BIT (1ULL << 63)
#define POISON_RANK_SHIFT 48
#define POISON_STEP_MASK ((1ULL << POISON_RANK_SHIFT) - 1)

static uint64_t poison_of(int rank, uint64_t step)
{
    return POISON_BIT | ((uint64_t)rank << POISON_RANK_SHIFT) | (step & POISON_STEP_MASK);
}

static int poisoner_of(uint64_t v) { return (int)((v & ~POISON_BIT) >> POISON_RANK_SHIFT); }

/* A step word has reached `target` (a poisoned word keeps the last step its owner reached). */
static inline int reached(uint64_t v, uint64_t target) { return (v & POISON_STEP_MASK) >= target; }

/* A step word that was poisoned below `target`: its owner can never reach it. */
static inline int lost_below(uint64_t v, uint64_t target)
{
    return (v & POISON_BIT) && (v & POISON_STEP_MASK) < target;
}

/* ---- waiting ------------------------------------------------------------------------------ */

/* Whether every rank reached `target`: polls the step counters, or, for a first phase
 * (mailbox >= 0), the stamps of that mailbox parity (each is stored just after its owner's step
 * swap succeeded, with the fingerprint and small data it carries). */
static int all_arrived(shm_state_t *S, uint64_t target, int mailbox)
{
    if (mailbox >= 0) {
        for (int j = 0; j < S->world; j++)
            if (atomic_load_explicit(&S->ranks[j].mailbox[mailbox].stamp, memory_order_acquire) <
                target)
                return 0;
        return 1;
    }
    for (int j = 0; j < S->world; j++)
        if (!reached(atomic_load_explicit(&S->ranks[j].step, memory_order_acquire), target))
            return 0;
    return 1;
}

/* Rank j's published give-up (abort flag and reason) as this rank's error, or DDP_OK. */
static ddp_status_t peer_gave_up(shm_state_t *S, int j, const ddp__collective_t *c)
{
    int st = atomic_load(&S->ranks[j].abort_status);
    if (st == 0) return DDP_OK;
    char what[256];
    describe(c, what, sizeof what);
    ddp_status_t s = st == DDP_ERR_TIMEOUT ? DDP_ERR_TIMEOUT : DDP_ERR_REMOTE;
    return ddp__error(s, "%s on rank %d: rank %d gave up (%s): %.*s", what, S->rank, j,
                      ddp_status_string((ddp_status_t)st), REASON_MAX, S->ranks[j].abort_reason);
}

/* Whether rank j has published its part of phase `target` (its stamp for a first phase). */
static int published(shm_state_t *S, int j, uint64_t target, int mailbox)
{
    if (mailbox >= 0)
        return atomic_load_explicit(&S->ranks[j].mailbox[mailbox].stamp, memory_order_acquire) >=
               target;
    return reached(atomic_load_explicit(&S->ranks[j].step, memory_order_acquire), target);
}

/* The error of a rank that finds rank j's step poisoned by the rank that gave up. That rank
 * publishes its reason right after the swap: wait briefly for it so that the text names the
 * cause, not only the rank. */
ddp_status_t ddp__shm_poisoned_error(shm_state_t *S, int j, uint64_t poison,
                                     const ddp__collective_t *c)
{
    int q = poisoner_of(poison);
    if (q < 0 || q >= S->world) q = j;
    for (int i = 0; i < 1000 && atomic_load(&S->ranks[q].abort_status) == 0; i++) {
        if (q != S->rank && peer_dead(atomic_load(&S->ranks[q].pid))) break;
        ddp__sleep_us(1000);
    }
    char what[256];
    describe(c, what, sizeof what);
    int st = atomic_load(&S->ranks[q].abort_status);
    if (j == S->rank)
        return ddp__error(DDP_ERR_REMOTE,
                          "%s on rank %d: rank %d gave up on it before this rank arrived "
                          "(%s): %.*s",
                          what, S->rank, q, st ? ddp_status_string((ddp_status_t)st) : "no reason",
                          REASON_MAX, st ? S->ranks[q].abort_reason : "");
    if (st != 0) return peer_gave_up(S, q, c);
    return ddp__error(DDP_ERR_REMOTE, "%s on rank %d: rank %d gave up on it before rank %d arrived",
                      what, S->rank, q, j);
}

/* Checks peers' steps, abort flags and liveness; returns DDP_OK or the cause to give up for
 * (give_up decides whether the collective is really lost). */
static ddp_status_t check_peers(shm_state_t *S, uint64_t target, int mailbox,
                                const ddp__collective_t *c, int check_liveness)
{
    for (int j = 0; j < S->world; j++) {
        uint64_t v = atomic_load(&S->ranks[j].step);
        if (lost_below(v, target)) return ddp__shm_poisoned_error(S, j, v, c);
    }
    for (int j = 0; j < S->world; j++) {
        if (j == S->rank) continue;
        ddp_status_t s = peer_gave_up(S, j, c);
        if (s != DDP_OK) return s;
    }
    if (check_liveness) {
        for (int j = 0; j < S->world; j++) {
            if (j == S->rank || published(S, j, target, mailbox)) continue;
            int pid = atomic_load(&S->ranks[j].pid);
            if (peer_dead(pid)) {
                /* A rank that left (or gave up) raises its flag and may exit right after: it
                 * can be gone by now although its flag was still down a moment ago. */
                ddp_status_t s = peer_gave_up(S, j, c);
                if (s != DDP_OK) return s;
                char what[256];
                describe(c, what, sizeof what);
                return ddp__error(DDP_ERR_REMOTE,
                                  "%s on rank %d: rank %d (pid %d) died (it was at seq %llu)", what,
                                  S->rank, j, pid,
                                  (unsigned long long)atomic_load(&S->ranks[j].seq));
            }
        }
    }
    return DDP_OK;
}

/* Decides, for a rank that wants to give up on phase `target`, whether the phase is lost:
 * swaps the step of every rank still below `target` to this rank's poison. Returns 1 when some
 * rank's step is (now, or already) poisoned, or when a rank that is in has died before
 * publishing its stamp: then no rank can complete the phase. Returns 0 when every rank is in:
 * the phase completes everywhere, and this rank must wait on instead of failing. */
static int give_up(shm_state_t *S, uint64_t target, int mailbox)
{
    int lost = 0;
    for (int j = 0; j < S->world; j++) {
        _Atomic uint64_t *step = &S->ranks[j].step;
        uint64_t v = atomic_load(step);
        for (;;) {
            if (lost_below(v, target)) {
                lost = 1;
                break;
            }
            if (reached(v, target)) {
                /* In, but a first phase's stamp comes after the swap: a rank that died in
                 * between can never publish it. */
                if (j != S->rank && !published(S, j, target, mailbox) &&
                    peer_dead(atomic_load(&S->ranks[j].pid)))
                    lost = 1;
                break;
            }
            if (atomic_compare_exchange_strong(step, &v, poison_of(S->rank, v))) {
                lost = 1;
                break;
            }
        }
    }
    return lost;
}

static ddp_status_t timeout_error(shm_state_t *S, uint64_t target, int mailbox,
                                  const ddp__collective_t *c)
{
    char what[256];
    describe(c, what, sizeof what);
    char missing[1024];
    size_t off = 0;
    missing[0] = '\0';
    for (int j = 0; j < S->world && off < sizeof missing - 64; j++) {
        if (published(S, j, target, mailbox)) continue;
        off += (size_t)snprintf(missing + off, sizeof missing - off, "%srank %d (at seq %llu)",
                                off ? ", " : "", j,
                                (unsigned long long)atomic_load(&S->ranks[j].seq));
    }
    return ddp__error(DDP_ERR_TIMEOUT,
                      "%s on rank %d timed out after %d ms: did not arrive: %s", what, S->rank,
                      S->timeout_ms, missing[0] ? missing : "(none: they arrived just now)");
}

/* Whether a rank that has not reached `target` last ran on `cpu`: waiting for it by spinning
 * would hold the very core it needs (more ranks than cores), so the waiter yields instead. */
static int missing_on_cpu(shm_state_t *S, uint64_t target, int mailbox, int cpu)
{
    for (int j = 0; j < S->world; j++) {
        uint64_t at = mailbox >= 0 ? atomic_load_explicit(&S->ranks[j].mailbox[mailbox].stamp,
                                                          memory_order_relaxed)
                                   : atomic_load_explicit(&S->ranks[j].step, memory_order_relaxed);
        if (!reached(at, target) &&
            atomic_load_explicit(&S->ranks[j].cpu, memory_order_relaxed) == cpu)
            return 1;
    }
    return 0;
}

/* The second half of a deferred arrival (arrive_ex): wakes sleeping peers if there are any.
 * Checking the sleepers count needs a sequentially consistent step store (a sleeper registers,
 * then reads the steps: one of the two must see the other's store). Such a store right after
 * the stage writes waits for every line this rank just wrote (its stage, its mailbox) to come
 * back from the peers that read them; done when the wait ends (or when its spin does), those
 * transfers overlap the wait for the peers instead (2 ranks, 2 KiB allreduce: 1.24 -> 1.11
 * us). It runs before this rank yields, sleeps or returns from the wait. */
void ddp__shm_settle_arrival(shm_state_t *S)
{
    if (!S->wake_due) return;
    S->wake_due = 0;
    /* A locked swap of the step to the value it has: the fence, and in C11 terms the operation
     * that the sleepers load is ordered with (an xchg measured faster than mfence; a plain
     * store here could overwrite a peer's poison for the next phase). */
    uint64_t expected = S->step;
    atomic_compare_exchange_strong(&S->ranks[S->rank].step, &expected, S->step);
    wake_peers(S);
}

static ddp_status_t sleep_until(shm_state_t *S, uint64_t target, int mailbox,
                                const ddp__collective_t *c, int64_t deadline_ns);

/* A wait on a progress thread: no spinning, yields for up to progress_yield_ns, then sleeps.
 * When ddprun pins a rank, its progress thread shares the rank's one CPU with the user's
 * thread, which is computing the rest of backward while buckets are reduced: a spin there takes
 * the CPU from the compute, a yield hands it over and polls again when the compute's slice ends
 * or when the user's thread blocks (in finalize), when the CPU is otherwise idle. The long yield
 * phase keeps an idle rank polling instead of asleep, so a late peer's arrival is seen at once.
 * Trainer, slower rank's exposed time, medians of 6 interleaved runs against spinning (up to
 * 50 us) as on the user's thread: hidden 1024, batch 64 per rank 0.47 -> 0.35 ms; hidden 1024
 * and 4096 at batch 1 and hidden 4096 at batch 64 even. */
static ddp_status_t wait_progress(shm_state_t *S, uint64_t target, int mailbox,
                                  const ddp__collective_t *c, int64_t deadline_ns)
{
    ddp__shm_settle_arrival(S);
    int64_t start = ddp__now_ns();
    for (unsigned i = 1;; i++) {
        sched_yield();
        if (all_arrived(S, target, mailbox)) return DDP_OK;
        if ((i & 7) == 0 && ddp__now_ns() - start > S->progress_yield_ns) break;
    }
    return sleep_until(S, target, mailbox, c, deadline_ns);
}

static ddp_status_t wait_all_body(shm_state_t *S, uint64_t target, int mailbox,
                                  const ddp__collective_t *c, int64_t deadline_ns)
{
    /* Spin (cheapest hand-off when the peer runs on another core), then yield (the peer may be
     * waiting for this core), then sleep on the futex. The clock is read only every 64 polls.
     * While a missing rank shares this rank's CPU, the spin yields to it at once: with two
     * ranks on a core, each collective then costs that core one switch, not a yield ping-pong
     * between two waiters. The spin budget adapts: waits that end while spinning double it (up
     * to spin_max_ns), waits that outlast it halve it, so a waiter quickly stops burning a time
     * slice that a peer needs. */
    if (S->refused) return ddp__shm_poisoned_error(S, S->rank, S->refused, c);
    if (all_arrived(S, target, mailbox)) return DDP_OK;
    if (c && c->on_progress_thread) return wait_progress(S, target, mailbox, c, deadline_ns);
    /* The clock is first read after 8 polls: most small waits end before, and a read costs
     * ~30 ns of a 450 ns collective here (kvm-clock). */
    int64_t start = 0;
    /* Only when another rank last ran on this CPU is the per-poll check worth its reads. */
    int cpu = -1;
    for (int j = 0; S->cpu >= 0 && j < S->world; j++)
        if (j != S->rank &&
            atomic_load_explicit(&S->ranks[j].cpu, memory_order_relaxed) == S->cpu)
            cpu = S->cpu;
    for (unsigned i = 1;; i++) {
        if (all_arrived(S, target, mailbox)) {
            if (S->spin_ns < S->spin_max_ns) S->spin_ns *= 2;
            return DDP_OK;
        }
        if (cpu >= 0 && missing_on_cpu(S, target, mailbox, cpu)) {
            ddp__shm_settle_arrival(S);
            sched_yield();
        } else {
            cpu_relax();
        }
        if (i == 8) start = ddp__now_ns();
        else if ((i & 63) == 0 && ddp__now_ns() - start > S->spin_ns) break;
    }
    if (S->spin_ns > S->spin_min_ns) S->spin_ns /= 2;
    ddp__shm_settle_arrival(S);
    for (unsigned i = 1;; i++) {
        if (all_arrived(S, target, mailbox)) return DDP_OK;
        sched_yield();
        if ((i & 7) == 0 && ddp__now_ns() - start > S->spin_ns + S->yield_ns) break;
    }
    return sleep_until(S, target, mailbox, c, deadline_ns);
}


void ddp__shm_set_nap_ns(int64_t nap_ns) { atomic_store(&nap_override_ns, nap_ns); }

/* The futex part of a wait, after the spinning and yielding. */
static ddp_status_t sleep_until(shm_state_t *S, uint64_t target, int mailbox,
                                const ddp__collective_t *c, int64_t deadline_ns)
{
    /* The publisher's fence before its sleepers check comes after its stamp (first phases) or is
     * its step swap (the others), so a sleeper decides on the words it was woken for. */
    int64_t next_check = 0;
    for (;;) {
        uint32_t w = atomic_load(&S->hdr->wake);
        atomic_fetch_add(&S->hdr->sleepers, 1);
        /* Orders the registration before the loads below in C11 terms too (they are acquire
         * loads; x86 orders them after the locked add anyway). */
        atomic_thread_fence(memory_order_seq_cst);
        if (all_arrived(S, target, mailbox)) {
            atomic_fetch_sub(&S->hdr->sleepers, 1);
            return DDP_OK;
        }
        int64_t now = ddp__now_ns();
        int liveness = now >= next_check;
        if (liveness) next_check = now + 100000000LL;
        ddp_status_t s = check_peers(S, target, mailbox, c, liveness);
        if (s == DDP_OK && now >= deadline_ns) s = timeout_error(S, target, mailbox, c);
        int64_t nap = deadline_ns - now;
        if (s != DDP_OK) {
            atomic_fetch_sub(&S->hdr->sleepers, 1);
            if (all_arrived(S, target, mailbox)) return DDP_OK;
            if (give_up(S, target, mailbox)) {
                ddp__shm_publish_abort(S, s, ddp_last_error());
                return s;
            }
            /* Every rank is in: the phase completes everywhere, so this rank may not fail it.
             * Only a stamp is still missing, stored a few instructions after its owner's swap. */
            atomic_fetch_add(&S->hdr->sleepers, 1);
            nap = 1000000LL;
        }
        int64_t nap_max = atomic_load_explicit(&nap_override_ns, memory_order_relaxed);
        if (nap_max <= 0) nap_max = 100000000LL;
        if (nap > nap_max) nap = nap_max;
        if (nap < 1000000LL) nap = 1000000LL;
        futex_wait(&S->hdr->wake, w, nap);
        atomic_fetch_sub(&S->hdr->sleepers, 1);
    }
}

/* Waits until every rank reached `target` (polling the stamps of mailbox parity `mailbox` for a
 * first phase, the steps otherwise). */
ddp_status_t ddp__shm_wait_all_on(shm_state_t *S, uint64_t target, int mailbox,
                                  const ddp__collective_t *c, int64_t deadline_ns)
{
    ddp_status_t s = wait_all_body(S, target, mailbox, c, deadline_ns);
    ddp__shm_settle_arrival(S);
    return s;
}

ddp_status_t ddp__shm_wait_all(shm_state_t *S, uint64_t target, const ddp__collective_t *c,
                               int64_t deadline_ns)
{
    return ddp__shm_wait_all_on(S, target, -1, c, deadline_ns);
}

/* Publishes this rank's next step (its part of a phase is done); returns the step to wait for.
 * `defer`: the sleepers check is left to the wait (settle_arrival). That pays for small
 * collectives; in the staged rounds of large ones, 1-4 MiB measured 5-16 % slower with it, so
 * they check at once. A refused arrival is recorded in S->refused and reported by the wait. */
uint64_t ddp__shm_arrive_ex(shm_state_t *S, int defer)
{
    uint64_t target = ++S->step;
    int cpu = sched_getcpu();
    if (cpu != S->cpu) {
        S->cpu = cpu;
        atomic_store_explicit(&S->ranks[S->rank].cpu, cpu, memory_order_relaxed);
    }
    /* The arrival: a swap from the previous step, which fails only when a peer that gave up on
     * this phase poisoned the word first (see give_up). The swap is on this rank's own line,
     * which its peers do not poll during small collectives, so it costs no transfer. */
    uint64_t expected = target - 1;
    if (!atomic_compare_exchange_strong(&S->ranks[S->rank].step, &expected, target)) {
        if (!S->refused) S->refused = expected;
        S->wake_due = 0;
        return target;
    }
    if (defer) S->wake_due = 1;
    else wake_peers(S);
    return target;
}

uint64_t ddp__shm_arrive(shm_state_t *S)
{
    return ddp__shm_arrive_ex(S, 0);
}

/* Publishes this rank's next step and waits for every rank to reach it. */
ddp_status_t ddp__shm_sync_all(shm_state_t *S, const ddp__collective_t *c, int64_t deadline_ns)
{
    return ddp__shm_wait_all(S, ddp__shm_arrive(S), c, deadline_ns);
}

/* ---- abort ------------------------------------------------------------------------------- */

void ddp__shm_publish_abort(shm_state_t *S, ddp_status_t status, const char *reason)
{
    shm_rank_t *me = &S->ranks[S->rank];
    if (atomic_load(&me->abort_status) != 0) return;
    snprintf(me->abort_reason, sizeof me->abort_reason, "%s", reason);
    atomic_store(&me->abort_status, (int32_t)(status ? status : DDP_ERR_REMOTE));
    atomic_fetch_add(&S->hdr->wake, 1);
    futex_wake_all(&S->hdr->wake);
}


/* A read of a peer's memory failed (status s, its text the last error). The peer most likely
 * left because the collective already failed elsewhere (it gave up, or another rank died and it
 * exited): then its published reason is the cause to report, not "No such process". Either way
 * this rank gives up on its next phase through the agreement protocol (its own step is below
 * it, so the phase is lost for every rank) and publishes why. */
ddp_status_t ddp__shm_cma_failed(shm_state_t *S, const ddp__collective_t *c, ddp_status_t s)
{
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "%s", ddp_last_error());
    uint64_t target = S->step + 1;
    ddp_status_t cause = check_peers(S, target, -1, c, 1);
    if (cause == DDP_OK) {
        char what[256];
        describe(c, what, sizeof what);
        cause = ddp__error(s, "%s on rank %d: %s", what, S->rank, text);
    }
    give_up(S, target, -1);
    ddp__shm_publish_abort(S, cause, ddp_last_error());
    return cause;
}
