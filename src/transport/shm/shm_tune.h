/* The shared-memory transport's self-tuning: per size class of allreduce, several ways to move
 * the data (variants: the algorithms of shm_algorithm.h below DDP__SHM_VARIANTS), chosen by
 * measurement, the same way on every rank. shm_choose.c asks which variant a call uses and
 * times the call, shm_agree.c carries rank 0's decisions in its mailbox; this file keeps the
 * tables and decides. docs/shm-transport.md ("Self-tuning") has the reasons. */
#ifndef DDP_TRANSPORT_SHM_TUNE_H
#define DDP_TRANSPORT_SHM_TUNE_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/trace.h"
#include "transport/shm/shm_algorithm.h"

#define DDP__SHM_TUNE_CLASSES 40 /* class = floor(log2(bytes)) - 6, clamped */
#define DDP__SHM_TUNE_KINDS 6 /* allreduce, broadcast, allgather, reduce_scatter, alltoall,
                                 reduce_scatter_apply (its mapped tries' policy only) */
/* What the tuner keeps a choice for: a collective kind (0..4) and a size class. */
#define DDP__SHM_TUNE_KEYS (DDP__SHM_TUNE_KINDS * DDP__SHM_TUNE_CLASSES)
#define DDP__SHM_TUNE_WINDOW 3

typedef enum { DDP__SHM_TUNE_OFF, DDP__SHM_TUNE_PROBE, DDP__SHM_TUNE_ONLINE } ddp__shm_tune_mode_t;

typedef struct ddp__shm_tune {
    int mode;
    int rank;
    /* Agreed on every rank (changed only by the same calls everywhere and by rank 0's published
     * updates, applied at the same collective everywhere). */
    uint8_t current[DDP__SHM_TUNE_KEYS]; /* the incumbent variant + 1 (0: default) */
    uint32_t calls[DDP__SHM_TUNE_KEYS];  /* collectives of the kind and class so far */
    uint8_t previous[DDP__SHM_TUNE_KEYS]; /* the variant + 1 of the key's last call (local) */
    /* Local measurements (decisions use rank 0's). */
    /* The last DDP__SHM_TUNE_WINDOW measurements (ns per byte) per class and variant; a
     * variant's estimate is their median, which a preempted call does not move. */
    float window[DDP__SHM_TUNE_KEYS][DDP__SHM_VARIANTS][DDP__SHM_TUNE_WINDOW];
    uint32_t samples[DDP__SHM_TUNE_KEYS][DDP__SHM_VARIANTS];
    uint16_t pending; /* rank 0: an update not yet published (0: none) */
    double skew[DDP__SHM_VARIANTS]; /* tests: multiplies this rank's measurements */
} ddp__shm_tune_t;

/* The key of a collective of kind `kind` (0 allreduce, 1 broadcast, 2 allgather, 3
 * reduce_scatter, 4 alltoall) moving `bytes` bytes. */
int ddp__shm_tune_key(int kind, size_t bytes);

/* The variant the next call of key `cls` uses, among the bits of `candidates` (1 << variant),
 * with `fallback` the default (the static rule, used with tuning off). Deterministic in agreed
 * data: the class's call count and incumbent, the mode. Counts the call. */
int ddp__shm_tune_pick(ddp__shm_tune_t *t, int cls, unsigned candidates, int fallback);

/* Records a call's duration (every rank measures; only rank 0's decisions are published). */
void ddp__shm_tune_record(ddp__shm_tune_t *t, int cls, int variant, unsigned candidates,
                          size_t bytes, int64_t ns);

/* Rank 0: the update to publish in the next first phase (0: none), cleared. */
uint16_t ddp__shm_tune_take_update(ddp__shm_tune_t *t);

/* Every rank, at the same collective: applies rank 0's published update. A change is logged by
 * rank 0 at DDP_LOG_LEVEL=info and, on every rank, recorded in `trace` (NULL: nowhere) as an
 * instant event "shm tune: ..." with the class, the new and the old variant as arguments (rank
 * 0's adds its estimates). Returns 1 when the incumbent changed. */
int ddp__shm_tune_apply(ddp__shm_tune_t *t, uint16_t update, ddp_trace_t *trace);


#endif
