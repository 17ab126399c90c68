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
#include <stdlib.h>

#include "core/internal.h"
#include "shard/zero_internal.h"

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
    free(z->fused_send);
    free(z->ready);
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
    if (c->fused && c->stage != 2)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero create: config.fused needs stage 2 "
                          "(stage is %d)", c->stage);
    if (c->fused && c->optim.max_grad_norm > 0.0)
        return ddp__error(DDP_ERR_UNSUPPORTED, "zero create: config.optim.max_grad_norm needs "
                          "the whole gradient's norm before any update; config.fused updates "
                          "each chunk as it is reduced (use stage 2 without fused)");
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

/* Keeps each parameter's pointers, size, dtype and name, and allocates the per-parameter arrays
 * (every parameter's owner unknown yet). */
static ddp_status_t keep_params(ddp_zero_t *z, const ddp_param_t *params)
{
    size_t nparams = z->nparams, n1 = nparams ? nparams : 1;
    z->data = ddp__calloc(n1, sizeof *z->data, "zero");
    z->grads = ddp__calloc(n1, sizeof *z->grads, "zero");
    z->numel = ddp__calloc(n1, sizeof *z->numel, "zero");
    z->dtype = ddp__calloc(n1, sizeof *z->dtype, "zero");
    z->names = ddp__calloc(n1, sizeof *z->names, "zero");
    z->owner = ddp__calloc(n1, sizeof *z->owner, "zero");
    z->runs = ddp__calloc(n1, sizeof *z->runs, "zero");
    z->works = ddp__calloc(n1, sizeof *z->works, "zero");
    z->load = ddp__calloc((size_t)z->world, sizeof *z->load, "zero");
    z->shadow = ddp__calloc(n1, sizeof *z->shadow, "zero");
    if (!z->data || !z->grads || !z->numel || !z->dtype || !z->names || !z->owner || !z->runs ||
        !z->works || !z->load || !z->shadow)
        return DDP_ERR_NO_MEMORY;
    for (size_t i = 0; i < nparams; i++) {
        z->data[i] = params[i].data;
        z->grads[i] = params[i].grad;
        z->numel[i] = params[i].numel;
        z->dtype[i] = params[i].dtype;
        z->owner[i] = -1;
        if (params[i].name) {
            z->names[i] = ddp__strdup(params[i].name, "zero parameter name");
            if (!z->names[i]) return DDP_ERR_NO_MEMORY;
        }
    }
    return DDP_OK;
}

/* Stage 1 with whole parameters: the greedy partition, and state for the parameters this rank
 * owns. */
static ddp_status_t own_whole_params(ddp_zero_t *z)
{
    greedy_partition(z);
    for (size_t i = 0; i < z->nparams; i++) {
        if (z->owner[i] < 0)
            return ddp__error(DDP_ERR_NO_MEMORY, "zero create: out of memory partitioning");
        if (z->owner[i] != z->rank) continue;
        z->runs[i].count = z->numel[i];
        if (z->numel[i] == 0) continue;
        ddp_status_t s = ddp__optim_run_alloc(&z->runs[i], ddp__optim_hp(&z->setup, i),
                                              z->dtype[i], z->data[i]);
        if (s != DDP_OK) return s;
    }
    return DDP_OK;
}

/* Stage 2: the reduce-scatter's buffers (each parameter's callback context, this rank's shard of
 * every averaged gradient, the padded chunks) and the bucketer. max_chunk: bytes of the largest
 * chunk. */
static ddp_status_t stage2_buffers(ddp_zero_t *z, size_t max_chunk, size_t bucket_cap_bytes)
{
    size_t nparams = z->nparams, n1 = nparams ? nparams : 1;
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
    if (!z->submitted || !z->arrived || !z->gshard || !z->gshard_mem) return DDP_ERR_NO_MEMORY;
    for (size_t i = 0, off = 0; i < nparams; i++) {
        z->gshard[i] = z->gshard_mem + off;
        off += (z->runs[i].count * ddp_dtype_size(z->dtype[i]) + 7) & ~(size_t)7;
    }
    z->blocks = ddp__calloc((size_t)z->world, sizeof *z->blocks, "zero");
    z->tail = ddp__calloc(max_chunk, 1, "zero padded chunk");
    z->zeros = ddp__calloc(max_chunk, 1, "zero padded chunk");
    if (!z->chunks || !z->blocks || !z->tail || !z->zeros) return DDP_ERR_NO_MEMORY;
    for (size_t i = 0; i < nparams; i++) z->chunks[i] = (zero_chunk_t){z, i, NULL};
    return ddp_rs_bucketer_create(bucket_cap_bytes, &z->bucketer);
}

/* Chunked (stage 2, or stage 1 with chunks): this rank's chunk of every parameter and its state,
 * the allgather's staging buffer, and the buffers of chunked stage 1 or of stage 2. */
static ddp_status_t own_chunks(ddp_zero_t *z, size_t bucket_cap_bytes)
{
    size_t nparams = z->nparams, n1 = nparams ? nparams : 1, world = (size_t)z->world;
    size_t max_chunk = 1, max_stage = 0;
    for (size_t i = 0; i < nparams; i++) {
        size_t c = chunk_of(z, i), es = ddp_dtype_size(z->dtype[i]);
        size_t first = (size_t)z->rank * c;
        z->runs[i].first = first;
        z->runs[i].count = first < z->numel[i] ? (z->numel[i] - first < c ? z->numel[i] - first
                                                                          : c)
                                               : 0;
        if (c * es > max_chunk) max_chunk = c * es;
        if (z->numel[i] % world != 0 && c * es * world > max_stage) max_stage = c * es * world;
        if (z->runs[i].count == 0) continue;
        unsigned char *run_data = (unsigned char *)z->data[i] + first * es;
        ddp_status_t s = ddp__optim_run_alloc(&z->runs[i], ddp__optim_hp(&z->setup, i),
                                              z->dtype[i], run_data);
        if (s != DDP_OK) return s;
    }
    z->stage_buf = ddp__calloc(max_stage ? max_stage : 1, 1, "zero allgather staging");
    if (!z->stage_buf) return DDP_ERR_NO_MEMORY;
    if (z->fused) { /* the padded gradient of a parameter world does not divide */
        z->fused_send = ddp__calloc(max_stage ? max_stage : 1, 1, "zero padded gradient");
        z->ready = ddp__calloc(n1, sizeof *z->ready, "zero");
        if (!z->fused_send || !z->ready) return DDP_ERR_NO_MEMORY;
    }
    if (z->stage == 1) { /* chunked stage 1: no reduce-scatter, only the allgathers */
        z->own_grads = ddp__calloc(n1, sizeof *z->own_grads, "zero");
        return z->own_grads ? DDP_OK : DDP_ERR_NO_MEMORY;
    }
    return stage2_buffers(z, max_chunk, bucket_cap_bytes);
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
    z->fused = config->fused;
    z->chunked = z->stage == 2 || config->partition == DDP_ZERO_PARTITION_CHUNKS;
    z->grad_norm = NAN;
    z->nparams = nparams;
    s = ddp__optim_setup_init(&z->setup, &config->optim, nparams, "zero create");
    if (s != DDP_OK) {
        free(z);
        return s;
    }
    s = keep_params(z, params);
    if (s != DDP_OK) goto fail;
    if (z->stage == 1 && !z->overlap && !z->chunked) s = own_whole_params(z);
    else if (z->chunked) s = own_chunks(z, config->bucket_cap_bytes);
    if (s != DDP_OK) goto fail;
    *out = z;
    return DDP_OK;
fail:
    ddp_zero_destroy(z);
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
