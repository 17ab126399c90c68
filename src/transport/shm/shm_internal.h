/* What the files of the shared-memory transport share (not installed): the segment's layout,
 * a rank's state, the plan of one allreduce, small inline helpers, and the functions each file
 * offers the others. The files, lowest first (each calls only files before it in this list):
 *   shm_algorithm.c  the ways a collective runs (one enum) and their names
 *   shm_tune.c       the tuner: which candidate a size class uses, by measurement
 *   shm_watch.c      hearing when registered pages are unmapped or moved (for shm_map.c)
 *   shm_cma.c, shm_map.c, shm_views.c, shm_desc.c   single-copy reads, registered memory,
 *                    peers' registrations mapped here, store texts
 *   shm_sync.c       synchronisation: arrive, wait (spin, yield, futex), poison, give up, abort
 *   shm_agree.c      agreement: a collective's first phase, the fingerprint in the mailbox line
 *   shm_buffers.c    memfds, segment buffers (alloc, free, find), registration for single copy
 *   shm_allreduce.c, shm_allreduce_mapped.c   the allreduce algorithms, one function each
 *   shm_pulled.c       broadcast, allgather, reduce_scatter, alltoall from registered memory
 *   shm_broadcast.c, shm_allgather.c, shm_reduce_scatter.c   rounds and single copy
 *   shm_choose.c     the one place an algorithm is chosen, and the dispatch of a collective
 *   shm.c            the transport's table and the segment's life cycle (create, abort, destroy)
 * docs/shm-transport.md has the layout and the reasons. */
#ifndef DDP_TRANSPORT_SHM_INTERNAL_H
#define DDP_TRANSPORT_SHM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/transport.h"
#include "transport/shm/shm_algorithm.h"
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
/* Where S->mapped_stream is set (DDP_SHM_MAPPED_STORES; by default on Intel CPUs), the mapped
 * allreduce streams its results from 2 MiB, the pulled allgather and alltoall their outputs
 * from 2 MiB and the pulled broadcast from 4 MiB. On the Intel Xeon of issue #27, 2 ranks,
 * ddp-bench against STREAM_MIN_BYTES, 2 alternating runs each, default and registered buffers:
 * allreduce 1 MiB 1.10-1.15x, 2 MiB 1.30-1.32x, 4 MiB 1.17-1.20x; allgather 2 MiB 1.08-1.10x,
 * 4 MiB 1.09-1.20x; broadcast 1 MiB 0.49-0.53x, 2 MiB 0.92x, 4 MiB 1.28-1.29x (results in
 * bench/results/2026-11-28-1946-stream-threshold-ab.txt). Alltoall, 3 alternating runs, the
 * time against STREAM_MIN_BYTES's (bench/results/2026-11-29-0100-alltoall-stream-ab.txt): 2
 * ranks 2 MiB 0.92-0.97x, 4 MiB 0.96x; 4 ranks 2 MiB 0.88-0.91x, 4 MiB 0.85-0.94x; 1 MiB
 * (not streamed) 0.97-1.06x, i.e. noise. */
#define MAPPED_STREAM_MIN_BYTES ((size_t)2 << 20)
#define PULLED_BROADCAST_STREAM_MIN_BYTES ((size_t)4 << 20)
#define DDP__SHM_MAX_WORLD 64
/* Knobs rank 0 had set explicitly (shm_header_t.fixed): the tuner keeps to them. */
#define FIXED_ONESHOT 1u     /* DDP_SHM_ONESHOT_BYTES: one-shot exactly up to it */
#define FIXED_CMA 2u         /* DDP_SHM_CMA_BYTES: single copy exactly from it */
#define FIXED_STORES_NT 4u   /* DDP_SHM_STAGED_STORES=nt */
#define FIXED_STORES_PLAIN 8u /* DDP_SHM_STAGED_STORES=plain */
#define FIXED_ROUNDS_LONG 16u  /* DDP_SHM_STAGED_ROUNDS=long */
#define FIXED_ROUNDS_SHORT 32u /* DDP_SHM_STAGED_ROUNDS=short */
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
    _Atomic int last_algorithm; /* ddp__shm_algorithm_t of the last collective (-1: none yet) */
    /* Registered memory: DDP_SHM_MAP (this rank's; a rank with it off publishes no hints, so
     * nobody maps), the agreed views of peers' exports, and per size class whether every rank
     * passed registered memory (agreed: then the one-shot variant is no candidate there). */
    int map_wanted;
    int mapped_stream; /* the mapped allreduce writes results >= STREAM_MIN_BYTES non-temporally */
    ddp__shm_views_t views;
    uint8_t map_class[DDP__SHM_TUNE_CLASSES];
    uint32_t live_seen[DDP__SHM_MAX_WORLD]; /* each peer's live_epoch when its views were pruned */
    /* Broadcast, allgather, reduce_scatter, alltoall from registered memory (shm_pulled.c), per
     * tuner key: calls to let pass before the next try, and tries in a row that found a rank's
     * source unregistered. Agreed (every rank sees the same calls and the same hints). */
    uint32_t pull_skip[DDP__SHM_TUNE_KEYS];
    uint8_t pull_misses[DDP__SHM_TUNE_KEYS];
} shm_state_t;

/* DDP_SHM_MAP: off, on (registered memory), auto (also buffers libddp registers itself). */
enum { MAP_OFF, MAP_ON, MAP_AUTO };

/* One allreduce as shm_choose.c decided it: the algorithm and what its function needs from the
 * first phase. The chooser fills it; the algorithm's function (shm_allreduce*.c) executes it. */
typedef struct shm_plan {
    int algorithm;          /* ddp__shm_algorithm_t */
    int variant;            /* the tuner's pick (-1: by the static size rules, untimed) */
    int key;                /* the tuner's key (a size class of allreduce) */
    unsigned candidates;    /* the tuner's candidates for this call */
    int64_t start_ns;       /* when the tuner's timing began */
    unsigned fparity;       /* the mailbox parity of the first phase */
    unsigned stage_parity;  /* one-shot: its stage; staged: round 0's */
    /* Staged: elements per round, the stores and rounds of the variant, whether round 0 was
     * staged before the first phase, and whether some rank hoped for zero copy or mapped (then
     * round 0 is staged after the first phase, with one more phase). */
    size_t chunk;
    int stream_stage, long_rounds, precopied, any_zero_copy;
    /* Zero copy: the segment buffer and the offsets of send and recv in every rank's region. */
    shm_buffer_t *buf;
    size_t send_off, recv_off;
    /* Mapped: every rank's send and recv hints. */
    ddp__shm_map_hint_t hints[2 * DDP__SHM_MAX_WORLD];
} shm_plan_t;

/* ---- small helpers ------------------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static inline size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* memcpy, with non-temporal stores when `stream` (see STREAM_MIN_BYTES). */
static inline void copy_out(void *dst, const void *src, size_t bytes, int stream)
{
    if (stream)
        ddp__copy_stream(dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

static inline char *stage_of(shm_state_t *S, int r, unsigned parity)
{
    return S->stage + ((size_t)r * 2 + parity) * STAGE_BYTES;
}

/* Splits n elements into world slices aligned to 64 bytes; slice r is [*lo, *hi). */
static inline void slice_of(size_t n, int world, int r, size_t esize, size_t *lo, size_t *hi)
{
    size_t align = LINE / esize;
    size_t per = round_up((n + (size_t)world - 1) / (size_t)world, align);
    size_t a = per * (size_t)r, b = a + per;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

static inline int pid_of(shm_state_t *S, int j)
{
    return atomic_load_explicit(&S->ranks[j].pid, memory_order_relaxed);
}

/* What ddp_group_algorithm reports for the last collective. */
static inline void set_algorithm(shm_state_t *S, int algorithm)
{
    atomic_store_explicit(&S->last_algorithm, algorithm, memory_order_relaxed);
}

/* ---- shm_sync.c: arrive, wait, give up ------------------------------------------------------ */

/* Publishes this rank's next step (its part of a phase is done); returns the step to wait for.
 * `defer`: the sleepers check is left to the wait (ddp__shm_settle_arrival). */
uint64_t ddp__shm_arrive_ex(shm_state_t *S, int defer);
uint64_t ddp__shm_arrive(shm_state_t *S);
/* The deferred half of an arrival: wakes sleeping peers if there are any. */
void ddp__shm_settle_arrival(shm_state_t *S);
/* Waits until every rank reached `target` (polling the stamps of mailbox parity `mailbox` for a
 * first phase, -1: the steps). */
ddp_status_t ddp__shm_wait_all_on(shm_state_t *S, uint64_t target, int mailbox,
                                  const ddp__collective_t *c, int64_t deadline_ns);
ddp_status_t ddp__shm_wait_all(shm_state_t *S, uint64_t target, const ddp__collective_t *c,
                               int64_t deadline_ns);
/* Publishes this rank's next step and waits for every rank to reach it. */
ddp_status_t ddp__shm_sync_all(shm_state_t *S, const ddp__collective_t *c, int64_t deadline_ns);
/* The error of a rank that finds rank j's step poisoned (`poison`). */
ddp_status_t ddp__shm_poisoned_error(shm_state_t *S, int j, uint64_t poison,
                                     const ddp__collective_t *c);
/* Raises this rank's abort flag with its reason and wakes every sleeper. */
void ddp__shm_publish_abort(shm_state_t *S, ddp_status_t status, const char *reason);
/* A read of a peer's memory failed (status s): gives up on the next phase, returns the cause. */
ddp_status_t ddp__shm_cma_failed(shm_state_t *S, const ddp__collective_t *c, ddp_status_t s);

/* ---- shm_agree.c: a collective's first phase ------------------------------------------------ */

void ddp__shm_fingerprint_of(const ddp__collective_t *c, shm_fingerprint_t *fp);
/* Publishes the fingerprint (with up to MAILBOX_DATA bytes of data, and the zero-copy hints),
 * waits for everyone, compares; the mailbox parity in *parity. `defer`: see ddp__shm_arrive_ex. */
ddp_status_t ddp__shm_first_sync_data(shm_state_t *S, const ddp__collective_t *c,
                                      const shm_fingerprint_t *mine, const void *data,
                                      size_t data_bytes, int defer, unsigned *parity);
ddp_status_t ddp__shm_first_sync(shm_state_t *S, const ddp__collective_t *c,
                                 const shm_fingerprint_t *mine);
/* The same in two halves, for a caller that fills its stage in between (after the arrival's
 * locked swap, which would otherwise wait for those stores): first_arrive returns the step that
 * first_publish publishes. */
uint64_t ddp__shm_first_arrive(shm_state_t *S);
ddp_status_t ddp__shm_first_publish(shm_state_t *S, const ddp__collective_t *c,
                                    const shm_fingerprint_t *mine, const void *data,
                                    size_t data_bytes, uint64_t target, int defer,
                                    unsigned *parity);
/* A staged collective's first round whose stage takes at most this many bytes arrives before
 * filling it (first_arrive): the arrival's locked swap then does not wait for the stage's
 * lines to come back from the peers that read them last. 2 ranks on the Xeon, alternating
 * builds, medians of 3 runs, 8 B-1 KiB: allgather 0.47-0.54 -> 0.41-0.51 us, alltoall
 * 0.44-0.52 -> 0.40-0.50, reduce_scatter 0.46-0.60 -> 0.43-0.52, broadcast even; with 2-4 KiB
 * staged up to 8 % slower, so larger stages keep the arrival after the copy. */
#define EARLY_ARRIVAL_MAX 1024
_Static_assert(EARLY_ARRIVAL_MAX >= MAILBOX_DATA, "a tiny collective's first round arrives early");

/* The arrival of a first round staging `staged` bytes, made now (returned) or left to
 * ddp__shm_round_phase (0). */
static inline uint64_t ddp__shm_early_arrival(shm_state_t *S, int first, size_t staged)
{
    return first && staged <= EARLY_ARRIVAL_MAX ? ddp__shm_first_arrive(S) : 0;
}

/* The phase that ends a round of the staged collectives: the first round's is the collective's
 * first phase (its arrival already made when `early` is not 0), later rounds' a plain one.
 * A collective whose whole stage fits in the first phase's line (`tiny`: one round of at most
 * MAILBOX_DATA bytes; the same on every rank, as it follows from the agreed size) sends its
 * `bytes` of `data` there instead, so that a peer's one poll brings them: *fq is then that
 * mailbox parity (for round_of), else -1. 2 ranks on the Xeon, 8-32 B, medians of 3 runs
 * alternating with the early arrival alone: allgather 0.47-0.48 -> 0.43-0.45 us, alltoall
 * 0.51-0.53 -> 0.43-0.44, reduce_scatter 0.53-0.56 -> 0.41-0.43, broadcast 0.39-0.40 ->
 * 0.37-0.38. */
static inline ddp_status_t ddp__shm_round_phase(shm_state_t *S, const ddp__collective_t *c,
                                                const shm_fingerprint_t *fp, int first,
                                                uint64_t early, int tiny, const void *data,
                                                size_t bytes, int *fq)
{
    unsigned q;
    *fq = -1;
    if (!early)
        return first ? ddp__shm_first_sync(S, c, fp) : ddp__shm_sync_all(S, c, c->deadline_ns);
    size_t in_line = tiny && data ? bytes : 0;
    ddp_status_t s = ddp__shm_first_publish(S, c, fp, data, in_line, early, 1, &q);
    if (tiny) *fq = (int)q;
    return s;
}

/* Where rank j's round is: its stage of parity q, or the mailbox data of parity fq (>= 0) for a
 * tiny collective (round_phase). */
static inline const char *round_of(shm_state_t *S, int j, unsigned q, int fq)
{
    return fq >= 0 ? (const char *)S->ranks[j].mailbox[fq].data : stage_of(S, j, q);
}

/* ---- shm_buffers.c: memfds and segment buffers ---------------------------------------------- */

ddp_status_t ddp__shm_memfd_create(size_t bytes, const char *name, int *fd, char **base);
ddp_status_t ddp__shm_memfd_attach(const ddp__shm_desc_t *d, size_t expected_bytes, char **base,
                                   const char *what);
/* The segment buffer holding [p, p + bytes) in this rank's region, with its offset. */
shm_buffer_t *ddp__shm_find_buffer(shm_state_t *S, const void *p, size_t bytes, size_t *offset);
/* Publishes where this rank's buffer is for a single-copy collective. */
void ddp__shm_cma_publish(shm_state_t *S, const void *buffer, size_t bytes);
ddp_status_t ddp__shm_alloc_buffer(void *state, size_t bytes, void **out);
ddp_status_t ddp__shm_free_buffer(void *state, void *buffer);
void ddp__shm_advise_cold_results(void *state, void *buffer);
ddp_status_t ddp__shm_register_memory(void *state, void *ptr, size_t bytes);
ddp_status_t ddp__shm_unregister_memory(void *state, void *ptr);
/* Unmaps and frees every segment buffer (destroy). */
void ddp__shm_buffers_release(shm_state_t *S);

/* ---- shm_allreduce.c, shm_allreduce_mapped.c: the allreduce algorithms ---------------------- */

/* Each runs after the first phase, which shm_choose.c ran (see there), the plan's algorithm. */
ddp_status_t ddp__shm_allreduce_mailbox(shm_state_t *S, const ddp__collective_t *c,
                                        const shm_plan_t *plan);
ddp_status_t ddp__shm_allreduce_oneshot(shm_state_t *S, const ddp__collective_t *c,
                                        const shm_plan_t *plan);
ddp_status_t ddp__shm_allreduce_zero_copy(shm_state_t *S, const ddp__collective_t *c,
                                          const shm_plan_t *plan);
ddp_status_t ddp__shm_allreduce_staged(shm_state_t *S, const ddp__collective_t *c,
                                       const shm_plan_t *plan);
ddp_status_t ddp__shm_allreduce_cma(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_allreduce_mapped(shm_state_t *S, const ddp__collective_t *c,
                                       const shm_plan_t *plan);
/* Stages the slices of n elements that the other ranks reduce. */
void ddp__shm_copy_in_others(shm_state_t *S, char *stage, const char *src, size_t n, size_t esize,
                             int stream);
/* Registered memory, before the first phase: this rank's hints for c's buffers in fp->map
 * (ddp__shm_map_hints_of also stages send's edges); returns whether both are registered. */
int ddp__shm_map_buffers(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                         shm_fingerprint_t *fp);
void ddp__shm_map_hints_of(shm_state_t *S, const ddp__collective_t *c, size_t bytes,
                           shm_fingerprint_t *fp);
/* After a first phase: drops views of peers' registrations that are gone; whether every rank
 * published registered buffers; whether the agreed views let the mapped path run (hints out). */
void ddp__shm_prune_views(shm_state_t *S);
int ddp__shm_all_registered(const shm_state_t *S, unsigned q);
int ddp__shm_decide_mapped(shm_state_t *S, const ddp__collective_t *c, unsigned fparity,
                           int nbuf, ddp__shm_map_hint_t *hints, ddp_status_t *status);
/* The hint for one buffer of a collective (registering it first under DDP_SHM_MAP=auto when the
 * collective moves at least the automatic minimum, `moved` bytes), after publishing this rank's
 * live registrations; 0 (slot -1) when it is not in registered memory. */
int ddp__shm_map_one(shm_state_t *S, const void *p, size_t bytes, size_t moved, size_t esize,
                     ddp__shm_map_hint_t *hint);

/* Where a rank's edges live in its stage (of the collective's parity): the bytes of its buffers
 * outside their export's whole pages, less than a page (plus an element) at each end. */
#define EDGE_SEND_HEAD 0
#define EDGE_SEND_TAIL (2 * PAGE)
#define EDGE_RECV_HEAD (4 * PAGE)
#define EDGE_RECV_TAIL (6 * PAGE)

/* Elements [*lo, *hi) of a buffer of n elements described by h lie in its export's pages. */
static inline void ddp__shm_covered(const ddp__shm_map_hint_t *h, size_t n, size_t esize,
                                    size_t *lo, size_t *hi)
{
    size_t a = h->start > h->addr ? (size_t)(h->start - h->addr + esize - 1) / esize : 0;
    size_t b = h->end > h->addr ? (size_t)(h->end - h->addr) / esize : 0;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
    if (*hi < *lo) *hi = *lo;
}

/* Sorts the cut points of a mapped collective (a few per rank: insertion sort). Between two
 * neighbours every rank's element lies in one place, its export's pages or an edge. */
static inline void ddp__shm_sort_cuts(size_t *cuts, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            size_t t = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = t;
        }
}

/* ---- shm_pulled.c: broadcast, allgather, reduce_scatter, alltoall from registered memory --- */

/* A broadcast, allgather (its output), reduce_scatter or alltoall (their send) of at least
 * ddp__shm_pull_min(world) bytes may read its sources where they lie. On the Intel Xeon of issue
 * #27, since registered memory is watched instead of checked by a system call every call, 2
 * ranks on registered buffers, two runs each (29 Nov 2026, 06:40 UTC): 8 KiB 1.36-1.53 us read
 * where they lie against 1.57-1.96 through the stage, 16 KiB 1.39-1.58 against 2.54-3.15, 4 KiB
 * lost or even (broadcast 1.48-1.51 against 1.09-1.17); before the watch 8 KiB lost (1.6-2.0
 * against 1.3-1.9). 4 ranks on the 2 cores, 16 KiB: alltoall and reduce_scatter won (6.8-7.0
 * against 8.0-8.2), allgather and broadcast lost (6.3-7.0 against 5.3-6.1), 8 KiB lost or even;
 * there it stays 8 KiB a rank (32 KiB won). It was 64 KiB whatever the world on an AMD EPYC. */
#define PULL_MIN_PER_RANK ((size_t)8 << 10)
#define PULL_MIN_TWO_RANKS ((size_t)8 << 10)
static inline size_t ddp__shm_pull_min(int world)
{
    return world == 2 ? PULL_MIN_TWO_RANKS : (size_t)world * PULL_MIN_PER_RANK;
}
/* Runs c (broadcast, allgather, reduce_scatter or alltoall; bytes >= ddp__shm_pull_min(world))
 * the mapped way when every rank's source is in registered memory and its views are agreed:
 * *ran = 1 and the status. Else *ran = 0 after one phase (every rank the same), and the caller
 * runs its usual way. Tried at every call of a size class while its tries find every source
 * registered; after m misses in a row, 2^(m-1) - 1 calls pass untried (at most 63; every rank
 * the same). */
ddp_status_t ddp__shm_try_pulled(shm_state_t *S, const ddp__collective_t *c, int key, int *ran);
/* reduce_scatter_apply (transport.h; world >= 2, at least ddp__shm_pull_min(world) bytes in
 * all) the mapped way when every rank's send and recv are registered: *ran = 1 and the status;
 * else *ran = 0 after one phase, every rank the same, and the caller builds it from
 * reduce_scatter and allgather. Tried under the policy above, with `key`. */
ddp_status_t ddp__shm_try_apply(shm_state_t *S, const ddp__collective_t *c, int key, int *ran);
/* (shm_allreduce_mapped.c) After a mapped collective's closing phase: the elements of this
 * rank's recv (n) outside its exported pages [lo, hi) and outside its own part [own_lo,
 * own_hi), from the edge areas of its stage where the peers wrote them. */
void ddp__shm_copy_edges(char *recv, const char *stage, size_t n, size_t lo, size_t hi,
                         size_t own_lo, size_t own_hi, size_t esize);

/* ---- shm_broadcast.c, shm_allgather.c, shm_reduce_scatter.c, shm_alltoall.c ------------------- */

/* Rounds through the stage, or single copy (process_vm_readv); each runs its own first phase. */
ddp_status_t ddp__shm_broadcast_rounds(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_broadcast_cma(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_allgather_rounds(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_allgather_cma(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_reduce_scatter_rounds(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_reduce_scatter_cma(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_alltoall_rounds(shm_state_t *S, const ddp__collective_t *c);
ddp_status_t ddp__shm_alltoall_cma(shm_state_t *S, const ddp__collective_t *c);

/* ---- shm_choose.c ---------------------------------------------------------------------------- */

/* The transport's run: chooses and runs one collective. */
ddp_status_t ddp__shm_run(void *state, const ddp__collective_t *c);

#endif
