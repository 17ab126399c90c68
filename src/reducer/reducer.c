/* The Reducer: c10d's gradient bucketing and overlapped averaging, driven by the caller's
 * backward pass through ddp_reducer_grad_ready. This file creates and destroys it and answers
 * queries; reducer_internal.h lists the files that do the rest.
 *
 * Life of an iteration. prepare resets the marks (and rebuilds the buckets once, after the first
 * synchronised iteration, in the order rank 0 saw gradients arrive). Each grad_ready marks one
 * parameter; when the last parameter of a bucket is marked, the bucket is divided by the world size
 * and handed to the comm hook, but only in bucket order: a bucket that is ready early waits for
 * the ones before it, and launching resumes as soon as they are ready, so every rank issues the
 * same collectives in the same order. finalize marks whatever was not marked (zeros, or an error
 * without find_unused_parameters), launches the rest, waits, and then every rank allreduces one
 * small status vector: per-parameter "used" flags (for find_unused) and per-rank error codes.
 * That last step is what makes a usage error on one rank (a parameter never marked, one marked
 * twice) fail every rank together instead of leaving the others waiting in a collective.
 *
 * Gradients live in the bucket memory itself (a view into a buffer from ddp_group_alloc_buffer,
 * which the shm transport reduces without a copy); with user_grads they are copied in at
 * grad_ready and out at finalize; in the block modes (config.grad_memory) they live in one block,
 * the caller's or libddp's, whose contiguous runs are the buckets, and never move. Sparse parameters get a bucket of their own, reduced on the
 * progress thread by allgathering row counts, indices and rows. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* What DDP_BUCKET_LAYOUT_DEFAULT stands for. A build may override it (-D) so that a program which
 * leaves the field at its default, such as the trainer, can be measured with either rule. */
#ifndef DDP__DEFAULT_BUCKET_LAYOUT
#define DDP__DEFAULT_BUCKET_LAYOUT DDP_BUCKET_LAYOUT_LAST_FIRST
#endif

static int is_float(ddp_dtype_t d)
{
    return d == DDP_F32 || d == DDP_F64 || d == DDP_F16 || d == DDP_BF16;
}

/* DDP_GRAD_MEMORY_USER_BLOCK: param.grad must hold the whole gradient inside the block, aligned
 * to its dtype (overlaps between parameters are checked after deduplication). */
static ddp_status_t check_block_grad(const ddp_param_t *p, size_t i, const ddp_reducer_config_t *c)
{
    if (p->sparse) {
        if (p->grad)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]) is sparse but its grad is set: sparse "
                              "gradients are not in the gradient block (give their rows with "
                              "ddp_reducer_sparse_grad and leave grad NULL)",
                              p->name, i);
        return DDP_OK;
    }
    if (p->numel == 0) return DDP_OK; /* nothing to place */
    if (!p->grad)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "parameter '%s' (params[%zu]): grad is NULL, but with "
                          "DDP_GRAD_MEMORY_USER_BLOCK every dense parameter's grad points into "
                          "config->grad_block",
                          p->name, i);
    uintptr_t g = (uintptr_t)p->grad, b = (uintptr_t)c->grad_block;
    size_t esize = ddp_dtype_size(p->dtype), bytes = p->numel * esize;
    if (g < b || g - b >= c->grad_block_bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "parameter '%s' (params[%zu]): grad %p is outside the gradient block "
                          "[%p, %p + %zu bytes)",
                          p->name, i, p->grad, c->grad_block, c->grad_block, c->grad_block_bytes);
    size_t off = (size_t)(g - b);
    if (off % esize != 0 || g % esize != 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "parameter '%s' (params[%zu]): grad at byte %zu of the block (address "
                          "%p) is misaligned for %s (%zu-byte elements)",
                          p->name, i, off, p->grad, ddp_dtype_name(p->dtype), esize);
    if (bytes > c->grad_block_bytes - off)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "parameter '%s' (params[%zu]): its gradient (%zu bytes at byte %zu) ends "
                          "past the gradient block of %zu bytes: the block is too small",
                          p->name, i, bytes, off, c->grad_block_bytes);
    return DDP_OK;
}

static int compare_block_offset(const void *a, const void *b)
{
    const rparam_t *x = *(const rparam_t *const *)a, *y = *(const rparam_t *const *)b;
    return x->block_offset < y->block_offset ? -1 : x->block_offset > y->block_offset ? 1 : 0;
}

/* DDP_GRAD_MEMORY_USER_BLOCK: no two kept gradients may share a byte of the block. */
static ddp_status_t check_block_overlaps(ddp_reducer_t *r)
{
    rparam_t **sorted = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof *sorted, "reducer");
    if (!sorted) return DDP_ERR_NO_MEMORY;
    size_t n = 0;
    for (size_t k = 0; k < r->nparams; k++)
        if (!r->params[k].sparse && r->params[k].numel > 0) sorted[n++] = &r->params[k];
    qsort(sorted, n, sizeof *sorted, compare_block_offset);
    ddp_status_t status = DDP_OK;
    for (size_t i = 1; i < n && status == DDP_OK; i++) {
        const rparam_t *a = sorted[i - 1], *b = sorted[i];
        if (a->block_offset + param_bytes(a) > b->block_offset)
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "parameter '%s' (params[%zu]): its gradient [%zu, %zu) overlaps "
                                "that of '%s' (params[%zu]) [%zu, %zu) in the gradient block",
                                b->name, b->registered, b->block_offset,
                                b->block_offset + param_bytes(b), a->name, a->registered,
                                a->block_offset, a->block_offset + param_bytes(a));
    }
    free(sorted);
    return status;
}

static ddp_status_t check_inputs(const ddp_param_t *params, size_t nparams,
                                 const ddp_buffer_t *buffers, size_t nbuffers,
                                 const ddp_reducer_config_t *c)
{
    if (nparams == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "nparams is 0: a reducer needs at least one parameter");
    if (!params) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL");
    /* A count no array can have: reject it before reading params[nparams - 1]. */
    if (nparams > PTRDIFF_MAX / sizeof(ddp_param_t))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nparams %zu is too large", nparams);
    if (nbuffers > PTRDIFF_MAX / sizeof(ddp_buffer_t))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nbuffers %zu is too large", nbuffers);
    if (nbuffers > 0 && !buffers)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffers is NULL but nbuffers is %zu",
                          nbuffers);
    if (c->bucket_cap_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->bucket_cap_bytes is 0");
    if (c->first_bucket_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->first_bucket_bytes is 0");
    if (c->broadcast_bucket_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->broadcast_bucket_bytes is 0");
    if (c->bucket_layout != DDP_BUCKET_LAYOUT_DEFAULT &&
        c->bucket_layout != DDP_BUCKET_LAYOUT_LAST_FIRST && c->bucket_layout != DDP_BUCKET_LAYOUT_C10D)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->bucket_layout is %d (expected DDP_BUCKET_LAYOUT_DEFAULT, "
                          "_LAST_FIRST or _C10D)",
                          c->bucket_layout);
    if (c->grad_memory < DDP_GRAD_MEMORY_BUCKETS || c->grad_memory > DDP_GRAD_MEMORY_BLOCK)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->grad_memory is %d (expected DDP_GRAD_MEMORY_BUCKETS, "
                          "_USER_BLOCK or _BLOCK)",
                          c->grad_memory);
    if (c->grad_memory != DDP_GRAD_MEMORY_BUCKETS && c->user_grads)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->user_grads is set with config->grad_memory %d: user_grads "
                          "copies gradients in and out of bucket memory, a gradient block is "
                          "reduced in place; choose one",
                          c->grad_memory);
    int user_block = c->grad_memory == DDP_GRAD_MEMORY_USER_BLOCK;
    if (user_block && (!c->grad_block || c->grad_block_bytes == 0))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->grad_memory is DDP_GRAD_MEMORY_USER_BLOCK but config->%s",
                          !c->grad_block ? "grad_block is NULL" : "grad_block_bytes is 0");
    if (!user_block && (c->grad_block || c->grad_block_bytes))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->grad_block/grad_block_bytes are set but config->grad_memory is "
                          "%d, not DDP_GRAD_MEMORY_USER_BLOCK",
                          c->grad_memory);
    if (c->join && c->comm_hook_averages)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->join (uneven inputs) with config->comm_hook_averages (e.g. "
                          "ZeRO's hook, ddp_zero_hook) is not supported: such a hook averages "
                          "over the world size, not over the ranks that still have data");
    size_t total_bytes = 0;
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        if (c->join && p->sparse)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]) is sparse: config->join (uneven "
                              "inputs) supports dense parameters only",
                              p->name ? p->name : "?", i);
        if (!p->name || !p->name[0])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params[%zu].name is %s", i,
                              p->name ? "empty" : "NULL");
        if (!is_float(p->dtype))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): dtype %s is not a floating type "
                              "(f32, f64, f16, bf16)",
                              p->name, i, ddp_dtype_name(p->dtype));
        if (p->numel > 0 && !p->data)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s' (params[%zu]): data is NULL",
                              p->name, i);
        /* Bucket offsets and byte sizes are computed in size_t: keep every product exact. */
        if (p->numel > PTRDIFF_MAX / ddp_dtype_size(p->dtype) ||
            p->numel * ddp_dtype_size(p->dtype) > PTRDIFF_MAX - total_bytes)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): numel %zu of %s is too large (the "
                              "model's bytes overflow)",
                              p->name, i, p->numel, ddp_dtype_name(p->dtype));
        total_bytes += p->numel * ddp_dtype_size(p->dtype);
        if (p->rows > 0 && p->numel % p->rows != 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): numel %zu is not a multiple of rows "
                              "%zu",
                              p->name, i, p->numel, p->rows);
        if (p->sparse && p->rows == 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]) is sparse but has rows = 0 (a sparse "
                              "parameter is a table of rows)",
                              p->name, i);
        if (user_block) {
            ddp_status_t s = check_block_grad(p, i, c);
            if (s != DDP_OK) return s;
        }
        if (c->user_grads && !p->sparse && p->numel > 0 && !p->grad)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): grad is NULL but config->user_grads "
                              "is set",
                              p->name, i);
    }
    for (size_t i = 0; i < nbuffers; i++) {
        const ddp_buffer_t *b = &buffers[i];
        if (!b->name || !b->name[0])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffers[%zu].name is %s", i,
                              b->name ? "empty" : "NULL");
        if ((unsigned)b->dtype >= DDP_DTYPE_COUNT)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffer '%s' (buffers[%zu]): invalid dtype",
                              b->name, i);
        if (b->numel > 0 && !b->data)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffer '%s' (buffers[%zu]): data is NULL",
                              b->name, i);
        if (b->numel > PTRDIFF_MAX / ddp_dtype_size(b->dtype))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "buffer '%s' (buffers[%zu]): numel %zu is too large", b->name, i,
                              b->numel);
    }
    return DDP_OK;
}

/* Merges duplicates (same data pointer) and checks that names are unique. */
static ddp_status_t dedup(ddp_reducer_t *r, const ddp_param_t *params, size_t nparams)
{
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        size_t kept = (size_t)-1;
        for (size_t k = 0; k < r->nparams; k++) {
            const rparam_t *q = &r->params[k];
            if (p->data && p->data == q->data) {
                if (p->numel != q->numel || p->dtype != q->dtype || p->sparse != q->sparse)
                    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                      "parameter '%s' (params[%zu]) shares its data with '%s' "
                                      "(params[%zu]) but differs in numel, dtype or sparsity "
                                      "(%zu %s vs %zu %s)",
                                      p->name, i, q->name, q->registered, p->numel,
                                      ddp_dtype_name(p->dtype), q->numel, ddp_dtype_name(q->dtype));
                if (r->config.grad_memory == DDP_GRAD_MEMORY_USER_BLOCK && p->grad &&
                    q->user_grad && p->grad != q->user_grad)
                    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                      "parameter '%s' (params[%zu]) shares its data with '%s' "
                                      "(params[%zu]) but its grad points elsewhere in the block: "
                                      "a tied weight has one gradient",
                                      p->name, i, q->name, q->registered);
                kept = k;
                break;
            }
            if (strcmp(p->name, q->name) == 0)
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "parameter name '%s' is registered twice (params[%zu] and "
                                  "params[%zu]) with different data: names must be unique",
                                  p->name, q->registered, i);
        }
        if (kept != (size_t)-1) {
            r->kept_of[i] = kept;
            continue;
        }
        rparam_t *q = &r->params[r->nparams];
        q->name = ddp__strdup(p->name, "parameter name");
        if (!q->name) return DDP_ERR_NO_MEMORY;
        q->registered = i;
        q->data = p->data;
        q->numel = p->numel;
        q->dtype = p->dtype;
        q->rows = p->rows;
        q->sparse = p->sparse;
        q->user_grad = p->grad;
        if (r->config.grad_memory == DDP_GRAD_MEMORY_USER_BLOCK && !p->sparse && p->numel > 0)
            q->block_offset = (size_t)((uintptr_t)p->grad - (uintptr_t)r->config.grad_block);
        r->kept_of[i] = r->nparams++;
    }
    return DDP_OK;
}

/* Waits for reductions in flight and frees everything; may leave a failed wait's text (create's
 * failure path restores its own). */
static void destroy_reducer(ddp_reducer_t *r)
{
    if (!r) return;
    for (size_t b = 0; b < r->nbuckets; b++) {
        if (r->buckets[b].work) {
            ddp_work_wait(r->buckets[b].work);
            ddp_work_free(r->buckets[b].work);
            r->buckets[b].work = NULL;
        }
        for (size_t i = 0; i < r->buckets[b].npieces; i++) {
            piece_t *q = &r->buckets[b].pieces[i];
            if (!q->work) continue;
            ddp_work_wait(q->work);
            ddp_work_free(q->work);
            q->work = NULL;
        }
    }
    ddp__reducer_wait_callbacks(r);
    /* No work of ours is in flight any more: the group stops writing into our trace, which the
     * caller may close once we return. */
    if (r->set_group_trace && ddp_group_trace(r->group) == r->config.trace)
        ddp_group_set_trace(r->group, NULL);
    ddp__reducer_free_stale(r);
    ddp__reducer_free_buckets(r);
    for (size_t i = 0; i < r->nparams; i++) {
        free(r->params[i].name);
        free(r->params[i].pending_index);
        free(r->params[i].pending_values);
        free(r->params[i].result_index);
        free(r->params[i].result_values);
    }
    free(r->params);
    free(r->kept_of);
    free(r->buffers);
    free(r->marked);
    free(r->row_marks);
    free(r->used_since_sync);
    free(r->arrival);
    free(r->finals);
    free(r->saved);
    free(r->status_vector);
    free(r->join_flags);
    free(r->join_prev);
    free(r->bucket_stats);
    free(r->schedule);
    free(r->launch_log);
    free(r->reduction_stats);
    free(r);
}

void ddp_reducer_destroy(ddp_reducer_t *r)
{
    destroy_reducer(r);
    ddp__clear_error(); /* status.h: a failed wait for a reduction in flight leaves no text */
}

void ddp_reducer_config_init(ddp_reducer_config_t *config)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (!config) return;
    ddp_reducer_config_t defaults = DDP_REDUCER_CONFIG_INIT;
    *config = defaults;
}

/* The reducer's identity, configuration and the arrays dedup fills (parameters, their kept
 * index, the buffers). */
static ddp_status_t init_reducer(ddp_reducer_t *r, ddp_group_t *group,
                                 const ddp_reducer_config_t *c, size_t nparams, size_t nbuffers)
{
    r->group = group;
    r->rank = ddp_group_rank(group);
    r->world = ddp_group_size(group);
    r->config = *c;
    if (r->config.bucket_layout == DDP_BUCKET_LAYOUT_DEFAULT)
        r->config.bucket_layout = DDP__DEFAULT_BUCKET_LAYOUT;
    r->sync_enabled = 1;
    r->nregistered = nparams;
    r->kept_of = ddp__malloc(nparams * sizeof(size_t), "reducer");
    r->params = ddp__calloc(nparams, sizeof(rparam_t), "reducer");
    r->buffers = ddp__calloc(nbuffers ? nbuffers : 1, sizeof(ddp__tensor_ref_t), "reducer");
    if (!r->kept_of || !r->params || !r->buffers) return DDP_ERR_NO_MEMORY;
    return DDP_OK;
}

/* After dedup: the buffers, each kept parameter's first row, and what an iteration keeps (the
 * marks, rank 0's arrival record, the status vector, join's flags). */
static ddp_status_t init_iteration_state(ddp_reducer_t *r, const ddp_buffer_t *buffers,
                                         size_t nbuffers)
{
    ddp_status_t status = DDP_OK;
    r->nbuffers = nbuffers;
    for (size_t i = 0; i < nbuffers; i++) {
        r->buffers[i].data = buffers[i].data;
        r->buffers[i].numel = buffers[i].numel;
        r->buffers[i].dtype = buffers[i].dtype;
    }
    size_t n = r->nparams;
    r->marked = ddp__calloc(n, 1, "reducer");
    r->used_since_sync = ddp__calloc(n, 1, "reducer");
    r->arrival = ddp__malloc(n * sizeof(size_t), "reducer");
    r->status_vector = ddp__malloc((n + (size_t)r->world) * sizeof(int64_t), "reducer");
    for (size_t i = 0; i < n; i++) {
        r->params[i].row_base = r->total_rows;
        if (!r->params[i].sparse) r->total_rows += ready_rows(&r->params[i]);
    }
    if (!r->marked || !r->used_since_sync || !r->arrival || !r->status_vector)
        status = DDP_ERR_NO_MEMORY;
    r->contributors = r->world;
    if (r->config.join && status == DDP_OK) {
        r->join_flags = ddp__malloc(((size_t)r->world + 1) * sizeof(int64_t), "reducer");
        r->join_prev = ddp__calloc((size_t)r->world, 1, "reducer");
        if (!r->join_flags || !r->join_prev) status = DDP_ERR_NO_MEMORY;
    }
    return status;
}

/* sync_at_create: parameters and buffers broadcast from rank 0, coalesced. */
static ddp_status_t broadcast_model(ddp_reducer_t *r)
{
    size_t nt = r->nparams + r->nbuffers;
    ddp__tensor_ref_t *t = ddp__malloc((nt ? nt : 1) * sizeof *t, "reducer");
    if (!t) return DDP_ERR_NO_MEMORY;
    for (size_t i = 0; i < r->nparams; i++) {
        t[i].data = r->params[i].data;
        t[i].numel = r->params[i].numel;
        t[i].dtype = r->params[i].dtype;
    }
    memcpy(t + r->nparams, r->buffers, r->nbuffers * sizeof *t);
    ddp_status_t status =
        ddp__broadcast_coalesced(r->group, t, nt, r->config.broadcast_bucket_bytes);
    free(t);
    return status;
}

/* After the buckets: the copy find_unused_parameters keeps, the buckets' statistics, and the
 * trace's comm lane (the group's trace too, unless the user gave it one). */
static ddp_status_t init_after_buckets(ddp_reducer_t *r)
{
    const ddp_reducer_config_t *c = &r->config;
    size_t saved_bytes = 0;
    for (size_t i = 0; i < r->nparams; i++) saved_bytes += param_bytes(&r->params[i]);
    if (c->find_unused_parameters && !c->user_grads) {
        r->saved = ddp__malloc(saved_bytes ? saved_bytes : 1, "reducer");
        if (!r->saved) return DDP_ERR_NO_MEMORY;
    }
    r->bucket_stats = ddp__calloc(r->nbuckets ? r->nbuckets : 1, sizeof(ddp_bucket_stats_t),
                                  "reducer");
    if (!r->bucket_stats) return DDP_ERR_NO_MEMORY;
    if (c->trace) {
        ddp_trace_name_lane(c->trace, DDP__COMM_LANE, "comm");
        /* The transport's decisions (the shm tuner's) go into the same trace, unless the user
         * gave the group a trace of its own. */
        if (!ddp_group_trace(r->group)) {
            ddp_group_set_trace(r->group, c->trace);
            r->set_group_trace = 1;
        }
    }
    r->recording = c->rebuild_buckets && !c->find_unused_parameters;
    return DDP_OK;
}

ddp_status_t ddp_reducer_create(ddp_group_t *group, const ddp_param_t *params, size_t nparams,
                                const ddp_buffer_t *buffers, size_t nbuffers,
                                const ddp_reducer_config_t *config, ddp_reducer_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group is NULL");
    ddp_reducer_config_t defaults = DDP_REDUCER_CONFIG_INIT;
    const ddp_reducer_config_t *c = config ? config : &defaults;
    int verify = c->sync_at_create;

    /* Local checks first; with sync_at_create a failure is still taken to the model
     * verification so that every rank fails together instead of waiting for this one. */
    ddp_status_t status = DDP_OK;
    ddp_reducer_t *r = NULL;
    if (!out) status = ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (status == DDP_OK) status = check_inputs(params, nparams, buffers, nbuffers, c);
    if (status == DDP_OK) {
        r = ddp__calloc(1, sizeof *r, "reducer");
        if (!r) status = DDP_ERR_NO_MEMORY;
    }
    if (status == DDP_OK) status = init_reducer(r, group, c, nparams, nbuffers);
    if (status == DDP_OK) status = dedup(r, params, nparams);
    if (status == DDP_OK && c->grad_memory == DDP_GRAD_MEMORY_USER_BLOCK)
        status = check_block_overlaps(r);
    if (status == DDP_OK) status = init_iteration_state(r, buffers, nbuffers);

    if (verify) {
        ddp_status_t v = ddp__reducer_verify_model(
            group, status, r ? r->params : NULL, r ? r->nparams : 0, r ? r->nbuffers : 0,
            c->piece_bytes, r ? r->config.bucket_layout : c->bucket_layout, c->grad_memory,
            c->join);
        if (status == DDP_OK) status = v;
    }
    if (status == DDP_OK && verify) status = broadcast_model(r);
    if (status == DDP_OK) status = ddp__reducer_initial_buckets(r);
    if (status == DDP_OK) status = ddp__reducer_size_launch_log(r);
    if (status == DDP_OK) status = init_after_buckets(r);
    if (status != DDP_OK) goto fail;
    DDP_LOG(DDP_LOG_INFO, "reducer: rank %d, %zu parameters (%zu registered), %zu buckets", r->rank,
            r->nparams, nparams, r->nbuckets);
    *out = r;
    return DDP_OK;

fail:
    if (r) {
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        destroy_reducer(r);
        ddp__set_error_text(text);
    }
    return status;
}

ddp_status_t ddp_reducer_grad(ddp_reducer_t *r, size_t index, void **grad)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = ddp__reducer_lookup(r, index, "ddp_reducer_grad", &p, &k);
    if (s != DDP_OK) return s;
    if (!grad) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_grad: grad is NULL");
    if (p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s' is sparse: its gradient is given as rows with "
                          "ddp_reducer_sparse_grad and read with ddp_reducer_sparse_result",
                          p->name);
    *grad = r->config.user_grads ? p->user_grad : (void *)slot_of(r, p);
    return DDP_OK;
}

ddp_status_t ddp_reducer_grad_block(ddp_reducer_t *r, void **block, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!block) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "block is NULL");
    if (!bytes) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "bytes is NULL");
    if (!block_mode(r))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_grad_block: this reducer keeps gradients in bucket memory "
                          "(config.grad_memory is DDP_GRAD_MEMORY_BUCKETS): there is no block");
    *block = r->block;
    *bytes = r->block_bytes;
    return DDP_OK;
}

size_t ddp_reducer_bucket_count(const ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    return r ? r->nbuckets : 0;
}

ddp_status_t ddp_reducer_bucket_params(const ddp_reducer_t *r, size_t bucket,
                                       const size_t **params, size_t *nparams)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!params) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL");
    if (!nparams) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nparams is NULL");
    if (bucket >= r->nbuckets)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "bucket %zu is out of range (%zu buckets)",
                          bucket, r->nbuckets);
    *params = r->buckets[bucket].registered;
    *nparams = r->buckets[bucket].nparams;
    return DDP_OK;
}

ddp_status_t ddp_reducer_stats(const ddp_reducer_t *r, ddp_reducer_stats_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (!r->have_stats)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "no synchronised iteration has been finalized yet: no statistics");
    *out = r->stats;
    return DDP_OK;
}

ddp_status_t ddp_reducer_set_sync(ddp_reducer_t *r, int enabled)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    r->sync_enabled = enabled ? 1 : 0;
    return DDP_OK;
}

static int in_flight(const ddp_reducer_t *r)
{
    return r->active && r->iter_sync && r->launches > 0;
}

ddp_status_t ddp_reducer_zero_grad(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (in_flight(r))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_zero_grad during backward: bucket reductions are in flight "
                          "(call it after ddp_reducer_finalize)");
    for (size_t b = 0; b < r->nbuckets; b++)
        if (r->buckets[b].data)
            memset(r->buckets[b].data, 0, r->buckets[b].numel * ddp_dtype_size(r->buckets[b].dtype));
    for (size_t i = 0; i < r->nparams; i++) {
        rparam_t *p = &r->params[i];
        if (r->config.user_grads && p->user_grad) memset(p->user_grad, 0, param_bytes(p));
        p->pending_rows = 0;
    }
    return DDP_OK;
}
