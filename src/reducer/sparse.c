/* Sparse gradients: rows given with ddp_reducer_sparse_grad accumulate until a synchronised
 * iteration, whose sparse bucket is reduced on the progress thread (allgather of row counts,
 * indices and rows, then rows with equal indices merged); the averaged rows are read with
 * ddp_reducer_sparse_result and become the gradient later iterations accumulate on. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Sparse reduction on the progress thread: gather row counts, then indices and rows padded to
 * the largest count, then merge rows with equal indices (summed in rank order, identically on
 * every rank) and divide by the world size. */
ddp_status_t ddp__reducer_sparse_task(ddp_group_t *group, void *arg)
{
    bucket_t *b = arg;
    ddp_reducer_t *r = b->owner;
    rparam_t *p = &r->params[b->params[0]];
    int world = ddp_group_size(group);
    size_t rb = row_bytes(p), width = p->numel / p->rows;
    int64_t mine = p->contribute ? (int64_t)p->pending_rows : 0;
    int64_t *counts = ddp__malloc((size_t)world * sizeof(int64_t), "sparse reduction");
    if (!counts) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp_group_allgather(group, &mine, counts, 1, DDP_I64);
    if (s != DDP_OK) {
        free(counts);
        return s;
    }
    size_t maxrows = 0, total = 0;
    for (int q = 0; q < world; q++) {
        if ((size_t)counts[q] > maxrows) maxrows = (size_t)counts[q];
        total += (size_t)counts[q];
    }
    size_t slots = maxrows ? maxrows : 1;
    int64_t *idx_send = ddp__calloc(slots, sizeof(int64_t), "sparse reduction");
    int64_t *idx_all = ddp__calloc(slots * (size_t)world, sizeof(int64_t), "sparse reduction");
    unsigned char *val_send = ddp__calloc(slots, rb ? rb : 1, "sparse reduction");
    unsigned char *val_all = ddp__calloc(slots * (size_t)world, rb ? rb : 1, "sparse reduction");
    size_t *perm = ddp__malloc((total ? total : 1) * sizeof(size_t), "sparse reduction");
    int64_t *out_idx = ddp__malloc((total ? total : 1) * sizeof(int64_t), "sparse reduction");
    unsigned char *out_val = ddp__calloc(total ? total : 1, rb ? rb : 1, "sparse reduction");
    double *acc = ddp__calloc(width ? width : 1, sizeof(double), "sparse reduction");
    if (!idx_send || !idx_all || !val_send || !val_all || !perm || !out_idx || !out_val || !acc) {
        s = DDP_ERR_NO_MEMORY;
        goto done;
    }
    if (mine) {
        memcpy(idx_send, p->pending_index, (size_t)mine * sizeof(int64_t));
        memcpy(val_send, p->pending_values, (size_t)mine * rb);
    }
    s = ddp_group_allgather(group, idx_send, idx_all, maxrows, DDP_I64);
    if (s == DDP_OK)
        s = ddp_group_allgather(group, val_send, val_all, maxrows * width, p->dtype);
    if (s != DDP_OK) goto done;

    /* Sort the gathered rows by index; ties keep rank order, then local order (insertion sort
     * on a list that is usually short; a stable merge keeps results identical on all ranks). */
    size_t n = 0;
    for (int q = 0; q < world; q++)
        for (size_t j = 0; j < (size_t)counts[q]; j++) perm[n++] = (size_t)q * maxrows + j;
    for (size_t i = 1; i < n; i++) {
        size_t v = perm[i], j = i;
        while (j > 0 && idx_all[perm[j - 1]] > idx_all[v]) {
            perm[j] = perm[j - 1];
            j--;
        }
        perm[j] = v;
    }
    size_t nout = 0;
    for (size_t i = 0; i < n;) {
        int64_t row = idx_all[perm[i]];
        memset(acc, 0, width * sizeof(double));
        for (; i < n && idx_all[perm[i]] == row; i++)
            for (size_t e = 0; e < width; e++) acc[e] += load(p->dtype, val_all + perm[i] * rb, e);
        out_idx[nout] = row;
        for (size_t e = 0; e < width; e++)
            store(p->dtype, out_val + nout * rb, e, acc[e] / (double)world);
        nout++;
    }
    p->result_index = out_idx;
    p->result_values = out_val;
    p->result_rows = nout;
    out_idx = NULL;
    out_val = NULL;
done:
    free(counts);
    free(idx_send);
    free(idx_all);
    free(val_send);
    free(val_all);
    free(perm);
    free(out_idx);
    free(out_val);
    free(acc);
    return s;
}

ddp_status_t ddp_reducer_sparse_grad(ddp_reducer_t *r, size_t index, const int64_t *indices,
                                     const void *values, size_t nrows)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = ddp__reducer_lookup(r, index, "ddp_reducer_sparse_grad", &p, &k);
    if (s != DDP_OK) return s;
    if (!p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s' (index %zu) is dense: use ddp_reducer_grad and "
                          "ddp_reducer_grad_ready",
                          p->name, index);
    if (nrows > 0 && !indices)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': indices is NULL", p->name);
    /* More rows than memory can hold: reject before reading indices[nrows - 1]. */
    if (nrows > PTRDIFF_MAX / 2 / (row_bytes(p) > sizeof(int64_t) ? row_bytes(p) : sizeof(int64_t)))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': nrows %zu is too large",
                          p->name, nrows);
    if (nrows > 0 && !values)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': values is NULL", p->name);
    for (size_t i = 0; i < nrows; i++)
        if (indices[i] < 0 || (uint64_t)indices[i] >= p->rows)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s': indices[%zu] = %lld is outside its %zu rows",
                              p->name, i, (long long)indices[i], p->rows);
    if ((s = ddp__reducer_check_active(r, "ddp_reducer_sparse_grad")) != DDP_OK) return s;
    r->ready_calls++;
    if (r->marked[k]) return ddp__reducer_mark_ready(r, k); /* the twice error */
    size_t rb = row_bytes(p);
    if (p->pending_rows + nrows > p->pending_cap) {
        size_t cap = (p->pending_rows + nrows) * 2;
        int64_t *ni = realloc(p->pending_index, cap * sizeof(int64_t));
        if (ni) p->pending_index = ni;
        unsigned char *nv = realloc(p->pending_values, cap * (rb ? rb : 1));
        if (nv) p->pending_values = nv;
        if (!ni || !nv) return ddp__error(DDP_ERR_NO_MEMORY, "sparse gradient of '%s'", p->name);
        p->pending_cap = cap;
    }
    if (nrows) {
        memcpy(p->pending_index + p->pending_rows, indices, nrows * sizeof(int64_t));
        memcpy(p->pending_values + p->pending_rows * rb, values, nrows * rb);
    }
    p->pending_rows += nrows;
    return ddp__reducer_mark_ready(r, k);
}

ddp_status_t ddp_reducer_sparse_result(ddp_reducer_t *r, size_t index, const int64_t **indices,
                                       const void **values, size_t *nrows)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = ddp__reducer_lookup(r, index, "ddp_reducer_sparse_result", &p, &k);
    if (s != DDP_OK) return s;
    if (!indices || !values || !nrows)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_sparse_result: %s is NULL",
                          !indices ? "indices" : !values ? "values" : "nrows");
    if (!p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE, "parameter '%s' (index %zu) is dense", p->name,
                          index);
    if (r->active || !p->result_index)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s': no sparse result (it exists after a synchronised "
                          "ddp_reducer_finalize, until the next ddp_reducer_prepare)",
                          p->name);
    *indices = p->result_index;
    *values = p->result_values;
    *nrows = p->result_rows;
    return DDP_OK;
}

ddp_status_t ddp__reducer_keep_sparse_result(rparam_t *p)
{
    if (p->result_rows > p->pending_cap) {
        size_t rb = row_bytes(p);
        int64_t *ni = realloc(p->pending_index, p->result_rows * sizeof(int64_t));
        if (ni) p->pending_index = ni;
        unsigned char *nv = realloc(p->pending_values, p->result_rows * (rb ? rb : 1));
        if (nv) p->pending_values = nv;
        if (!ni || !nv) return ddp__error(DDP_ERR_NO_MEMORY, "sparse gradient of '%s'", p->name);
        p->pending_cap = p->result_rows;
    }
    memcpy(p->pending_index, p->result_index, p->result_rows * sizeof(int64_t));
    memcpy(p->pending_values, p->result_values, p->result_rows * row_bytes(p));
    p->pending_rows = p->result_rows;
    return DDP_OK;
}
