/* One iteration of the Reducer up to finalize: prepare resets the marks (and rebuilds the buckets
 * once), each grad_ready marks a parameter (or grad_ready_rows some of its rows), and complete
 * buckets, or complete pieces of them, are handed to the comm hook strictly in bucket order so
 * that every rank issues the same collectives in the same order. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "reducer/reducer_internal.h"

/* Completion callbacks (progress thread): the done time is kept as the bits of a double, read
 * by finalize's statistics after the wait. */
static double stamp_done(_Atomic uint64_t *done_bits, _Atomic int *done_set)
{
    double t = ddp__now_us();
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    atomic_store(done_bits, bits);
    atomic_store(done_set, 1);
    return t;
}

static void on_bucket_done(void *arg, ddp_status_t status)
{
    (void)status;
    bucket_t *b = arg;
    double t = stamp_done(&b->done_bits, &b->done_set);
    if (b->owner->config.trace)
        ddp_trace_span(b->owner->config.trace, b->trace_name, "comm", DDP__COMM_LANE,
                       b->launch_us, t);
    atomic_fetch_sub(&b->owner->callbacks_pending, 1);
}

static void on_piece_done(void *arg, ddp_status_t status)
{
    (void)status;
    piece_t *q = arg;
    bucket_t *b = q->bucket;
    double t = stamp_done(&q->done_bits, &q->done_set);
    if (b->owner->config.trace) {
        char name[64];
        snprintf(name, sizeof name, "%s piece %zu/%zu", b->trace_name, q->index, b->npieces);
        ddp_trace_span(b->owner->config.trace, name, "comm", DDP__COMM_LANE, q->launch_us, t);
    }
    atomic_fetch_sub(&b->owner->callbacks_pending, 1);
}

/* The agreement of config.join: one allreduce (sum) of every rank's has-data flag and of the
 * count of ranks with data that synchronise, so that every rank learns the divisor and whether
 * this iteration communicates. */
static ddp_status_t agree(ddp_reducer_t *r, int has_data, int sync, int *sync_out)
{
    int64_t *v = r->join_flags;
    int w = r->world;
    for (int q = 0; q < w; q++) v[q] = q == r->rank ? has_data : 0;
    v[w] = has_data && sync;
    ddp_status_t s = ddp_group_allreduce(r->group, v, v, (size_t)w + 1, DDP_I64, DDP_SUM);
    if (s != DDP_OK)
        return ddp__error_context(s, "agreeing which ranks still have data (uneven inputs, "
                                     "after %llu synchronised iterations)",
                                  (unsigned long long)r->iteration);
    int n = 0, first = -1;
    for (int q = 0; q < w; q++) {
        if (v[q] != 0 && v[q] != 1)
            return ddp__error(DDP_ERR_PROTOCOL,
                              "uneven inputs: the agreement gave rank %d the flag %lld (expected 0 "
                              "or 1); config.join must be the same on every rank",
                              q, (long long)v[q]);
        if (v[q] && first < 0) first = q;
        n += (int)v[q];
    }
    if (v[w] != 0 && v[w] != n)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "uneven inputs: of the %d ranks with data, %lld synchronise this "
                          "iteration and the others not (after %llu synchronised iterations): "
                          "ddp_reducer_set_sync must be the same on every rank",
                          n, (long long)v[w], (unsigned long long)r->iteration);
    *sync_out = n > 0 && v[w] > 0;
    if (n > 0) {
        for (int q = 0; q < w; q++) r->join_prev[q] = (unsigned char)v[q];
        r->contributors = n;
        /* The recording iteration's arrival order comes from a rank that has data in it. */
        if (r->recording && *sync_out) r->rebuild_root = first;
    }
    r->post_divide = n > 0 && n < w && !r->config.comm_hook;
    return DDP_OK;
}

ddp_status_t ddp__reducer_start_collectives(ddp_reducer_t *r, int has_data, int sync,
                                            int *sync_out)
{
    ddp_status_t status;
    if (r->rebuild_due) {
        r->rebuild_due = 0;
        r->rebuilt = 1;
        status = ddp__reducer_rebuild(r);
        if (status != DDP_OK) return status;
    }
    if (r->config.broadcast_buffers && r->nbuffers > 0) {
        status = ddp__broadcast_coalesced(r->group, r->buffers, r->nbuffers,
                                          r->config.broadcast_bucket_bytes);
        if (status != DDP_OK) return status;
    }
    r->contributors = r->world;
    r->post_divide = 0;
    *sync_out = sync;
    if (r->config.join) return agree(r, has_data, sync, sync_out);
    return DDP_OK;
}

void ddp__reducer_reset_iteration(ddp_reducer_t *r)
{
    memset(r->marked, 0, r->nparams);
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        k->pending = k->nparams;
        k->launched = 0;
        k->ready_us = k->launch_us = 0;
        atomic_store(&k->done_set, 0);
        k->next_piece = 0;
        for (size_t i = 0; i < k->npieces; i++) {
            piece_t *q = &k->pieces[i];
            q->pending = q->numel;
            q->launch_us = 0;
            atomic_store(&q->done_set, 0);
        }
    }
    r->launches = 0;
    for (size_t i = 0; i < r->nparams; i++) {
        rparam_t *p = &r->params[i];
        free(p->result_index);
        free(p->result_values);
        p->result_index = NULL;
        p->result_values = NULL;
        p->result_rows = 0;
        if (p->rows_marked) memset(r->row_marks + p->row_base, 0, ready_rows(p));
        p->rows_marked = 0;
    }
    r->next_launch = 0;
    r->next_unit = 0;
    r->ready_calls = 0;
    r->finalizing = 0;
    r->local_error = 0;
    r->local_error_text[0] = '\0';
    r->first_ready_us = 0;
    r->narrival = 0;
    r->nfinals = 0;
}

ddp_status_t ddp_reducer_prepare(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (r->active && r->iter_sync)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_prepare: the previous synchronised iteration (after %llu "
                          "completed) was not finalized; call ddp_reducer_finalize after backward "
                          "(it waits for the bucket reductions every rank has started)",
                          (unsigned long long)r->iteration);
    r->active = 0;
    int sync = r->sync_enabled;
    ddp_status_t status = ddp__reducer_start_collectives(r, 1, r->sync_enabled, &sync);
    if (status != DDP_OK) return status;
    ddp__reducer_reset_iteration(r);
    r->iter_sync = sync;
    r->active = 1;
    return DDP_OK;
}

static ddp_status_t default_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                                 ddp_work_t **work)
{
    /* After a rank joined (uneven inputs) the divisor is not the world size: sum, and finalize
     * divides by the ranks with data. */
    const ddp_reducer_t *r = state;
    return ddp_group_allreduce_async(group, bucket->data, bucket->data, bucket->numel,
                                     bucket->dtype, r->post_divide ? DDP_SUM : DDP_AVG, work);
}

/* Statistics: the launch of bucket b's piece (or the whole bucket), in launch order. */
static void log_launch(ddp_reducer_t *r, const bucket_t *b, size_t piece)
{
    if (r->launches < r->launch_cap)
        r->launch_log[r->launches] =
            (launch_record_t){b->index, piece, r->ready_calls, r->finalizing};
    r->launches++;
}

/* The start of a launch of bucket b's piece (or the whole bucket): the bucket's launch time is
 * that of its first piece. Returns the launch time. */
static double begin_launch(ddp_reducer_t *r, bucket_t *b, size_t piece)
{
    double now = ddp__now_us();
    if (!b->launched || piece == DDP__WHOLE) {
        b->launched = 1;
        b->launch_us = now;
    }
    log_launch(r, b, piece);
    return now;
}

/* The end of a launch: counts the completion callback the wait waits for (if the work cannot
 * take one, the done time is taken at the wait). */
static void follow_work(ddp_reducer_t *r, ddp_work_t *work, ddp_work_callback_fn on_done, void *arg)
{
    atomic_fetch_add(&r->callbacks_pending, 1);
    if (ddp_work_on_complete(work, on_done, arg) != DDP_OK)
        atomic_fetch_sub(&r->callbacks_pending, 1);
}

static ddp_status_t launch(ddp_reducer_t *r, bucket_t *b)
{
    begin_launch(r, b, DDP__WHOLE);
    ddp_work_t *work = NULL;
    ddp_status_t s;
    if (b->sparse) {
        s = ddp_group_submit(r->group, ddp__reducer_sparse_task, b, &work);
    } else {
        /* A hook gets the bucket prescaled (c10d's div, then it sums) unless it averages
         * itself. The default hook averages inside the allreduce: the same result without a
         * pass over the bucket on the caller's (backward's) thread — the transports divide
         * once after summing, shm inside its reduction loop. */
        int prescaled = r->config.comm_hook && !r->config.comm_hook_averages;
        /* c10d's div_, f16/bf16 through f32 */
        if (prescaled && r->contributors > 1)
            ddp__divide_by(b->data, b->numel, b->dtype, r->contributors);
        ddp_comm_bucket_t *v = &b->view;
        v->index = b->index;
        v->data = b->data;
        v->numel = b->numel;
        v->dtype = b->dtype;
        v->nparams = b->nparams;
        v->params = b->registered;
        v->offsets = b->offsets;
        v->numels = b->numels;
        v->rows = b->rows;
        v->iteration = r->iteration;
        v->prescaled = prescaled;
        v->contributors = r->contributors;
        ddp_comm_hook_fn hook = r->config.comm_hook ? r->config.comm_hook : default_hook;
        s = hook(r->config.comm_hook ? r->config.comm_hook_state : r, r->group, v, &work);
        if (s == DDP_OK && !work)
            s = ddp__error(DDP_ERR_INVALID_USAGE, "the comm hook returned DDP_OK but no work");
    }
    if (s != DDP_OK) {
        ddp_work_free(work);
        return ddp__error_context(s, "launching the reduction of bucket %zu (iteration %llu)",
                                  b->index, (unsigned long long)r->iteration);
    }
    b->work = work;
    follow_work(r, work, on_bucket_done, b);
    return DDP_OK;
}

/* One piece: the default hook's allreduce on a sub-range of the bucket memory. */
static ddp_status_t launch_piece(ddp_reducer_t *r, bucket_t *b, piece_t *q)
{
    q->launch_us = begin_launch(r, b, q->index);
    size_t esize = ddp_dtype_size(b->dtype);
    unsigned char *data = (unsigned char *)b->data + q->begin * esize;
    ddp_work_t *work = NULL;
    ddp_status_t s = ddp_group_allreduce_async(r->group, data, data, q->numel, b->dtype,
                                               r->post_divide ? DDP_SUM : DDP_AVG, &work);
    if (s != DDP_OK) {
        ddp_work_free(work);
        return ddp__error_context(s,
                                  "launching the reduction of bucket %zu piece %zu of %zu "
                                  "(iteration %llu)",
                                  b->index, q->index, b->npieces, (unsigned long long)r->iteration);
    }
    q->work = work;
    follow_work(r, work, on_piece_done, q);
    return DDP_OK;
}

/* Launches complete buckets, or complete pieces of them, strictly in order: bucket b's pieces in
 * order, and nothing of bucket b + 1 before every piece of bucket b. */
ddp_status_t ddp__reducer_launch_in_order(ddp_reducer_t *r)
{
    /* After the rebuild with pieces: one schedule across buckets (piece_schedule.c, "stacked
     * tensors"), still strictly in order. */
    while (r->schedule && r->next_unit < r->nschedule) {
        launch_unit_t u = r->schedule[r->next_unit];
        bucket_t *b = &r->buckets[u.bucket];
        if (u.piece == DDP__WHOLE) {
            if (b->pending != 0) break;
            r->next_unit++;
            ddp_status_t s = launch(r, b);
            if (s != DDP_OK) return s;
        } else {
            if (b->pieces[u.piece].pending != 0) break;
            r->next_unit++;
            b->next_piece++;
            ddp_status_t s = launch_piece(r, b, &b->pieces[u.piece]);
            if (s != DDP_OK) return s;
        }
    }
    while (!r->schedule && r->next_launch < r->nbuckets) {
        bucket_t *b = &r->buckets[r->next_launch];
        if (b->npieces) {
            while (b->next_piece < b->npieces &&
                   b->pieces[b->piece_order[b->next_piece]].pending == 0) {
                ddp_status_t s = launch_piece(r, b, &b->pieces[b->piece_order[b->next_piece++]]);
                if (s != DDP_OK) return s;
            }
            if (b->next_piece < b->npieces) break;
            r->next_launch++;
        } else {
            if (b->pending != 0) break;
            r->next_launch++;
            ddp_status_t s = launch(r, b);
            if (s != DDP_OK) return s;
        }
    }
    return DDP_OK;
}

/* Elements [begin, end) of bucket b are final: count them off the pieces they overlap. */
void ddp__reducer_count_off(bucket_t *b, size_t begin, size_t end)
{
    if (!b->npieces || begin >= end) return;
    for (size_t i = ddp__piece_at(b, begin); i < b->npieces && b->pieces[i].begin < end; i++) {
        piece_t *q = &b->pieces[i];
        size_t lo = begin > q->begin ? begin : q->begin;
        size_t hi = end < q->begin + q->numel ? end : q->begin + q->numel;
        if (hi > lo) q->pending -= hi - lo;
    }
}

/* Whether rank 0 records the order in which rows became final now: in the recording iteration
 * when there are pieces, whose cuts and schedule the rebuild takes from it. */
static int recording_finals(const ddp_reducer_t *r)
{
    return r->recording && r->rank == r->rebuild_root && r->config.piece_bytes > 0 &&
           !r->config.comm_hook;
}

/* The recording iteration, rank 0: elements [begin, end) of p became final now. A failed
 * allocation only loses the piece order (pieces then keep ascending order). */
static void record_final(ddp_reducer_t *r, const rparam_t *p, size_t begin, size_t end)
{
    if (r->nfinals == r->finals_cap) {
        size_t cap = r->finals_cap ? 2 * r->finals_cap : 64;
        void *grown = realloc(r->finals, cap * sizeof *r->finals);
        if (!grown) return;
        r->finals = grown;
        r->finals_cap = cap;
    }
    r->finals[r->nfinals].param = (size_t)(p - r->params);
    r->finals[r->nfinals].begin = begin;
    r->finals[r->nfinals].end = end;
    r->nfinals++;
}

/* Rows [lo, hi) of parameter p became final in a synchronised iteration: take them from the
 * user's gradient and count their elements off the pieces. */
static void rows_final(ddp_reducer_t *r, rparam_t *p, size_t lo, size_t hi)
{
    if (p->sparse || p->numel == 0 || hi <= lo) return;
    size_t w = row_numel(p), esize = ddp_dtype_size(p->dtype);
    if (r->config.user_grads)
        memcpy(slot_of(r, p) + lo * w * esize, (unsigned char *)p->user_grad + lo * w * esize,
               (hi - lo) * w * esize);
    if (recording_finals(r)) record_final(r, p, lo * w, hi * w);
    ddp__reducer_count_off(&r->buckets[p->bucket], p->offset + lo * w, p->offset + hi * w);
}

/* Calls fn for each maximal run of rows of p not marked in this iteration. */
static void each_unmarked_run(ddp_reducer_t *r, rparam_t *p,
                              void (*fn)(ddp_reducer_t *, rparam_t *, size_t, size_t))
{
    size_t n = ready_rows(p);
    if (p->rows_marked == 0) {
        fn(r, p, 0, n);
        return;
    }
    const unsigned char *m = r->row_marks + p->row_base;
    for (size_t i = 0; i < n;) {
        if (m[i]) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !m[j]) j++;
        fn(r, p, i, j);
        i = j;
    }
}

void ddp__reducer_unmarked_rows_final(ddp_reducer_t *r, rparam_t *p)
{
    each_unmarked_run(r, p, rows_final);
}

/* Records a usage error that finalize will report on every rank. */
static void note_local_error(ddp_reducer_t *r, int64_t kind, size_t k)
{
    if (r->iter_sync && !r->local_error) {
        r->local_error = (kind << 32) | (int64_t)(k + 1);
        snprintf(r->local_error_text, sizeof r->local_error_text, "%s", ddp_last_error());
    }
}

/* Parameter k is complete (all rows final): bucket bookkeeping and launches. */
static ddp_status_t complete(ddp_reducer_t *r, size_t k, double now)
{
    rparam_t *p = &r->params[k];
    r->marked[k] = 1;
    if (r->recording && r->narrival < r->nparams) r->arrival[r->narrival++] = k;
    if (recording_finals(r)) record_final(r, p, 0, 0); /* complete: an empty range */
    bucket_t *b = &r->buckets[p->bucket];
    if (p->sparse) p->contribute = 1;
    if (--b->pending == 0) b->ready_us = now;
    return ddp__reducer_launch_in_order(r);
}

ddp_status_t ddp__reducer_mark_ready(ddp_reducer_t *r, size_t k)
{
    rparam_t *p = &r->params[k];
    if (r->marked[k]) {
        ddp_status_t s = ddp__error(
            DDP_ERR_INVALID_USAGE,
            "parameter '%s' (index %zu) was marked ready twice in one iteration (after %llu "
            "synchronised iterations). Its gradient was reported more than once, which happens "
            "when a module is reused in the forward pass, with shared weights (layers tied to "
            "one tensor: register it once, duplicates of one data pointer are merged, and report "
            "it once), or when a parameter takes part in several backward passes of one "
            "iteration. A gradient completed in parts (a stacked (L, ...) tensor whose layers' "
            "rows become final one layer at a time) is reported part by part with "
            "ddp_reducer_grad_ready_rows(reducer, %zu, row_begin, row_end), each row once. With "
            "find_unused_parameters a parameter must also not produce a gradient after finalize "
            "treated it as unused.",
            p->name, p->registered, (unsigned long long)r->iteration, p->registered);
        note_local_error(r, DDP__ERROR_TWICE, k);
        return s;
    }
    r->used_since_sync[k] = 1;
    if (!r->iter_sync) {
        r->marked[k] = 1;
        return DDP_OK;
    }
    double now = ddp__now_us();
    if (r->first_ready_us == 0) r->first_ready_us = now;
    /* The rows not marked yet (all of them unless grad_ready_rows was used) become final. */
    each_unmarked_run(r, p, rows_final);
    return complete(r, k, now);
}

/* ddp__reducer_lookup for the dense-gradient calls: a sparse parameter is a usage error. */
static ddp_status_t lookup_dense(ddp_reducer_t *r, size_t index, const char *what, rparam_t **p,
                                 size_t *k)
{
    ddp_status_t s = ddp__reducer_lookup(r, index, what, p, k);
    if (s != DDP_OK) return s;
    if ((*p)->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s: parameter '%s' (index %zu) is sparse: report its gradient with "
                          "ddp_reducer_sparse_grad",
                          what, (*p)->name, index);
    return DDP_OK;
}

ddp_status_t ddp_reducer_grad_ready(ddp_reducer_t *r, size_t index)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup_dense(r, index, "ddp_reducer_grad_ready", &p, &k);
    if (s != DDP_OK) return s;
    if ((s = ddp__reducer_check_active(r, "ddp_reducer_grad_ready")) != DDP_OK) return s;
    r->ready_calls++;
    return ddp__reducer_mark_ready(r, k);
}

ddp_status_t ddp_reducer_grad_ready_rows(ddp_reducer_t *r, size_t index, size_t row_begin,
                                         size_t row_end)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup_dense(r, index, "ddp_reducer_grad_ready_rows", &p, &k);
    if (s != DDP_OK) return s;
    size_t nrows = ready_rows(p);
    if (row_begin >= row_end)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp_reducer_grad_ready_rows: parameter '%s' (index %zu): the row range "
                          "[%zu, %zu) is empty",
                          p->name, index, row_begin, row_end);
    if (row_end > nrows)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp_reducer_grad_ready_rows: parameter '%s' (index %zu): rows [%zu, "
                          "%zu) are out of range (it has %zu rows%s)",
                          p->name, index, row_begin, row_end, nrows,
                          p->rows ? "" : ": a vector has one row per element");
    if ((s = ddp__reducer_check_active(r, "ddp_reducer_grad_ready_rows")) != DDP_OK) return s;
    r->ready_calls++;
    if (!r->row_marks) {
        /* A byte per row of every dense parameter (a vector has one per element): only
         * callers that report rows pay for it. */
        r->row_marks = ddp__calloc(r->total_rows ? r->total_rows : 1, 1, "row readiness");
        if (!r->row_marks)
            return ddp__error(DDP_ERR_NO_MEMORY,
                              "parameter '%s': no memory for the row marks (%zu bytes)", p->name,
                              r->total_rows);
    }
    unsigned char *m = r->row_marks + p->row_base;
    size_t twice = (size_t)-1;
    if (r->marked[k]) {
        twice = row_begin;
    } else {
        for (size_t i = row_begin; i < row_end && twice == (size_t)-1; i++)
            if (m[i]) twice = i;
    }
    if (twice != (size_t)-1) {
        s = ddp__error(DDP_ERR_INVALID_USAGE,
                       "parameter '%s' (index %zu): rows [%zu, %zu) were marked ready, but row "
                       "%zu was already marked in this iteration (after %llu synchronised "
                       "iterations)%s: each row of a gradient is reported once per iteration",
                       p->name, p->registered, row_begin, row_end, twice,
                       (unsigned long long)r->iteration,
                       r->marked[k] ? "; the whole parameter was already complete" : "");
        note_local_error(r, DDP__ERROR_ROWS_TWICE, k);
        return s;
    }
    memset(m + row_begin, 1, row_end - row_begin);
    p->rows_marked += row_end - row_begin;
    r->used_since_sync[k] = 1;
    if (!r->iter_sync) {
        if (p->rows_marked == nrows) r->marked[k] = 1;
        return DDP_OK;
    }
    double now = ddp__now_us();
    if (r->first_ready_us == 0) r->first_ready_us = now;
    rows_final(r, p, row_begin, row_end);
    if (p->rows_marked == nrows) return complete(r, k, now);
    return ddp__reducer_launch_in_order(r);
}
