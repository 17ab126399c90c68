/* Fully sharded data parallelism (ZeRO-3): each rank keeps one shard of every unit's flat
 * parameter buffer, of its averaged gradient and of the optimizer state, and holds a unit's full
 * parameters only between ddp_fsdp_gather and ddp_fsdp_release.
 *
 * How data moves. A unit's parameters, in index order, are one flat buffer of F elements padded
 * to world * S (S = ceil(F / world)); rank r keeps elements [r S, (r + 1) S). gather allgathers
 * the shards into a full buffer (asynchronously on the group's progress thread when started by
 * prefetch, so the next unit's allgather runs while this one computes); release hands the
 * buffer back to a small cache (or frees it). Backward accumulates into a full gradient buffer
 * per unit; grad_ready reduce-scatters it with DDP_AVG through the ReduceScatterBucketer (units
 * up to half a bucket share one reduction, as fairscale's FSDP does; a larger one goes at
 * once on its own, since sharing would only delay its start to the next unit's), and the
 * callback, on the caller's thread, adds this rank's shard of the average into its gradient
 * shard and frees the full buffer. The step updates each parameter's part of the shard (a run,
 * in the optimizer state format shared with ddp_optim and ZeRO) with the same kernels, so the
 * state saves and consolidates in that format too (fsdp_state.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/fsdp_internal.h"

const char *ddp__fsdp_name(const ddp_fsdp_t *f, size_t i)
{
    return f->names[i] ? f->names[i] : "(unnamed)";
}

/* ---- buffers ------------------------------------------------------------------------------- */

/* The smallest cached buffer of at least `bytes`, else a new one; *cap gets its size. */
static void *acquire(ddp_fsdp_t *f, size_t bytes, size_t *cap, const char *what)
{
    size_t best = f->npool;
    for (size_t k = 0; k < f->npool; k++)
        if (f->pool[k].bytes >= bytes &&
            (best == f->npool || f->pool[k].bytes < f->pool[best].bytes))
            best = k;
    if (best < f->npool) {
        void *p = f->pool[best].ptr;
        *cap = f->pool[best].bytes;
        f->cached -= f->pool[best].bytes;
        f->pool[best] = f->pool[--f->npool];
        return p;
    }
    *cap = bytes ? bytes : 1;
    return ddp__malloc(*cap, what);
}

/* Keeps the buffer (of `bytes`, its capacity) for reuse (config.cache_buffers) or frees it. */
static void give_back(ddp_fsdp_t *f, void *p, size_t bytes)
{
    if (!p) return;
    if (f->cache) {
        if (f->npool == f->pool_cap) {
            size_t cap = f->pool_cap ? 2 * f->pool_cap : 8;
            ddp__fsdp_buffer_t *grown = realloc(f->pool, cap * sizeof *grown);
            if (!grown) {
                free(p);
                return;
            }
            f->pool = grown;
            f->pool_cap = cap;
        }
        f->pool[f->npool++] = (ddp__fsdp_buffer_t){p, bytes};
        f->cached += bytes;
        return;
    }
    free(p);
}

static size_t full_bytes(const ddp_fsdp_t *f, const ddp__fsdp_unit_t *u)
{
    return (size_t)f->world * u->shard * u->es;
}

/* ---- create / destroy ---------------------------------------------------------------------- */

void ddp_fsdp_config_init(ddp_fsdp_config_t *config)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (!config) return;
    ddp_fsdp_config_t defaults = DDP_FSDP_CONFIG_INIT;
    *config = defaults;
}

void ddp_fsdp_destroy(ddp_fsdp_t *f)
{
    if (!f) return;
    for (size_t u = 0; f->units && u < f->nunits; u++)
        if (f->units[u].work) {
            (void)ddp_work_wait(f->units[u].work);
            ddp_work_free(f->units[u].work);
        }
    ddp_rs_bucketer_destroy(f->bucketer); /* runs the callbacks that can still run */
    ddp_rs_bucketer_destroy(f->direct);
    while (f->flights) {                  /* those of failed reductions */
        ddp__fsdp_flight_t *fl = f->flights;
        f->flights = fl->next;
        free(fl->buf);
        free(fl);
    }
    for (size_t u = 0; f->units && u < f->nunits; u++) {
        free(f->units[u].shard_data);
        free(f->units[u].grad_shard);
        free(f->units[u].full);
        free(f->units[u].grad_full);
    }
    for (size_t k = 0; k < f->npool; k++) free(f->pool[k].ptr);
    for (size_t i = 0; i < f->nparams; i++) {
        if (f->runs) ddp__optim_run_free(&f->runs[i]);
        if (f->names) free(f->names[i]);
    }
    free(f->pool);
    free(f->units);
    free(f->runs);
    free(f->names);
    free(f->numel);
    free(f->dtype);
    free(f->unit_of);
    free(f->offset);
    free(f->shard_at);
    ddp__optim_setup_free(&f->setup);
    free(f);
}

static ddp_status_t check_units(const ddp_param_t *params, size_t nparams,
                                const uint32_t *param_units, size_t nunits)
{
    const char *who = "fsdp create";
    if (!param_units && nunits != nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: param_units is NULL (a unit per "
                          "parameter) but nunits is %zu, not nparams %zu", who, nunits, nparams);
    if (nunits == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: nunits is 0 (every parameter needs a "
                          "unit)", who);
    size_t *count = calloc(nunits, sizeof *count);
    ddp_dtype_t *dt = calloc(nunits, sizeof *dt);
    if (!count || !dt) {
        free(count);
        free(dt);
        return ddp__error(DDP_ERR_NO_MEMORY, "%s: out of memory", who);
    }
    ddp_status_t s = DDP_OK;
    for (size_t i = 0; i < nparams && s == DDP_OK; i++) {
        size_t u = param_units ? param_units[i] : i;
        const char *name = params[i].name ? params[i].name : "(unnamed)";
        if (u >= nunits) {
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: param_units[%zu] (%s) is %zu, but "
                           "there are %zu units", who, i, name, u, nunits);
        } else if (count[u]++ && dt[u] != params[i].dtype) {
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: unit %zu mixes dtypes: parameter %zu "
                           "(%s) is %s, an earlier one %s (a unit is one flat buffer)", who, u, i,
                           name, ddp_dtype_name(params[i].dtype), ddp_dtype_name(dt[u]));
        }
        if (u < nunits) dt[u] = params[i].dtype;
    }
    for (size_t u = 0; u < nunits && s == DDP_OK; u++)
        if (!count[u])
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: unit %zu has no parameter", who, u);
    free(count);
    free(dt);
    return s;
}

ddp_status_t ddp_fsdp_create(ddp_group_t *group, const ddp_param_t *params, size_t nparams,
                             const uint32_t *param_units, size_t nunits,
                             const ddp_fsdp_config_t *config, ddp_fsdp_t **out)
{
    const char *who = "fsdp create";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", who);
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: group is NULL", who);
    if (!config) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: config is NULL", who);
    ddp_status_t s = ddp__optim_check_params(params, nparams, who);
    if (s != DDP_OK) return s;
    s = check_units(params, nparams, param_units, nunits);
    if (s != DDP_OK) return s;

    ddp_fsdp_t *f = ddp__calloc(1, sizeof *f, "fsdp");
    if (!f) return DDP_ERR_NO_MEMORY;
    f->group = group;
    f->rank = ddp_group_rank(group);
    f->world = ddp_group_size(group);
    f->sync = 1;
    f->cache = !!config->cache_buffers;
    f->grad_norm = NAN;
    f->nparams = nparams;
    f->nunits = nunits;
    s = ddp__optim_setup_init(&f->setup, &config->optim, nparams, who);
    if (s != DDP_OK) {
        free(f);
        return s;
    }
    size_t n1 = nparams ? nparams : 1;
    f->numel = ddp__calloc(n1, sizeof *f->numel, "fsdp");
    f->dtype = ddp__calloc(n1, sizeof *f->dtype, "fsdp");
    f->names = ddp__calloc(n1, sizeof *f->names, "fsdp");
    f->unit_of = ddp__calloc(n1, sizeof *f->unit_of, "fsdp");
    f->offset = ddp__calloc(n1, sizeof *f->offset, "fsdp");
    f->shard_at = ddp__calloc(n1, sizeof *f->shard_at, "fsdp");
    f->runs = ddp__calloc(n1, sizeof *f->runs, "fsdp");
    f->units = ddp__calloc(nunits, sizeof *f->units, "fsdp");
    if (!f->numel || !f->dtype || !f->names || !f->unit_of || !f->offset || !f->shard_at ||
        !f->runs || !f->units) {
        s = DDP_ERR_NO_MEMORY;
        goto fail;
    }
    for (size_t u = 0; u < nunits; u++) {
        f->units[u].fsdp = f;
        f->units[u].index = u;
        f->units[u].grad_shard_clean = 1;
    }
    for (size_t i = 0; i < nparams; i++) {
        size_t u = param_units ? param_units[i] : i;
        ddp__fsdp_unit_t *un = &f->units[u];
        f->numel[i] = params[i].numel;
        f->dtype[i] = params[i].dtype;
        f->unit_of[i] = u;
        f->offset[i] = un->numel;
        un->dtype = params[i].dtype;
        un->es = ddp_dtype_size(params[i].dtype);
        un->numel += params[i].numel;
        f->full_model += params[i].numel * un->es;
        if (params[i].name && !(f->names[i] = ddp__strdup(params[i].name, "fsdp name"))) {
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
    }
    /* Each unit: its flat buffer built from the caller's values (rank 0's when sync_params),
     * this rank's shard kept. One unit's full buffer exists at a time. */
    for (size_t u = 0; u < nunits; u++) {
        ddp__fsdp_unit_t *un = &f->units[u];
        un->shard = (un->numel + (size_t)f->world - 1) / (size_t)f->world;
        size_t sb = un->shard * un->es;
        un->shard_data = ddp__calloc(1, sb ? sb : 1, "fsdp parameter shard");
        un->grad_shard = ddp__calloc(1, sb ? sb : 1, "fsdp gradient shard");
        unsigned char *flat = ddp__calloc(1, full_bytes(f, un) ? full_bytes(f, un) : 1,
                                          "fsdp unit at create");
        if (!un->shard_data || !un->grad_shard || !flat) {
            free(flat);
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        for (size_t i = 0; i < nparams; i++)
            if (f->unit_of[i] == u && f->numel[i])
                memcpy(flat + f->offset[i] * un->es, params[i].data, f->numel[i] * un->es);
        if (config->sync_params && f->world > 1 && un->numel) {
            s = ddp_group_broadcast(group, flat, un->numel, un->dtype, 0);
            if (s != DDP_OK) {
                free(flat);
                ddp__error_context(s, "%s: broadcast of unit %zu's parameters from rank 0", who,
                                   u);
                goto fail;
            }
        }
        memcpy(un->shard_data, flat + (size_t)f->rank * sb, sb);
        free(flat);
    }
    /* Runs: the part of each parameter inside this rank's shard of its unit. */
    for (size_t i = 0; i < nparams; i++) {
        ddp__fsdp_unit_t *un = &f->units[f->unit_of[i]];
        size_t lo = (size_t)f->rank * un->shard, hi = lo + un->shard;
        size_t a = f->offset[i] > lo ? f->offset[i] : lo;
        size_t b = f->offset[i] + f->numel[i] < hi ? f->offset[i] + f->numel[i] : hi;
        f->runs[i].first = a < b ? a - f->offset[i] : 0;
        f->runs[i].count = a < b ? b - a : 0;
        f->shard_at[i] = a < b ? a - lo : 0;
        if (!f->runs[i].count) continue;
        s = ddp__optim_run_alloc(&f->runs[i], ddp__optim_hp(&f->setup, i), f->dtype[i],
                                 un->shard_data + f->shard_at[i] * un->es);
        if (s != DDP_OK) goto fail;
    }
    f->bucket_cap = config->bucket_cap_bytes;
    s = ddp_rs_bucketer_create(config->bucket_cap_bytes, &f->bucketer);
    if (s == DDP_OK) s = ddp_rs_bucketer_create(0, &f->direct);
    if (s != DDP_OK) goto fail;
    *out = f;
    return DDP_OK;
fail:
    ddp_fsdp_destroy(f);
    return s;
}

/* ---- gather / release ---------------------------------------------------------------------- */

static ddp_status_t check_unit(const ddp_fsdp_t *f, size_t unit, const char *who)
{
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fsdp is NULL", who);
    if (unit >= f->nunits)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: unit %zu out of range (%zu units)", who,
                          unit, f->nunits);
    return DDP_OK;
}

ddp_status_t ddp__fsdp_gather_start(ddp_fsdp_t *f, ddp__fsdp_unit_t *u, const char *who)
{
    if (u->state != DDP__FSDP_RELEASED) return DDP_OK;
    size_t bytes = full_bytes(f, u);
    u->full = acquire(f, bytes, &u->full_cap, "fsdp gathered parameters");
    if (!u->full) return DDP_ERR_NO_MEMORY;
    if (u->shard) {
        ddp_status_t s = ddp_group_allgather_async(f->group, u->shard_data, u->full, u->shard,
                                                   u->dtype, &u->work);
        if (s != DDP_OK) {
            give_back(f, u->full, u->full_cap);
            u->full = NULL;
            return ddp__error_context(s, "%s: allgather of unit %zu (step %llu)", who, u->index,
                                      (unsigned long long)f->steps);
        }
    }
    u->state = DDP__FSDP_GATHERING;
    f->gathered += bytes;
    if (f->gathered > f->gathered_peak) f->gathered_peak = f->gathered;
    return DDP_OK;
}

void ddp__fsdp_drop_full(ddp_fsdp_t *f, ddp__fsdp_unit_t *u)
{
    give_back(f, u->full, u->full_cap);
    u->full = NULL;
    f->gathered -= full_bytes(f, u);
    u->state = DDP__FSDP_RELEASED;
}

ddp_status_t ddp__fsdp_gather_finish(ddp_fsdp_t *f, ddp__fsdp_unit_t *u, const char *who)
{
    if (u->state != DDP__FSDP_GATHERING) return DDP_OK;
    ddp_status_t s = DDP_OK;
    if (u->work) {
        s = ddp_work_wait(u->work);
        ddp_work_free(u->work);
        u->work = NULL;
    }
    if (s != DDP_OK) {
        ddp__fsdp_drop_full(f, u);
        return ddp__error_context(s, "%s: allgather of unit %zu (step %llu)", who, u->index,
                                  (unsigned long long)f->steps);
    }
    u->state = DDP__FSDP_GATHERED;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_prefetch(ddp_fsdp_t *f, size_t unit)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    ddp_status_t s = check_unit(f, unit, "fsdp prefetch");
    if (s != DDP_OK) return s;
    return ddp__fsdp_gather_start(f, &f->units[unit], "fsdp prefetch");
}

ddp_status_t ddp_fsdp_gather(ddp_fsdp_t *f, size_t unit)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    ddp_status_t s = check_unit(f, unit, "fsdp gather");
    if (s != DDP_OK) return s;
    s = ddp__fsdp_gather_start(f, &f->units[unit], "fsdp gather");
    if (s != DDP_OK) return s;
    return ddp__fsdp_gather_finish(f, &f->units[unit], "fsdp gather");
}

ddp_status_t ddp_fsdp_release(ddp_fsdp_t *f, size_t unit)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    ddp_status_t s = check_unit(f, unit, "fsdp release");
    if (s != DDP_OK) return s;
    ddp__fsdp_unit_t *u = &f->units[unit];
    if (u->state == DDP__FSDP_RELEASED) return DDP_OK;
    s = ddp__fsdp_gather_finish(f, u, "fsdp release"); /* the allgather writes into the buffer */
    if (s != DDP_OK) return s;
    ddp__fsdp_drop_full(f, u);
    return DDP_OK;
}

ddp_status_t ddp_fsdp_param(ddp_fsdp_t *f, size_t index, void **data)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp param: fsdp is NULL");
    if (!data) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp param: data is NULL");
    if (index >= f->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp param: index %zu out of range (%zu "
                          "parameters)", index, f->nparams);
    ddp__fsdp_unit_t *u = &f->units[f->unit_of[index]];
    if (u->state != DDP__FSDP_GATHERED)
        return ddp__error(DDP_ERR_INVALID_USAGE, "fsdp param: parameter %zu (%s) is in unit %zu, "
                          "which is %s: call ddp_fsdp_gather first", index,
                          ddp__fsdp_name(f, index), u->index,
                          u->state == DDP__FSDP_GATHERING ? "still being gathered (prefetched)"
                                                          : "not gathered");
    *data = u->full + f->offset[index] * u->es;
    return DDP_OK;
}

/* ---- gradients ----------------------------------------------------------------------------- */

static ddp_status_t ensure_grad(ddp_fsdp_t *f, ddp__fsdp_unit_t *u)
{
    if (u->grad_full) return DDP_OK;
    size_t bytes = full_bytes(f, u);
    u->grad_full = acquire(f, bytes, &u->grad_cap, "fsdp full gradient");
    if (!u->grad_full) return DDP_ERR_NO_MEMORY;
    memset(u->grad_full, 0, bytes ? bytes : 1);
    f->grad_full += bytes;
    if (f->grad_full > f->grad_full_peak) f->grad_full_peak = f->grad_full;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_grad(ddp_fsdp_t *f, size_t index, void **grad)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp grad: fsdp is NULL");
    if (!grad) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp grad: grad is NULL");
    if (index >= f->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp grad: index %zu out of range (%zu "
                          "parameters)", index, f->nparams);
    ddp__fsdp_unit_t *u = &f->units[f->unit_of[index]];
    ddp_status_t s = ensure_grad(f, u);
    if (s != DDP_OK) return s;
    *grad = u->grad_full + f->offset[index] * u->es;
    return DDP_OK;
}

/* Adds n elements of src to dst (half types through f32, rounded once per element). */
static void add_into(ddp_dtype_t dt, void *dst, const void *src, size_t n)
{
    switch (dt) {
    case DDP_F32:
        for (size_t k = 0; k < n; k++) ((float *)dst)[k] += ((const float *)src)[k];
        break;
    case DDP_F64:
        for (size_t k = 0; k < n; k++) ((double *)dst)[k] += ((const double *)src)[k];
        break;
    case DDP_BF16:
        for (size_t k = 0; k < n; k++) {
            uint16_t *d = (uint16_t *)dst + k;
            *d = ddp_f32_to_bf16(ddp_bf16_to_f32(*d) + ddp_bf16_to_f32(((const uint16_t *)src)[k]));
        }
        break;
    default: /* DDP_F16 */
        for (size_t k = 0; k < n; k++) {
            uint16_t *d = (uint16_t *)dst + k;
            *d = ddp_f32_to_f16(ddp_f16_to_f32(*d) + ddp_f16_to_f32(((const uint16_t *)src)[k]));
        }
        break;
    }
}

/* The bucketer's callback (caller's thread): this rank's shard of the unit's averaged gradient. */
static void unit_reduced(void *arg, const void *shard, size_t count)
{
    ddp__fsdp_flight_t *fl = arg;
    ddp__fsdp_unit_t *u = fl->unit;
    ddp_fsdp_t *f = u->fsdp;
    if (u->grad_shard_clean)
        memcpy(u->grad_shard, shard, count * u->es);
    else
        add_into(u->dtype, u->grad_shard, shard, count);
    u->grad_shard_clean = 0;
    if (fl->prev) fl->prev->next = fl->next;
    else f->flights = fl->next;
    if (fl->next) fl->next->prev = fl->prev;
    f->grad_full -= fl->bytes;
    give_back(f, fl->buf, fl->cap);
    free(fl);
}

ddp_status_t ddp_fsdp_grad_ready(ddp_fsdp_t *f, size_t unit)
{
    const char *who = "fsdp grad ready";
    ddp__clear_error(); /* status.h: no stale text after a success */
    ddp_status_t s = check_unit(f, unit, who);
    if (s != DDP_OK) return s;
    ddp__fsdp_unit_t *u = &f->units[unit];
    s = ensure_grad(f, u); /* a unit whose gradient nobody asked for contributes zeros */
    if (s != DDP_OK) return s;
    if (!f->sync) {
        u->grad_unsynced = 1;
        return DDP_OK;
    }
    size_t bytes = full_bytes(f, u);
    if (!u->shard) { /* nothing to reduce: every rank skips alike */
        f->grad_full -= bytes;
        give_back(f, u->grad_full, u->grad_cap);
        u->grad_full = NULL;
        u->grad_unsynced = 0;
        return DDP_OK;
    }
    ddp__fsdp_flight_t *fl = ddp__calloc(1, sizeof *fl, "fsdp gradient in flight");
    if (!fl) return DDP_ERR_NO_MEMORY;
    fl->unit = u;
    fl->buf = u->grad_full;
    fl->bytes = bytes;
    fl->cap = u->grad_cap;
    fl->next = f->flights;
    if (f->flights) f->flights->prev = fl;
    f->flights = fl;
    u->grad_full = NULL; /* the flight owns it now; a next micro-step gets a fresh buffer */
    u->grad_unsynced = 0;
    /* Shared buckets only pay for small gradients; one of half a bucket or more would wait in
     * its bucket until the next unit's did not fit, for nothing. The bucketer copies what it
     * buckets (ddp/shard.h), so the full gradient can go at once. */
    int share = f->bucket_cap && 2 * bytes <= f->bucket_cap;
    s = ddp_rs_bucketer_reduce_scatter_async(share ? f->bucketer : f->direct, f->group, fl->buf,
                                             u->shard, u->dtype, DDP_AVG, unit_reduced, fl);
    if (s != DDP_OK)
        return ddp__error_context(s, "%s: reduce-scatter of unit %zu's gradient (step %llu)", who,
                                  unit, (unsigned long long)f->steps);
    if (share) {
        f->grad_full -= bytes;
        give_back(f, fl->buf, fl->cap);
        fl->buf = NULL;
        fl->bytes = 0;
    }
    return DDP_OK;
}

ddp_status_t ddp_fsdp_set_sync(ddp_fsdp_t *f, int sync)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp set sync: fsdp is NULL");
    f->sync = !!sync;
    return DDP_OK;
}

/* ---- the step ------------------------------------------------------------------------------ */

ddp_status_t ddp_fsdp_step(ddp_fsdp_t *f)
{
    const char *who = "fsdp step";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fsdp is NULL", who);
    ddp_status_t s = ddp_rs_bucketer_flush(f->bucketer);
    if (s == DDP_OK) s = ddp_rs_bucketer_flush(f->direct);
    if (s != DDP_OK)
        return ddp__error_context(s, "%s %llu: gradient reduce-scatter", who,
                                  (unsigned long long)f->steps);
    for (size_t k = 0; k < f->nunits; k++) {
        ddp__fsdp_unit_t *u = &f->units[k];
        if (u->state != DDP__FSDP_RELEASED)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s %llu: unit %zu is %s; release it before "
                              "the step (its full copy would be stale after the update)", who,
                              (unsigned long long)f->steps, k,
                              u->state == DDP__FSDP_GATHERED ? "gathered" : "being gathered");
        if (u->grad_full)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s %llu: unit %zu holds %s gradients not "
                              "reduced; call ddp_fsdp_grad_ready with sync on before the step",
                              who, (unsigned long long)f->steps, k,
                              u->grad_unsynced ? "no_sync" : "local");
    }
    double coef = 1.0;
    if (f->setup.base.max_grad_norm > 0.0) {
        double sumsq = 0.0;
        for (size_t i = 0; i < f->nparams; i++) {
            ddp__fsdp_unit_t *u = &f->units[f->unit_of[i]];
            if (f->runs[i].count)
                sumsq += ddp__optim_grad_sumsq(f->dtype[i], u->grad_shard + f->shard_at[i] * u->es,
                                               f->runs[i].count);
        }
        s = ddp_group_allreduce(f->group, &sumsq, &sumsq, 1, DDP_F64, DDP_SUM);
        if (s != DDP_OK)
            return ddp__error_context(s, "%s %llu: allreduce of the gradient norm", who,
                                      (unsigned long long)f->steps);
        f->grad_norm = sqrt(sumsq);
        coef = ddp__optim_clip_coef(f->grad_norm, f->setup.base.max_grad_norm);
    }
    for (size_t i = 0; i < f->nparams; i++) {
        if (!f->runs[i].count) continue;
        ddp__fsdp_unit_t *u = &f->units[f->unit_of[i]];
        unsigned char *p = u->shard_data + f->shard_at[i] * u->es;
        ddp__optim_run_update_to(&f->runs[i], ddp__optim_hp(&f->setup, i), f->dtype[i], p, p,
                                 u->grad_shard + f->shard_at[i] * u->es, coef);
    }
    for (size_t k = 0; k < f->nunits; k++) {
        ddp__fsdp_unit_t *u = &f->units[k];
        if (!u->grad_shard_clean) memset(u->grad_shard, 0, u->shard * u->es);
        u->grad_shard_clean = 1;
    }
    f->steps++;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_grad_norm(const ddp_fsdp_t *f, double *norm)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp grad norm: fsdp is NULL");
    if (!norm) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp grad norm: norm is NULL");
    *norm = f->grad_norm;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_set_lr(ddp_fsdp_t *f, size_t group, double lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp set lr: fsdp is NULL");
    return ddp__optim_set_lr(&f->setup, group, lr, "fsdp set lr");
}

ddp_status_t ddp_fsdp_scale_lr(ddp_fsdp_t *f, double factor)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp scale lr: fsdp is NULL");
    return ddp__optim_scale_lr(&f->setup, factor, "fsdp scale lr");
}

ddp_status_t ddp_fsdp_get_lr(const ddp_fsdp_t *f, size_t group, double *lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp get lr: fsdp is NULL");
    return ddp__optim_get_lr(&f->setup, group, lr, "fsdp get lr");
}

/* ---- queries ------------------------------------------------------------------------------- */

ddp_status_t ddp_fsdp_memory(const ddp_fsdp_t *f, ddp_fsdp_memory_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp memory: fsdp is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp memory: out is NULL");
    ddp_fsdp_memory_t m = {0};
    for (size_t k = 0; k < f->nunits; k++) {
        m.param_shard_bytes += f->units[k].shard * f->units[k].es;
        m.grad_shard_bytes += f->units[k].shard * f->units[k].es;
    }
    for (size_t i = 0; i < f->nparams; i++)
        m.optim_state_bytes += ddp__optim_run_bytes(&f->runs[i], &f->setup.base, f->dtype[i]);
    m.gathered_bytes = f->gathered;
    m.gathered_peak_bytes = f->gathered_peak;
    m.grad_full_bytes = f->grad_full;
    m.grad_full_peak_bytes = f->grad_full_peak;
    m.cached_bytes = f->cached;
    m.bucketer_bytes = ddp_rs_bucketer_memory_bytes(f->bucketer) +
                       ddp_rs_bucketer_memory_bytes(f->direct);
    m.full_model_bytes = f->full_model;
    *out = m;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_param_shard(const ddp_fsdp_t *f, size_t index, size_t *unit,
                                  size_t *first, size_t *count)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp param shard: fsdp is NULL");
    if (index >= f->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp param shard: index %zu out of range "
                          "(%zu parameters)", index, f->nparams);
    if (unit) *unit = f->unit_of[index];
    if (first) *first = f->runs[index].first;
    if (count) *count = f->runs[index].count;
    return DDP_OK;
}
