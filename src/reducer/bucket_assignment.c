/* Gradient bucket assignment, after c10d's compute_bucket_assignment_by_size.
 *
 * Tensors are visited in a given order and appended to an open bucket of their dtype; the bucket
 * closes as soon as its size reaches the dtype's current limit, and that dtype then moves on to
 * the next limit (the last one repeats). This is why the first bucket of each dtype is small
 * (1 MiB by default): the first gradients of backward start communicating early. Sparse tensors
 * each get a bucket of their own. Open buckets are closed at the end, and the buckets are sorted
 * (by their smallest tensor index, or for a rebuild by their earliest visiting position) so that
 * they become ready in consecutive order during backward. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "reducer/reducer_internal.h"

typedef struct built_bucket {
    size_t first; /* offset of its first entry in the shared index list */
    size_t count;
    size_t key;   /* sort key: smallest index or smallest position */
} built_bucket_t;

typedef struct open_bucket {
    size_t *indices; /* indices of the open bucket, in visiting order */
    size_t *positions;
    size_t count;
    size_t bytes;
    size_t limit_index; /* which limit applies to this dtype's next bucket */
} open_bucket_t;

typedef struct builder {
    size_t *entries; /* every tensor index, bucket after bucket as they close */
    size_t nentries;
    built_bucket_t *buckets;
    size_t nbuckets;
    int sort_key;
} builder_t;

static void close_bucket(builder_t *b, const size_t *indices, const size_t *positions,
                         size_t count)
{
    built_bucket_t *bucket = &b->buckets[b->nbuckets++];
    bucket->first = b->nentries;
    bucket->count = count;
    bucket->key = (size_t)-1;
    for (size_t i = 0; i < count; i++) {
        b->entries[b->nentries++] = indices[i];
        size_t key = b->sort_key == DDP__SORT_BY_INDEX ? indices[i] : positions[i];
        if (key < bucket->key) bucket->key = key;
    }
}

static int compare_buckets(const void *a, const void *b)
{
    const built_bucket_t *x = a, *y = b;
    return x->key < y->key ? -1 : x->key > y->key ? 1 : 0;
}

ddp_status_t ddp__bucket_assignment(const ddp_param_t *params, size_t nparams,
                                    const size_t *limits, size_t nlimits, const size_t *order,
                                    int sort_key, ddp_bucket_assignment_t *out)
{
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (nparams > 0 && !params)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL but nparams is %zu", nparams);
    if (!limits || nlimits == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "limits: at least one bucket size limit is required (got %s, %zu)",
                          limits ? "an array" : "NULL", nlimits);
    for (size_t i = 0; i < nparams; i++) {
        if ((unsigned)params[i].dtype >= DDP_DTYPE_COUNT)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params[%zu] ('%s'): invalid dtype %d", i,
                              params[i].name ? params[i].name : "(unnamed)",
                              (int)params[i].dtype);
        if (params[i].numel > PTRDIFF_MAX / ddp_dtype_size(params[i].dtype))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params[%zu] ('%s'): numel %zu is too large",
                              i, params[i].name ? params[i].name : "(unnamed)", params[i].numel);
    }

    ddp_status_t status = DDP_OK;
    unsigned char *seen = NULL;
    builder_t b = {0};
    b.sort_key = sort_key;
    open_bucket_t open[DDP_DTYPE_COUNT];
    memset(open, 0, sizeof open);
    size_t *starts = NULL, *indices = NULL;

    size_t alloc_n = nparams ? nparams : 1;
    seen = ddp__calloc(alloc_n, 1, "bucket assignment");
    b.entries = ddp__malloc(alloc_n * sizeof(size_t), "bucket assignment");
    b.buckets = ddp__malloc(alloc_n * sizeof(built_bucket_t), "bucket assignment");
    starts = ddp__malloc((alloc_n + 1) * sizeof(size_t), "bucket assignment");
    indices = ddp__malloc(alloc_n * sizeof(size_t), "bucket assignment");
    if (!seen || !b.entries || !b.buckets || !starts || !indices) {
        status = DDP_ERR_NO_MEMORY;
        goto free_all;
    }
    for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
        open[d].indices = ddp__malloc(alloc_n * sizeof(size_t), "bucket assignment");
        open[d].positions = ddp__malloc(alloc_n * sizeof(size_t), "bucket assignment");
        if (!open[d].indices || !open[d].positions) {
            status = DDP_ERR_NO_MEMORY;
            goto free_all;
        }
    }

    for (size_t pos = 0; pos < nparams; pos++) {
        size_t i = order ? order[pos] : pos;
        if (i >= nparams) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "order[%zu] = %zu is out of range (nparams is %zu)", pos, i,
                                nparams);
            goto free_all;
        }
        if (seen[i]) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "order[%zu] = %zu appears twice: order must be a permutation", pos,
                                i);
            goto free_all;
        }
        seen[i] = 1;
        if (params[i].sparse) {
            close_bucket(&b, &i, &pos, 1);
            continue;
        }
        open_bucket_t *o = &open[params[i].dtype];
        o->indices[o->count] = i;
        o->positions[o->count] = pos;
        o->count++;
        o->bytes += params[i].numel * ddp_dtype_size(params[i].dtype);
        if (o->bytes >= limits[o->limit_index]) {
            close_bucket(&b, o->indices, o->positions, o->count);
            o->count = 0;
            o->bytes = 0;
            if (o->limit_index + 1 < nlimits) o->limit_index++;
        }
    }
    for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
        if (open[d].count) close_bucket(&b, open[d].indices, open[d].positions, open[d].count);
    }
    /* Keys are unique (each tensor is in one bucket), so an unstable sort is deterministic. */
    qsort(b.buckets, b.nbuckets, sizeof *b.buckets, compare_buckets);

    size_t n = 0;
    for (size_t k = 0; k < b.nbuckets; k++) {
        starts[k] = n;
        memcpy(indices + n, b.entries + b.buckets[k].first, b.buckets[k].count * sizeof(size_t));
        n += b.buckets[k].count;
    }
    starts[b.nbuckets] = n;
    out->nbuckets = b.nbuckets;
    out->starts = starts;
    out->indices = indices;
    starts = indices = NULL;

free_all:
    for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
        free(open[d].indices);
        free(open[d].positions);
    }
    free(starts);
    free(indices);
    free(b.buckets);
    free(b.entries);
    free(seen);
    return status;
}

ddp_status_t ddp_compute_bucket_assignment(const ddp_param_t *params, size_t nparams,
                                           const size_t *limits, size_t nlimits,
                                           const size_t *order, ddp_bucket_assignment_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    return ddp__bucket_assignment(params, nparams, limits, nlimits, order, DDP__SORT_BY_INDEX,
                                  out);
}

void ddp__bucket_assignment_free(ddp_bucket_assignment_t *assignment)
{
    if (!assignment) return;
    free(assignment->starts);
    free(assignment->indices);
    assignment->starts = NULL;
    assignment->indices = NULL;
    assignment->nbuckets = 0;
}

void ddp_bucket_assignment_free(ddp_bucket_assignment_t *assignment)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    ddp__bucket_assignment_free(assignment);
}
