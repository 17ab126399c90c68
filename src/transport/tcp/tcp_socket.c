/* TCP transport rendezvous: choose the address to listen on, publish it through the store, and
 * build one authenticated connection per pair of ranks (the lower rank connects to the higher).
 * A connection that does not present the job's token, the group name and consistent ranks is
 * closed without an answer while the rendezvous goes on (like the store server's own check). */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/socket.h"
#include "transport/tcp/tcp.h"

static int remaining_ms(int64_t deadline_ns) { return ddp__ms_left(deadline_ns, 1000000); }

/* ---- choosing the address ----------------------------------------------------------------
 * DDP_SOCKET_IFNAME names the interface explicitly (first IPv4 address, else IPv6). Without it
 * we ask the kernel which source address it would use to reach the store's host
 * (ddp__rendezvous_host: the store the ranks met through, else DDP_STORE_ADDR, else MASTER_ADDR;
 * a connected UDP socket sends nothing): on a multi-homed host that is the interface facing the
 * other hosts, which is what peers can reach. Without one the job is single-host: 127.0.0.1. */
static ddp_status_t address_of_interface(const char *ifname, struct sockaddr_storage *out,
                                         socklen_t *len)
{
    struct ifaddrs *list = NULL;
    if (getifaddrs(&list) != 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "DDP_SOCKET_IFNAME=%s: getifaddrs", ifname);
    int found = 0;
    for (int want = AF_INET; want != 0 && !found; want = want == AF_INET ? AF_INET6 : 0) {
        for (struct ifaddrs *a = list; a; a = a->ifa_next) {
            if (!a->ifa_addr || strcmp(a->ifa_name, ifname) != 0) continue;
            if (a->ifa_addr->sa_family != want) continue;
            if (want == AF_INET6) {
                const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)a->ifa_addr;
                if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) continue;
            }
            *len = want == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
            memcpy(out, a->ifa_addr, *len);
            found = 1;
            break;
        }
    }
    freeifaddrs(list);
    if (!found)
        return ddp__error(DDP_ERR_NOT_FOUND,
                          "DDP_SOCKET_IFNAME=%s: no such interface with an IPv4 or global IPv6 "
                          "address",
                          ifname);
    return DDP_OK;
}

static ddp_status_t address_towards(const char *host, const char *port,
                                    struct sockaddr_storage *out, socklen_t *len)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0)
        return ddp__error(DDP_ERR_SYSTEM, "store host %s: cannot resolve: %s", host,
                          gai_strerror(rc));
    ddp_status_t status = ddp__error(DDP_ERR_SYSTEM, "store host %s: no route", host);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            *len = sizeof *out;
            if (getsockname(fd, (struct sockaddr *)out, len) == 0) {
                close(fd);
                status = DDP_OK;
                break;
            }
        }
        status = ddp__error_errno(DDP_ERR_SYSTEM, errno, "store host %s: no route", host);
        close(fd);
    }
    freeaddrinfo(res);
    return status;
}

ddp_status_t ddp__tcp_listen(int *listen_fd, char *published, size_t size)
{
    struct sockaddr_storage addr;
    socklen_t len = 0;
    ddp_status_t s;
    const char *ifname = ddp__env("DDP_SOCKET_IFNAME");
    const char *master = ddp__rendezvous_host();
    if (ifname) {
        s = address_of_interface(ifname, &addr, &len);
    } else if (master) {
        s = address_towards(master, "29500", &addr, &len); /* any port: nothing is sent */
    } else {
        s = address_towards("127.0.0.1", "29500", &addr, &len);
    }
    if (s != DDP_OK) return s;
    if (addr.ss_family == AF_INET) ((struct sockaddr_in *)&addr)->sin_port = 0;
    else ((struct sockaddr_in6 *)&addr)->sin6_port = 0;

    int fd = -1;
    int err = ddp__socket_listen((struct sockaddr *)&addr, len, 128, 0, &fd);
    if (err != 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "tcp transport: socket/bind/listen");
    if (ddp__socket_local_port(fd, &addr) < 0) {
        int e = errno;
        close(fd);
        return ddp__error_errno(DDP_ERR_SYSTEM, e, "tcp transport: getsockname");
    }
    char host[INET6_ADDRSTRLEN];
    int port;
    if (addr.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&addr)->sin_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in *)&addr)->sin_port);
    } else {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&addr)->sin6_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in6 *)&addr)->sin6_port);
    }
    snprintf(published, size, "%s %d", host, port);
    *listen_fd = fd;
    return DDP_OK;
}

/* ---- blocking-with-deadline byte transfers used only during the rendezvous ---------------- */
static ddp_status_t send_all(int fd, const void *buf, size_t bytes, int64_t deadline_ns,
                             int peer)
{
    int err = 0;
    switch (ddp__socket_send_all(fd, buf, bytes, deadline_ns, &err)) {
    case DDP__SOCKET_IO_DONE:
        return DDP_OK;
    case DDP__SOCKET_IO_TIMEOUT:
        return ddp__error(DDP_ERR_TIMEOUT,
                          "tcp rendezvous: timed out sending the hello to rank %d", peer);
    case DDP__SOCKET_IO_POLL_ERROR:
        return ddp__error_errno(DDP_ERR_SYSTEM, err,
                                "tcp rendezvous: poll while sending the hello to rank %d", peer);
    default:
        return ddp__error_errno(DDP_ERR_REMOTE, err,
                                "tcp rendezvous: sending the hello to rank %d", peer);
    }
}

/* Connects (non-blocking, retrying while refused) to "host port" before the deadline. */
static ddp_status_t connect_to(const char *published, int peer, int64_t deadline_ns, int *out)
{
    char host[INET6_ADDRSTRLEN + 1], port[16];
    if (sscanf(published, "%46s %15s", host, port) != 2)
        return ddp__error(DDP_ERR_PROTOCOL, "tcp rendezvous: rank %d published a malformed "
                          "address '%s'", peer, published);
    char *end = NULL;
    long portnum = strtol(port, &end, 10);
    if (*end != '\0' || portnum < 0 || portnum > 65535)
        return ddp__error(DDP_ERR_PROTOCOL, "tcp rendezvous: rank %d published '%s': bad port",
                          peer, published);
    struct addrinfo *res = NULL;
    int rc = ddp__socket_resolve(host, (int)portnum, AI_NUMERICHOST, &res);
    if (rc != 0)
        return ddp__error(DDP_ERR_PROTOCOL, "tcp rendezvous: rank %d published '%s': %s", peer,
                          published, gai_strerror(rc));
    int delay_ms = 5;
    int last_errno = 0;
    for (;;) {
        int fd = -1;
        last_errno = ddp__socket_connect(res->ai_addr, res->ai_addrlen, deadline_ns, &fd);
        if (last_errno == 0) {
            freeaddrinfo(res);
            *out = fd;
            return DDP_OK;
        }
        /* Refused while the peer is not listening yet: retry with backoff until the deadline.
         * Out of descriptors or memory for a socket: no point in waiting, fail now. */
        if (last_errno == EMFILE || last_errno == ENFILE || last_errno == ENOBUFS ||
            last_errno == ENOMEM || last_errno == EAFNOSUPPORT)
            break;
        if (remaining_ms(deadline_ns) == 0) break;
        ddp__sleep_us((int64_t)delay_ms * 1000);
        if (delay_ms < 200) delay_ms *= 2;
    }
    freeaddrinfo(res);
    if (remaining_ms(deadline_ns) == 0)
        return ddp__error(DDP_ERR_TIMEOUT, "tcp rendezvous: timed out connecting to rank %d at "
                          "%s (%s)", peer, published, strerror(last_errno));
    return ddp__error_errno(DDP_ERR_SYSTEM, last_errno, "tcp rendezvous: connecting to rank %d",
                            peer);
}

/* ---- the acceptor's side ---------------------------------------------------------------- */
typedef struct pending {
    int fd;
    size_t have;
    char buf[DDP_TCP_MAX_HELLO];
} pending_t;

#define MAX_PENDING 64

static int constant_time_equal(const char *a, size_t alen, const char *b, size_t blen)
{
    unsigned char diff = (unsigned char)(alen != blen);
    size_t n = alen < blen ? alen : blen;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(a[i] ^ b[i]);
    return diff == 0;
}

size_t ddp__tcp_hello_encode(char *buf, int rank, int peer, int world, const char *token,
                             const char *group)
{
    size_t token_len = strlen(token), group_len = strlen(group);
    ddp__tcp_hello_t h = {DDP_TCP_HELLO_MAGIC, DDP_TCP_VERSION, rank, peer, world,
                          (uint32_t)token_len, (uint32_t)group_len, 0};
    memcpy(buf, &h, sizeof h);
    memcpy(buf + sizeof h, token, token_len);
    memcpy(buf + sizeof h + token_len, group, group_len);
    return sizeof h + token_len + group_len;
}

int ddp__tcp_hello_check(const char *buf, size_t have, const char *token, const char *group,
                         int rank, int world, const ddp__tcp_conn_t *conns, size_t *need,
                         int *from, const char **why)
{
    *need = sizeof(ddp__tcp_hello_t);
    if (have < *need) return 0;
    ddp__tcp_hello_t h;
    memcpy(&h, buf, sizeof h);
    if (h.magic != DDP_TCP_HELLO_MAGIC || h.version != DDP_TCP_VERSION) {
        *why = "not a libddp hello (garbage or another version)";
        return -1;
    }
    if (h.token_len > DDP_TCP_MAX_TOKEN || h.group_len > DDP_TCP_MAX_GROUP) {
        *why = "oversized hello";
        return -1;
    }
    *need += h.token_len + h.group_len;
    if (have < *need) return 0;
    const char *t = buf + sizeof h;
    const char *g = t + h.token_len;
    if (!constant_time_equal(t, h.token_len, token, strlen(token))) {
        *why = "wrong or missing token";
        return -1;
    }
    if (h.group_len != strlen(group) || memcmp(g, group, h.group_len) != 0) {
        *why = "another group";
        return -1;
    }
    if (h.to_rank != rank || h.world != world || h.from_rank < 0 || h.from_rank >= rank) {
        *why = "inconsistent ranks";
        return -1;
    }
    if (conns[h.from_rank].fd >= 0) {
        *why = "a second connection from the same rank";
        return -1;
    }
    *from = h.from_rank;
    return 1;
}

/* Reads what the pending connection has sent. Returns 1 when a full hello arrived and it is
 * valid (*from set), 0 while incomplete, -1 when it must be closed (reason in *why). Never reads
 * past the hello it checks (ddp__tcp_hello_check says how many bytes it needs), so the buffer of
 * the largest hello is enough. */
static int pending_step(pending_t *p, const char *token, const char *group, int rank, int world,
                        const ddp__tcp_conn_t *conns, int *from, const char **why)
{
    for (;;) {
        size_t need = 0;
        int r = ddp__tcp_hello_check(p->buf, p->have, token, group, rank, world, conns, &need,
                                     from, why);
        if (r != 0) return r;
        ssize_t n = recv(p->fd, p->buf + p->have, need - p->have, 0);
        if (n > 0) {
            p->have += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
        *why = "closed before completing the hello";
        return -1;
    }
}

/* One rank's side of the rendezvous of the pair connections (ddp__tcp_connect_all). */
typedef struct rendezvous {
    ddp_store_t *store;
    const char *group_name, *token;
    int rank, world, listen_fd;
    int64_t deadline;
    ddp__tcp_conn_t *conns;
} rendezvous_t;

/* Step 1: connects to every higher rank and sends the hello; does not wait for the answers, so
 * that no rank waits on another that is itself waiting (the acks are read in step 3). */
static ddp_status_t connect_higher(const rendezvous_t *rv)
{
    char key[DDP_STORE_MAX_KEY];
    for (int peer = rv->rank + 1; peer < rv->world; peer++) {
        snprintf(key, sizeof key, "%s/tcp/addr/%d", rv->group_name, peer);
        const char *keys[1] = {key};
        int ms = remaining_ms(rv->deadline);
        ddp_status_t s = ddp_store_wait(rv->store, keys, 1, ms > 0 ? ms : 1);
        if (s != DDP_OK)
            return ddp__error_context(s, "tcp rendezvous: waiting for the address of rank %d",
                                      peer);
        void *value = NULL;
        size_t vlen = 0;
        s = ddp_store_get(rv->store, key, &value, &vlen);
        if (s != DDP_OK)
            return ddp__error_context(s, "tcp rendezvous: reading the address of rank %d", peer);
        int fd = -1;
        s = connect_to(value, peer, rv->deadline, &fd);
        ddp_free(value);
        if (s != DDP_OK) return s;
        rv->conns[peer].fd = fd;
        char hello[DDP_TCP_MAX_HELLO];
        size_t hello_len =
            ddp__tcp_hello_encode(hello, rv->rank, peer, rv->world, rv->token, rv->group_name);
        s = send_all(fd, hello, hello_len, rv->deadline, peer);
        if (s != DDP_OK) return s;
    }
    return DDP_OK;
}

/* The timeout of step 2: names the lower ranks that did not connect. */
static ddp_status_t accept_timed_out(const rendezvous_t *rv)
{
    char missing[512] = "";
    size_t used = 0;
    for (int r = 0; r < rv->rank && used + 16 < sizeof missing; r++)
        if (rv->conns[r].fd < 0)
            used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%d",
                                     used ? ", " : "", r);
    return ddp__error(DDP_ERR_TIMEOUT, "tcp rendezvous of group '%s': rank %d timed out "
                      "waiting for connections from rank(s) %s", rv->group_name, rv->rank,
                      missing);
}

/* Step 2, one poll's worth of readable pending connections: a complete, right hello is
 * acknowledged and becomes its rank's connection (counted in *accepted); a wrong one is dropped. */
static void read_hellos(const rendezvous_t *rv, const struct pollfd *pfds, pending_t *pend,
                        int *npend, int *accepted)
{
    for (int i = *npend - 1; i >= 0; i--) {
        if (!pfds[i + 1].revents) continue;
        int from = -1;
        const char *why = NULL;
        int r = pending_step(&pend[i], rv->token, rv->group_name, rv->rank, rv->world, rv->conns,
                             &from, &why);
        if (r == 0) continue;
        if (r > 0) {
            uint32_t ack[2] = {DDP_TCP_ACK_MAGIC, 0};
            /* 8 bytes into a fresh socket's empty buffer cannot block. */
            if (send(pend[i].fd, ack, sizeof ack, MSG_NOSIGNAL) != (ssize_t)sizeof ack) {
                why = "could not send the acknowledgement";
                r = -1;
            } else {
                rv->conns[from].fd = pend[i].fd;
                (*accepted)++;
            }
        }
        if (r < 0) {
            DDP_LOG(DDP_LOG_WARN, "tcp rendezvous of group '%s' (rank %d): refused a "
                    "connection: %s", rv->group_name, rv->rank, why);
            close(pend[i].fd);
        }
        pend[i] = pend[*npend - 1];
        (*npend)--;
    }
}

/* Step 2, the listening socket readable: every new connection joins the pending ones (too many
 * strangers at once: the oldest is dropped). */
static void take_new_connections(int listen_fd, pending_t *pend, int *npend)
{
    for (;;) {
        int fd = ddp__socket_accept(listen_fd, NULL, NULL);
        if (fd < 0) break;
        if (*npend == MAX_PENDING) {
            close(pend[0].fd);
            pend[0] = pend[*npend - 1];
            (*npend)--;
        }
        pend[*npend].fd = fd;
        pend[*npend].have = 0;
        (*npend)++;
    }
}

/* Step 2: accepts from every lower rank; strangers are read without blocking the others and
 * dropped as soon as their hello proves wrong. */
static ddp_status_t accept_lower(const rendezvous_t *rv)
{
    pending_t *pend = calloc(MAX_PENDING, sizeof *pend);
    if (!pend) return ddp__error(DDP_ERR_NO_MEMORY, "tcp rendezvous: pending connections");
    ddp_status_t s = DDP_OK;
    int npend = 0, accepted = 0;
    while (accepted < rv->rank) {
        struct pollfd pfds[MAX_PENDING + 1];
        pfds[0].fd = rv->listen_fd;
        pfds[0].events = POLLIN;
        for (int i = 0; i < npend; i++) {
            pfds[i + 1].fd = pend[i].fd;
            pfds[i + 1].events = POLLIN;
        }
        int ms = remaining_ms(rv->deadline);
        if (ms == 0) {
            s = accept_timed_out(rv);
            break;
        }
        int ready = poll(pfds, (nfds_t)npend + 1, ms > 200 ? 200 : ms);
        if (ready < 0 && errno != EINTR) {
            s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "tcp rendezvous: poll");
            break;
        }
        if (ready <= 0) continue;
        read_hellos(rv, pfds, pend, &npend, &accepted);
        if (pfds[0].revents) take_new_connections(rv->listen_fd, pend, &npend);
    }
    for (int i = 0; i < npend; i++) close(pend[i].fd);
    free(pend);
    return s;
}

/* Step 3: the acknowledgements from the higher ranks; a refusal shows as a closed connection. */
static ddp_status_t read_acks(const rendezvous_t *rv)
{
    for (int peer = rv->rank + 1; peer < rv->world; peer++) {
        uint32_t ack[2];
        int err = 0;
        ddp__socket_io_t r = ddp__socket_recv_all(rv->conns[peer].fd, ack, sizeof ack,
                                                  rv->deadline, NULL, &err);
        if (r == DDP__SOCKET_IO_TIMEOUT)
            return ddp__error(DDP_ERR_TIMEOUT, "tcp rendezvous of group '%s': rank %d "
                              "timed out waiting for rank %d to accept its connection",
                              rv->group_name, rv->rank, peer);
        if (r == DDP__SOCKET_IO_POLL_ERROR)
            return ddp__error_errno(DDP_ERR_SYSTEM, err, "tcp rendezvous: poll");
        if (r != DDP__SOCKET_IO_DONE)
            return ddp__error(DDP_ERR_REMOTE, "tcp rendezvous of group '%s': rank %d refused the "
                              "connection of rank %d (different DDP_STORE_TOKEN, group or world "
                              "size?)", rv->group_name, peer, rv->rank);
        if (ack[0] != DDP_TCP_ACK_MAGIC)
            return ddp__error(DDP_ERR_PROTOCOL, "tcp rendezvous: rank %d sent a malformed "
                              "acknowledgement", peer);
    }
    return DDP_OK;
}

ddp_status_t ddp__tcp_connect_all(ddp_store_t *store, const char *group_name, int rank,
                                  int world, int listen_fd, int timeout_ms,
                                  ddp__tcp_conn_t *conns)
{
    int64_t deadline = ddp__now_ns() + (int64_t)timeout_ms * 1000000LL;
    const char *token = ddp__env("DDP_STORE_TOKEN");
    if (!token) token = "";
    size_t token_len = strlen(token), group_len = strlen(group_name);
    if (token_len > DDP_TCP_MAX_TOKEN)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_TOKEN is longer than %u bytes",
                          DDP_TCP_MAX_TOKEN);
    if (group_len > DDP_TCP_MAX_GROUP)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_name is longer than %u bytes",
                          DDP_TCP_MAX_GROUP);
    rendezvous_t rv = {store, group_name, token, rank, world, listen_fd, deadline, conns};
    ddp_status_t s = connect_higher(&rv);
    if (s == DDP_OK) s = accept_lower(&rv);
    if (s == DDP_OK) s = read_acks(&rv);
    if (s != DDP_OK) {
        for (int peer = 0; peer < world; peer++) {
            if (conns[peer].fd >= 0) close(conns[peer].fd);
            conns[peer].fd = -1;
        }
        return s;
    }
    for (int peer = 0; peer < world; peer++) {
        if (peer == rank) continue;
        ddp__socket_nodelay(conns[peer].fd);
        ddp__socket_nonblocking(conns[peer].fd);
    }
    return DDP_OK;
}
