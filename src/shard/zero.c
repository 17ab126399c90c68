/* ZeRO (ZeroRedundancyOptimizer): each rank keeps optimizer state for, and updates, only its
 * partition of the parameters; the updated values then travel from their owners to every rank.
 *
 * Stage 1: gradients arrive averaged (the Reducer). Parameters are assigned whole, largest first,
 * each to the least-loaded rank (PyTorch's greedy partition), so each rank's state is about
 * 1/world of the total; after the local update every parameter is broadcast from its owner.
 * Stage 2: gradients arrive local. Each parameter is cut into world_size chunks of
 * ceil(numel/world) elements (the last padded), reduce-scattered with DDP_AVG through the
 * bucketer (small parameters share one reduce-scatter), and rank r updates chunk r of every
 * parameter from its shard of the average the moment that shard arrives; an allgather per
 * parameter then reassembles it. No rank ever holds the full averaged gradient or full state.
 * Overlap (stage 1 with ddp_zero_hook): whole Reducer buckets are assigned greedily as the hook
 * first sees them; one progress-thread task per bucket allreduces it and, on its owner, updates
 * its parameters right away, hidden behind the rest of backward.
 * Stage 1 with DDP_ZERO_PARTITION_CHUNKS: stage 2's chunks, updated from averaged gradients and
 * reassembled by the same allgathers: balanced, and every rank moves its share at once. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

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

typedef struct zero_chunk {
    ddp_zero_t *zero;
    size_t param;
} zero_chunk_t;

struct ddp_zero {
    ddp_group_t *group;
    int rank, world, stage, overlap;
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
    /* overlap */
    zero_bucket_t **buckets;
    size_t nbuckets;
    size_t *load; /* bytes assigned to each rank */
};

static size_t chunk_of(const ddp_zero_t *z, size_t i)
{
    return (z->numel[i] + (size_t)z->world - 1) / (size_t)z->world;
}

static const char *pname(const ddp_zero_t *z, size_t i)
{
    return z->names[i] ? z->names[i] : "(unnamed)";
}

void ddp_zero_destroy(ddp_zero_t *z)
{
    if (!z) return;
    ddp_rs_bucketer_destroy(z->bucketer);
    for (size_t i = 0; i < z->nparams; i++) {
        if (z->runs) ddp__optim_run_free(&z->runs[i]);
        if (z->works && z->works[i]) ddp_work_free(z->works[i]);
        if (z->names) free(z->names[i]);
        if (z->shadow) free(z->shadow[i]);
    }
    for (size_t b = 0; b < z->nbuckets; b++) {
        if (!z->buckets[b]) continue;
        free(z->buckets[b]->params);
        free(z->buckets[b]->offsets);
        free(z->buckets[b]);
    }
    free(z->buckets);
    free(z->load);
    free(z->runs);
    free(z->works);
    free(z->shadow);
    free(z->owner);
    free(z->names);
    free(z->data);
    free(z->grads);
    free(z->numel);
    free(z->dtype);
    free(z->chunks);
    free(z->submitted);
    free(z->arrived);
    free(z->gshard);
    free(z->gshard_mem);
    free(z->blocks);
    free(z->tail);
    free(z->zeros);
    free(z->stage_buf);
    free(z->own_grads);
    ddp__optim_setup_free(&z->setup);
    free(z);
}

/* Stage 1: largest first onto the least-loaded rank; ties go to the lower index and rank, so
 * every rank computes the same partition. */
static void greedy_partition(ddp_zero_t *z)
{
    size_t n = z->nparams;
    size_t *order = malloc((n ? n : 1) * sizeof *order);
    size_t *load = calloc((size_t)z->world, sizeof *load);
    if (!order || !load) {
        free(order);
        free(load);
        return; /* caller checks owner[] */
    }
    for (size_t i = 0; i < n; i++) order[i] = i;
    /* Insertion sort by bytes descending, stable (parameter lists are short). */
    for (size_t i = 1; i < n; i++) {
        size_t v = order[i], bv = z->numel[v] * ddp_dtype_size(z->dtype[v]);
        size_t j = i;
        while (j > 0 && z->numel[order[j - 1]] * ddp_dtype_size(z->dtype[order[j - 1]]) < bv) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
    for (size_t k = 0; k < n; k++) {
        size_t i = order[k];
        int best = 0;
        for (int r = 1; r < z->world; r++)
            if (load[r] < load[best]) best = r;
        z->owner[i] = best;
        load[best] += z->numel[i] * ddp_dtype_size(z->dtype[i]);
    }
    free(order);
    free(load);
}

static ddp_status_t check_config(const ddp_zero_config_t *c, int world)
{
    if (!c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config is NULL");
    if (c->stage != 1 && c->stage != 2)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config.stage is %d, expected "
                          "1 or 2", c->stage);
    if (c->overlap && c->stage != 1)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config.overlap needs stage 1 "
                          "(stage is %d)", c->stage);
    if (c->partition != DDP_ZERO_PARTITION_PARAMS && c->partition != DDP_ZERO_PARTITION_CHUNKS)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config.partition is %d, "
                          "expected DDP_ZERO_PARTITION_PARAMS (0) or _CHUNKS (1)",
                          (int)c->partition);
    if (c->overlap && c->partition == DDP_ZERO_PARTITION_CHUNKS)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config.overlap assigns whole "
                          "Reducer buckets; it cannot take DDP_ZERO_PARTITION_CHUNKS");
    (void)world;
    /* The overlap hook updates each bucket as soon as it is reduced, before the gradients of
     * later buckets exist, so there is no global norm to clip by at that point. */
    if (c->overlap && c->optim.max_grad_norm > 0.0)
        return ddp__error(DDP_ERR_UNSUPPORTED, "zero create: config.optim.max_grad_norm needs "
                          "the whole gradient before any update; overlap updates each bucket as "
                          "it is reduced (use stage 1 without overlap, or stage 2)");
    return ddp__optim_check_config(&c->optim, "zero create");
}

void ddp_zero_config_init(ddp_zero_config_t *config)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (!config) return;
    ddp_zero_config_t defaults = DDP_ZERO_CONFIG_INIT;
    *config = defaults;
}

ddp_status_t ddp_zero_create(ddp_group_t *group, const ddp_param_t *params, size_t nparams,
                             const ddp_zero_config_t *config, ddp_zero_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: out is NULL");
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: group is NULL");
    int world = ddp_group_size(group);
    ddp_status_t s = check_config(config, world);
    if (s != DDP_OK) return s;
    s = ddp__optim_check_params(params, nparams, "zero create");
    if (s != DDP_OK) return s;

    ddp_zero_t *z = ddp__calloc(1, sizeof *z, "zero");
    if (!z) return DDP_ERR_NO_MEMORY;
    z->group = group;
    z->rank = ddp_group_rank(group);
    z->world = world;
    z->stage = config->stage;
    z->overlap = config->overlap;
    z->chunked = z->stage == 2 || config->partition == DDP_ZERO_PARTITION_CHUNKS;
    z->grad_norm = NAN;
    z->nparams = nparams;
    s = ddp__optim_setup_init(&z->setup, &config->optim, nparams, "zero create");
    if (s != DDP_OK) {
        free(z);
        return s;
    }
    size_t n1 = nparams ? nparams : 1;
    z->data = ddp__calloc(n1, sizeof *z->data, "zero");
    z->grads = ddp__calloc(n1, sizeof *z->grads, "zero");
    z->numel = ddp__calloc(n1, sizeof *z->numel, "zero");
    z->dtype = ddp__calloc(n1, sizeof *z->dtype, "zero");
    z->names = ddp__calloc(n1, sizeof *z->names, "zero");
    z->owner = ddp__calloc(n1, sizeof *z->owner, "zero");
    z->runs = ddp__calloc(n1, sizeof *z->runs, "zero");
    z->works = ddp__calloc(n1, sizeof *z->works, "zero");
    z->load = ddp__calloc((size_t)world, sizeof *z->load, "zero");
    z->shadow = ddp__calloc(n1, sizeof *z->shadow, "zero");
    if (!z->data || !z->grads || !z->numel || !z->dtype || !z->names || !z->owner || !z->runs ||
        !z->works || !z->load || !z->shadow) {
        s = DDP_ERR_NO_MEMORY;
        goto fail;
    }
    for (size_t i = 0; i < nparams; i++) {
        z->data[i] = params[i].data;
        z->grads[i] = params[i].grad;
        z->numel[i] = params[i].numel;
        z->dtype[i] = params[i].dtype;
        z->owner[i] = -1;
        if (params[i].name) {
            z->names[i] = ddp__strdup(params[i].name, "zero parameter name");
            if (!z->names[i]) {
                s = DDP_ERR_NO_MEMORY;
                goto fail;
            }
        }
    }

    if (z->stage == 1 && !z->overlap && !z->chunked) {
        greedy_partition(z);
        for (size_t i = 0; i < nparams; i++) {
            if (z->owner[i] < 0) {
                s = ddp__error(DDP_ERR_NO_MEMORY, "zero create: out of memory partitioning");
                goto fail;
            }
            if (z->owner[i] != z->rank) continue;
            z->runs[i].count = z->numel[i];
            if (z->numel[i] == 0) continue;
            s = ddp__optim_run_alloc(&z->runs[i], ddp__optim_hp(&z->setup, i), z->dtype[i],
                                     z->data[i]);
            if (s != DDP_OK) goto fail;
        }
    } else if (z->chunked) {
        size_t max_chunk = 1, max_stage = 0;
        for (size_t i = 0; i < nparams; i++) {
            size_t c = chunk_of(z, i), es = ddp_dtype_size(z->dtype[i]);
            size_t first = (size_t)z->rank * c;
            z->runs[i].first = first;
            z->runs[i].count = first < z->numel[i] ? (z->numel[i] - first < c ? z->numel[i] - first
                                                                              : c)
                                                   : 0;
            if (c * es > max_chunk) max_chunk = c * es;
            if (z->numel[i] % (size_t)world != 0 && c * es * (size_t)world > max_stage)
                max_stage = c * es * (size_t)world;
            if (z->runs[i].count == 0) continue;
            s = ddp__optim_run_alloc(&z->runs[i], ddp__optim_hp(&z->setup, i), z->dtype[i],
                                     (unsigned char *)z->data[i] + first * es);
            if (s != DDP_OK) goto fail;
        }
        z->stage_buf = ddp__calloc(max_stage ? max_stage : 1, 1, "zero allgather staging");
        if (!z->stage_buf) {
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        if (z->stage == 1) { /* chunked stage 1: no reduce-scatter, only the allgathers */
            z->own_grads = ddp__calloc(n1, sizeof *z->own_grads, "zero");
            if (!z->own_grads) {
                s = DDP_ERR_NO_MEMORY;
                goto fail;
            }
            *out = z;
            return DDP_OK;
        }
        z->chunks = ddp__calloc(n1, sizeof *z->chunks, "zero");
        z->submitted = ddp__calloc(n1, 1, "zero");
        z->arrived = ddp__calloc(n1, 1, "zero");
        z->gshard = ddp__calloc(n1, sizeof *z->gshard, "zero");
        /* Each shard starts 8-byte aligned: parameters of different dtypes (an odd number of
         * bf16 elements before an f32 shard) would otherwise misalign the next. */
        size_t owned_bytes = 0;
        for (size_t i = 0; i < nparams; i++)
            owned_bytes += (z->runs[i].count * ddp_dtype_size(z->dtype[i]) + 7) & ~(size_t)7;
        z->gshard_mem = ddp__malloc(owned_bytes ? owned_bytes : 1, "zero gradient shard");
        if (!z->submitted || !z->arrived || !z->gshard || !z->gshard_mem) {
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        for (size_t i = 0, off = 0; i < nparams; i++) {
            z->gshard[i] = z->gshard_mem + off;
            off += (z->runs[i].count * ddp_dtype_size(z->dtype[i]) + 7) & ~(size_t)7;
        }
        z->blocks = ddp__calloc((size_t)world, sizeof *z->blocks, "zero");
        z->tail = ddp__calloc(max_chunk, 1, "zero padded chunk");
        z->zeros = ddp__calloc(max_chunk, 1, "zero padded chunk");
        if (!z->chunks || !z->blocks || !z->tail || !z->zeros) {
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        for (size_t i = 0; i < nparams; i++) z->chunks[i] = (zero_chunk_t){z, i};
        s = ddp_rs_bucketer_create(config->bucket_cap_bytes, &z->bucketer);
        if (s != DDP_OK) goto fail;
    }
    *out = z;
    return DDP_OK;
fail:
    ddp_zero_destroy(z);
    return s;
}

/* Waits for the works in z->works (every parameter's exchange), keeping the first failure. */
static ddp_status_t wait_works(ddp_zero_t *z, ddp_status_t first, const char *what)
{
    char text[DDP_ERROR_TEXT_MAX] = "";
    if (first != DDP_OK) snprintf(text, sizeof text, "%s", ddp_last_error());
    for (size_t i = 0; i < z->nparams; i++) {
        if (!z->works[i]) continue;
        ddp_status_t s = ddp_work_wait(z->works[i]);
        if (s != DDP_OK && first == DDP_OK) {
            first = s;
            snprintf(text, sizeof text, "zero step %llu: %s of parameter %zu (%s): %s",
                     (unsigned long long)z->steps, what, i, pname(z, i), ddp_last_error());
        }
        ddp_work_free(z->works[i]);
        z->works[i] = NULL;
    }
    if (first != DDP_OK) return ddp__error(first, "%s", text);
    return DDP_OK;
}

/* Stage 1 and overlap: every parameter from its owner, in place (overlap: the owner sends its
 * shadow copy, then takes the same bytes). */
static ddp_status_t broadcast_from_owners(ddp_zero_t *z)
{
    ddp_status_t first = DDP_OK;
    for (size_t i = 0; i < z->nparams && first == DDP_OK; i++) {
        if (z->numel[i] == 0) continue;
        void *buf = z->overlap && z->owner[i] == z->rank ? z->shadow[i] : z->data[i];
        first = ddp_group_broadcast_async(z->group, buf, z->numel[i], z->dtype[i], z->owner[i],
                                          &z->works[i]);
        if (first != DDP_OK)
            ddp__error_context(first, "zero step %llu: broadcast of parameter %zu (%s) from "
                               "rank %d", (unsigned long long)z->steps, i, pname(z, i),
                               z->owner[i]);
    }
    return wait_works(z, first, "broadcast");
}

/* A shard of parameter i's averaged gradient arrived (on the caller's thread, inside a bucketer
 * call): keep it until the step. Backward may still be reading the parameter, so the update
 * itself waits for ddp_zero_step. */
static void chunk_reduced(void *arg, const void *shard, size_t count)
{
    zero_chunk_t *c = arg;
    ddp_zero_t *z = c->zero;
    size_t i = c->param;
    (void)count;
    if (z->runs[i].count)
        memcpy(z->gshard[i], shard, z->runs[i].count * ddp_dtype_size(z->dtype[i]));
    z->arrived[i] = 1;
}

/* Stage 2: hands parameter i's local gradient to the bucketer (AVG reduce-scatter of its
 * world_size chunks, the last zero-padded). */
static ddp_status_t stage2_submit(ddp_zero_t *z, size_t i, const void *grad)
{
    size_t world = (size_t)z->world;
    size_t n = z->numel[i], c = chunk_of(z, i), es = ddp_dtype_size(z->dtype[i]);
    ddp_status_t s;
    z->submitted[i] = 1;
    if (n == 0) {
        z->arrived[i] = 1;
        return DDP_OK;
    }
    if (n % world == 0) {
        s = ddp_rs_bucketer_reduce_scatter_async(z->bucketer, z->group, grad, c, z->dtype[i],
                                                 DDP_AVG, chunk_reduced, &z->chunks[i]);
    } else {
        const unsigned char *g = grad;
        for (size_t r = 0; r < world; r++) {
            size_t lo = r * c;
            if (lo + c <= n) {
                z->blocks[r] = g + lo * es;
            } else if (lo < n) {
                memcpy(z->tail, g + lo * es, (n - lo) * es);
                memset(z->tail + (n - lo) * es, 0, (lo + c - n) * es);
                z->blocks[r] = z->tail;
            } else {
                z->blocks[r] = z->zeros;
            }
        }
        s = ddp_rs_bucketer_reduce_scatter_blocks_async(z->bucketer, z->group, z->blocks, c,
                                                        z->dtype[i], DDP_AVG, chunk_reduced,
                                                        &z->chunks[i]);
    }
    if (s != DDP_OK)
        ddp__error_context(s, "zero step %llu: reduce-scatter of parameter %zu (%s)",
                           (unsigned long long)z->steps, i, pname(z, i));
    return s;
}

ddp_status_t ddp_zero_grad_ready(ddp_zero_t *z, size_t index, const void *grad)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero grad ready: zero is NULL");
    if (z->stage != 2)
        return ddp__error(DDP_ERR_INVALID_USAGE, "zero grad ready: only stage 2 reduces "
                          "gradients itself (this optimizer is stage %d)", z->stage);
    if (index >= z->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero grad ready: index %zu out of range "
                          "(%zu parameters)", index, z->nparams);
    if (!grad && z->numel[index] > 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero grad ready: grad of parameter %zu (%s) "
                          "is NULL", index, pname(z, index));
    if (z->submitted[index])
        return ddp__error(DDP_ERR_INVALID_USAGE, "zero grad ready: parameter %zu (%s) was "
                          "already marked ready in step %llu", index, pname(z, index),
                          (unsigned long long)z->steps);
    return stage2_submit(z, index, grad);
}

/* With max_grad_norm: the global norm from this rank's share (grads[i] holds run i's
 * gradient elements; runs of count 0 are skipped) and one allreduce of the partial sums of
 * squares, so every rank gets the same norm and coefficient. */
static ddp_status_t clip_coefficient(ddp_zero_t *z, const void *const *grads, double *coef)
{
    *coef = 1.0;
    if (!(z->setup.base.max_grad_norm > 0.0)) return DDP_OK;
    double sumsq = 0.0;
    for (size_t i = 0; i < z->nparams; i++)
        if (z->runs[i].count > 0 && (z->chunked || z->owner[i] == z->rank))
            sumsq += ddp__optim_grad_sumsq(z->dtype[i], grads[i], z->runs[i].count);
    ddp_status_t s = ddp_group_allreduce(z->group, &sumsq, &sumsq, 1, DDP_F64, DDP_SUM);
    if (s != DDP_OK)
        return ddp__error_context(s, "zero step %llu: allreduce of the gradient norm",
                                  (unsigned long long)z->steps);
    z->grad_norm = sqrt(sumsq);
    *coef = ddp__optim_clip_coef(z->grad_norm, z->setup.base.max_grad_norm);
    return DDP_OK;
}

static ddp_status_t allgather_chunks(ddp_zero_t *z);

static ddp_status_t stage2_step(ddp_zero_t *z, void *const *grads)
{
    ddp_status_t s = DDP_OK;
    /* Whatever was not marked ready yet goes now, in index order. */
    for (size_t i = 0; i < z->nparams && s == DDP_OK; i++)
        if (!z->submitted[i]) s = stage2_submit(z, i, grads ? grads[i] : NULL);
    /* The flush clears the error text on entry: keep a failed submission's text. */
    char text[DDP_ERROR_TEXT_MAX] = "";
    if (s != DDP_OK) snprintf(text, sizeof text, "%s", ddp_last_error());
    ddp_status_t f = ddp_rs_bucketer_flush(z->bucketer);
    for (size_t i = 0; i < z->nparams; i++) z->submitted[i] = 0;
    if (s != DDP_OK) return ddp__error(s, "%s", text);
    if (f != DDP_OK)
        return ddp__error_context(f, "zero step %llu: gradient reduce-scatter",
                                  (unsigned long long)z->steps);
    for (size_t i = 0; i < z->nparams; i++) {
        if (!z->arrived[i])
            return ddp__error(DDP_ERR_INVALID_USAGE, "zero step %llu: no reduced gradient "
                              "arrived for parameter %zu (%s)", (unsigned long long)z->steps, i,
                              pname(z, i));
        z->arrived[i] = 0;
    }
    /* The norm of the averaged gradient: each rank holds disjoint shards of it. */
    double coef = 1.0;
    s = clip_coefficient(z, (const void *const *)z->gshard, &coef);
    if (s != DDP_OK) return s;
    /* Each rank updates its chunk of every parameter from its shard of the average. */
    for (size_t i = 0; i < z->nparams; i++) {
        ddp__optim_run_t *run = &z->runs[i];
        unsigned char *p = (unsigned char *)z->data[i] + run->first * ddp_dtype_size(z->dtype[i]);
        ddp__optim_run_update_to(run, ddp__optim_hp(&z->setup, i), z->dtype[i], p, p,
                                 z->gshard[i], coef);
    }

    return allgather_chunks(z);
}

/* Stage 2 and chunked stage 1: every parameter reassembled from the ranks' chunks, in place when
 * the chunks tile the parameter exactly, else through staging. */
static ddp_status_t allgather_chunks(ddp_zero_t *z)
{
    size_t world = (size_t)z->world;
    ddp_status_t first = DDP_OK;
    for (size_t i = 0; i < z->nparams && first == DDP_OK; i++) {
        size_t n = z->numel[i], c = chunk_of(z, i), es = ddp_dtype_size(z->dtype[i]);
        if (n == 0) continue;
        unsigned char *d = z->data[i];
        size_t mine = (size_t)z->rank * c;
        if (n % world == 0) {
            first = ddp_group_allgather_async(z->group, d + mine * es, d, c, z->dtype[i],
                                              &z->works[i]);
        } else {
            unsigned char *own = z->stage_buf + mine * es;
            size_t valid = z->runs[i].count;
            if (valid) memcpy(own, d + mine * es, valid * es);
            memset(own + valid * es, 0, (c - valid) * es);
            first = ddp_group_allgather(z->group, own, z->stage_buf, c, z->dtype[i]);
            if (first == DDP_OK) memcpy(d, z->stage_buf, n * es);
        }
        if (first != DDP_OK)
            ddp__error_context(first, "zero step %llu: allgather of parameter %zu (%s)",
                               (unsigned long long)z->steps, i, pname(z, i));
    }
    return wait_works(z, first, "allgather");
}

ddp_status_t ddp_zero_step(ddp_zero_t *z, void *const *grads)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero step: zero is NULL");
    ddp_status_t s;
    if (z->overlap) {
        if (grads)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero step: grads must be NULL in "
                              "overlap mode (ddp_zero_hook already applied the update)");
        for (size_t i = 0; i < z->nparams; i++)
            if (z->owner[i] < 0)
                return ddp__error(DDP_ERR_INVALID_USAGE,
                                  "zero step %llu: parameter %zu (%s) was in no bucket "
                                  "ddp_zero_hook has seen; install the hook on the Reducer and "
                                  "call ddp_reducer_finalize before the step",
                                  (unsigned long long)z->steps, i, pname(z, i));
        /* Every bucket must have been updated since the last step, or stale copies would be
         * installed (e.g. a step after a no_sync iteration, where the hook does not run). */
        for (size_t b = 0; b < z->nbuckets; b++)
            if (z->buckets[b] && !z->buckets[b]->reduced)
                return ddp__error(DDP_ERR_INVALID_USAGE,
                                  "zero step %llu: bucket %zu was not reduced since the last "
                                  "step (a no_sync iteration?); in overlap mode step only after "
                                  "a synchronised iteration's finalize",
                                  (unsigned long long)z->steps, b);
        for (size_t b = 0; b < z->nbuckets; b++)
            if (z->buckets[b]) z->buckets[b]->reduced = 0;
        s = broadcast_from_owners(z);
        if (s == DDP_OK)
            for (size_t i = 0; i < z->nparams; i++)
                if (z->owner[i] == z->rank && z->numel[i] > 0)
                    memcpy(z->data[i], z->shadow[i], z->numel[i] * ddp_dtype_size(z->dtype[i]));
    } else if (z->stage == 2) {
        /* Gradients not handed over by ddp_zero_grad_ready come from grads, or with grads NULL
         * from each parameter's .grad as given at create. */
        int own = grads == NULL;
        if (own) grads = z->grads;
        for (size_t i = 0; i < z->nparams; i++)
            if (!z->submitted[i] && z->numel[i] > 0 && !grads[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "zero step: parameter %zu (%s) was not marked ready and %s is "
                                  "NULL", i, pname(z, i),
                                  own ? "grads is NULL and its .grad at ddp_zero_create"
                                      : "its grads[] entry");
        s = stage2_step(z, grads);
    } else {
        int own = grads == NULL;
        if (own) grads = z->grads; /* each parameter's .grad as given at create */
        for (size_t i = 0; i < z->nparams; i++)
            if (z->numel[i] > 0 && !grads[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  own ? "zero step: grads is NULL and parameter %zu (%s) had no "
                                        ".grad at ddp_zero_create (give grads, or set every "
                                        "ddp_param_t.grad)"
                                      : "zero step: grads[%zu] (parameter %s) is NULL",
                                  i, pname(z, i));
        /* The norm over the owned parameters' (chunks') averaged gradients, summed over ranks:
         * every element is owned by exactly one rank. */
        double coef = 1.0;
        if (z->chunked) {
            for (size_t i = 0; i < z->nparams; i++)
                z->own_grads[i] = z->runs[i].count == 0
                                      ? NULL
                                      : (const unsigned char *)grads[i] +
                                            z->runs[i].first * ddp_dtype_size(z->dtype[i]);
            s = clip_coefficient(z, z->own_grads, &coef);
            if (s != DDP_OK) return s;
            for (size_t i = 0; i < z->nparams; i++) {
                if (z->runs[i].count == 0) continue;
                unsigned char *p = (unsigned char *)z->data[i] +
                                   z->runs[i].first * ddp_dtype_size(z->dtype[i]);
                ddp__optim_run_update_to(&z->runs[i], ddp__optim_hp(&z->setup, i), z->dtype[i],
                                         p, p, z->own_grads[i], coef);
            }
            s = allgather_chunks(z);
        } else {
            s = clip_coefficient(z, (const void *const *)grads, &coef);
            if (s != DDP_OK) return s;
            for (size_t i = 0; i < z->nparams; i++)
                if (z->owner[i] == z->rank)
                    ddp__optim_run_update_to(&z->runs[i], ddp__optim_hp(&z->setup, i),
                                             z->dtype[i], z->data[i], z->data[i], grads[i], coef);
            s = broadcast_from_owners(z);
        }
    }
    if (s == DDP_OK) z->steps++;
    return s;
}

/* ---- overlap ------------------------------------------------------------------------------ */

/* On the progress thread: average the bucket, then (on its owner) compute its parameters' new
 * values into their shadow copies: the caller's backward may still be reading the parameters
 * (a layer's weights are needed for its input gradient after its weight gradient is ready), so
 * they change only in ddp_zero_step, after finalize. */
static ddp_status_t overlap_task(ddp_group_t *group, void *arg)
{
    zero_bucket_t *zb = arg;
    ddp_zero_t *z = zb->zero;
    ddp_status_t s = ddp_group_allreduce(group, zb->data, zb->data, zb->numel, zb->dtype,
                                         zb->prescaled ? DDP_SUM : DDP_AVG);
    if (s != DDP_OK) return s;
    if (zb->owner != z->rank) return DDP_OK;
    size_t es = ddp_dtype_size(zb->dtype);
    for (size_t j = 0; j < zb->nparams; j++) {
        size_t p = zb->params[j];
        ddp__optim_run_update_to(&z->runs[p], ddp__optim_hp(&z->setup, p), z->dtype[p],
                                 z->data[p], z->shadow[p],
                                 (const unsigned char *)zb->data + zb->offsets[j] * es, 1.0);
    }
    return DDP_OK;
}

static int same_layout(const zero_bucket_t *zb, const ddp_comm_bucket_t *b)
{
    if (zb->nparams != b->nparams) return 0;
    for (size_t j = 0; j < b->nparams; j++)
        if (zb->params[j] != b->params[j] || zb->offsets[j] != b->offsets[j]) return 0;
    return 1;
}

/* First sight of bucket b: checks it against the parameters, assigns it to the least-loaded
 * rank and allocates state for its parameters on that rank. */
static ddp_status_t learn_bucket(ddp_zero_t *z, const ddp_comm_bucket_t *b, zero_bucket_t **out)
{
    for (size_t j = 0; j < b->nparams; j++) {
        size_t p = b->params[j];
        if (p >= z->nparams)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "zero hook: bucket %zu holds parameter %zu but the ZeRO "
                              "optimizer has %zu (create it with the Reducer's parameters)",
                              b->index, p, z->nparams);
        if (b->numels[j] != z->numel[p] || b->dtype != z->dtype[p])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "zero hook: bucket %zu: parameter %zu (%s) has %zu %s elements in "
                              "the Reducer but %zu %s in the ZeRO optimizer",
                              b->index, p, pname(z, p), b->numels[j], ddp_dtype_name(b->dtype),
                              z->numel[p], ddp_dtype_name(z->dtype[p]));
        if (z->owner[p] >= 0)
            return ddp__error(DDP_ERR_INVALID_USAGE,
                              "zero hook: bucket %zu: parameter %zu (%s) was already in another "
                              "bucket; the Reducer's bucket layout changed (create it with "
                              "rebuild_buckets = 0 for ZeRO overlap)",
                              b->index, p, pname(z, p));
    }
    if (b->index >= z->nbuckets) {
        size_t n = b->index + 1;
        zero_bucket_t **grown = realloc(z->buckets, n * sizeof *grown);
        if (!grown) return ddp__error(DDP_ERR_NO_MEMORY, "zero hook: out of memory");
        for (size_t i = z->nbuckets; i < n; i++) grown[i] = NULL;
        z->buckets = grown;
        z->nbuckets = n;
    }
    zero_bucket_t *zb = ddp__calloc(1, sizeof *zb, "zero bucket");
    if (!zb) return DDP_ERR_NO_MEMORY;
    size_t np = b->nparams ? b->nparams : 1;
    zb->params = ddp__malloc(np * sizeof *zb->params, "zero bucket");
    zb->offsets = ddp__malloc(np * sizeof *zb->offsets, "zero bucket");
    if (!zb->params || !zb->offsets) {
        free(zb->params);
        free(zb->offsets);
        free(zb);
        return DDP_ERR_NO_MEMORY;
    }
    zb->zero = z;
    zb->index = b->index;
    zb->nparams = b->nparams;
    memcpy(zb->params, b->params, b->nparams * sizeof *zb->params);
    memcpy(zb->offsets, b->offsets, b->nparams * sizeof *zb->offsets);
    int best = 0;
    for (int r = 1; r < z->world; r++)
        if (z->load[r] < z->load[best]) best = r;
    zb->owner = best;
    z->load[best] += b->numel * ddp_dtype_size(b->dtype);
    z->buckets[b->index] = zb;
    for (size_t j = 0; j < b->nparams; j++) {
        size_t p = b->params[j];
        z->owner[p] = best;
        if (best != z->rank) continue;
        z->runs[p].count = z->numel[p];
        if (z->numel[p] == 0) continue;
        ddp_status_t s = ddp__optim_run_alloc(&z->runs[p], ddp__optim_hp(&z->setup, p),
                                              z->dtype[p], z->data[p]);
        if (s != DDP_OK) return s;
        z->shadow[p] = ddp__malloc(z->numel[p] * ddp_dtype_size(z->dtype[p]), "zero shadow");
        if (!z->shadow[p]) return DDP_ERR_NO_MEMORY;
    }
    *out = zb;
    return DDP_OK;
}

ddp_status_t ddp_zero_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                           ddp_work_t **work)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    ddp_zero_t *z = state;
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: state is NULL (pass the "
                              "ddp_zero_t as comm_hook_state)");
    if (!z->overlap)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: the ZeRO optimizer was created "
                          "without config.overlap");
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: group is NULL");
    if (group != z->group)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: the Reducer's group is not the "
                          "ZeRO optimizer's group");
    if (!bucket) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: bucket is NULL");
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: work is NULL");
    if (bucket->numel > 0 && !bucket->data)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero hook: bucket %zu has %zu elements but "
                          "no data", bucket->index, bucket->numel);
    zero_bucket_t *zb = bucket->index < z->nbuckets ? z->buckets[bucket->index] : NULL;
    ddp_status_t s;
    if (!zb) {
        s = learn_bucket(z, bucket, &zb);
        if (s != DDP_OK) return s;
    } else if (!same_layout(zb, bucket)) {
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "zero hook: bucket %zu changed its parameters since the optimizer "
                          "assigned it to rank %d (the Reducer rebuilt its buckets); create "
                          "the Reducer with rebuild_buckets = 0 for ZeRO overlap",
                          bucket->index, zb->owner);
    }
    zb->data = bucket->data;
    zb->numel = bucket->numel;
    zb->dtype = bucket->dtype;
    zb->prescaled = bucket->prescaled;
    s = ddp_group_submit(group, overlap_task, zb, work);
    if (s == DDP_OK) zb->reduced = 1;
    return s;
}

/* ---- queries ------------------------------------------------------------------------------ */

size_t ddp_zero_state_bytes(const ddp_zero_t *z)
{
    if (!z) return 0;
    size_t bytes = 0;
    for (size_t i = 0; i < z->nparams; i++)
        bytes += ddp__optim_run_bytes(&z->runs[i], &z->setup.base, z->dtype[i]);
    return bytes;
}

size_t ddp_zero_owned_numel(const ddp_zero_t *z)
{
    if (!z) return 0;
    size_t n = 0;
    for (size_t i = 0; i < z->nparams; i++) n += z->runs[i].count;
    return n;
}

ddp_status_t ddp_zero_param_owner(const ddp_zero_t *z, size_t index, int *rank)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero param owner: zero is NULL");
    if (!rank) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero param owner: rank is NULL");
    if (index >= z->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero param owner: index %zu out of range "
                          "(%zu parameters)", index, z->nparams);
    *rank = z->chunked ? -1 : z->owner[index];
    return DDP_OK;
}

ddp_status_t ddp_zero_grad_norm(const ddp_zero_t *z, double *norm)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero grad norm: zero is NULL");
    if (!norm) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero grad norm: norm is NULL");
    *norm = z->grad_norm;
    return DDP_OK;
}

/* ---- learning rates ------------------------------------------------------------------------ */

ddp_status_t ddp_zero_set_lr(ddp_zero_t *z, size_t group, double lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero set lr: zero is NULL");
    return ddp__optim_set_lr(&z->setup, group, lr, "zero set lr");
}

ddp_status_t ddp_zero_scale_lr(ddp_zero_t *z, double factor)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero scale lr: zero is NULL");
    return ddp__optim_scale_lr(&z->setup, factor, "zero scale lr");
}

ddp_status_t ddp_zero_get_lr(const ddp_zero_t *z, size_t group, double *lr)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero get lr: zero is NULL");
    return ddp__optim_get_lr(&z->setup, group, lr, "zero get lr");
}

/* ---- saved state ----------------------------------------------------------------------------
 * A shard is this rank's runs in the optimizer state format (optim.c); consolidation gathers
 * every shard everywhere and merges them on the root into whole parameters. */

static ddp__optim_view_t shard_view(const ddp_zero_t *z)
{
    return (ddp__optim_view_t){&z->setup, z->nparams, z->numel, z->dtype, z->runs,
                               (uint32_t)z->world, (uint32_t)z->rank};
}

/* Overlap mode learns the partition in the first step; before that the shard is not defined. */
static ddp_status_t check_partition_known(const ddp_zero_t *z, const char *who)
{
    for (size_t i = 0; i < z->nparams; i++)
        if (z->stage == 1 && !z->chunked && z->owner[i] < 0)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s: parameter %zu (%s) has no owner yet "
                              "(overlap mode assigns buckets in the first step)", who, i,
                              pname(z, i));
    return DDP_OK;
}

ddp_status_t ddp_zero_state_size(const ddp_zero_t *z, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state size: zero is NULL");
    if (!bytes) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state size: bytes is NULL");
    ddp_status_t s = check_partition_known(z, "zero state size");
    if (s != DDP_OK) return s;
    ddp__optim_view_t v = shard_view(z);
    *bytes = ddp__optim_state_size(&v);
    return DDP_OK;
}

ddp_status_t ddp_zero_state_save(const ddp_zero_t *z, void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state save: zero is NULL");
    ddp_status_t s = check_partition_known(z, "zero state save");
    if (s != DDP_OK) return s;
    ddp__optim_view_t v = shard_view(z);
    return ddp__optim_state_write(&v, buf, size, "zero state save");
}

ddp_status_t ddp_zero_state_load(ddp_zero_t *z, const void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state load: zero is NULL");
    if (z->overlap)
        return ddp__error(DDP_ERR_UNSUPPORTED, "zero state load: overlap mode learns which rank "
                          "owns which bucket during the first step, after which loading is too "
                          "late; resume with stage 1 without overlap or stage 2");
    ddp__optim_view_t v = shard_view(z);
    return ddp__optim_state_read(&v, &z->setup, z->runs, buf, size, "zero state load");
}

/* The whole-parameter view: runs of numel elements (no arrays: only sizes are read). */
static ddp__optim_run_t *whole_runs(const ddp_zero_t *z)
{
    ddp__optim_run_t *runs = ddp__calloc(z->nparams ? z->nparams : 1, sizeof *runs,
                                         "zero consolidated state");
    if (runs)
        for (size_t i = 0; i < z->nparams; i++) runs[i].count = z->numel[i];
    return runs;
}

ddp_status_t ddp_zero_consolidated_state_size(const ddp_zero_t *z, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero consolidated state size: zero is "
                              "NULL");
    if (!bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero consolidated state size: bytes is "
                          "NULL");
    ddp__optim_run_t *runs = whole_runs(z);
    if (!runs) return DDP_ERR_NO_MEMORY;
    ddp__optim_view_t v = {&z->setup, z->nparams, z->numel, z->dtype, runs, 1, 0};
    *bytes = ddp__optim_state_size(&v);
    free(runs);
    return DDP_OK;
}

ddp_status_t ddp_zero_state_consolidate(ddp_zero_t *z, int root, void *buf, size_t size)
{
    const char *who = "zero state consolidate";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: zero is NULL", who);
    if (root < 0 || root >= z->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: root is %d, expected 0..%d", who, root,
                          z->world - 1);
    ddp_status_t s = check_partition_known(z, who);
    if (s != DDP_OK) return s;
    ddp__optim_view_t mine = shard_view(z);
    ddp__optim_run_t *runs = whole_runs(z);
    if (!runs) return DDP_ERR_NO_MEMORY;
    ddp__optim_view_t whole = {&z->setup, z->nparams, z->numel, z->dtype, runs, 1, 0};
    s = ddp__optim_state_consolidate(z->group, &mine, &whole, root, buf, size, who,
                                     "ddp_zero_consolidated_state_size");
    free(runs);
    return s;
}
