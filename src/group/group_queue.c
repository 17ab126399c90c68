/* The group's work queue and progress thread: reference counting of groups and works, breaking
 * a group, running one collective through the transport, the FIFO of works and its thread, the
 * blocking calls and internal tasks that run inline, and the works' public calls.
 *
 * Each group has one FIFO of works and one progress thread that runs them in issue order. A
 * collective gets its sequence number when it starts running (not when it is issued), so the
 * blocking collectives a task runs inline take the next numbers exactly as on every other rank.
 * The first failure breaks the group: it is recorded, the transport is told (so peers fail fast)
 * and every queued or later work fails with DDP_ERR_ABORTED quoting the cause. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/group_private.h"
#include "group/group_state.h"
#include "transport/transport.h"

/* The group whose progress thread this is (NULL on other threads). */
static _Thread_local ddp_group_t *progress_group;
/* The group whose internal task this thread runs inline (it claimed `busy`), so that the blocking
 * collectives the task calls run inline too instead of queueing behind it. */
static _Thread_local ddp_group_t *inline_group;

int ddp__group_is_progress_thread(const ddp_group_t *g) { return progress_group == g; }

/* ---- reference counting ------------------------------------------------------------------- */

void ddp__group_free(ddp_group_t *g)
{
    fallback_buffer_t *b = g->fallback_buffers;
    while (b) {
        fallback_buffer_t *next = b->next;
        free(b->ptr);
        free(b);
        b = next;
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->queue_cv);
    pthread_cond_destroy(&g->done_cv);
    free(g);
}

void ddp__group_unref(ddp_group_t *g)
{
    if (atomic_fetch_sub(&g->refs, 1) == 1) ddp__group_free(g);
}

void ddp__group_work_unref(ddp_work_t *w)
{
    if (atomic_fetch_sub(&w->refs, 1) == 1) {
        ddp_group_t *g = w->group;
        if (w->task_free) w->task_free(w->task_arg);
        free(w->error_text);
        free(w);
        ddp__group_unref(g);
    }
}

/* ---- breaking the group ------------------------------------------------------------------- */

/* Records the first failure and, with tell_peers, tells the transport, so peers stop waiting
 * for this rank. */
void ddp__group_break_group_ex(ddp_group_t *g, ddp_status_t status, const char *text,
                               int tell_peers)
{
    int first = 0;
    pthread_mutex_lock(&g->mu);
    if (!atomic_load(&g->broken)) {
        g->broken_status = status;
        snprintf(g->broken_text, sizeof g->broken_text, "%s", text);
        atomic_store(&g->broken, 1);
        first = 1;
    }
    pthread_mutex_unlock(&g->mu);
    if (first) {
        DDP_LOG(DDP_LOG_WARN, "group %s rank %d broken: %s: %s", g->prefix, g->rank,
                ddp_status_string(status), text);
        if (tell_peers && g->ops && g->ops->abort) g->ops->abort(g->state, text);
    }
}

void ddp__group_break_group(ddp_group_t *g, ddp_status_t status, const char *text)
{
    ddp__group_break_group_ex(g, status, text, 1);
}

ddp_status_t ddp_group_abort(ddp_group_t *group, const char *reason)
{
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_abort: group is NULL");
    char text[256];
    snprintf(text, sizeof text, "rank %d aborted the group: %s", group->rank,
             reason && reason[0] ? reason : "(no reason given)");
    ddp__group_break_group_ex(group, DDP_ERR_ABORTED, text, 1);
    return DDP_OK;
}

/* DDP_ERR_ABORTED with the original cause, as the calling thread's error. */
ddp_status_t ddp__group_aborted_error(ddp_group_t *g, const char *what)
{
    char cause[DDP_ERROR_TEXT_MAX];
    ddp_status_t cause_status;
    pthread_mutex_lock(&g->mu);
    snprintf(cause, sizeof cause, "%s", g->broken_text);
    cause_status = g->broken_status;
    pthread_mutex_unlock(&g->mu);
    return ddp__error(DDP_ERR_ABORTED,
                      "%s on rank %d not run: the group was broken by an earlier failure (%s): %s",
                      what, g->rank, ddp_status_string(cause_status), cause);
}

/* ---- running one collective (progress thread) --------------------------------------------- */

static ddp_status_t run_collective(ddp_group_t *g, ddp__collective_t *c)
{
    if (atomic_load(&g->broken)) {
        char what[256];
        ddp__fingerprint_describe(c, what, sizeof what);
        return ddp__group_aborted_error(g, what);
    }
    c->seq = ++g->seq;
    /* The coarse clock (with slack for its lag): a precise read costs ~26 ns here, twice per
     * collective. */
    c->deadline_ns = ddp__deadline_ns(g->timeout_ms);
    /* Any group's progress thread (a task of one group may run another's collective inline). */
    c->on_progress_thread = progress_group != NULL;
    c->trace = atomic_load_explicit(&g->trace, memory_order_acquire);
    atomic_store(&g->last_progress_ns, ddp__coarse_now_ns());
    ddp__clear_error();
    ddp_status_t s = g->ops->run(g->state, c);
    atomic_store(&g->last_progress_ns, ddp__coarse_now_ns());
    if (s != DDP_OK) {
        if (ddp_last_error()[0] == '\0') {
            char what[256];
            ddp__fingerprint_describe(c, what, sizeof what);
            ddp__error(s, "%s failed on rank %d (transport %s)", what, g->rank, g->ops->name);
        }
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        ddp__group_break_group(g, s, text);
        ddp__set_error_text(text);
    }
    return s;
}

static void execute(ddp_group_t *g, ddp_work_t *w)
{
    ddp_status_t s;
    ddp__clear_error();
    if (w->is_task) {
        if (atomic_load(&g->broken)) {
            s = ddp__group_aborted_error(g, "task");
        } else {
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            s = w->task_fn(g, w->task_arg);
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            if (s != DDP_OK && ddp_last_error()[0] == '\0')
                ddp__error(s, "task on rank %d returned %s", g->rank, ddp_status_string(s));
        }
    } else {
        s = run_collective(g, &w->coll);
    }
    char *text = NULL;
    if (s != DDP_OK) text = strdup(ddp_last_error());

    pthread_mutex_lock(&g->mu);
    w->done = 1;
    w->status = s;
    w->error_text = text;
    ddp_work_callback_fn cb = w->callback;
    void *cb_arg = w->callback_arg;
    pthread_cond_broadcast(&g->done_cv);
    pthread_mutex_unlock(&g->mu);
    if (cb) cb(cb_arg, s);
}

void *ddp__group_progress_main(void *arg)
{
    ddp_group_t *g = arg;
    progress_group = g;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        /* The group is claimed before the work leaves the queue, so an inline caller never
         * finds it unclaimed with a work on the way to running. A caller running inline
         * signals when it lets go (release_inline). */
        ddp_work_t *w = NULL;
        for (;;) {
            int idle = 0;
            if (g->head) {
                if (atomic_compare_exchange_strong(&g->busy, &idle, 1)) {
                    w = g->head;
                    break;
                }
            } else if (g->stop && !atomic_load(&g->busy)) {
                break;
            }
            pthread_cond_wait(&g->queue_cv, &g->mu);
        }
        if (!w) break; /* stop requested and the queue is drained */
        g->head = w->next;
        if (!g->head) g->tail = NULL;
        atomic_fetch_sub(&g->pending, 1);
        pthread_mutex_unlock(&g->mu);
        execute(g, w);
        atomic_store(&g->busy, 0);
        ddp__group_work_unref(w); /* the queue's reference */
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    progress_group = NULL;
    return NULL;
}

/* ---- issuing ------------------------------------------------------------------------------ */

ddp_status_t ddp__group_enqueue(ddp_group_t *g, const ddp__collective_t *c, ddp_task_fn fn,
                                void *arg, ddp_work_t **out)
{
    if (atomic_load(&g->broken)) {
        if (c) {
            char what[256];
            ddp__fingerprint_describe(c, what, sizeof what);
            return ddp__group_aborted_error(g, what);
        }
        return ddp__group_aborted_error(g, "task");
    }
    ddp_work_t *w = ddp__calloc(1, sizeof *w, "a work");
    if (!w) return DDP_ERR_NO_MEMORY;
    atomic_init(&w->refs, 2);
    w->group = g;
    atomic_fetch_add(&g->refs, 1);
    if (c) {
        w->coll = *c;
    } else {
        w->is_task = 1;
        w->task_fn = fn;
        w->task_arg = arg;
    }
    pthread_mutex_lock(&g->mu);
    /* An idle group's last progress may be long ago: the wait bound counts from now. */
    if (!g->head && !atomic_load(&g->busy)) atomic_store(&g->last_progress_ns, ddp__now_ns());
    if (g->tail) g->tail->next = w;
    else g->head = w;
    g->tail = w;
    atomic_fetch_add(&g->pending, 1);
    pthread_cond_signal(&g->queue_cv);
    pthread_mutex_unlock(&g->mu);
    *out = w;
    return DDP_OK;
}

/* Waits for a work without the "not on a progress thread" rule (internal: blocking calls made
 * from another group's task may wait). Bounded: if the group's progress thread makes no progress
 * for its timeout plus a margin, the group is broken and DDP_ERR_TIMEOUT returned. */
static ddp_status_t ddp__group_wait_work(ddp_work_t *w)
{
    ddp_group_t *g = w->group;
    int64_t margin_ns = 2000000000LL + (int64_t)g->timeout_ms * 100000LL; /* 2 s + 10% */
    int64_t limit_ns = (int64_t)g->timeout_ms * 1000000LL + margin_ns;
    pthread_mutex_lock(&g->mu);
    while (!w->done) {
        struct timespec ts = ddp__timespec_in(CLOCK_REALTIME, 100 * 1000000LL);
        pthread_cond_timedwait(&g->done_cv, &g->mu, &ts);
        if (w->done) break;
        int64_t idle = ddp__now_ns() - atomic_load(&g->last_progress_ns);
        if (idle > limit_ns) {
            pthread_mutex_unlock(&g->mu);
            char text[512];
            snprintf(text, sizeof text,
                     "rank %d: the progress thread of group %s made no progress for %lld ms "
                     "(timeout %d ms): a task or transport is stuck",
                     g->rank, g->prefix, (long long)(idle / 1000000), g->timeout_ms);
            ddp__group_break_group(g, DDP_ERR_TIMEOUT, text);
            return ddp__error(DDP_ERR_TIMEOUT, "%s", text);
        }
    }
    ddp_status_t s = w->status;
    if (s != DDP_OK) ddp__set_error_text(w->error_text ? w->error_text : "");
    else ddp__clear_error();
    pthread_mutex_unlock(&g->mu);
    return s;
}

/* Claims the group for running a blocking call on the calling thread, when nothing is queued,
 * nothing runs and no stop was requested: the call is then next in issue order anyway, and
 * running it here saves two thread hand-offs (a small collective's latency is then the
 * transport's alone). Without the lock: two mutex round trips per call were 6.5% of an 8-byte
 * allreduce. A work queued by this thread before shows in `pending` (its own write); one
 * queued by another thread meanwhile is concurrent with this call, unordered either way. */
static int claim_inline(ddp_group_t *g)
{
    if (atomic_load_explicit(&g->pending, memory_order_relaxed)) return 0;
    int idle = 0;
    return atomic_compare_exchange_strong(&g->busy, &idle, 1);
}

/* Lets the group go after an inline run. The progress thread, if something was queued (or a
 * stop requested) meanwhile, found the group claimed and waits: it is signalled, under the lock
 * so that the signal cannot fall between its check and its wait. The store and the load are
 * sequentially consistent, as are ddp__group_enqueue's increment and the progress thread's
 * claim: either it sees the group free, or this sees the work pending. Waking the progress
 * thread after every inline call would cost each a futex wake and two context switches. */
static void release_inline(ddp_group_t *g)
{
    atomic_store(&g->busy, 0);
    if (atomic_load(&g->pending)) {
        pthread_mutex_lock(&g->mu);
        pthread_cond_signal(&g->queue_cv);
        pthread_mutex_unlock(&g->mu);
    }
}

/* A blocking collective: inline on this group's progress thread (inside a task), inline on the
 * calling thread when the group is idle, otherwise issue + wait. */
ddp_status_t ddp__group_run_blocking(ddp_group_t *g, ddp__collective_t *c)
{
    if (progress_group == g || inline_group == g) return run_collective(g, c);
    if (claim_inline(g)) {
        ddp_status_t s = run_collective(g, c);
        release_inline(g);
        return s;
    }
    ddp_work_t *w = NULL;
    ddp_status_t s = ddp__group_enqueue(g, c, NULL, NULL, &w);
    if (s != DDP_OK) return s;
    s = ddp__group_wait_work(w);
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "%s", ddp_last_error());
    ddp_work_free(w);
    if (s != DDP_OK) ddp__set_error_text(text);
    return s;
}
/* ---- works -------------------------------------------------------------------------------- */

ddp_status_t ddp_work_wait(ddp_work_t *work)
{
    ddp__clear_error();
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "work_wait: work is NULL");
    if (progress_group)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "work_wait called on the progress thread of group %s (inside a task or "
                          "callback): tasks run blocking collectives inline and must not wait on "
                          "works",
                          progress_group->prefix);
    return ddp__group_wait_work(work);
}

ddp_status_t ddp_work_test(ddp_work_t *work, int *done)
{
    ddp__clear_error();
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "work_test: work is NULL");
    if (!done) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "work_test: done is NULL");
    ddp_group_t *g = work->group;
    pthread_mutex_lock(&g->mu);
    *done = work->done;
    pthread_mutex_unlock(&g->mu);
    return DDP_OK;
}

ddp_status_t ddp_work_on_complete(ddp_work_t *work, ddp_work_callback_fn fn, void *arg)
{
    ddp__clear_error();
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "work_on_complete: work is NULL");
    if (!fn) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "work_on_complete: fn is NULL");
    ddp_group_t *g = work->group;
    pthread_mutex_lock(&g->mu);
    if (work->callback_set) {
        pthread_mutex_unlock(&g->mu);
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "work_on_complete: this work already has a callback (one per work)");
    }
    work->callback_set = 1;
    if (!work->done) {
        work->callback = fn;
        work->callback_arg = arg;
        pthread_mutex_unlock(&g->mu);
        return DDP_OK;
    }
    ddp_status_t s = work->status;
    /* fn reads a failure's text from ddp_last_error(), as it does on the progress thread. */
    if (s != DDP_OK) ddp__set_error_text(work->error_text ? work->error_text : "");
    pthread_mutex_unlock(&g->mu);
    fn(arg, s);
    if (s != DDP_OK) ddp__clear_error();
    return DDP_OK;
}

void ddp_work_free(ddp_work_t *work)
{
    if (work) ddp__group_work_unref(work);
}

/* ---- internal tasks and point-to-point pairs (group_private.h) ---------------------------- */

ddp_status_t ddp__group_task(ddp_group_t *g, ddp_task_fn fn, void *arg, void (*free_arg)(void *),
                             ddp_work_t **work)
{
    ddp_status_t s;
    if (work) {
        s = ddp__group_enqueue(g, NULL, fn, arg, work);
        if (s == DDP_OK) (*work)->task_free = free_arg;
        else if (free_arg) free_arg(arg);
        return s;
    }
    if (progress_group == g || inline_group == g) {
        if (atomic_load(&g->broken)) s = ddp__group_aborted_error(g, "collective");
        else s = fn(g, arg);
        if (free_arg) free_arg(arg);
        return s;
    }
    /* Idle: run on the calling thread, as ddp__group_run_blocking does for one collective. */
    if (claim_inline(g)) {
        if (atomic_load(&g->broken)) {
            s = ddp__group_aborted_error(g, "collective");
        } else {
            inline_group = g;
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            s = fn(g, arg);
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            inline_group = NULL;
        }
        if (free_arg) free_arg(arg);
        release_inline(g);
        return s;
    }
    ddp_work_t *w = NULL;
    s = ddp__group_enqueue(g, NULL, fn, arg, &w);
    if (s != DDP_OK) {
        if (free_arg) free_arg(arg);
        return s;
    }
    w->task_free = free_arg;
    s = ddp__group_wait_work(w);
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "%s", ddp_last_error());
    ddp_work_free(w);
    if (s != DDP_OK) ddp__set_error_text(text);
    return s;
}

void ddp__group_fail(ddp_group_t *g, ddp_status_t status, const char *text, int tell_peers)
{
    ddp__group_break_group_ex(g, status, text, tell_peers);
}

