/* The TCP transport: collectives over one authenticated socket per pair of ranks, driven by the
 * group's progress thread with non-blocking sockets and poll().
 *
 * Every collective starts with a fingerprint ddp__tcp_exchange (a dissemination allgather of each rank's
 * (seq, kind, dtype, op, count, root), ceil(log2 n) rounds), which doubles as the barrier: every
 * rank learns every fingerprint and reaches the same verdict, so a disagreement is
 * DDP_ERR_MISMATCH on every rank with both sides in the text, and no data moves.
 *
 * Data then moves in frames (a 24-byte header, then the payload received straight into its
 * destination). Large allreduces use the ring: a reduce-scatter (each segment is reduced once,
 * in ring order, by the rank that receives it) then an allgather (the owner's bytes are copied
 * around), pipelined in chunks so that the send of a chunk at step s+1 starts as soon as that
 * chunk arrived and was reduced at step s. Every rank therefore holds bytes computed once by
 * one rank: bitwise identical. Small allreduces use recursive doubling, where partners always
 * combine as (lower rank's data) op (higher rank's data), so both hold the same bits; ranks
 * beyond the largest power of two fold into a partner first and get the result back. f16 and
 * bf16 are widened to f32, reduced in f32 and rounded once. Broadcast is a pipelined chain from
 * the root; allgather and reduce_scatter are the ring's halves.
 *
 * Failures: a deadline names the peer we were waiting for; a closed connection names the rank;
 * after any failure the transport sends an abort frame with the reason where a frame boundary
 * allows it, closes every socket (so that peers fail fast too, in a cascade) and is broken.
 *
 * This file holds the state's life (create, run, abort, destroy) and the ops table; the engine
 * is tcp_engine.c and the algorithms tcp_ring.c (tcp_private.h). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/reduce.h"
#include "transport/tcp/tcp_private.h"

static _Atomic size_t small_threshold = 64 * 1024;

void ddp__tcp_set_small_threshold(size_t bytes) { small_threshold = bytes; }


/* ---- the ops table ------------------------------------------------------------------------- */
static ddp_status_t tcp_create(ddp_store_t *store, const char *group_name, int rank, int world,
                               int timeout_ms, void **state)
{
    if (!store) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: store is NULL");
    if (!group_name || !*group_name || strlen(group_name) > DDP_TCP_MAX_GROUP)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: group_name is NULL, empty "
                          "or longer than %u bytes", DDP_TCP_MAX_GROUP);
    if (world < 1) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: world %d < 1", world);
    if (rank < 0 || rank >= world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: rank %d outside [0, %d)",
                          rank, world);
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: state is NULL");
    /* The group resolves its timeout (its options, else DDP_TIMEOUT) and hands it down: a
     * transport reads no configuration of its own. */
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: timeout_ms %d is negative",
                          timeout_ms);

    tcp_state_t *t = calloc(1, sizeof *t);
    if (!t) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: state");
    t->rank = rank;
    t->world = world;
    t->timeout_ms = timeout_ms;
    snprintf(t->group, sizeof t->group, "%s", group_name);
    pthread_mutex_init(&t->lock, NULL);
    t->conns = calloc((size_t)world, sizeof *t->conns);
    ddp_status_t s;
    if (!t->conns) {
        s = ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: connections");
        goto free_state;
    }
    for (int p = 0; p < world; p++) t->conns[p].fd = -1;
    if (world > 1) {
        int listen_fd = -1;
        char published[128];
        s = ddp__tcp_listen(&listen_fd, published, sizeof published);
        if (s != DDP_OK) goto free_state;
        char key[DDP_STORE_MAX_KEY];
        snprintf(key, sizeof key, "%s/tcp/addr/%d", group_name, rank);
        s = ddp_store_set(store, key, published, strlen(published) + 1);
        if (s == DDP_OK)
            s = ddp__tcp_connect_all(store, group_name, rank, world, listen_fd, timeout_ms,
                                     t->conns);
        close(listen_fd);
        if (s != DDP_OK) goto free_state;
        DDP_LOG(DDP_LOG_INFO, "tcp transport: group '%s' rank %d of %d listening on %s, "
                "connected", group_name, rank, world, published);
    }
    *state = t;
    return DDP_OK;

free_state:
    pthread_mutex_destroy(&t->lock);
    free(t->conns);
    free(t);
    return s;
}

static ddp_status_t validate(const tcp_state_t *t, const ddp__collective_t *c)
{
    if (!c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: collective is NULL");
    if ((unsigned)c->kind > DDP__BARRIER)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: kind %d", (int)c->kind);
    if (c->kind == DDP__BARRIER) return DDP_OK;
    if (ddp_dtype_size(c->dtype) == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: dtype %d", (int)c->dtype);
    if ((c->kind == DDP__ALLREDUCE || c->kind == DDP__REDUCE_SCATTER) &&
        (unsigned)c->op >= DDP_OP_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: op %d", (int)c->op);
    if (c->kind == DDP__BROADCAST && (c->root < 0 || c->root >= t->world))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: root %d outside [0, %d)",
                          c->root, t->world);
    if (c->count && !c->recv)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: recv is NULL");
    if (c->count && !c->send && c->kind != DDP__BROADCAST)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: send is NULL");
    return DDP_OK;
}

static ddp_status_t run_single(const ddp__collective_t *c)
{
    size_t es = ddp_dtype_size(c->dtype);
    if (c->count == 0 || c->kind == DDP__BARRIER) return DDP_OK;
    if (c->kind == DDP__BROADCAST) {
        if (c->send && c->send != c->recv) memmove(c->recv, c->send, c->count * es);
        return DDP_OK;
    }
    /* One rank: the reduction of one value is that value (avg divides by 1). */
    if (c->send != c->recv) memmove(c->recv, c->send, c->count * es);
    return DDP_OK;
}

/* ---- agreement: a late rank does not succeed where a peer gave up ----------------------------
 * A rank that gives up on a collective (timeout, dead peer) sends an abort frame for its
 * sequence number on every connection. A rank that arrives later can still find every frame it
 * needs already in its sockets (the barrier is only the fingerprint ddp__tcp_exchange; in a ring, the
 * last frames may have been sent before the sender gave up) and would finish the collective the
 * others failed. So, before reporting success, a rank looks at what is queued after the
 * collective's frames on every connection: an abort frame for this collective fails it too,
 * naming the rank that gave up. Without a shared atomic word (the shm transport has one) a give-up
 * and a last message that cross on the wire within one network latency of the deadline cannot
 * be ordered; everything later is (docs/tcp-transport.md, "Agreement"). One poll() with a zero
 * timeout costs ~1 us against the tens of microseconds of a TCP collective. */
static ddp_status_t confirm(tcp_state_t *t, const ddp__collective_t *c)
{
    struct pollfd pfds[64];
    int peer_of[64];
    for (int base = 0; base < t->world; base += 64) {
        int npfd = 0;
        for (int p = base; p < t->world && p < base + 64; p++) {
            if (p == t->rank || t->conns[p].fd < 0 || t->conns[p].recv_partial) continue;
            pfds[npfd].fd = t->conns[p].fd;
            pfds[npfd].events = POLLIN;
            pfds[npfd].revents = 0;
            peer_of[npfd++] = p;
        }
        if (npfd == 0 || poll(pfds, (nfds_t)npfd, 0) <= 0) continue;
        for (int i = 0; i < npfd; i++) {
            if (!(pfds[i].revents & POLLIN)) continue;
            ddp__tcp_frame_t h;
            ssize_t k = recv(pfds[i].fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
            /* A peer that finished and closed (k == 0), or whose next frame belongs to a later
             * collective, completed this one. */
            if (k != (ssize_t)sizeof h || h.magic != DDP_TCP_FRAME_MAGIC ||
                h.type != DDP_TCP_FRAME_ABORT || h.seq != c->seq)
                continue;
            char reason[512];
            int peer = peer_of[i];
            if (!ddp__tcp_pending_abort_reason(t, peer, reason, sizeof reason))
                snprintf(reason, sizeof reason, "(no reason given)");
            char d[400];
            ddp__tcp_describe_c(t, c, d, sizeof d);
            return ddp__error(DDP_ERR_REMOTE, "%s: rank %d gave up on it before this rank "
                              "finished: %s", d, peer, reason);
        }
    }
    return DDP_OK;
}

static ddp_status_t run_algorithm(tcp_state_t *t, const ddp__collective_t *c)
{
    ddp_status_t s = ddp__tcp_check_fingerprints(t, c, 0);
    if (s != DDP_OK || c->kind == DDP__BARRIER || c->count == 0) return s;
    switch (c->kind) {
    case DDP__ALLREDUCE:
        if (c->count * ddp_dtype_size(c->dtype) <= small_threshold)
            return ddp__tcp_allreduce_doubling(t, c);
        return ddp__tcp_allreduce_ring(t, c);
    case DDP__BROADCAST: return ddp__tcp_broadcast_chain(t, c);
    case DDP__REDUCE_SCATTER: return ddp__tcp_reduce_scatter_ring(t, c);
    case DDP__ALLGATHER: return ddp__tcp_allgather_ring(t, c);
    default: return DDP_OK;
    }
}

/* In a ring or recursive doubling a rank's last frames need not come from every rank: ranks can
 * finish while another still waits for a stopped rank, and that one's give-up came too late for
 * them. A collective that moved data therefore ends with a commit round, one more all-to-all of
 * small frames (the fingerprint ddp__tcp_exchange's code, the frames marked as commits): a rank reports
 * success only when every rank has finished its part, and a rank that gave up instead sends its
 * abort frame where the others wait for its commit. The barrier is itself one all-to-all and
 * needs none. Costs one network latency per collective (docs/tcp-transport.md, "Agreement"). */
static ddp_status_t commit_everywhere(tcp_state_t *t, const ddp__collective_t *c)
{
    if (c->kind == DDP__BARRIER || c->count == 0) return DDP_OK;
    ddp_status_t s = ddp__tcp_check_fingerprints(t, c, 1);
    if (s != DDP_OK)
        ddp__error_context(s, "tcp transport: the commit round of seq %llu (every rank's part "
                           "done?)", (unsigned long long)c->seq);
    return s;
}

static ddp_status_t dispatch(tcp_state_t *t, const ddp__collective_t *c)
{
    if (t->world == 1) return run_single(c);
    ddp_status_t s = run_algorithm(t, c);
    if (s == DDP_OK) s = commit_everywhere(t, c);
    return s == DDP_OK ? confirm(t, c) : s;
}

static ddp_status_t tcp_run(void *state, const ddp__collective_t *c)
{
    tcp_state_t *t = state;
    if (!t) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "tcp transport: state is NULL");
    ddp_status_t s = validate(t, c);
    if (s != DDP_OK) return s;
    pthread_mutex_lock(&t->lock);
    if (t->broken || atomic_load(&t->aborted)) {
        pthread_mutex_unlock(&t->lock);
        return ddp__error(DDP_ERR_ABORTED, "tcp transport, group '%s', rank %d: broken by an "
                          "earlier failure (%s); seq %llu not run", t->group, t->rank,
                          t->broken ? t->broken_text : t->abort_reason,
                          (unsigned long long)c->seq);
    }
    t->running = 1;
    pthread_mutex_unlock(&t->lock);

    s = dispatch(t, c);

    pthread_mutex_lock(&t->lock);
    t->running = 0;
    if (s != DDP_OK) {
        t->broken = 1;
        snprintf(t->broken_text, sizeof t->broken_text, "%s", ddp_last_error());
        if (t->world > 1) {
            char reason[600];
            if (atomic_load(&t->aborted))
                snprintf(reason, sizeof reason, "rank %d aborted: %s", t->rank, t->abort_reason);
            else
                snprintf(reason, sizeof reason, "rank %d: %s", t->rank, ddp_last_error());
            ddp__tcp_send_abort_frames(t, c->seq, reason);
            ddp__tcp_shut_all(t);
        }
    } else if (atomic_load(&t->aborted)) {
        char reason[400];
        snprintf(reason, sizeof reason, "rank %d aborted: %s", t->rank, t->abort_reason);
        ddp__tcp_send_abort_frames(t, c->seq, reason);
        ddp__tcp_shut_all(t);
    }
    pthread_mutex_unlock(&t->lock);
    return s;
}

static void tcp_abort(void *state, const char *reason)
{
    tcp_state_t *t = state;
    if (!t) return;
    pthread_mutex_lock(&t->lock);
    if (!atomic_load(&t->aborted)) {
        snprintf(t->abort_reason, sizeof t->abort_reason, "%s", reason ? reason : "aborted");
        atomic_store(&t->aborted, 1);
        if (!t->running) {
            if (!t->broken) {
                char text[400];
                snprintf(text, sizeof text, "rank %d aborted: %s", t->rank, t->abort_reason);
                ddp__tcp_send_abort_frames(t, 0, text);
            }
            ddp__tcp_shut_all(t);
        } else {
            /* A collective is running on the progress thread: shutting the read side (not
             * closing: the thread polls these descriptors) wakes it; it sees the flag, fails
             * with DDP_ERR_ABORTED, and itself tells the peers (it knows where its frames
             * stand) before shutting everything. Writers notice within the 1 s poll cap. */
            for (int p = 0; p < t->world; p++)
                if (t->conns[p].fd >= 0) shutdown(t->conns[p].fd, SHUT_RD);
        }
    }
    pthread_mutex_unlock(&t->lock);
}

static void tcp_destroy(void *state)
{
    tcp_state_t *t = state;
    if (!t) return;
    for (int p = 0; p < t->world; p++)
        if (t->conns[p].fd >= 0) close(t->conns[p].fd);
    free(t->conns);
    free(t->work);
    free(t->tmp);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

const ddp__transport_ops_t ddp__transport_tcp = {
    .name = "tcp",
    .create = tcp_create,
    .run = tcp_run,
    .alloc_buffer = NULL,
    .free_buffer = NULL,
    .abort = tcp_abort,
    .destroy = tcp_destroy,
    .multi_host = 1,
};
