/* ddp_reducer_finalize: the end of a synchronised iteration. It settles the parameters nobody
 * marked, launches what is left, exchanges one status vector so that every rank learns of every
 * rank's usage error (and, with find_unused_parameters, which parameters any rank used), waits,
 * then keeps or copies out the results and records the iteration's statistics. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* The first failure of an iteration and its error text, kept while later steps run (and may
 * overwrite the thread's last error). */
typedef struct outcome {
    ddp_status_t status;
    char text[DDP_ERROR_TEXT_MAX];
} outcome_t;

/* Records `status` (whose text is ddp_last_error()) unless an earlier failure was recorded. */
static void note_failure(outcome_t *o, ddp_status_t status)
{
    if (status == DDP_OK || o->status != DDP_OK) return;
    o->status = status;
    snprintf(o->text, sizeof o->text, "%s", ddp_last_error());
}

/* Step 1. Parameters never marked: zeros (or their accumulated no_sync gradient) with
 * find_unused_parameters, an error otherwise. Either way their buckets become ready so that
 * every rank issues the same collectives. A zeroed slot's gradient is first saved, in kept order,
 * so that a parameter no rank used keeps it (keep_results). */
static void settle_unmarked(ddp_reducer_t *r, int find_unused)
{
    char names[512];
    size_t nunmarked = 0, nl = 0;
    names[0] = '\0';
    size_t saved_off = 0;
    for (size_t k = 0; k < r->nparams; k++) {
        rparam_t *p = &r->params[k];
        size_t esize = param_bytes(p);
        if (r->marked[k]) continue;
        if (!find_unused) {
            if (nunmarked == 0 && !r->local_error)
                r->local_error = (DDP__ERROR_UNMARKED << 32) | (int64_t)(k + 1);
            if (nunmarked < 8 && nl + 1 < sizeof names) {
                int w = snprintf(names + nl, sizeof names - nl, "%s'%s'", nunmarked ? ", " : "",
                                 p->name);
                nl = w < 0 ? nl : nl + (size_t)w < sizeof names ? nl + (size_t)w : sizeof names;
            }
            nunmarked++;
        }
        if (p->sparse) {
            p->contribute = r->used_since_sync[k];
        } else if (p->numel > 0) {
            if (r->used_since_sync[k]) {
                /* Rows marked with grad_ready_rows were copied in already (and may be in a
                 * piece in flight): take only the others. */
                ddp__reducer_unmarked_rows_final(r, p);
            } else {
                if (r->saved) memcpy(r->saved + saved_off, slot_of(r, p), esize);
                memset(slot_of(r, p), 0, esize);
                ddp__reducer_count_off(&r->buckets[p->bucket], p->offset, p->offset + p->numel);
            }
        }
        if (!r->used_since_sync[k]) saved_off += esize;
        bucket_t *b = &r->buckets[p->bucket];
        if (--b->pending == 0) b->ready_us = ddp__now_us();
    }
    if (nunmarked > 0 && r->local_error >> 32 == DDP__ERROR_UNMARKED) {
        ddp__error(DDP_ERR_INVALID_USAGE,
                   "%zu parameter(s) were not marked ready in this iteration (after %llu "
                   "synchronised iterations): %s%s. Every parameter must get its gradient "
                   "reported with ddp_reducer_grad_ready before ddp_reducer_finalize; if some "
                   "parameters legitimately get no gradient in some iterations, enable "
                   "find_unused_parameters in the reducer config",
                   nunmarked, (unsigned long long)r->iteration, names,
                   nunmarked > 8 ? ", ..." : "");
        snprintf(r->local_error_text, sizeof r->local_error_text, "%s", ddp_last_error());
    }
}

/* Step 1b. Bucket mode, the first synchronised finalize after the rebuild moved the gradients:
 * a write through a pointer fetched before the rebuild changed the marker in the old memory.
 * That is reported on every rank like any usage error, so it cannot go unnoticed (the program's
 * backward wrote gradients the Reducer never saw). */
static void check_stale_writes(ddp_reducer_t *r)
{
    if (!r->stale_slot) return;
    size_t k = ddp__reducer_check_stale(r);
    if (k == (size_t)-1 || r->local_error) return;
    r->local_error = (DDP__ERROR_STALE << 32) | (int64_t)(k + 1);
    ddp__error(DDP_ERR_INVALID_USAGE,
               "parameter '%s' (index %zu): its gradient was written at the address "
               "ddp_reducer_grad gave before the bucket rebuild, which moved every gradient at "
               "the last ddp_reducer_prepare; the Reducer never saw that gradient. Fetch pointers "
               "with ddp_reducer_grad after each prepare, or use config.grad_memory = "
               "DDP_GRAD_MEMORY_BLOCK or DDP_GRAD_MEMORY_USER_BLOCK, whose gradients never move",
               r->params[k].name, r->params[k].registered);
    snprintf(r->local_error_text, sizeof r->local_error_text, "%s", ddp_last_error());
}

/* Step 2. The status vector: nu "used" flags, then one error code per rank (only this rank's
 * set). It is known now, so it is queued right behind the last bucket instead of after the
 * waits (one round trip less on the exposed path). */
static ddp_work_t *start_status_exchange(ddp_reducer_t *r, size_t nu, outcome_t *o)
{
    int64_t *v = r->status_vector;
    for (size_t k = 0; k < nu; k++) v[k] = r->used_since_sync[k];
    for (int q = 0; q < r->world; q++) v[nu + (size_t)q] = q == r->rank ? r->local_error : 0;
    if (o->status != DDP_OK) return NULL;
    ddp_work_t *work = NULL;
    ddp_status_t s = ddp_group_allreduce_async(r->group, v, v, nu + (size_t)r->world, DDP_I64,
                                               DDP_MAX, &work);
    if (s != DDP_OK)
        note_failure(o, ddp__error_context(s, "exchanging the status of iteration %llu",
                                           (unsigned long long)r->iteration));
    return work;
}

/* Step 3. Waits for every bucket and piece, then for the status exchange, and for the
 * completion callbacks (statistics read their times). */
static void wait_all(ddp_reducer_t *r, ddp_work_t *status_work, outcome_t *o)
{
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        for (size_t i = 0; i <= k->npieces; i++) {
            ddp_work_t **work = i < k->npieces ? &k->pieces[i].work : &k->work;
            if (!*work) continue;
            ddp_status_t w = ddp_work_wait(*work);
            if (w != DDP_OK && o->status == DDP_OK) {
                if (i < k->npieces)
                    ddp__error_context(w,
                                       "reduction of gradient bucket %zu piece %zu of %zu "
                                       "(iteration %llu)",
                                       b, i, k->npieces, (unsigned long long)r->iteration);
                else
                    ddp__error_context(w, "reduction of gradient bucket %zu (iteration %llu)", b,
                                       (unsigned long long)r->iteration);
                note_failure(o, w);
            }
            ddp_work_free(*work);
            *work = NULL;
        }
        /* Some rank has joined: the default hook summed, the average is over the ranks with
         * data (the same division on every rank, so the results stay bitwise equal). */
        if (r->post_divide && o->status == DDP_OK && !k->sparse && k->data && k->numel)
            ddp__divide_by(k->data, k->numel, k->dtype, r->contributors);
    }
    if (status_work) {
        ddp_status_t s = ddp_work_wait(status_work);
        ddp_work_free(status_work);
        if (s != DDP_OK && o->status == DDP_OK) {
            ddp__error_context(s, "exchanging the status of iteration %llu",
                               (unsigned long long)r->iteration);
            note_failure(o, s);
        }
    }
    ddp__reducer_wait_callbacks(r);
}

/* Text for an error code another rank reported in the status vector. */
static void describe_remote_error(ddp_reducer_t *r, int q, int64_t code, char *out, size_t cap)
{
    int64_t kind = code >> 32;
    size_t k = (size_t)(code & 0xffffffff) - 1;
    const char *name = k < r->nparams ? r->params[k].name : "?";
    size_t reg = k < r->nparams ? r->params[k].registered : 0;
    if (kind == DDP__ERROR_STALE)
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) had its gradient written at its address "
                 "from before the bucket rebuild (a stale ddp_reducer_grad pointer)",
                 q, name, reg);
    else if (kind == DDP__ERROR_ROWS_TWICE)
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) had rows marked ready twice in one "
                 "iteration (overlapping ddp_reducer_grad_ready_rows ranges)",
                 q, name, reg);
    else if (kind == DDP__ERROR_TWICE)
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) was marked ready twice in one iteration "
                 "(a reused module or shared weights? a gradient completed in parts is reported "
                 "with ddp_reducer_grad_ready_rows)",
                 q, name, reg);
    else
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) was not marked ready in this iteration; "
                 "if some parameters legitimately get no gradient, enable "
                 "find_unused_parameters",
                 q, name, reg);
}

/* Step 4. The outcome every rank agrees on: a failed collective, then this rank's own usage
 * error, then the first other rank's. */
static ddp_status_t agreed_outcome(ddp_reducer_t *r, size_t nu, const outcome_t *o)
{
    const int64_t *v = r->status_vector;
    if (o->status != DDP_OK) {
        ddp__set_error_text(o->text);
        return o->status;
    }
    if (v[nu + (size_t)r->rank]) {
        ddp__set_error_text(r->local_error_text);
        return DDP_ERR_INVALID_USAGE;
    }
    for (int q = 0; q < r->world; q++) {
        int64_t code = v[nu + (size_t)q];
        if (!code) continue;
        char text[600];
        describe_remote_error(r, q, code, text, sizeof text);
        return ddp__error(DDP_ERR_INVALID_USAGE, "%s", text);
    }
    return DDP_OK;
}

/* Step 5. Globally unused parameters keep their gradient (restored from r->saved, in step 1's
 * order); the others' results are copied out in user_grads mode, and sparse results become the
 * accumulated gradient. */
static ddp_status_t keep_results(ddp_reducer_t *r, int find_unused)
{
    const int64_t *v = r->status_vector;
    size_t saved_off = 0;
    for (size_t k = 0; k < r->nparams; k++) {
        rparam_t *p = &r->params[k];
        size_t esize = param_bytes(p);
        int globally_unused = find_unused && v[k] == 0;
        int saved_here = !r->marked[k] && !r->used_since_sync[k];
        if (p->sparse) {
            if (!globally_unused) {
                ddp_status_t s = ddp__reducer_keep_sparse_result(p);
                if (s != DDP_OK) return s;
            }
        } else if (p->numel > 0) {
            if (globally_unused) {
                if (saved_here && r->saved) memcpy(slot_of(r, p), r->saved + saved_off, esize);
            } else if (r->config.user_grads) {
                memcpy(p->user_grad, slot_of(r, p), esize);
            }
        }
        if (saved_here) saved_off += esize;
        p->contribute = 0;
    }
    return DDP_OK;
}

static double piece_done_time(piece_t *q)
{
    if (!atomic_load(&q->done_set)) return ddp__now_us();
    uint64_t bits = atomic_load(&q->done_bits);
    double t;
    memcpy(&t, &bits, sizeof t);
    return t;
}

static double done_time(bucket_t *b)
{
    if (b->npieces) {
        double t = 0;
        for (size_t i = 0; i < b->npieces; i++) {
            double d = piece_done_time(&b->pieces[i]);
            if (d > t) t = d;
        }
        return t;
    }
    if (!atomic_load(&b->done_set)) return ddp__now_us();
    uint64_t bits = atomic_load(&b->done_bits);
    double t;
    memcpy(&t, &bits, sizeof t);
    return t;
}

/* Step 6. Statistics of the iteration: times relative to the first gradient (or finalize's
 * entry), bytes, and how long the network was busy. */
static void record_stats(ddp_reducer_t *r, double enter, double backward_end)
{
    double exit_us = ddp__now_us();
    double t0 = r->first_ready_us ? r->first_ready_us : enter;
    ddp_reducer_stats_t *st = &r->stats;
    st->iteration = r->iteration;
    st->backward_us = backward_end - t0;
    st->exposed_us = exit_us - enter;
    st->comm_us = 0;
    st->bytes = 0;
    st->nbuckets = r->nbuckets;
    st->npieces = 0;
    st->busy_us = 0;
    st->bytes_launched_in_backward = 0;
    /* The launch log is in launch order, so launch times are sorted and the union of the
     * intervals is one sweep. */
    double busy_start = 0, busy_end = -1e300;
    size_t nlog = r->launches < r->launch_cap ? r->launches : r->launch_cap;
    for (size_t j = 0; j < nlog; j++) {
        const launch_record_t *e = &r->launch_log[j];
        bucket_t *k = &r->buckets[e->bucket];
        int whole = e->piece == DDP__WHOLE;
        double l = whole ? k->launch_us : k->pieces[e->piece].launch_us;
        double d = whole ? done_time(k) : piece_done_time(&k->pieces[e->piece]);
        ddp_reduction_stats_t *rs = &r->reduction_stats[st->npieces++];
        size_t esize = ddp_dtype_size(k->dtype);
        rs->bucket = e->bucket;
        rs->offset = whole ? 0 : k->pieces[e->piece].begin * esize;
        if (!whole) rs->bytes = k->pieces[e->piece].numel * esize;
        else if (k->sparse) {
            const rparam_t *p = &r->params[k->params[0]];
            rs->bytes = p->pending_rows * (row_bytes(p) + sizeof(int64_t));
        } else rs->bytes = k->numel * esize;
        rs->ready_calls = e->ready_calls;
        rs->by_finalize = e->by_finalize;
        rs->launch_us = l - t0;
        rs->done_us = d - t0;
        if (!e->by_finalize) st->bytes_launched_in_backward += rs->bytes;
        if (!whole) st->comm_us += d - l;
        if (l > busy_end) {
            if (busy_end > busy_start) st->busy_us += busy_end - busy_start;
            busy_start = l;
            busy_end = d;
        } else if (d > busy_end) {
            busy_end = d;
        }
    }
    if (busy_end > busy_start) st->busy_us += busy_end - busy_start;
    st->reductions = r->reduction_stats;
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        ddp_bucket_stats_t *bs = &r->bucket_stats[b];
        double done = done_time(k);
        if (k->sparse) {
            const rparam_t *p = &r->params[k->params[0]];
            bs->bytes = p->pending_rows * (row_bytes(p) + sizeof(int64_t));
        } else {
            bs->bytes = k->numel * ddp_dtype_size(k->dtype);
        }
        bs->ready_us = k->ready_us - t0;
        bs->launch_us = k->launch_us - t0;
        bs->done_us = done - t0;
        if (!k->npieces) st->comm_us += done - k->launch_us;
        st->bytes += bs->bytes;
    }
    st->buckets = r->bucket_stats;
    r->have_stats = 1;
}

ddp_status_t ddp_reducer_finalize(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    ddp_status_t s = ddp__reducer_check_active(r, "ddp_reducer_finalize");
    if (s != DDP_OK) return s;
    if (!r->iter_sync) {
        r->active = 0; /* no_sync: gradients stay local and accumulate */
        return DDP_OK;
    }
    double enter = ddp__now_us();
    int find_unused = r->config.find_unused_parameters;
    size_t nu = find_unused ? r->nparams : 0;
    outcome_t o;
    o.status = DDP_OK;
    o.text[0] = '\0';

    check_stale_writes(r);
    settle_unmarked(r, find_unused);
    double backward_end = enter;
    r->finalizing = 1;
    note_failure(&o, ddp__reducer_launch_in_order(r));
    ddp_work_t *status_work = start_status_exchange(r, nu, &o);
    wait_all(r, status_work, &o);
    s = agreed_outcome(r, nu, &o);
    if (s == DDP_OK) s = keep_results(r, find_unused);
    if (s != DDP_OK) {
        r->active = 0;
        return s;
    }
    record_stats(r, enter, backward_end);

    memset(r->used_since_sync, 0, r->nparams);
    if (r->recording) {
        r->recording = 0;
        if (!(r->narrival == r->nparams)) {
            free(r->finals);
            r->finals = NULL;
            r->nfinals = r->finals_cap = 0;
        }
        r->rebuild_due = !r->rebuilt && r->narrival == r->nparams;
    }
    r->iteration++;
    r->active = 0;
    return DDP_OK;
}

/* A joined rank's part in one synchronised iteration of the ranks that still have data: every
 * bucket (or piece) in their launch order with zeros, the status exchange, and the bookkeeping
 * that keeps the rebuild and the iteration count in step with them. */
static ddp_status_t shadow_iteration(ddp_reducer_t *r)
{
    outcome_t o;
    o.status = DDP_OK;
    o.text[0] = '\0';
    ddp__reducer_reset_iteration(r);
    r->iter_sync = 1;
    r->active = 1;
    /* The old memory after a rebuild is freed collectively at this point of finalize. */
    if (r->stale_slot) ddp__reducer_free_stale(r);
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        if (k->data && k->numel) memset(k->data, 0, k->numel * ddp_dtype_size(k->dtype));
        k->pending = 0;
        for (size_t i = 0; i < k->npieces; i++) k->pieces[i].pending = 0;
    }
    memset(r->used_since_sync, 0, r->nparams);
    note_failure(&o, ddp__reducer_launch_in_order(r));
    size_t nu = r->config.find_unused_parameters ? r->nparams : 0;
    ddp_work_t *status_work = start_status_exchange(r, nu, &o);
    wait_all(r, status_work, &o);
    r->active = 0;
    /* The reductions leave the others' average in this rank's gradients, the same bits as
     * theirs: after the join a caller may take the same optimizer step (ddp_reducer_join). */
    ddp_status_t s = agreed_outcome(r, nu, &o);
    if (s != DDP_OK) return s;
    if (r->recording) {
        /* The ranks with data recorded a full arrival order (or failed above). */
        r->recording = 0;
        r->rebuild_due = !r->rebuilt;
    }
    r->iteration++;
    return DDP_OK;
}

ddp_status_t ddp_reducer_join(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!r->config.join)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_join: uneven inputs are not enabled; set config.join = 1 "
                          "on every rank when creating the reducer");
    if (r->active && r->iter_sync)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_join inside a synchronised iteration (after %llu "
                          "completed): call ddp_reducer_finalize first",
                          (unsigned long long)r->iteration);
    r->active = 0;
    ddp_status_t s;
    for (;;) {
        int sync = 0;
        s = ddp__reducer_start_collectives(r, 0, 0, &sync);
        if (s != DDP_OK) return ddp__error_context(s, "ddp_reducer_join");
        if (r->join_flags[r->world] == 0) {
            int any = 0;
            for (int q = 0; q < r->world; q++) any |= r->join_flags[q] != 0;
            if (!any) break; /* every rank has joined */
        }
        if (!sync) continue; /* a no_sync iteration: nothing is communicated in it */
        s = shadow_iteration(r);
        if (s != DDP_OK) return s;
    }
    /* Every rank leaves with the model of the last rank to join (the lowest of them): the
     * ranks that joined earlier skipped the optimizer steps of the iterations they shadowed. */
    int root = 0;
    for (int q = 0; q < r->world; q++)
        if (r->join_prev[q]) {
            root = q;
            break;
        }
    for (size_t i = 0; i < r->nparams && s == DDP_OK; i++)
        if (r->params[i].numel)
            s = ddp_group_broadcast(r->group, r->params[i].data, r->params[i].numel,
                                    r->params[i].dtype, root);
    for (size_t i = 0; i < r->nbuffers && s == DDP_OK; i++)
        if (r->buffers[i].numel)
            s = ddp_group_broadcast(r->group, r->buffers[i].data, r->buffers[i].numel,
                                    r->buffers[i].dtype, root);
    if (s != DDP_OK)
        return ddp__error_context(s, "ddp_reducer_join: broadcasting the model from rank %d, the "
                                     "last to join",
                                  root);
    memset(r->join_prev, 0, (size_t)r->world);
    r->contributors = r->world;
    r->post_divide = 0;
    return DDP_OK;
}
