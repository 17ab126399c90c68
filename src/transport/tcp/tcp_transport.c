/* The TCP transport: collectives over one authenticated socket per pair of ranks, driven by the
 * group's progress thread with non-blocking sockets and poll().
 *
 * Every collective starts with a fingerprint exchange (a dissemination allgather of each rank's
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
 * allows it, closes every socket (so that peers fail fast too, in a cascade) and is broken. */
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
#include "transport/tcp/tcp.h"

static _Atomic size_t small_threshold = 64 * 1024;
static _Atomic size_t chunk_bytes = 512 * 1024;

void ddp__tcp_set_small_threshold(size_t bytes) { small_threshold = bytes; }
void ddp__tcp_set_chunk_bytes(size_t bytes) { chunk_bytes = bytes < 64 ? 64 : bytes; }

typedef struct tcp_state {
    int rank, world;
    int timeout_ms; /* the group's timeout: sets the grace of blame_grace_ns */
    char group[DDP_TCP_MAX_GROUP + 1];
    ddp__tcp_conn_t *conns;
    char *work; /* accumulation workspace, grown on demand */
    size_t work_bytes;
    char *tmp; /* one incoming chunk */
    size_t tmp_bytes;
    pthread_mutex_t lock;
    int running;
    atomic_int aborted;
    char abort_reason[256];
    int broken;
    char broken_text[DDP_ERROR_TEXT_MAX];
} tcp_state_t;

/* ---- fingerprints ----------------------------------------------------------------------- */
/* The shared fingerprint and a flag: the frame every rank sends first. */
typedef struct fp_wire {
    ddp__fingerprint_t f;
    int32_t valid, pad;
} fp_wire_t;

static void describe_fp(const fp_wire_t *w, char *buf, size_t size)
{
    ddp__fingerprint_text(&w->f, buf, size);
}

static fp_wire_t fp_of(const ddp__collective_t *c)
{
    fp_wire_t w;
    memset(&w, 0, sizeof w);
    w.f = ddp__fingerprint_of(c);
    w.valid = 1;
    return w;
}

/* ---- the progress engine ------------------------------------------------------------------
 * One exchange drives at most one outgoing and one incoming stream of frames (enough for the
 * ring, the chain and each round of the logarithmic algorithms). An outgoing piece may wait for
 * an incoming piece (its `after` index) to have arrived and been processed by `on_recv`. */
typedef struct piece {
    char *buf;
    size_t bytes;
    long after; /* send only: index of the incoming piece that must be done first, or -1 */
} piece_t;

typedef struct flow {
    int peer;
    uint32_t type;
    piece_t *pieces;
    size_t n;
    size_t cur;  /* pieces before this one are complete */
    size_t done; /* bytes of the current frame (header + payload) transferred */
    ddp__tcp_frame_t hdr;
} flow_t;

typedef void (*on_recv_fn)(void *ctx, size_t index);

static void describe_c(const tcp_state_t *t, const ddp__collective_t *c, char *buf, size_t size)
{
    fp_wire_t f = fp_of(c);
    char d[200];
    describe_fp(&f, d, sizeof d);
    snprintf(buf, size, "tcp transport, group '%s', rank %d, %s", t->group, t->rank, d);
}

/* Reads the reason of an abort frame (best effort, short wait) and reports it. */
static ddp_status_t remote_abort(tcp_state_t *t, const ddp__collective_t *c, int peer,
                                 uint64_t bytes)
{
    char reason[512] = "";
    size_t want = bytes < sizeof reason - 1 ? (size_t)bytes : sizeof reason - 1;
    size_t have = 0;
    int64_t until = ddp__now_ns() + 200000000LL;
    int fd = t->conns[peer].fd;
    while (have < want && ddp__now_ns() < until) {
        ssize_t n = recv(fd, reason + have, want - have, 0);
        if (n > 0) have += (size_t)n;
        else if (n == 0) break;
        else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            struct pollfd p = {fd, POLLIN, 0};
            poll(&p, 1, 20);
        } else break;
    }
    reason[have] = '\0';
    char d[400];
    describe_c(t, c, d, sizeof d);
    return ddp__error(DDP_ERR_REMOTE, "%s: rank %d failed: %s", d, peer,
                      have ? reason : "(no reason given)");
}

/* A peer that failed usually sent an abort frame with its reason before closing; when this
 * rank was not reading from that peer (the ring reads only from its left neighbour) the frame is
 * still waiting in the socket. Returns 1 and fills `reason` if one is there. */
static int pending_abort_reason(tcp_state_t *t, int peer, char *reason, size_t size)
{
    ddp__tcp_conn_t *conn = &t->conns[peer];
    if (conn->fd < 0 || conn->recv_partial) return 0;
    ddp__tcp_frame_t h;
    ssize_t k = recv(conn->fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (k != (ssize_t)sizeof h || h.magic != DDP_TCP_FRAME_MAGIC || h.type != DDP_TCP_FRAME_ABORT)
        return 0;
    if (recv(conn->fd, &h, sizeof h, MSG_DONTWAIT) != (ssize_t)sizeof h) return 0;
    size_t want = h.bytes < size - 1 ? (size_t)h.bytes : size - 1, have = 0;
    int64_t until = ddp__now_ns() + 200000000LL;
    while (have < want && ddp__now_ns() < until) {
        ssize_t n = recv(conn->fd, reason + have, want - have, MSG_DONTWAIT);
        if (n > 0) have += (size_t)n;
        else if (n == 0) break;
        else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            struct pollfd p = {conn->fd, POLLIN, 0};
            poll(&p, 1, 20);
        } else break;
    }
    reason[have] = '\0';
    return have > 0;
}

static ddp_status_t closed_error(tcp_state_t *t, const ddp__collective_t *c, int peer, int err)
{
    char d[400];
    describe_c(t, c, d, sizeof d);
    if (atomic_load(&t->aborted))
        return ddp__error(DDP_ERR_ABORTED, "%s: aborted locally: %s", d, t->abort_reason);
    char reason[512];
    if (pending_abort_reason(t, peer, reason, sizeof reason))
        return ddp__error(DDP_ERR_REMOTE, "%s: rank %d failed: %s", d, peer, reason);
    if (err)
        return ddp__error(DDP_ERR_REMOTE, "%s: connection to rank %d failed (%s): rank %d died "
                          "or aborted", d, peer, strerror(err), peer);
    return ddp__error(DDP_ERR_REMOTE, "%s: rank %d closed the connection (it died or aborted)",
                      d, peer);
}

/* Writes what the socket accepts now. Returns 1 if progress was made, 0 if blocked, <0 error. */
static int pump_send(tcp_state_t *t, const ddp__collective_t *c, flow_t *f, const flow_t *in,
                     ddp_status_t *status)
{
    int progressed = 0;
    ddp__tcp_conn_t *conn = &t->conns[f->peer];
    while (f->cur < f->n) {
        piece_t *p = &f->pieces[f->cur];
        if (p->after >= 0 && (!in || in->cur <= (size_t)p->after)) break;
        if (f->done == 0) {
            f->hdr.magic = DDP_TCP_FRAME_MAGIC;
            f->hdr.type = f->type;
            f->hdr.seq = c->seq;
            f->hdr.bytes = p->bytes;
        }
        struct iovec iov[2];
        int niov = 0;
        size_t hsz = sizeof f->hdr;
        if (f->done < hsz) {
            iov[niov].iov_base = (char *)&f->hdr + f->done;
            iov[niov].iov_len = hsz - f->done;
            niov++;
            if (p->bytes) {
                iov[niov].iov_base = p->buf;
                iov[niov].iov_len = p->bytes;
                niov++;
            }
        } else {
            iov[niov].iov_base = p->buf + (f->done - hsz);
            iov[niov].iov_len = p->bytes - (f->done - hsz);
            niov++;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)niov;
        ssize_t n = sendmsg(conn->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            *status = closed_error(t, c, f->peer, errno);
            return -1;
        }
        progressed = 1;
        f->done += (size_t)n;
        conn->send_partial = 1;
        if (f->done == hsz + p->bytes) {
            conn->send_partial = 0;
            f->cur++;
            f->done = 0;
        }
    }
    return progressed;
}

static int pump_recv(tcp_state_t *t, const ddp__collective_t *c, flow_t *f, on_recv_fn fn,
                     void *ctx, ddp_status_t *status)
{
    int progressed = 0;
    int fd = t->conns[f->peer].fd;
    size_t hsz = sizeof f->hdr;
    while (f->cur < f->n) {
        piece_t *p = &f->pieces[f->cur];
        struct iovec iov[2];
        int niov = 0;
        if (f->done < hsz) {
            iov[niov].iov_base = (char *)&f->hdr + f->done;
            iov[niov].iov_len = hsz - f->done;
            niov++;
        } else {
            iov[niov].iov_base = p->buf + (f->done - hsz);
            iov[niov].iov_len = p->bytes - (f->done - hsz);
            niov++;
        }
        ssize_t n = readv(fd, iov, niov);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            *status = closed_error(t, c, f->peer, errno);
            return -1;
        }
        if (n == 0) {
            *status = closed_error(t, c, f->peer, 0);
            return -1;
        }
        progressed = 1;
        f->done += (size_t)n;
        t->conns[f->peer].recv_partial = 1;
        if (f->done == hsz) {
            char d[400];
            if (f->hdr.magic == DDP_TCP_FRAME_MAGIC) t->conns[f->peer].last_seq = f->hdr.seq;
            if (f->hdr.magic != DDP_TCP_FRAME_MAGIC) {
                describe_c(t, c, d, sizeof d);
                *status = ddp__error(DDP_ERR_PROTOCOL, "%s: rank %d sent a malformed frame", d,
                                     f->peer);
                return -1;
            }
            if (f->hdr.type == DDP_TCP_FRAME_ABORT) {
                *status = remote_abort(t, c, f->peer, f->hdr.bytes);
                return -1;
            }
            if (f->hdr.type != f->type || f->hdr.bytes != p->bytes ||
                (f->type == DDP_TCP_FRAME_DATA && f->hdr.seq != c->seq)) {
                describe_c(t, c, d, sizeof d);
                *status = ddp__error(DDP_ERR_PROTOCOL, "%s: rank %d sent an unexpected frame "
                                     "(type %u, seq %llu, %llu bytes; expected type %u, %zu "
                                     "bytes)", d, f->peer, f->hdr.type,
                                     (unsigned long long)f->hdr.seq,
                                     (unsigned long long)f->hdr.bytes, f->type, p->bytes);
                return -1;
            }
        }
        if (f->done == hsz + p->bytes) {
            t->conns[f->peer].recv_partial = 0;
            if (fn) fn(ctx, f->cur);
            f->cur++;
            f->done = 0;
        }
    }
    return progressed;
}

/* ---- waking less -------------------------------------------------------------------------
 * A receiver asleep in poll() is woken by every segment burst that arrives (64 KiB or less on a
 * GRO'd link), and on a virtual machine each sleep and wake-up costs more than copying the data
 * it brings: measured on the 2-core development VM (1 Gbit/s shaped link), most of the transport's
 * CPU time went to scheduling and interrupt re-enabling, not to copies or reductions. So while a
 * data frame's payload is expected, the socket's low-water mark (SO_RCVLOWAT, which poll()
 * honours) asks for up to RCVLOWAT_MAX bytes before waking, never more than the rest of the
 * current frame: the bytes asked for are certain to come (or the peer closes or fails, which
 * wakes poll() regardless), so no wait depends on bytes that will not be sent. Headers are waited
 * for with the default mark, so a short or foreign frame is still read and judged at once.
 * The mark never exceeds a quarter of the receive buffer: Linux would otherwise grow the buffer
 * and clamp the TCP window to the mark. Every exchange leaves the mark at 1 (the default) for the
 * fingerprint exchange and the abort paths, which wait for small frames. */
#define RCVLOWAT_MAX (512 * 1024)

static void set_rcvlowat(ddp__tcp_conn_t *conn, size_t want)
{
    if (conn->fd < 0) return;
    int have = conn->rcvlowat > 1 ? conn->rcvlowat : 1;
    if (want > 1) {
        int rcvbuf = 0;
        socklen_t len = sizeof rcvbuf;
        if (getsockopt(conn->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) != 0 || rcvbuf < 4)
            rcvbuf = 4;
        if (want > (size_t)rcvbuf / 4) want = (size_t)rcvbuf / 4;
        if (want > RCVLOWAT_MAX) want = RCVLOWAT_MAX;
    }
    int v = want > 1 ? (int)want : 1;
    if (v == have) return;
    /* Best effort: if the kernel refuses, poll() simply wakes more often. */
    if (setsockopt(conn->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) conn->rcvlowat = v;
}

static int remaining_ms(int64_t deadline_ns) { return ddp__ms_left(deadline_ns, 1000); }

/* A rank that waits for a peer's data past the deadline may be waiting for a rank that is itself
 * waiting: in a ring, rank 3 waits for rank 2, which waits for rank 1, which waits for a stopped
 * rank 0. Their deadlines differ by how far apart they started, so rank 3's can pass first, and
 * it would blame rank 2. So at its deadline a rank gives up at once (its abort frames go out to
 * every peer) and then listens on every connection for a grace period: each rank that is alive
 * and stuck gives up within it and sends its abort frame, and the ranks that send nothing are
 * the ones that stopped. The grace is half the timeout, at most 1 s (a quarter let a loaded
 * machine's later deadlines fall outside it); with two ranks there is nobody else to blame. */
static void send_abort_frames(tcp_state_t *t, uint64_t seq, const char *reason);

static int64_t blame_grace_ns(const tcp_state_t *t)
{
    if (t->world <= 2) return 0;
    int64_t g = (int64_t)t->timeout_ms * 500000LL;
    return g > 1000000000LL ? 1000000000LL : g;
}

/* `relayed`: the peer this rank waits for gave up itself, timing out on another rank (its abort
 * frame came before this rank's deadline): look for the rank that stopped the same way, with
 * that peer counted as heard from; its own reason is in `relayed_text`. */
static ddp_status_t blame_stopped(tcp_state_t *t, const ddp__collective_t *c, int waited,
                                  int waited_mid_frame, size_t got, size_t total,
                                  const char *relayed_text)
{
    char d[400], reason[600];
    describe_c(t, c, d, sizeof d);
    snprintf(reason, sizeof reason, "rank %d: %s: timed out waiting for rank %d (at seq %llu): it "
             "did not send its part", t->rank, d, waited,
             (unsigned long long)t->conns[waited].last_seq);
    send_abort_frames(t, c->seq, reason);
    /* Peers heard from: an abort frame or a closed connection. A connection in the middle of a
     * frame (only the one this rank was reading can be) cannot be read for an abort frame; its
     * peer counts as stopped unless it closes. */
    char *heard = calloc((size_t)t->world, 1);
    struct pollfd *pfds = calloc((size_t)t->world, sizeof *pfds);
    int *peer_of = calloc((size_t)t->world, sizeof *peer_of);
    if (!heard || !pfds || !peer_of) goto report;
    heard[t->rank] = 1;
    if (relayed_text) heard[waited] = 1;
    int64_t until = ddp__now_ns() + blame_grace_ns(t);
    for (;;) {
        int npfd = 0, waiting = 0;
        for (int p = 0; p < t->world; p++) {
            if (heard[p] || t->conns[p].fd < 0) continue;
            waiting++;
            int mid_frame = p == waited ? waited_mid_frame : t->conns[p].recv_partial;
            pfds[npfd].fd = t->conns[p].fd;
            pfds[npfd].events = mid_frame ? POLLRDHUP : POLLIN | POLLRDHUP;
            pfds[npfd].revents = 0;
            peer_of[npfd++] = p;
        }
        int64_t left = until - ddp__now_ns();
        if (!waiting || left <= 0) break;
        int r = poll(pfds, (nfds_t)npfd, (int)((left + 999999) / 1000000));
        if (r < 0 && errno != EINTR) break;
        int progressed = 0;
        for (int i = 0; r > 0 && i < npfd; i++) {
            int p = peer_of[i];
            if (pfds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
                heard[p] = 1;
                progressed = 1;
                continue;
            }
            if (!(pfds[i].revents & POLLIN)) continue;
            ddp__tcp_frame_t h;
            ssize_t k = recv(pfds[i].fd, &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
            if (k == 0 || (k == (ssize_t)sizeof h && h.magic == DDP_TCP_FRAME_MAGIC &&
                           h.type == DDP_TCP_FRAME_ABORT)) {
                heard[p] = 1;
                progressed = 1;
            }
        }
        /* Data still arriving on a connection (not an abort): nothing to learn from it; do
         * not spin on it. */
        if (!progressed && r > 0) {
            ddp__sleep_us(1000);
        }
    }
report:;
    char stopped[400] = "", gave_up[200] = "";
    size_t ns = 0, ng = 0;
    for (int p = 0; heard && p < t->world; p++) {
        if (p == t->rank) continue;
        if (!heard[p] && ns < sizeof stopped - 48)
            ns += (size_t)snprintf(stopped + ns, sizeof stopped - ns, "%srank %d (at seq %llu)",
                                   ns ? ", " : "", p,
                                   (unsigned long long)t->conns[p].last_seq);
        else if (heard[p] && ng < sizeof gave_up - 16)
            ng += (size_t)snprintf(gave_up + ng, sizeof gave_up - ng, "%s%d", ng ? ", " : "", p);
    }
    free(heard);
    free(pfds);
    free(peer_of);
    if (ns)
        return ddp__error(DDP_ERR_TIMEOUT, "%s: timed out: %s stopped sending; %s%s%sthis rank "
                          "waited for rank %d", d, stopped, ng ? "ranks " : "", gave_up,
                          ng ? " gave up waiting too; " : "", waited);
    if (relayed_text) return ddp__error(DDP_ERR_REMOTE, "%s", relayed_text);
    return ddp__error(DDP_ERR_TIMEOUT, "%s: timed out waiting for rank %d (at seq %llu): it did "
                      "not send its part (%zu of %zu messages received)", d, waited,
                      (unsigned long long)t->conns[waited].last_seq, got, total);
}

static ddp_status_t exchange_flows(tcp_state_t *t, const ddp__collective_t *c, flow_t *out,
                                   flow_t *in, on_recv_fn fn, void *ctx)
{
    ddp_status_t status = DDP_OK;
    int64_t deadline_ns = c->deadline_ns;
    for (;;) {
        if (atomic_load(&t->aborted)) return closed_error(t, c, out ? out->peer : in->peer, 0);
        int progressed = 1;
        while (progressed) {
            progressed = 0;
            if (in && in->cur < in->n) {
                int r = pump_recv(t, c, in, fn, ctx, &status);
                if (r < 0 && status == DDP_ERR_REMOTE && blame_grace_ns(t) > 0 &&
                    strstr(ddp_last_error(), "timed out")) {
                    char relayed[DDP_ERROR_TEXT_MAX];
                    snprintf(relayed, sizeof relayed, "%s", ddp_last_error());
                    return blame_stopped(t, c, in->peer, in->done > 0, in->cur, in->n, relayed);
                }
                if (r < 0) return status;
                progressed |= r;
            }
            if (out && out->cur < out->n) {
                int r = pump_send(t, c, out, in, &status);
                if (r < 0) return status;
                progressed |= r;
            }
        }
        int out_pending = out && out->cur < out->n;
        int in_pending = in && in->cur < in->n;
        if (!out_pending && !in_pending) return DDP_OK;

        struct pollfd pfds[2];
        int npfd = 0;
        if (in_pending) {
            /* Wake for the rest of the current frame's payload (bounded in set_rcvlowat), or
             * for any byte while a header is expected. */
            const size_t hsz = sizeof in->hdr;
            size_t want = 1;
            if (in->type == DDP_TCP_FRAME_DATA && in->done >= hsz)
                want = hsz + in->pieces[in->cur].bytes - in->done;
            set_rcvlowat(&t->conns[in->peer], want);
            pfds[npfd].fd = t->conns[in->peer].fd;
            pfds[npfd].events = POLLIN;
            npfd++;
        }
        if (out_pending) {
            const piece_t *p = &out->pieces[out->cur];
            int blocked_on_dep = p->after >= 0 && (!in || in->cur <= (size_t)p->after);
            if (!blocked_on_dep) {
                int fd = t->conns[out->peer].fd;
                if (npfd == 1 && pfds[0].fd == fd) {
                    pfds[0].events |= POLLOUT;
                } else {
                    pfds[npfd].fd = fd;
                    pfds[npfd].events = POLLOUT;
                    npfd++;
                }
            }
        }
        int ms = remaining_ms(deadline_ns);
        if (ms == 0 && in_pending && blame_grace_ns(t) > 0)
            return blame_stopped(t, c, in->peer, in->done > 0, in->cur, in->n, NULL);
        if (ms == 0) {
            char d[400];
            describe_c(t, c, d, sizeof d);
            if (in_pending)
                return ddp__error(DDP_ERR_TIMEOUT, "%s: timed out waiting for rank %d (at seq "
                                  "%llu): it did not send its part (%zu of %zu messages "
                                  "received)", d, in->peer,
                                  (unsigned long long)t->conns[in->peer].last_seq, in->cur,
                                  in->n);
            return ddp__error(DDP_ERR_TIMEOUT, "%s: timed out waiting for rank %d (at seq %llu) "
                              "to take its data (%zu of %zu messages sent)", d, out->peer,
                              (unsigned long long)t->conns[out->peer].last_seq, out->cur,
                              out->n);
        }
        int r = poll(pfds, (nfds_t)npfd, ms);
        if (r < 0 && errno != EINTR)
            return ddp__error_errno(DDP_ERR_SYSTEM, errno, "tcp transport: poll");
    }
}

/* One exchange of frames (above); the receive low-water mark goes back to its default. */
static ddp_status_t exchange(tcp_state_t *t, const ddp__collective_t *c, flow_t *out,
                             flow_t *in, on_recv_fn fn, void *ctx)
{
    ddp_status_t s = exchange_flows(t, c, out, in, fn, ctx);
    if (in) set_rcvlowat(&t->conns[in->peer], 1);
    return s;
}

/* ---- workspace ----------------------------------------------------------------------------- */
static ddp_status_t ensure(char **buf, size_t *have, size_t bytes, const char *what)
{
    if (*have >= bytes) return DDP_OK;
    free(*buf);
    *buf = NULL;
    *have = 0;
    size_t want = bytes < 4096 ? 4096 : bytes;
    *buf = malloc(want);
    if (!*buf) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: %zu bytes for %s", want, what);
    *have = want;
    return DDP_OK;
}

/* ---- fingerprint exchange (also the barrier) ---------------------------------------------
 * Every rank sends its fingerprint to every other rank and reads theirs, all at once, in one
 * poll loop: one network latency, every rank holds every fingerprint (so all reach the same
 * verdict), and on a timeout the ranks whose fingerprint did not come are exactly the ranks that
 * did not arrive at this collective; each is named with the last sequence number heard from it. */
typedef struct fp_peer {
    size_t sent, got; /* bytes of the 64-byte frame written / read */
    union {
        struct {
            ddp__tcp_frame_t hdr;
            fp_wire_t fp;
        } f;
        char bytes[sizeof(ddp__tcp_frame_t) + sizeof(fp_wire_t)];
    } in;
} fp_peer_t;

static ddp_status_t check_fingerprints(tcp_state_t *t, const ddp__collective_t *c, int commit)
{
    int n = t->world, r = t->rank;
    const size_t hsz = sizeof(ddp__tcp_frame_t), fsz = hsz + sizeof(fp_wire_t);
    fp_wire_t *all = calloc((size_t)n, sizeof *all);
    fp_peer_t *peers = calloc((size_t)n, sizeof *peers);
    struct pollfd *pfds = calloc((size_t)n, sizeof *pfds);
    ddp_status_t s = DDP_OK;
    if (!all || !peers || !pfds) {
        s = ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: fingerprints");
        goto done;
    }
    all[r] = fp_of(c);
    if (commit) all[r].valid = 2; /* a commit frame: see confirm_everywhere */
    struct {
        ddp__tcp_frame_t hdr;
        fp_wire_t fp;
    } out = {{DDP_TCP_FRAME_MAGIC, DDP_TCP_FRAME_FINGERPRINT, c->seq, sizeof(fp_wire_t)}, all[r]};
    char d[400];
    for (;;) {
        if (atomic_load(&t->aborted)) {
            s = closed_error(t, c, r == 0 ? 1 : 0, 0);
            goto done;
        }
        int pending = 0, npfd = 0;
        for (int p = 0; p < n; p++) {
            if (p == r) continue;
            ddp__tcp_conn_t *conn = &t->conns[p];
            fp_peer_t *q = &peers[p];
            while (q->sent < fsz) {
                ssize_t k = send(conn->fd, (char *)&out + q->sent, fsz - q->sent, MSG_NOSIGNAL);
                if (k > 0) {
                    q->sent += (size_t)k;
                    conn->send_partial = q->sent < fsz;
                    continue;
                }
                if (k < 0 && errno == EINTR) continue;
                if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
                s = closed_error(t, c, p, errno);
                goto done;
            }
            while (q->got < fsz) {
                size_t want = q->got < hsz ? hsz - q->got : fsz - q->got;
                ssize_t k = recv(conn->fd, q->in.bytes + q->got, want, 0);
                if (k > 0) {
                    q->got += (size_t)k;
                    conn->recv_partial = q->got < fsz;
                    if (q->got == hsz) {
                        const ddp__tcp_frame_t *h = &q->in.f.hdr;
                        if (h->magic != DDP_TCP_FRAME_MAGIC) {
                            describe_c(t, c, d, sizeof d);
                            s = ddp__error(DDP_ERR_PROTOCOL, "%s: rank %d sent a malformed "
                                           "frame", d, p);
                            goto done;
                        }
                        conn->last_seq = h->seq;
                        if (h->type == DDP_TCP_FRAME_ABORT) {
                            s = remote_abort(t, c, p, h->bytes);
                            /* A peer that timed out on another rank: find the rank that
                             * stopped, as a rank that times out itself does. */
                            if (blame_grace_ns(t) > 0 && strstr(ddp_last_error(), "timed out")) {
                                char relayed[DDP_ERROR_TEXT_MAX];
                                snprintf(relayed, sizeof relayed, "%s", ddp_last_error());
                                conn->recv_partial = 0;
                                s = blame_stopped(t, c, p, 0, 0, 0, relayed);
                            }
                            goto done;
                        }
                        if (h->type != DDP_TCP_FRAME_FINGERPRINT || h->bytes != sizeof(fp_wire_t)) {
                            describe_c(t, c, d, sizeof d);
                            s = ddp__error(DDP_ERR_PROTOCOL, "%s: rank %d sent frame type %u "
                                           "(seq %llu) where its fingerprint was expected", d,
                                           p, h->type, (unsigned long long)h->seq);
                            goto done;
                        }
                    }
                    if (q->got == fsz) all[p] = q->in.f.fp;
                    continue;
                }
                if (k < 0 && errno == EINTR) continue;
                if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
                s = closed_error(t, c, p, k == 0 ? 0 : errno);
                goto done;
            }
            short events = (short)((q->sent < fsz ? POLLOUT : 0) | (q->got < fsz ? POLLIN : 0));
            if (events) {
                pending = 1;
                pfds[npfd].fd = conn->fd;
                pfds[npfd].events = events;
                pfds[npfd].revents = 0;
                npfd++;
            }
        }
        if (!pending) break;
        int ms = remaining_ms(c->deadline_ns);
        if (ms == 0) {
            char missing[1024] = "";
            size_t used = 0;
            int slow_reader = -1;
            for (int p = 0; p < n && used + 48 < sizeof missing; p++) {
                if (p == r) continue;
                if (peers[p].got < fsz)
                    used += (size_t)snprintf(missing + used, sizeof missing - used,
                                             "%srank %d (at seq %llu)", used ? ", " : "", p,
                                             (unsigned long long)t->conns[p].last_seq);
                else if (peers[p].sent < fsz && slow_reader < 0)
                    slow_reader = p;
            }
            describe_c(t, c, d, sizeof d);
            if (used)
                s = ddp__error(DDP_ERR_TIMEOUT, "%s: timed out: %s did not arrive", d, missing);
            else
                s = ddp__error(DDP_ERR_TIMEOUT, "%s: timed out: rank %d (at seq %llu) does not "
                               "read its connection", d, slow_reader,
                               (unsigned long long)t->conns[slow_reader].last_seq);
            goto done;
        }
        if (poll(pfds, (nfds_t)npfd, ms) < 0 && errno != EINTR) {
            s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "tcp transport: poll");
            goto done;
        }
    }
    for (int j = 1; j < n; j++) {
        if (memcmp(&all[j], &all[0], sizeof all[0]) != 0) {
            char a[200], b[200];
            describe_fp(&all[0], a, sizeof a);
            describe_fp(&all[j], b, sizeof b);
            s = ddp__error(DDP_ERR_MISMATCH, "tcp transport, group '%s': ranks disagree on the "
                           "collective: rank 0 called %s but rank %d called %s", t->group, a, j,
                           b);
            goto done;
        }
    }
done:
    free(all);
    free(peers);
    free(pfds);
    return s;
}

/* ---- the ring -------------------------------------------------------------------------------
 * Segment j of the vector has seg_cnt[j] elements at seg_off[j]. At reduce-scatter step s rank r
 * sends segment (r - s + shift) and receives (r - s - 1 + shift) from r - 1, combining it with its
 * own; after n - 1 steps it owns segment (r + 1 + shift), fully reduced. Allgather steps then
 * pass owned segments on: at step s rank r sends (own - s) and receives (own - s - 1). Every
 * step's outgoing segment is the previous step's incoming one, chunk by chunk: that is what the
 * `after` links express. */
typedef struct ring {
    tcp_state_t *t;
    const ddp__collective_t *c;
    int n;
    size_t *seg_off, *seg_cnt;
    size_t chunk; /* elements */
    /* reduce-scatter: my contribution `src`, partial sums `acc`, incoming chunks `tmp` */
    const char *src;
    char *acc;
    char *tmp;
    ddp_dtype_t at;
    size_t as;
    /* the owned segment, finished, goes to final (element i of the owned segment at
     * final + (i - final_from) * out size) */
    char *final;
    size_t final_from;
    /* allgather: the output vector */
    char *out;
    size_t os;
    /* per incoming piece: what it is */
    struct rinfo {
        int rs;   /* 1: a reduce-scatter chunk to combine; 0: allgather, already in place */
        int last; /* last reduce-scatter step: finish the chunk */
        size_t elem, count;
    } *info;
} ring_t;

static void ring_on_recv(void *ctx, size_t i)
{
    ring_t *g = ctx;
    const struct rinfo *ri = &g->info[i];
    if (!ri->rs) return;
    char *acc = g->acc + ri->elem * g->as;
    /* Combine as (incoming partial) op (mine): the same order on every rank for a segment. */
    ddp__acc_combine(acc, g->tmp, g->src + ri->elem * g->as, ri->count, g->at, g->c->op);
    if (ri->last && g->final)
        ddp__acc_finish(g->final + (ri->elem - g->final_from) * ddp_dtype_size(g->c->dtype), acc,
                        ri->count, g->c->dtype, g->at, g->c->op, g->n);
}

static size_t nchunks(size_t count, size_t chunk) { return (count + chunk - 1) / chunk; }

/* rs_steps and ag_steps are each 0 or n - 1. */
static ddp_status_t ring_run(ring_t *g, int rs_steps, int ag_steps, int shift)
{
    tcp_state_t *t = g->t;
    int n = g->n, r = t->rank;
    int steps = rs_steps + ag_steps;
    int own = ((r + 1 + shift) % n + n) % n;
    if (rs_steps == 0) own = ((r + shift) % n + n) % n;
    int *sseg = malloc(sizeof(int) * 2 * (size_t)steps);
    size_t *rbase = malloc(sizeof(size_t) * ((size_t)steps + 1));
    if (!sseg || !rbase) {
        free(sseg);
        free(rbase);
        return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: ring plan");
    }
    int *rseg = sseg + steps;
    size_t nsend = 0, nrecv = 0;
    for (int s = 0; s < steps; s++) {
        if (s < rs_steps) {
            sseg[s] = (((r - s + shift) % n) + n) % n;
            rseg[s] = (((r - s - 1 + shift) % n) + n) % n;
        } else {
            int a = s - rs_steps;
            sseg[s] = (((own - a) % n) + n) % n;
            rseg[s] = (((own - a - 1) % n) + n) % n;
        }
        rbase[s] = nrecv;
        nsend += nchunks(g->seg_cnt[sseg[s]], g->chunk);
        nrecv += nchunks(g->seg_cnt[rseg[s]], g->chunk);
    }
    rbase[steps] = nrecv;
    piece_t *sp = calloc(nsend + 1, sizeof *sp);
    piece_t *rp = calloc(nrecv + 1, sizeof *rp);
    g->info = calloc(nrecv + 1, sizeof *g->info);
    ddp_status_t status = DDP_OK;
    if (!sp || !rp || !g->info) {
        status = ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: ring plan");
        goto done;
    }
    size_t si = 0, ri = 0;
    for (int s = 0; s < steps; s++) {
        int rs = s < rs_steps;
        size_t esz = rs ? g->as : g->os;
        /* outgoing */
        int seg = sseg[s];
        size_t k = 0;
        for (size_t e = 0; e < g->seg_cnt[seg]; e += g->chunk, k++) {
            size_t cnt = g->seg_cnt[seg] - e < g->chunk ? g->seg_cnt[seg] - e : g->chunk;
            size_t elem = g->seg_off[seg] + e;
            const char *base = rs ? (s == 0 ? g->src : g->acc) : g->out;
            sp[si].buf = (char *)base + elem * esz;
            sp[si].bytes = cnt * esz;
            sp[si].after = s == 0 ? -1 : (long)(rbase[s - 1] + k);
            si++;
        }
        /* incoming */
        seg = rseg[s];
        for (size_t e = 0; e < g->seg_cnt[seg]; e += g->chunk) {
            size_t cnt = g->seg_cnt[seg] - e < g->chunk ? g->seg_cnt[seg] - e : g->chunk;
            size_t elem = g->seg_off[seg] + e;
            rp[ri].buf = rs ? g->tmp : g->out + elem * esz;
            rp[ri].bytes = cnt * esz;
            rp[ri].after = -1;
            g->info[ri].rs = rs;
            g->info[ri].last = rs && s == rs_steps - 1;
            g->info[ri].elem = elem;
            g->info[ri].count = cnt;
            ri++;
        }
    }
    flow_t out = {(r + 1) % n, DDP_TCP_FRAME_DATA, sp, nsend, 0, 0, {0}};
    flow_t in = {(r - 1 + n) % n, DDP_TCP_FRAME_DATA, rp, nrecv, 0, 0, {0}};
    status = exchange(t, g->c, &out, &in, ring_on_recv, g);
done:
    free(sp);
    free(rp);
    free(g->info);
    g->info = NULL;
    free(sseg);
    free(rbase);
    return status;
}

/* Splits `count` elements into n segments, the first count % n one element longer. */
static ddp_status_t split(size_t count, int n, size_t **off, size_t **cnt)
{
    *off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!*off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    *cnt = *off + n;
    size_t base = count / (size_t)n, extra = count % (size_t)n, at = 0;
    for (int j = 0; j < n; j++) {
        (*cnt)[j] = base + ((size_t)j < extra ? 1 : 0);
        (*off)[j] = at;
        at += (*cnt)[j];
    }
    return DDP_OK;
}

static size_t chunk_elems(size_t esize)
{
    size_t c = chunk_bytes / esize;
    return c ? c : 1;
}

static ddp_status_t allreduce_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = t->world;
    g.at = at;
    g.as = as;
    g.os = es;
    g.out = c->recv;
    g.final = c->recv;
    g.final_from = 0;
    g.chunk = chunk_elems(as > es ? as : es);
    ddp_status_t s = ensure(&t->tmp, &t->tmp_bytes, g.chunk * as, "an incoming chunk");
    if (s != DDP_OK) return s;
    g.tmp = t->tmp;
    if (at != c->dtype) {
        s = ensure(&t->work, &t->work_bytes, c->count * as, "wider accumulation");
        if (s != DDP_OK) return s;
        ddp__acc_widen(t->work, c->send, c->count, c->dtype);
        g.src = t->work;
        g.acc = t->work;
    } else {
        /* Each segment is combined at most once on a rank, so partial sums can be written
         * straight into recv while `send` stays the source of this rank's contribution. */
        g.src = c->send;
        g.acc = c->recv;
    }
    s = split(c->count, g.n, &g.seg_off, &g.seg_cnt);
    if (s != DDP_OK) return s;
    s = ring_run(&g, g.n - 1, g.n - 1, 0);
    free(g.seg_off);
    return s;
}

static ddp_status_t reduce_scatter_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world;
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    size_t total = c->count * (size_t)n;
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = n;
    g.at = at;
    g.as = as;
    g.os = es;
    g.chunk = chunk_elems(as);
    g.final = c->recv;
    g.final_from = c->count * (size_t)t->rank;
    ddp_status_t s = ensure(&t->tmp, &t->tmp_bytes, g.chunk * as, "an incoming chunk");
    if (s != DDP_OK) return s;
    g.tmp = t->tmp;
    s = ensure(&t->work, &t->work_bytes, total * as, "reduce-scatter partial sums");
    if (s != DDP_OK) return s;
    if (at != c->dtype) {
        ddp__acc_widen(t->work, c->send, total, c->dtype);
        g.src = t->work;
    } else {
        g.src = c->send;
    }
    g.acc = t->work;
    g.seg_off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!g.seg_off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    g.seg_cnt = g.seg_off + n;
    for (int j = 0; j < n; j++) {
        g.seg_off[j] = c->count * (size_t)j;
        g.seg_cnt[j] = c->count;
    }
    /* shift -1: rank r ends up owning segment r. */
    s = ring_run(&g, n - 1, 0, -1);
    free(g.seg_off);
    (void)es;
    return s;
}

static ddp_status_t allgather_ring(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world;
    size_t es = ddp_dtype_size(c->dtype);
    char *mine = (char *)c->recv + c->count * (size_t)t->rank * es;
    if (c->send != mine && c->count) memmove(mine, c->send, c->count * es);
    ring_t g;
    memset(&g, 0, sizeof g);
    g.t = t;
    g.c = c;
    g.n = n;
    g.os = es;
    g.as = es;
    g.out = c->recv;
    g.chunk = chunk_elems(es);
    g.seg_off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!g.seg_off) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: segments");
    g.seg_cnt = g.seg_off + n;
    for (int j = 0; j < n; j++) {
        g.seg_off[j] = c->count * (size_t)j;
        g.seg_cnt[j] = c->count;
    }
    ddp_status_t s = ring_run(&g, 0, n - 1, 0);
    free(g.seg_off);
    return s;
}

/* ---- recursive doubling (small allreduce) ---------------------------------------------------- */
static ddp_status_t swap_with(tcp_state_t *t, const ddp__collective_t *c, int peer, char *send,
                              size_t sbytes, char *recv, size_t rbytes)
{
    piece_t sp = {send, sbytes, -1}, rp = {recv, rbytes, -1};
    flow_t out = {peer, DDP_TCP_FRAME_DATA, &sp, send ? 1u : 0u, 0, 0, {0}};
    flow_t in = {peer, DDP_TCP_FRAME_DATA, &rp, recv ? 1u : 0u, 0, 0, {0}};
    return exchange(t, c, send ? &out : NULL, recv ? &in : NULL, NULL, NULL);
}

static ddp_status_t allreduce_doubling(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world, r = t->rank;
    size_t es = ddp_dtype_size(c->dtype);
    ddp_dtype_t at = ddp__acc_dtype(c->dtype, c->op);
    size_t as = ddp_dtype_size(at);
    size_t abytes = c->count * as;
    ddp_status_t s = ensure(&t->work, &t->work_bytes, 2 * abytes, "recursive doubling");
    if (s != DDP_OK) return s;
    char *acc = t->work, *tmp = t->work + abytes;
    if (at != c->dtype) ddp__acc_widen(acc, c->send, c->count, c->dtype);
    else memcpy(acc, c->send, abytes);

    int p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    int extra = n - p2;
    if (r >= p2) {
        /* Fold into rank r - p2, then receive the finished result from it. */
        s = swap_with(t, c, r - p2, acc, abytes, NULL, 0);
        if (s != DDP_OK) return s;
        return swap_with(t, c, r - p2, NULL, 0, c->recv, c->count * es);
    }
    if (r < extra) {
        s = swap_with(t, c, r + p2, NULL, 0, tmp, abytes);
        if (s != DDP_OK) return s;
        ddp__acc_combine(acc, acc, tmp, c->count, at, c->op);
    }
    for (int mask = 1; mask < p2; mask *= 2) {
        int peer = r ^ mask;
        s = swap_with(t, c, peer, acc, abytes, tmp, abytes);
        if (s != DDP_OK) return s;
        if (r < peer) ddp__acc_combine(acc, acc, tmp, c->count, at, c->op);
        else ddp__acc_combine(acc, tmp, acc, c->count, at, c->op);
    }
    ddp__acc_finish(c->recv, acc, c->count, c->dtype, at, c->op, n);
    if (r < extra) return swap_with(t, c, r + p2, c->recv, c->count * es, NULL, 0);
    return DDP_OK;
}

/* ---- broadcast: a pipelined chain from the root ---------------------------------------------- */
static ddp_status_t broadcast_chain(tcp_state_t *t, const ddp__collective_t *c)
{
    int n = t->world, r = t->rank;
    size_t es = ddp_dtype_size(c->dtype);
    size_t bytes = c->count * es;
    char *buf = c->recv;
    int pos = (r - c->root + n) % n;
    if (pos == 0 && c->send && c->send != c->recv && bytes) memmove(buf, c->send, bytes);
    size_t chunk = chunk_elems(es) * es;
    size_t np = nchunks(bytes, chunk);
    piece_t *pieces = calloc(2 * np + 1, sizeof *pieces);
    if (!pieces) return ddp__error(DDP_ERR_NO_MEMORY, "tcp transport: broadcast plan");
    piece_t *sp = pieces, *rp = pieces + np;
    for (size_t k = 0; k < np; k++) {
        size_t off = k * chunk;
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        rp[k].buf = sp[k].buf = buf + off;
        rp[k].bytes = sp[k].bytes = len;
        rp[k].after = -1;
        sp[k].after = pos == 0 ? -1 : (long)k;
    }
    flow_t out = {(r + 1) % n, DDP_TCP_FRAME_DATA, sp, np, 0, 0, {0}};
    flow_t in = {(r - 1 + n) % n, DDP_TCP_FRAME_DATA, rp, np, 0, 0, {0}};
    ddp_status_t s = exchange(t, c, pos == n - 1 ? NULL : &out, pos == 0 ? NULL : &in, NULL,
                              NULL);
    free(pieces);
    return s;
}

/* ---- failure: tell the peers, close everything ------------------------------------------- */
static void send_abort_frames(tcp_state_t *t, uint64_t seq, const char *reason)
{
    size_t len = strlen(reason);
    for (int p = 0; p < t->world; p++) {
        ddp__tcp_conn_t *conn = &t->conns[p];
        if (conn->fd < 0 || conn->send_partial) continue;
        ddp__tcp_frame_t h = {DDP_TCP_FRAME_MAGIC, DDP_TCP_FRAME_ABORT, seq, len};
        struct iovec iov[2] = {{&h, sizeof h}, {(void *)reason, len}};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = 2;
        /* Best effort: a full socket buffer just loses the reason; peers still see the close. */
        (void)sendmsg(conn->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
}

static void shut_all(tcp_state_t *t)
{
    for (int p = 0; p < t->world; p++)
        if (t->conns[p].fd >= 0) shutdown(t->conns[p].fd, SHUT_RDWR);
}

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
    if (timeout_ms <= 0) {
        ddp_status_t timeout_status = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
        if (timeout_status != DDP_OK) return ddp__error_context(timeout_status, "tcp transport");
    }

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
 * needs already in its sockets (the barrier is only the fingerprint exchange; in a ring, the
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
            if (!pending_abort_reason(t, peer, reason, sizeof reason))
                snprintf(reason, sizeof reason, "(no reason given)");
            char d[400];
            describe_c(t, c, d, sizeof d);
            return ddp__error(DDP_ERR_REMOTE, "%s: rank %d gave up on it before this rank "
                              "finished: %s", d, peer, reason);
        }
    }
    return DDP_OK;
}

static ddp_status_t run_algorithm(tcp_state_t *t, const ddp__collective_t *c)
{
    ddp_status_t s = check_fingerprints(t, c, 0);
    if (s != DDP_OK || c->kind == DDP__BARRIER || c->count == 0) return s;
    switch (c->kind) {
    case DDP__ALLREDUCE:
        if (c->count * ddp_dtype_size(c->dtype) <= small_threshold)
            return allreduce_doubling(t, c);
        return allreduce_ring(t, c);
    case DDP__BROADCAST: return broadcast_chain(t, c);
    case DDP__REDUCE_SCATTER: return reduce_scatter_ring(t, c);
    case DDP__ALLGATHER: return allgather_ring(t, c);
    default: return DDP_OK;
    }
}

/* In a ring or recursive doubling a rank's last frames need not come from every rank: ranks can
 * finish while another still waits for a stopped rank, and that one's give-up came too late for
 * them. A collective that moved data therefore ends with a commit round, one more all-to-all of
 * small frames (the fingerprint exchange's code, the frames marked as commits): a rank reports
 * success only when every rank has finished its part, and a rank that gave up instead sends its
 * abort frame where the others wait for its commit. The barrier is itself one all-to-all and
 * needs none. Costs one network latency per collective (docs/tcp-transport.md, "Agreement"). */
static ddp_status_t commit_everywhere(tcp_state_t *t, const ddp__collective_t *c)
{
    if (c->kind == DDP__BARRIER || c->count == 0) return DDP_OK;
    ddp_status_t s = check_fingerprints(t, c, 1);
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
            send_abort_frames(t, c->seq, reason);
            shut_all(t);
        }
    } else if (atomic_load(&t->aborted)) {
        char reason[400];
        snprintf(reason, sizeof reason, "rank %d aborted: %s", t->rank, t->abort_reason);
        send_abort_frames(t, c->seq, reason);
        shut_all(t);
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
                send_abort_frames(t, 0, text);
            }
            shut_all(t);
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
