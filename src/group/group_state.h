/* The inside of a group and of a work, shared by the group's own files: group.c (issuing and
 * the argument checks, buffers, accessors), group_queue.c (the work queue and the progress
 * thread) and group_life.c (create, split, destroy, point-to-point pairs). Group-private. */
#ifndef DDP_GROUP_GROUP_STATE_H
#define DDP_GROUP_GROUP_STATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/internal.h"
#include "ddp/ddp.h"
#include "transport/transport.h"


#define GROUP_MAX_WORLD 4096
/* Added to ddp_group.pending when a stop is requested (far above any queue length). */
#define GROUP_STOPPING (1 << 30)


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
    /* A collective or task is executing, on the progress thread or inline on a caller's thread.
     * Whoever sets it 0 -> 1 (compare-exchange) holds the group: no lock is needed to run a
     * collective inline. The progress thread claims it under `mu`; an inline caller without. */
    _Atomic int busy;
    /* Queued works, plus GROUP_STOPPING once a stop is requested: changed under `mu`, read
     * without it by an inline caller, which runs only while it is 0. */
    _Atomic int pending;
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

/* ---- group_queue.c ---- */

/* Frees a group whose last reference is gone (or that never started). */
void ddp__group_free(ddp_group_t *g);
void ddp__group_unref(ddp_group_t *g);
void ddp__group_work_unref(ddp_work_t *w);
/* Breaks the group: records status and text, tells the transport (tell_peers) and fails every
 * queued work. break_group tells the peers. */
void ddp__group_break_group_ex(ddp_group_t *g, ddp_status_t status, const char *text,
                               int tell_peers);
void ddp__group_break_group(ddp_group_t *g, ddp_status_t status, const char *text);
/* DDP_ERR_ABORTED quoting why the group broke, for a call named `what`. */
ddp_status_t ddp__group_aborted_error(ddp_group_t *g, const char *what);
/* Queues a collective (c) or a task (fn) and returns its work. */
ddp_status_t ddp__group_enqueue(ddp_group_t *g, const ddp__collective_t *c, ddp_task_fn fn,
                                void *arg, ddp_work_t **out);
/* Runs a collective now (inline on the progress thread or in a task) or queues it and waits. */
ddp_status_t ddp__group_run_blocking(ddp_group_t *g, ddp__collective_t *c);
/* The progress thread's body (pthread_create's start routine; arg is the group). */
void *ddp__group_progress_main(void *arg);
/* Whether the calling thread is `g`'s progress thread. */
int ddp__group_is_progress_thread(const ddp_group_t *g);

#endif
