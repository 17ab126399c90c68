/* The Reducer's buckets: how parameters are assigned to buckets (at create, in
 * config.bucket_layout's order; once after the first synchronised iteration, in the order rank 0
 * saw gradients arrive), the bucket descriptors and pieces, and their memory (allocated
 * collectively). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

static void free_bucket_arrays(bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(buckets[i].params);
        free(buckets[i].registered);
        free(buckets[i].offsets);
        free(buckets[i].numels);
        free(buckets[i].rows);
        free(buckets[i].pieces);
    }
    free(buckets);
}

/* Frees bucket memory collectively (every rank frees the same buffers in the same order). */
static void free_bucket_memory(ddp_reducer_t *r, bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (buckets[i].data) ddp_group_free_buffer(r->group, buckets[i].data);
        buckets[i].data = NULL;
    }
}

/* Builds buckets from an assignment (kept indices) and allocates their memory collectively. */
static ddp_status_t make_buckets(ddp_reducer_t *r, const ddp_bucket_assignment_t *a,
                                 bucket_t **out)
{
    bucket_t *buckets = ddp__calloc(a->nbuckets ? a->nbuckets : 1, sizeof(bucket_t), "buckets");
    if (!buckets) return DDP_ERR_NO_MEMORY;
    ddp_status_t status = DDP_OK;
    for (size_t b = 0; b < a->nbuckets; b++) {
        bucket_t *k = &buckets[b];
        size_t n = a->starts[b + 1] - a->starts[b];
        k->owner = r;
        k->index = b;
        k->nparams = n;
        k->params = ddp__malloc(n * sizeof(size_t), "buckets");
        k->registered = ddp__malloc(n * sizeof(size_t), "buckets");
        k->offsets = ddp__malloc(n * sizeof(size_t), "buckets");
        k->numels = ddp__malloc(n * sizeof(size_t), "buckets");
        k->rows = ddp__malloc(n * sizeof(size_t), "buckets");
        if (!k->params || !k->registered || !k->offsets || !k->numels || !k->rows) {
            status = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        const rparam_t *first = &r->params[a->indices[a->starts[b]]];
        k->dtype = first->dtype;
        k->sparse = first->sparse;
        size_t offset = 0;
        for (size_t j = 0; j < n; j++) {
            const rparam_t *p = &r->params[a->indices[a->starts[b] + j]];
            k->params[j] = a->indices[a->starts[b] + j];
            k->registered[j] = p->registered;
            k->offsets[j] = offset;
            k->numels[j] = p->numel;
            k->rows[j] = p->rows;
            offset += p->numel;
        }
        k->numel = k->sparse ? 0 : offset;
        snprintf(k->trace_name, sizeof k->trace_name, "bucket %zu", b);
        /* Pieces depend only on the layout, so every rank cuts the bucket the same way. A hook
         * gets whole buckets (PowerSGD needs whole matrices). */
        size_t esize = ddp_dtype_size(k->dtype);
        if (!k->sparse && k->numel > 0 && r->config.piece_bytes > 0 && !r->config.comm_hook) {
            size_t step = r->config.piece_bytes / esize ? r->config.piece_bytes / esize : 1;
            k->npieces = (k->numel + step - 1) / step;
            k->pieces = ddp__calloc(k->npieces, sizeof(piece_t), "buckets");
            if (!k->pieces) {
                status = DDP_ERR_NO_MEMORY;
                goto fail;
            }
            for (size_t i = 0; i < k->npieces; i++) {
                piece_t *q = &k->pieces[i];
                q->index = i;
                q->begin = i * step;
                q->numel = k->numel - q->begin < step ? k->numel - q->begin : step;
            }
        }
    }
    /* Allocation is collective: same sizes in the same order on every rank (the model was
     * verified identical, and the assignment is deterministic). */
    for (size_t b = 0; b < a->nbuckets; b++) {
        bucket_t *k = &buckets[b];
        if (k->numel == 0) continue;
        status = ddp_group_alloc_buffer(r->group, k->numel * ddp_dtype_size(k->dtype), &k->data);
        if (status != DDP_OK) {
            ddp__error_context(status, "allocating memory of gradient bucket %zu (%zu bytes)", b,
                               k->numel * ddp_dtype_size(k->dtype));
            free_bucket_memory(r, buckets, b);
            goto fail;
        }
        /* A bucket's result is read by the optimizer after the rest of backward, not at once. */
        ddp__group_advise_cold_results(r->group, k->data);
    }
    /* The bucket array does not move from here on: pieces may point at their bucket. */
    for (size_t b = 0; b < a->nbuckets; b++)
        for (size_t i = 0; i < buckets[b].npieces; i++) buckets[b].pieces[i].bucket = &buckets[b];
    *out = buckets;
    return DDP_OK;
fail:
    free_bucket_arrays(buckets, a->nbuckets);
    return status;
}

static void place_params(ddp_reducer_t *r)
{
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        for (size_t j = 0; j < k->nparams; j++) {
            rparam_t *p = &r->params[k->params[j]];
            p->bucket = b;
            p->slot = j;
            p->offset = k->offsets[j];
        }
    }
}

/* Assignment over kept parameters: `order` NULL means the initial one of config.bucket_layout
 * (visited in reverse registration order, or for c10d's rule in registration order; either way
 * the list is then reversed); otherwise arrival order, sorted by arrival position. */
static ddp_status_t assign(ddp_reducer_t *r, const size_t *order, ddp_bucket_assignment_t *out)
{
    ddp_param_t *desc = ddp__calloc(r->nparams ? r->nparams : 1, sizeof(ddp_param_t), "buckets");
    size_t *reverse = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof(size_t), "buckets");
    if (!desc || !reverse) {
        free(desc);
        free(reverse);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < r->nparams; i++) {
        desc[i].name = r->params[i].name;
        desc[i].numel = r->params[i].numel;
        desc[i].dtype = r->params[i].dtype;
        desc[i].rows = r->params[i].rows;
        desc[i].sparse = r->params[i].sparse;
        reverse[i] = r->nparams - 1 - i;
    }
    size_t limits[2] = {r->config.first_bucket_bytes, r->config.bucket_cap_bytes};
    ddp_status_t status;
    if (order) {
        status = ddp__bucket_assignment(desc, r->nparams, limits, 2, order,
                                        DDP__SORT_BY_POSITION, out);
    } else {
        const size_t *visit = r->config.bucket_layout == DDP_BUCKET_LAYOUT_C10D ? NULL : reverse;
        status = ddp__bucket_assignment(desc, r->nparams, limits, 2, visit, DDP__SORT_BY_INDEX,
                                        out);
        if (status == DDP_OK) {
            /* Reverse the bucket list so that the last layers (ready first) are bucket 0. */
            ddp_bucket_assignment_t rev;
            size_t nb = out->nbuckets;
            rev.nbuckets = nb;
            rev.starts = ddp__malloc((nb + 1) * sizeof(size_t), "buckets");
            rev.indices = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof(size_t), "buckets");
            if (!rev.starts || !rev.indices) {
                ddp__bucket_assignment_free(&rev);
                ddp__bucket_assignment_free(out);
                status = DDP_ERR_NO_MEMORY;
            } else {
                size_t n = 0;
                for (size_t b = 0; b < nb; b++) {
                    size_t src = nb - 1 - b;
                    size_t len = out->starts[src + 1] - out->starts[src];
                    rev.starts[b] = n;
                    memcpy(rev.indices + n, out->indices + out->starts[src], len * sizeof(size_t));
                    n += len;
                }
                rev.starts[nb] = n;
                ddp__bucket_assignment_free(out);
                *out = rev;
            }
        }
    }
    free(desc);
    free(reverse);
    return status;
}

/* Collective, at prepare: rank 0's arrival order of the first synchronised iteration is
 * broadcast, buckets are reassigned in that order, and gradients are moved to the new slots. */
ddp_status_t ddp__reducer_rebuild(ddp_reducer_t *r)
{
    size_t n = r->nparams;
    int64_t *order64 = ddp__malloc(n * sizeof(int64_t), "rebuild");
    size_t *order = ddp__malloc(n * sizeof(size_t), "rebuild");
    unsigned char *seen = ddp__calloc(n, 1, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!order64 || !order || !seen) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t i = 0; i < n; i++) order64[i] = r->rank == 0 ? (int64_t)r->arrival[i] : 0;
    status = ddp_group_broadcast(r->group, order64, n, DDP_I64, 0);
    if (status != DDP_OK) {
        ddp__error_context(status, "rebuilding buckets (broadcast of rank 0's gradient order)");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        if (order64[i] < 0 || (size_t)order64[i] >= n || seen[order64[i]]) {
            status = ddp__error(DDP_ERR_PROTOCOL,
                                "rebuilding buckets: rank 0's gradient order is not a permutation "
                                "(entry %zu)",
                                i);
            goto done;
        }
        seen[order64[i]] = 1;
        order[i] = (size_t)order64[i];
    }
    ddp_bucket_assignment_t a;
    status = assign(r, order, &a);
    if (status != DDP_OK) goto done;
    int same = a.nbuckets == r->nbuckets;
    for (size_t b = 0; same && b < a.nbuckets; b++) {
        size_t len = a.starts[b + 1] - a.starts[b];
        same = len == r->buckets[b].nparams &&
               memcmp(a.indices + a.starts[b], r->buckets[b].params, len * sizeof(size_t)) == 0;
    }
    if (!same) {
        bucket_t *fresh = NULL;
        status = make_buckets(r, &a, &fresh);
        if (status == DDP_OK) {
            for (size_t b = 0; b < a.nbuckets; b++) {
                for (size_t j = 0; j < fresh[b].nparams; j++) {
                    rparam_t *p = &r->params[fresh[b].params[j]];
                    if (p->sparse || p->numel == 0) continue;
                    memcpy((unsigned char *)fresh[b].data +
                               fresh[b].offsets[j] * ddp_dtype_size(p->dtype),
                           slot_of(r, p), param_bytes(p));
                }
            }
            ddp__reducer_wait_callbacks(r);
            free_bucket_memory(r, r->buckets, r->nbuckets);
            free_bucket_arrays(r->buckets, r->nbuckets);
            r->buckets = fresh;
            r->nbuckets = a.nbuckets;
            place_params(r);
            ddp_bucket_stats_t *bs =
                ddp__calloc(r->nbuckets ? r->nbuckets : 1, sizeof *bs, "reducer");
            if (!bs) {
                status = DDP_ERR_NO_MEMORY;
            } else {
                free(r->bucket_stats);
                r->bucket_stats = bs;
                r->have_stats = 0;
            }
        }
    }
    ddp__bucket_assignment_free(&a);
    DDP_LOG(DDP_LOG_INFO, "reducer: rank %d rebuilt buckets in arrival order (%zu buckets%s)",
            r->rank, r->nbuckets, same ? ", unchanged" : "");
done:
    free(order64);
    free(order);
    free(seen);
    return status;
}

ddp_status_t ddp__reducer_initial_buckets(ddp_reducer_t *r)
{
    ddp_bucket_assignment_t a;
    ddp_status_t status = assign(r, NULL, &a);
    if (status != DDP_OK) return status;
    status = make_buckets(r, &a, &r->buckets);
    if (status == DDP_OK) r->nbuckets = a.nbuckets;
    ddp__bucket_assignment_free(&a);
    if (status != DDP_OK) return status;
    place_params(r);
    return DDP_OK;
}

void ddp__reducer_free_buckets(ddp_reducer_t *r)
{
    if (!r->buckets) return;
    free_bucket_memory(r, r->buckets, r->nbuckets);
    free_bucket_arrays(r->buckets, r->nbuckets);
}
