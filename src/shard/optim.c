/* The plain optimizer (ddp_optim_*): PyTorch's SGD, Adam and AdamW keeping every parameter's
 * state, on the shared parameter groups and runs (optim_setup.c), kernels (optim_kernels.c) and
 * saved-state format (optim_state.c). ZeRO (zero.c) applies the same kernels to the runs it
 * owns, so equal gradients give bitwise equal parameters either way. */
#include <math.h>
#include <stdlib.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

struct ddp_optim {
    ddp__optim_setup_t setup;
    size_t nparams;
    void **data;
    size_t *numel;
    ddp_dtype_t *dtypes;
    ddp__optim_run_t *runs;
    void **grads;     /* each parameter's .grad at create: the gradients a NULL grads means */
    double grad_norm; /* of the last step, NaN before one with clipping */
};

void ddp_optim_destroy(ddp_optim_t *o)
{
    if (!o) return;
    if (o->runs)
        for (size_t i = 0; i < o->nparams; i++) ddp__optim_run_free(&o->runs[i]);
    ddp__optim_setup_free(&o->setup);
    free(o->runs);
    free(o->grads);
    free(o->data);
    free(o->numel);
    free(o->dtypes);
    free(o);
}

void ddp_optim_config_init(ddp_optim_config_t *config)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (!config) return;
    ddp_optim_config_t defaults = DDP_OPTIM_CONFIG_INIT;
    *config = defaults;
}

ddp_status_t ddp_optim_create(const ddp_param_t *params, size_t nparams,
                              const ddp_optim_config_t *config, ddp_optim_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim create: out is NULL");
    ddp_status_t s = ddp__optim_check_config(config, "optim create");
    if (s != DDP_OK) return s;
    s = ddp__optim_check_params(params, nparams, "optim create");
    if (s != DDP_OK) return s;
    ddp_optim_t *o = ddp__calloc(1, sizeof *o, "optimizer");
    if (!o) return DDP_ERR_NO_MEMORY;
    s = ddp__optim_setup_init(&o->setup, config, nparams, "optim create");
    if (s != DDP_OK) {
        free(o);
        return s;
    }
    o->nparams = nparams;
    o->grad_norm = NAN;
    size_t n = nparams ? nparams : 1;
    o->data = ddp__calloc(n, sizeof *o->data, "optimizer");
    o->numel = ddp__calloc(n, sizeof *o->numel, "optimizer");
    o->dtypes = ddp__calloc(n, sizeof *o->dtypes, "optimizer");
    o->runs = ddp__calloc(n, sizeof *o->runs, "optimizer");
    o->grads = ddp__calloc(n, sizeof *o->grads, "optimizer");
    if (!o->data || !o->numel || !o->dtypes || !o->runs || !o->grads) {
        ddp_optim_destroy(o);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < nparams; i++) {
        o->data[i] = params[i].data;
        o->numel[i] = params[i].numel;
        o->dtypes[i] = params[i].dtype;
        o->grads[i] = params[i].grad;
        o->runs[i].first = 0;
        o->runs[i].count = params[i].numel;
        s = ddp__optim_run_alloc(&o->runs[i], ddp__optim_hp(&o->setup, i), params[i].dtype,
                                 params[i].data);
        if (s != DDP_OK) {
            ddp_optim_destroy(o);
            return s;
        }
    }
    *out = o;
    return DDP_OK;
}

ddp_status_t ddp_optim_step(ddp_optim_t *o, void *const *grads)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim step: optim is NULL");
    /* NULL: each parameter's .grad as given at create (a program with one gradient block and
     * pointers into it, llm.c's layout, has nothing else to pass). */
    int own = grads == NULL;
    if (own) grads = o->grads;
    for (size_t i = 0; i < o->nparams; i++)
        if (o->runs[i].count > 0 && !grads[i])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              own ? "optim step: grads is NULL and parameter %zu's .grad was NULL "
                                    "at ddp_optim_create (give grads, or set every "
                                    "ddp_param_t.grad)"
                                  : "optim step: grads[%zu] is NULL",
                              i);
    double coef = 1.0;
    if (o->setup.base.max_grad_norm > 0.0) {
        double sumsq = 0.0;
        for (size_t i = 0; i < o->nparams; i++)
            sumsq += ddp__optim_grad_sumsq(o->dtypes[i], grads[i], o->runs[i].count);
        o->grad_norm = sqrt(sumsq);
        coef = ddp__optim_clip_coef(o->grad_norm, o->setup.base.max_grad_norm);
    }
    for (size_t i = 0; i < o->nparams; i++)
        ddp__optim_run_update_to(&o->runs[i], ddp__optim_hp(&o->setup, i), o->dtypes[i],
                                 o->data[i], o->data[i], grads[i], coef);
    return DDP_OK;
}

size_t ddp_optim_state_bytes(const ddp_optim_t *o)
{
    if (!o) return 0;
    size_t bytes = 0;
    for (size_t i = 0; i < o->nparams; i++)
        bytes += ddp__optim_run_bytes(&o->runs[i], &o->setup.base, o->dtypes[i]);
    return bytes;
}

ddp_status_t ddp_optim_grad_norm(const ddp_optim_t *o, double *norm)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim grad norm: optim is NULL");
    if (!norm) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim grad norm: norm is NULL");
    *norm = o->grad_norm;
    return DDP_OK;
}

ddp_status_t ddp_optim_set_lr(ddp_optim_t *o, size_t group, double lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim set lr: optim is NULL");
    return ddp__optim_set_lr(&o->setup, group, lr, "optim set lr");
}

ddp_status_t ddp_optim_scale_lr(ddp_optim_t *o, double factor)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim scale lr: optim is NULL");
    return ddp__optim_scale_lr(&o->setup, factor, "optim scale lr");
}

ddp_status_t ddp_optim_get_lr(const ddp_optim_t *o, size_t group, double *lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim get lr: optim is NULL");
    return ddp__optim_get_lr(&o->setup, group, lr, "optim get lr");
}

static ddp__optim_view_t optim_view(const ddp_optim_t *o)
{
    return (ddp__optim_view_t){&o->setup, o->nparams, o->numel, o->dtypes, o->runs, 1, 0};
}

ddp_status_t ddp_optim_state_size(const ddp_optim_t *o, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim state size: optim is NULL");
    if (!bytes) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim state size: bytes is NULL");
    ddp__optim_view_t v = optim_view(o);
    *bytes = ddp__optim_state_size(&v);
    return DDP_OK;
}

ddp_status_t ddp_optim_state_save(const ddp_optim_t *o, void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim state save: optim is NULL");
    ddp__optim_view_t v = optim_view(o);
    return ddp__optim_state_write(&v, buf, size, "optim state save");
}

ddp_status_t ddp_optim_state_load(ddp_optim_t *o, const void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!o) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim state load: optim is NULL");
    ddp__optim_view_t v = optim_view(o);
    return ddp__optim_state_read(&v, &o->setup, o->runs, buf, size, "optim state load");
}
