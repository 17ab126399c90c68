/* Sharding: the reduce-scatter bucketer, a plain optimizer (SGD, Adam, AdamW with parameter
 * groups, a learning-rate setter and schedules, gradient clipping, f16/bf16 parameters with f32
 * master weights, state save/load) and the ZeRO optimizer (ZeroRedundancyOptimizer) that keeps
 * each rank's optimizer state for its partition only, with the same rules, and saves it per rank
 * or consolidated on one rank.
 *
 * ReduceScatterBucketer (fairscale's): many small reduce-scatters become one.
 *
 *     ddp_rs_bucketer_t *b;
 *     ddp_rs_bucketer_create((size_t)25 << 20, &b);
 *     for each tensor:  // input: world_size blocks of `count` elements each, contiguous
 *         ddp_rs_bucketer_reduce_scatter_async(b, group, input, count, DDP_F32, DDP_SUM,
 *                                              on_shard, arg);
 *     ddp_rs_bucketer_flush(b);   // every callback has run, with this rank's reduced block
 *
 * ZeRO (stage 1: averaged gradients in, e.g. from the Reducer; stage 2: local gradients in,
 * reduce-scattered through the bucketer so each rank only ever holds its shard of the average):
 *
 *     ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;  zc.optim.kind = DDP_OPTIM_ADAM; ...
 *     ddp_zero_create(group, params, n, &zc, &zero);
 *     each step:  ... gradients ...;  ddp_zero_step(zero, grads);   // replicas identical again
 *
 * Overlap (stage 1, PyTorch's overlap_with_ddp): put ddp_zero_hook with the ZeRO object as the
 * Reducer's comm hook; each bucket's owner computes that bucket's update on the progress thread
 * as soon as its allreduce completes; after ddp_reducer_finalize, ddp_zero_step(zero, NULL) only
 * broadcasts the updated parameters. See docs/sharding.md for the partitioning rules.
 *
 * Thread-safety: one thread drives a bucketer, an optimizer or a ZeRO object. */
#ifndef DDP_SHARD_H
#define DDP_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/group.h"
#include "ddp/reducer.h"
#include "ddp/status.h"
#include "ddp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- ReduceScatterBucketer ---------------------------------------------------------------- */

typedef struct ddp_rs_bucketer ddp_rs_bucketer_t;

/* Receives this rank's reduced block: `count` elements of the input's dtype. `shard` is valid
 * only during the call (copy what you keep). Runs on the thread that called flush, teardown,
 * destroy or a later reduce_scatter_async of the same bucketer, never on the progress thread. */
typedef void (*ddp_rs_callback_fn)(void *arg, const void *shard, size_t count);

/* bucket_cap_bytes: bytes of one bucket over all ranks; each rank's block in a bucket holds
 * bucket_cap_bytes / dtype size / world_size elements. 0 disables bucketing (every input is
 * reduce-scattered on its own, at once). Buckets are created per (group, dtype, op) on first
 * use. */
DDP_API ddp_status_t ddp_rs_bucketer_create(size_t bucket_cap_bytes, ddp_rs_bucketer_t **out);

/* Flushes (waits for every reduction and runs every callback), then frees. The groups used must
 * still exist. NULL is allowed. Errors of that last flush are dropped: flush first to see them. */
DDP_API void ddp_rs_bucketer_destroy(ddp_rs_bucketer_t *bucketer);

/* Reduce-scatters `input`: world_size equal blocks of `count` elements, contiguous
 * (world_size * count elements). callback(arg, shard, count) later receives op over ranks of
 * block[rank]. An input of more than a bucket's block is issued at once on its own (the reduction
 * then reads `input` while it runs: keep it valid and unchanged until its callback has run);
 * smaller inputs are copied into the (group, dtype, op) bucket before the call returns (`input`
 * may be reused at once), and that bucket is first flushed (one reduce-scatter issued) when the
 * input does not fit in what is left of it. Every rank must make the same sequence of calls with
 * equal counts (the group checks). callback may be NULL. count 0 is accepted and does nothing
 * but run the callback (with count 0) in order with the others. */
DDP_API ddp_status_t ddp_rs_bucketer_reduce_scatter_async(ddp_rs_bucketer_t *bucketer,
                                                          ddp_group_t *group, const void *input,
                                                          size_t count, ddp_dtype_t dtype,
                                                          ddp_reduce_op_t op,
                                                          ddp_rs_callback_fn callback, void *arg);

/* Same with the world_size blocks given as pointers (blocks[r]: count elements). Always copied
 * before the call returns (into the bucket, or into a temporary for a direct input), so the
 * blocks may be reused at once. */
DDP_API ddp_status_t ddp_rs_bucketer_reduce_scatter_blocks_async(
    ddp_rs_bucketer_t *bucketer, ddp_group_t *group, const void *const *blocks, size_t count,
    ddp_dtype_t dtype, ddp_reduce_op_t op, ddp_rs_callback_fn callback, void *arg);

/* Issues every partly filled bucket, waits for every reduction and runs every pending callback
 * (in issue order of the reductions). Returns the first failure; works of a failed reduction
 * have their callbacks dropped. */
DDP_API ddp_status_t ddp_rs_bucketer_flush(ddp_rs_bucketer_t *bucketer);

/* Frees the memory of every bucket and the buffers of finished direct inputs (the last few are
 * kept for reuse: same-sized inputs every step would otherwise fault in fresh pages each time).
 * DDP_ERR_INVALID_USAGE, naming
 * the bucket, when one holds unflushed inputs or reductions are in flight: flush first. A later
 * input re-creates its bucket's memory on demand; ddp_rs_bucketer_setup does it at once. */
DDP_API ddp_status_t ddp_rs_bucketer_teardown(ddp_rs_bucketer_t *bucketer);
/* Allocates the memory of every bucket known to the bucketer (those freed by teardown). */
DDP_API ddp_status_t ddp_rs_bucketer_setup(ddp_rs_bucketer_t *bucketer);

/* Bytes of bucket memory the bucketer currently holds (buckets, their output shards and the
 * buffers of reductions in flight or kept for reuse). */
DDP_API size_t ddp_rs_bucketer_memory_bytes(const ddp_rs_bucketer_t *bucketer);

/* Reductions issued since create: bucket flushes and direct inputs. */
DDP_API ddp_status_t ddp_rs_bucketer_counts(const ddp_rs_bucketer_t *bucketer,
                                            uint64_t *bucket_flushes, uint64_t *direct);

/* ---- optimizers: update rules ------------------------------------------------------------- */

typedef enum ddp_optim_kind {
    DDP_OPTIM_SGD = 0,  /* torch.optim.SGD: weight decay added to the gradient */
    DDP_OPTIM_ADAM = 1, /* torch.optim.Adam: L2 weight decay, bias-corrected moments */
    DDP_OPTIM_ADAMW = 2 /* torch.optim.AdamW: decoupled weight decay */
} ddp_optim_kind_t;

/* The update rules, exactly torch.optim's (1.13, single-tensor) with lr and weight_decay (wd)
 * of the parameter's group, t = steps of this parameter so far including this one, g the
 * gradient (times the clipping coefficient, see max_grad_norm):
 * SGD:   d = g + wd*p; with momentum: buf = (t == 1) d, else momentum*buf + (1-dampening)*d;
 *        d = nesterov ? d + momentum*buf : buf;  p -= lr*d.
 * Adam:  d = g + wd*p; m = b1*m + (1-b1)*d; v = b2*v + (1-b2)*d*d; amsgrad: vmax = max(vmax, v)
 *        and vmax replaces v below; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
 * AdamW: p *= 1 - lr*wd (rounded to the storage type, as torch's in-place mul_); then Adam's
 *        moments and update from g (no wd in d).
 * Computed in double per element and stored in the working type (f32 or f64; f16 and bf16
 * parameters are updated in an f32 master copy kept by the optimizer and written back rounded to
 * nearest even, as torch's .to(torch.bfloat16)), so the same gradients give bitwise the same
 * parameters in the plain optimizer and in ZeRO. */
typedef struct ddp_optim_group {
    double lr;
    double weight_decay;
} ddp_optim_group_t;

/* Passed as a group index: every group. */
#define DDP_OPTIM_ALL_GROUPS ((size_t)-1)

typedef struct ddp_optim_config {
    ddp_optim_kind_t kind;
    double lr;
    double momentum; /* SGD; 0: no momentum buffer is kept */
    int nesterov;    /* SGD; needs momentum > 0 and dampening 0 */
    double beta1, beta2, eps; /* Adam, AdamW */
    double weight_decay;
    /* Fields below were added later; zero keeps the behaviour of before. */
    double dampening; /* SGD, in [0, 1] */
    int amsgrad;      /* Adam, AdamW: keep the running maximum of v */
    /* > 0: every step first computes the global L2 norm of all gradients (the norm over every
     * shard and rank under ZeRO) and multiplies them by min(1, max_grad_norm / (norm + 1e-6)),
     * as torch.nn.utils.clip_grad_norm_; the caller's gradients are not written.
     * ddp_optim_grad_norm / ddp_zero_grad_norm return the norm before clipping. 0: off. */
    double max_grad_norm;
    /* Parameter groups (torch's param_groups): ngroups entries of (lr, weight_decay), which
     * replace lr and weight_decay for their parameters; param_groups[i] is the group of
     * parameter i (NULL: all in group 0). Both arrays are copied at create. ngroups 0: one group
     * with lr and weight_decay above. */
    size_t ngroups;
    const ddp_optim_group_t *groups;
    const uint32_t *param_groups;
} ddp_optim_config_t;

/* Fills *config with the defaults (DDP_OPTIM_CONFIG_INIT's), from C or C++. NULL is ignored. */
DDP_API void ddp_optim_config_init(ddp_optim_config_t *config);

/* In C, designated initializers (adding a field cannot shift the others); in C++, the same
 * values from ddp_optim_config_init. Defaults: SGD, lr 0.01, no momentum, Adam's betas
 * 0.9/0.999 and eps 1e-8, no weight decay, no dampening, no amsgrad, no clipping, one group. */
#ifndef __cplusplus
#define DDP_OPTIM_CONFIG_INIT                                                                     \
    {.kind = DDP_OPTIM_SGD,                                                                       \
     .lr = 0.01,                                                                                  \
     .momentum = 0.0,                                                                             \
     .nesterov = 0,                                                                               \
     .beta1 = 0.9,                                                                                \
     .beta2 = 0.999,                                                                              \
     .eps = 1e-8,                                                                                 \
     .weight_decay = 0.0,                                                                         \
     .dampening = 0.0,                                                                            \
     .amsgrad = 0,                                                                                \
     .max_grad_norm = 0.0,                                                                        \
     .ngroups = 0,                                                                                \
     .groups = NULL,                                                                              \
     .param_groups = NULL}
#else
#define DDP_OPTIM_CONFIG_INIT                                                                     \
    ([] {                                                                                         \
        ddp_optim_config_t ddp_config_;                                                           \
        ddp_optim_config_init(&ddp_config_);                                                      \
        return ddp_config_;                                                                       \
    }())
#endif

/* The plain optimizer: every parameter's state on this rank (for single-process training and as
 * the reference ZeRO is compared with). Parameters: data, numel, dtype (f32, f64, f16 or bf16)
 * of each ddp_param_t are used; the array is copied, data must outlive the optimizer. f16/bf16
 * parameters get an f32 master copy, initialised from their values here. */
typedef struct ddp_optim ddp_optim_t;
DDP_API ddp_status_t ddp_optim_create(const ddp_param_t *params, size_t nparams,
                                      const ddp_optim_config_t *config, ddp_optim_t **out);
DDP_API void ddp_optim_destroy(ddp_optim_t *optim);
/* grads[i]: parameter i's gradient (numel elements of its dtype; only read). Clips (when
 * max_grad_norm > 0) and updates every parameter. grads NULL: each parameter's ddp_param_t.grad
 * as given to ddp_optim_create (e.g. pointers into one gradient block, llm.c's layout, which
 * need no array of their own; a `float **` is not a `void *const *` in C), an
 * DDP_ERR_INVALID_ARGUMENT naming the first non-empty parameter whose .grad was NULL. */
DDP_API ddp_status_t ddp_optim_step(ddp_optim_t *optim, void *const *grads);
/* Bytes of optimizer state tensors held: SGD's momentum buffers (none without momentum), Adam's
 * two moments (three with amsgrad), and the f32 master copies of f16/bf16 parameters.
 * Per-parameter step counters (scalars) are not counted. */
DDP_API size_t ddp_optim_state_bytes(const ddp_optim_t *optim);

/* The global gradient norm (before clipping) of the last step; NaN before a step with
 * max_grad_norm > 0 (the norm is computed only when clipping). */
DDP_API ddp_status_t ddp_optim_grad_norm(const ddp_optim_t *optim, double *norm);

/* Learning rate of `group` (DDP_OPTIM_ALL_GROUPS: every group), taking effect at the next step.
 * scale_lr sets every group's lr to its initial lr (the config's) times factor, as
 * torch.optim.lr_scheduler.LambdaLR does with a schedule's multiplier. get_lr reads one group's.
 * Between steps only (not while a step runs). */
DDP_API ddp_status_t ddp_optim_set_lr(ddp_optim_t *optim, size_t group, double lr);
DDP_API ddp_status_t ddp_optim_scale_lr(ddp_optim_t *optim, double factor);
DDP_API ddp_status_t ddp_optim_get_lr(const ddp_optim_t *optim, size_t group, double *lr);

/* Saved state: step counts, moments, master copies and every group's lr, in one byte blob
 * (native byte order; layout in docs/sharding.md; ends with a checksum). The blob of a plain
 * optimizer is "consolidated" (whole parameters): ddp_zero_state_load takes it too, at any world
 * size, and ddp_zero_state_consolidate makes the same format. size: *bytes gets the size. save:
 * buf of at least that size. load: checks magic, version, checksum, kind, amsgrad, momentum
 * buffers, every parameter's numel, dtype and group, and the number of groups (each mismatch
 * named) before changing anything; restores the groups' learning rates. The parameters are the
 * caller's to restore (their values equal the rounded master copies). */
DDP_API ddp_status_t ddp_optim_state_size(const ddp_optim_t *optim, size_t *bytes);
DDP_API ddp_status_t ddp_optim_state_save(const ddp_optim_t *optim, void *buf, size_t size);
DDP_API ddp_status_t ddp_optim_state_load(ddp_optim_t *optim, const void *buf, size_t size);

/* ---- learning-rate schedules ----------------------------------------------------------------
 * Pure functions: the learning rate of optimizer step `step` (0-based: the first step is 0),
 * equal to Hugging Face transformers' schedules (transformers.optimization) with LambdaLR after
 * `step` scheduler steps, times peak_lr:
 *   warmup (all three): step < warmup_steps: peak_lr * step / max(1, warmup_steps);
 *   cosine: get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5): progress =
 *     (step - warmup) / max(1, total - warmup); f = max(0, 0.5 (1 + cos(pi progress)));
 *     lr = min_lr + (peak_lr - min_lr) f  (min_lr 0: get_cosine_schedule_with_warmup);
 *   linear: get_linear_schedule_with_warmup: peak_lr max(0, (total - step) / max(1, total -
 *     warmup));
 *   constant: get_constant_schedule_with_warmup: peak_lr after the warmup. */
DDP_API double ddp_lr_warmup_cosine(uint64_t step, uint64_t warmup_steps, uint64_t total_steps,
                                    double peak_lr, double min_lr);
DDP_API double ddp_lr_warmup_linear(uint64_t step, uint64_t warmup_steps, uint64_t total_steps,
                                    double peak_lr);
DDP_API double ddp_lr_warmup_constant(uint64_t step, uint64_t warmup_steps, double peak_lr);

/* ---- ZeRO --------------------------------------------------------------------------------- */

/* How stage 1 partitions the parameters over the ranks (stage 2 always cuts them into chunks,
 * overlap assigns whole Reducer buckets). */
typedef enum ddp_zero_partition {
    /* Whole parameters, largest first onto the least-loaded rank (PyTorch's); after the update
     * each parameter is broadcast from its owner. A model dominated by one matrix stays
     * unbalanced. */
    DDP_ZERO_PARTITION_PARAMS = 0,
    /* Every parameter cut into world_size chunks of ceil(numel / world_size) elements, rank r
     * updating chunk r of each (stage 2's layout, from averaged gradients); after the update
     * each parameter is allgathered. Balanced to within one element per parameter, and every
     * rank moves its share of the exchange at the same time. Not with overlap. */
    DDP_ZERO_PARTITION_CHUNKS = 1
} ddp_zero_partition_t;

typedef struct ddp_zero_config {
    int stage;                /* 1: gradients are averaged already; 2: reduce-scattered here */
    ddp_optim_config_t optim;
    size_t bucket_cap_bytes;  /* stage 2: the reduce-scatter bucketer's cap (0: no bucketing) */
    int overlap;              /* stage 1 only: driven by ddp_zero_hook (see below) */
    ddp_zero_partition_t partition; /* stage 1 without overlap: see ddp_zero_partition_t */
    /* Stage 2 only: no reduce-scatter during backward (ddp_zero_grad_ready only notes the
     * gradient); ddp_zero_step reduces each parameter, updates this rank's chunk piece by piece
     * while the averaged values are in cache and writes the new values into every rank's
     * parameter, in one ddp_group_reduce_scatter_apply. On shared memory with the gradients and
     * parameters registered (DDP_SHM_MAP=auto does it from the second step) that reads the
     * peers' gradient chunks and writes its chunk into their parameters, nothing more: a
     * quarter of the memory traffic of an allreduce and an allgather. Not with max_grad_norm
     * (the norm needs every gradient before any update). */
    int fused;
} ddp_zero_config_t;

/* Fills *config with the defaults (DDP_ZERO_CONFIG_INIT's), from C or C++. NULL is ignored. */
DDP_API void ddp_zero_config_init(ddp_zero_config_t *config);

/* In C, designated initializers; in C++, the same values from ddp_zero_config_init. Defaults:
 * stage 1, DDP_OPTIM_CONFIG_INIT, a 25 MiB bucketer cap, no overlap, whole parameters. */
#ifndef __cplusplus
#define DDP_ZERO_CONFIG_INIT                                                                      \
    {.stage = 1,                                                                                  \
     .optim = DDP_OPTIM_CONFIG_INIT,                                                              \
     .bucket_cap_bytes = (size_t)25 << 20,                                                        \
     .overlap = 0,                                                                                \
     .partition = DDP_ZERO_PARTITION_PARAMS,                                                      \
     .fused = 0}
#else
#define DDP_ZERO_CONFIG_INIT                                                                      \
    ([] {                                                                                         \
        ddp_zero_config_t ddp_config_;                                                            \
        ddp_zero_config_init(&ddp_config_);                                                       \
        return ddp_config_;                                                                       \
    }())
#endif

typedef struct ddp_zero ddp_zero_t;

/* Not collective (no communication), but every rank must pass the same parameters (count,
 * numel, dtype) and config: the partition is computed from them alone, identically everywhere.
 * Stage 1: parameters are assigned whole, largest first, each to the least-loaded rank (ties:
 * lower rank), or with DDP_ZERO_PARTITION_CHUNKS cut as in stage 2. Stage 2: every parameter is
 * split into world_size contiguous chunks of ceil(numel / world_size) elements; rank r owns chunk
 * r of each. Overlap: whole Reducer buckets are assigned the same greedy way, learned as the hook
 * sees them. The group must outlive it. */
DDP_API ddp_status_t ddp_zero_create(ddp_group_t *group, const ddp_param_t *params,
                                     size_t nparams, const ddp_zero_config_t *config,
                                     ddp_zero_t **out);
DDP_API void ddp_zero_destroy(ddp_zero_t *zero);

/* One optimizer step, collective. Stage 1: grads[i] holds parameter i's AVERAGED gradient (as after
 * ddp_reducer_finalize); this rank updates the parameters it owns, then each parameter is broadcast
 * from its owner so every replica is bitwise identical (with DDP_ZERO_PARTITION_CHUNKS: this rank
 * updates its chunk of every parameter, then each parameter is allgathered). Stage 2: grads[i] holds this rank's LOCAL
 * gradient (no Reducer); they are averaged by reduce-scatter (DDP_AVG) through the bucketer, each
 * rank updates its chunks, and parameters are allgathered. The gradients are only read. Stage 2
 * with ddp_zero_grad_ready: grads gives only the parameters not marked. grads NULL (stages 1 and
 * 2): each parameter's ddp_param_t.grad as given to ddp_zero_create takes the place of grads[i]
 * (an error names a parameter that needs one and has none). Overlap:
 * grads must be NULL (the hook already computed each bucket's update); call after
 * ddp_reducer_finalize; the updated parameters are broadcast from their owners. */
DDP_API ddp_status_t ddp_zero_step(ddp_zero_t *zero, void *const *grads);

/* Stage 2: parameter `index`'s local gradient (numel elements of its dtype) is complete: its
 * reduce-scatter starts now (or it joins the bucketer's bucket), overlapping the rest of
 * backward like the Reducer's buckets. `grad` is read until the next ddp_zero_step returns (keep
 * it valid and unchanged). Every rank must mark the same parameters in the same order.
 * ddp_zero_step then takes gradients of parameters not marked from its grads argument (which may
 * be NULL when all were marked). Parameters are only written by ddp_zero_step, so backward may
 * go on reading them. DDP_ERR_INVALID_USAGE for stage 1 or a parameter marked twice in a step. */
DDP_API ddp_status_t ddp_zero_grad_ready(ddp_zero_t *zero, size_t index, const void *grad);

/* Bytes of optimizer state this rank holds (its partition only; same accounting as
 * ddp_optim_state_bytes, so the sum over ranks equals the plain optimizer's). */
DDP_API size_t ddp_zero_state_bytes(const ddp_zero_t *zero);
/* Elements of parameters this rank updates (its partition). */
DDP_API size_t ddp_zero_owned_numel(const ddp_zero_t *zero);
/* Stage 1: the rank that owns parameter `index` (-1 in overlap mode before the hook saw its
 * bucket). Stage 2 and DDP_ZERO_PARTITION_CHUNKS: every rank owns a chunk, *rank = -1. */
DDP_API ddp_status_t ddp_zero_param_owner(const ddp_zero_t *zero, size_t index, int *rank);

/* The global gradient norm (before clipping) of the last step, computed when config.optim has
 * max_grad_norm > 0: the square root of the allreduced sum of every rank's squares over its
 * partition (stage 1: its parameters' averaged gradients; stage 2: its shards of the averages),
 * the same value on every rank. NaN before such a step. Clipping is refused with overlap (each
 * bucket is updated before the last gradient exists). */
DDP_API ddp_status_t ddp_zero_grad_norm(const ddp_zero_t *zero, double *norm);

/* As ddp_optim_set_lr / scale_lr / get_lr. Every rank must make the same changes (each updates
 * its own partition with them). Between steps only; in overlap mode before the next backward. */
DDP_API ddp_status_t ddp_zero_set_lr(ddp_zero_t *zero, size_t group, double lr);
DDP_API ddp_status_t ddp_zero_scale_lr(ddp_zero_t *zero, double factor);
DDP_API ddp_status_t ddp_zero_get_lr(const ddp_zero_t *zero, size_t group, double *lr);

/* Sharded state: this rank's runs only (no communication); each rank saves its own and loads it
 * back into a ZeRO optimizer with the same parameters, stage and world size (the partition must
 * be the same: a run not covered by the blob is named in the error). Overlap mode: after the
 * hook has seen every bucket (after the first step). Same blob format as ddp_optim_state_*. */
DDP_API ddp_status_t ddp_zero_state_size(const ddp_zero_t *zero, size_t *bytes);
DDP_API ddp_status_t ddp_zero_state_save(const ddp_zero_t *zero, void *buf, size_t size);
/* Loads a shard saved by this rank's counterpart, or a consolidated blob (whole parameters:
 * from ddp_zero_state_consolidate or ddp_optim_state_save, any world size or stage): each rank
 * takes its part. Every rank calls it (each with a blob) before the next step. Overlap mode
 * learns its partition from the hook during the first step, too late to load into:
 * DDP_ERR_UNSUPPORTED there. */
DDP_API ddp_status_t ddp_zero_state_load(ddp_zero_t *zero, const void *buf, size_t size);

/* Consolidated state on `root`: collective. Every rank's shard travels to every rank (an
 * allgather of the shards padded to the largest, so each rank briefly holds about the whole
 * state) and root merges them into whole parameters, the plain optimizer's format.
 * consolidated_state_size is the same on every rank; root passes a buffer of that size, the
 * others NULL and 0. */
DDP_API ddp_status_t ddp_zero_consolidated_state_size(const ddp_zero_t *zero, size_t *bytes);
DDP_API ddp_status_t ddp_zero_state_consolidate(ddp_zero_t *zero, int root, void *buf,
                                                size_t size);

/* The overlap comm hook (ddp_comm_hook_fn): state is a ddp_zero_t created with overlap = 1 and the
 * same parameters, in the same order, as the Reducer's. One task on the progress thread allreduces
 * the bucket and, on the bucket's owner, computes its parameters' updated values from the averaged
 * gradients into a copy kept by the ZeRO object (memory: the owned parameters, about 1/world of the
 * model), so the caller's backward may keep reading every parameter until finalize;
 * ddp_zero_step(zero, NULL) then broadcasts the new values and installs them. The Reducer must keep
 * a fixed bucket layout (rebuild_buckets = 0): a bucket whose parameters change is
 * DDP_ERR_INVALID_USAGE, and so is a ddp_zero_step when some bucket was not reduced since the
 * previous step (no_sync iterations do not call hooks: step after a synchronised one). Parameter
 * indices are the Reducer's (no duplicate registrations). */
DDP_API ddp_status_t ddp_zero_hook(void *state, ddp_group_t *group,
                                   const ddp_comm_bucket_t *bucket, ddp_work_t **work);

#ifdef __cplusplus
}
#endif
#endif
