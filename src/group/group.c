/* Process groups: argument checks, the work queue, the progress thread, tasks, and the group's
 * life cycle (create, split, create from the launcher's environment, destroy).
 *
 * Each group has one FIFO of works and one progress thread that runs them in issue order. A
 * collective gets its sequence number when it starts running (not when it is issued), so the
 * blocking collectives a task runs inline take the next numbers exactly as on every other rank.
 * The thread hands each collective to the transport (src/transport/transport.h) with an absolute
 * deadline; the first failure breaks the group: it is recorded, the transport is told (so peers
 * fail fast) and every queued or later work fails with DDP_ERR_ABORTED quoting the cause.
 *
 * Works and the group are reference counted: a work holds its group, so a handle stays valid
 * (and ddp_work_wait answers) even after ddp_group_destroy. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/group_internal.h"
#include "group/rendezvous.h"
#include "group/group_private.h"
#include "transport/transport.h"

#define GROUP_MAX_WORLD 4096


struct ddp_work {
    _Atomic int refs; /* the user's handle + the queue's reference */
    ddp_group_t *group;
    struct ddp_work *next;
    int is_task;
    ddp__collective_t coll;
    ddp_task_fn task_fn;
    void *task_arg;
    void (*task_free)(void *); /* internal tasks (collectives.c): frees task_arg with the work */
    /* Guarded by group->mu. */
    int done;
    ddp_status_t status;
    char *error_text;
    ddp_work_callback_fn callback;
    void *callback_arg;
    int callback_set;
};

typedef struct fallback_buffer {
    void *ptr;
    struct fallback_buffer *next;
} fallback_buffer_t;

struct ddp_group {
    _Atomic int refs; /* 1 until destroy + 1 per live work */
    ddp_store_t *store;
    int owns_store;
    ddp_store_t *base_store;    /* the store `store` is a prefix view of (create_from_env), or NULL */
    ddp_store_server_t *server; /* the store this rank hosts (create_from_env), or NULL */
    int hosted_by_rank;         /* the store lives in a rank: see ddp_group_destroy */
    char prefix[512]; /* store keys of this group instance: "ddp/group/<name>/<instance>" */
    int rank;
    int world;
    int timeout_ms;
    const ddp__transport_ops_t *ops;
    void *state;

    pthread_mutex_t mu;
    pthread_cond_t queue_cv; /* work queued or stop requested */
    pthread_cond_t done_cv;  /* some work completed */
    ddp_work_t *head;
    ddp_work_t *tail;
    int stop;
    int busy; /* a collective or task is executing (on the progress thread or inline) */
    int thread_started;
    pthread_t thread;

    uint64_t seq;                   /* only whoever holds `busy` touches it */
    _Atomic int64_t last_progress_ns; /* last time the progress thread started or ended something */
    _Atomic int broken;
    _Atomic(ddp_trace_t *) trace;   /* ddp_group_set_trace: handed to the transport per call */
    ddp_status_t broken_status;     /* guarded by mu */
    char broken_text[DDP_ERROR_TEXT_MAX];

    int splits; /* caller's thread: number of ddp_group_split calls so far */
    /* Point-to-point: pairs[peer] is the two-rank group this rank shares with `peer`, made on
     * first use (send/recv), touched only by whoever holds `busy`. */
    ddp_group_t **pairs;
    /* Recv from any source (ddp_group_enable_recv_any): every send announces itself in the
     * store; received[peer] counts this rank's recvs from `peer` (named or any), so a peer whose
     * announced sends outnumber them has a message waiting. Touched only by whoever holds
     * `busy`, except recv_any, set before the first work. */
    int recv_any;
    int64_t *received;
    int any_next; /* the last source picked: the next search starts after it (round robin) */
    fallback_buffer_t *fallback_buffers; /* guarded by mu */
};

/* The group whose progress thread this is (NULL on other threads). */
static _Thread_local ddp_group_t *progress_group;
/* The group whose internal task this thread runs inline (it holds `busy`), so that the blocking
 * collectives the task calls run inline too instead of queueing behind it. */
static _Thread_local ddp_group_t *inline_group;

/* ---- reference counting ------------------------------------------------------------------- */

static void group_free(ddp_group_t *g)
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

static void group_unref(ddp_group_t *g)
{
    if (atomic_fetch_sub(&g->refs, 1) == 1) group_free(g);
}

static void work_unref(ddp_work_t *w)
{
    if (atomic_fetch_sub(&w->refs, 1) == 1) {
        ddp_group_t *g = w->group;
        if (w->task_free) w->task_free(w->task_arg);
        free(w->error_text);
        free(w);
        group_unref(g);
    }
}

/* ---- breaking the group ------------------------------------------------------------------- */

/* Records the first failure and, with tell_peers, tells the transport, so peers stop waiting
 * for this rank. */
static void break_group_ex(ddp_group_t *g, ddp_status_t status, const char *text, int tell_peers)
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

static void break_group(ddp_group_t *g, ddp_status_t status, const char *text)
{
    break_group_ex(g, status, text, 1);
}

ddp_status_t ddp_group_abort(ddp_group_t *group, const char *reason)
{
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_abort: group is NULL");
    char text[256];
    snprintf(text, sizeof text, "rank %d aborted the group: %s", group->rank,
             reason && reason[0] ? reason : "(no reason given)");
    break_group_ex(group, DDP_ERR_ABORTED, text, 1);
    return DDP_OK;
}

/* DDP_ERR_ABORTED with the original cause, as the calling thread's error. */
static ddp_status_t aborted_error(ddp_group_t *g, const char *what)
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
        return aborted_error(g, what);
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
        break_group(g, s, text);
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
            s = aborted_error(g, "task");
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

static void *progress_main(void *arg)
{
    ddp_group_t *g = arg;
    progress_group = g;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while ((!g->head || g->busy) && !(g->stop && !g->head && !g->busy))
            pthread_cond_wait(&g->queue_cv, &g->mu);
        ddp_work_t *w = g->head;
        if (!w) break; /* stop requested and the queue is drained */
        g->head = w->next;
        if (!g->head) g->tail = NULL;
        g->busy = 1;
        pthread_mutex_unlock(&g->mu);
        execute(g, w);
        pthread_mutex_lock(&g->mu);
        g->busy = 0;
        pthread_mutex_unlock(&g->mu);
        work_unref(w); /* the queue's reference */
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    progress_group = NULL;
    return NULL;
}

/* ---- issuing ------------------------------------------------------------------------------ */

static ddp_status_t enqueue(ddp_group_t *g, const ddp__collective_t *c, ddp_task_fn fn, void *arg,
                            ddp_work_t **out)
{
    if (atomic_load(&g->broken)) {
        if (c) {
            char what[256];
            ddp__fingerprint_describe(c, what, sizeof what);
            return aborted_error(g, what);
        }
        return aborted_error(g, "task");
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
    if (!g->head && !g->busy) atomic_store(&g->last_progress_ns, ddp__now_ns());
    if (g->tail) g->tail->next = w;
    else g->head = w;
    g->tail = w;
    pthread_cond_signal(&g->queue_cv);
    pthread_mutex_unlock(&g->mu);
    *out = w;
    return DDP_OK;
}

/* Waits for a work without the "not on a progress thread" rule (internal: blocking calls made
 * from another group's task may wait). Bounded: if the group's progress thread makes no progress
 * for its timeout plus a margin, the group is broken and DDP_ERR_TIMEOUT returned. */
static ddp_status_t wait_work(ddp_work_t *w)
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
            break_group(g, DDP_ERR_TIMEOUT, text);
            return ddp__error(DDP_ERR_TIMEOUT, "%s", text);
        }
    }
    ddp_status_t s = w->status;
    if (s != DDP_OK) ddp__set_error_text(w->error_text ? w->error_text : "");
    else ddp__clear_error();
    pthread_mutex_unlock(&g->mu);
    return s;
}

/* A blocking collective: inline on this group's progress thread (inside a task), otherwise
 * issue + wait. */
static ddp_status_t run_blocking(ddp_group_t *g, ddp__collective_t *c)
{
    if (progress_group == g || inline_group == g) return run_collective(g, c);
    /* Fast path: nothing queued and nothing running, so this collective is next in issue order
     * anyway; run it on the calling thread and save two thread hand-offs (the latency of a small
     * collective is then the transport's alone). The busy flag keeps the progress thread out. */
    pthread_mutex_lock(&g->mu);
    int inline_ok = !g->head && !g->busy && !g->stop;
    if (inline_ok) g->busy = 1;
    pthread_mutex_unlock(&g->mu);
    if (inline_ok) {
        ddp_status_t s = run_collective(g, c);
        pthread_mutex_lock(&g->mu);
        g->busy = 0;
        /* Wake the progress thread only if something was queued (or a stop requested) while
         * this ran: waking it after every inline collective cost each one a futex wake and two
         * context switches (4 ranks on 2 cores: most of the 8-byte latency). */
        if (g->head || g->stop) pthread_cond_signal(&g->queue_cv);
        pthread_mutex_unlock(&g->mu);
        return s;
    }
    ddp_work_t *w = NULL;
    ddp_status_t s = enqueue(g, c, NULL, NULL, &w);
    if (s != DDP_OK) return s;
    s = wait_work(w);
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "%s", ddp_last_error());
    ddp_work_free(w);
    if (s != DDP_OK) ddp__set_error_text(text);
    return s;
}

/* ---- argument checks (checks.h) ----------------------------------------------------------- */

/* What each of the transports' five kinds takes, so that one function checks and builds them
 * all. A per-rank kind has one buffer of world blocks of `count` (reduce_scatter's send,
 * allgather's recv) and one of a block; in place is the block at this rank's position. */
typedef struct kind_rules {
    const char *fn;         /* the name errors start with */
    const char *count_name; /* the count argument's name; NULL: none (barrier) */
    int has_op;
    int has_root;            /* one buffer, `buf`, and a root (broadcast) */
    int send_is_per_rank;    /* send holds world blocks (reduce_scatter) */
    int recv_is_per_rank;    /* recv holds world blocks (allgather) */
    const char *overlap_text; /* why overlapping buffers that are not in place are refused */
} kind_rules_t;

static const kind_rules_t kind_rules[] = {
    [DDP__ALLREDUCE] = {"allreduce", "count", 1, 0, 0, 0,
                        "send and recv overlap without being equal (in place needs send == recv)"},
    [DDP__BROADCAST] = {"broadcast", "count", 0, 1, 0, 0, NULL},
    [DDP__REDUCE_SCATTER] = {"reduce_scatter", "recv_count", 1, 0, 1, 0,
                             "recv overlaps send but is not send + rank * recv_count elements "
                             "(the in-place position)"},
    [DDP__ALLGATHER] = {"allgather", "send_count", 0, 0, 0, 1,
                        "send overlaps recv but is not recv + rank * send_count elements (the "
                        "in-place position)"},
    [DDP__BARRIER] = {"barrier", NULL, 0, 0, 0, 0, NULL},
};

/* Checks the arguments of one of the five kinds and fills *c with them. broadcast passes its
 * buffer as both send and recv. */
static ddp_status_t build(ddp_group_t *g, ddp__collective_kind_t kind, const void *send,
                          void *recv, size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                          int root, ddp__collective_t *c)
{
    const kind_rules_t *k = &kind_rules[kind];
    TRY(ddp__check_group(g, k->fn));
    memset(c, 0, sizeof *c);
    c->kind = kind;
    if (!k->count_name) {
        c->dtype = DDP_U8;
        return DDP_OK;
    }
    int per_rank = k->send_is_per_rank || k->recv_is_per_rank;
    TRY(ddp__check_dtype(dtype, k->fn));
    if (k->has_op) TRY(ddp__check_op(op, k->fn));
    TRY(ddp__check_count(count, per_rank ? (size_t)g->world : 1, dtype, k->fn, k->count_name));
    if (k->has_root) {
        TRY(ddp__check_buffer(recv, count, k->fn, "buf", k->count_name));
        TRY(ddp__check_rank(g, root, k->fn, "root"));
    } else {
        TRY(ddp__check_buffer(send, count, k->fn, "send", k->count_name));
        TRY(ddp__check_buffer(recv, count, k->fn, "recv", k->count_name));
        size_t block = count * ddp_dtype_size(dtype);
        size_t blocks = per_rank ? (size_t)g->world : 1;
        uintptr_t whole = (uintptr_t)(k->recv_is_per_rank ? (const void *)recv : send);
        uintptr_t part = (uintptr_t)(k->recv_is_per_rank ? (const void *)send : recv);
        uintptr_t in_place = whole + (per_rank ? (size_t)g->rank * block : 0);
        if (in_place != part && ddp__overlaps((const void *)whole, block * blocks,
                                              (const void *)part, block))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s", k->fn, k->overlap_text);
    }
    c->send = send;
    c->recv = recv;
    c->count = count;
    c->dtype = dtype;
    if (k->has_op) c->op = op;
    if (k->has_root) c->root = root;
    return DDP_OK;
}

static ddp_status_t issue(ddp_group_t *g, const ddp__collective_t *c, ddp_work_t **work,
                          const char *fn)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: work is NULL", fn);
    return enqueue(g, c, NULL, NULL, work);
}

/* ---- public collectives ------------------------------------------------------------------- */

ddp_status_t ddp_group_allreduce_async(ddp_group_t *group, const void *send, void *recv,
                                       size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                       ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLREDUCE, send, recv, count, dtype, op, 0, &c));
    return issue(group, &c, work, "allreduce_async");
}

ddp_status_t ddp_group_broadcast_async(ddp_group_t *group, void *buf, size_t count,
                                       ddp_dtype_t dtype, int root, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BROADCAST, buf, buf, count, dtype, 0, root, &c));
    return issue(group, &c, work, "broadcast_async");
}

ddp_status_t ddp_group_reduce_scatter_async(ddp_group_t *group, const void *send, void *recv,
                                            size_t recv_count, ddp_dtype_t dtype,
                                            ddp_reduce_op_t op, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__REDUCE_SCATTER, send, recv, recv_count, dtype, op, 0, &c));
    return issue(group, &c, work, "reduce_scatter_async");
}

ddp_status_t ddp_group_allgather_async(ddp_group_t *group, const void *send, void *recv,
                                       size_t send_count, ddp_dtype_t dtype, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLGATHER, send, recv, send_count, dtype, 0, 0, &c));
    return issue(group, &c, work, "allgather_async");
}

ddp_status_t ddp_group_barrier_async(ddp_group_t *group, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BARRIER, NULL, NULL, 0, DDP_U8, 0, 0, &c));
    return issue(group, &c, work, "barrier_async");
}

ddp_status_t ddp_group_allreduce(ddp_group_t *group, const void *send, void *recv, size_t count,
                                 ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLREDUCE, send, recv, count, dtype, op, 0, &c));
    return run_blocking(group, &c);
}

ddp_status_t ddp_group_broadcast(ddp_group_t *group, void *buf, size_t count, ddp_dtype_t dtype,
                                 int root)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BROADCAST, buf, buf, count, dtype, 0, root, &c));
    return run_blocking(group, &c);
}

ddp_status_t ddp_group_reduce_scatter(ddp_group_t *group, const void *send, void *recv,
                                      size_t recv_count, ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__REDUCE_SCATTER, send, recv, recv_count, dtype, op, 0, &c));
    return run_blocking(group, &c);
}

ddp_status_t ddp_group_allgather(ddp_group_t *group, const void *send, void *recv,
                                 size_t send_count, ddp_dtype_t dtype)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLGATHER, send, recv, send_count, dtype, 0, 0, &c));
    return run_blocking(group, &c);
}

ddp_status_t ddp_group_barrier(ddp_group_t *group)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BARRIER, NULL, NULL, 0, DDP_U8, 0, 0, &c));
    return run_blocking(group, &c);
}

ddp_status_t ddp_group_submit(ddp_group_t *group, ddp_task_fn fn, void *arg, ddp_work_t **work)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "submit"));
    if (!fn) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "submit: fn is NULL");
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "submit: work is NULL");
    return enqueue(group, NULL, fn, arg, work);
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
    return wait_work(work);
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
    if (work) work_unref(work);
}

/* ---- buffers ------------------------------------------------------------------------------ */

ddp_status_t ddp_group_alloc_buffer(ddp_group_t *group, size_t bytes, void **out)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "alloc_buffer"));
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alloc_buffer: out is NULL");
    if (bytes > SIZE_MAX / 4)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alloc_buffer: bytes %zu is too large", bytes);
    if (atomic_load(&group->broken)) return aborted_error(group, "alloc_buffer");
    if (group->ops->alloc_buffer) {
        ddp_status_t s = group->ops->alloc_buffer(group->state, bytes, out);
        if (s == DDP_ERR_MISMATCH) {
            /* Ranks disagree on the sizes (and on later buffers' order): like a mismatched
             * collective, this breaks the group so later calls fail instead of hanging. */
            char text[DDP_ERROR_TEXT_MAX];
            snprintf(text, sizeof text, "%s", ddp_last_error());
            break_group(group, s, text);
            ddp__set_error_text(text);
        }
        return s;
    }
    /* Ordinary memory: nothing to agree on, but the call is collective, so check that every
     * rank asked for the same size (as shm does) and break the group if not: a rank that later
     * reduces more elements than its peers' buffers hold would otherwise fail far from here. */
    if (group->world > 1) {
        int64_t range[2] = {(int64_t)bytes, -(int64_t)bytes}; /* MAX gives largest, -smallest */
        ddp_status_t s = ddp_group_allreduce(group, range, range, 2, DDP_I64, DDP_MAX);
        if (s != DDP_OK) return s;
        if (range[0] != -range[1]) {
            char text[DDP_ERROR_TEXT_MAX];
            snprintf(text, sizeof text,
                     "alloc_buffer on rank %d: the ranks asked for different sizes (smallest "
                     "%lld bytes, largest %lld bytes; this rank %zu bytes): every rank must ask "
                     "for the same size in the same order",
                     group->rank, (long long)-range[1], (long long)range[0], bytes);
            break_group(group, DDP_ERR_MISMATCH, text);
            return ddp__error(DDP_ERR_MISMATCH, "%s", text);
        }
    }
    fallback_buffer_t *node = ddp__calloc(1, sizeof *node, "a buffer record");
    if (!node) return DDP_ERR_NO_MEMORY;
    size_t rounded = (bytes + 63) / 64 * 64;
    node->ptr = aligned_alloc(64, rounded ? rounded : 64);
    if (!node->ptr) {
        free(node);
        return ddp__error(DDP_ERR_NO_MEMORY, "alloc_buffer: out of memory for %zu bytes", bytes);
    }
    memset(node->ptr, 0, rounded ? rounded : 64);
    pthread_mutex_lock(&group->mu);
    node->next = group->fallback_buffers;
    group->fallback_buffers = node;
    pthread_mutex_unlock(&group->mu);
    *out = node->ptr;
    return DDP_OK;
}

void ddp__group_advise_cold_results(ddp_group_t *group, void *buffer)
{
    if (group && buffer && group->ops->advise_cold_results)
        group->ops->advise_cold_results(group->state, buffer);
}

ddp_status_t ddp_group_free_buffer(ddp_group_t *group, void *buffer)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "free_buffer"));
    if (!buffer) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "free_buffer: buffer is NULL");
    if (group->ops->free_buffer) return group->ops->free_buffer(group->state, buffer);
    pthread_mutex_lock(&group->mu);
    fallback_buffer_t **link = &group->fallback_buffers;
    while (*link && (*link)->ptr != buffer) link = &(*link)->next;
    fallback_buffer_t *node = *link;
    if (node) *link = node->next;
    pthread_mutex_unlock(&group->mu);
    if (!node)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "free_buffer: %p was not returned by ddp_group_alloc_buffer on this group",
                          buffer);
    free(node->ptr);
    free(node);
    return DDP_OK;
}

ddp_status_t ddp_group_register_memory(ddp_group_t *group, void *ptr, size_t bytes)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "register_memory"));
    if (!ptr || bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "register_memory: %s",
                          ptr ? "bytes is 0" : "ptr is NULL");
    if ((uintptr_t)ptr > UINTPTR_MAX - bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "register_memory: %p + %zu bytes wraps around the address space", ptr,
                          bytes);
    if (atomic_load(&group->broken)) return aborted_error(group, "register_memory");
    return group->ops->register_memory ? group->ops->register_memory(group->state, ptr, bytes)
                                       : DDP_OK;
}

ddp_status_t ddp_group_unregister_memory(ddp_group_t *group, void *ptr)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "unregister_memory"));
    if (!ptr) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "unregister_memory: ptr is NULL");
    /* Also on a broken group: the pages must go back to ordinary memory whatever happened. */
    return group->ops->unregister_memory ? group->ops->unregister_memory(group->state, ptr)
                                         : DDP_OK;
}

/* ---- accessors ---------------------------------------------------------------------------- */

int ddp_group_rank(const ddp_group_t *group) { return group ? group->rank : -1; }
int ddp_group_size(const ddp_group_t *group) { return group ? group->world : 0; }
int ddp_group_timeout_ms(const ddp_group_t *group) { return group ? group->timeout_ms : 0; }
const char *ddp_group_transport(const ddp_group_t *group)
{
    return group && group->ops ? group->ops->name : "none";
}

const char *ddp_group_algorithm(const ddp_group_t *group)
{
    if (!group || !group->ops) return "none";
    if (!group->ops->algorithm || !group->state) return group->ops->name;
    return group->ops->algorithm(group->state);
}

void ddp_group_set_trace(ddp_group_t *group, ddp_trace_t *trace)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (group) atomic_store_explicit(&group->trace, trace, memory_order_release);
}

ddp_trace_t *ddp_group_trace(const ddp_group_t *group)
{
    ddp__clear_error();
    return group ? atomic_load_explicit(&((ddp_group_t *)group)->trace, memory_order_acquire)
                 : NULL;
}

/* ---- creation ----------------------------------------------------------------------------- */

/* Sets `key` and reads the same key of every rank into values[r] (malloc'd, NUL-terminated). */
static ddp_status_t exchange(ddp_store_t *store, const char *prefix, const char *what, int rank,
                             int world, int timeout_ms, const char *mine, char **values)
{
    char key[700];
    snprintf(key, sizeof key, "%s/%s/%d", prefix, what, rank);
    ddp_status_t s = ddp_store_set(store, key, mine, strlen(mine));
    if (s != DDP_OK) return ddp__error_context(s, "group rendezvous: publishing %s", key);
    char **keys = calloc((size_t)world, sizeof *keys);
    char *keybuf = calloc((size_t)world, 700);
    if (!keys || !keybuf) {
        free(keys);
        free(keybuf);
        return ddp__error(DDP_ERR_NO_MEMORY, "group rendezvous: out of memory");
    }
    for (int r = 0; r < world; r++) {
        keys[r] = keybuf + (size_t)r * 700;
        snprintf(keys[r], 700, "%s/%s/%d", prefix, what, r);
    }
    s = ddp_store_wait(store, (const char *const *)keys, (size_t)world, timeout_ms);
    if (s != DDP_OK) {
        ddp__error_context(s, "group rendezvous (rank %d of %d) waiting for every rank's %s",
                           rank, world, what);
        goto out;
    }
    for (int r = 0; r < world; r++) {
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(store, keys[r], &v, &len);
        if (s != DDP_OK) {
            ddp__error_context(s, "group rendezvous: reading %s", keys[r]);
            for (int k = 0; k < r; k++) {
                free(values[k]);
                values[k] = NULL;
            }
            goto out;
        }
        values[r] = v;
    }
out:
    free(keys);
    free(keybuf);
    return s;
}

static void free_values(char **values, int n)
{
    for (int i = 0; i < n; i++) {
        ddp_free(values[i]);
        values[i] = NULL;
    }
}

/* A state made by a transport's split op that no group took over. */
typedef struct split_state {
    const ddp__transport_ops_t *ops;
    void *state;
} split_state_t;

static void release_split(split_state_t *made)
{
    if (made && made->state) made->ops->destroy(made->state);
}

/* made: NULL, or the state of a store-less subgroup already made by its transport's split op
 * (the group takes it over, also on failure). */
static ddp_status_t create_internal(ddp_store_t *store, int owns_store, int rank, int world,
                                    const ddp_group_options_t *options, const char *name,
                                    int timeout_ms, split_state_t *made, ddp_group_t **out)
{
    ddp_status_t s;
    ddp_group_t *g = ddp__calloc(1, sizeof *g, "a process group");
    if (!g) {
        release_split(made);
        return DDP_ERR_NO_MEMORY;
    }
    atomic_init(&g->refs, 1);
    g->store = store;
    g->owns_store = 0;
    g->rank = rank;
    g->world = world;
    g->timeout_ms = timeout_ms;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->queue_cv, NULL);
    pthread_cond_init(&g->done_cv, NULL);
    atomic_store(&g->last_progress_ns, ddp__now_ns());

    /* Which transport was asked for: the options, else DDP_TRANSPORT, else auto. Both variables
     * are read before the store is touched, so a bad value fails every rank at once. */
    const char *asked = options && options->transport ? options->transport : NULL;
    const char *env = NULL;
    const char *hierarchical = NULL;
    if ((s = ddp__env_text("DDP_TRANSPORT", &env)) != DDP_OK ||
        (s = ddp__env_text("DDP_HIERARCHICAL", &hierarchical)) != DDP_OK) {
        ddp__error_context(s, "group_create");
        goto fail;
    }
    if (!asked || strcmp(asked, "auto") == 0) asked = env ? env : "auto";
    if (!ddp__transport_known(asked)) {
        ddp__transport_find(asked, &s); /* records the text naming the known transports */
        ddp__error_context(s, "group_create");
        goto fail;
    }

    const char *chosen = "self";
    const ddp__transport_ops_t *storeless = NULL;
    if (world == 1 || !store) {
        snprintf(g->prefix, sizeof g->prefix, "ddp/group/%s/local", name);
        /* Without a store only a storeless transport can connect several ranks (MPI_COMM_WORLD
         * in rank order, or a subgroup made by its split op, whose state is handed in). */
        if (made) {
            storeless = made->ops;
        } else if (world > 1) {
            storeless = strcmp(asked, "auto") == 0 ? ddp__transport_storeless(&s)
                                                   : ddp__transport_find(asked, &s);
            if (!storeless) {
                ddp__error_context(s, "group_create (rank %d of %d)", rank, world);
                goto fail;
            }
            if (!storeless->storeless) {
                s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                               "group_create: transport '%s' needs a store (MASTER_ADDR and "
                               "MASTER_PORT); without one it cannot connect %d ranks",
                               asked, world);
                goto fail;
            }
        }
    } else {
        /* Instances of one name on one store are numbered: the k-th creation on every rank gets
         * instance k (every rank's add for instance k precedes any for k+1, since creation is
         * collective and completes only after every rank has added). */
        char key[600];
        snprintf(key, sizeof key, "ddp/group/%s/instances", name);
        int64_t v = 0;
        s = ddp_store_add(store, key, 1, &v);
        if (s != DDP_OK) {
            ddp__error_context(s, "group_create: counting instances of group '%s'", name);
            goto fail;
        }
        snprintf(g->prefix, sizeof g->prefix, "ddp/group/%s/%lld", name,
                 (long long)((v - 1) / world));

        char mine[512];
        char ident[400];
        ddp__host_identity(ident, sizeof ident);
        snprintf(mine, sizeof mine, "%s|%s", asked, ident);
        char **values = ddp__calloc((size_t)world, sizeof *values, "host identities");
        if (!values) {
            s = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        s = exchange(store, g->prefix, "host", rank, world, timeout_ms, mine, values);
        if (s != DDP_OK) {
            free(values);
            goto fail;
        }
        int same_host = 1;
        int bad = -1;
        for (int r = 0; r < world; r++) {
            const char *bar = strchr(values[r], '|');
            size_t alen = bar ? (size_t)(bar - values[r]) : strlen(values[r]);
            if (alen != strlen(asked) || strncmp(values[r], asked, alen) != 0) bad = r;
            if (!bar || strcmp(bar + 1, ident) != 0) same_host = 0;
        }
        if (bad >= 0) {
            s = ddp__error(DDP_ERR_MISMATCH,
                           "group_create: ranks ask for different transports: rank %d asks for "
                           "'%s' but rank %d asks for '%.*s'",
                           rank, asked, bad, (int)strcspn(values[bad], "|"), values[bad]);
            free_values(values, world);
            free(values);
            goto fail;
        }
        int other = 0;
        for (int r = 0; r < world; r++) {
            const char *bar = strchr(values[r], '|');
            if (!bar || strcmp(bar + 1, ident) != 0) {
                other = r;
                break;
            }
        }
        char other_host[256];
        snprintf(other_host, sizeof other_host, "%s", strchr(values[other], '|') ? strchr(values[other], '|') + 1 : "?");
        free_values(values, world);
        free(values);

        if (strcmp(asked, "auto") == 0) {
            /* Several hosts: shared memory inside each, TCP between them, unless
             * DDP_HIERARCHICAL=0 asks for flat TCP. */
            chosen = same_host ? "shm"
                               : (strcmp(hierarchical, "0") != 0 ? "hierarchical" : "tcp");
        } else if (strcmp(asked, "shm") == 0 && !same_host) {
            s = ddp__error(DDP_ERR_UNSUPPORTED,
                           "group_create: transport shm needs every rank on one host, but rank "
                           "%d is on '%s' and rank %d on '%s'",
                           rank, ident, other, other_host);
            goto fail;
        } else {
            chosen = asked;
        }
    }
    g->ops = storeless ? storeless : ddp__transport_find(chosen, &s);
    if (!g->ops) {
        ddp__error_context(s, "group_create (rank %d of %d)", rank, world);
        goto fail;
    }
    if (made) {
        g->state = made->state;
        made = NULL;
        s = DDP_OK;
    } else {
        s = g->ops->create(store, g->prefix, rank, world, timeout_ms, &g->state);
    }
    if (s != DDP_OK) {
        ddp__error_context(s, "group_create: transport %s (rank %d of %d)", g->ops->name, rank,
                           world);
        g->ops = NULL;
        goto fail;
    }
    int rc = pthread_create(&g->thread, NULL, progress_main, g);
    if (rc != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, rc, "group_create: starting the progress thread");
        g->ops->destroy(g->state);
        goto fail;
    }
    g->thread_started = 1;
    g->owns_store = owns_store;
    *out = g;
    DDP_LOG(DDP_LOG_INFO, "group %s: rank %d of %d over %s", g->prefix, rank, world,
            g->ops->name);
    return DDP_OK;
fail:
    release_split(made);
    group_free(g);
    return s;
}

static ddp_status_t check_options(const ddp_group_options_t *options, const char *fn)
{
    if (!options) return DDP_OK;
    if (options->timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: options->timeout_ms %d is negative", fn,
                          options->timeout_ms);
    if (options->name && (options->name[0] == '\0' || strlen(options->name) > 200))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: options->name must be 1 to 200 characters", fn);
    return DDP_OK;
}

/* Checks every DDP_* variable before anything else (so a bad value fails each rank at once, before
 * a rank that read it in a transport leaves its peers waiting, and a value read only on some
 * paths - several hosts, several ranks on one host - is caught on the first small run too), then
 * gives the group's timeout: the options', else DDP_TIMEOUT. */
static ddp_status_t checked_timeout(const ddp_group_options_t *options, const char *fn,
                                   int *timeout_ms)
{
    ddp_status_t s = ddp_config_check();
    if (s == DDP_OK && !(options && options->timeout_ms > 0))
        s = ddp__env_seconds_ms("DDP_TIMEOUT", timeout_ms);
    else if (s == DDP_OK)
        *timeout_ms = options->timeout_ms;
    return s == DDP_OK ? DDP_OK : ddp__error_context(s, "%s", fn);
}

ddp_status_t ddp_group_create(ddp_store_t *store, int rank, int world_size,
                              const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    /* A store-less group exists only internally (MPI under mpirun, MPI subgroups); the public
     * entry point always needs the rendezvous store, even for world_size 1. */
    if (!store) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create: store is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create: out is NULL");
    if (world_size < 1 || world_size > GROUP_MAX_WORLD)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "group_create: world_size %d is out of range [1, %d]", world_size,
                          GROUP_MAX_WORLD);
    if (rank < 0 || rank >= world_size)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "group_create: rank %d is out of range [0, %d)", rank, world_size);
    TRY(check_options(options, "group_create"));
    int timeout_ms = 0;
    TRY(checked_timeout(options, "group_create", &timeout_ms));
    const char *name = options && options->name ? options->name : "default";
    return create_internal(store, 0, rank, world_size, options, name, timeout_ms, NULL, out);
}

ddp_status_t ddp_group_create_from_env(const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create_from_env: out is NULL");
    TRY(check_options(options, "group_create_from_env"));
    int timeout_ms = 0;
    TRY(checked_timeout(options, "group_create_from_env", &timeout_ms));
    ddp_env_t env;
    ddp_status_t s = ddp_env_read(&env);
    if (s != DDP_OK) return ddp__error_context(s, "group_create_from_env");
    const char *name = options && options->name ? options->name : "default";
    /* A storeless transport asked for by name (mpi) connects the ranks by itself when no store
     * is named. Otherwise the ranks meet through a store (src/group/rendezvous.c: the one the
     * launcher names, or one a rank hosts), and the group picks shared memory inside a host. */
    const char *asked = options && options->transport && strcmp(options->transport, "auto")
                            ? options->transport
                            : NULL;
    if (!asked) TRY(ddp__env_text("DDP_TRANSPORT", &asked));
    int storeless = 0;
    if (!env.store_source && env.world_size > 1 && asked && strcmp(asked, "auto") != 0 &&
        ddp__transport_known(asked)) {
        ddp_status_t found = DDP_OK;
        const ddp__transport_ops_t *ops = ddp__transport_find(asked, &found);
        if (ops && ops->storeless) storeless = 1;
        else if (!ops) return ddp__error_context(found, "group_create_from_env");
    }
    ddp__rendezvous_t meet;
    memset(&meet, 0, sizeof meet);
    if (env.world_size > 1 && !storeless) {
        s = ddp__rendezvous(&env, timeout_ms, &meet);
        if (s != DDP_OK)
            return ddp__error_context(s, "group_create_from_env (rank %d of %d, launcher '%s')",
                                      env.rank, env.world_size, env.source);
    }
    s = create_internal(meet.store, 1, env.rank, env.world_size, options, name, timeout_ms, NULL,
                        out);
    if (s != DDP_OK) {
        ddp_store_destroy(meet.store);
        ddp_store_destroy(meet.base);
        ddp_store_server_stop(meet.server);
        return s;
    }
    (*out)->base_store = meet.base;
    (*out)->server = meet.server;
    (*out)->hosted_by_rank = meet.hosted_by_rank;
    return DDP_OK;
}

/* A store hosted by a rank must outlive the other ranks' use of it: each rank leaves a key when
 * its group is gone, and the host waits for them all (bounded by the group's timeout, skipped
 * when the group is broken: a dead rank leaves no key) before stopping its server. */
static void leave_hosted_store(ddp_group_t *g)
{
    if (!g->hosted_by_rank || !g->store || g->world < 2 || atomic_load(&g->broken)) return;
    char key[64];
    if (!g->server) {
        /* The host may be gone already (its rank failed after ours last heard of it): a few
         * seconds to reconnect at most, not the store's whole timeout. */
        ddp_store_set_timeout(g->store, g->timeout_ms < 5000 ? g->timeout_ms : 5000);
        snprintf(key, sizeof key, "ddp/launch/left/%d", g->rank);
        ddp_store_set(g->store, key, "1", 1);
        return;
    }
    char **keys = calloc((size_t)g->world, sizeof *keys);
    int n = 0;
    for (int r = 0; keys && r < g->world; r++) {
        if (r == g->rank) continue;
        snprintf(key, sizeof key, "ddp/launch/left/%d", r);
        keys[n] = strdup(key);
        if (!keys[n]) break;
        n++;
    }
    if (keys && n == g->world - 1) {
        ddp_status_t s = ddp_store_wait(g->store, (const char *const *)keys, (size_t)n,
                                        g->timeout_ms);
        if (s != DDP_OK)
            DDP_LOG(DDP_LOG_WARN, "rank %d: stopping the store it hosts before every rank left: %s",
                    g->rank, ddp_last_error());
    }
    for (int i = 0; keys && i < n; i++) free(keys[i]);
    free(keys);
}

ddp_status_t ddp_group_split(ddp_group_t *parent, const int *ranks, int nranks,
                             const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    if (!parent) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: parent is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: out is NULL");
    if (!ranks) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: ranks is NULL");
    if (nranks < 1 || nranks > parent->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: nranks %d is out of range [1, %d]",
                          nranks, parent->world);
    TRY(check_options(options, "group_split"));
    int my_index = -1;
    for (int i = 0; i < nranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= parent->world)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "group_split: ranks[%d] = %d is out of range [0, %d)", i, ranks[i],
                              parent->world);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "group_split: rank %d is listed twice (ranks[%d] and ranks[%d])",
                                  ranks[i], j, i);
        if (ranks[i] == parent->rank) my_index = i;
    }
    /* A broken parent fails at once, quoting its cause, on every rank (its failure reached every
     * rank). A parent that is not broken here may still have lost a rank: a barrier on it finds
     * a dead or missing peer within the transport's liveness checks, where the member lists'
     * comparison through the store below would wait the whole timeout for the dead rank's key. */
    if (atomic_load(&parent->broken)) return aborted_error(parent, "group_split");
    if (parent->world > 1) {
        ddp_status_t b = ddp_group_barrier(parent);
        if (b != DDP_OK)
            return atomic_load(&parent->broken) ? aborted_error(parent, "group_split") : b;
    }
    int k = ++parent->splits;
    char name[400];
    snprintf(name, sizeof name, "%s/split%d%s%s", parent->prefix + strlen("ddp/group/"), k,
             options && options->name ? "-" : "", options && options->name ? options->name : "");

    /* Every rank of the parent must pass the same list: compare through the store. */
    char mine[4096];
    size_t off = 0;
    for (int i = 0; i < nranks && off < sizeof mine - 16; i++)
        off += (size_t)snprintf(mine + off, sizeof mine - off, "%s%d", i ? "," : "", ranks[i]);
    int timeout_ms = options && options->timeout_ms > 0 ? options->timeout_ms
                                                        : parent->timeout_ms;
    ddp_status_t s = DDP_OK;
    if (parent->world > 1 && !parent->store) {
        /* A store-less group (MPI_COMM_WORLD over MPI): compare the lists with a collective on
         * the parent (an allgather of a hash of each rank's list), then build the subgroup with
         * the transport's split op (MPI_Comm_create_group over the parent's communicator, among
         * the members only). */
        if (!parent->ops->split)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "group_split: a group without a store can be split only over a "
                              "transport with a split operation, not '%s'",
                              parent->ops->name);
        /* FNV-1a over the count and every rank (not the text `mine`, which is cut at 4 KiB). */
        uint64_t h = 1469598103934665603ull;
        for (int i = -1; i < nranks; i++) {
            uint32_t v = (uint32_t)(i < 0 ? nranks : ranks[i]);
            for (int byte = 0; byte < 4; byte++)
                h = (h ^ ((v >> (8 * byte)) & 0xffu)) * 1099511628211ull;
        }
        int64_t *hashes = ddp__calloc((size_t)parent->world, sizeof *hashes, "split hashes");
        if (!hashes) return DDP_ERR_NO_MEMORY;
        int64_t my_hash = (int64_t)h;
        s = ddp_group_allgather(parent, &my_hash, hashes, 1, DDP_I64);
        if (s != DDP_OK) {
            free(hashes);
            return ddp__error_context(s, "group_split: comparing the member lists");
        }
        for (int r = 0; r < parent->world && s == DDP_OK; r++) {
            if (hashes[r] != my_hash)
                s = ddp__error(DDP_ERR_MISMATCH,
                               "group_split: ranks disagree on the members: rank %d passed [%s] "
                               "but rank %d passed a different list",
                               parent->rank, mine, r);
        }
        free(hashes);
        if (s != DDP_OK) return s;
        if (my_index < 0) {
            *out = NULL;
            return DDP_OK;
        }
        ddp_group_options_t sub = DDP_GROUP_OPTIONS_INIT;
        if (options) sub = *options;
        sub.transport = nranks > 1 ? parent->ops->name : NULL;
        if (nranks == 1)
            return create_internal(NULL, 0, 0, 1, &sub, name, timeout_ms, NULL, out);
        split_state_t made = {parent->ops, NULL};
        s = parent->ops->split(parent->state, ranks, nranks, name, &made.state);
        if (s != DDP_OK) return ddp__error_context(s, "group_split");
        return create_internal(NULL, 0, my_index, nranks, &sub, name, timeout_ms, &made, out);
    }
    if (parent->world > 1) {
        char prefix[600];
        snprintf(prefix, sizeof prefix, "ddp/group/%s", name);
        char **values = ddp__calloc((size_t)parent->world, sizeof *values, "split lists");
        if (!values) return DDP_ERR_NO_MEMORY;
        s = exchange(parent->store, prefix, "members", parent->rank, parent->world, timeout_ms,
                     mine, values);
        if (s != DDP_OK) {
            free(values);
            return ddp__error_context(s, "group_split");
        }
        for (int r = 0; r < parent->world && s == DDP_OK; r++) {
            if (strcmp(values[r], mine) != 0)
                s = ddp__error(DDP_ERR_MISMATCH,
                               "group_split: ranks disagree on the members: rank %d passed [%s] "
                               "but rank %d passed [%s]",
                               parent->rank, mine, r, values[r]);
        }
        free_values(values, parent->world);
        free(values);
        if (s != DDP_OK) return s;
    }
    if (my_index < 0) {
        *out = NULL;
        return DDP_OK;
    }
    ddp_group_options_t sub = DDP_GROUP_OPTIONS_INIT;
    if (options) sub = *options;
    return create_internal(parent->store, 0, my_index, nranks, &sub, name, timeout_ms, NULL, out);
}

/* ---- internal tasks and point-to-point pairs (group_private.h) ---------------------------- */

ddp_status_t ddp__group_task(ddp_group_t *g, ddp_task_fn fn, void *arg, void (*free_arg)(void *),
                             ddp_work_t **work)
{
    ddp_status_t s;
    if (work) {
        s = enqueue(g, NULL, fn, arg, work);
        if (s == DDP_OK) (*work)->task_free = free_arg;
        else if (free_arg) free_arg(arg);
        return s;
    }
    if (progress_group == g || inline_group == g) {
        if (atomic_load(&g->broken)) s = aborted_error(g, "collective");
        else s = fn(g, arg);
        if (free_arg) free_arg(arg);
        return s;
    }
    /* Idle: run on the calling thread, as run_blocking does for one collective. */
    pthread_mutex_lock(&g->mu);
    int inline_ok = !g->head && !g->busy && !g->stop;
    if (inline_ok) g->busy = 1;
    pthread_mutex_unlock(&g->mu);
    if (inline_ok) {
        if (atomic_load(&g->broken)) {
            s = aborted_error(g, "collective");
        } else {
            inline_group = g;
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            s = fn(g, arg);
            atomic_store(&g->last_progress_ns, ddp__now_ns());
            inline_group = NULL;
        }
        if (free_arg) free_arg(arg);
        pthread_mutex_lock(&g->mu);
        g->busy = 0;
        if (g->head || g->stop) pthread_cond_signal(&g->queue_cv);
        pthread_mutex_unlock(&g->mu);
        return s;
    }
    ddp_work_t *w = NULL;
    s = enqueue(g, NULL, fn, arg, &w);
    if (s != DDP_OK) {
        if (free_arg) free_arg(arg);
        return s;
    }
    w->task_free = free_arg;
    s = wait_work(w);
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "%s", ddp_last_error());
    ddp_work_free(w);
    if (s != DDP_OK) ddp__set_error_text(text);
    return s;
}

void ddp__group_fail(ddp_group_t *g, ddp_status_t status, const char *text, int tell_peers)
{
    break_group_ex(g, status, text, tell_peers);
}

ddp_status_t ddp__group_pair(ddp_group_t *g, int peer, ddp_group_t **out)
{
    if (!g->pairs) {
        g->pairs = ddp__calloc((size_t)g->world, sizeof *g->pairs, "point-to-point pairs");
        if (!g->pairs) return DDP_ERR_NO_MEMORY;
    }
    if (g->pairs[peer]) {
        *out = g->pairs[peer];
        return DDP_OK;
    }
    if (!g->store)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "send/recv on rank %d: group %s has no store (a store-less MPI group), "
                          "and point-to-point pairs are made through the store",
                          g->rank, g->prefix);
    /* The pair is a group of two on the parent's store, named after the parent instance and
     * the two ranks: both sides make it at their first send/recv with each other, in issue
     * order, so it is made exactly once per pair. Its transport follows the parent's: shm and
     * mpi as the parent (an MPI pair is made by its two members only), tcp for tcp and
     * hierarchical (two ranks need no hierarchy). */
    int lo = g->rank < peer ? g->rank : peer, hi = g->rank < peer ? peer : g->rank;
    char name[600];
    snprintf(name, sizeof name, "%s/p2p%d_%d", g->prefix + strlen("ddp/group/"), lo, hi);
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = g->timeout_ms;
    options.transport = !strcmp(g->ops->name, "shm") || !strcmp(g->ops->name, "mpi")
                            ? g->ops->name : "tcp";
    ddp_group_t *pair = NULL;
    ddp_status_t s = create_internal(g->store, 0, g->rank == lo ? 0 : 1, 2, &options, name,
                                     g->timeout_ms, NULL, &pair);
    if (s != DDP_OK)
        return ddp__error_context(s, "rank %d making its point-to-point pair with rank %d", g->rank,
                                  peer);
    g->pairs[peer] = pair;
    *out = pair;
    return DDP_OK;
}

ddp_status_t ddp_group_enable_recv_any(ddp_group_t *group)
{
    ddp__clear_error();
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "enable_recv_any: group is NULL");
    if (!group->store)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "enable_recv_any on rank %d: group %s has no store (a store-less MPI "
                          "group), and senders announce themselves through the store",
                          group->rank, group->prefix);
    group->recv_any = 1;
    return DDP_OK;
}

int ddp__group_recv_any_enabled(const ddp_group_t *g) { return g->recv_any; }

static void sent_key(const ddp_group_t *g, int from, int to, char *key, size_t size)
{
    snprintf(key, size, "%s/p2p_sent/%d_%d", g->prefix, from, to);
}

ddp_status_t ddp__group_p2p_count(ddp_group_t *g, int peer, int is_send)
{
    if (is_send) {
        if (!g->recv_any) return DDP_OK;
        char key[700];
        int64_t n = 0;
        sent_key(g, g->rank, peer, key, sizeof key);
        ddp_status_t s = ddp_store_add(g->store, key, 1, &n);
        if (s != DDP_OK)
            return ddp__error_context(s, "rank %d announcing its send to rank %d in the store",
                                      g->rank, peer);
        return DDP_OK;
    }
    if (!g->received) {
        g->received = ddp__calloc((size_t)g->world, sizeof *g->received, "recv counts per peer");
        if (!g->received) return DDP_ERR_NO_MEMORY;
    }
    g->received[peer]++;
    return DDP_OK;
}

/* Polls every peer's count of sends to this rank (one store add of 0 each, round robin from the
 * last source picked) until one exceeds the recvs from it, backing off from 20 us to 2 ms, until
 * the group's timeout or until the group breaks. */
ddp_status_t ddp__group_p2p_any_source(ddp_group_t *g, int tag, int *out)
{
    if (!g->recv_any)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "recv from any source (tag %d) on rank %d: group %s was not enabled "
                          "for it (ddp_group_enable_recv_any on every rank before its first send)",
                          tag, g->rank, g->prefix);
    if (!g->received) {
        g->received = ddp__calloc((size_t)g->world, sizeof *g->received, "recv counts per peer");
        if (!g->received) return DDP_ERR_NO_MEMORY;
    }
    int64_t deadline = ddp__now_ns() + (int64_t)g->timeout_ms * 1000000;
    int64_t pause_us = 20;
    for (;;) {
        for (int i = 1; i <= g->world; i++) {
            int p = (g->any_next + i) % g->world;
            if (p == g->rank) continue;
            char key[700];
            int64_t sent = 0;
            sent_key(g, p, g->rank, key, sizeof key);
            ddp_status_t s = ddp_store_add(g->store, key, 0, &sent);
            if (s != DDP_OK)
                return ddp__error_context(s, "recv from any source on rank %d reading the sends "
                                          "of rank %d", g->rank, p);
            if (sent > g->received[p]) {
                g->any_next = p;
                *out = p;
                return DDP_OK;
            }
        }
        if (atomic_load(&g->broken))
            return ddp__error(DDP_ERR_ABORTED,
                              "recv from any source (tag %d) on rank %d: the group broke while "
                              "it waited for a sender", tag, g->rank);
        if (ddp__now_ns() > deadline)
            return ddp__error(DDP_ERR_TIMEOUT,
                              "recv from any source (tag %d) on rank %d: no rank of the %d sent "
                              "to it within %d ms", tag, g->rank, g->world, g->timeout_ms);
        ddp__sleep_us(pause_us);
        pause_us = pause_us * 2 > 2000 ? 2000 : pause_us * 2;
    }
}

void ddp_group_destroy(ddp_group_t *group)
{
    if (!group) return;
    if (group->thread_started) {
        pthread_mutex_lock(&group->mu);
        group->stop = 1;
        pthread_cond_signal(&group->queue_cv);
        pthread_mutex_unlock(&group->mu);
        if (progress_group != group) pthread_join(group->thread, NULL);
        else pthread_detach(group->thread);
    }
    if (group->pairs) {
        for (int r = 0; r < group->world; r++) ddp_group_destroy(group->pairs[r]);
        free(group->pairs);
        group->pairs = NULL;
    }
    free(group->received);
    group->received = NULL;
    if (group->ops) group->ops->destroy(group->state);
    group->ops = NULL;
    group->state = NULL;
    if (group->owns_store) {
        leave_hosted_store(group);
        ddp_store_destroy(group->store);
    }
    group->store = NULL;
    ddp_store_destroy(group->base_store);
    group->base_store = NULL;
    ddp_store_server_stop(group->server);
    group->server = NULL;
    group_unref(group);
}
