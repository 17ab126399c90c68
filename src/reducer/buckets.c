/* The Reducer's buckets: how parameters are assigned to buckets (at create, in
 * config.bucket_layout's order; once after the first synchronised iteration, in the order rank 0
 * saw gradients arrive), the bucket descriptors and pieces, and their memory (allocated
 * collectively, or runs of the gradient block in the block modes). */
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

/* ---- the block modes: buckets are contiguous runs of the gradient block -----------------
 *
 * Parameters are visited in an order (the initial layout's, or the rebuild's arrival order); each
 * dtype has an open run, and a parameter joins its dtype's run when its gradient touches the run
 * at either end (so a backward that walks the block downwards builds runs as well as one that
 * walks it upwards); otherwise the run is closed and a new one opens. A run also closes when it
 * reaches the dtype's current size limit (first_bucket_bytes, then bucket_cap_bytes, as c10d).
 * Empty parameters join whatever run is open. Runs are sorted by their first visiting position,
 * so buckets become ready in consecutive order; each run's parameters are listed in block order
 * (kept that way as they join, at the head or the tail), so the bucket is one range [lo, hi) of
 * the block that hooks see as ordinary bucket memory. */

typedef struct block_run {
    size_t head, tail, count; /* kept indices in block order, linked through next[] (empty
                               * parameters anywhere: they take no place) */
    size_t lo, hi, bytes;     /* byte range in the block (bytes == 0: nothing placed yet) */
    size_t first_pos;
    size_t limit_index;
    int open;
} block_run_t;

typedef struct run_ref {
    size_t first_pos, start, count;
} run_ref_t;

static int compare_run_refs(const void *a, const void *b)
{
    const run_ref_t *x = a, *y = b;
    return x->first_pos < y->first_pos ? -1 : x->first_pos > y->first_pos ? 1 : 0;
}

typedef struct block_builder {
    ddp_reducer_t *r;
    size_t *next, *entries, nentries;
    run_ref_t *runs;
    size_t nruns;
} block_builder_t;

static void close_run(block_builder_t *bb, block_run_t *run)
{
    if (!run->open) return;
    run_ref_t *ref = &bb->runs[bb->nruns++];
    ref->first_pos = run->first_pos;
    ref->start = bb->nentries;
    ref->count = run->count;
    /* The list is in block order: a parameter below the run was put at its head. */
    for (size_t k = run->head; k != (size_t)-1; k = bb->next[k]) bb->entries[bb->nentries++] = k;
    run->open = 0;
    run->limit_index++;
}

static ddp_status_t block_assign(ddp_reducer_t *r, const size_t *order, int reverse_list,
                                 ddp_bucket_assignment_t *out)
{
    size_t n = r->nparams;
    block_builder_t bb = {r, NULL, NULL, 0, NULL, 0};
    block_run_t runs[DDP_DTYPE_COUNT];
    memset(runs, 0, sizeof runs);
    out->nbuckets = 0;
    out->starts = NULL;
    out->indices = NULL;
    bb.next = ddp__malloc((n ? n : 1) * sizeof(size_t), "buckets");
    bb.entries = ddp__malloc((n ? n : 1) * sizeof(size_t), "buckets");
    bb.runs = ddp__malloc((n ? n : 1) * sizeof(run_ref_t), "buckets");
    out->starts = ddp__malloc((n + 1) * sizeof(size_t), "buckets");
    out->indices = ddp__malloc((n ? n : 1) * sizeof(size_t), "buckets");
    if (!bb.next || !bb.entries || !bb.runs || !out->starts || !out->indices) {
        free(bb.next);
        free(bb.entries);
        free(bb.runs);
        ddp__bucket_assignment_free(out);
        return DDP_ERR_NO_MEMORY;
    }
    size_t limits[2] = {r->config.first_bucket_bytes, r->config.bucket_cap_bytes};
    for (size_t pos = 0; pos < n; pos++) {
        size_t k = order[pos];
        const rparam_t *p = &r->params[k];
        bb.next[k] = (size_t)-1;
        if (p->sparse) { /* a bucket of its own, with no memory in the block */
            run_ref_t *ref = &bb.runs[bb.nruns++];
            ref->first_pos = pos;
            ref->start = bb.nentries;
            ref->count = 1;
            bb.entries[bb.nentries++] = k;
            continue;
        }
        block_run_t *run = &runs[p->dtype];
        size_t lo = p->block_offset, bytes = param_bytes(p), hi = lo + bytes;
        if (run->open && bytes > 0 && run->bytes > 0 && hi != run->lo && lo != run->hi)
            close_run(&bb, run);
        if (!run->open) {
            run->open = 1;
            run->head = run->tail = k;
            run->count = 1;
            run->bytes = 0;
            run->first_pos = pos;
        } else if (bytes > 0 && run->bytes > 0 && hi == run->lo) {
            bb.next[k] = run->head; /* it lies just below the run */
            run->head = k;
            run->count++;
        } else {
            bb.next[run->tail] = k;
            run->tail = k;
            run->count++;
        }
        if (bytes > 0) {
            if (run->bytes == 0) {
                run->lo = lo;
                run->hi = hi;
            } else if (hi == run->lo) {
                run->lo = lo;
            } else {
                run->hi = hi;
            }
            run->bytes += bytes;
        }
        size_t limit = limits[run->limit_index < 1 ? 0 : 1];
        if (run->bytes >= limit) close_run(&bb, run);
    }
    for (int d = 0; d < DDP_DTYPE_COUNT; d++) close_run(&bb, &runs[d]);
    qsort(bb.runs, bb.nruns, sizeof *bb.runs, compare_run_refs);
    size_t m = 0;
    for (size_t b = 0; b < bb.nruns; b++) {
        const run_ref_t *ref = &bb.runs[reverse_list ? bb.nruns - 1 - b : b];
        out->starts[b] = m;
        memcpy(out->indices + m, bb.entries + ref->start, ref->count * sizeof(size_t));
        m += ref->count;
    }
    out->starts[bb.nruns] = m;
    out->nbuckets = bb.nruns;
    free(bb.next);
    free(bb.entries);
    free(bb.runs);
    return DDP_OK;
}

/* The initial visiting order of config.bucket_layout over kept parameters (reverse registration
 * order for last-first, registration order for c10d's rule, whose list is then reversed). */
static void initial_order(const ddp_reducer_t *r, size_t *order, int *reverse_list)
{
    int c10d = r->config.bucket_layout == DDP_BUCKET_LAYOUT_C10D;
    for (size_t i = 0; i < r->nparams; i++) order[i] = c10d ? i : r->nparams - 1 - i;
    *reverse_list = c10d;
}

/* DDP_GRAD_MEMORY_BLOCK: lays the block out in the order of the ordinary initial buckets (each
 * bucket's parameters adjacent in its visiting order, every bucket 64-byte aligned), so that the
 * block's initial runs are exactly those buckets, and allocates it collectively. */
static ddp_status_t layout_block(ddp_reducer_t *r, const ddp_bucket_assignment_t *a)
{
    size_t off = 0;
    for (size_t b = 0; b < a->nbuckets; b++) {
        off = (off + 63) & ~(size_t)63;
        for (size_t j = a->starts[b]; j < a->starts[b + 1]; j++) {
            rparam_t *p = &r->params[a->indices[j]];
            if (p->sparse) continue;
            p->block_offset = off;
            off += param_bytes(p);
        }
    }
    r->block_bytes = off;
    if (off == 0) return DDP_OK; /* only empty or sparse parameters */
    void *block = NULL;
    ddp_status_t status = ddp_group_alloc_buffer(r->group, off, &block);
    if (status != DDP_OK)
        return ddp__error_context(status, "allocating the gradient block (%zu bytes)", off);
    r->block = block;
    r->block_owned = 1;
    /* Results are read by the optimizer after the rest of backward, not at once. */
    ddp__group_advise_cold_results(r->group, r->block);
    return DDP_OK;
}

/* Collective, at the rebuild (with pieces): each bucket's pieces are launched from now on in the
 * order rank 0's became complete in the recording iteration (the last row mark touching a piece
 * completes it; ties keep index order), broadcast so that every rank issues the same
 * collectives. */
typedef struct piece_key {
    size_t key, index;
} piece_key_t;

static int compare_piece_keys(const void *a, const void *b)
{
    const piece_key_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index ? 1 : 0;
}

static ddp_status_t order_pieces(ddp_reducer_t *r)
{
    size_t total = 0, most = 0;
    for (size_t b = 0; b < r->nbuckets; b++) {
        total += r->buckets[b].npieces;
        if (r->buckets[b].npieces > most) most = r->buckets[b].npieces;
    }
    if (total == 0) return DDP_OK;
    int64_t *order = ddp__calloc(total, sizeof(int64_t), "rebuild");
    size_t *keys = ddp__calloc(total, sizeof(size_t), "rebuild");
    piece_key_t *sorted = ddp__malloc(most * sizeof *sorted, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!order || !keys || !sorted) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    if (r->rank == r->rebuild_root) {
        size_t *first = ddp__malloc(r->nbuckets * sizeof(size_t), "rebuild");
        if (!first) {
            status = DDP_ERR_NO_MEMORY;
            goto done;
        }
        for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
            first[b] = at;
            at += r->buckets[b].npieces;
        }
        /* Marks are in completion order, so the last one touching a piece sets its key. */
        for (size_t f = 0; f < r->nfinals; f++) {
            const rparam_t *p = &r->params[r->finals[f].param];
            bucket_t *k = &r->buckets[p->bucket];
            if (!k->npieces || r->finals[f].begin == r->finals[f].end) continue;
            size_t lo = p->offset + r->finals[f].begin, hi = p->offset + r->finals[f].end;
            size_t step = k->pieces[0].numel;
            for (size_t i = lo / step; i < k->npieces && k->pieces[i].begin < hi; i++)
                keys[first[k->index] + i] = f + 1;
        }
        for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
            bucket_t *k = &r->buckets[b];
            for (size_t i = 0; i < k->npieces; i++) {
                sorted[i].key = keys[at + i];
                sorted[i].index = i;
            }
            qsort(sorted, k->npieces, sizeof *sorted, compare_piece_keys);
            for (size_t i = 0; i < k->npieces; i++) order[at + i] = (int64_t)sorted[i].index;
            at += k->npieces;
        }
        free(first);
    }
    status = ddp_group_broadcast(r->group, order, total, DDP_I64, r->rebuild_root);
    if (status != DDP_OK) {
        ddp__error_context(status, "rebuilding buckets (broadcast of rank %d's piece order)",
                           r->rebuild_root);
        goto done;
    }
    for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        unsigned char *seen = (unsigned char *)keys; /* reused: at least npieces bytes */
        memset(seen, 0, k->npieces);
        for (size_t i = 0; i < k->npieces; i++) {
            int64_t v = order[at + i];
            if (v < 0 || (size_t)v >= k->npieces || seen[v]) {
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank 0's piece order of bucket %zu is "
                                    "not a permutation",
                                    b);
                goto done;
            }
            seen[v] = 1;
            k->piece_order[i] = (size_t)v;
        }
        at += k->npieces;
    }
done:
    free(order);
    free(keys);
    free(sorted);
    return status;
}

/* ---- stacked tensors: pieces along rank 0's row ranges, one launch order for all buckets ----
 *
 * llm.c keeps each kind of weight of all L layers in one (L, ...) tensor, and its backward makes
 * layer l's rows of every such tensor final at once, from the last layer down. Bucket by bucket,
 * a bucket holding any stacked tensor is complete only when layer 0 is, so nothing after it
 * could start before the end of backward, whatever its own pieces' order. So at the rebuild,
 * rank 0's recording iteration (every row range in the order it became final) decides, for
 * every bucket with pieces:
 *   - where its pieces are cut: at the boundaries of the row ranges marked (a segment is one
 *     range of one call), a segment larger than piece_bytes split into equal parts.
 *     Neighbouring segments share a piece, up to piece_bytes, when they became final one right
 *     after the other among the bucket's segments (a matrix's consecutive row blocks, whole
 *     tensors in arrival order: what fixed-size pieces would have merged anyway, and each
 *     piece is one more collective), or when both are small (under piece_bytes / 16: a layer's
 *     rows of a stacked bias cost less as part of one piece than as a collective of their
 *     own). Two layers of one stacked tensor are not consecutive when the bucket holds other
 *     tensors' rows of the layers between, so they stay apart;
 *   - when each piece is launched: every piece, and every bucket without pieces (sparse, empty),
 *     gets the position at which its last element became final, and all of them go in one
 *     schedule sorted by it (ties in bucket, then piece, order).
 * Launching stays strict, in the schedule's order instead of bucket after bucket, and the
 * schedule is broadcast from rank 0, so every rank issues the same collectives in the same order.
 * Which element each collective reduces is fixed as before, so results are bitwise those of
 * whole buckets. Bucket boundaries no longer hold anything back: a 1 MiB first bucket of
 * layer 0's rows only delays those rows. */

typedef struct segment {
    size_t lo, hi; /* element range in the bucket */
    size_t key;    /* 1 + position in rank 0's recording; later than all for a gap */
    size_t rank;   /* its place among the bucket's segments sorted by key */
} segment_t;

static int compare_segments_by_lo(const void *a, const void *b)
{
    const segment_t *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

/* A segment's key and place, sorted to rank the segments (qsort has no context argument, and
 * two reducers may rebuild on two threads at once: no global to point into the segments). */
typedef struct segment_ref {
    size_t key, lo, index;
} segment_ref_t;

static int compare_segment_refs(const void *a, const void *b)
{
    const segment_ref_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

static size_t units_of(const bucket_t *k) { return k->npieces ? k->npieces : 1; }

ddp_status_t ddp__reducer_size_launch_log(ddp_reducer_t *r)
{
    size_t n = 0;
    for (size_t b = 0; b < r->nbuckets; b++) n += units_of(&r->buckets[b]);
    if (n <= r->launch_cap && r->launch_log) return DDP_OK;
    launch_record_t *log = ddp__calloc(n ? n : 1, sizeof *log, "reducer");
    ddp_reduction_stats_t *st = ddp__calloc(n ? n : 1, sizeof *st, "reducer");
    if (!log || !st) {
        free(log);
        free(st);
        return DDP_ERR_NO_MEMORY;
    }
    free(r->launch_log);
    free(r->reduction_stats);
    r->launch_log = log;
    r->reduction_stats = st;
    r->launch_cap = n;
    r->have_stats = 0;
    return DDP_OK;
}

/* Rank 0: bucket k's segments (sorted by lo, gaps filled, ranked) cut into pieces: their first
 * elements into begins and their keys into keys; returns how many. */
static size_t cut_pieces(segment_t *segs, size_t n, size_t step, int64_t *begins, size_t *keys)
{
    size_t small = step / 16 ? step / 16 : 1, count = 0;
    int open = 0;
    size_t cur_n = 0, cur_key = 0, cur_rank = 0;
    for (size_t i = 0; i < n; i++) {
        const segment_t *g = &segs[i];
        size_t len = g->hi - g->lo;
        int next = g->rank == cur_rank + 1 || g->rank + 1 == cur_rank;
        if (open && cur_n + len <= step &&
            (next || (cur_n < small && len < small))) {
            cur_n += len;
            if (g->key > cur_key) cur_key = g->key;
            cur_rank = g->rank;
            continue;
        }
        if (open) keys[count++] = cur_key;
        size_t parts = (len + step - 1) / step;
        for (size_t j = 0; j < parts; j++) {
            begins[count] = (int64_t)(g->lo + len * j / parts);
            if (j + 1 < parts) keys[count++] = g->key;
        }
        open = 1;
        cur_n = g->hi - (size_t)begins[count];
        cur_key = g->key;
        cur_rank = g->rank;
    }
    if (open) keys[count++] = cur_key;
    return count;
}

typedef struct unit_key {
    size_t key, unit;
} unit_key_t;

static int compare_unit_keys(const void *a, const void *b)
{
    const unit_key_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->unit < y->unit ? -1 : x->unit > y->unit ? 1 : 0;
}

/* Rank 0: fills counts (pieces per bucket, 0 for buckets without), and returns the payload:
 * every bucket's piece begins, then the schedule as unit numbers (bucket b's units are numbered
 * after those of the buckets before it). */
static ddp_status_t plan_schedule(ddp_reducer_t *r, int64_t *counts, int64_t **payload,
                                  size_t *payload_len)
{
    size_t nb = r->nbuckets, nf = r->nfinals, np = r->nparams;
    ddp_status_t status = DDP_OK;
    size_t *complete_key = ddp__calloc(np ? np : 1, sizeof(size_t), "rebuild");
    size_t *seg_count = ddp__calloc(nb ? nb : 1, sizeof(size_t), "rebuild");
    size_t *seg_first = ddp__calloc(nb + 1, sizeof(size_t), "rebuild");
    segment_t *segs = ddp__malloc((nf ? nf : 1) * sizeof *segs, "rebuild");
    segment_t *filled = NULL;
    segment_ref_t *refs = NULL;
    size_t *keys = NULL;
    int64_t *begins = NULL, *out = NULL;
    unit_key_t *units = NULL;
    if (!complete_key || !seg_count || !seg_first || !segs) goto no_memory;
    /* Segments by bucket; completion events give pieceless buckets their keys. */
    for (size_t f = 0; f < nf; f++) {
        const rparam_t *p = &r->params[r->finals[f].param];
        if (r->finals[f].begin == r->finals[f].end) {
            complete_key[r->finals[f].param] = f + 1;
            continue;
        }
        if (r->buckets[p->bucket].npieces) seg_count[p->bucket]++;
    }
    for (size_t b = 0; b < nb; b++) seg_first[b + 1] = seg_first[b] + seg_count[b];
    memset(seg_count, 0, nb * sizeof(size_t));
    for (size_t f = 0; f < nf; f++) {
        const rparam_t *p = &r->params[r->finals[f].param];
        if (r->finals[f].begin == r->finals[f].end || !r->buckets[p->bucket].npieces) continue;
        segment_t *g = &segs[seg_first[p->bucket] + seg_count[p->bucket]++];
        g->lo = p->offset + r->finals[f].begin;
        g->hi = p->offset + r->finals[f].end;
        g->key = f + 1;
    }
    size_t most = 0;
    for (size_t b = 0; b < nb; b++)
        if (seg_count[b] > most) most = seg_count[b];
    /* At most 2n + 1 segments once gaps are filled; pieces: at most one per element. */
    filled = ddp__malloc((2 * most + 1) * sizeof *filled, "rebuild");
    refs = ddp__malloc((2 * most + 1) * sizeof *refs, "rebuild");
    size_t cap_pieces = 0;
    for (size_t b = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (!k->npieces) continue;
        size_t step = k->pieces[0].numel; /* the grid's: piece_bytes in elements */
        cap_pieces += 2 * seg_count[b] + 1 + k->numel / step + 1;
    }
    begins = ddp__malloc((cap_pieces ? cap_pieces : 1) * sizeof *begins, "rebuild");
    keys = ddp__malloc((cap_pieces ? cap_pieces : 1) * sizeof *keys, "rebuild");
    if (!filled || !refs || !begins || !keys) goto no_memory;
    size_t npieces_all = 0, nunits = 0;
    for (size_t b = 0; b < nb; b++) {
        bucket_t *k = &r->buckets[b];
        counts[b] = 0;
        if (!k->npieces) {
            nunits++;
            continue;
        }
        segment_t *g = segs + seg_first[b];
        size_t n = seg_count[b], m = 0, pos = 0;
        qsort(g, n, sizeof *g, compare_segments_by_lo);
        for (size_t i = 0; i < n; i++) {
            size_t lo = g[i].lo < pos ? pos : g[i].lo; /* overlaps cannot happen: be safe */
            if (g[i].hi <= lo) continue;
            if (lo > pos) filled[m++] = (segment_t){pos, lo, (size_t)-1, 0};
            filled[m++] = (segment_t){lo, g[i].hi, g[i].key, 0};
            pos = g[i].hi;
        }
        if (pos < k->numel) filled[m++] = (segment_t){pos, k->numel, (size_t)-1, 0};
        for (size_t i = 0; i < m; i++) refs[i] = (segment_ref_t){filled[i].key, filled[i].lo, i};
        qsort(refs, m, sizeof *refs, compare_segment_refs);
        for (size_t i = 0; i < m; i++) filled[refs[i].index].rank = i;
        size_t step = k->pieces[0].numel;
        size_t c = cut_pieces(filled, m, step, begins + npieces_all, keys + npieces_all);
        counts[b] = (int64_t)c;
        npieces_all += c;
        nunits += c;
    }
    units = ddp__malloc((nunits ? nunits : 1) * sizeof *units, "rebuild");
    out = ddp__malloc((npieces_all + nunits + 1) * sizeof *out, "rebuild");
    if (!units || !out) goto no_memory;
    for (size_t b = 0, u = 0, at = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (!counts[b]) {
            size_t key = 0;
            for (size_t j = 0; j < k->nparams; j++)
                if (complete_key[k->params[j]] > key) key = complete_key[k->params[j]];
            units[u] = (unit_key_t){key, u};
            u++;
            continue;
        }
        for (size_t i = 0; i < (size_t)counts[b]; i++, u++, at++)
            units[u] = (unit_key_t){keys[at], u};
    }
    qsort(units, nunits, sizeof *units, compare_unit_keys);
    memcpy(out, begins, npieces_all * sizeof *out);
    for (size_t u = 0; u < nunits; u++) out[npieces_all + u] = (int64_t)units[u].unit;
    *payload = out;
    *payload_len = npieces_all + nunits;
    out = NULL;
    goto done;
no_memory:
    status = DDP_ERR_NO_MEMORY;
done:
    free(complete_key);
    free(seg_count);
    free(seg_first);
    free(segs);
    free(filled);
    free(refs);
    free(keys);
    free(begins);
    free(units);
    free(out);
    return status;
}

/* Every rank: checks rank 0's plan and installs it (new pieces, each bucket's piece order, the
 * schedule). */
static ddp_status_t install_schedule(ddp_reducer_t *r, const int64_t *counts,
                                     const int64_t *payload, size_t npieces_all, size_t nunits)
{
    size_t nb = r->nbuckets;
    launch_unit_t *schedule = ddp__malloc((nunits ? nunits : 1) * sizeof *schedule, "rebuild");
    launch_unit_t *unit_of = ddp__malloc((nunits ? nunits : 1) * sizeof *unit_of, "rebuild");
    unsigned char *seen = ddp__calloc(nunits ? nunits : 1, 1, "rebuild");
    piece_t **pieces = ddp__calloc(nb ? nb : 1, sizeof *pieces, "rebuild");
    size_t **orders = ddp__calloc(nb ? nb : 1, sizeof *orders, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!schedule || !unit_of || !seen || !pieces || !orders) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t b = 0, u = 0, at = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        size_t c = (size_t)counts[b];
        if (!k->npieces) {
            unit_of[u++] = (launch_unit_t){b, DDP__WHOLE};
            continue;
        }
        pieces[b] = ddp__calloc(c, sizeof(piece_t), "rebuild");
        orders[b] = ddp__malloc(c * sizeof(size_t), "rebuild");
        if (!pieces[b] || !orders[b]) {
            status = DDP_ERR_NO_MEMORY;
            goto done;
        }
        for (size_t i = 0; i < c; i++, u++, at++) {
            size_t begin = (size_t)payload[at];
            size_t end = i + 1 < c ? (size_t)payload[at + 1] : k->numel;
            if ((i == 0 && begin != 0) || payload[at] < 0 || end <= begin || end > k->numel) {
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank %d's pieces of bucket %zu do not "
                                    "cover it in order (piece %zu)",
                                    r->rebuild_root, b, i);
                goto done;
            }
            piece_t *q = &pieces[b][i];
            q->bucket = &r->buckets[b];
            q->index = i;
            q->begin = begin;
            q->numel = end - begin;
            unit_of[u] = (launch_unit_t){b, i};
        }
    }
    for (size_t b = 0; b < nb; b++) r->buckets[b].next_piece = 0;
    for (size_t j = 0; j < nunits; j++) {
        int64_t v = payload[npieces_all + j];
        if (v < 0 || (size_t)v >= nunits || seen[v]) {
            status = ddp__error(DDP_ERR_PROTOCOL,
                                "rebuilding buckets: rank %d's launch schedule is not a "
                                "permutation (entry %zu)",
                                r->rebuild_root, j);
            goto done;
        }
        seen[v] = 1;
        schedule[j] = unit_of[v];
        launch_unit_t x = schedule[j];
        if (x.piece != DDP__WHOLE) orders[x.bucket][r->buckets[x.bucket].next_piece++] = x.piece;
    }
    for (size_t b = 0; b < nb; b++) {
        bucket_t *k = &r->buckets[b];
        k->next_piece = 0;
        if (!k->npieces) continue;
        free(k->pieces);
        free(k->piece_order);
        k->pieces = pieces[b];
        k->piece_order = orders[b];
        k->npieces = (size_t)counts[b];
        pieces[b] = NULL;
        orders[b] = NULL;
    }
    free(r->schedule);
    r->schedule = schedule;
    r->nschedule = nunits;
    r->next_unit = 0;
    schedule = NULL;
done:
    for (size_t b = 0; b < nb && pieces && orders; b++) {
        free(pieces[b]);
        free(orders[b]);
    }
    free(pieces);
    free(orders);
    free(schedule);
    free(unit_of);
    free(seen);
    return status;
}

/* Collective, at the rebuild (with pieces): rank 0 (rebuild_root) plans the pieces and the
 * schedule from its recording, broadcasts them in two steps (the counts, then the begins and
 * the schedule), and every rank installs them. */
static ddp_status_t schedule_pieces(ddp_reducer_t *r)
{
    size_t nb = r->nbuckets, any = 0;
    for (size_t b = 0; b < nb; b++) any += r->buckets[b].npieces;
    if (any == 0) return DDP_OK;
    int64_t *counts = ddp__calloc(nb, sizeof(int64_t), "rebuild");
    int64_t *payload = NULL;
    size_t len = 0;
    ddp_status_t status = counts ? DDP_OK : DDP_ERR_NO_MEMORY;
    /* A failure to plan on rank 0 must not leave the others waiting in the broadcast: it sends
     * -1 counts, and every rank fails. */
    if (status == DDP_OK && r->rank == r->rebuild_root) {
        status = plan_schedule(r, counts, &payload, &len);
        if (status != DDP_OK)
            for (size_t b = 0; b < nb; b++) counts[b] = -1;
    }
    if (!counts) goto done;
    ddp_status_t s = ddp_group_broadcast(r->group, counts, nb, DDP_I64, r->rebuild_root);
    if (s != DDP_OK) {
        status = ddp__error_context(s, "rebuilding buckets (broadcast of rank %d's pieces)",
                                    r->rebuild_root);
        goto done;
    }
    size_t npieces_all = 0, nunits = 0;
    for (size_t b = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (counts[b] < 0 || (k->npieces && (counts[b] == 0 || (size_t)counts[b] > k->numel)) ||
            (!k->npieces && counts[b] != 0)) {
            if (status == DDP_OK)
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank %d could not plan the pieces of "
                                    "bucket %zu (count %lld)",
                                    r->rebuild_root, b, (long long)counts[b]);
            goto done;
        }
        npieces_all += (size_t)counts[b];
        nunits += k->npieces ? (size_t)counts[b] : 1;
    }
    if (r->rank != r->rebuild_root) {
        len = npieces_all + nunits;
        payload = ddp__malloc((len ? len : 1) * sizeof *payload, "rebuild");
        if (!payload) {
            status = DDP_ERR_NO_MEMORY; /* the peers then wait until the timeout */
            goto done;
        }
    }
    s = ddp_group_broadcast(r->group, payload, len, DDP_I64, r->rebuild_root);
    if (s != DDP_OK) {
        status = ddp__error_context(s, "rebuilding buckets (broadcast of rank %d's schedule)",
                                    r->rebuild_root);
        goto done;
    }
    status = install_schedule(r, counts, payload, npieces_all, nunits);
done:
    free(counts);
    free(payload);
    return status;
}

/* Whether the rebuild plans pieces and their schedule from rank 0's record (buckets with pieces:
 * piece_bytes > 0 and the default hook). */
static int schedules_pieces(const ddp_reducer_t *r)
{
    return DDP__READINESS_SCHEDULE && r->config.piece_bytes > 0 && !r->config.comm_hook;
}

typedef struct place {
    int sparse;
    size_t offset, index;
} place_t;

static int compare_places(const void *a, const void *b)
{
    const place_t *x = a, *y = b;
    if (x->sparse != y->sparse) return x->sparse - y->sparse;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index ? 1 : 0;
}

/* Block modes with a schedule: the visiting order for the rebuild's runs is the block's own
 * (address order; sparse parameters, which are not in the block, last). When pieces launch in
 * completion order across buckets, a bucket is only a run of memory that pieces do not cross,
 * and visiting in arrival order would make the runs depend on the order in which a layer's
 * rows are marked (a run closes when the next parameter to arrive is not adjacent: llm.c's
 * backward order gave 7 buckets, block order 2, for one layout). */
static ddp_status_t address_order(const ddp_reducer_t *r, size_t *order)
{
    place_t *v = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof *v, "rebuild");
    if (!v) return DDP_ERR_NO_MEMORY;
    for (size_t k = 0; k < r->nparams; k++)
        v[k] = (place_t){r->params[k].sparse, r->params[k].sparse ? 0 : r->params[k].block_offset,
                         k};
    qsort(v, r->nparams, sizeof *v, compare_places);
    for (size_t k = 0; k < r->nparams; k++) order[k] = v[k].index;
    free(v);
    return DDP_OK;
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
    if (block_mode(r) && schedules_pieces(r)) status = address_order(r, order);
    if (status != DDP_OK) goto done;
    status = block_mode(r) ? block_assign(r, order, 0, &a) : assign(r, order, &a);
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
    if (status == DDP_OK) status = schedules_pieces(r) ? schedule_pieces(r) : order_pieces(r);
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
    ddp_status_t status = assign(r, NULL, &a);
    if (status != DDP_OK) return status;
    if (block_mode(r)) {
        if (r->config.grad_memory == DDP_GRAD_MEMORY_BLOCK) {
            status = layout_block(r, &a);
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
        initial_order(r, order, &reverse_list);
        status = block_assign(r, order, reverse_list, &a);
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
