/* The agent: torchrun's steps for one node's part of the job. Start the workers; monitor them
 * (the event loop: signals to forward, output to copy, workers to reap, another node's failure,
 * --timeout); when one fails, blame the culprit and stop the rest; when all are done, linger for
 * the other nodes; then restart while --max-restarts allows. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddprun.h"

/* Starts the teardown of this attempt: SIGTERM to every worker now, SIGKILL after --grace
 * (enforce_stops). The first call's exit code is the job's. */
static void begin_stop(job_t *job, int exit_code)
{
    if (job->stopping) return;
    job->stopping = 1;
    job->exit_code = exit_code;
    if (job->running > 0) {
        fprintf(stderr, "ddprun: stopping %d remaining worker%s (SIGTERM, SIGKILL after %g s)\n",
                job->running, job->running == 1 ? "" : "s", job->opt.grace_s);
        signal_workers(job, SIGTERM);
    }
    job->kill_at = now_s() + job->opt.grace_s;
}

/* ---- blame: which failed worker is the cause ---------------------------------------------- */

static void describe_exit(char *out, size_t size, const worker_t *w, int node, int nnodes)
{
    char where[48] = "";
    if (nnodes > 1) snprintf(where, sizeof where, " on node %d", node);
    if (WIFSIGNALED(w->status)) {
        int sig = WTERMSIG(w->status);
        snprintf(out, size, "rank %d (pid %d) killed by signal %d (%s)%s", w->rank, (int)w->pid,
                 sig, signal_name(sig), where);
    } else {
        snprintf(out, size, "rank %d (pid %d) exited with status %d%s", w->rank, (int)w->pid,
                 WEXITSTATUS(w->status), where);
    }
}

/* How sure ddprun is that a failed worker is the cause rather than a casualty, strongest first.
 * A worker that a peer's failure reached (a libddp rank returns DDP_ERR_REMOTE or
 * DDP_ERR_ABORTED and its program exits 1) dies by its own exit; a worker that ddprun did not
 * signal and that nevertheless died by a signal was killed from outside (the OOM killer, kill -9,
 * a crash) and cannot be anyone's casualty. A shell reports its child's signal death as exit
 * status 128+N, so a worker running `sh -c 'trainer ...'` ranks with the signal deaths. */
enum { FAILURE_NONE, FAILURE_SIGNAL, FAILURE_SHELL_SIGNAL, FAILURE_EXIT };

static int failure_kind(const worker_t *w)
{
    if (w->running || !w->reaped) return FAILURE_NONE;
    if (WIFSIGNALED(w->status)) return FAILURE_SIGNAL;
    int code = WIFEXITED(w->status) ? WEXITSTATUS(w->status) : 1;
    if (code == 0) return FAILURE_NONE;
    if (code > 128 && code <= 128 + 64) return FAILURE_SHELL_SIGNAL;
    return FAILURE_EXIT;
}

/* The culprit among the failed workers: the strongest kind, and among those the first reaped. */
static worker_t *choose_culprit(job_t *job)
{
    worker_t *best = NULL;
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        int kind = failure_kind(w);
        if (kind == FAILURE_NONE) continue;
        if (!best || kind < failure_kind(best) ||
            (kind == failure_kind(best) && w->reaped < best->reaped))
            best = w;
    }
    return best;
}

/* Names the culprit (and, after it, the workers that failed with it), tells the other nodes and
 * stops the rest of the job. ddprun exits with the culprit's status: 128+N for a signal death
 * (also one its shell reported), 1 for any other failure. */
static void blame(job_t *job)
{
    worker_t *culprit = choose_culprit(job);
    job->blame_until = 0;
    if (!culprit || job->stopping) return;
    char text[FAILURE_TEXT_MAX];
    describe_exit(text, sizeof text, culprit, job->opt.node_rank, job->opt.nnodes);
    fprintf(stderr, "ddprun: %s\n", text);
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (w == culprit || failure_kind(w) == FAILURE_NONE) continue;
        char other[FAILURE_TEXT_MAX];
        describe_exit(other, sizeof other, w, job->opt.node_rank, job->opt.nnodes);
        fprintf(stderr, "ddprun: after it, %s\n", other);
    }
    publish_failure(job, text);
    int code = 1;
    if (WIFSIGNALED(culprit->status)) code = 128 + WTERMSIG(culprit->status);
    else if (failure_kind(culprit) == FAILURE_SHELL_SIGNAL) code = WEXITSTATUS(culprit->status);
    begin_stop(job, code);
}

/* Reaps the workers that exited. The first failure does not end the job at once: over TCP a
 * SIGKILLed rank's peers see the connection reset and exit 1 within microseconds, sometimes
 * before ddprun reaps the killed rank, and waitpid then reports the casualty first (6 of 48 kills
 * named the wrong rank). So a failure opens a window of BLAME_WINDOW_S in which the others may
 * be reaped too, and ddprun names the culprit (choose_culprit) once the window closes, once a
 * signal death settles it, or once no worker is left. The workers still running get their SIGTERM
 * that much later; they are blocked in a collective or exiting on the failure anyway. */
static void reap(job_t *job)
{
    for (;;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) break;
        for (int i = 0; i < job->nworkers; i++) {
            worker_t *w = &job->workers[i];
            if (w->pid != pid || !w->running) continue;
            w->running = 0;
            w->status = status;
            w->reaped = ++job->reaped;
            job->running--;
            if (failure_kind(w) != FAILURE_NONE && !job->stopping && job->blame_until == 0)
                job->blame_until = now_s() + BLAME_WINDOW_S;
        }
    }
    if (job->blame_until == 0 || job->stopping) return;
    worker_t *culprit = choose_culprit(job);
    if (failure_kind(culprit) == FAILURE_SIGNAL || job->running == 0 || now_s() >= job->blame_until)
        blame(job);
}

/* ---- monitor: the event loop --------------------------------------------------------------- */

/* What the event loop carries from one turn to the next. */
typedef struct loop {
    struct pollfd *fds; /* the signal pipe, the notify pipe, then every open output pipe */
    worker_t **owner;   /* the worker of fds[i] (i >= 2) */
    stream_t **stream_of;
    int nfds;
    double drain_until;  /* after the last worker: stop waiting for stray pipe writers */
    int sent_exited;     /* this node counted itself out (job/exited) */
    double linger_until; /* node 0: wait for the other nodes before closing the store */
} loop_t;

/* Waits up to 100 ms for a signal, a word from the watcher or a worker's output. */
static void wait_for_events(job_t *job, loop_t *l)
{
    l->nfds = 0;
    if (!l->fds) {
        sleep_ms(100);
        return;
    }
    l->fds[l->nfds++] = (struct pollfd){signal_fd(), POLLIN, 0};
    l->fds[l->nfds++] = (struct pollfd){job->watch.notify_pipe[0], POLLIN, 0};
    for (int i = 0; i < job->nworkers; i++) {
        stream_t *ss[2] = {&job->workers[i].out, &job->workers[i].err};
        for (int k = 0; k < 2; k++) {
            if (ss[k]->fd < 0) continue;
            l->owner[l->nfds] = &job->workers[i];
            l->stream_of[l->nfds] = ss[k];
            l->fds[l->nfds++] = (struct pollfd){ss[k]->fd, POLLIN, 0};
        }
    }
    if (poll(l->fds, (nfds_t)l->nfds, 100) < 0 && errno != EINTR) perror("ddprun: poll");
}

/* Signals sent to ddprun go to every worker; a second one escalates to SIGKILL. */
static void forward_signals(job_t *job)
{
    const options_t *o = &job->opt;
    unsigned char sigs[16];
    ssize_t got;
    while ((got = read(signal_fd(), sigs, sizeof sigs)) > 0) {
        /* A failure awaiting its culprit is named before the signal changes the job's end. */
        if (job->blame_until > 0) blame(job);
        for (ssize_t k = 0; k < got; k++) {
            int sig = sigs[k];
            job->final = 1; /* the user stops the job: no restart */
            if (!job->stopping) {
                fprintf(stderr, "ddprun: received %s, forwarding it to the workers\n",
                        signal_name(sig));
                char text[FAILURE_TEXT_MAX];
                snprintf(text, sizeof text, "ddprun on node %d received %s", o->node_rank,
                         signal_name(sig));
                publish_failure(job, text);
                job->stopping = 1;
                job->final = 1;
                job->exit_code = 128 + sig;
                job->kill_at = now_s() + o->grace_s;
                signal_workers(job, sig);
            } else if (!job->killed) {
                fprintf(stderr, "ddprun: received %s again, killing the workers\n",
                        signal_name(sig));
                job->killed = 1;
                signal_workers(job, SIGKILL);
            }
        }
    }
    /* The watcher's wake-ups carry no data: what it learnt is read with watcher_view. */
    while ((got = read(job->watch.notify_pipe[0], sigs, sizeof sigs)) > 0) {
    }
}

/* Copies what the workers wrote since the last turn. */
static void drain_output(loop_t *l)
{
    for (int i = 2; i < l->nfds; i++) {
        if (l->fds[i].revents) stream_read(l->owner[i], l->stream_of[i]);
    }
}

/* Stops the job on another node's failure or --timeout (a local failure already reaped is named
 * first), and escalates to SIGKILL once the grace period is over. */
static void enforce_stops(job_t *job, const remote_view_t *v, double now)
{
    const options_t *o = &job->opt;
    double deadline = job->deadline; /* --timeout counts from the first attempt's start */
    if (job->blame_until > 0 && (v->failure[0] || (deadline > 0 && now > deadline))) blame(job);
    if (v->failure[0] && !job->stopping) {
        fprintf(stderr, "ddprun: stopping the job: %s\n", v->failure);
        begin_stop(job, 1);
    }
    if (deadline > 0 && now > deadline && !job->stopping) {
        fprintf(stderr, "ddprun: the job ran past --timeout %g s\n", o->timeout_s);
        char text[FAILURE_TEXT_MAX];
        snprintf(text, sizeof text, "node %d ran past --timeout %g s", o->node_rank,
                 o->timeout_s);
        publish_failure(job, text);
        begin_stop(job, 1);
        job->final = 1;
    }
    if (job->stopping && !job->killed && job->running > 0 && now >= job->kill_at) {
        fprintf(stderr, "ddprun: %d worker%s still running after %g s, sending SIGKILL\n",
                job->running, job->running == 1 ? "" : "s", o->grace_s);
        job->killed = 1;
        signal_workers(job, SIGKILL);
    }
}

/* Every worker is reaped: takes what they left in the pipes (up to 2 s). 1 once done. */
static int output_drained(job_t *job, loop_t *l, double now)
{
    if (l->drain_until == 0) {
        l->drain_until = now + 2.0;
        /* Anything a worker left behind in its process group goes with it. */
        if (job->stopping) signal_workers(job, SIGKILL);
    }
    return !(streams_open(job) && now < l->drain_until);
}

/* This node's workers are done: counts the node out; node 0 keeps the store up until the other
 * nodes are done too, and after a failure only long enough for them to see job/failed and stop
 * their workers. 1 when the attempt may end. */
static int other_nodes_done(job_t *job, loop_t *l, remote_view_t *v, double now)
{
    const options_t *o = &job->opt;
    if (!job->store || !store_usable(job)) return 1;
    if (!l->sent_exited) {
        int64_t count = mark_exited(job);
        l->sent_exited = 1;
        /* The count may already include a node that failed after our workers finished. */
        fetch_failure(job);
        if (o->node_rank != 0) return 1;
        l->linger_until = job->stopping ? now + o->grace_s + 5.0 : 0;
        v->exited = watcher_count_exited(job, count);
    }
    if (v->exited >= o->nnodes) return 1;
    if (v->failure[0] && l->linger_until == 0) l->linger_until = now + o->grace_s + 5.0;
    if (l->linger_until > 0 && now > l->linger_until) return 1;
    return v->watcher_done || !job->watch.running;
}

/* Monitors one attempt until its workers are reaped, their output drained and (node 0) the
 * other nodes done. */
static void run_event_loop(job_t *job)
{
    loop_t l = {0};
    size_t slots = (size_t)job->nworkers * 2 + 2;
    l.fds = calloc(slots, sizeof *l.fds);
    l.owner = calloc(slots, sizeof *l.owner);
    l.stream_of = calloc(slots, sizeof *l.stream_of);
    if (!l.fds || !l.owner || !l.stream_of) {
        fprintf(stderr, "ddprun: out of memory\n");
        begin_stop(job, 1);
        free(l.fds);
        l.fds = NULL; /* wait_for_events then only sleeps */
    }
    for (;;) {
        wait_for_events(job, &l);
        forward_signals(job);
        drain_output(&l);
        reap(job);
        remote_view_t view;
        watcher_view(job, &view);
        double now = now_s();
        enforce_stops(job, &view, now);
        if (job->running > 0) continue;
        if (!output_drained(job, &l, now)) continue;
        if (other_nodes_done(job, &l, &view, now)) break;
    }
    free(l.fds);
    free(l.owner);
    free(l.stream_of);
}

/* ---- the job's attempts: start, and after a failure (--max-restarts) start again ---------- */

/* Starts every worker of this node; a worker that cannot start fails the attempt. */
static void start_workers(job_t *job)
{
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (start_worker(job, w) != 0) {
            char text[FAILURE_TEXT_MAX];
            snprintf(text, sizeof text, "node %d could not start rank %d", job->opt.node_rank,
                     w->rank);
            fprintf(stderr, "ddprun: %s\n", text);
            publish_failure(job, text);
            begin_stop(job, 1);
            job->final = 1; /* it would fail the same way again */
            break;
        }
        job->running++;
    }
}

/* torchrun's rule: a failed attempt is retried while restarts are left; a job the user stopped
 * (a signal to ddprun) or that ran past --timeout is not. */
static int restart_wanted(const job_t *job)
{
    return job->stopping && job->exit_code != 0 && !job->final &&
           job->attempt < job->opt.max_restarts;
}

/* Resets the job for its next attempt. Every worker of the last one is reaped and its process
 * group killed (run_event_loop's end), so none can still write a checkpoint or reach the store.
 * The store is replaced by a fresh one: the last attempt's keys (group rendezvous, sequence
 * numbers) would otherwise meet the new workers. */
static int prepare_restart(job_t *job)
{
    job->attempt++;
    fprintf(stderr, "ddprun: restarting the job (restart %d of %d)\n", job->attempt,
            job->opt.max_restarts);
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (w->out.fd >= 0) close(w->out.fd);
        if (w->err.fd >= 0) close(w->err.fd);
        w->out.fd = w->err.fd = -1;
        w->out.len = w->err.len = 0;
        w->pid = 0;
        w->running = 0;
        w->status = 0;
        w->reaped = 0;
        if (w->log_fd >= 0) {
            char line[96];
            int n = snprintf(line, sizeof line, "=== ddprun: restart %d of %d ===\n",
                             job->attempt, job->opt.max_restarts);
            write_all(w->log_fd, line, (size_t)n);
        }
    }
    job->running = 0;
    job->reaped = 0;
    job->blame_until = 0;
    job->stopping = 0;
    job->killed = 0;
    job->kill_at = 0;
    job->exit_code = 0;
    ddp_store_server_stop(job->server);
    job->server = NULL;
    if (setup_store(job) != 0) {
        job->stopping = 1;
        job->exit_code = 1;
        return -1;
    }
    return 0;
}

void run_agent(job_t *job)
{
    for (;;) {
        start_workers(job);
        run_event_loop(job);
        if (!restart_wanted(job)) break;
        if (prepare_restart(job) != 0) break;
    }
}
