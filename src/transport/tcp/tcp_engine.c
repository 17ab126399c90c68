/* The TCP transport's progress engine (tcp_private.h): fingerprints and their exchange (also
 * the barrier), the non-blocking streams of frames one exchange drives with poll(), the
 * receive low-water mark, blaming the rank that stopped, and the abort frames sent on failure.
 * The algorithms (tcp_ring.c) and the ops table (tcp_transport.c) are built on it. */
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

/* ---- fingerprints ----------------------------------------------------------------------- */
/* The shared fingerprint and a flag: the frame every rank sends first. */

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


void ddp__tcp_describe_c(const tcp_state_t *t, const ddp__collective_t *c, char *buf, size_t size)
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
    ddp__tcp_describe_c(t, c, d, sizeof d);
    return ddp__error(DDP_ERR_REMOTE, "%s: rank %d failed: %s", d, peer,
                      have ? reason : "(no reason given)");
}

/* A peer that failed usually sent an abort frame with its reason before closing; when this
 * rank was not reading from that peer (the ring reads only from its left neighbour) the frame is
 * still waiting in the socket. Returns 1 and fills `reason` if one is there. */
int ddp__tcp_pending_abort_reason(tcp_state_t *t, int peer, char *reason, size_t size)
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
    ddp__tcp_describe_c(t, c, d, sizeof d);
    if (atomic_load(&t->aborted))
        return ddp__error(DDP_ERR_ABORTED, "%s: aborted locally: %s", d, t->abort_reason);
    char reason[512];
    if (ddp__tcp_pending_abort_reason(t, peer, reason, sizeof reason))
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
                ddp__tcp_describe_c(t, c, d, sizeof d);
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
                ddp__tcp_describe_c(t, c, d, sizeof d);
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
 * and clamp the TCP window to the mark. Every ddp__tcp_exchange leaves the mark at 1 (the default) for the
 * fingerprint ddp__tcp_exchange and the abort paths, which wait for small frames. */
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
int64_t ddp__tcp_blame_grace_ns(const tcp_state_t *t)
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
    ddp__tcp_describe_c(t, c, d, sizeof d);
    snprintf(reason, sizeof reason, "rank %d: %s: timed out waiting for rank %d (at seq %llu): it "
             "did not send its part", t->rank, d, waited,
             (unsigned long long)t->conns[waited].last_seq);
    ddp__tcp_send_abort_frames(t, c->seq, reason);
    /* Peers heard from: an abort frame or a closed connection. A connection in the middle of a
     * frame (only the one this rank was reading can be) cannot be read for an abort frame; its
     * peer counts as stopped unless it closes. */
    char *heard = calloc((size_t)t->world, 1);
    struct pollfd *pfds = calloc((size_t)t->world, sizeof *pfds);
    int *peer_of = calloc((size_t)t->world, sizeof *peer_of);
    if (!heard || !pfds || !peer_of) goto report;
    heard[t->rank] = 1;
    if (relayed_text) heard[waited] = 1;
    int64_t until = ddp__now_ns() + ddp__tcp_blame_grace_ns(t);
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
                if (r < 0 && status == DDP_ERR_REMOTE && ddp__tcp_blame_grace_ns(t) > 0 &&
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
        if (ms == 0 && in_pending && ddp__tcp_blame_grace_ns(t) > 0)
            return blame_stopped(t, c, in->peer, in->done > 0, in->cur, in->n, NULL);
        if (ms == 0) {
            char d[400];
            ddp__tcp_describe_c(t, c, d, sizeof d);
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

/* One ddp__tcp_exchange of frames (above); the receive low-water mark goes back to its default. */
ddp_status_t ddp__tcp_exchange(tcp_state_t *t, const ddp__collective_t *c, flow_t *out,
                             flow_t *in, on_recv_fn fn, void *ctx)
{
    ddp_status_t s = exchange_flows(t, c, out, in, fn, ctx);
    if (in) set_rcvlowat(&t->conns[in->peer], 1);
    return s;
}

/* ---- workspace ----------------------------------------------------------------------------- */
ddp_status_t ddp__tcp_ensure(char **buf, size_t *have, size_t bytes, const char *what)
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

/* ---- fingerprint ddp__tcp_exchange (also the barrier) ---------------------------------------------
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

/* Long because it is one poll loop over every peer's partial send and receive of its frame,
 * with the deadline, abort frames and the verdict on the gathered fingerprints handled in the
 * loop's own state; moved here unchanged from tcp_transport.c (issue #29 leaves it whole). */
ddp_status_t ddp__tcp_check_fingerprints(tcp_state_t *t, const ddp__collective_t *c, int commit)
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
                            ddp__tcp_describe_c(t, c, d, sizeof d);
                            s = ddp__error(DDP_ERR_PROTOCOL, "%s: rank %d sent a malformed "
                                           "frame", d, p);
                            goto done;
                        }
                        conn->last_seq = h->seq;
                        if (h->type == DDP_TCP_FRAME_ABORT) {
                            s = remote_abort(t, c, p, h->bytes);
                            /* A peer that timed out on another rank: find the rank that
                             * stopped, as a rank that times out itself does. */
                            if (ddp__tcp_blame_grace_ns(t) > 0 && strstr(ddp_last_error(), "timed out")) {
                                char relayed[DDP_ERROR_TEXT_MAX];
                                snprintf(relayed, sizeof relayed, "%s", ddp_last_error());
                                conn->recv_partial = 0;
                                s = blame_stopped(t, c, p, 0, 0, 0, relayed);
                            }
                            goto done;
                        }
                        if (h->type != DDP_TCP_FRAME_FINGERPRINT || h->bytes != sizeof(fp_wire_t)) {
                            ddp__tcp_describe_c(t, c, d, sizeof d);
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
            ddp__tcp_describe_c(t, c, d, sizeof d);
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

/* ---- failure: tell the peers, close everything ------------------------------------------- */
void ddp__tcp_send_abort_frames(tcp_state_t *t, uint64_t seq, const char *reason)
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

void ddp__tcp_shut_all(tcp_state_t *t)
{
    for (int p = 0; p < t->world; p++)
        if (t->conns[p].fd >= 0) shutdown(t->conns[p].fd, SHUT_RDWR);
}

