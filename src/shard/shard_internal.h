/* Internal to src/shard/: the optimizer update kernels shared by the plain optimizer and ZeRO, so
 * that both apply bitwise the same arithmetic to the same gradients. Not installed. */
#ifndef DDP_SHARD_INTERNAL_H
#define DDP_SHARD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/shard.h"

/* State of one contiguous run of a parameter's elements (a whole parameter, or a stage-2 chunk):
 * `first` of `count` elements, SGD's momentum buffer or Adam's moments (in the parameter's dtype,
 * NULL when not needed), and how many updates this run has had. */
typedef struct ddp__optim_run {
    size_t first;
    size_t count;
    void *m;
    void *v;
    uint64_t steps;
} ddp__optim_run_t;

/* Checks an optimizer configuration; `who` prefixes the message ("zero", "optim"). */
ddp_status_t ddp__optim_check_config(const ddp_optim_config_t *config, const char *who);

/* Checks that params are usable by an optimizer (data for numel > 0, f32 or f64). */
ddp_status_t ddp__optim_check_params(const ddp_param_t *params, size_t nparams, const char *who);

/* Allocates the state of `run` (count elements of dtype, zeroed) as the config needs. */
ddp_status_t ddp__optim_run_alloc(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                  ddp_dtype_t dtype);
void ddp__optim_run_free(ddp__optim_run_t *run);
/* Bytes the state of `run` takes (see ddp_optim_state_bytes). */
size_t ddp__optim_run_bytes(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                            ddp_dtype_t dtype);

/* One update of run->count elements: param points at the run's first element, grad at its
 * gradient (same dtype). Increments run->steps. */
void ddp__optim_run_update(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                           ddp_dtype_t dtype, void *param, const void *grad);
/* Same, reading the parameter from `param` and writing the updated values to `out` (which may be
 * param), so a parameter still being read elsewhere can be updated into a copy. */
void ddp__optim_run_update_to(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                              ddp_dtype_t dtype, const void *param, void *out, const void *grad);

#endif
