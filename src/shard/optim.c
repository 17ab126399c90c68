/* Optimizer update rules (PyTorch's SGD, Adam and AdamW) on runs of parameter elements, parameter
 * groups, gradient clipping, learning-rate schedules, the saved-state format, and the plain
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

static int is_half(ddp_dtype_t dtype) { return dtype == DDP_F16 || dtype == DDP_BF16; }

/* The type of the moments and of the arithmetic's stored values: f64 for f64, else f32. */
static ddp_dtype_t state_dtype(ddp_dtype_t dtype) { return dtype == DDP_F64 ? DDP_F64 : DDP_F32; }

/* State arrays besides the master copy: momentum; m, v; m, v, vmax. */
static int states_needed(const ddp_optim_config_t *c)
{
    if (c->kind == DDP_OPTIM_ADAM || c->kind == DDP_OPTIM_ADAMW) return c->amsgrad ? 3 : 2;
    return c->momentum > 0.0 ? 1 : 0;
}

ddp_status_t ddp__optim_run_alloc(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                  ddp_dtype_t dtype, const void *param)
{
    int k = states_needed(config);
    size_t n = run->count ? run->count : 1, es = ddp_dtype_size(state_dtype(dtype));
    run->m = run->v = run->vmax = NULL;
    run->master = NULL;
    run->steps = 0;
    void **slots[3] = {&run->m, &run->v, &run->vmax};
    for (int j = 0; j < k; j++) {
        *slots[j] = ddp__calloc(n, es, "optimizer state");
        if (!*slots[j]) goto no_memory;
    }
    if (is_half(dtype)) {
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
    size_t bytes = (size_t)states_needed(config) * run->count *
                   ddp_dtype_size(state_dtype(dtype));
    if (is_half(dtype)) bytes += run->count * sizeof(float);
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

/* ---- the saved state --------------------------------------------------------------------------
 * Layout (native byte order):
 *   u64 magic "DDPOPTST" | u32 version | u32 kind | u32 state arrays | u32 amsgrad |
 *   u32 world | u32 rank | u64 nparams | u64 ngroups | f64 lr[ngroups] |
 *   nparams x (u64 numel, u32 dtype, u32 group, u64 first, u64 count, u64 steps) |
 *   per parameter: [f32 master[count] (f16/bf16)] then each state array [count] (f32; f64 for
 *   f64 parameters) | u64 FNV-1a of everything before. */
#define STATE_MAGIC 0x545354504f505444ull /* "DDPOPTST" read as little-endian */
#define STATE_VERSION 1u
#define STATE_HEADER 48u
#define STATE_RECORD 40u

typedef struct state_record {
    uint64_t numel;
    uint32_t dtype, group;
    uint64_t first, count, steps;
} state_record_t;


/* Bytes of one run's arrays in the blob. */
static size_t run_blob_bytes(int nstates, ddp_dtype_t dtype, uint64_t count)
{
    size_t b = (size_t)nstates * (size_t)count * ddp_dtype_size(state_dtype(dtype));
    if (is_half(dtype)) b += (size_t)count * sizeof(float);
    return b;
}

size_t ddp__optim_state_size(const ddp__optim_view_t *v)
{
    int k = states_needed(&v->setup->base);
    size_t bytes = STATE_HEADER + 8 * v->setup->ngroups + STATE_RECORD * v->nparams + 8;
    for (size_t i = 0; i < v->nparams; i++)
        bytes += run_blob_bytes(k, v->dtype[i], v->runs[i].count);
    return bytes;
}

static unsigned char *put(unsigned char *p, const void *x, size_t n)
{
    if (n) memcpy(p, x, n);
    return p + n;
}

ddp_status_t ddp__optim_state_write(const ddp__optim_view_t *v, void *buf, size_t size,
                                    const char *who)
{
    size_t need = ddp__optim_state_size(v);
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    if (size < need)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: size is %zu bytes, the state needs %zu",
                          who, size, need);
    const ddp__optim_setup_t *st = v->setup;
    uint64_t magic = STATE_MAGIC, nparams = v->nparams, ngroups = st->ngroups;
    uint32_t head[6] = {STATE_VERSION, (uint32_t)st->base.kind,
                        (uint32_t)states_needed(&st->base), (uint32_t)!!st->base.amsgrad,
                        v->world, v->rank};
    unsigned char *p = buf;
    p = put(p, &magic, 8);
    p = put(p, head, sizeof head);
    p = put(p, &nparams, 8);
    p = put(p, &ngroups, 8);
    for (size_t g = 0; g < st->ngroups; g++) p = put(p, &st->group[g].lr, 8);
    for (size_t i = 0; i < v->nparams; i++) {
        uint64_t rec[5] = {v->numel[i], 0, v->runs[i].first, v->runs[i].count, v->runs[i].steps};
        uint32_t dg[2] = {(uint32_t)v->dtype[i], st->param_group[i]};
        memcpy(&rec[1], dg, 8);
        p = put(p, rec, sizeof rec);
    }
    int k = states_needed(&st->base);
    for (size_t i = 0; i < v->nparams; i++) {
        const ddp__optim_run_t *r = &v->runs[i];
        size_t bytes = r->count * ddp_dtype_size(state_dtype(v->dtype[i]));
        if (is_half(v->dtype[i])) p = put(p, r->master, r->count * sizeof(float));
        const void *arrays[3] = {r->m, r->v, r->vmax};
        for (int j = 0; j < k; j++) p = put(p, arrays[j], bytes);
    }
    uint64_t sum = ddp__fnv1a(buf, (size_t)(p - (unsigned char *)buf));
    put(p, &sum, 8);
    return DDP_OK;
}

/* A checked blob: its records and where each parameter's arrays start. */
typedef struct parsed {
    uint32_t kind, nstates, amsgrad, world, rank;
    uint64_t nparams, ngroups;
    const unsigned char *lrs;
    const unsigned char *records;
    size_t *data_offset; /* per parameter, malloc'd */
} parsed_t;

static void get_record(const parsed_t *ps, size_t i, state_record_t *r)
{
    const unsigned char *p = ps->records + STATE_RECORD * i;
    memcpy(&r->numel, p, 8);
    memcpy(&r->dtype, p + 8, 4);
    memcpy(&r->group, p + 12, 4);
    memcpy(&r->first, p + 16, 8);
    memcpy(&r->count, p + 24, 8);
    memcpy(&r->steps, p + 32, 8);
}

/* Checks the blob against the optimizer in `v` (kind, arrays, parameters, groups) and its own
 * consistency (sizes, checksum). */
static ddp_status_t parse_blob(const ddp__optim_view_t *v, const void *buf, size_t size,
                               parsed_t *ps, const char *who)
{
    memset(ps, 0, sizeof *ps);
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    const unsigned char *b = buf;
    uint64_t magic;
    uint32_t version;
    if (size < STATE_HEADER + 8)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %zu bytes are too few for an optimizer "
                          "state (the header alone is %u)", who, size, STATE_HEADER + 8);
    memcpy(&magic, b, 8);
    if (magic != STATE_MAGIC)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: not an optimizer state (bad magic)",
                          who);
    memcpy(&version, b + 8, 4);
    if (version != STATE_VERSION)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optimizer state version %u, this "
                          "library reads version %u", who, version, STATE_VERSION);
    memcpy(&ps->kind, b + 12, 4);
    memcpy(&ps->nstates, b + 16, 4);
    memcpy(&ps->amsgrad, b + 20, 4);
    memcpy(&ps->world, b + 24, 4);
    memcpy(&ps->rank, b + 28, 4);
    memcpy(&ps->nparams, b + 32, 8);
    memcpy(&ps->ngroups, b + 40, 8);
    uint64_t sum, stored;
    memcpy(&stored, b + size - 8, 8);
    sum = ddp__fnv1a(b, size - 8);
    if (sum != stored)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the optimizer state is corrupt or "
                          "truncated (checksum %016llx, stored %016llx, %zu bytes)", who,
                          (unsigned long long)sum, (unsigned long long)stored, size);
    const ddp__optim_setup_t *st = v->setup;
    if (ps->kind != (uint32_t)st->base.kind || ps->amsgrad != (uint32_t)!!st->base.amsgrad ||
        ps->nstates != (uint32_t)states_needed(&st->base))
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state was saved by optimizer kind %u with "
                          "%u state arrays (amsgrad %u); this one is kind %d with %d (amsgrad "
                          "%d)", who, ps->kind, ps->nstates, ps->amsgrad, (int)st->base.kind,
                          states_needed(&st->base), !!st->base.amsgrad);
    if (ps->nparams != v->nparams)
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state has %llu parameters, the optimizer "
                          "%zu", who, (unsigned long long)ps->nparams, v->nparams);
    if (ps->ngroups != st->ngroups)
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state has %llu parameter groups, the "
                          "optimizer %zu", who, (unsigned long long)ps->ngroups, st->ngroups);
    size_t fixed = STATE_HEADER + 8 * (size_t)ps->ngroups;
    if (size - 8 < fixed || (size - 8 - fixed) / STATE_RECORD < v->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated in its "
                          "parameter records", who);
    ps->lrs = b + STATE_HEADER;
    ps->records = b + fixed;
    ps->data_offset = ddp__malloc((v->nparams ? v->nparams : 1) * sizeof *ps->data_offset,
                                  "optimizer state load");
    if (!ps->data_offset) return DDP_ERR_NO_MEMORY;
    size_t off = fixed + STATE_RECORD * v->nparams;
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(ps, i, &r);
        const char *what = NULL;
        if (r.numel != v->numel[i]) what = "numel";
        else if (r.dtype != (uint32_t)v->dtype[i]) what = "dtype";
        else if (r.group != st->param_group[i]) what = "group";
        else if (r.first > r.numel || r.count > r.numel - r.first) what = "run";
        if (what) {
            free(ps->data_offset);
            ps->data_offset = NULL;
            return ddp__error(DDP_ERR_MISMATCH, "%s: parameter %zu: the state has numel %llu, "
                              "dtype %s, group %u, run [%llu, +%llu); the optimizer numel %zu, "
                              "dtype %s, group %u (the %s differs)", who, i,
                              (unsigned long long)r.numel,
                              ddp_dtype_name((ddp_dtype_t)r.dtype), r.group,
                              (unsigned long long)r.first, (unsigned long long)r.count,
                              v->numel[i], ddp_dtype_name(v->dtype[i]),
                              (unsigned)st->param_group[i], what);
        }
        ps->data_offset[i] = off;
        size_t bytes = run_blob_bytes((int)ps->nstates, v->dtype[i], r.count);
        if (bytes > size - 8 - off) {
            free(ps->data_offset);
            ps->data_offset = NULL;
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated in "
                              "parameter %zu's arrays", who, i);
        }
        off += bytes;
    }
    if (off != size - 8) {
        free(ps->data_offset);
        ps->data_offset = NULL;
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state has %zu bytes, its records "
                          "describe %zu", who, size, off + 8);
    }
    return DDP_OK;
}

/* Copies elements [first, first + count) of parameter i's arrays from a parsed blob (whose run
 * covers them) into dst's arrays at element dst_at. */
static void copy_arrays(const parsed_t *ps, const unsigned char *blob, size_t i,
                        ddp_dtype_t dtype, size_t first, size_t count, ddp__optim_run_t *dst,
                        size_t dst_at)
{
    state_record_t r;
    get_record(ps, i, &r);
    size_t es = ddp_dtype_size(state_dtype(dtype)), skip = first - (size_t)r.first;
    const unsigned char *src = blob + ps->data_offset[i];
    if (is_half(dtype)) {
        memcpy(dst->master + dst_at, src + skip * sizeof(float), count * sizeof(float));
        src += r.count * sizeof(float);
    }
    void *arrays[3] = {dst->m, dst->v, dst->vmax};
    for (uint32_t j = 0; j < ps->nstates; j++) {
        memcpy((unsigned char *)arrays[j] + dst_at * es, src + skip * es, count * es);
        src += r.count * es;
    }
}

ddp_status_t ddp__optim_state_read(const ddp__optim_view_t *v, ddp__optim_setup_t *st,
                                   ddp__optim_run_t *runs, const void *buf, size_t size,
                                   const char *who)
{
    parsed_t ps;
    ddp_status_t s = parse_blob(v, buf, size, &ps, who);
    if (s != DDP_OK) return s;
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(&ps, i, &r);
        const ddp__optim_run_t *run = &runs[i];
        if (run->count && (run->first < r.first || run->first + run->count > r.first + r.count)) {
            free(ps.data_offset);
            return ddp__error(DDP_ERR_MISMATCH,
                              "%s: parameter %zu: this optimizer updates elements [%zu, %zu) but "
                              "the state (rank %u of %u) holds [%llu, %llu); load this rank's "
                              "own shard or a consolidated state",
                              who, i, run->first, run->first + run->count, ps.rank, ps.world,
                              (unsigned long long)r.first,
                              (unsigned long long)(r.first + r.count));
        }
    }
    /* Checked: now change things. */
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(&ps, i, &r);
        runs[i].steps = r.steps;
        if (runs[i].count)
            copy_arrays(&ps, buf, i, v->dtype[i], runs[i].first, runs[i].count, &runs[i], 0);
    }
    for (size_t g = 0; g < st->ngroups; g++) memcpy(&st->group[g].lr, ps.lrs + 8 * g, 8);
    free(ps.data_offset);
    return DDP_OK;
}

ddp_status_t ddp__optim_state_merge(const ddp__optim_view_t *whole, const void *const *blobs,
                                    const size_t *sizes, size_t nblobs, void *out, size_t size,
                                    const char *who)
{
    /* The whole view's runs describe the result (first 0, count numel); their arrays are
     * allocated here, filled from the shards, and written out. */
    size_t n = whole->nparams;
    ddp__optim_run_t *runs = ddp__calloc(n ? n : 1, sizeof *runs, "optimizer state merge");
    parsed_t *ps = ddp__calloc(nblobs ? nblobs : 1, sizeof *ps, "optimizer state merge");
    ddp_status_t s = DDP_OK;
    size_t parsed = 0;
    if (!runs || !ps) {
        s = DDP_ERR_NO_MEMORY;
        goto out;
    }
    for (; parsed < nblobs; parsed++) {
        s = parse_blob(whole, blobs[parsed], sizes[parsed], &ps[parsed], who);
        if (s != DDP_OK) goto out;
    }
    for (size_t i = 0; i < n && s == DDP_OK; i++) {
        runs[i].count = whole->numel[i];
        s = ddp__optim_run_alloc(&runs[i], &whole->setup->base, whole->dtype[i], NULL);
        if (s != DDP_OK) break;
        /* A half parameter's master was not initialised from data: every element must come
         * from some shard, which the coverage check below makes sure of. */
        size_t covered = 0;
        for (size_t b = 0; b < nblobs; b++) {
            state_record_t r;
            get_record(&ps[b], i, &r);
            /* Shards of one partition are disjoint; overlapping ones would count twice. */
            for (size_t c = 0; c < b && r.count; c++) {
                state_record_t o;
                get_record(&ps[c], i, &o);
                if (o.count && r.first < o.first + o.count && o.first < r.first + r.count) {
                    s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: parameter %zu: shards %zu and "
                                   "%zu both hold elements of [%llu, %llu)", who, i, c, b,
                                   (unsigned long long)r.first,
                                   (unsigned long long)(r.first + r.count));
                    goto out;
                }
            }
            if (r.steps > runs[i].steps) runs[i].steps = r.steps;
            if (r.count == 0) continue;
            copy_arrays(&ps[b], blobs[b], i, whole->dtype[i], (size_t)r.first, (size_t)r.count,
                        &runs[i], (size_t)r.first);
            covered += (size_t)r.count;
        }
        if (covered != whole->numel[i])
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: parameter %zu: the shards hold %zu of "
                           "its %zu elements", who, i, covered, whole->numel[i]);
    }
    if (s == DDP_OK) {
        ddp__optim_view_t v = *whole;
        v.runs = runs;
        s = ddp__optim_state_write(&v, out, size, who);
    }
out:
    for (size_t b = 0; b < parsed && ps; b++) free(ps[b].data_offset);
    if (runs)
        for (size_t i = 0; i < n; i++) ddp__optim_run_free(&runs[i]);
    free(runs);
    free(ps);
    return s;
}

/* ---- the plain optimizer ------------------------------------------------------------------ */

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
