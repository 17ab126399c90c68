/* TCP store client: each request is one frame on an authenticated connection and one reply frame
 * back. A handle keeps a small pool of connections so threads sharing it do not queue behind one
 * another's blocking get/wait (each in-flight call uses its own connection). Every socket call is
 * bounded by a deadline through poll(). */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/socket.h"
#include "store/store_impl.h"
#include "store/c10d.h"
#include "store/conn_pool.h"
#include "store/tcp_frame.h"

/* Extra time a client gives the server to answer a get/wait after the wait's own timeout, before
 * it concludes the server is gone. */
#define REPLY_GRACE_MS 2000
/* How long the first AUTH of a connect waits for its reply before the client asks whether the
 * server speaks another protocol (a c10d TCPStore waits for more bytes and never answers). */
#define AUTH_PATIENCE_MS 2000

struct tcp_client {
    ddp__conn_pool_t pool;
    char *host;
    int port;
    char *token;
};

static struct tcp_client *impl_of(ddp_store_t *store) { return store->impl; }

static int ms_left(int64_t deadline_ns) { return ddp__ms_left(deadline_ns, 1000000000); }

/* The socket helpers' outcome as this client words it. */
static ddp_status_t io_status(struct tcp_client *tc, ddp__socket_io_t r, int err, int sending)
{
    switch (r) {
    case DDP__SOCKET_IO_DONE:
        return DDP_OK;
    case DDP__SOCKET_IO_TIMEOUT:
        return ddp__error(DDP_ERR_TIMEOUT, "TCP store %s:%d: timed out %s", tc->host, tc->port,
                          sending ? "sending a request" : "waiting for the server's reply");
    case DDP__SOCKET_IO_POLL_ERROR:
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "TCP store %s:%d: poll", tc->host, tc->port);
    case DDP__SOCKET_IO_CLOSED:
        return ddp__error(DDP_ERR_REMOTE,
                          "TCP store %s:%d: the server closed the connection (stopped, or it "
                          "rejected the request)",
                          tc->host, tc->port);
    case DDP__SOCKET_IO_ERROR:
        break;
    }
    if (sending)
        return ddp__error_errno(DDP_ERR_REMOTE, err,
                                "TCP store %s:%d: sending a request failed (server gone?)",
                                tc->host, tc->port);
    return ddp__error_errno(DDP_ERR_REMOTE, err, "TCP store %s:%d: receiving a reply", tc->host,
                            tc->port);
}

static ddp_status_t send_all(struct tcp_client *tc, int fd, const uint8_t *data, size_t len,
                             int64_t deadline_ns)
{
    int err = 0;
    return io_status(tc, ddp__socket_send_all(fd, data, len, deadline_ns, &err), err, 1);
}

static ddp_status_t recv_all(struct tcp_client *tc, int fd, uint8_t *data, size_t len,
                             int64_t deadline_ns)
{
    int err = 0;
    return io_status(tc, ddp__socket_recv_all(fd, data, len, deadline_ns, NULL, &err), err, 0);
}

/* Sends one request frame and reads the reply. On DDP_OK, *body (malloc'd, one spare byte at the
 * end for a NUL) holds the reply after its result byte. A server-side error reply comes back as
 * its status with the server's text. *in_sync = 1 when a whole reply was read, so the connection
 * can carry the next request. */
static ddp_status_t roundtrip(struct tcp_client *tc, int fd, const ddp__bytes_t *frame,
                              int64_t deadline_ns, uint8_t **body, size_t *body_len, int *in_sync)
{
    *in_sync = 0;
    ddp_status_t s = send_all(tc, fd, frame->data, frame->len, deadline_ns);
    if (s != DDP_OK) return s;
    uint8_t header[DDP__STORE_FRAME_HEADER];
    s = recv_all(tc, fd, header, sizeof header, deadline_ns);
    if (s != DDP_OK) return s;
    uint32_t n = ddp__load_u32(header);
    if (n == 0 || n > DDP__STORE_MAX_FRAME)
        return ddp__error(DDP_ERR_PROTOCOL, "TCP store %s:%d: reply with bad length %u", tc->host,
                          tc->port, n);
    uint8_t *payload = ddp__malloc((size_t)n + 1, "TCP store reply");
    if (!payload) return DDP_ERR_NO_MEMORY;
    s = recv_all(tc, fd, payload, n, deadline_ns);
    if (s != DDP_OK) goto free_payload;
    *in_sync = 1;
    if (payload[0] == DDP__STORE_REPLY_OK) {
        memmove(payload, payload + 1, n - 1);
        payload[n - 1] = 0;
        *body = payload;
        *body_len = n - 1;
        return DDP_OK;
    }
    if (payload[0] != DDP__STORE_REPLY_ERROR || n < 5) {
        *in_sync = 0;
        s = ddp__error(DDP_ERR_PROTOCOL, "TCP store %s:%d: malformed reply", tc->host, tc->port);
        goto free_payload;
    }
    int32_t remote = (int32_t)ddp__load_u32(payload + 1);
    payload[n] = 0;
    s = remote < (int32_t)DDP_ERR_ABORTED || remote >= 0 ? DDP_ERR_REMOTE : (ddp_status_t)remote;
    ddp__error(s, "TCP store %s:%d: %s", tc->host, tc->port, (const char *)payload + 5);
free_payload:
    free(payload);
    return s;
}

/* Sends AUTH on a fresh connection and reads the answer. */
static ddp_status_t authenticate(struct tcp_client *tc, int fd, int64_t deadline_ns)
{
    ddp__bytes_t frame = {0};
    ddp__store_request_t req = {.op = DDP__STORE_OP_AUTH,
                                .value = (const uint8_t *)(tc->token ? tc->token : ""),
                                .value_len = tc->token ? strlen(tc->token) : 0};
    ddp__store_request_encode(&frame, &req);
    uint8_t *body = NULL;
    size_t body_len = 0;
    int in_sync = 0;
    ddp_status_t s = frame.failed ? DDP_ERR_NO_MEMORY
                                  : roundtrip(tc, fd, &frame, deadline_ns, &body, &body_len,
                                              &in_sync);
    ddp__bytes_free(&frame);
    free(body);
    return s;
}

/* Connects and authenticates, retrying with backoff while nothing listens or while the server
 * closes the connection before answering AUTH: a server flooded with unauthenticated connections
 * evicts the oldest ones, and an honest client caught in that must try again, not give up. A
 * wrong token is answered with an error reply and is not retried. */
static ddp_status_t open_connection(struct tcp_client *tc, int64_t deadline_ns, int *out_fd)
{
    int64_t backoff_ms = 10;
    int last_err = 0;
    int evicted = 0; /* the last attempt connected but was closed before the AUTH reply */
    int probed = 0;  /* asked whether the server speaks c10d (ddp__store_probe) */
    for (;;) {
        struct addrinfo *res = NULL;
        int gai = ddp__socket_resolve(tc->host, tc->port, 0, &res);
        if (gai != 0 && gai != EAI_AGAIN)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "TCP store: host '%s': %s", tc->host,
                              gai_strerror(gai));
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = -1;
            int err = ddp__socket_connect(ai->ai_addr, ai->ai_addrlen, deadline_ns, &fd);
            if (err != 0) {
                last_err = err;
                continue;
            }
            ddp__socket_nodelay(fd);
            /* A libddp server answers AUTH in well under a second; one that stays silent or
             * hangs up is asked, once, whether it speaks c10d's protocol instead. */
            int64_t auth_deadline =
                probed ? deadline_ns : ddp__deadline_precise_ns(AUTH_PATIENCE_MS);
            if (auth_deadline > deadline_ns) auth_deadline = deadline_ns;
            ddp_status_t s = authenticate(tc, fd, auth_deadline);
            if (s == DDP_OK) {
                freeaddrinfo(res);
                *out_fd = fd;
                return DDP_OK;
            }
            close(fd);
            if ((s == DDP_ERR_REMOTE || s == DDP_ERR_TIMEOUT) && !probed) {
                probed = 1;
                ddp__store_kind_t kind;
                if (ddp__store_probe(tc->host, tc->port, deadline_ns, &kind) == DDP_OK &&
                    kind != DDP__STORE_KIND_LIBDDP) {
                    freeaddrinfo(res);
                    return ddp__error(DDP_ERR_PROTOCOL,
                                      "TCP store %s:%d speaks PyTorch's c10d TCPStore protocol, "
                                      "not libddp's: connect with ddp_store_connect or "
                                      "ddp_store_c10d_connect",
                                      tc->host, tc->port);
                }
                if (s == DDP_ERR_TIMEOUT && ddp__now_ns() < deadline_ns) s = DDP_ERR_REMOTE;
            }
            /* Out of time after earlier evictions: the message below says why. */
            if (s == DDP_ERR_TIMEOUT && evicted) break;
            if (s != DDP_ERR_REMOTE) {
                freeaddrinfo(res);
                if (s == DDP_ERR_PROTOCOL)
                    return ddp__error_context(DDP_ERR_PROTOCOL,
                                              "TCP store %s:%d refused the connection (wrong "
                                              "token?)",
                                              tc->host, tc->port);
                return s;
            }
            evicted = 1;
        }
        if (res) freeaddrinfo(res);
        if (ddp__now_ns() >= deadline_ns) break;
        int left = ms_left(deadline_ns);
        ddp__sleep_us((backoff_ms < left ? backoff_ms : left) * 1000);
        if (backoff_ms < 500) backoff_ms *= 2;
    }
    if (evicted)
        return ddp__error(DDP_ERR_TIMEOUT,
                          "TCP store %s:%d: the server kept closing the connection before "
                          "answering AUTH until the timeout (flooded by unauthenticated "
                          "connections, or not a libddp store)",
                          tc->host, tc->port);
    return ddp__error_errno(DDP_ERR_TIMEOUT, last_err ? last_err : ETIMEDOUT,
                            "TCP store: could not connect to %s:%d before the timeout", tc->host,
                            tc->port);
}

/* Takes an idle pooled connection or opens a new one. */
static ddp_status_t acquire(ddp_store_t *store, int *fd)
{
    struct tcp_client *tc = impl_of(store);
    if (ddp__conn_pool_take(&tc->pool, fd)) return DDP_OK;
    return open_connection(tc, ddp__deadline_precise_ns(atomic_load(&store->timeout_ms)), fd);
}

static void release(ddp_store_t *store, int fd, int healthy)
{
    ddp__conn_pool_put(&impl_of(store)->pool, fd, healthy);
}

/* Encodes req, runs it on a pooled connection and returns the reply body. A connection whose
 * exchange did not complete cleanly is closed, never reused (its stream may be mid-frame). */
static ddp_status_t call(ddp_store_t *store, const ddp__store_request_t *req, int64_t wait_ms,
                         uint8_t **body, size_t *body_len)
{
    struct tcp_client *tc = impl_of(store);
    ddp__bytes_t frame = {0};
    ddp__store_request_encode(&frame, req);
    if (frame.failed) {
        ddp__bytes_free(&frame);
        return ddp__error(DDP_ERR_NO_MEMORY, "TCP store: out of memory encoding a request");
    }
    if (frame.len - DDP__STORE_FRAME_HEADER > DDP__STORE_MAX_FRAME) {
        ddp__bytes_free(&frame);
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "TCP store: request of %zu bytes exceeds the frame limit (too many keys)",
                          frame.len);
    }
    int fd = -1;
    ddp_status_t s = acquire(store, &fd);
    if (s == DDP_OK) {
        int64_t budget = wait_ms > 0 ? wait_ms + REPLY_GRACE_MS : atomic_load(&store->timeout_ms);
        int in_sync = 0;
        s = roundtrip(tc, fd, &frame, ddp__deadline_precise_ns(budget), body, body_len, &in_sync);
        release(store, fd, in_sync);
    }
    ddp__bytes_free(&frame);
    return s;
}

static ddp_status_t tcp_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    char *keys[1] = {(char *)key};
    ddp__store_request_t req = {.op = DDP__STORE_OP_SET, .keys = keys, .nkeys = 1,
                                .value = value, .value_len = len};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    free(body);
    return s;
}

static ddp_status_t tcp_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                            size_t *len)
{
    char *keys[1] = {(char *)key};
    ddp__store_request_t req = {.op = DDP__STORE_OP_GET, .keys = keys, .nkeys = 1,
                                .timeout_ms = (uint32_t)timeout_ms};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, timeout_ms, &body, &n);
    if (s != DDP_OK) return s;
    *value = body;
    *len = n;
    return DDP_OK;
}

static ddp_status_t read_i64_reply(const uint8_t *body, size_t n, int64_t *out)
{
    if (n != 8) return ddp__error(DDP_ERR_PROTOCOL, "TCP store: integer reply of %zu bytes", n);
    *out = (int64_t)ddp__load_u64(body);
    return DDP_OK;
}

static ddp_status_t tcp_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    char *keys[1] = {(char *)key};
    ddp__store_request_t req = {.op = DDP__STORE_OP_ADD, .keys = keys, .nkeys = 1,
                                .delta = delta};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    if (s == DDP_OK) s = read_i64_reply(body, n, result);
    free(body);
    return s;
}

static ddp_status_t tcp_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                    size_t expected_len, const void *desired, size_t desired_len,
                                    void **current, size_t *current_len)
{
    char *keys[1] = {(char *)key};
    ddp__store_request_t req = {.op = DDP__STORE_OP_COMPARE_SET, .keys = keys, .nkeys = 1,
                                .expected = expected, .expected_len = expected_len,
                                .value = desired, .value_len = desired_len};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    if (s != DDP_OK) return s;
    *current = body;
    *current_len = n;
    return DDP_OK;
}

static ddp_status_t tcp_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int *all_exist)
{
    if (nkeys > UINT32_MAX) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "check: too many keys");
    ddp__store_request_t req = {.op = DDP__STORE_OP_CHECK, .keys = (char **)keys,
                                .nkeys = (uint32_t)nkeys};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    if (s == DDP_OK) {
        if (n != 1) s = ddp__error(DDP_ERR_PROTOCOL, "TCP store: check reply of %zu bytes", n);
        else *all_exist = body[0] != 0;
    }
    free(body);
    return s;
}

static ddp_status_t tcp_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                             int timeout_ms)
{
    if (nkeys > UINT32_MAX) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "wait: too many keys");
    ddp__store_request_t req = {.op = DDP__STORE_OP_WAIT, .keys = (char **)keys,
                                .nkeys = (uint32_t)nkeys, .timeout_ms = (uint32_t)timeout_ms};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, timeout_ms, &body, &n);
    free(body);
    return s;
}

static ddp_status_t tcp_remove(ddp_store_t *store, const char *key, int *deleted)
{
    char *keys[1] = {(char *)key};
    ddp__store_request_t req = {.op = DDP__STORE_OP_DELETE, .keys = keys, .nkeys = 1};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    if (s == DDP_OK) {
        if (n != 1) s = ddp__error(DDP_ERR_PROTOCOL, "TCP store: delete reply of %zu bytes", n);
        else *deleted = body[0] != 0;
    }
    free(body);
    return s;
}

static ddp_status_t tcp_num_keys(ddp_store_t *store, int64_t *count)
{
    ddp__store_request_t req = {.op = DDP__STORE_OP_NUM_KEYS};
    uint8_t *body = NULL;
    size_t n = 0;
    ddp_status_t s = call(store, &req, 0, &body, &n);
    if (s == DDP_OK) s = read_i64_reply(body, n, count);
    free(body);
    return s;
}

static void tcp_destroy(ddp_store_t *store)
{
    struct tcp_client *tc = impl_of(store);
    if (!tc) return;
    ddp__conn_pool_destroy(&tc->pool);
    free(tc->host);
    free(tc->token);
    free(tc);
}

static const ddp__store_ops_t tcp_ops = {
    .kind = "tcp",
    .set = tcp_set,
    .get = tcp_get,
    .add = tcp_add,
    .compare_set = tcp_compare_set,
    .check = tcp_check,
    .wait = tcp_wait,
    .remove = tcp_remove,
    .num_keys = tcp_num_keys,
    .destroy = tcp_destroy,
};

ddp_status_t ddp_store_tcp_connect(const char *host, int port, const char *token, int timeout_ms,
                                   ddp_store_t **out)
{
    static const char fn[] = "ddp_store_tcp_connect";
    if (!host || !*host)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: host is %s", fn, host ? "empty" : "NULL");
    if (port <= 0 || port > 65535)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: port %d is not in 1..65535", fn, port);
    if (token && strlen(token) > DDP__STORE_MAX_TOKEN)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: token is longer than %u bytes", fn,
                          DDP__STORE_MAX_TOKEN);
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: timeout_ms must be >= 0 (0: DDP_TIMEOUT), got %d", fn, timeout_ms);
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    ddp__clear_error();
    if (timeout_ms == 0) {
        ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
        if (s != DDP_OK) return ddp__error_context(s, "%s: timeout_ms 0 asks for DDP_TIMEOUT", fn);
    }

    ddp_status_t s = DDP_ERR_NO_MEMORY;
    struct tcp_client *tc = ddp__calloc(1, sizeof *tc, "TCP store client");
    if (!tc) return s;
    ddp__conn_pool_init(&tc->pool);
    tc->port = port;
    tc->host = ddp__strdup(host, "store host");
    if (!tc->host) goto free_client;
    if (token && *token) {
        tc->token = ddp__strdup(token, "store token");
        if (!tc->token) goto free_client;
    }
    /* Open the first connection now: it proves the server is up and takes our token. */
    int fd = -1;
    s = open_connection(tc, ddp__deadline_precise_ns(timeout_ms), &fd);
    if (s != DDP_OK) goto free_client;
    ddp_store_t *store = ddp__store_new(&tcp_ops, tc, timeout_ms);
    if (!store) {
        close(fd);
        s = DDP_ERR_NO_MEMORY;
        goto free_client;
    }
    release(store, fd, 1);
    *out = store;
    return DDP_OK;
free_client:
    ddp__conn_pool_destroy(&tc->pool);
    free(tc->host);
    free(tc->token);
    free(tc);
    return s;
}
