/* Internal to src/shard/: the optimizer update kernels, hyperparameters per parameter group and
 * the state format shared by the plain optimizer and ZeRO, so that both apply bitwise the same
 * arithmetic to the same gradients and read each other's saved state. Not installed. */
#ifndef DDP_SHARD_INTERNAL_H
#define DDP_SHARD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/shard.h"

/* State of one contiguous run of a parameter's elements (a whole parameter, or a stage-2 chunk):
 * `first` of `count` elements; SGD's momentum buffer or Adam's moments and AMSGrad's running
 * maximum (f64 for f64 parameters, else f32; NULL when not needed); the f32 master copy of an f16
 * or bf16 parameter's run; and how many updates this run has had. */
typedef struct ddp__optim_run {
    size_t first;
    size_t count;
    void *m;
    void *v;
    void *vmax;
    float *master;
    uint64_t steps;
} ddp__optim_run_t;

/* Whether a dtype is a half type (f16, bf16): its runs keep an f32 master copy. */
static inline int ddp__optim_is_half(ddp_dtype_t dtype)
{
    return dtype == DDP_F16 || dtype == DDP_BF16;
}

/* The type of the moments and of the arithmetic's stored values: f64 for f64, else f32. */
static inline ddp_dtype_t ddp__optim_state_dtype(ddp_dtype_t dtype)
{
    return dtype == DDP_F64 ? DDP_F64 : DDP_F32;
}

/* State arrays besides the master copy: momentum; m, v; m, v, vmax. */
static inline int ddp__optim_states_needed(const ddp_optim_config_t *c)
{
    if (c->kind == DDP_OPTIM_ADAM || c->kind == DDP_OPTIM_ADAMW) return c->amsgrad ? 3 : 2;
    return c->momentum > 0.0 ? 1 : 0;
}

/* The hyperparameters, resolved per parameter group: group g's lr and weight_decay replace the
 * config's in group[g]. initial_lr is what ddp_*_scale_lr multiplies. */
typedef struct ddp__optim_setup {
    ddp_optim_config_t base; /* the config with its pointers cleared */
    size_t ngroups;          /* >= 1 */
    ddp_optim_config_t *group;
    double *initial_lr;
    uint32_t *param_group; /* nparams entries */
    size_t nparams;
} ddp__optim_setup_t;

/* Checks an optimizer configuration; `who` prefixes the message ("zero", "optim"). */
ddp_status_t ddp__optim_check_config(const ddp_optim_config_t *config, const char *who);

/* Checks that params are usable by an optimizer (data for numel > 0, f32, f64, f16 or bf16). */
ddp_status_t ddp__optim_check_params(const ddp_param_t *params, size_t nparams, const char *who);

/* Checks config (groups included) and copies it for nparams parameters. */
ddp_status_t ddp__optim_setup_init(ddp__optim_setup_t *setup, const ddp_optim_config_t *config,
                                   size_t nparams, const char *who);
void ddp__optim_setup_free(ddp__optim_setup_t *setup);
/* The hyperparameters of parameter `param`. */
const ddp_optim_config_t *ddp__optim_hp(const ddp__optim_setup_t *setup, size_t param);
/* Learning-rate changes; group DDP_OPTIM_ALL_GROUPS is every group. */
ddp_status_t ddp__optim_set_lr(ddp__optim_setup_t *setup, size_t group, double lr,
                               const char *who);
ddp_status_t ddp__optim_scale_lr(ddp__optim_setup_t *setup, double factor, const char *who);
ddp_status_t ddp__optim_get_lr(const ddp__optim_setup_t *setup, size_t group, double *lr,
                               const char *who);

/* Allocates the state of `run` (count elements, zeroed) as the config needs; for an f16/bf16
 * parameter also the f32 master copy, initialised from `param` (the run's first element). */
ddp_status_t ddp__optim_run_alloc(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                  ddp_dtype_t dtype, const void *param);
void ddp__optim_run_free(ddp__optim_run_t *run);
/* Bytes the state of `run` takes (see ddp_optim_state_bytes). */
size_t ddp__optim_run_bytes(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                            ddp_dtype_t dtype);

/* One update of run->count elements: param points at the run's first element, grad at its
 * gradient (same dtype), reading the parameter from `param` and writing the updated values to
 * `out` (which may be param). grad_scale < 1 is the clipping coefficient applied to every
 * gradient element first (as clip_grad_norm_ multiplies the gradients); pass 1 for none.
 * Increments run->steps. `out` is `param` or does not overlap it, and neither overlaps the
 * gradient or the run's state: the kernels (optim_kernels.c) are vectorised on that promise. */
void ddp__optim_run_update_to(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                              ddp_dtype_t dtype, const void *param, void *out, const void *grad,
                              double grad_scale);

/* Elements [first, first + n) of the run, as the update numbered run->steps (which it does not
 * increment): param, out and grad point at element `first`. The arithmetic is per element, so
 * the run updated in pieces gets the bits of one whole update (optim_kernels.c). */
void ddp__optim_run_update_range(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                 ddp_dtype_t dtype, const void *param, void *out,
                                 const void *grad, double grad_scale, size_t first, size_t n);

/* Sum of squares of n gradient elements (in double). */
double ddp__optim_grad_sumsq(ddp_dtype_t dtype, const void *grad, size_t n);
/* torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6)); 1 when
 * max_norm is 0 (no clipping). */
double ddp__optim_clip_coef(double norm, double max_norm);

/* ---- saved state ---------------------------------------------------------------------------
 * A state blob holds, for every parameter, one run (maybe empty) with its step count and state
 * arrays. The plain optimizer and a consolidated ZeRO state hold whole parameters; a ZeRO shard
 * holds the rank's runs. See docs/sharding.md for the byte layout. */
typedef struct ddp__optim_view {
    const ddp__optim_setup_t *setup;
    size_t nparams;
    const size_t *numel;
    const ddp_dtype_t *dtype;
    const ddp__optim_run_t *runs;
    uint32_t world, rank; /* recorded for the reader's messages: a shard's origin */
} ddp__optim_view_t;

/* Bytes of the blob `view` makes. */
size_t ddp__optim_state_size(const ddp__optim_view_t *view);
/* Runs covering whole parameters (count = numel[i]; no state arrays: only sizes are read), for
 * a consolidated view; NULL with the error set when out of memory. Free with free(). */
ddp__optim_run_t *ddp__optim_whole_runs(const size_t *numel, size_t nparams, const char *what);
/* *bytes = the size of the consolidated (whole-parameter) blob of these parameters. */
ddp_status_t ddp__optim_whole_state_size(const ddp__optim_setup_t *setup, size_t nparams,
                                         const size_t *numel, const ddp_dtype_t *dtype,
                                         size_t *bytes);
/* Writes the blob into buf (size bytes, at least ddp__optim_state_size). */
ddp_status_t ddp__optim_state_write(const ddp__optim_view_t *view, void *buf, size_t size,
                                    const char *who);
/* Loads a blob into runs (the view's runs, cast mutable): every non-empty run must be covered
 * by the blob's run of that parameter. Checks everything before changing anything. The group
 * learning rates are restored into setup. */
ddp_status_t ddp__optim_state_read(const ddp__optim_view_t *view, ddp__optim_setup_t *setup,
                                   ddp__optim_run_t *runs, const void *buf, size_t size,
                                   const char *who);
/* Merges `nblobs` shard blobs (each checked) into one whole-parameter blob in out (size bytes,
 * exactly ddp__optim_state_size of a whole-parameter view with these parameters). */
ddp_status_t ddp__optim_state_merge(const ddp__optim_view_t *whole, const void *const *blobs,
                                    const size_t *sizes, size_t nblobs, void *out, size_t size,
                                    const char *who);


/* Collective over group: merges every rank's shard (`mine`, this rank's runs) into the
 * whole-parameter blob described by `whole` on root (buf of size bytes there; others NULL, 0);
 * size_fn names the call that tells the size, for the error on a short buffer.
 * consolidate.c; used by ZeRO and FSDP. */
ddp_status_t ddp__optim_state_consolidate(ddp_group_t *group, const ddp__optim_view_t *mine,
                                          const ddp__optim_view_t *whole, int root, void *buf,
                                          size_t size, const char *who,
                                          const char *size_fn);

#endif
