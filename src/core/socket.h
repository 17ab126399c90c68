/* Socket setup and blocking-with-deadline transfers shared by the TCP store's server and clients
 * and the TCP transport: resolving, listening, connecting before a deadline, accepting, sending
 * and receiving whole buffers before a deadline, and the options every libddp TCP socket
 * carries (non-blocking, close-on-exec, TCP_NODELAY). Errors come back as errno values or
 * getaddrinfo codes, not as ddp_status_t: each caller words the message for its own context
 * ("TCP store: ...", "tcp rendezvous: ...") and tests match those texts. */
#ifndef DDP_CORE_SOCKET_H
#define DDP_CORE_SOCKET_H

#include <netdb.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* getaddrinfo for a TCP stream to or on `host`:`port` (AF_UNSPEC, AI_NUMERICSERV plus
 * `ai_flags`, e.g. AI_PASSIVE or AI_NUMERICHOST). Returns getaddrinfo's code (0 on success);
 * free *out with freeaddrinfo. */
int ddp__socket_resolve(const char *host, int port, int ai_flags, struct addrinfo **out);

/* A new TCP socket of `family`, non-blocking and close-on-exec; -1 with errno on failure. */
int ddp__socket_tcp(int family);

/* A non-blocking, close-on-exec socket bound to `addr` and listening with `backlog`
 * (SO_REUSEADDR first when `reuse_addr`). Returns 0 and *out_fd, or an errno value. */
int ddp__socket_listen(const struct sockaddr *addr, socklen_t len, int backlog, int reuse_addr,
                       int *out_fd);

/* The port a bound socket has (after port 0 was asked for), the address in *addr if not NULL;
 * -1 with errno on failure. */
int ddp__socket_local_port(int fd, struct sockaddr_storage *addr);

/* Connects a new non-blocking, close-on-exec socket to `addr`, waiting for the handshake at most
 * until `deadline_ns` (ddp__now_ns clock). Returns 0 and *out_fd, or an errno value (ETIMEDOUT
 * when the deadline passed first, ECONNREFUSED while nobody listens yet, ...). One attempt:
 * callers retry as their protocol wants. */
int ddp__socket_connect(const struct sockaddr *addr, socklen_t len, int64_t deadline_ns,
                        int *out_fd);

/* accept4: the new connection is non-blocking and close-on-exec, its peer's address in *peer
 * (*peer_len bytes) when peer is not NULL; -1 with errno. */
int ddp__socket_accept(int listen_fd, struct sockaddr_storage *peer, socklen_t *peer_len);

/* Option helpers; they return setsockopt's / fcntl's result. */
int ddp__socket_nodelay(int fd);
int ddp__socket_nonblocking(int fd);

/* Polls fd for `events` until the deadline, retrying on EINTR. Returns 1 ready, 0 when the
 * deadline passed, -1 on a poll error (errno). */
int ddp__socket_wait(int fd, short events, int64_t deadline_ns);

/* How a whole-buffer transfer ended. The caller turns all but DONE into its own message and
 * status (a store client says "TCP store host:port: ...", the transport "tcp rendezvous: ..."). */
typedef enum {
    DDP__SOCKET_IO_DONE = 0,   /* every byte moved */
    DDP__SOCKET_IO_TIMEOUT,    /* the deadline passed first */
    DDP__SOCKET_IO_CLOSED,     /* recv: the peer closed the connection (read 0) */
    DDP__SOCKET_IO_POLL_ERROR, /* poll failed (errno in *err) */
    DDP__SOCKET_IO_ERROR       /* send/recv failed (errno in *err; EPIPE for a send of 0) */
} ddp__socket_io_t;

/* Sends `len` bytes of `data` on the non-blocking socket fd, waiting in poll whenever the socket
 * is full, until the deadline (ddp__now_ns clock). MSG_NOSIGNAL: a closed peer is an error, never
 * SIGPIPE. On POLL_ERROR and ERROR, *err holds the errno value (err may be NULL). */
ddp__socket_io_t ddp__socket_send_all(int fd, const void *data, size_t len, int64_t deadline_ns,
                                      int *err);

/* Receives exactly `len` bytes into data, as ddp__socket_send_all sends. *got (may be NULL) is
 * how many bytes arrived before it returned, so a caller can tell "closed before the first byte"
 * (a server's refusal) from "closed mid-message". */
ddp__socket_io_t ddp__socket_recv_all(int fd, void *data, size_t len, int64_t deadline_ns,
                                      size_t *got, int *err);

#endif
