/* Shared-memory transport: every rank of the group on one host maps one segment and runs the
 * collectives through it (see docs/shm-transport.md for the layout and the reasons).
 *
 * Synchronisation is one counter per rank ("step"): a rank publishes step s when it has done
 * its part of a phase, and waits until every rank's step is >= s. Every collective starts with
 * such a phase whose data includes the fingerprint, so ranks that disagree all see it before
 * anyone reads a byte of someone else's data. Waiting spins briefly, yields, then sleeps on a
 * futex in the segment; while asleep it wakes every 100 ms to check deadlines, peers' abort
 * flags and whether the ranks it waits for are still alive. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/transport.h"
#include "transport/shm/shm.h"
#include "transport/shm/shm_cma.h"
#include "transport/shm/shm_desc.h"
#include "transport/shm/shm_map.h"
#include "transport/shm/shm_tune.h"

#define SHM_MAGIC 0x3230746d68737064ULL /* "dpshmt02" */
#define LINE 64
#define PAGE 4096
/* Per rank and parity: the staging area each round of a large collective goes through. */
#define STAGE_BYTES ((size_t)1 << 20)
/* Default bytes per rank per round of a staged broadcast, allgather or reduce-scatter: small
 * enough that a round's staging stays in L2 while the next is copied in (1 MiB rounds made
 * broadcast and allgather 3-4x slower from 4 MiB up). */
#define ROUND_BYTES_DEFAULT ((size_t)256 << 10)
/* The staged allreduce's rounds: the whole stage. Its stage writes are streamed, so the staging
 * need not stay in L2, and fewer rounds mean fewer synchronisations: 2 ranks, 5 interleaved
 * runs, 1 MiB against 256 KiB rounds: 2 MiB +6 %, 8 MiB +9 %, 32 MiB +5 %, 128 MiB +7 %
 * (docs/shm-transport.md). */
#define ALLREDUCE_ROUND_BYTES_DEFAULT STAGE_BYTES
/* Allreduces up to this size go the one-shot way (every rank reduces everything itself). Above
 * it the staged path wins now that its stages are streamed: 2 ranks, 32 KiB-256 KiB took 4.0-19
 * us staged against 4.9-28 us one-shot (docs/shm-transport.md). */
#define ONESHOT_BYTES_DEFAULT ((size_t)16 << 10)
#define REASON_MAX 512
/* Collectives at least this large write the caller's output with non-temporal stores: the output
 * will not fit in the caches anyway, and streaming stores skip reading each line before writing
 * it (a third of the memory traffic of a copy). */
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES ((size_t)8 << 20)
#endif
#define DDP__SHM_MAX_WORLD 64
/* Knobs rank 0 had set explicitly (shm_header_t.fixed): the tuner keeps to them. */
#define FIXED_ONESHOT 1u     /* DDP_SHM_ONESHOT_BYTES: one-shot exactly up to it */
#define FIXED_CMA 2u         /* DDP_SHM_CMA_BYTES: single copy exactly from it */
#define FIXED_STORES_NT 4u   /* DDP_SHM_STAGED_STORES=nt */
#define FIXED_STORES_PLAIN 8u /* DDP_SHM_STAGED_STORES=plain */
#define FIXED_ROUNDS_LONG 16u  /* DDP_SHM_STAGED_ROUNDS=long */
#define FIXED_ROUNDS_SHORT 32u /* DDP_SHM_STAGED_ROUNDS=short */
/* The one-shot variant is a candidate of the tuner below this size (every rank reduces
 * everything: p times the work of a slice, worth it only while synchronisation dominates). */
#define TUNE_ONESHOT_MAX ((size_t)256 << 10)
/* Single copy is a candidate from this size (below it, a system call per peer and piece costs
 * more than the staging it saves). */
#define TUNE_CMA_MIN ((size_t)256 << 10)

/* What every rank must agree on for one collective (the common record of transport.h), plus
 * the zero-copy hints. This is the local copy; what crosses processes is the mailbox below. */
typedef struct shm_fingerprint {
    ddp__fingerprint_t id;
    int64_t buffer_id; /* -1: not in a segment buffer */
    uint64_t send_offset;
    uint64_t recv_offset;
    ddp__shm_map_hint_t map[2]; /* send, recv in registered memory (slot -1: not) */
} shm_fingerprint_t;

typedef struct shm_header {
    uint64_t magic;
    uint32_t world;
    uint32_t reserved;
    uint64_t stage_bytes;
    uint64_t segment_bytes;
    uint64_t round_bytes;   /* chosen by rank 0 so that every rank chunks the same way */
    uint64_t oneshot_bytes;
    uint64_t allreduce_round_bytes;
    char pad0[LINE - 56];
    _Atomic uint32_t wake;     /* futex word: bumped when a rank publishes while others sleep */
    _Atomic uint32_t sleepers; /* ranks inside (or about to enter) FUTEX_WAIT */
    char pad1[LINE - 8];
    /* Rank 0's choices for single-copy transfers (see shm_cma.h): the smallest allreduce that
     * reads peers' buffers directly, and the tuner's mode. */
    uint64_t cma_bytes;
    uint32_t tune_mode; /* ddp__shm_tune_mode_t */
    uint32_t fixed;     /* FIXED_* bits: knobs set explicitly, which the tuner leaves alone */
    char pad2[LINE - 16];
} shm_header_t;

/* One cache line: the fingerprint of a collective's first phase, the step it was written for,
 * and the data of a small collective, so that a waiter's one poll brings all three.
 * Why not the common 32-byte ddp__fingerprint_t here: with the 8-byte stamp it would leave 24
 * bytes of data in the line instead of 32 (a 32-byte allreduce, 4 f64 or 8 f32, would lose the
 * one-line path), or push the data into a second line that every waiter must also pull. kind,
 * dtype and op fit in a byte each, which buys those 8 bytes; the mailbox is packed from and
 * read back into ddp__fingerprint_t (fingerprint_in), so the rule of what must match and the
 * text of a mismatch stay the common ones. */
#define MAILBOX_DATA 32
typedef struct shm_mailbox {
    _Atomic uint64_t stamp; /* the step this mailbox was written for (stored last, release) */
    uint64_t seq;
    uint64_t count;
    uint8_t kind, dtype, op, pad;
    int16_t root;         /* < DDP__SHM_MAX_WORLD (the group checks roots) */
    uint16_t tune_update; /* rank 0's: a tuner decision every rank applies here (shm_tune.h) */
    unsigned char data[MAILBOX_DATA];
} shm_mailbox_t;

/* The zero-copy hints of a first phase (read only for large allreduces). */
typedef struct shm_hints {
    int64_t buffer_id; /* -1: not in a segment buffer */
    uint64_t send_offset;
    uint64_t recv_offset;
} shm_hints_t;

typedef struct shm_rank {
    _Atomic uint64_t step; /* written by the owner only: last phase it completed its part of */
    char pad0[LINE - 8];
    shm_mailbox_t mailbox[2]; /* by step parity */
    shm_hints_t hints[2];     /* by step parity */
    char pad1[LINE - 2 * sizeof(shm_hints_t)];
    _Atomic uint64_t seq; /* the collective the owner is in (or last ran): for error messages */
    _Atomic int32_t pid;
    _Atomic int32_t abort_status; /* 0, or the ddp_status_t with which the owner gave up */
    char abort_reason[REASON_MAX];
    char pad2[LINE - 16];
    /* The CPU the owner ran on when it last arrived (-1: not yet). In a line of its own that
     * changes only when the owner migrates, so waiters read it from their own cache. */
    _Atomic int32_t cpu;
    char pad3[LINE - 4];
    /* Single copy (shm_cma.c): where this rank's buffers of the current allreduce are, in its
     * own address space (written before its first phase, read by peers until its last), and
     * the create-time probe: a word peers read with process_vm_readv, and this rank's verdict
     * on reading every peer's (0: ok, -1: not wanted here, else the errno). */
    uint64_t cma_send, cma_recv;
    uint64_t cma_probe_addr;
    int32_t cma_verdict;
    char pad4[LINE - 28];
    /* Registered memory (shm_map.h): where this rank's send and recv are, by step parity like
     * the hints (written in the first phase), and its verdict on mapping its peers' exports at
     * a collective that needed new views (1 ok, 0 not). */
    ddp__shm_map_hint_t map_hints[2][2];
    int32_t map_verdict;
    char pad5[4 * LINE - 4 * sizeof(ddp__shm_map_hint_t) - 4];
    /* The generation of each of this process's registrations (0: none) and a counter that
     * changes with them: peers drop their views of registrations that are gone, so memory
     * freed here is not kept alive by their mappings. */
    _Atomic uint32_t live_epoch;
    uint32_t live_gen[DDP__SHM_MAP_SLOTS];
    char pad6[3 * LINE - 4 - 4 * DDP__SHM_MAP_SLOTS];
} shm_rank_t;

_Static_assert(sizeof(shm_header_t) == 3 * LINE, "header is three cache lines");
_Static_assert(sizeof(shm_rank_t) % LINE == 0, "rank lines are cache-line sized");
_Static_assert(sizeof(shm_mailbox_t) == LINE, "a mailbox is one cache line");

typedef struct shm_buffer {
    int64_t id;
    char *base;    /* the whole mapping: world regions */
    size_t region; /* bytes per rank */
    size_t total;
    int fd; /* -1 once every rank has attached */
    /* Set by advise_cold_results: zero-copy allreduce writes other ranks' results with
     * non-temporal stores (see there). */
    _Atomic int cold_results;
    struct shm_buffer *next;
} shm_buffer_t;

typedef struct shm_state {
    int rank;
    int world;
    int timeout_ms;
    ddp_store_t *store;
    char prefix[600];
    int fd;
    char *base;
    size_t size;
    shm_header_t *hdr;
    shm_rank_t *ranks;
    char *stage;
    uint64_t step; /* this rank's step (progress thread) */
    uint64_t use;  /* stage uses so far (progress thread); parity = use & 1 */
    size_t round_bytes;
    size_t allreduce_round_bytes;
    size_t oneshot_bytes;
    int64_t spin_ns;  /* how long a waiter spins before yielding (adapts, see wait_all) */
    int64_t spin_max_ns;
    int64_t spin_min_ns;
    int64_t yield_ns; /* then how long it yields before sleeping on the futex */
    int64_t progress_yield_ns; /* the same on a progress thread, which does not spin */
    int cpu;          /* the CPU this rank last published (see arrive) */
    int wake_due;     /* arrived, but sleepers not checked yet (see settle_arrival) */
    uint64_t refused; /* the poison found in this rank's step when its arrival was refused */
    ddp_status_t last_status;
    pthread_mutex_t buffers_mu;
    shm_buffer_t *buffers;
    int64_t next_buffer_id;
    /* Single copy: agreed by every rank at create (setup_cma); then allreduces of at least
     * cma_bytes from user buffers read peers' buffers directly. */
    int cma_enabled;
    size_t cma_bytes;
    uint64_t cma_probe; /* the word peers read at create */
    ddp__shm_cma_t cma;
    ddp__shm_tune_t tune;
    int64_t untimed_ns; /* of the current call: one-off costs the tuner does not count */
    uint32_t fixed; /* the header's FIXED_* bits */
    _Atomic int last_algorithm; /* shm_algorithm_t of the last collective (ddp-bench reports it) */
    /* Registered memory: DDP_SHM_MAP (this rank's; a rank with it off publishes no hints, so
     * nobody maps), the agreed views of peers' exports, and per size class whether every rank
     * passed registered memory (agreed: then the one-shot variant is no candidate there). */
    int map_wanted;
    ddp__shm_views_t views;
    uint8_t map_class[DDP__SHM_TUNE_CLASSES];
    uint32_t live_seen[DDP__SHM_MAX_WORLD]; /* each peer's live_epoch when its views were pruned */
} shm_state_t;

/* ---- small helpers ------------------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* memcpy, with non-temporal stores when `stream` (see STREAM_MIN_BYTES). */
static void copy_out(void *dst, const void *src, size_t bytes, int stream)
{
    if (stream)
        ddp__copy_stream(dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

static char *stage_of(shm_state_t *S, int r, unsigned parity)
{
    return S->stage + ((size_t)r * 2 + parity) * STAGE_BYTES;
}

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

static void publish_abort(shm_state_t *S, ddp_status_t status, const char *reason);

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
static ddp_status_t poisoned_error(shm_state_t *S, int j, uint64_t poison,
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
        if (lost_below(v, target)) return poisoned_error(S, j, v, c);
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
static void settle_arrival(shm_state_t *S)
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
    settle_arrival(S);
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
    if (S->refused) return poisoned_error(S, S->rank, S->refused, c);
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
            settle_arrival(S);
            sched_yield();
        } else {
            cpu_relax();
        }
        if (i == 8) start = ddp__now_ns();
        else if ((i & 63) == 0 && ddp__now_ns() - start > S->spin_ns) break;
    }
    if (S->spin_ns > S->spin_min_ns) S->spin_ns /= 2;
    settle_arrival(S);
    for (unsigned i = 1;; i++) {
        if (all_arrived(S, target, mailbox)) return DDP_OK;
        sched_yield();
        if ((i & 7) == 0 && ddp__now_ns() - start > S->spin_ns + S->yield_ns) break;
    }
    return sleep_until(S, target, mailbox, c, deadline_ns);
}

static _Atomic int64_t nap_override_ns;
static double tune_skew[DDP__SHM_VARIANTS];

void ddp__shm_set_tune_skew(const double *skew, int n)
{
    for (int v = 0; v < DDP__SHM_VARIANTS; v++) tune_skew[v] = v < n ? skew[v] : 0.0;
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
                publish_abort(S, s, ddp_last_error());
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
static ddp_status_t wait_all_on(shm_state_t *S, uint64_t target, int mailbox,
                                const ddp__collective_t *c, int64_t deadline_ns)
{
    ddp_status_t s = wait_all_body(S, target, mailbox, c, deadline_ns);
    settle_arrival(S);
    return s;
}

static ddp_status_t wait_all(shm_state_t *S, uint64_t target, const ddp__collective_t *c,
                             int64_t deadline_ns)
{
    return wait_all_on(S, target, -1, c, deadline_ns);
}

/* Publishes this rank's next step (its part of a phase is done); returns the step to wait for.
 * `defer`: the sleepers check is left to the wait (settle_arrival). That pays for small
 * collectives; in the staged rounds of large ones, 1-4 MiB measured 5-16 % slower with it, so
 * they check at once. A refused arrival is recorded in S->refused and reported by the wait. */
static uint64_t arrive_ex(shm_state_t *S, int defer)
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

static uint64_t arrive(shm_state_t *S)
{
    return arrive_ex(S, 0);
}

/* Publishes this rank's next step and waits for every rank to reach it. */
static ddp_status_t sync_all(shm_state_t *S, const ddp__collective_t *c, int64_t deadline_ns)
{
    return wait_all(S, arrive(S), c, deadline_ns);
}

/* ---- fingerprints ------------------------------------------------------------------------- */

static void fingerprint_of(const ddp__collective_t *c, shm_fingerprint_t *fp)
{
    memset(fp, 0, sizeof *fp);
    fp->id = ddp__fingerprint_of(c);
    fp->buffer_id = -1;
    fp->map[0].slot = fp->map[1].slot = -1;
}

/* The common record a mailbox was packed from (for the text of a mismatch). */
static ddp__fingerprint_t fingerprint_in(const shm_mailbox_t *mb)
{
    ddp__fingerprint_t f;
    memset(&f, 0, sizeof f);
    f.seq = mb->seq;
    f.count = mb->count;
    f.kind = mb->kind;
    f.dtype = mb->dtype;
    f.op = mb->op;
    f.root = mb->root;
    return f;
}

/* The first phase of every collective: publish the fingerprint (with up to MAILBOX_DATA bytes
 * of the caller's data, and the zero-copy hints) in this rank's mailbox, wait for everyone,
 * compare. Every rank compares every rank with rank 0, so all ranks reach the same verdict and
 * print the same text. Returns the mailbox parity in *parity. `defer`: see arrive_ex. */
static ddp_status_t first_sync_data(shm_state_t *S, const ddp__collective_t *c,
                                    const shm_fingerprint_t *mine, const void *data,
                                    size_t data_bytes, int defer, unsigned *parity)
{
    /* Arrive first (the step swap), then publish the mailbox: a stamp a peer sees is then the
     * stamp of a rank that is in, which no give-up can undo. */
    uint64_t target = arrive_ex(S, 1);
    unsigned q = (unsigned)(target & 1);
    if (S->refused) return poisoned_error(S, S->rank, S->refused, c);
    shm_rank_t *me = &S->ranks[S->rank];
    shm_mailbox_t *mb = &me->mailbox[q];
    mb->seq = mine->id.seq;
    mb->count = mine->id.count;
    mb->kind = (uint8_t)mine->id.kind;
    mb->dtype = (uint8_t)mine->id.dtype;
    mb->op = (uint8_t)mine->id.op;
    mb->root = (int16_t)mine->id.root;
    mb->tune_update = S->rank == 0 ? ddp__shm_tune_take_update(&S->tune) : 0;
    if (data_bytes) memcpy(mb->data, data, data_bytes);
    me->hints[q].buffer_id = mine->buffer_id;
    me->hints[q].send_offset = mine->send_offset;
    me->hints[q].recv_offset = mine->recv_offset;
    me->map_hints[q][0] = mine->map[0];
    me->map_hints[q][1] = mine->map[1];
    atomic_store_explicit(&mb->stamp, target, memory_order_release);
    if (!defer) settle_arrival(S);
    ddp_status_t s = wait_all_on(S, target, (int)q, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    *parity = q;
    const shm_mailbox_t *m0 = &S->ranks[0].mailbox[q];
    for (int j = 1; j < S->world; j++) {
        const shm_mailbox_t *mj = &S->ranks[j].mailbox[q];
        if (mj->seq != m0->seq || mj->count != m0->count || mj->kind != m0->kind ||
            mj->dtype != m0->dtype || mj->op != m0->op || mj->root != m0->root) {
            ddp__fingerprint_t f0 = fingerprint_in(m0), fj = fingerprint_in(mj);
            char d0[256], dj[256];
            ddp__fingerprint_text(&f0, d0, sizeof d0);
            ddp__fingerprint_text(&fj, dj, sizeof dj);
            return ddp__error(DDP_ERR_MISMATCH,
                              "collective mismatch (seen on rank %d): rank 0 called %s but rank %d "
                              "called %s",
                              S->rank, d0, j, dj);
        }
    }
    /* Every rank applies rank 0's tuner decision at this same collective. */
    if (m0->tune_update) ddp__shm_tune_apply(&S->tune, m0->tune_update, c->trace);
    return DDP_OK;
}

static ddp_status_t first_sync(shm_state_t *S, const ddp__collective_t *c,
                               const shm_fingerprint_t *mine)
{
    unsigned q;
    return first_sync_data(S, c, mine, NULL, 0, 0, &q);
}

/* ---- segment buffers ---------------------------------------------------------------------- */

/* The segment buffer holding [p, p + bytes) in this rank's region, with its offset. */
static shm_buffer_t *find_buffer(shm_state_t *S, const void *p, size_t bytes, size_t *offset)
{
    shm_buffer_t *found = NULL;
    pthread_mutex_lock(&S->buffers_mu);
    for (shm_buffer_t *b = S->buffers; b; b = b->next) {
        const char *mine = b->base + (size_t)S->rank * b->region;
        if ((const char *)p >= mine && (const char *)p + bytes <= mine + b->region) {
            *offset = (size_t)((const char *)p - mine);
            found = b;
            break;
        }
    }
    pthread_mutex_unlock(&S->buffers_mu);
    return found;
}

/* Splits n elements into world slices aligned to 64 bytes; slice r is [*lo, *hi). */
static void slice_of(size_t n, int world, int r, size_t esize, size_t *lo, size_t *hi)
{
    size_t align = LINE / esize;
    size_t per = round_up((n + (size_t)world - 1) / (size_t)world, align);
    size_t a = per * (size_t)r, b = a + per;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* ---- collectives -------------------------------------------------------------------------- */

/* How the last collective ran (ddp_group_algorithm). */
typedef enum {
    ALG_NONE,
    ALG_MAILBOX,
    ALG_ONESHOT,
    ALG_STAGED,
    ALG_STAGED_PLAIN,
    ALG_STAGED_NT_SHORT,
    ALG_STAGED_PLAIN_LONG,
    ALG_ZERO_COPY,
    ALG_CMA,
    ALG_MAPPED,
    ALG_ROUNDS, /* broadcast, allgather, reduce_scatter: rounds through the stage */
    ALG_BARRIER,
} shm_algorithm_t;

static const char *const algorithm_names[] = {
    "none", "mailbox", "one-shot", "staged:nt", "staged:plain", "staged:nt:short",
    "staged:plain:long", "zero-copy", "single-copy", "mapped",
    "rounds", "barrier",
};

static void set_algorithm(shm_state_t *S, int algorithm)
{
    atomic_store_explicit(&S->last_algorithm, algorithm, memory_order_relaxed);
}

/* Stages the slices of n elements that the other ranks reduce (this rank's own slice is read
 * from the caller's buffer directly), with non-temporal stores: the other ranks read these lines
 * and wrote nothing into them, and a plain store would first pull each line back from the
 * caches of the ranks that read the previous round (measured: the staged allreduce got ~2x
 * faster at 512 KiB - 128 MiB). */
static void copy_in_others(shm_state_t *S, char *stage, const char *src, size_t n, size_t esize,
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

/* A read of a peer's memory failed (status s, its text the last error). The peer most likely
 * left because the collective already failed elsewhere (it gave up, or another rank died and it
 * exited): then its published reason is the cause to report, not "No such process". Either way
 * this rank gives up on its next phase through the agreement protocol (its own step is below
 * it, so the phase is lost for every rank) and publishes why. */
static ddp_status_t cma_failed(shm_state_t *S, const ddp__collective_t *c, ddp_status_t s)
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
    publish_abort(S, cause, ddp_last_error());
    return cause;
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
static ddp_status_t run_allreduce_cma(shm_state_t *S, const ddp__collective_t *c)
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
    if (s != DDP_OK) return cma_failed(S, c, s);
    if (profile) t[1] = ddp__now_ns();
    s = sync_all(S, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    if (profile) t[2] = ddp__now_ns();
    for (int j = 0; j < p; j++) {
        size_t jlo, jhi;
        slice_of(c->count, p, j, esize, &jlo, &jhi);
        if (j == me || jhi <= jlo) continue;
        int err;
        s = ddp__shm_cma_read(pids[j], (char *)c->recv + jlo * esize, recvs[j] + jlo * esize,
                              (jhi - jlo) * esize, "a peer's result", &err);
        if (s != DDP_OK) return cma_failed(S, c, ddp__error_context(s, "rank %d's slice", j));
    }
    if (profile) t[3] = ddp__now_ns();
    s = sync_all(S, c, c->deadline_ns);
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

/* ---- registered memory ---------------------------------------------------------------------- */

/* Where a rank's edges live in its stage (of the collective's parity): the bytes of its buffers
 * outside their export's whole pages, less than a page (plus an element) at each end. The owner
 * stages its send edges; the ranks reducing those elements write the results for its recv edges,
 * which it copies out after the last phase. */
#define EDGE_SEND_HEAD 0
#define EDGE_SEND_TAIL (2 * PAGE)
#define EDGE_RECV_HEAD (4 * PAGE)
#define EDGE_RECV_TAIL (6 * PAGE)

/* Elements [*lo, *hi) of a buffer of n elements described by h lie in its export's pages. */
static void covered(const ddp__shm_map_hint_t *h, size_t n, size_t esize, size_t *lo, size_t *hi)
{
    size_t a = h->start > h->addr ? (size_t)(h->start - h->addr + esize - 1) / esize : 0;
    size_t b = h->end > h->addr ? (size_t)(h->end - h->addr) / esize : 0;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
    if (*hi < *lo) *hi = *lo;
}

/* DDP_SHM_MAP: off, on (registered memory), auto (also buffers libddp registers itself). */
enum { MAP_OFF, MAP_ON, MAP_AUTO };
/* The smallest buffer DDP_SHM_MAP=auto registers (below, a copy through the stage is cheap). */
#define MAP_AUTO_MIN ((size_t)128 << 10)

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
static void prune_views(shm_state_t *S)
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
static int map_lookup(shm_state_t *S, const void *p, size_t bytes, ddp__shm_map_hint_t *hint)
{
    if (ddp__shm_map_find(p, bytes, hint)) return 1;
    return S->map_wanted == MAP_AUTO && bytes >= MAP_AUTO_MIN && ddp__shm_map_auto(p, bytes) &&
           ddp__shm_map_find(p, bytes, hint);
}

/* This rank's hints for c's buffers in fp->map (publishing its live registrations first), or
 * slot -1 in both; returns whether both are registered. */
static int map_buffers(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                       shm_fingerprint_t *fp)
{
    if (!S->map_wanted || S->world < 2 || fp->buffer_id >= 0) return 0;
    publish_live(S);
    const size_t esize = ddp_dtype_size(c->dtype);
    if ((uintptr_t)c->send % esize || (uintptr_t)c->recv % esize) return 0;
    if (!map_lookup(S, c->send, bytes, &fp->map[0])) return 0;
    if (c->recv == c->send) {
        fp->map[1] = fp->map[0];
    } else if (!map_lookup(S, c->recv, bytes, &fp->map[1])) {
        fp->map[0].slot = fp->map[1].slot = -1;
        return 0;
    }
    return 1;
}

/* Whether every rank published registered buffers in the first phase of parity q. */
static int all_registered(const shm_state_t *S, unsigned q)
{
    for (int k = 0; k < S->world; k++)
        if (S->ranks[k].map_hints[q][0].slot < 0 || S->ranks[k].map_hints[q][1].slot < 0)
            return 0;
    return 1;
}

/* map_buffers, and the edges of send for the peers that reduce them (written at the parity the
 * collective uses if it is mapped; if it is not, the staged path overwrites them). */
static void map_hints_of(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                         shm_fingerprint_t *fp)
{
    if (!map_buffers(S, c, bytes, fp)) return;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t lo, hi;
    covered(&fp->map[0], c->count, esize, &lo, &hi);
    char *stage = stage_of(S, S->rank, (unsigned)(S->use & 1));
    memcpy(stage + EDGE_SEND_HEAD, c->send, lo * esize);
    memcpy(stage + EDGE_SEND_TAIL, (const char *)c->send + hi * esize, (c->count - hi) * esize);
}

/* After the first phase, every rank having passed registered memory: whether the agreed views
 * let the mapped path run now, mapping what is missing (one more phase, where every rank says
 * whether it could). The same answer on every rank. */
static int decide_mapped(shm_state_t *S, const ddp__collective_t *c, unsigned fparity,
                         ddp__shm_map_hint_t *hints, ddp_status_t *status)
{
    const int p = S->world;
    *status = DDP_OK;
    for (int k = 0; k < p; k++) {
        hints[2 * k] = S->ranks[k].map_hints[fparity][0];
        hints[2 * k + 1] = S->ranks[k].map_hints[fparity][1];
    }
    int ready = ddp__shm_views_ready(&S->views, hints, 2);
    if (ready != 0) return ready > 0;
    int pids[DDP__SHM_MAX_WORLD];
    for (int k = 0; k < p; k++) pids[k] = atomic_load_explicit(&S->ranks[k].pid, memory_order_relaxed);
    S->ranks[S->rank].map_verdict = ddp__shm_views_prepare(&S->views, hints, 2, pids);
    *status = sync_all(S, c, c->deadline_ns);
    if (*status != DDP_OK) return 0;
    int all_ok = 1;
    for (int k = 0; k < p; k++) all_ok &= S->ranks[k].map_verdict == 1;
    ddp__shm_views_settle(&S->views, hints, 2, all_ok);
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

/* Mapped allreduce (every rank's send and recv in registered memory, every view agreed): rank r
 * reduces slice r reading every rank's send where it lies (its export, through this rank's
 * view; its edges, from its stage) and writes the result into every rank's recv (its export, or
 * the edge area of its stage); one phase ends it, after which each rank copies its own edge
 * results in. Each rank reads every input once and writes every output once; the same kernel in
 * the same rank order as every other path, so the bytes are the same whichever ran. In place is
 * safe for the reason the zero-copy path is: element i is read and written only by its slice's
 * owner, in one pass. */
static ddp_status_t run_allreduce_mapped(shm_state_t *S, const ddp__collective_t *c,
                                         const ddp__shm_map_hint_t *hints)
{
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
            covered(&hints[2 * k + b], n, esize, &lo_of[k][b], &hi_of[k][b]);
            if (lo_of[k][b] > lo && lo_of[k][b] < hi) cuts[ncuts++] = lo_of[k][b];
            if (hi_of[k][b] > lo && hi_of[k][b] < hi) cuts[ncuts++] = hi_of[k][b];
        }
    }
    /* Sorted cut points: between two, every rank's element lies in one place. */
    for (int i = 1; i < ncuts; i++)
        for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            size_t t = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = t;
        }
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
        /* Plain stores: streaming the results (all, or this rank's own, or the peers') was slower
         * or no faster at 128 KiB-128 MiB in both states of the test VM (2 ranks: 8 MiB 25-38
         * against 52-57 GB/s, 128 MiB 10-17 against 19). Every rank reducing everything into
         * its own recv (no remote writes) was slower too (2 MiB 33 against 46 GB/s). */
        ddp__reduce_multi_stream(dsts, nd, 0u, srcs, p, y - x, c->dtype, c->op);
    }
    ddp_status_t s = sync_all(S, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    /* My recv's edges: the others' slices of them are in my stage. */
    const char *stage = stage_of(S, me, q);
    copy_except((char *)c->recv, stage + EDGE_RECV_HEAD, 0, lo_of[me][1], lo, hi, esize);
    copy_except((char *)c->recv + hi_of[me][1] * esize, stage + EDGE_RECV_TAIL, 0,
                n - hi_of[me][1], lo > hi_of[me][1] ? lo - hi_of[me][1] : 0,
                hi > hi_of[me][1] ? hi - hi_of[me][1] : 0, esize);
    return DDP_OK;
}

/* One allreduce above the mailbox size, the way `variant` says (ddp__shm_variant_t; -1: by the
 * static thresholds). */
static ddp_status_t run_allreduce_as(shm_state_t *S, const ddp__collective_t *c, int variant)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    const size_t bytes = c->count * esize;
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    ddp_status_t s;

    if (bytes <= MAILBOX_DATA) {
        /* Tiny: the data travels in the mailbox line with the fingerprint. */
        set_algorithm(S, ALG_MAILBOX);
        unsigned q;
        s = first_sync_data(S, c, &fp, c->send, bytes, 1, &q);
        if (s != DDP_OK || bytes == 0) return s;
        const void *srcs[DDP__SHM_MAX_WORLD];
        for (int j = 0; j < p; j++) srcs[j] = S->ranks[j].mailbox[q].data;
        ddp__reduce(c->recv, srcs, p, c->count, c->dtype, c->op);
        return DDP_OK;
    }
    if (variant < 0 ? bytes <= S->oneshot_bytes : variant == DDP__SHM_V_ONESHOT) {
        /* One-shot: stage, one synchronisation, every rank reduces all slots in rank order. */
        set_algorithm(S, ALG_ONESHOT);
        /* Registered memory on every rank: this size class goes the mapped way from the next
         * call on (the one-shot variant stops being a candidate, the same on every rank). */
        if (variant >= 0) map_buffers(S, c, bytes, &fp);
        unsigned q = (unsigned)(S->use++ & 1);
        if (bytes) memcpy(stage_of(S, me, q), c->send, bytes);
        unsigned fq;
        s = first_sync_data(S, c, &fp, NULL, 0, 1, &fq);
        if (s != DDP_OK || bytes == 0) return s;
        if (variant >= 0 && S->map_wanted && p > 1) {
            prune_views(S);
            if (all_registered(S, fq)) S->map_class[ddp__shm_tune_key(0, bytes)] = 1;
        }
        const void *srcs[DDP__SHM_MAX_WORLD];
        for (int j = 0; j < p; j++) srcs[j] = stage_of(S, j, q);
        ddp__reduce(c->recv, srcs, p, c->count, c->dtype, c->op);
        return DDP_OK;
    }

    /* Zero copy when send and recv live in one segment buffer at the same offsets everywhere. */
    size_t send_off = 0, recv_off = 0;
    shm_buffer_t *buf = find_buffer(S, c->send, bytes, &send_off);
    if (buf && find_buffer(S, c->recv, bytes, &recv_off) == buf) {
        fp.buffer_id = buf->id;
        fp.send_offset = send_off;
        fp.recv_offset = recv_off;
    }
    map_hints_of(S, c, bytes, &fp);
    /* A rank that may go the zero-copy or the mapped way does not stage round 0 before the first
     * phase; if in the end nobody can, every rank stages it after. */
    const int hoping = fp.buffer_id >= 0 || fp.map[0].slot >= 0;
    const size_t line_elems = LINE / esize;
    /* Two knobs, each tuned (docs/shm-transport.md, "Self-tuning"): the stores that write the
     * stage, and the round size. By default streamed stores go with whole-stage rounds (fewer
     * synchronisations) and plain ones with L2-sized rounds (the staging stays in L2); -1 (the
     * static rules, up to the one-shot size here) is the former. */
    const int stream_stage = variant < 0 || ddp__shm_variant_streams(variant);
    const int long_rounds = variant < 0 || ddp__shm_variant_long_rounds(variant);
    const size_t round = long_rounds ? S->allreduce_round_bytes : S->round_bytes;
    size_t chunk = round / esize / (size_t)p / line_elems * line_elems;
    chunk *= (size_t)p;
    if (chunk == 0) chunk = (size_t)p * line_elems;
    int precopied = 0;
    unsigned parity0 = (unsigned)(S->use & 1);
    /* Agreed on every rank before the first phase: the flag at create, the size (checked by the
     * fingerprint) and rank 0's threshold. Buffers in one segment buffer everywhere still go the
     * zero-copy way (decided after the first phase), so nobody stages round 0 then either. */
    const int cma = variant < 0 ? S->cma_enabled && bytes >= S->cma_bytes
                                : variant == DDP__SHM_V_CMA;
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
        copy_in_others(S, stage_of(S, me, parity0), c->send, n0, esize, stream_stage);
        precopied = 1;
    }
    unsigned fparity;
    s = first_sync_data(S, c, &fp, NULL, 0, 0, &fparity);
    if (s != DDP_OK) return s;
    int all_zero_copy = 1, any_zero_copy = 0;
    for (int j = 0; j < p; j++) {
        const shm_hints_t *fj = &S->ranks[j].hints[fparity];
        if (fj->buffer_id >= 0 || S->ranks[j].map_hints[fparity][0].slot >= 0) any_zero_copy = 1;
        if (fj->buffer_id < 0 || fj->buffer_id != fp.buffer_id ||
            fj->send_offset != fp.send_offset || fj->recv_offset != fp.recv_offset)
            all_zero_copy = 0;
    }
    if (!all_zero_copy && any_zero_copy) prune_views(S);
    if (!all_zero_copy && any_zero_copy && all_registered(S, fparity)) {
        S->map_class[ddp__shm_tune_key(0, bytes)] = 1;
        ddp__shm_map_hint_t hints[2 * DDP__SHM_MAX_WORLD];
        int mapped = decide_mapped(S, c, fparity, hints, &s);
        if (s != DDP_OK) return s;
        if (mapped) {
            set_algorithm(S, ALG_MAPPED);
            return run_allreduce_mapped(S, c, hints);
        }
    }

    if (!all_zero_copy && cma) {
        set_algorithm(S, ALG_CMA);
        return run_allreduce_cma(S, c);
    }
    if (all_zero_copy) {
        set_algorithm(S, ALG_ZERO_COPY);
        /* Rank r reduces slice r straight from every rank's region and writes the result into
         * slice r of every rank's region; one barrier ends it. */
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
        return sync_all(S, c, c->deadline_ns);
    }

    /* Staged rounds: copy a chunk in, reduce my slice of it (into my stage, and into my recv),
     * synchronise, copy the other slices out. The copy-in of round t+1 is done between
     * publishing "reduced t" and waiting for everyone's "reduced t", so it overlaps with the
     * peers' reductions instead of idling (safe: that stage parity was last read in round t-1,
     * which every rank finished before arriving at round t). */
    const char *send = c->send;
    char *recv = c->recv;
    const int stream = bytes >= STREAM_MIN_BYTES;
    set_algorithm(S, stream_stage ? (long_rounds ? ALG_STAGED : ALG_STAGED_NT_SHORT)
                                  : (long_rounds ? ALG_STAGED_PLAIN_LONG : ALG_STAGED_PLAIN));
    if (any_zero_copy) {
        /* Some rank did not stage round 0 (it hoped for zero copy): stage it now, everywhere. */
        if (!precopied) {
            size_t n0 = c->count < chunk ? c->count : chunk;
            copy_in_others(S, stage_of(S, me, parity0), send, n0, esize, stream_stage);
        }
        s = sync_all(S, c, c->deadline_ns);
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
        uint64_t reduced = arrive(S);
        size_t next = o + n;
        unsigned next_q = 0;
        if (next < c->count) {
            size_t n2 = c->count - next < chunk ? c->count - next : chunk;
            next_q = (unsigned)(S->use++ & 1);
            copy_in_others(S, stage_of(S, me, next_q), send + next * esize, n2, esize,
                           stream_stage);
        }
        s = wait_all(S, reduced, c, c->deadline_ns);
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
        s = sync_all(S, c, c->deadline_ns); /* round t+1 staged everywhere */
        if (s != DDP_OK) return s;
        o = next;
        q = next_q;
    }
    return DDP_OK;
}

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
    if (nt && want_long != 0) set |= 1u << DDP__SHM_V_STAGED_NT;
    if (nt && (want_long == 0 || (want_long < 0 && both))) set |= 1u << DDP__SHM_V_STAGED_NT_SHORT;
    if (plain && want_long != 1) set |= 1u << DDP__SHM_V_STAGED_PLAIN;
    if (plain && (want_long == 1 || (want_long < 0 && both)))
        set |= 1u << DDP__SHM_V_STAGED_PLAIN_LONG;
    if (!(S->fixed & FIXED_ONESHOT) && bytes < TUNE_ONESHOT_MAX)
        set |= 1u << DDP__SHM_V_ONESHOT;
    if (S->cma_enabled) {
        if (!(S->fixed & FIXED_CMA) && bytes >= TUNE_CMA_MIN) set |= 1u << DDP__SHM_V_CMA;
        /* Threshold set explicitly: single copy exactly from it, and only it. */
        if ((S->fixed & FIXED_CMA) && bytes >= S->cma_bytes) set = 1u << DDP__SHM_V_CMA;
    }
    return set;
}

/* Allreduce: small ones by the static rules; above the one-shot threshold the tuner picks the
 * variant (the same on every rank) and is told how long the call took. */
static ddp_status_t run_allreduce(shm_state_t *S, const ddp__collective_t *c)
{
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    if (bytes <= MAILBOX_DATA || bytes <= S->oneshot_bytes) return run_allreduce_as(S, c, -1);
    const int cls = ddp__shm_tune_key(0, bytes);
    unsigned candidates = allreduce_candidates(S, bytes);
    /* Registered memory everywhere in this class before: it goes the mapped way, which the
     * one-shot variant would bypass. */
    if (S->map_class[cls] && (candidates & ~(1u << DDP__SHM_V_ONESHOT)))
        candidates &= ~(1u << DDP__SHM_V_ONESHOT);
    /* With tuning off: the stores asked for (nt by default) with the rounds asked for (by
     * default those that go with the stores). */
    const int plain = (S->fixed & FIXED_STORES_PLAIN) != 0;
    const int long_rounds = S->fixed & FIXED_ROUNDS_LONG    ? 1
                            : S->fixed & FIXED_ROUNDS_SHORT ? 0
                                                            : !plain;
    const int staged = plain ? (long_rounds ? DDP__SHM_V_STAGED_PLAIN_LONG
                                            : DDP__SHM_V_STAGED_PLAIN)
                             : (long_rounds ? DDP__SHM_V_STAGED_NT : DDP__SHM_V_STAGED_NT_SHORT);
    const int fallback = S->cma_enabled && bytes >= S->cma_bytes ? DDP__SHM_V_CMA : staged;
    const int variant = ddp__shm_tune_pick(&S->tune, cls, candidates, fallback);
    S->untimed_ns = 0;
    const int64_t start = ddp__now_ns();
    ddp_status_t s = run_allreduce_as(S, c, variant);
    /* Segment buffers in place everywhere ran zero-copy, registered memory everywhere ran
     * mapped, whatever the variant: not a sample of it. */
    const int ran = atomic_load_explicit(&S->last_algorithm, memory_order_relaxed);
    if (s == DDP_OK && ran != ALG_ZERO_COPY && ran != ALG_MAPPED)
        ddp__shm_tune_record(&S->tune, cls, variant, candidates, bytes,
                             ddp__now_ns() - start - S->untimed_ns);
    return s;
}

static ddp_status_t run_broadcast(shm_state_t *S, const ddp__collective_t *c)
{
    const int me = S->rank, root = c->root;
    const size_t esize = ddp_dtype_size(c->dtype);
    const size_t chunk = S->round_bytes / esize;
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    char *buf = c->recv;
    size_t o = 0;
    int first = 1;
    do {
        size_t n = c->count - o < chunk ? c->count - o : chunk;
        unsigned q = (unsigned)(S->use++ & 1);
        if (me == root && n) memcpy(stage_of(S, root, q), buf + o * esize, n * esize);
        ddp_status_t s = first ? first_sync(S, c, &fp) : sync_all(S, c, c->deadline_ns);
        if (s != DDP_OK) return s;
        first = 0;
        if (me != root && n)
            copy_out(buf + o * esize, stage_of(S, root, q), n * esize,
                     c->count * esize >= STREAM_MIN_BYTES);
        o += n;
    } while (o < c->count);
    return DDP_OK;
}

static ddp_status_t run_reduce_scatter(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t per_block = S->round_bytes / esize / (size_t)p; /* elements of each block per round */
    if (per_block == 0) per_block = 1;
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    const char *send = c->send;
    char *recv = c->recv;
    const size_t n = c->count;
    size_t o = 0;
    int first = 1;
    do {
        size_t k = n - o < per_block ? n - o : per_block;
        unsigned q = (unsigned)(S->use++ & 1);
        char *mine = stage_of(S, me, q);
        for (int b = 0; b < p && k; b++)
            memcpy(mine + (size_t)b * k * esize, send + ((size_t)b * n + o) * esize, k * esize);
        ddp_status_t s = first ? first_sync(S, c, &fp) : sync_all(S, c, c->deadline_ns);
        if (s != DDP_OK) return s;
        first = 0;
        if (k) {
            const void *srcs[DDP__SHM_MAX_WORLD];
            for (int j = 0; j < p; j++) srcs[j] = stage_of(S, j, q) + (size_t)me * k * esize;
            ddp__reduce(recv + o * esize, srcs, p, k, c->dtype, c->op);
        }
        o += k;
    } while (o < n);
    return DDP_OK;
}

static ddp_status_t run_allgather(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    const size_t chunk = S->round_bytes / esize;
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    const char *send = c->send;
    char *recv = c->recv;
    const size_t n = c->count;
    const int in_place = send == recv + (size_t)me * n * esize;
    size_t o = 0;
    int first = 1;
    do {
        size_t k = n - o < chunk ? n - o : chunk;
        unsigned q = (unsigned)(S->use++ & 1);
        if (k) memcpy(stage_of(S, me, q), send + o * esize, k * esize);
        ddp_status_t s = first ? first_sync(S, c, &fp) : sync_all(S, c, c->deadline_ns);
        if (s != DDP_OK) return s;
        first = 0;
        for (int j = 0; j < p && k; j++) {
            char *dst = recv + ((size_t)j * n + o) * esize;
            if (j == me) {
                if (!in_place) memcpy(dst, send + o * esize, k * esize);
            } else {
                copy_out(dst, stage_of(S, j, q), k * esize, n * (size_t)p * esize >= STREAM_MIN_BYTES);
            }
        }
        o += k;
    } while (o < n);
    return DDP_OK;
}

/* ---- single copy and tuning for broadcast, allgather, reduce_scatter ------------------------ */

/* Publishes where this rank's buffer is for a single-copy collective (peers read it after the
 * first phase, until the last) and registers it for huge pages (not segment buffers). */
static void cma_publish(shm_state_t *S, const void *buffer, size_t bytes)
{
    S->ranks[S->rank].cma_send = (uint64_t)(uintptr_t)buffer;
    size_t offset;
    if (bytes && !find_buffer(S, buffer, bytes, &offset))
        S->untimed_ns += ddp__shm_cma_register(&S->cma, buffer, bytes);
}

static int pid_of(shm_state_t *S, int j)
{
    return atomic_load_explicit(&S->ranks[j].pid, memory_order_relaxed);
}

/* Every rank reads the root's buffer straight into its own; the last phase keeps the root's
 * buffer unchanged until every rank has read it. */
static ddp_status_t run_broadcast_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    if (S->rank == c->root) cma_publish(S, c->recv, bytes);
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    ddp_status_t s = first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    if (S->rank != c->root) {
        int err;
        s = ddp__shm_cma_read(pid_of(S, c->root), c->recv,
                              (uintptr_t)S->ranks[c->root].cma_send, bytes, "the root's buffer",
                              &err);
        if (s != DDP_OK) return cma_failed(S, c, s);
    }
    return sync_all(S, c, c->deadline_ns);
}

/* Every rank reads every peer's send straight into its place in recv. In place (send is this
 * rank's block of recv) is safe: a rank writes only the other ranks' blocks of its recv, and
 * peers read only its own block. */
static ddp_status_t run_allgather_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    char *recv = c->recv;
    cma_publish(S, c->send, bytes);
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    ddp_status_t s = first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    for (int j = 0; j < p; j++) {
        if (j == me) continue;
        int err;
        s = ddp__shm_cma_read(pid_of(S, j), recv + (size_t)j * bytes,
                              (uintptr_t)S->ranks[j].cma_send, bytes, "a peer's send buffer", &err);
        if (s != DDP_OK) return cma_failed(S, c, ddp__error_context(s, "rank %d's block", j));
    }
    if (c->send != recv + (size_t)me * bytes) memcpy(recv + (size_t)me * bytes, c->send, bytes);
    return sync_all(S, c, c->deadline_ns);
}

/* Rank r reads block r of every peer's send and reduces them with its own, in rank order (as
 * the rounds do), into recv. In place (recv is block r of send) is safe: peers read the other
 * blocks of this rank's send. */
static ddp_status_t run_reduce_scatter_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), n = c->count;
    cma_publish(S, c->send, n * esize * (size_t)p);
    shm_fingerprint_t fp;
    fingerprint_of(c, &fp);
    ddp_status_t s = first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    int pids[DDP__SHM_MAX_WORLD];
    uintptr_t sends[DDP__SHM_MAX_WORLD];
    for (int j = 0; j < p; j++) {
        pids[j] = pid_of(S, j);
        sends[j] = (uintptr_t)S->ranks[j].cma_send;
    }
    s = ddp__shm_cma_reduce(&S->cma, pids, sends, me, p, (const char *)c->send + (size_t)me * n * esize,
                            c->recv, (size_t)me * n, n, c->dtype, c->op, 0);
    if (s != DDP_OK) return cma_failed(S, c, s);
    return sync_all(S, c, c->deadline_ns);
}

/* Broadcast, allgather, reduce_scatter: rounds through the stage or single copy, chosen by the
 * tuner like the allreduce's variants (kind: the tuner's collective index; bytes: the size
 * ddp-bench calls SIZE). */
static ddp_status_t run_tuned(shm_state_t *S, const ddp__collective_t *c, int kind, size_t bytes,
                              ddp_status_t (*rounds)(shm_state_t *, const ddp__collective_t *),
                              ddp_status_t (*single)(shm_state_t *, const ddp__collective_t *))
{
    unsigned candidates = 1u << DDP__SHM_V_ROUNDS;
    if (S->cma_enabled && bytes) {
        if (!(S->fixed & FIXED_CMA) && bytes >= TUNE_CMA_MIN) candidates |= 1u << DDP__SHM_V_CMA;
        if ((S->fixed & FIXED_CMA) && bytes >= S->cma_bytes) candidates = 1u << DDP__SHM_V_CMA;
    }
    const int key = ddp__shm_tune_key(kind, bytes);
    const int variant = ddp__shm_tune_pick(&S->tune, key, candidates, DDP__SHM_V_ROUNDS);
    set_algorithm(S, variant == DDP__SHM_V_CMA ? ALG_CMA : ALG_ROUNDS);
    S->untimed_ns = 0;
    const int64_t start = ddp__now_ns();
    ddp_status_t s = variant == DDP__SHM_V_CMA ? single(S, c) : rounds(S, c);
    if (s == DDP_OK)
        ddp__shm_tune_record(&S->tune, key, variant, candidates, bytes,
                             ddp__now_ns() - start - S->untimed_ns);
    return s;
}

static ddp_status_t shm_run(void *state, const ddp__collective_t *c)
{
    shm_state_t *S = state;
    atomic_store_explicit(&S->ranks[S->rank].seq, c->seq, memory_order_relaxed);
    const size_t esize = ddp_dtype_size(c->dtype);
    ddp_status_t s;
    switch (c->kind) {
    case DDP__ALLREDUCE: s = run_allreduce(S, c); break;
    case DDP__BROADCAST:
        s = run_tuned(S, c, 1, c->count * esize, run_broadcast, run_broadcast_cma);
        break;
    case DDP__ALLGATHER:
        s = run_tuned(S, c, 2, c->count * esize * (size_t)S->world, run_allgather,
                      run_allgather_cma);
        break;
    case DDP__REDUCE_SCATTER:
        s = run_tuned(S, c, 3, c->count * esize * (size_t)S->world, run_reduce_scatter,
                      run_reduce_scatter_cma);
        break;
    case DDP__BARRIER: {
        set_algorithm(S, ALG_BARRIER);
        shm_fingerprint_t fp;
        fingerprint_of(c, &fp);
        s = first_sync(S, c, &fp);
        break;
    }
    default: s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "shm: unknown collective kind %d", (int)c->kind);
    }
    if (s != DDP_OK) S->last_status = s;
    return s;
}

/* ---- abort and life cycle ----------------------------------------------------------------- */

static void publish_abort(shm_state_t *S, ddp_status_t status, const char *reason)
{
    shm_rank_t *me = &S->ranks[S->rank];
    if (atomic_load(&me->abort_status) != 0) return;
    snprintf(me->abort_reason, sizeof me->abort_reason, "%s", reason);
    atomic_store(&me->abort_status, (int32_t)(status ? status : DDP_ERR_REMOTE));
    atomic_fetch_add(&S->hdr->wake, 1);
    futex_wake_all(&S->hdr->wake);
}

static void shm_abort(void *state, const char *reason)
{
    shm_state_t *S = state;
    if (!S || !S->ranks) return;
    publish_abort(S, S->last_status ? S->last_status : DDP_ERR_REMOTE, reason);
}

/* Opens the memfd another rank published (d, parsed by shm_desc.c) and maps it. */
static ddp_status_t attach_memfd(const ddp__shm_desc_t *d, size_t expected_bytes, char **base,
                                 const char *what)
{
    if (d->total != (unsigned long long)expected_bytes)
        return ddp__error(DDP_ERR_MISMATCH, "shm: %s has %llu bytes but this rank expects %zu",
                          what, d->total, expected_bytes);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", d->pid, d->fd);
    int mfd = open(path, O_RDWR | O_CLOEXEC);
    if (mfd < 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "shm: opening %s (%s of rank 0)", path, what);
    struct stat st;
    if (fstat(mfd, &st) != 0 || (size_t)st.st_size != expected_bytes) {
        close(mfd);
        return ddp__error(DDP_ERR_PROTOCOL, "shm: %s at %s has the wrong size", what, path);
    }
    void *p = mmap(NULL, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    int err = errno;
    close(mfd);
    if (p == MAP_FAILED) return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: mapping %s", what);
    *base = p;
    return DDP_OK;
}

/* Rank 0: an anonymous shared file of `bytes` bytes, mapped; *fd stays open for the others. */
static ddp_status_t create_memfd(size_t bytes, const char *name, int *fd, char **base)
{
    int mfd = memfd_create(name, MFD_CLOEXEC);
    if (mfd < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "shm: memfd_create");
    if (ftruncate(mfd, (off_t)bytes) != 0) {
        int err = errno;
        close(mfd);
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: sizing the segment to %zu bytes", bytes);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        close(mfd);
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: mapping %zu bytes", bytes);
    }
    *fd = mfd;
    *base = p;
    return DDP_OK;
}

static void shm_destroy(void *state);

/* The environment's tuning knobs (src/core/config.c has their defaults and bounds). Every rank
 * reads them all, so that a bad value fails every rank here rather than rank 0 alone while the
 * others wait for its segment; the sizes used are rank 0's (it publishes them in the header). A
 * wait budget of -1 means unset. */
typedef struct {
    long long round_bytes, allreduce_round_bytes, oneshot_bytes;
    long long yield_ns, spin_ns;
    long long cma_bytes, cma_hugepages;
    int cma_wanted;
    int map_wanted; /* DDP_SHM_MAP */
    int tune_mode;  /* ddp__shm_tune_mode_t */
    uint32_t fixed; /* FIXED_* */
} shm_tuning_t;

static int set_explicitly(const char *name)
{
    const char *v = getenv(name);
    return v && *v;
}

/* One byte-count knob; `built_in` is the default documented above, which the config table must
 * give too (checked when the variable is unset, in builds with asserts). */
static ddp_status_t tuned_bytes(const char *name, size_t built_in, long long *out)
{
    ddp_status_t s = ddp__env_integer(name, -1, out);
    if (s != DDP_OK) return s;
    const char *set = getenv(name);
    assert((set && *set) || *out == (long long)built_in);
    (void)set;
    (void)built_in;
    /* The table's bounds keep a round inside one stage. */
    assert(*out >= 0 && (size_t)*out <= STAGE_BYTES);
    return DDP_OK;
}

static ddp_status_t read_tuning(shm_tuning_t *t)
{
    ddp_status_t s;
    if ((s = tuned_bytes("DDP_SHM_ROUND_BYTES", ROUND_BYTES_DEFAULT, &t->round_bytes)) != DDP_OK ||
        (s = tuned_bytes("DDP_SHM_ALLREDUCE_ROUND_BYTES", ALLREDUCE_ROUND_BYTES_DEFAULT,
                         &t->allreduce_round_bytes)) != DDP_OK ||
        (s = tuned_bytes("DDP_SHM_ONESHOT_BYTES", ONESHOT_BYTES_DEFAULT, &t->oneshot_bytes)) !=
            DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_YIELD_NS", -1, &t->yield_ns)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_SPIN_NS", -1, &t->spin_ns)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_CMA_BYTES", -1, &t->cma_bytes)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_CMA_HUGEPAGES", -1, &t->cma_hugepages)) != DDP_OK)
        return ddp__error_context(s, "shm");
    const char *cma = NULL;
    if ((s = ddp__env_text("DDP_SHM_CMA", &cma)) != DDP_OK) return ddp__error_context(s, "shm");
    t->cma_wanted = !cma || strcmp(cma, "off") != 0;
    const char *map = NULL;
    if ((s = ddp__env_text("DDP_SHM_MAP", &map)) != DDP_OK) return ddp__error_context(s, "shm");
    t->map_wanted = !map || !strcmp(map, "auto") ? MAP_AUTO : !strcmp(map, "on") ? MAP_ON : MAP_OFF;
    const char *tune = NULL, *stores = NULL, *rounds = NULL;
    if ((s = ddp__env_text("DDP_SHM_TUNE", &tune)) != DDP_OK ||
        (s = ddp__env_text("DDP_SHM_STAGED_STORES", &stores)) != DDP_OK ||
        (s = ddp__env_text("DDP_SHM_STAGED_ROUNDS", &rounds)) != DDP_OK)
        return ddp__error_context(s, "shm");
    t->tune_mode = !tune || !strcmp(tune, "online") ? DDP__SHM_TUNE_ONLINE
                   : !strcmp(tune, "probe")         ? DDP__SHM_TUNE_PROBE
                                                    : DDP__SHM_TUNE_OFF;
    t->fixed = 0;
    if (set_explicitly("DDP_SHM_ONESHOT_BYTES")) t->fixed |= FIXED_ONESHOT;
    if (set_explicitly("DDP_SHM_CMA_BYTES")) t->fixed |= FIXED_CMA;
    if (stores && !strcmp(stores, "nt")) t->fixed |= FIXED_STORES_NT;
    if (stores && !strcmp(stores, "plain")) t->fixed |= FIXED_STORES_PLAIN;
    if (rounds && !strcmp(rounds, "long")) t->fixed |= FIXED_ROUNDS_LONG;
    if (rounds && !strcmp(rounds, "short")) t->fixed |= FIXED_ROUNDS_SHORT;
    return DDP_OK;
}

/* Decides, the same way on every rank, whether allreduces may read peers' buffers directly:
 * every rank that wants it lets its peers read it, publishes a word for them to read, and
 * tries to read every peer's; then every rank's verdict is in the segment and single copy is
 * on only if every rank read every peer (one refusal, or one rank with DDP_SHM_CMA=off, turns
 * it off everywhere, so no collective ever needs a rank's consent it did not give). */
static ddp_status_t setup_cma(shm_state_t *S, int wanted, int64_t deadline_ns)
{
    shm_rank_t *me = &S->ranks[S->rank];
    if (wanted) ddp__shm_cma_allow_peers();
    S->cma_probe = SHM_MAGIC ^ (uint64_t)getpid();
    me->cma_probe_addr = (uint64_t)(uintptr_t)&S->cma_probe;
    me->cma_verdict = wanted ? 0 : -1;
    ddp_status_t s = sync_all(S, NULL, deadline_ns);
    if (s != DDP_OK) return ddp__error_context(s, "shm: single-copy probe");
    int verdict = wanted ? 0 : -1, refused = -1;
    for (int j = 0; j < S->world && verdict == 0; j++) {
        if (j == S->rank) continue;
        if (S->ranks[j].cma_verdict != 0) { /* that rank does not want it: no need to try */
            verdict = -1;
            break;
        }
        int pid = atomic_load(&S->ranks[j].pid);
        uint64_t word = 0;
        int err = 0;
        s = ddp__shm_cma_read(pid, &word, (uintptr_t)S->ranks[j].cma_probe_addr, sizeof word,
                              "the single-copy probe", &err);
        if (s == DDP_OK && word != (SHM_MAGIC ^ (uint64_t)pid)) err = EIO;
        if (err) {
            verdict = err;
            refused = j;
        }
    }
    ddp__clear_error();
    me->cma_verdict = verdict;
    s = sync_all(S, NULL, deadline_ns);
    if (s != DDP_OK) return ddp__error_context(s, "shm: single-copy probe");
    S->cma_enabled = 1;
    for (int j = 0; j < S->world; j++) {
        int v = S->ranks[j].cma_verdict;
        if (v == 0) continue;
        S->cma_enabled = 0;
        if (j == S->rank && v > 0)
            DDP_LOG(DDP_LOG_INFO, "shm: rank %d cannot read rank %d's memory (%s): allreduces of "
                                  "user buffers stage through the segment",
                    S->rank, refused, strerror(v));
    }
    DDP_LOG(DDP_LOG_INFO, "shm: rank %d: single-copy allreduce (process_vm_readv) %s", S->rank,
            S->cma_enabled ? "on from the first size where it is chosen"
                           : "off (a rank refused or set DDP_SHM_CMA=off): staged copies");
    return DDP_OK;
}

static ddp_status_t shm_create(ddp_store_t *store, const char *group_name, int rank, int world,
                               int timeout_ms, void **state)
{
    if (world > DDP__SHM_MAX_WORLD)
        return ddp__error(DDP_ERR_UNSUPPORTED, "shm: world size %d exceeds the maximum %d", world,
                          DDP__SHM_MAX_WORLD);
    shm_tuning_t tuning;
    ddp_status_t s = read_tuning(&tuning);
    if (s != DDP_OK) return s;
    shm_state_t *S = ddp__calloc(1, sizeof *S, "the shm transport");
    if (!S) return DDP_ERR_NO_MEMORY;
    S->rank = rank;
    S->world = world;
    S->timeout_ms = timeout_ms;
    S->store = store;
    S->fd = -1;
    S->cpu = -1;
    snprintf(S->prefix, sizeof S->prefix, "%s/shm", group_name);
    pthread_mutex_init(&S->buffers_mu, NULL);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    /* More ranks than cores: a spinning waiter steals the core of the rank it waits for. */
    if (ncpu > 0 && world <= ncpu) {
        S->spin_max_ns = 50000;
        S->spin_ns = 20000;
        S->yield_ns = 200000;
    } else {
        S->spin_max_ns = 4000;
        S->spin_ns = 1000;
        S->yield_ns = 200000;
    }
    S->spin_min_ns = 1000;
    S->progress_yield_ns = 20000000;
    if (tuning.yield_ns >= 0) S->yield_ns = S->progress_yield_ns = tuning.yield_ns;
    if (tuning.spin_ns >= 0) S->spin_ns = S->spin_max_ns = S->spin_min_ns = tuning.spin_ns;

    size_t header = sizeof(shm_header_t) + (size_t)world * sizeof(shm_rank_t);
    size_t stage_off = round_up(header, PAGE);
    S->size = stage_off + (size_t)world * 2 * STAGE_BYTES;

    char key[700];
    snprintf(key, sizeof key, "%s/segment", S->prefix);
    if (rank == 0) {
        s = create_memfd(S->size, "ddp-shm-group", &S->fd, &S->base);
        if (s != DDP_OK) goto fail;
        shm_header_t *hdr = (shm_header_t *)S->base;
        hdr->magic = SHM_MAGIC;
        hdr->world = (uint32_t)world;
        hdr->stage_bytes = STAGE_BYTES;
        hdr->segment_bytes = S->size;
        hdr->round_bytes = (uint64_t)tuning.round_bytes;
        hdr->oneshot_bytes = (uint64_t)tuning.oneshot_bytes;
        hdr->allreduce_round_bytes = (uint64_t)tuning.allreduce_round_bytes;
        hdr->cma_bytes = (uint64_t)tuning.cma_bytes;
        hdr->tune_mode = (uint32_t)tuning.tune_mode;
        hdr->fixed = tuning.fixed;
        shm_rank_t *ranks = (shm_rank_t *)(S->base + sizeof(shm_header_t));
        for (int j = 0; j < world; j++) atomic_store(&ranks[j].cpu, -1);
        char value[128];
        snprintf(value, sizeof value, "%d %d %zu", (int)getpid(), S->fd, S->size);
        s = ddp_store_set(store, key, value, strlen(value));
        if (s != DDP_OK) {
            ddp__error_context(s, "shm: publishing the segment");
            goto fail;
        }
    } else {
        const char *keys[1] = {key};
        s = ddp_store_wait(store, keys, 1, timeout_ms);
        if (s != DDP_OK) {
            ddp__error_context(s, "shm: rank %d waiting for rank 0's segment", rank);
            goto fail;
        }
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(store, key, &v, &len);
        if (s != DDP_OK) goto fail;
        ddp__shm_desc_t desc;
        if (ddp__shm_desc_parse(v, len, 3, &desc) != 0)
            s = ddp__error(DDP_ERR_PROTOCOL, "shm: malformed description of the group segment "
                           "'%.*s' (\"pid fd bytes\" expected)", len > 64 ? 64 : (int)len,
                           (const char *)v);
        else
            s = attach_memfd(&desc, S->size, &S->base, "the group segment");
        ddp_free(v);
        if (s != DDP_OK) goto fail;
        shm_header_t *hdr = (shm_header_t *)S->base;
        if (hdr->magic != SHM_MAGIC || hdr->world != (uint32_t)world) {
            s = ddp__error(DDP_ERR_PROTOCOL, "shm: the segment of rank 0 is not a %d-rank segment",
                           world);
            goto fail;
        }
    }
    S->hdr = (shm_header_t *)S->base;
    S->round_bytes = (size_t)S->hdr->round_bytes;
    S->oneshot_bytes = (size_t)S->hdr->oneshot_bytes;
    S->allreduce_round_bytes = (size_t)S->hdr->allreduce_round_bytes;
    S->cma_bytes = (size_t)S->hdr->cma_bytes;
    S->cma.hugepages = tuning.cma_hugepages != 0;
    S->map_wanted = tuning.map_wanted;
    if ((s = ddp__shm_views_init(&S->views, world, rank)) != DDP_OK) goto fail;
    S->fixed = S->hdr->fixed;
    S->tune.mode = (int)S->hdr->tune_mode;
    S->tune.rank = rank;
    for (int v = 0; v < DDP__SHM_VARIANTS; v++) S->tune.skew[v] = tune_skew[v];
    S->ranks = (shm_rank_t *)(S->base + sizeof(shm_header_t));
    S->stage = S->base + stage_off;
    atomic_store(&S->ranks[rank].pid, (int32_t)getpid());

    /* Everyone attached: rank 0 closes the memfd, after which the segment has no name anywhere
     * and disappears with the last mapping, whatever happens to the processes. */
    s = sync_all(S, NULL, ddp__now_ns() + (int64_t)timeout_ms * 1000000LL);
    if (s != DDP_OK) {
        ddp__error_context(s, "shm: waiting for every rank to attach the segment");
        goto fail;
    }
    if (S->fd >= 0) {
        close(S->fd);
        S->fd = -1;
    }
    s = setup_cma(S, tuning.cma_wanted, ddp__now_ns() + (int64_t)timeout_ms * 1000000LL);
    if (s != DDP_OK) goto fail;
    *state = S;
    return DDP_OK;
fail:
    if (S->ranks) publish_abort(S, s, ddp_last_error());
    {
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        shm_destroy(S);
        ddp__set_error_text(text);
    }
    return s;
}

static ddp_status_t shm_alloc_buffer(void *state, size_t bytes, void **out)
{
    shm_state_t *S = state;
    shm_buffer_t *b = ddp__calloc(1, sizeof *b, "a segment buffer record");
    if (!b) return DDP_ERR_NO_MEMORY;
    b->fd = -1;
    b->region = round_up(bytes ? bytes : 1, PAGE);
    b->total = b->region * (size_t)S->world;
    b->id = S->next_buffer_id++;
    char key[700];
    snprintf(key, sizeof key, "%s/buffer/%lld", S->prefix, (long long)b->id);
    ddp_status_t s;
    if (S->rank == 0) {
        s = create_memfd(b->total, "ddp-shm-buffer", &b->fd, &b->base);
        if (s != DDP_OK) goto fail;
        char value[128];
        /* The 4th field, the size asked for, lets each peer compare its own (regions round up
         * to pages, so the totals alone would not tell 64 from 128 bytes). */
        snprintf(value, sizeof value, "%d %d %zu %zu", (int)getpid(), b->fd, b->total, bytes);
        s = ddp_store_set(S->store, key, value, strlen(value));
        if (s != DDP_OK) goto fail;
        /* Wait until every rank has mapped it, then drop the descriptor. */
        char **keys = calloc((size_t)S->world, sizeof *keys);
        char *keybuf = calloc((size_t)S->world, 720);
        if (!keys || !keybuf) {
            free(keys);
            free(keybuf);
            s = ddp__error(DDP_ERR_NO_MEMORY, "shm: alloc_buffer keys");
            goto fail;
        }
        int nk = 0;
        for (int r = 1; r < S->world; r++) {
            keys[nk] = keybuf + (size_t)nk * 720;
            snprintf(keys[nk], 720, "%s/attached/%d", key, r);
            nk++;
        }
        s = nk ? ddp_store_wait(S->store, (const char *const *)keys, (size_t)nk, S->timeout_ms)
               : DDP_OK;
        /* Each peer answered with the size it asked for: compare them all, then publish the
         * verdict, which peers asking for rank 0's size wait for (so every rank fails alike). */
        char verdict[256] = "ok";
        for (int i = 0; s == DDP_OK && i < nk; i++) {
            void *v = NULL;
            size_t len = 0;
            s = ddp_store_get(S->store, keys[i], &v, &len);
            if (s != DDP_OK) break;
            unsigned long long peer_bytes = 0;
            int parsed = ddp__shm_size_parse(v, len, &peer_bytes) == 0;
            ddp_free(v);
            if (parsed && peer_bytes != (unsigned long long)bytes && strcmp(verdict, "ok") == 0)
                snprintf(verdict, sizeof verdict,
                         "alloc_buffer %lld: rank 0 asked for %zu bytes but rank %d asked for "
                         "%llu bytes (every rank must ask for the same size in the same order)",
                         (long long)b->id, bytes, i + 1, peer_bytes);
        }
        free(keys);
        free(keybuf);
        if (s != DDP_OK) {
            ddp__error_context(s, "shm: alloc_buffer %lld waiting for every rank to attach",
                               (long long)b->id);
            goto fail;
        }
        char vkey[760];
        snprintf(vkey, sizeof vkey, "%s/verdict", key);
        s = ddp_store_set(S->store, vkey, verdict, strlen(verdict));
        if (s != DDP_OK) goto fail;
        if (strcmp(verdict, "ok") != 0) {
            s = ddp__error(DDP_ERR_MISMATCH, "%s", verdict);
            goto fail;
        }
        close(b->fd);
        b->fd = -1;
    } else {
        const char *keys[1] = {key};
        s = ddp_store_wait(S->store, keys, 1, S->timeout_ms);
        if (s != DDP_OK) {
            ddp__error_context(s, "shm: alloc_buffer %lld waiting for rank 0", (long long)b->id);
            goto fail;
        }
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(S->store, key, &v, &len);
        if (s != DDP_OK) goto fail;
        ddp__shm_desc_t desc = {0};
        int parsed = ddp__shm_desc_parse(v, len, 4, &desc) == 0;
        int same = parsed && desc.asked == (unsigned long long)bytes;
        unsigned long long bytes0 = desc.asked;
        s = same ? attach_memfd(&desc, b->total, &b->base, "the segment buffer") : DDP_OK;
        ddp_free(v);
        if (s != DDP_OK) {
            ddp__error_context(s, "alloc_buffer: every rank must ask for the same size in the same "
                                  "order (rank %d asked for %zu bytes)",
                               S->rank, bytes);
            goto fail;
        }
        /* Answer with the size asked for, also when it differs, so rank 0 need not time out. */
        char akey[760], avalue[32];
        snprintf(akey, sizeof akey, "%s/attached/%d", key, S->rank);
        snprintf(avalue, sizeof avalue, "%zu", bytes);
        s = ddp_store_set(S->store, akey, avalue, strlen(avalue));
        if (s != DDP_OK) goto fail;
        if (!parsed) {
            s = ddp__error(DDP_ERR_PROTOCOL, "alloc_buffer %lld: malformed description of rank "
                           "0's buffer (\"pid fd total asked\" expected)", (long long)b->id);
            goto fail;
        }
        if (!same) {
            s = ddp__error(DDP_ERR_MISMATCH,
                           "alloc_buffer %lld: rank %d asked for %zu bytes but rank 0 asked for "
                           "%llu bytes (every rank must ask for the same size in the same order)",
                           (long long)b->id, S->rank, bytes, bytes0);
            goto fail;
        }
        /* Rank 0 compared every rank's size: another peer may differ although this one does
         * not. */
        char vkey[760];
        snprintf(vkey, sizeof vkey, "%s/verdict", key);
        const char *vkeys[1] = {vkey};
        s = ddp_store_wait(S->store, vkeys, 1, S->timeout_ms);
        if (s != DDP_OK) {
            ddp__error_context(s, "shm: alloc_buffer %lld waiting for rank 0's size check",
                               (long long)b->id);
            goto fail;
        }
        s = ddp_store_get(S->store, vkey, &v, &len);
        if (s != DDP_OK) goto fail;
        if (len != 2 || memcmp(v, "ok", 2) != 0) {
            s = ddp__error(DDP_ERR_MISMATCH, "%.*s", (int)len, (const char *)v);
            ddp_free(v);
            goto fail;
        }
        ddp_free(v);
    }
    pthread_mutex_lock(&S->buffers_mu);
    b->next = S->buffers;
    S->buffers = b;
    pthread_mutex_unlock(&S->buffers_mu);
    *out = b->base + (size_t)S->rank * b->region;
    return DDP_OK;
fail:
    if (b->base) munmap(b->base, b->total);
    if (b->fd >= 0) close(b->fd);
    free(b);
    return s;
}

static ddp_status_t shm_free_buffer(void *state, void *buffer)
{
    shm_state_t *S = state;
    pthread_mutex_lock(&S->buffers_mu);
    shm_buffer_t **link = &S->buffers;
    while (*link && (*link)->base + (size_t)S->rank * (*link)->region != (char *)buffer)
        link = &(*link)->next;
    shm_buffer_t *b = *link;
    if (b) *link = b->next;
    pthread_mutex_unlock(&S->buffers_mu);
    if (!b)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "free_buffer: %p was not returned by ddp_group_alloc_buffer on this group",
                          buffer);
    munmap(b->base, b->total);
    if (b->fd >= 0) close(b->fd);
    free(b);
    return DDP_OK;
}

static void shm_destroy(void *state)
{
    shm_state_t *S = state;
    if (!S) return;
    if (S->ranks) {
        char reason[128];
        snprintf(reason, sizeof reason, "rank %d left the group (ddp_group_destroy) after seq %llu",
                 S->rank, (unsigned long long)atomic_load(&S->ranks[S->rank].seq));
        publish_abort(S, DDP_ERR_REMOTE, reason);
    }
    shm_buffer_t *b = S->buffers;
    while (b) {
        shm_buffer_t *next = b->next;
        munmap(b->base, b->total);
        if (b->fd >= 0) close(b->fd);
        free(b);
        b = next;
    }
    if (S->base) munmap(S->base, S->size);
    if (S->fd >= 0) close(S->fd);
    ddp__shm_cma_release(&S->cma);
    ddp__shm_views_release(&S->views);
    pthread_mutex_destroy(&S->buffers_mu);
    free(S);
}

static void shm_advise_cold_results(void *state, void *buffer)
{
    size_t offset = 0;
    shm_buffer_t *b = find_buffer(state, buffer, 1, &offset);
    if (b) atomic_store_explicit(&b->cold_results, 1, memory_order_relaxed);
}

/* Registration is the process's (shm_map.h): every shm group of the process may use it. With
 * DDP_SHM_MAP=off on this group's rank, memory is left alone. */
static ddp_status_t shm_register_memory(void *state, void *ptr, size_t bytes)
{
    shm_state_t *S = state;
    if (!S->map_wanted) {
        DDP_LOG(DDP_LOG_INFO, "shm: DDP_SHM_MAP=off: %zu bytes at %p left unregistered", bytes,
                ptr);
        return DDP_OK;
    }
    return ddp__shm_map_register(ptr, bytes);
}

static ddp_status_t shm_unregister_memory(void *state, void *ptr)
{
    shm_state_t *S = state;
    return S->map_wanted ? ddp__shm_map_unregister(ptr) : DDP_OK;
}

static const char *shm_algorithm(void *state)
{
    shm_state_t *S = state;
    int a = atomic_load_explicit(&S->last_algorithm, memory_order_relaxed);
    return a >= 0 && a < (int)(sizeof algorithm_names / sizeof *algorithm_names)
               ? algorithm_names[a]
               : "none";
}

const ddp__transport_ops_t ddp__transport_shm = {
    .algorithm = shm_algorithm,
    .name = "shm",
    .create = shm_create,
    .run = shm_run,
    .alloc_buffer = shm_alloc_buffer,
    .free_buffer = shm_free_buffer,
    .advise_cold_results = shm_advise_cold_results,
    .register_memory = shm_register_memory,
    .unregister_memory = shm_unregister_memory,
    .abort = shm_abort,
    .destroy = shm_destroy,
};
