/* Fully sharded data parallelism (ZeRO-3; fairscale's FSDP, DeepSpeed's stage 3, PyTorch's
 * FSDP2): every rank keeps 1/world of every parameter, of its gradient and of its optimizer state.
 * The caller names units (a layer, or any group of tensors); a unit's parameters are one flat
 * buffer cut into world equal shards. Before a unit is used its shards are allgathered
 * (ddp_fsdp_gather; ddp_fsdp_prefetch starts the next unit's allgather so that it runs while the
 * current one computes), after use the full copy is released; as a unit's backward finishes its
 * gradient is reduce-scattered (averaged) into the owners' gradient shards, small units sharing a
 * reduction through the ReduceScatterBucketer; ddp_fsdp_step then runs libddp's optimizers (the
 * kernels of ddp/shard.h, bitwise the same rules) on each rank's shard.
 *
 *     uint32_t unit_of[n] = {...};                     // unit of every parameter
 *     ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;  fc.optim.kind = DDP_OPTIM_ADAMW; ...
 *     ddp_fsdp_create(group, params, n, unit_of, nunits, &fc, &fsdp);  // params may be freed now
 *     each step:
 *       forward, for each unit u:   ddp_fsdp_gather(fsdp, u); ddp_fsdp_prefetch(fsdp, u + 1);
 *                                   ddp_fsdp_param(fsdp, i, &w) ... compute ...;
 *                                   ddp_fsdp_release(fsdp, u);
 *       backward, for u downwards:  ddp_fsdp_gather(fsdp, u); ddp_fsdp_prefetch(fsdp, u - 1);
 *                                   ddp_fsdp_grad(fsdp, i, &g) ... accumulate into g ...;
 *                                   ddp_fsdp_grad_ready(fsdp, u); ddp_fsdp_release(fsdp, u);
 *       ddp_fsdp_step(fsdp);        // the shards updated; gradient shards zeroed
 *
 * Collectives go through the group (every transport works); every rank must make the same calls
 * in the same order (the group's fingerprints turn a difference into DDP_ERR_MISMATCH).
 * Thread-safety: one thread drives an FSDP object. Errors: ddp_status_t, and ddp_last_error()
 * names the unit or parameter and the step. */
#ifndef DDP_FSDP_H
#define DDP_FSDP_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/group.h"
#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "ddp/status.h"
#include "ddp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_fsdp_config {
    ddp_optim_config_t optim; /* SGD/Adam/AdamW, groups (by parameter index), clipping */
    /* Bytes of one reduce-scatter bucket over all ranks (ddp_rs_bucketer_create's cap): units
     * whose gradient (over all ranks, padding included) is at most half of it share reductions
     * (the bucket is issued when the next does not fit, or at the step); larger ones are
     * reduce-scattered at once, each on its own. 0: every unit on its own. */
    size_t bucket_cap_bytes;
    /* 1: rank 0's parameter values are broadcast at create (PyTorch FSDP's sync_module_states),
     * so ranks that initialised differently still start equal. 0: each rank takes its shard from
     * its own values (they must be equal). */
    int sync_params;
    /* 1: released full buffers (parameters and gradients) are kept for reuse: no page faults
     * each step; the memory held is about the peak of what was in use at once (exactly:
     * ddp_fsdp_memory's cached_bytes). 0: freed at release. */
    int cache_buffers;
} ddp_fsdp_config_t;

DDP_API void ddp_fsdp_config_init(ddp_fsdp_config_t *config);

/* Defaults: DDP_OPTIM_CONFIG_INIT, 1 MiB buckets, sync_params 1, cache_buffers 1. */
#ifndef __cplusplus
#define DDP_FSDP_CONFIG_INIT                                                                      \
    {.optim = DDP_OPTIM_CONFIG_INIT,                                                              \
     .bucket_cap_bytes = (size_t)1 << 20,                                                         \
     .sync_params = 1,                                                                            \
     .cache_buffers = 1}
#else
#define DDP_FSDP_CONFIG_INIT                                                                      \
    ([] {                                                                                         \
        ddp_fsdp_config_t ddp_config_;                                                            \
        ddp_fsdp_config_init(&ddp_config_);                                                       \
        return ddp_config_;                                                                       \
    }())
#endif

typedef struct ddp_fsdp ddp_fsdp_t;

/* Collective when config.sync_params (one broadcast per unit), else local. params: name, data,
 * numel, dtype (f32, f64, f16 or bf16) are used; data is read here only (the caller may free
 * its full copies after create: the FSDP object keeps only this rank's shards). param_units[i]
 * is parameter i's unit (< nunits); NULL puts every parameter in a unit of its own (nunits must
 * then equal nparams). A unit's parameters, in index order, form its flat buffer; they must share
 * one dtype, and every unit must hold at least one parameter. The flat buffer of F elements is
 * padded to world * ceil(F / world); rank r owns elements [r * S, (r + 1) * S), S = ceil(F /
 * world). f16/bf16 parameters get f32 master weights for the shard, as ddp_optim does. Every rank
 * passes the same shapes, units and config. The group must outlive the object. */
DDP_API ddp_status_t ddp_fsdp_create(ddp_group_t *group, const ddp_param_t *params,
                                     size_t nparams, const uint32_t *param_units, size_t nunits,
                                     const ddp_fsdp_config_t *config, ddp_fsdp_t **out);
/* Waits for what is in flight (errors dropped) and frees everything. NULL is allowed. */
DDP_API void ddp_fsdp_destroy(ddp_fsdp_t *fsdp);

/* Starts the allgather of `unit`'s shards into a full buffer (asynchronous, through the group's
 * work queue) and returns; nothing if the unit is gathered or being gathered. Collective. */
DDP_API ddp_status_t ddp_fsdp_prefetch(ddp_fsdp_t *fsdp, size_t unit);
/* The unit's full parameters, available when this returns (prefetch if not yet, then wait).
 * ddp_fsdp_param gives their addresses until ddp_fsdp_release. Gathering a gathered unit does
 * nothing. Collective. */
DDP_API ddp_status_t ddp_fsdp_gather(ddp_fsdp_t *fsdp, size_t unit);
/* Drops the unit's full parameters (a prefetch in flight is waited for first). Releasing a
 * released unit does nothing. Not collective. */
DDP_API ddp_status_t ddp_fsdp_release(ddp_fsdp_t *fsdp, size_t unit);
/* Address of parameter `index`'s full values (numel elements of its dtype) while its unit is
 * gathered: read them, do not write them (the next gather overwrites them with the shards).
 * DDP_ERR_INVALID_USAGE, naming the unit, when it is not gathered. */
DDP_API ddp_status_t ddp_fsdp_param(ddp_fsdp_t *fsdp, size_t index, void **data);

/* Address of parameter `index`'s full (unsharded) gradient, numel elements of its dtype, for
 * backward to ACCUMULATE into. The unit's gradient buffer is created zeroed on the first call
 * after its last reduction and stays until ddp_fsdp_grad_ready reduces it (across no_sync
 * iterations it keeps accumulating). Not collective. */
DDP_API ddp_status_t ddp_fsdp_grad(ddp_fsdp_t *fsdp, size_t index, void **grad);
/* The unit's gradient is final for this iteration. With sync on (the default) it is
 * reduce-scattered with DDP_AVG now (or joins the bucketer's bucket) and each rank's shard of
 * the average is ADDED to its gradient shard when it arrives; the full buffer is freed after.
 * With sync off (no_sync) nothing is communicated and the full gradient keeps accumulating. A
 * unit whose gradient was never asked for contributes zeros. Collective when sync is on. */
DDP_API ddp_status_t ddp_fsdp_grad_ready(ddp_fsdp_t *fsdp, size_t unit);
/* no_sync: sync 0 makes ddp_fsdp_grad_ready keep local gradients (PyTorch's no_sync()); the
 * first grad_ready with sync 1 reduces everything accumulated. Every rank must agree. */
DDP_API ddp_status_t ddp_fsdp_set_sync(ddp_fsdp_t *fsdp, int sync);

/* One optimizer step, collective: finishes every reduction in flight, computes the global
 * gradient norm when config.optim.max_grad_norm > 0 (each rank's sum of squares over its
 * gradient shards, one allreduce), updates this rank's shard of every parameter with the
 * ddp_optim kernels and zeroes the gradient shards. DDP_ERR_INVALID_USAGE, naming the unit, when
 * a unit is gathered (its full copy would go stale: release first) or holds unreduced gradients
 * from a no_sync iteration. */
DDP_API ddp_status_t ddp_fsdp_step(ddp_fsdp_t *fsdp);
/* The norm of the last step with clipping (NaN before), the same on every rank. */
DDP_API ddp_status_t ddp_fsdp_grad_norm(const ddp_fsdp_t *fsdp, double *norm);
/* As ddp_optim_set_lr / scale_lr / get_lr; every rank makes the same calls, between steps. */
DDP_API ddp_status_t ddp_fsdp_set_lr(ddp_fsdp_t *fsdp, size_t group, double lr);
DDP_API ddp_status_t ddp_fsdp_scale_lr(ddp_fsdp_t *fsdp, double factor);
DDP_API ddp_status_t ddp_fsdp_get_lr(const ddp_fsdp_t *fsdp, size_t group, double *lr);

/* Memory this rank holds, in bytes. The sharded part (parameters, gradients, optimizer state)
 * falls as 1/world; gathered full parameters and full gradients are what units in use take. */
typedef struct ddp_fsdp_memory {
    size_t param_shard_bytes;    /* this rank's parameter shards (padding included) */
    size_t grad_shard_bytes;     /* its gradient shards */
    size_t optim_state_bytes;    /* its optimizer state (ddp_optim_state_bytes' accounting) */
    size_t gathered_bytes;       /* full parameter buffers of units gathered now */
    size_t gathered_peak_bytes;  /* the most gathered at once since create */
    size_t grad_full_bytes;      /* full gradient buffers alive now (units in backward) */
    size_t grad_full_peak_bytes; /* the most at once since create */
    size_t cached_bytes;         /* released buffers kept for reuse (config.cache_buffers) */
    size_t bucketer_bytes;       /* the reduce-scatter bucketer's memory */
    size_t full_model_bytes;     /* all parameters unsharded (what one replica would hold) */
} ddp_fsdp_memory_t;
DDP_API ddp_status_t ddp_fsdp_memory(const ddp_fsdp_t *fsdp, ddp_fsdp_memory_t *out);

/* Unit of parameter `index`, and the elements of it this rank owns: [*first, *first + *count)
 * of the parameter (count 0: none). Any output may be NULL. */
DDP_API ddp_status_t ddp_fsdp_param_shard(const ddp_fsdp_t *fsdp, size_t index, size_t *unit,
                                          size_t *first, size_t *count);

/* ---- checkpoints ---------------------------------------------------------------------------
 * Sharded: each rank saves one blob (its parameter shards, its optimizer shard, native byte
 * order, checksummed; layout in docs/sharding.md). Loading takes any set of blobs that together
 * hold this rank's elements: its own blob at the same world size, or every blob of a run at
 * another world size (resharding: each rank takes its part). Consolidated: whole parameters and
 * the optimizer state in ddp_optim's format on one root (so a plain optimizer, ZeRO or FSDP at
 * any world size resumes from it). */
DDP_API ddp_status_t ddp_fsdp_state_size(const ddp_fsdp_t *fsdp, size_t *bytes);
DDP_API ddp_status_t ddp_fsdp_state_save(const ddp_fsdp_t *fsdp, void *buf, size_t size);
/* Not collective; between steps, with no unit gathered (else DDP_ERR_INVALID_USAGE). Checks
 * every blob (magic, checksum, parameter count, each parameter's numel and dtype, optimizer
 * kind) and that this rank's elements are covered before changing anything; with several blobs
 * their optimizer shards are merged (briefly the whole state). */
DDP_API ddp_status_t ddp_fsdp_state_load(ddp_fsdp_t *fsdp, const void *const *blobs,
                                         const size_t *sizes, size_t nblobs);

/* Bytes of the consolidated optimizer state (the same on every rank). */
DDP_API ddp_status_t ddp_fsdp_consolidated_optim_size(const ddp_fsdp_t *fsdp, size_t *bytes);
/* Collective. On root: params[i] (numel elements of parameter i's dtype) receives parameter i
 * whole, and optim_buf (optim_size >= ddp_fsdp_consolidated_optim_size) the optimizer state
 * in ddp_optim_state_save's format; the other ranks pass NULL, NULL, 0. Each unit is allgathered
 * in turn (units gathered by the caller stay gathered). */
DDP_API ddp_status_t ddp_fsdp_consolidate(ddp_fsdp_t *fsdp, int root, void *const *params,
                                          void *optim_buf, size_t optim_size);
/* Not collective; between steps, with no unit gathered: every rank passes the whole parameters
 * (params[i]: numel elements of its dtype) and a consolidated optimizer state (from
 * ddp_fsdp_consolidate, ddp_zero_state_consolidate or ddp_optim_state_save, any world size) and
 * takes its shard of both. optim_buf NULL keeps the optimizer state as it is (parameters only;
 * f16/bf16 master copies are reset to the loaded values). */
DDP_API ddp_status_t ddp_fsdp_load_consolidated(ddp_fsdp_t *fsdp, const void *const *params,
                                                const void *optim_buf, size_t optim_size);

#ifdef __cplusplus
}
#endif
#endif
