/* ZeRO's step (see zero.c for the design): gradients arriving (stage 2 reduce-scatters each
 * through the bucketer as it is ready), the update of this rank's share, and the exchange that
 * gives every rank the new values (broadcast from owners, or allgather of chunks); and the
 * overlap hook, which reduces whole Reducer buckets and updates them on their owner at once. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/zero_internal.h"

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
    if (z->fused) { /* reduced in the step */
        z->submitted[index] = 1;
        z->ready[index] = grad;
        return DDP_OK;
    }
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

/* Fused (inside reduce_scatter_apply, on the group's progress thread): elements [first, first +
 * n) of parameter i's padded whole are averaged in `values`; those of this rank's run are
 * updated in chunk->recv (elements past the parameter's end, padding, are left alone). */
static void fused_apply(void *arg, size_t first, void *values, size_t n)
{
    zero_chunk_t *c = arg;
    ddp_zero_t *z = c->zero;
    size_t i = c->param, es = ddp_dtype_size(z->dtype[i]);
    const ddp__optim_run_t *run = &z->runs[i];
    size_t o = first - run->first;
    if (o >= run->count) return;
    if (n > run->count - o) n = run->count - o;
    unsigned char *p = c->recv + first * es;
    ddp__optim_run_update_range(run, ddp__optim_hp(&z->setup, i), z->dtype[i], p, p, values, 1.0,
                                o, n);
}

/* Stage 2 fused: one reduce_scatter_apply per parameter, in index order, from its gradient into
 * the parameter itself, or through padded copies when the world size does not divide it. */
static ddp_status_t fused_step(ddp_zero_t *z, void *const *grads)
{
    size_t world = (size_t)z->world;
    ddp_status_t s = DDP_OK;
    for (size_t i = 0; i < z->nparams && s == DDP_OK; i++) {
        size_t n = z->numel[i], c = chunk_of(z, i), es = ddp_dtype_size(z->dtype[i]);
        const void *g = z->submitted[i] ? z->ready[i] : grads[i];
        z->runs[i].steps++;
        if (n == 0) continue;
        zero_chunk_t *chunk = &z->chunks[i];
        if (n % world == 0) {
            chunk->recv = z->data[i];
            s = ddp_group_reduce_scatter_apply(z->group, g, z->data[i], c, z->dtype[i], DDP_AVG,
                                               fused_apply, chunk);
        } else {
            memcpy(z->fused_send, g, n * es);
            memset(z->fused_send + n * es, 0, (c * world - n) * es);
            memcpy(z->stage_buf, z->data[i], n * es);
            memset(z->stage_buf + n * es, 0, (c * world - n) * es);
            chunk->recv = z->stage_buf;
            s = ddp_group_reduce_scatter_apply(z->group, z->fused_send, z->stage_buf, c,
                                               z->dtype[i], DDP_AVG, fused_apply, chunk);
            if (s == DDP_OK) memcpy(z->data[i], z->stage_buf, n * es);
        }
        if (s != DDP_OK)
            ddp__error_context(s, "zero step %llu: reduce_scatter_apply of parameter %zu (%s)",
                               (unsigned long long)z->steps, i, pname(z, i));
    }
    for (size_t i = 0; i < z->nparams; i++) z->submitted[i] = 0;
    return s;
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
        s = z->fused ? fused_step(z, grads) : stage2_step(z, grads);
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
