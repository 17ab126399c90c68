/* Internal to src/shard/: the FSDP object's layout, shared by fsdp.c (units, gather/release,
 * gradients, the step) and fsdp_state.c (sharded and consolidated checkpoints). Not installed. */
#ifndef DDP_FSDP_INTERNAL_H
#define DDP_FSDP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/fsdp.h"
#include "shard/shard_internal.h"

/* A unit's full parameters: none, an allgather in flight (prefetched), or there. */
enum { DDP__FSDP_RELEASED = 0, DDP__FSDP_GATHERING = 1, DDP__FSDP_GATHERED = 2 };

typedef struct ddp__fsdp_unit ddp__fsdp_unit_t;

/* A unit's full gradient handed to the bucketer: freed by the callback when its shard arrived. */
typedef struct ddp__fsdp_flight {
    ddp__fsdp_unit_t *unit;
    void *buf;
    size_t bytes, cap; /* the gradient's size; the buffer's (a cached one may be larger) */
    struct ddp__fsdp_flight *next, *prev;
} ddp__fsdp_flight_t;

struct ddp__fsdp_unit {
    ddp_fsdp_t *fsdp;
    size_t index;
    ddp_dtype_t dtype;
    size_t es;
    size_t numel; /* F */
    size_t shard; /* S */
    unsigned char *shard_data; /* S elements: this rank's parameters (padding zero) */
    unsigned char *grad_shard; /* S elements: the averaged gradient accumulated */
    int grad_shard_clean;      /* grad_shard is all zeros (the next shard is copied, not added) */
    unsigned char *full;       /* world * S elements while gathering or gathered */
    size_t full_cap;           /* its size (a cached buffer may be larger than the unit) */
    ddp_work_t *work;          /* the allgather in flight */
    int state;
    unsigned char *grad_full; /* world * S elements: backward's local gradient */
    size_t grad_cap;
    int grad_unsynced;        /* grad_full holds gradients of a no_sync iteration */
};

typedef struct ddp__fsdp_buffer {
    void *ptr;
    size_t bytes;
} ddp__fsdp_buffer_t;

struct ddp_fsdp {
    ddp_group_t *group;
    int rank, world, sync, cache;
    size_t bucket_cap; /* the bucketer's: which gradients it copies (shard.h's rule) */
    ddp__optim_setup_t setup;
    double grad_norm;
    uint64_t steps;
    size_t nparams;
    size_t *numel;
    ddp_dtype_t *dtype;
    char **names;
    size_t *unit_of;  /* parameter -> unit */
    size_t *offset;   /* parameter's first element in its unit's flat buffer */
    size_t *shard_at; /* where its run starts in the unit's shard (elements) */
    ddp__optim_run_t *runs;
    size_t nunits;
    ddp__fsdp_unit_t *units;
    ddp_rs_bucketer_t *bucketer; /* units of at most half a bucket share reductions */
    ddp_rs_bucketer_t *direct;   /* larger units: each reduced at once, on its own (cap 0) */
    ddp__fsdp_flight_t *flights;
    ddp__fsdp_buffer_t *pool;
    size_t npool, pool_cap;
    size_t gathered, gathered_peak, grad_full, grad_full_peak, cached, full_model;
};

/* Parameter i's name for messages. */
const char *ddp__fsdp_name(const ddp_fsdp_t *f, size_t i);
/* Starts the allgather of a released unit into a full buffer (nothing otherwise). */
ddp_status_t ddp__fsdp_gather_start(ddp_fsdp_t *f, ddp__fsdp_unit_t *u, const char *who);
/* Waits for a unit's allgather in flight (nothing when it is not gathering). */
ddp_status_t ddp__fsdp_gather_finish(ddp_fsdp_t *f, ddp__fsdp_unit_t *u, const char *who);
/* Returns a unit's full buffer (its allgather must be finished). */
void ddp__fsdp_drop_full(ddp_fsdp_t *f, ddp__fsdp_unit_t *u);

#endif
