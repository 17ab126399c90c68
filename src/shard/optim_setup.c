/* What the optimizers share besides their kernels (optim_kernels.c) and saved state
 * (optim_state.c): the checks of a config and of the parameters, the hyperparameters per
 * parameter group, a run's state arrays, gradient clipping, and the learning-rate schedules.
 * The plain optimizer (optim.c), ZeRO and FSDP build on them, so equal gradients give bitwise
 * equal parameters whichever keeps the state. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

ddp_status_t ddp__optim_check_config(const ddp_optim_config_t *c, const char *who)
{
    if (!c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optimizer config is NULL", who);
    if (c->kind != DDP_OPTIM_SGD && c->kind != DDP_OPTIM_ADAM && c->kind != DDP_OPTIM_ADAMW)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: optim.kind is %d, expected DDP_OPTIM_SGD (0), DDP_OPTIM_ADAM (1) "
                          "or DDP_OPTIM_ADAMW (2)",
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
        if (!(c->dampening >= 0.0 && c->dampening <= 1.0))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: optim.dampening is %g, expected [0, 1]", who, c->dampening);
        /* torch.optim.SGD refuses it too: Nesterov's look-ahead assumes an undamped buffer. */
        if (c->nesterov && c->dampening != 0.0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: optim.nesterov needs optim.dampening 0 (it is %g)", who,
                              c->dampening);
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
    if (!(c->max_grad_norm >= 0.0) || !isfinite(c->max_grad_norm))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: optim.max_grad_norm is %g, expected >= 0 (0: no clipping)", who,
                          c->max_grad_norm);
    if (c->ngroups > 0 && !c->groups)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: optim.groups is NULL but optim.ngroups is %zu", who, c->ngroups);
    if (c->ngroups == 0 && (c->groups || c->param_groups))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: optim.groups or optim.param_groups is set but optim.ngroups is 0",
                          who);
    if (c->ngroups > UINT32_MAX)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optim.ngroups is %zu, at most %u", who,
                          c->ngroups, (unsigned)UINT32_MAX);
    for (size_t g = 0; g < c->ngroups; g++) {
        if (!(c->groups[g].lr >= 0.0) || !isfinite(c->groups[g].lr))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: optim.groups[%zu].lr is %g, expected >= 0", who, g,
                              c->groups[g].lr);
        if (!(c->groups[g].weight_decay >= 0.0) || !isfinite(c->groups[g].weight_decay))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s: optim.groups[%zu].weight_decay is %g, expected >= 0", who, g,
                              c->groups[g].weight_decay);
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
        if (p->dtype != DDP_F32 && p->dtype != DDP_F64 && p->dtype != DDP_F16 &&
            p->dtype != DDP_BF16)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "%s: parameter %zu (%s) has dtype %s; optimizers update f32, f64, "
                              "f16 and bf16 parameters",
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

/* ---- parameter groups ---------------------------------------------------------------------- */

ddp_status_t ddp__optim_setup_init(ddp__optim_setup_t *st, const ddp_optim_config_t *config,
                                   size_t nparams, const char *who)
{
    memset(st, 0, sizeof *st);
    ddp_status_t s = ddp__optim_check_config(config, who);
    if (s != DDP_OK) return s;
    if (config->param_groups)
        for (size_t i = 0; i < nparams; i++)
            if (config->param_groups[i] >= config->ngroups)
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "%s: optim.param_groups[%zu] is %u but there are %zu groups",
                                  who, i, (unsigned)config->param_groups[i], config->ngroups);
    st->base = *config;
    st->base.ngroups = 0;
    st->base.groups = NULL;
    st->base.param_groups = NULL;
    st->ngroups = config->ngroups ? config->ngroups : 1;
    st->nparams = nparams;
    st->group = ddp__calloc(st->ngroups, sizeof *st->group, "optimizer groups");
    st->initial_lr = ddp__calloc(st->ngroups, sizeof *st->initial_lr, "optimizer groups");
    st->param_group = ddp__calloc(nparams ? nparams : 1, sizeof *st->param_group,
                                  "optimizer groups");
    if (!st->group || !st->initial_lr || !st->param_group) {
        ddp__optim_setup_free(st);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t g = 0; g < st->ngroups; g++) {
        st->group[g] = st->base;
        if (config->ngroups) {
            st->group[g].lr = config->groups[g].lr;
            st->group[g].weight_decay = config->groups[g].weight_decay;
        }
        st->initial_lr[g] = st->group[g].lr;
    }
    if (config->param_groups)
        memcpy(st->param_group, config->param_groups, nparams * sizeof *st->param_group);
    return DDP_OK;
}

void ddp__optim_setup_free(ddp__optim_setup_t *st)
{
    free(st->group);
    free(st->initial_lr);
    free(st->param_group);
    st->group = NULL;
    st->initial_lr = NULL;
    st->param_group = NULL;
}

const ddp_optim_config_t *ddp__optim_hp(const ddp__optim_setup_t *st, size_t param)
{
    return &st->group[st->param_group[param]];
}

ddp_status_t ddp__optim_set_lr(ddp__optim_setup_t *st, size_t group, double lr, const char *who)
{
    if (!(lr >= 0.0) || !isfinite(lr))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: lr is %g, expected >= 0", who, lr);
    if (group != DDP_OPTIM_ALL_GROUPS && group >= st->ngroups)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: group %zu out of range (%zu groups; DDP_OPTIM_ALL_GROUPS for all)",
                          who, group, st->ngroups);
    for (size_t g = 0; g < st->ngroups; g++)
        if (group == DDP_OPTIM_ALL_GROUPS || g == group) st->group[g].lr = lr;
    return DDP_OK;
}

ddp_status_t ddp__optim_scale_lr(ddp__optim_setup_t *st, double factor, const char *who)
{
    if (!(factor >= 0.0) || !isfinite(factor))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: factor is %g, expected >= 0", who,
                          factor);
    for (size_t g = 0; g < st->ngroups; g++) st->group[g].lr = st->initial_lr[g] * factor;
    return DDP_OK;
}

ddp_status_t ddp__optim_get_lr(const ddp__optim_setup_t *st, size_t group, double *lr,
                               const char *who)
{
    if (!lr) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: lr is NULL", who);
    if (group >= st->ngroups)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: group %zu out of range (%zu groups)",
                          who, group, st->ngroups);
    *lr = st->group[group].lr;
    return DDP_OK;
}

/* ---- runs ---------------------------------------------------------------------------------- */

ddp_status_t ddp__optim_run_alloc(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                  ddp_dtype_t dtype, const void *param)
{
    int k = ddp__optim_states_needed(config);
    size_t n = run->count ? run->count : 1, es = ddp_dtype_size(ddp__optim_state_dtype(dtype));
    run->m = run->v = run->vmax = NULL;
    run->master = NULL;
    run->steps = 0;
    void **slots[3] = {&run->m, &run->v, &run->vmax};
    for (int j = 0; j < k; j++) {
        *slots[j] = ddp__calloc(n, es, "optimizer state");
        if (!*slots[j]) goto no_memory;
    }
    if (ddp__optim_is_half(dtype)) {
        run->master = ddp__calloc(n, sizeof(float), "optimizer master weights");
        if (!run->master) goto no_memory;
        const uint16_t *h = param;
        for (size_t i = 0; h && i < run->count; i++)
            run->master[i] = dtype == DDP_BF16 ? ddp_bf16_to_f32(h[i]) : ddp_f16_to_f32(h[i]);
    }
    return DDP_OK;
no_memory:
    ddp__optim_run_free(run);
    return DDP_ERR_NO_MEMORY;
}

void ddp__optim_run_free(ddp__optim_run_t *run)
{
    free(run->m);
    free(run->v);
    free(run->vmax);
    free(run->master);
    run->m = run->v = run->vmax = NULL;
    run->master = NULL;
}

size_t ddp__optim_run_bytes(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                            ddp_dtype_t dtype)
{
    size_t bytes = (size_t)ddp__optim_states_needed(config) * run->count *
                   ddp_dtype_size(ddp__optim_state_dtype(dtype));
    if (ddp__optim_is_half(dtype)) bytes += run->count * sizeof(float);
    return bytes;
}

double ddp__optim_grad_sumsq(ddp_dtype_t dtype, const void *grad, size_t n)
{
    double sum = 0.0;
    switch (dtype) {
    case DDP_F32:
        for (size_t i = 0; i < n; i++) {
            double x = ((const float *)grad)[i];
            sum += x * x;
        }
        break;
    case DDP_F64:
        for (size_t i = 0; i < n; i++) {
            double x = ((const double *)grad)[i];
            sum += x * x;
        }
        break;
    case DDP_BF16:
        for (size_t i = 0; i < n; i++) {
            double x = ddp_bf16_to_f32(((const uint16_t *)grad)[i]);
            sum += x * x;
        }
        break;
    case DDP_F16:
        for (size_t i = 0; i < n; i++) {
            double x = ddp_f16_to_f32(((const uint16_t *)grad)[i]);
            sum += x * x;
        }
        break;
    default:
        break;
    }
    return sum;
}

double ddp__optim_clip_coef(double norm, double max_norm)
{
    if (!(max_norm > 0.0)) return 1.0;
    double coef = max_norm / (norm + 1e-6);
    /* A NaN or infinite norm gives NaN or 0 here: torch multiplies by it as well. */
    return coef < 1.0 || coef != coef ? coef : 1.0;
}

/* ---- learning-rate schedules ----------------------------------------------------------------- */

static double warmup_factor(uint64_t step, uint64_t warmup)
{
    return (double)step / (double)(warmup > 1 ? warmup : 1);
}

double ddp_lr_warmup_cosine(uint64_t step, uint64_t warmup_steps, uint64_t total_steps,
                            double peak_lr, double min_lr)
{
    if (step < warmup_steps) return peak_lr * warmup_factor(step, warmup_steps);
    uint64_t span = total_steps > warmup_steps ? total_steps - warmup_steps : 0;
    double progress = (double)(step - warmup_steps) / (double)(span > 1 ? span : 1);
    double f = 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
    if (f < 0.0) f = 0.0;
    if (min_lr == 0.0) return peak_lr * f;
    /* HF's cosine_with_min_lr: f * (1 - min_lr_rate) + min_lr_rate, times the peak. */
    double rate = min_lr / peak_lr;
    return peak_lr * (f * (1.0 - rate) + rate);
}

double ddp_lr_warmup_linear(uint64_t step, uint64_t warmup_steps, uint64_t total_steps,
                            double peak_lr)
{
    if (step < warmup_steps) return peak_lr * warmup_factor(step, warmup_steps);
    uint64_t span = total_steps > warmup_steps ? total_steps - warmup_steps : 0;
    double left = step < total_steps ? (double)(total_steps - step) : 0.0;
    return peak_lr * (left / (double)(span > 1 ? span : 1));
}

double ddp_lr_warmup_constant(uint64_t step, uint64_t warmup_steps, double peak_lr)
{
    if (step < warmup_steps) return peak_lr * warmup_factor(step, warmup_steps);
    return peak_lr;
}
