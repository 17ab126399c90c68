/* Socket setup and whole-buffer transfers with deadlines, shared by the TCP store (server and
 * clients) and the TCP transport (socket.h). Only the mechanics live here; each caller keeps its
 * own protocol (retries, backoff, authentication) and its own error texts. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/socket.h"

int ddp__socket_resolve(const char *host, int port, int ai_flags, struct addrinfo **out)
{
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | ai_flags;
    *out = NULL;
    return getaddrinfo(host, portstr, &hints, out);
}

int ddp__socket_tcp(int family)
{
    return socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
}

int ddp__socket_listen(const struct sockaddr *addr, socklen_t len, int backlog, int reuse_addr,
                       int *out_fd)
{
    int fd = ddp__socket_tcp(addr->sa_family);
    if (fd < 0) return errno;
    int one = 1;
    if (reuse_addr) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, addr, len) != 0 || listen(fd, backlog) != 0) {
        int e = errno;
        close(fd);
        return e;
    }
    *out_fd = fd;
    return 0;
}

int ddp__socket_local_port(int fd, struct sockaddr_storage *addr)
{
    struct sockaddr_storage a;
    socklen_t alen = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &alen) != 0) return -1;
    if (addr) *addr = a;
    return ntohs(a.ss_family == AF_INET6 ? ((const struct sockaddr_in6 *)&a)->sin6_port
                                         : ((const struct sockaddr_in *)&a)->sin_port);
}

int ddp__socket_wait(int fd, short events, int64_t deadline_ns)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, ddp__ms_left(deadline_ns, 1000000000));
        if (n > 0) return 1;
        if (n == 0 && ddp__now_ns() >= deadline_ns) return 0;
        if (n < 0 && errno != EINTR) return -1;
    }
}

int ddp__socket_connect(const struct sockaddr *addr, socklen_t len, int64_t deadline_ns,
                        int *out_fd)
{
    int fd = ddp__socket_tcp(addr->sa_family);
    if (fd < 0) return errno;
    int err = 0;
    if (connect(fd, addr, len) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
            /* The handshake finishes in the background; its outcome is SO_ERROR. */
            int r = ddp__socket_wait(fd, POLLOUT, deadline_ns);
            socklen_t el = sizeof err;
            if (r == 1) {
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
            } else {
                err = r == 0 ? ETIMEDOUT : errno;
            }
        }
    }
    if (err != 0) {
        close(fd);
        return err;
    }
    *out_fd = fd;
    return 0;
}

int ddp__socket_accept(int listen_fd, struct sockaddr_storage *peer, socklen_t *peer_len)
{
    if (peer_len) *peer_len = sizeof *peer;
    return accept4(listen_fd, (struct sockaddr *)peer, peer ? peer_len : NULL,
                   SOCK_NONBLOCK | SOCK_CLOEXEC);
}

int ddp__socket_nodelay(int fd)
{
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int ddp__socket_nonblocking(int fd)
{
    int flags = fcntl(fd, F_GETFL, 0);
    if (flags < 0) return -1;
    return fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

ddp__socket_io_t ddp__socket_send_all(int fd, const void *data, size_t len, int64_t deadline_ns,
                                      int *err)
{
    const uint8_t *p = data;
    size_t done = 0;
    while (done < len) {
        ssize_t n = send(fd, p + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = ddp__socket_wait(fd, POLLOUT, deadline_ns);
            if (r == 0) return DDP__SOCKET_IO_TIMEOUT;
            if (r < 0) {
                if (err) *err = errno;
                return DDP__SOCKET_IO_POLL_ERROR;
            }
            continue;
        }
        if (err) *err = n < 0 ? errno : EPIPE;
        return DDP__SOCKET_IO_ERROR;
    }
    return DDP__SOCKET_IO_DONE;
}

ddp__socket_io_t ddp__socket_recv_all(int fd, void *data, size_t len, int64_t deadline_ns,
                                      size_t *got, int *err)
{
    uint8_t *p = data;
    size_t done = 0;
    ddp__socket_io_t result = DDP__SOCKET_IO_DONE;
    while (done < len) {
        ssize_t n = recv(fd, p + done, len - done, MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n == 0) {
            result = DDP__SOCKET_IO_CLOSED;
            break;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = ddp__socket_wait(fd, POLLIN, deadline_ns);
            if (r == 0) {
                result = DDP__SOCKET_IO_TIMEOUT;
                break;
            }
            if (r < 0) {
                if (err) *err = errno;
                result = DDP__SOCKET_IO_POLL_ERROR;
                break;
            }
            continue;
        }
        if (err) *err = errno;
        result = DDP__SOCKET_IO_ERROR;
        break;
    }
    if (got) *got = done;
    return result;
}
