/* The Reducer's bucket layouts: which kept parameters share a bucket, in config.bucket_layout's
 * initial order or in rank 0's arrival order at the rebuild (c10d's size rule of
 * ddp__bucket_assignment), and in the block modes, which runs of the gradient block become
 * buckets. buckets.c turns a layout into bucket descriptors and memory. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Assignment over kept parameters: `order` NULL means the initial one of config.bucket_layout
 * (visited in reverse registration order, or for c10d's rule in registration order; either way
 * the list is then reversed); otherwise arrival order, sorted by arrival position. */
ddp_status_t ddp__reducer_assign(ddp_reducer_t *r, const size_t *order,
                                 ddp_bucket_assignment_t *out)
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

ddp_status_t ddp__reducer_block_assign(ddp_reducer_t *r, const size_t *order, int reverse_list,
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
void ddp__reducer_initial_order(const ddp_reducer_t *r, size_t *order, int *reverse_list)
{
    int c10d = r->config.bucket_layout == DDP_BUCKET_LAYOUT_C10D;
    for (size_t i = 0; i < r->nparams; i++) order[i] = c10d ? i : r->nparams - 1 - i;
    *reverse_list = c10d;
}

/* DDP_GRAD_MEMORY_BLOCK: lays the block out in the order of the ordinary initial buckets (each
 * bucket's parameters adjacent in its visiting order, every bucket 64-byte aligned), so that the
 * block's initial runs are exactly those buckets, and allocates it collectively. */
ddp_status_t ddp__reducer_layout_block(ddp_reducer_t *r, const ddp_bucket_assignment_t *a)
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
ddp_status_t ddp__reducer_address_order(const ddp_reducer_t *r, size_t *order)
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