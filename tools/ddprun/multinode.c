/* Multi-node: node 0 hosts the store and every node of a multi-node job joins it, agrees on the
 * job's shape and counts itself in and out; a watcher thread beats this node's heartbeat and
 * looks for job/failed, the key any node sets when its part of the job fails. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddprun.h"

/* The store is there and reachable (a lost store would make every call wait its timeout). */
int store_usable(job_t *job)
{
    if (!job->store) return 0;
    pthread_mutex_lock(&job->watch.lock);
    int lost = job->watch.done && !job->watch.stop;
    pthread_mutex_unlock(&job->watch.lock);
    return !lost;
}

void publish_failure(job_t *job, const char *text)
{
    if (!store_usable(job)) return;
    void *current = NULL;
    size_t current_len = 0;
    ddp_status_t s = ddp_store_compare_set(job->store, "job/failed", NULL, 0, text, strlen(text),
                                           &current, &current_len);
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: could not tell the other nodes (job/failed): %s\n",
                ddp_last_error());
    }
    ddp_free(current);
}

static void set_remote_failure(job_t *job, const char *text);

/* Reads job/failed into job->watch.remote_failure when some node has set it. */
ddp_status_t fetch_failure(job_t *job)
{
    const char *failed_key = "job/failed";
    int exists = 0;
    ddp_status_t s = ddp_store_check(job->store, &failed_key, 1, &exists);
    if (s != DDP_OK || !exists) return s;
    void *v = NULL;
    size_t len = 0;
    s = ddp_store_get(job->store, failed_key, &v, &len);
    if (s == DDP_OK) set_remote_failure(job, (const char *)v);
    ddp_free(v);
    return s;
}

/* Counts this node out (job/exited) so node 0 stops waiting for it; returns the new count. */
int64_t mark_exited(job_t *job)
{
    char key[64];
    int64_t count = 0;
    snprintf(key, sizeof key, "job/exited/%d", job->opt.node_rank);
    if (ddp_store_set(job->store, key, "1", 1) == DDP_OK) {
        ddp_store_add(job->store, "job/exited", 1, &count);
    }
    return count;
}

static void notify_main(job_t *job)
{
    unsigned char b = 1;
    ssize_t ignored = write(job->watch.notify_pipe[1], &b, 1);
    (void)ignored;
}

static int watcher_should_stop(job_t *job)
{
    pthread_mutex_lock(&job->watch.lock);
    int stop = job->watch.stop;
    pthread_mutex_unlock(&job->watch.lock);
    return stop;
}

static void set_remote_failure(job_t *job, const char *text)
{
    pthread_mutex_lock(&job->watch.lock);
    if (!job->watch.remote_failure[0])
        snprintf(job->watch.remote_failure, sizeof job->watch.remote_failure, "%s", text);
    pthread_mutex_unlock(&job->watch.lock);
    notify_main(job);
}

/* Every WATCH_INTERVAL_MS: look for job/failed, beat this node's heartbeat, count the nodes that
 * have finished, and (node 0) notice another node's ddprun that went silent or never came. */
static void *watcher_main(void *arg)
{
    job_t *job = arg;
    const options_t *o = &job->opt;
    int nnodes = o->nnodes;
    int64_t *last_beat = calloc((size_t)nnodes, sizeof *last_beat);
    double *last_change = calloc((size_t)nnodes, sizeof *last_change);
    char *dead = calloc((size_t)nnodes, 1);
    if (!last_beat || !last_change || !dead) {
        set_remote_failure(job, "ddprun watcher: out of memory");
        free(last_beat);
        free(last_change);
        free(dead);
        return NULL;
    }
    double started = now_s();
    double join_limit = ddp_default_timeout_ms() / 1000.0;
    for (int k = 0; k < nnodes; k++) last_change[k] = started;
    char key[64], text[FAILURE_TEXT_MAX];
    snprintf(key, sizeof key, "job/heartbeat/%d", o->node_rank);
    while (!watcher_should_stop(job)) {
        /* Count finished nodes before looking for job/failed: a node sets job/failed before it
         * counts itself out, so a count that includes a failed node comes with its failure. */
        int64_t value = 0;
        ddp_status_t s = ddp_store_add(job->store, key, 1, &value);
        if (s == DDP_OK) s = ddp_store_add(job->store, "job/exited", 0, &value);
        if (s == DDP_OK) s = fetch_failure(job);
        if (s == DDP_OK) {
            pthread_mutex_lock(&job->watch.lock);
            job->watch.nodes_exited = value;
            pthread_mutex_unlock(&job->watch.lock);
            notify_main(job);
        }
        if (s != DDP_OK) {
            if (watcher_should_stop(job)) break;
            snprintf(text, sizeof text, "lost the store at %s:%d (node 0 gone?): %s",
                     job->master_addr, job->master_port, ddp_last_error());
            set_remote_failure(job, text);
            break;
        }
        if (o->node_rank == 0) {
            double now = now_s();
            for (int k = 1; k < nnodes; k++) {
                if (dead[k]) continue;
                char other[64];
                int done = 0;
                snprintf(other, sizeof other, "job/exited/%d", k);
                const char *done_key = other;
                if (ddp_store_check(job->store, &done_key, 1, &done) != DDP_OK || done) continue;
                snprintf(other, sizeof other, "job/heartbeat/%d", k);
                int64_t beat = 0;
                if (ddp_store_add(job->store, other, 0, &beat) != DDP_OK) continue;
                if (beat != last_beat[k]) {
                    last_beat[k] = beat;
                    last_change[k] = now;
                    continue;
                } else if (beat == 0 && now - started > join_limit) {
                    snprintf(text, sizeof text,
                             "node %d did not join within %g s (DDP_TIMEOUT)", k, join_limit);
                } else if (beat > 0 && now - last_change[k] > o->heartbeat_timeout_s) {
                    snprintf(text, sizeof text,
                             "node %d's ddprun has been silent for %g s (--heartbeat-timeout)",
                             k, o->heartbeat_timeout_s);
                } else {
                    continue;
                }
                /* Written here, seen by every node (this one included) on the next check. */
                publish_failure(job, text);
                dead[k] = 1;
                pthread_mutex_lock(&job->watch.lock);
                job->watch.nodes_dead++;
                pthread_mutex_unlock(&job->watch.lock);
            }
        }
        sleep_ms(WATCH_INTERVAL_MS);
    }
    free(last_beat);
    free(last_change);
    free(dead);
    pthread_mutex_lock(&job->watch.lock);
    job->watch.done = 1;
    pthread_mutex_unlock(&job->watch.lock);
    notify_main(job);
    return NULL;
}

/* A port nothing listens on at addr now, for torch's own store (MASTER_PORT): bind port 0, read
 * what the kernel gave, close. torchrun does the same; the port may be taken again before torch
 * binds it, a small race both accept. 0 when none could be found. */
static int free_port(const char *addr)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(addr, "0", &hints, &res) != 0) return 0;
    int port = 0;
    for (struct addrinfo *ai = res; ai && !port; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        struct sockaddr_storage bound;
        socklen_t len = sizeof bound;
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
            getsockname(fd, (struct sockaddr *)&bound, &len) == 0)
            port = ntohs(bound.ss_family == AF_INET6
                             ? ((struct sockaddr_in6 *)&bound)->sin6_port
                             : ((struct sockaddr_in *)&bound)->sin_port);
        close(fd);
    }
    freeaddrinfo(res);
    return port;
}

/* Node 0 hosts the store (multi-node: every node also connects to it as a client). */
int setup_store(job_t *job)
{
    const options_t *o = &job->opt;
    job->master_addr = o->master_addr ? o->master_addr : "127.0.0.1";
    job->master_port = o->master_port;
    if (o->token) snprintf(job->token, sizeof job->token, "%s", o->token);
    else make_token(job->token, sizeof job->token);

    if (o->node_rank == 0) {
        sigset_t old;
        block_forwarded_signals(1, &old);
        ddp_status_t s =
            ddp_store_server_start(job->master_addr, o->master_port, job->token, &job->server);
        block_forwarded_signals(0, &old);
        if (s != DDP_OK) {
            fprintf(stderr, "ddprun: cannot host the store on %s:%d: %s\n", job->master_addr,
                    o->master_port, ddp_last_error());
            return -1;
        }
        job->master_port = ddp_store_server_port(job->server);
        job->torch_port = free_port(job->master_addr);
        if (job->torch_port == 0) {
            fprintf(stderr, "ddprun: no free port on %s for MASTER_PORT\n", job->master_addr);
            return -1;
        }
    }
    if (o->nnodes == 1) return 0;

    int timeout_ms = ddp_default_timeout_ms();
    if (o->timeout_s > 0 && o->timeout_s * 1000 < timeout_ms) timeout_ms = (int)(o->timeout_s * 1000);
    if (timeout_ms < 1) timeout_ms = 1;
    /* The client starts no thread; leaving signals open here lets Ctrl-C end a long wait for
     * node 0 at once (on_signal exits while no worker exists). */
    ddp_status_t s = ddp_store_tcp_connect(job->master_addr, job->master_port, job->token,
                                           timeout_ms, &job->store);
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: node %d cannot reach the store at %s:%d: %s\n", o->node_rank,
                job->master_addr, job->master_port, ddp_last_error());
        return -1;
    }
    ddp_store_set_timeout(job->store, timeout_ms);

    /* Every node must agree on the shape of the job, and each node rank be taken once. */
    char config[128], key[64];
    snprintf(config, sizeof config, "nnodes=%d nproc=%d", o->nnodes, o->nproc);
    if (o->node_rank == 0) {
        s = ddp_store_set(job->store, "ddprun/config", config, strlen(config));
    } else {
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(job->store, "ddprun/config", &v, &len);
        if (s == DDP_OK && (len != strlen(config) || memcmp(v, config, len) != 0)) {
            /* The ranks could never meet: stop the nodes that did start. */
            char text[FAILURE_TEXT_MAX];
            snprintf(text, sizeof text, "node %d was started with %s but node 0 with %.*s",
                     o->node_rank, config, (int)len, (const char *)v);
            fprintf(stderr, "ddprun: %s\n", text);
            ddp_store_set_timeout(job->store, STORE_CALL_TIMEOUT_MS);
            publish_failure(job, text);
            mark_exited(job);
            ddp_free(v);
            return -1;
        }
        ddp_free(v);
    }
    if (s == DDP_OK) {
        char mine[128], host[64] = "?";
        gethostname(host, sizeof host);
        host[sizeof host - 1] = '\0';
        snprintf(mine, sizeof mine, "pid %d on %s", (int)getpid(), host);
        snprintf(key, sizeof key, "ddprun/node/%d", o->node_rank);
        void *current = NULL;
        size_t len = 0;
        s = ddp_store_compare_set(job->store, key, NULL, 0, mine, strlen(mine), &current, &len);
        if (s == DDP_OK && (len != strlen(mine) || memcmp(current, mine, len) != 0)) {
            fprintf(stderr, "ddprun: --node-rank %d is already taken by ddprun %.*s\n",
                    o->node_rank, (int)len, (const char *)current);
            ddp_free(current);
            return -1;
        }
        ddp_free(current);
    }
    if (s == DDP_OK) {
        /* Every node's workers get node 0's choice of MASTER_PORT. */
        char text[16];
        if (o->node_rank == 0) {
            snprintf(text, sizeof text, "%d", job->torch_port);
            s = ddp_store_set(job->store, "ddprun/torch_port", text, strlen(text));
        } else {
            void *v = NULL;
            size_t len = 0;
            s = ddp_store_get(job->store, "ddprun/torch_port", &v, &len);
            if (s == DDP_OK) job->torch_port = atoi((const char *)v);
            ddp_free(v);
        }
    }
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: node %d: rendezvous through the store failed: %s\n",
                o->node_rank, ddp_last_error());
        return -1;
    }
    ddp_store_set_timeout(job->store, STORE_CALL_TIMEOUT_MS);
    return 0;
}

int start_watcher(job_t *job)
{
    if (pipe2(job->watch.notify_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        perror("ddprun: pipe");
        return -1;
    }
    if (!job->store) return 0;
    sigset_t old;
    block_forwarded_signals(1, &old);
    int rc = pthread_create(&job->watch.thread, NULL, watcher_main, job);
    block_forwarded_signals(0, &old);
    if (rc != 0) {
        fprintf(stderr, "ddprun: cannot start the store watcher: %s\n", strerror(rc));
        return -1;
    }
    job->watch.running = 1;
    return 0;
}

void stop_watcher(job_t *job)
{
    if (!job->watch.running) return;
    pthread_mutex_lock(&job->watch.lock);
    job->watch.stop = 1;
    pthread_mutex_unlock(&job->watch.lock);
    pthread_join(job->watch.thread, NULL);
    job->watch.running = 0;
}

void watcher_view(job_t *job, remote_view_t *v)
{
    pthread_mutex_lock(&job->watch.lock);
    snprintf(v->failure, sizeof v->failure, "%s", job->watch.remote_failure);
    v->exited = job->watch.nodes_exited + job->watch.nodes_dead;
    v->watcher_done = job->watch.done;
    pthread_mutex_unlock(&job->watch.lock);
}

int64_t watcher_count_exited(job_t *job, int64_t count)
{
    pthread_mutex_lock(&job->watch.lock);
    if (count > job->watch.nodes_exited) job->watch.nodes_exited = count;
    int64_t exited = job->watch.nodes_exited + job->watch.nodes_dead;
    pthread_mutex_unlock(&job->watch.lock);
    return exited;
}
