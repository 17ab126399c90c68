/* The Reducer's buckets: the bucket descriptors and pieces made from a layout (bucket_layout.c),
 * at create in config.bucket_layout's order and once after the first synchronised iteration in
 * the order rank 0 saw gradients arrive (the rebuild), and their memory (allocated collectively,
 * or runs of the gradient block in the block modes). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Completion callbacks run on the progress thread; before bucket memory or descriptors are
 * freed or statistics read, wait for every one of them (bounded by the group's timeout). */
void ddp__reducer_wait_callbacks(ddp_reducer_t *r)
{
    double deadline = ddp__now_us() + (double)ddp_group_timeout_ms(r->group) * 1000.0;
    while (atomic_load(&r->callbacks_pending) > 0 && ddp__now_us() < deadline) ddp__sleep_us(20);
}

static void free_bucket_arrays(bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(buckets[i].params);
        free(buckets[i].registered);
        free(buckets[i].offsets);
        free(buckets[i].numels);
        free(buckets[i].rows);
        free(buckets[i].pieces);
        free(buckets[i].piece_order);
    }
    free(buckets);
}

/* Frees bucket memory collectively (every rank frees the same buffers in the same order). In the
 * block modes a bucket is a view of the block, which is freed with the reducer. */
static void free_bucket_memory(ddp_reducer_t *r, bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (block_mode(r)) {
            buckets[i].data = NULL;
            continue;
        }
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
            k->piece_order = ddp__malloc(k->npieces * sizeof(size_t), "buckets");
            if (!k->pieces || !k->piece_order) {
                status = DDP_ERR_NO_MEMORY;
                goto fail;
            }
            for (size_t i = 0; i < k->npieces; i++) {
                piece_t *q = &k->pieces[i];
                q->index = i;
                q->begin = i * step;
                q->numel = k->numel - q->begin < step ? k->numel - q->begin : step;
                k->piece_order[i] = i;
            }
        }
    }
    /* Allocation is collective: same sizes in the same order on every rank (the model was
     * verified identical, and the assignment is deterministic). In the block modes a bucket is
     * the run of the block its parameters cover: block_assign put them in block order with no
     * gap, so the offsets above are their places in the run. */
    for (size_t b = 0; b < a->nbuckets; b++) {
        bucket_t *k = &buckets[b];
        if (k->numel == 0) continue;
        if (block_mode(r)) {
            size_t j = 0;
            while (r->params[k->params[j]].numel == 0) j++;
            const rparam_t *p = &r->params[k->params[j]];
            k->data = r->block + p->block_offset - k->offsets[j] * ddp_dtype_size(k->dtype);
            continue;
        }
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

/* Bucket mode, at the rebuild: remembers the old bucket memory and each parameter's slot in it,
 * so that the next synchronised finalize can tell whether a stale pointer was written. */
static ddp_status_t keep_stale(ddp_reducer_t *r, bucket_t *old, size_t n)
{
    r->stale_memory = ddp__calloc(n ? n : 1, sizeof(void *), "rebuild");
    r->stale_slot = ddp__calloc(r->nparams ? r->nparams : 1, sizeof(unsigned char *), "rebuild");
    if (!r->stale_memory || !r->stale_slot) {
        free(r->stale_memory);
        free(r->stale_slot);
        r->stale_memory = NULL;
        r->stale_slot = NULL;
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t b = 0; b < n; b++)
        if (old[b].data) r->stale_memory[r->nstale++] = old[b].data;
    for (size_t k = 0; k < r->nparams; k++) {
        rparam_t *p = &r->params[k];
        if (!p->sparse && p->numel > 0) r->stale_slot[k] = slot_of(r, p);
    }
    return DDP_OK;
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
    /* rebuild_root: rank 0, or with uneven inputs the lowest rank that had data in the
     * recording iteration (a rank that had joined recorded nothing). */
    int root = r->rebuild_root;
    for (size_t i = 0; i < n; i++) order64[i] = r->rank == root ? (int64_t)r->arrival[i] : 0;
    status = ddp_group_broadcast(r->group, order64, n, DDP_I64, root);
    if (status != DDP_OK) {
        ddp__error_context(status, "rebuilding buckets (broadcast of rank %d's gradient order)",
                           root);
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
    if (block_mode(r) && ddp__reducer_schedules_pieces(r))
        status = ddp__reducer_address_order(r, order);
    if (status != DDP_OK) goto done;
    status = block_mode(r) ? ddp__reducer_block_assign(r, order, 0, &a)
                           : ddp__reducer_assign(r, order, &a);
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
        if (status == DDP_OK && !block_mode(r))
            status = keep_stale(r, r->buckets, r->nbuckets);
        if (status != DDP_OK && fresh) {
            free_bucket_memory(r, fresh, a.nbuckets);
            free_bucket_arrays(fresh, a.nbuckets);
        }
        if (status == DDP_OK) {
            /* In the block modes the new buckets are other runs of the same block: nothing
             * moves. Otherwise every gradient is copied to its new slot, and the old memory is
             * kept, filled with the marker, until the next synchronised finalize checks it. */
            for (size_t b = 0; !block_mode(r) && b < a.nbuckets; b++) {
                for (size_t j = 0; j < fresh[b].nparams; j++) {
                    rparam_t *p = &r->params[fresh[b].params[j]];
                    if (p->sparse || p->numel == 0) continue;
                    memcpy((unsigned char *)fresh[b].data +
                               fresh[b].offsets[j] * ddp_dtype_size(p->dtype),
                           slot_of(r, p), param_bytes(p));
                }
            }
            ddp__reducer_wait_callbacks(r);
            if (!block_mode(r))
                for (size_t b = 0; b < r->nbuckets; b++)
                    if (r->buckets[b].data)
                        memset(r->buckets[b].data, DDP__STALE_BYTE,
                               r->buckets[b].numel * ddp_dtype_size(r->buckets[b].dtype));
            free_bucket_arrays(r->buckets, r->nbuckets);
            free(r->schedule); /* of the old buckets; schedule_pieces makes the new one */
            r->schedule = NULL;
            r->nschedule = 0;
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
    if (status == DDP_OK)
        status = ddp__reducer_schedules_pieces(r) ? ddp__reducer_schedule_pieces(r)
                                                  : ddp__reducer_order_pieces(r);
    if (status == DDP_OK) status = ddp__reducer_size_launch_log(r);
    DDP_LOG(DDP_LOG_INFO, "reducer: rank %d rebuilt buckets in arrival order (%zu buckets%s)",
            r->rank, r->nbuckets, same ? ", unchanged" : "");
done:
    free(order64);
    free(order);
    free(seen);
    free(r->finals); /* the piece order is learned once */
    r->finals = NULL;
    r->nfinals = r->finals_cap = 0;
    return status;
}

ddp_status_t ddp__reducer_initial_buckets(ddp_reducer_t *r)
{
    ddp_bucket_assignment_t a;
    ddp_status_t status = ddp__reducer_assign(r, NULL, &a);
    if (status != DDP_OK) return status;
    if (block_mode(r)) {
        if (r->config.grad_memory == DDP_GRAD_MEMORY_BLOCK) {
            status = ddp__reducer_layout_block(r, &a);
        } else {
            r->block = r->config.grad_block;
            r->block_bytes = r->config.grad_block_bytes;
            /* A block the transport cannot read in place (malloc'd) is registered for the
             * reducer's life, so that on shm every bucket and piece of it is reduced in place:
             * DDP_SHM_MAP=auto alone maps at most 32 ranges per process, fewer than a block
             * cut into pieces has. Memory that cannot be registered (a transport buffer from
             * ddp_group_alloc_buffer, a block holding no whole page, one the caller registered
             * already, no registration left) stays as it is and works as before. */
            if (r->block_bytes &&
                ddp_group_register_memory(r->group, r->block, r->block_bytes) == DDP_OK)
                r->block_registered = 1;
            ddp__clear_error();
            /* As for bucket memory: results are read after the rest of backward. A no-op
             * unless the block is in a transport buffer (ddp_group_alloc_buffer). */
            ddp__group_advise_cold_results(r->group, r->block);
        }
        ddp__bucket_assignment_free(&a);
        if (status != DDP_OK) return status;
        size_t *order = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof(size_t), "buckets");
        if (!order) return DDP_ERR_NO_MEMORY;
        int reverse_list = 0;
        ddp__reducer_initial_order(r, order, &reverse_list);
        status = ddp__reducer_block_assign(r, order, reverse_list, &a);
        free(order);
        if (status != DDP_OK) return status;
    }
    status = make_buckets(r, &a, &r->buckets);
    if (status == DDP_OK) r->nbuckets = a.nbuckets;
    ddp__bucket_assignment_free(&a);
    if (status != DDP_OK) return status;
    place_params(r);
    return DDP_OK;
}

void ddp__reducer_free_buckets(ddp_reducer_t *r)
{
    if (r->buckets) {
        free_bucket_memory(r, r->buckets, r->nbuckets);
        free_bucket_arrays(r->buckets, r->nbuckets);
        r->buckets = NULL;
    }
    free(r->schedule);
    r->schedule = NULL;
    r->nschedule = 0;
    if (r->block_owned && r->block) ddp_group_free_buffer(r->group, r->block);
    /* Every reduction on it has completed (destroy waited): its pages become private again,
     * with the same bytes, before the caller frees it. */
    if (r->block_registered) ddp_group_unregister_memory(r->group, r->block);
    r->block_registered = 0;
    r->block = NULL;
    r->block_owned = 0;
}

void ddp__reducer_free_stale(ddp_reducer_t *r)
{
    for (size_t i = 0; i < r->nstale; i++) ddp_group_free_buffer(r->group, r->stale_memory[i]);
    free(r->stale_memory);
    free(r->stale_slot);
    r->stale_memory = NULL;
    r->stale_slot = NULL;
    r->nstale = 0;
}

size_t ddp__reducer_check_stale(ddp_reducer_t *r)
{
    size_t found = (size_t)-1;
    for (size_t k = 0; r->stale_slot && k < r->nparams && found == (size_t)-1; k++) {
        const unsigned char *old = r->stale_slot[k];
        size_t bytes = param_bytes(&r->params[k]);
        for (size_t i = 0; old && i < bytes; i++) {
            if (old[i] != DDP__STALE_BYTE) {
                found = k;
                break;
            }
        }
    }
    ddp__reducer_free_stale(r);
    return found;
}
