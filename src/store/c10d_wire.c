/* What both store clients need of PyTorch's c10d TCPStore wire (docs/store-protocol.md): dialing
 * a server, whole-buffer I/O worded as "c10d store host:port: ...", and the probe that tells
 * libddp's protocol from c10d's. The c10d client (c10d_client.c) runs requests over these; the
 * libddp client (tcp_client.c) asks the probe when a server does not answer its AUTH; the front
 * door (store_connect.c) probes and dispatches. It sits below all three, so none is circular. */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <unistd.h>

#include "core/socket.h"
#include "store/c10d.h"
#include "store/store_impl.h"

/* How long a probe waits for a reply from a server that accepted the connection. A libddp server
 * closes at once and a c10d server answers at once; silence this long means neither. The first
 * probe (torch 1.x's CHECK) waits less: torch 2.x's libuv server stays silent to it (it waits
 * for a VALIDATE), so that wait is paid by every torch 2.x rendezvous. */
#define PROBE_REPLY_MS 5000
#define PROBE_V1_REPLY_MS 1500
/* The socket helpers' outcome as a c10d client words it. */
static ddp_status_t io_status(const char *host, int port, ddp__socket_io_t r, int err,
                              const char *what)
{
    switch (r) {
    case DDP__SOCKET_IO_DONE:
        return DDP_OK;
    case DDP__SOCKET_IO_TIMEOUT:
        if (!what)
            return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out sending a request",
                              host, port);
        return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out waiting for %s", host,
                          port, what);
    case DDP__SOCKET_IO_POLL_ERROR:
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "c10d store: poll");
    case DDP__SOCKET_IO_CLOSED:
        return ddp__error(DDP_ERR_REMOTE,
                          "c10d store %s:%d: the server closed the connection while we waited "
                          "for %s (stopped, or it rejected the request)",
                          host, port, what ? what : "a reply");
    case DDP__SOCKET_IO_ERROR:
        break;
    }
    if (!what)
        return ddp__error_errno(DDP_ERR_REMOTE, err,
                                "c10d store %s:%d: sending a request failed (server gone?)", host,
                                port);
    return ddp__error_errno(DDP_ERR_REMOTE, err, "c10d store %s:%d: receiving %s", host, port,
                            what);
}

ddp_status_t ddp__c10d_send_all(const char *host, int port, int fd, const uint8_t *data,
                                size_t len, int64_t deadline_ns)
{
    int err = 0;
    return io_status(host, port, ddp__socket_send_all(fd, data, len, deadline_ns, &err), err,
                     NULL);
}

ddp_status_t ddp__c10d_recv_all(const char *host, int port, int fd, uint8_t *data, size_t len,
                                int64_t deadline_ns, const char *what, int *closed)
{
    int err = 0;
    size_t got = 0;
    ddp__socket_io_t r = ddp__socket_recv_all(fd, data, len, deadline_ns, &got, &err);
    if (closed)
        *closed = got == 0 && (r == DDP__SOCKET_IO_CLOSED ||
                               (r == DDP__SOCKET_IO_ERROR && err == ECONNRESET));
    return io_status(host, port, r, err, what);
}

/* One TCP connection to host:port, retrying with backoff while nothing listens, until the
 * deadline: the probe's connections and the c10d client's (c10d.h). */
ddp_status_t ddp__c10d_dial(const char *host, int port, int64_t deadline_ns, int *out_fd)
{
    int64_t backoff_ms = 10;
    int last_err = 0;
    for (;;) {
        struct addrinfo *res = NULL;
        int gai = ddp__socket_resolve(host, port, 0, &res);
        if (gai != 0 && gai != EAI_AGAIN)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "store host '%s': %s", host,
                              gai_strerror(gai));
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = -1;
            int err = ddp__socket_connect(ai->ai_addr, ai->ai_addrlen, deadline_ns, &fd);
            if (err != 0) {
                last_err = err;
                continue;
            }
            ddp__socket_nodelay(fd);
            freeaddrinfo(res);
            *out_fd = fd;
            return DDP_OK;
        }
        if (res) freeaddrinfo(res);
        if (ddp__now_ns() >= deadline_ns) break;
        int left = ddp__ms_left(deadline_ns, 1000000000);
        ddp__sleep_us((backoff_ms < left ? backoff_ms : left) * 1000);
        if (backoff_ms < 500) backoff_ms *= 2;
    }
    return ddp__error_errno(DDP_ERR_TIMEOUT, last_err ? last_err : ETIMEDOUT,
                            "store: could not connect to %s:%d before the timeout", host, port);
}

/* ---- the probe ----------------------------------------------------------------------------- */

/* One probe on a connection of its own: sends `probe` and reads `reply_len` bytes within
 * reply_ms. *closed = 1 when the server closed the connection instead of answering. */
static ddp_status_t probe_once(const char *host, int port, int64_t deadline_ns,
                               const uint8_t *probe, size_t len, uint8_t *reply, size_t reply_len,
                               int64_t reply_ms, int *closed)
{
    int fd = -1;
    *closed = 0;
    ddp_status_t s = ddp__c10d_dial(host, port, deadline_ns, &fd);
    if (s != DDP_OK) return s;
    int64_t reply_deadline = ddp__deadline_precise_ns(reply_ms);
    if (reply_deadline > deadline_ns) reply_deadline = deadline_ns;
    s = ddp__c10d_send_all(host, port, fd, probe, len, reply_deadline);
    if (s == DDP_OK)
        s = ddp__c10d_recv_all(host, port, fd, reply, reply_len, reply_deadline, "the reply to the probe",
                     closed);
    close(fd);
    return s;
}

void ddp__c10d_put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The first probe is torch 1.x's CHECK of zero keys: 0x04 then a 64-bit count of 0, nine bytes in
 * all. A 1.x server answers READY (one byte 0x00: all of no keys exist). A libddp server reads the
 * first four bytes as a frame length of 0x04000000, above its 4101-byte limit before
 * authentication, and closes the connection at once without reading further. torch 2.x's
 * servers wait for a VALIDATE first: the libuv one stays silent, the other closes.
 * The second, only then, is torch 2.x's VALIDATE (0x00, the magic number) and PING (13, a
 * number), fourteen bytes: a 2.x server echoes the number (four bytes); a libddp server reads a
 * frame length of 0x85F7CE00 and closes at once. It is never sent before the first failed,
 * because a 1.x server would read it as a SET of a key gigabytes long.
 * Neither probe makes any kind of server allocate anything or change state. */
ddp_status_t ddp__store_probe(const char *host, int port, int64_t deadline_ns,
                              ddp__store_kind_t *kind)
{
    static const uint8_t v1[9] = {C10D_Q_CHECK, 0, 0, 0, 0, 0, 0, 0, 0};
    uint8_t reply[4] = {0xff, 0xff, 0xff, 0xff};
    int closed1 = 0, closed2 = 0;
    ddp_status_t s = probe_once(host, port, deadline_ns, v1, sizeof v1, reply, 1,
                                PROBE_V1_REPLY_MS, &closed1);
    if (s == DDP_OK && reply[0] == C10D_CHECK_READY) {
        *kind = DDP__STORE_KIND_C10D;
        ddp__clear_error();
        return DDP_OK;
    }
    if (s != DDP_OK && s != DDP_ERR_TIMEOUT && !(s == DDP_ERR_REMOTE && closed1)) return s;
    if (ddp__now_ns() >= deadline_ns)
        return ddp__error(DDP_ERR_TIMEOUT, "the server at %s:%d did not answer a c10d CHECK probe "
                          "before the timeout", host, port);
    uint8_t v2[10];
    const uint32_t nonce = 0x6464706Bu; /* "kpdd" */
    v2[0] = C10D_Q2_VALIDATE;
    ddp__c10d_put_le32(v2 + 1, C10D_VALIDATION_MAGIC);
    v2[5] = C10D_Q2_PING;
    ddp__c10d_put_le32(v2 + 6, nonce);
    s = probe_once(host, port, deadline_ns, v2, sizeof v2, reply, 4, PROBE_REPLY_MS, &closed2);
    if (s == DDP_OK && reply[0] == (nonce & 0xff) && reply[1] == ((nonce >> 8) & 0xff) &&
        reply[2] == ((nonce >> 16) & 0xff) && reply[3] == (nonce >> 24)) {
        *kind = DDP__STORE_KIND_C10D_V2;
        ddp__clear_error();
        return DDP_OK;
    }
    if (s == DDP_ERR_REMOTE && closed2) {
        *kind = DDP__STORE_KIND_LIBDDP;
        ddp__clear_error();
        return DDP_OK;
    }
    if (s == DDP_OK || s == DDP_ERR_TIMEOUT)
        return ddp__error(DDP_ERR_PROTOCOL,
                          "the server at %s:%d speaks neither libddp's store protocol nor "
                          "PyTorch's c10d TCPStore protocol (%s to c10d's CHECK and PING "
                          "probes%s)",
                          host, port, s == DDP_OK ? "an unexpected reply" : "no reply",
                          s == DDP_OK ? "" : ddp__now_ns() < deadline_ns ? " in 5 s"
                                                                        : " before the timeout");
    return s;
}
