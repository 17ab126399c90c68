/* Optimizer update rules (PyTorch's SGD and Adam) on runs of parameter elements, and the plain
 * optimizer that keeps every parameter's state. ZeRO (zero.c) applies the same kernels to the runs
 * it owns, so equal gradients give bitwise equal parameters either way. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

ddp_status_t ddp__optim_check_config(const ddp_optim_config_t *c, const char *who)
{
    if (!c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optimizer config is NULL", who);
    if (c->kind != DDP_OPTIM_SGD && c->kind != DDP_OPTIM_ADAM)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: optim.kind is %d, expected DDP_OPTIM_SGD (0) or DDP_OPTIM_ADAM (1)",
                          who, (int)c->kind);
    if (!(c->lr >= 0.0) || !isfinite(c->lr))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.lr is %g, expected >= 0", who,
                          c->lr);
    if (!(c->weight_decay >= 0.0) || !isfinite(c->weight_decay))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.weight_decay is %g, expected >= 0",
                          who, c->weight_decay);
    if (c->kind == DDP_OPTIM_SGD) {
        if (!(c->momentum >= 0.0) || !isfinite(c->momentum))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.momentum is %g, expected >= 0",
                              who, c->momentum);
        if (c->nesterov && c->momentum <= 0.0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: optim.nesterov needs optim.momentum > 0 (it is %g)", who,
                              c->momentum);
    } else {
        if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.beta1 is %g, expected [0, 1)",
                              who, c->beta1);
        if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.beta2 is %g, expected [0, 1)",
                              who, c->beta2);
        if (!(c->eps >= 0.0) || !isfinite(c->eps))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.eps is %g, expected >= 0", who,
                              c->eps);
    }
    return DDP_OK;
}

ddp_status_t ddp__optim_check_params(const ddp_param_t *params, size_t nparams, const char *who)
{
    if (nparams > 0 && !params)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: params is NULL but nparams is %zu", who,
                          nparams);
    size_t total_bytes = 0;
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        const char *name = p->name ? p->name : "(unnamed)";
        if (p->dtype != DDP_F32 && p->dtype != DDP_F64)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "%s: parameter %zu (%s) has dtype %s; optimizers update f32 and "
                              "f64 parameters",
                              who, i, name, ddp_dtype_name(p->dtype));
        if (p->numel > 0 && !p->data)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: parameter %zu (%s) has %zu elements but data is NULL", who, i,
                              name, p->numel);
        if (p->sparse)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "%s: parameter %zu (%s) is sparse; optimizers here are dense", who,
                              i, name);
        /* Byte sizes (numel * element size, and their sum for ZeRO's buffers) must fit in a
         * ptrdiff_t, or the state allocations and the update's pointer arithmetic wrap and a
         * step writes past the data. */
        size_t es = ddp_dtype_size(p->dtype);
        size_t limit = (size_t)PTRDIFF_MAX / es;
        if (p->numel > limit)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: params[%zu].numel (%s) is %zu: its byte size overflows "
                              "(at most %zu elements of %s)",
                              who, i, name, p->numel, limit, ddp_dtype_name(p->dtype));
        if (p->numel * es > (size_t)PTRDIFF_MAX - total_bytes)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: params[%zu].numel (%s) is %zu: the total byte size of "
                              "parameters 0..%zu overflows",
                              who, i, name, p->numel, i);
        total_bytes += p->numel * es;
    }
    return DDP_OK;
}

static int states_needed(const ddp_optim_config_t *c)
{
    if (c->kind == DDP_OPTIM_ADAM) return 2;
    return c->momentum > 0.0 ? 1 : 0;
}

ddp_status_t ddp__optim_run_alloc(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                  ddp_dtype_t dtype)
{
    int k = states_needed(config);
    size_t n = run->count ? run->count : 1;
    run->m = run->v = NULL;
    run->steps = 0;
    if (k >= 1) {
        run->m = ddp__calloc(n, ddp_dtype_size(dtype), "optimizer state");
        if (!run->m) return DDP_ERR_NO_MEMORY;
    }
    if (k >= 2) {
        run->v = ddp__calloc(n, ddp_dtype_size(dtype), "optimizer state");
        if (!run->v) {
            free(run->m);
            run->m = NULL;
            return DDP_ERR_NO_MEMORY;
        }
    }
    return DDP_OK;
}

void ddp__optim_run_free(ddp__optim_run_t *run)
{
    free(run->m);
    free(run->v);
    run->m = run->v = NULL;
}

size_t ddp__optim_run_bytes(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                            ddp_dtype_t dtype)
{
    return (size_t)states_needed(config) * run->count * ddp_dtype_size(dtype);
}

/* The kernels compute every element in double and round once to the storage type, so the result
 * depends only on the inputs, never on how the elements were split into runs. */
#define DEFINE_UPDATE(suffix, T)                                                                  \
    static void sgd_##suffix(const ddp_optim_config_t *c, uint64_t t, const T *p, T *out,         \
                             const T *g, T *buf, size_t n)                                        \
    {                                                                                             \
        const double lr = c->lr, wd = c->weight_decay, mu = c->momentum;                          \
        for (size_t i = 0; i < n; i++) {                                                          \
            double d = (double)g[i] + wd * (double)p[i];                                          \
            if (buf) {                                                                            \
                double b = t == 1 ? d : mu * (double)buf[i] + d;                                  \
                buf[i] = (T)b;                                                                    \
                b = (double)buf[i];                                                               \
                d = c->nesterov ? d + mu * b : b;                                                 \
            }                                                                                     \
            out[i] = (T)((double)p[i] - lr * d);                                                  \
        }                                                                                         \
    }                                                                                             \
    static void adam_##suffix(const ddp_optim_config_t *c, uint64_t t, const T *p, T *out,        \
                              const T *g, T *m, T *v, size_t n)                                   \
    {                                                                                             \
        const double b1 = c->beta1, b2 = c->beta2, wd = c->weight_decay, eps = c->eps;            \
        const double step = c->lr / (1.0 - pow(b1, (double)t));                                   \
        const double inv_c2 = 1.0 / sqrt(1.0 - pow(b2, (double)t));                               \
        for (size_t i = 0; i < n; i++) {                                                          \
            double d = (double)g[i] + wd * (double)p[i];                                          \
            m[i] = (T)(b1 * (double)m[i] + (1.0 - b1) * d);                                       \
            v[i] = (T)(b2 * (double)v[i] + (1.0 - b2) * d * d);                                   \
            double denom = sqrt((double)v[i]) * inv_c2 + eps;                                     \
            out[i] = (T)((double)p[i] - step * (double)m[i] / denom);                             \
        }                                                                                         \
    }

DEFINE_UPDATE(f32, float)
DEFINE_UPDATE(f64, double)

void ddp__optim_run_update_to(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                              ddp_dtype_t dtype, const void *param, void *out, const void *grad)
{
    uint64_t t = ++run->steps;
    if (run->count == 0) return;
    if (dtype == DDP_F32) {
        if (config->kind == DDP_OPTIM_ADAM)
            adam_f32(config, t, param, out, grad, run->m, run->v, run->count);
        else
            sgd_f32(config, t, param, out, grad, run->m, run->count);
    } else {
        if (config->kind == DDP_OPTIM_ADAM)
            adam_f64(config, t, param, out, grad, run->m, run->v, run->count);
        else
            sgd_f64(config, t, param, out, grad, run->m, run->count);
    }
}

void ddp__optim_run_update(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                           ddp_dtype_t dtype, void *param, const void *grad)
{
    ddp__optim_run_update_to(run, config, dtype, param, param, grad);
}

/* ---- the plain optimizer ------------------------------------------------------------------ */

struct ddp_optim {
    ddp_optim_config_t config;
    size_t nparams;
    void **data;
    ddp_dtype_t *dtypes;
    ddp__optim_run_t *runs;
};

void ddp_optim_destroy(ddp_optim_t *o)
{
    if (!o) return;
    if (o->runs)
        for (size_t i = 0; i < o->nparams; i++) ddp__optim_run_free(&o->runs[i]);
    free(o->runs);
    free(o->data);
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
    o->config = *config;
    o->nparams = nparams;
    size_t n = nparams ? nparams : 1;
    o->data = ddp__calloc(n, sizeof *o->data, "optimizer");
    o->dtypes = ddp__calloc(n, sizeof *o->dtypes, "optimizer");
    o->runs = ddp__calloc(n, sizeof *o->runs, "optimizer");
    if (!o->data || !o->dtypes || !o->runs) {
        ddp_optim_destroy(o);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < nparams; i++) {
        o->data[i] = params[i].data;
        o->dtypes[i] = params[i].dtype;
        o->runs[i].first = 0;
        o->runs[i].count = params[i].numel;
        s = ddp__optim_run_alloc(&o->runs[i], config, params[i].dtype);
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
    if (o->nparams > 0 && !grads)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim step: grads is NULL");
    for (size_t i = 0; i < o->nparams; i++)
        if (o->runs[i].count > 0 && !grads[i])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "optim step: grads[%zu] is NULL", i);
    for (size_t i = 0; i < o->nparams; i++)
        ddp__optim_run_update(&o->runs[i], &o->config, o->dtypes[i], o->data[i], grads[i]);
    return DDP_OK;
}

size_t ddp_optim_state_bytes(const ddp_optim_t *o)
{
    if (!o) return 0;
    size_t bytes = 0;
    for (size_t i = 0; i < o->nparams; i++)
        bytes += ddp__optim_run_bytes(&o->runs[i], &o->config, o->dtypes[i]);
    return bytes;
}
