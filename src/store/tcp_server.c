/* TCP store server: one background thread runs a poll() loop over non-blocking sockets. Each
 * connection has its own input and output buffers, so a slow, silent or hostile client never
 * blocks the loop; it must authenticate with the shared token first. get/wait on missing keys are
 * parked server-side and answered when a write makes them ready or their timeout passes, so
 * clients never poll. Anything malformed closes only that connection. Protocol:
 * docs/store-protocol.md. This file holds the connections (accept, read, evict) and the loop;
 * what a request does and the replies it sends are in tcp_server_requests.c, which calls nothing
 * here. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/socket.h"
#include "store/store_impl.h"
#include "store/tcp_frame.h"
#include "store/tcp_server.h"

#define MAX_CONNECTIONS 4096
/* A connection that has not authenticated within this time is closed. An honest client sends AUTH
 * right after connecting, so a few seconds is generous, and junk connections do not linger. */
#define AUTH_DEADLINE_MS 5000
/* At most this many unauthenticated connections are kept (fewer when the descriptor limit is low,
 * see unauthenticated_limit); beyond it the oldest is evicted for the newcomer. Each one costs at
 * most UNAUTH_BUFFER bytes of input plus its struct, so together they stay below 4.5 MiB. */
#define MAX_UNAUTHENTICATED 1024
/* Connections accepted per loop turn, so a flood of connects cannot keep the loop from serving
 * the connections it has. */
#define ACCEPT_BATCH 64
/* Bytes read from one connection per loop turn, so one fast sender cannot starve the others. */
#define READ_BUDGET (4u << 20)

/* ---- connections ------------------------------------------------------------------------- */

static void conn_free(struct conn *c)
{
    if (c->fd >= 0) close(c->fd);
    free(c->in);
    ddp__bytes_free(&c->out);
    ddp__store_request_free(&c->wait);
    free(c);
}


/* Reads the first frame of a connection that has not authenticated: the 4-byte header alone
 * first, which is checked against the 4101-byte limit at once, then exactly the frame it announces,
 * into a buffer of UNAUTH_BUFFER bytes. Nothing beyond that frame is read before the AUTH is
 * handled, so a connection that sends megabytes costs the server no more than one that sends the
 * AUTH it should. */
static void conn_read_unauthenticated(struct conn *c)
{
    if (!c->in) {
        c->in = malloc(UNAUTH_BUFFER);
        if (!c->in) {
            ddp__store_conn_close(c, "out of memory for the input buffer");
            return;
        }
        c->in_cap = UNAUTH_BUFFER;
    }
    while (!c->dead) {
        size_t want = DDP__STORE_FRAME_HEADER;
        if (c->in_len >= DDP__STORE_FRAME_HEADER) {
            size_t payload_len = 0;
            const char *why = NULL;
            int r = ddp__store_frame_split(c->in, c->in_len, DDP__STORE_MAX_AUTH_FRAME,
                                           &payload_len, &why);
            if (r == DDP__FRAME_BAD) {
                char text[160];
                snprintf(text, sizeof text, "%s (before authentication, limit %u bytes)", why,
                         DDP__STORE_MAX_AUTH_FRAME);
                ddp__store_conn_close(c, text);
                return;
            }
            if (r == DDP__FRAME_READY) return; /* process() handles it */
            want = DDP__STORE_FRAME_HEADER + ddp__load_u32(c->in);
        }
        ssize_t n = recv(c->fd, c->in + c->in_len, want - c->in_len, MSG_DONTWAIT);
        if (n > 0) {
            c->in_len += (size_t)n;
            continue;
        }
        if (n == 0) {
            ddp__store_conn_close(c, c->in_len > 0 ? "peer closed the connection in the middle of a frame"
                                        : NULL);
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) ddp__store_conn_close(c, strerror(errno));
        return;
    }
}

/* Reads what the socket of an authenticated connection has (up to READ_BUDGET). The buffer grows
 * only as bytes actually arrive, never to the size a length prefix merely claims. */
static void conn_read(struct conn *c)
{
    if (!c->authenticated) {
        conn_read_unauthenticated(c);
        return;
    }
    size_t budget = READ_BUDGET;
    while (!c->dead && budget > 0) {
        /* An honest client has at most one request in flight, so the buffer holds at most one
         * frame plus what one read turn brought in before process() consumed it. */
        if (c->in_len >= (size_t)DDP__STORE_MAX_FRAME + DDP__STORE_FRAME_HEADER + READ_BUDGET) {
            ddp__store_conn_close(c, "too much data buffered while a request is pending");
            return;
        }
        if (c->in_cap - c->in_len < 65536) {
            size_t cap = c->in_cap * 2 > 65536 ? c->in_cap * 2 : 65536;
            uint8_t *p = realloc(c->in, cap);
            if (!p) {
                ddp__store_conn_close(c, "out of memory for the input buffer");
                return;
            }
            c->in = p;
            c->in_cap = cap;
        }
        size_t room = c->in_cap - c->in_len;
        if (room > budget) room = budget;
        ssize_t n = recv(c->fd, c->in + c->in_len, room, MSG_DONTWAIT);
        if (n > 0) {
            c->in_len += (size_t)n;
            budget -= (size_t)n;
            continue;
        }
        if (n == 0) {
            if (c->in_len > 0 && !c->parked)
                ddp__store_conn_close(c, "peer closed the connection in the middle of a frame");
            else
                ddp__store_conn_close(c, NULL); /* an ordinary goodbye */
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) ddp__store_conn_close(c, strerror(errno));
        return;
    }
}

/* How many unauthenticated connections the server keeps: MAX_UNAUTHENTICATED, or a quarter of the
 * process's descriptor limit when that is lower, so that hostile connections can never take the
 * descriptors that authenticated clients and the rest of the process (a rank's own transport, for
 * one) need. Read once at start; at least 8 so a burst of honest ranks is not evicted early. */
static size_t unauthenticated_limit(void)
{
    struct rlimit rl;
    size_t limit = MAX_UNAUTHENTICATED;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur / 4 < limit)
        limit = (size_t)(rl.rlim_cur / 4);
    return limit < 8 ? 8 : limit;
}

/* Closes the oldest connection that has not authenticated yet, at once (its descriptor is needed
 * now, not at the end of the turn). Only connections accepted in an earlier turn are candidates
 * (indexes below `end`): every connection gets one turn to present its AUTH, which an honest
 * client has sent by then. The connection array is in accept order, so the first live
 * unauthenticated entry from *cursor on is the oldest; the cursor only moves forward within one
 * accept_all call, which keeps a flood linear. Returns 0 when there is none. */
static int evict_oldest_unauthenticated(struct ddp_store_server *srv, size_t *cursor, size_t end)
{
    for (; *cursor < end; (*cursor)++) {
        struct conn *c = srv->conns[*cursor];
        if (c->dead || c->authenticated) continue;
        close(c->fd);
        c->fd = -1;
        c->dead = 1;
        srv->evicted++;
        (*cursor)++;
        return 1;
    }
    return 0;
}

/* Accepts up to ACCEPT_BATCH waiting connections. A newcomer beyond the unauthenticated limit, or
 * beyond MAX_CONNECTIONS, first evicts the oldest unauthenticated connection: idle or trickling
 * connections then hold the server's slots only until newer ones arrive, and an honest client
 * (which authenticates right after connecting) is always among the newest. When accept fails for
 * lack of descriptors, the oldest unauthenticated connection is evicted and the accept retried.
 * When nothing can be evicted yet (the only unauthenticated connections arrived in this turn),
 * the rest wait in the listen queue for the next turn; when nothing can be evicted at all,
 * accepting pauses briefly, because the listener stays readable and polling it would spin. */
static void accept_all(struct ddp_store_server *srv)
{
    size_t live = 0, unauthenticated = 0, cursor = 0, evictable_end = srv->nconns;
    for (size_t i = 0; i < srv->nconns; i++) {
        if (srv->conns[i]->dead) continue;
        live++;
        unauthenticated += !srv->conns[i]->authenticated;
    }
    for (size_t accepted = 0; accepted < ACCEPT_BATCH;) {
        int full = unauthenticated >= srv->unauth_limit || live >= MAX_CONNECTIONS;
        if (full && evict_oldest_unauthenticated(srv, &cursor, evictable_end)) {
            live--;
            unauthenticated--;
            full = 0;
        }
        /* Full of connections that arrived in this turn: they get their turn first. */
        if (full && unauthenticated > 0) return;
        struct sockaddr_storage addr;
        socklen_t alen = sizeof addr;
        int fd = ddp__socket_accept(srv->listen_fd, &addr, &alen);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE) {
                if (evict_oldest_unauthenticated(srv, &cursor, evictable_end)) {
                    live--;
                    unauthenticated--;
                    continue;
                }
                if (unauthenticated > 0) return; /* evictable next turn */
            }
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* The pending connection stays queued and the listener stays readable: polling
                 * it now would spin. Serve the existing connections and try again shortly. */
                DDP_LOG(DDP_LOG_WARN, "TCP store server: accept: %s (pausing new connections)",
                        strerror(errno));
                srv->accept_paused_until_ns = ddp__now_ns() + 100 * 1000000LL;
            } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
                DDP_LOG(DDP_LOG_WARN, "TCP store server: accept: %s", strerror(errno));
            }
            return;
        }
        accepted++;
        if (full) {
            /* Every one of MAX_CONNECTIONS is authenticated: this client hears a close now rather
             * than waiting in the queue. */
            DDP_LOG(DDP_LOG_WARN,
                    "TCP store server: refusing a connection: %d authenticated ones open",
                    MAX_CONNECTIONS);
            close(fd);
            continue;
        }
        ddp__socket_nodelay(fd);
        struct conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->opened_ns = ddp__now_ns();
        char host[INET6_ADDRSTRLEN] = "?", serv[16] = "?";
        getnameinfo((struct sockaddr *)&addr, alen, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(c->peer, sizeof c->peer, "%s:%s", host, serv);
        if (srv->nconns == srv->conns_cap) {
            size_t cap = srv->conns_cap ? srv->conns_cap * 2 : 16;
            struct conn **p = realloc(srv->conns, cap * sizeof *p);
            if (!p) {
                conn_free(c);
                continue;
            }
            srv->conns = p;
            srv->conns_cap = cap;
        }
        srv->conns[srv->nconns++] = c;
        live++;
        unauthenticated++;
        DDP_LOG(DDP_LOG_DEBUG, "TCP store server: connection from %s", c->peer);
    }
}

/* Closes and removes the connections marked dead. */
static void reap(struct ddp_store_server *srv)
{
    size_t kept = 0;
    for (size_t i = 0; i < srv->nconns; i++) {
        if (srv->conns[i]->dead) conn_free(srv->conns[i]);
        else srv->conns[kept++] = srv->conns[i];
    }
    srv->nconns = kept;
}

static void *serve(void *arg)
{
    struct ddp_store_server *srv = arg;
    struct pollfd *fds = NULL;
    size_t fds_cap = 0;
    for (;;) {
        size_t want = srv->nconns + 2;
        if (want > fds_cap) {
            struct pollfd *p = realloc(fds, want * sizeof *p);
            if (!p) {
                DDP_LOG(DDP_LOG_ERROR, "TCP store server: out of memory for poll set");
                ddp__sleep_us(10000);
                continue;
            }
            fds = p;
            fds_cap = want;
        }
        fds[0] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
        int64_t now = ddp__now_ns();
        int64_t next = now + 1000 * 1000000LL; /* wake at least once a second */
        int accepting = now >= srv->accept_paused_until_ns;
        fds[1] = (struct pollfd){.fd = srv->listen_fd, .events = accepting ? POLLIN : 0};
        if (!accepting && srv->accept_paused_until_ns < next) next = srv->accept_paused_until_ns;
        for (size_t i = 0; i < srv->nconns; i++) {
            struct conn *c = srv->conns[i];
            short ev = POLLIN;
            if (c->out.len > c->out_sent) ev |= POLLOUT;
            fds[i + 2] = (struct pollfd){.fd = c->fd, .events = ev};
            if (c->parked && c->wait_deadline_ns < next) next = c->wait_deadline_ns;
        }
        int timeout = next <= now ? 0 : (int)((next - now) / 1000000) + 1;
        int n = poll(fds, srv->nconns + 2, timeout);
        if (n < 0 && errno != EINTR) {
            DDP_LOG(DDP_LOG_ERROR, "TCP store server: poll: %s", strerror(errno));
            ddp__sleep_us(10000);
        }
        if (n > 0 && (fds[0].revents & POLLIN)) break;
        size_t polled = srv->nconns;
        for (size_t i = 0; n > 0 && i < polled; i++) {
            struct conn *c = srv->conns[i];
            short re = fds[i + 2].revents;
            if (re & POLLOUT) ddp__store_conn_flush(c);
            if (re & (POLLIN | POLLHUP | POLLERR)) conn_read(c);
        }
        /* Requests: also for connections whose earlier reply or wait held buffered frames back. */
        for (size_t i = 0; i < srv->nconns; i++) ddp__store_server_process(srv, srv->conns[i]);
        now = ddp__now_ns();
        for (size_t i = 0; i < srv->nconns; i++) {
            struct conn *c = srv->conns[i];
            if (c->dead) continue;
            if (c->parked && c->wait_deadline_ns <= now) {
                ddp__store_server_time_out_waiter(srv, c);
                ddp__store_server_process(srv, c);
            }
            if (!c->authenticated && now - c->opened_ns > (int64_t)AUTH_DEADLINE_MS * 1000000)
                ddp__store_conn_close(c, "did not authenticate in time");
        }
        if (n > 0 && (fds[1].revents & POLLIN)) accept_all(srv);
        /* One line a second at most: a flood would otherwise write one per connection. */
        if (srv->evicted > 0 && now - srv->evictions_logged_ns >= 1000 * 1000000LL) {
            DDP_LOG(DDP_LOG_WARN,
                    "TCP store server: evicted %llu unauthenticated connection%s to make room "
                    "for newer ones (a connection flood?)",
                    (unsigned long long)srv->evicted, srv->evicted == 1 ? "" : "s");
            srv->evicted = 0;
            srv->evictions_logged_ns = now;
        }
        reap(srv);
    }
    free(fds);
    return NULL;
}

/* ---- public ------------------------------------------------------------------------------ */

ddp_status_t ddp_store_server_start(const char *bind_addr, int port, const char *token,
                                    ddp_store_server_t **out)
{
    static const char fn[] = "ddp_store_server_start";
    if (port < 0 || port > 65535)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: port %d is not in 0..65535", fn, port);
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (token && strlen(token) > DDP__STORE_MAX_TOKEN)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: token is longer than %u bytes", fn,
                          DDP__STORE_MAX_TOKEN);
    if (!bind_addr || !*bind_addr) bind_addr = "127.0.0.1";
    ddp__clear_error();

    ddp_status_t s = DDP_ERR_NO_MEMORY;
    struct ddp_store_server *srv = ddp__calloc(1, sizeof *srv, "TCP store server");
    if (!srv) return s;
    srv->listen_fd = -1;
    srv->wake[0] = srv->wake[1] = -1;
    srv->unauth_limit = unauthenticated_limit();
    if (token && *token) {
        srv->token_len = strlen(token);
        srv->token = (uint8_t *)ddp__strdup(token, "store token");
        if (!srv->token) goto free_srv;
    }
    s = ddp__kv_init(&srv->table);
    if (s != DDP_OK) goto free_token;

    struct addrinfo *res = NULL;
    int gai = ddp__socket_resolve(bind_addr, port, AI_PASSIVE, &res);
    if (gai != 0) {
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bind_addr '%s': %s", fn, bind_addr,
                       gai_strerror(gai));
        goto free_table;
    }
    int err = 0;
    for (struct addrinfo *ai = res; ai && srv->listen_fd < 0; ai = ai->ai_next)
        err = ddp__socket_listen(ai->ai_addr, ai->ai_addrlen, 1024, 1, &srv->listen_fd);
    freeaddrinfo(res);
    if (srv->listen_fd < 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, err, "%s: cannot listen on %s:%d", fn, bind_addr,
                             port);
        goto free_table;
    }
    srv->port = ddp__socket_local_port(srv->listen_fd, NULL);
    if (srv->port < 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "%s: getsockname", fn);
        goto close_listen;
    }
    if (pipe2(srv->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "%s: pipe", fn);
        goto close_listen;
    }
    int rc = pthread_create(&srv->thread, NULL, serve, srv);
    if (rc != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, rc, "%s: starting the server thread", fn);
        goto close_pipe;
    }
    DDP_LOG(DDP_LOG_INFO, "TCP store server listening on %s:%d", bind_addr, srv->port);
    *out = srv;
    return DDP_OK;

close_pipe:
    close(srv->wake[0]);
    close(srv->wake[1]);
close_listen:
    close(srv->listen_fd);
free_table:
    ddp__kv_free(&srv->table);
free_token:
    free(srv->token);
free_srv:
    free(srv);
    return s;
}

int ddp_store_server_port(const ddp_store_server_t *server)
{
    if (!server) {
        ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_server_port: server is NULL");
        return -1;
    }
    return server->port;
}

void ddp_store_server_stop(ddp_store_server_t *server)
{
    if (!server) return;
    char byte = 1;
    while (write(server->wake[1], &byte, 1) < 0 && errno == EINTR) {
    }
    pthread_join(server->thread, NULL);
    for (size_t i = 0; i < server->nconns; i++) conn_free(server->conns[i]);
    free(server->conns);
    close(server->wake[0]);
    close(server->wake[1]);
    close(server->listen_fd);
    ddp__kv_free(&server->table);
    free(server->token);
    free(server);
}

/* ---- replay (tests/fuzz/fuzz_store_server.c) --------------------------------------------------
 * The server's own connection handling - conn_read (the pre-authentication reader included),
 * process, handle, the waiters - run on connections whose peers are the given byte streams,
 * over socket pairs instead of accepted sockets and without the server thread, so that a fuzz
 * target drives exactly what a hostile client reaches. */
ddp_status_t ddp__store_server_replay(const uint8_t *const *streams, const size_t *lens,
                                      size_t nstreams, const char *token, size_t *replied)
{
    enum { MAX_STREAMS = 8 };
    if (nstreams > MAX_STREAMS)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "store replay: at most %d streams",
                          MAX_STREAMS);
    struct ddp_store_server *srv = ddp__calloc(1, sizeof *srv, "store replay");
    if (!srv) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp__kv_init(&srv->table);
    int peers[MAX_STREAMS];
    size_t sent[MAX_STREAMS] = {0};
    size_t nstarted = 0;
    if (s != DDP_OK) goto free_srv;
    if (token && *token) {
        srv->token = (uint8_t *)token; /* borrowed: not freed below */
        srv->token_len = strlen(token);
    }
    srv->conns = ddp__calloc(MAX_STREAMS, sizeof *srv->conns, "store replay");
    if (!srv->conns) {
        s = DDP_ERR_NO_MEMORY;
        goto free_table;
    }
    srv->conns_cap = MAX_STREAMS;
    for (; nstarted < nstreams; nstarted++) {
        int sv[2];
        struct conn *c = calloc(1, sizeof *c);
        if (!c || socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) {
            free(c);
            s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "store replay: socketpair");
            goto free_conns;
        }
        c->fd = sv[0];
        c->opened_ns = ddp__now_ns();
        snprintf(c->peer, sizeof c->peer, "replay stream %zu", nstarted);
        srv->conns[srv->nconns++] = c;
        peers[nstarted] = sv[1];
    }
    /* Each turn: the peers send what fits and read what came back; then one turn of serve()'s
     * loop for every connection. A connection ends when its peer has sent everything and the
     * server saw the end, so the number of turns is bounded by the bytes; the bound below is
     * only a net under a bug (a connection that never ends is a hang the caller reports). */
    size_t total = 0;
    for (size_t i = 0; i < nstreams; i++) total += lens[i];
    size_t max_turns = 64 + 4 * total;
    size_t turns = 0;
    for (; srv->nconns > 0 && turns < max_turns; turns++) {
        for (size_t i = 0; i < nstarted; i++) {
            if (peers[i] < 0) continue;
            if (sent[i] < lens[i]) {
                ssize_t n = send(peers[i], streams[i] + sent[i], lens[i] - sent[i],
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n > 0) sent[i] += (size_t)n;
                if (sent[i] == lens[i]) shutdown(peers[i], SHUT_WR);
            } else if (turns == 0) {
                shutdown(peers[i], SHUT_WR); /* an empty stream: the client only connects */
            }
            uint8_t sink[4096];
            ssize_t n;
            while ((n = recv(peers[i], sink, sizeof sink, MSG_DONTWAIT)) > 0)
                if (replied) replied[i] += (size_t)n;
        }
        for (size_t i = 0; i < srv->nconns; i++) {
            ddp__store_conn_flush(srv->conns[i]);
            conn_read(srv->conns[i]);
        }
        for (size_t i = 0; i < srv->nconns; i++) ddp__store_server_process(srv, srv->conns[i]);
        int64_t now = ddp__now_ns();
        for (size_t i = 0; i < srv->nconns; i++) {
            struct conn *c = srv->conns[i];
            if (!c->dead && c->parked && c->wait_deadline_ns <= now) {
                ddp__store_server_time_out_waiter(srv, c);
                ddp__store_server_process(srv, c);
            }
        }
        reap(srv);
    }
    if (srv->nconns > 0)
        s = ddp__error(DDP_ERR_TIMEOUT, "store replay: %zu connection(s) still open after %zu "
                       "turns", srv->nconns, turns);
free_conns:
    for (size_t i = 0; i < srv->nconns; i++) conn_free(srv->conns[i]);
    for (size_t i = 0; i < nstarted; i++) close(peers[i]);
    free(srv->conns);
free_table:
    ddp__kv_free(&srv->table);
free_srv:
    free(srv);
    return s;
}
