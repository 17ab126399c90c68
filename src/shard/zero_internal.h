/* Internal to ZeRO's files (zero.c: create, partition, queries; zero_step.c: gradients, the step
 * and the overlap hook; zero_state.c: the saved state): the optimizer's state and its helpers.
 * Not installed. */
#ifndef DDP_ZERO_INTERNAL_H
#define DDP_ZERO_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

/* Overlap: one Reducer bucket as the hook first saw it, with the rank that owns it. */
typedef struct zero_bucket {
    ddp_zero_t *zero;
    size_t index;
    size_t nparams;
    size_t *params;
    size_t *offsets;
    int owner;
    int reduced; /* the hook ran for it since the last ddp_zero_step */
    void *data;  /* the bucket being reduced this iteration */
    size_t numel;
    ddp_dtype_t dtype;
    int prescaled; /* the Reducer divided it by the world size: sum; else average */
} zero_bucket_t;

/* Stage 2: the context of parameter `param`'s reduce-scatter callback. */
typedef struct zero_chunk {
    ddp_zero_t *zero;
    size_t param;
    unsigned char *recv; /* fused: the parameter's values the apply function updates */
} zero_chunk_t;

struct ddp_zero {
    ddp_group_t *group;
    int rank, world, stage, overlap;
    int fused;                /* stage 2: reduce_scatter_apply in the step (config.fused) */
    int chunked;              /* stage 2, or stage 1 with DDP_ZERO_PARTITION_CHUNKS */
    ddp__optim_setup_t setup; /* hyperparameters per parameter group */
    double grad_norm;         /* of the last step with clipping; NaN before */
    size_t nparams;
    void **data;
    void **grads; /* each parameter's .grad at create: the gradients a NULL grads means */
    size_t *numel;
    ddp_dtype_t *dtype;
    char **names;
    int *owner;              /* stage 1: owner of each parameter (-1: not yet known) */
    ddp__optim_run_t *runs;  /* this rank's run of each parameter (count 0: none) */
    ddp_work_t **works;      /* one per parameter, for the parameter exchange */
    void **shadow;           /* overlap: updated values of the parameters this rank owns */
    uint64_t steps;          /* ddp_zero_step calls that succeeded */
    /* stage 2 */
    ddp_rs_bucketer_t *bucketer;
    unsigned char *submitted; /* this step's gradient was handed to the bucketer */
    unsigned char *arrived;   /* ... and its reduced shard has arrived */
    void **gshard;            /* this rank's shard of each averaged gradient (into gshard_mem) */
    unsigned char *gshard_mem;
    zero_chunk_t *chunks;
    const void **blocks;     /* world pointers */
    unsigned char *tail;     /* one zero-padded chunk (the one straddling the end) */
    unsigned char *zeros;    /* one chunk of zeros (chunks wholly past the end) */
    unsigned char *stage_buf; /* world chunks of the largest non-divisible parameter */
    const void **own_grads;   /* chunked stage 1: this rank's chunk of each averaged gradient */
    const void **ready;       /* fused: the gradients ddp_zero_grad_ready noted this step */
    unsigned char *fused_send; /* fused: world chunks of a padded gradient (as stage_buf) */
    /* overlap */
    zero_bucket_t **buckets;
    size_t nbuckets;
    size_t *load; /* bytes assigned to each rank */
};

/* Elements per chunk of parameter i (stage 2 and chunked stage 1): ceil(numel / world). */
static inline size_t chunk_of(const ddp_zero_t *z, size_t i)
{
    return (z->numel[i] + (size_t)z->world - 1) / (size_t)z->world;
}

/* Parameter i's name for error messages. */
static inline const char *pname(const ddp_zero_t *z, size_t i)
{
    return z->names[i] ? z->names[i] : "(unnamed)";
}

#endif
