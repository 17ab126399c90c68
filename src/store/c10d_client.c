/* A client of PyTorch's c10d TCPStore (torch 1.x's and 2.x's wire protocols,
 * docs/store-protocol.md), so a
 * libddp program started the way torchrun starts workers - a TCPStore on MASTER_ADDR:MASTER_PORT
 * and no libddp store - rendezvous through it; and the probe that tells the two protocols apart
 * (ddp_store_connect), so a store of the other kind is recognised at once, not after a timeout.
 * Like the libddp client, a handle keeps a pool of connections: one per call in flight. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/socket.h"
#include "store/c10d.h"
#include "store/conn_pool.h"
#include "store/store_impl.h"
#include "store/tcp_frame.h"

/* c10d's query types (torch/csrc/distributed/c10d/TCPStore.cpp, enum QueryType, torch 1.13).
 * torch 2.x put VALIDATE (0) in front, so SET..GETNUMKEYS are one higher there; it dropped
 * WATCH_KEY, which leaves DELETE_KEY at 8 in both (query_type()). */
enum {
    Q_SET = 0,
    Q_COMPARE_SET = 1,
    Q_GET = 2,
    Q_ADD = 3,
    Q_CHECK = 4,
    Q_WAIT = 5,
    Q_GETNUMKEYS = 6,
    Q_WATCH_KEY = 7, /* not used: needs a callback connection */
    Q_DELETE_KEY = 8,
};
enum { Q2_VALIDATE = 0, Q2_PING = 13 };
/* torch 2.x's VALIDATE carries this number (c10d::detail::validationMagicNumber). */
#define C10D_VALIDATION_MAGIC 0x3C85F7CEu
enum { CHECK_READY = 0, CHECK_NOT_READY = 1 };
enum { WAIT_STOP_WAITING = 0 };

/* How long a probe waits for a reply from a server that accepted the connection. A libddp server
 * closes at once and a c10d server answers at once; silence this long means neither. The first
 * probe (torch 1.x's CHECK) waits less: torch 2.x's libuv server stays silent to it (it waits
 * for a VALIDATE), so that wait is paid by every torch 2.x rendezvous. */
#define PROBE_REPLY_MS 5000
#define PROBE_V1_REPLY_MS 1500
/* Extra time given to a WAIT's reply after its own timeout (the server itself never times out
 * a c10d WAIT; the client does, and closes the connection). */
#define REPLY_GRACE_MS 2000

typedef struct c10d_client {
    ddp__conn_pool_t pool;
    char *host;
    int port;
    int v2;      /* torch 2.x's protocol: VALIDATE on each new connection, query types + 1 */
    int adopted; /* ddp__store_c10d_adopt: only the one connection, never a new one */
} c10d_client_t;

static int64_t deadline_after(int64_t ms) { return ddp__now_ns() + ms * 1000000; }

static ddp_status_t send_all(const char *host, int port, int fd, const uint8_t *data, size_t len,
                             int64_t deadline_ns)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = send(fd, data + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = ddp__socket_wait(fd, POLLOUT, deadline_ns);
            if (r == 0)
                return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out sending a request",
                                  host, port);
            if (r < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "c10d store: poll");
            continue;
        }
        return ddp__error_errno(DDP_ERR_REMOTE, n < 0 ? errno : EPIPE,
                                "c10d store %s:%d: sending a request failed (server gone?)", host,
                                port);
    }
    return DDP_OK;
}

/* Reads exactly len bytes. A connection closed before the first byte is DDP_ERR_REMOTE with
 * *closed = 1 (the probe needs to know). */
static ddp_status_t recv_all(const char *host, int port, int fd, uint8_t *data, size_t len,
                             int64_t deadline_ns, const char *what, int *closed)
{
    size_t done = 0;
    if (closed) *closed = 0;
    while (done < len) {
        ssize_t n = recv(fd, data + done, len - done, MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n == 0) {
            if (closed) *closed = done == 0;
            return ddp__error(DDP_ERR_REMOTE,
                              "c10d store %s:%d: the server closed the connection while we waited "
                              "for %s (stopped, or it rejected the request)",
                              host, port, what);
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = ddp__socket_wait(fd, POLLIN, deadline_ns);
            if (r == 0)
                return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out waiting for %s",
                                  host, port, what);
            if (r < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "c10d store: poll");
            continue;
        }
        if (closed) *closed = done == 0 && (errno == ECONNRESET);
        return ddp__error_errno(DDP_ERR_REMOTE, errno, "c10d store %s:%d: receiving %s", host,
                                port, what);
    }
    return DDP_OK;
}

/* One TCP connection to host:port, retrying with backoff while nothing listens, until the
 * deadline. Shared with the probe. */
static ddp_status_t connect_retrying(const char *host, int port, int64_t deadline_ns, int *out_fd)
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
    ddp_status_t s = connect_retrying(host, port, deadline_ns, &fd);
    if (s != DDP_OK) return s;
    int64_t reply_deadline = deadline_after(reply_ms);
    if (reply_deadline > deadline_ns) reply_deadline = deadline_ns;
    s = send_all(host, port, fd, probe, len, reply_deadline);
    if (s == DDP_OK)
        s = recv_all(host, port, fd, reply, reply_len, reply_deadline, "the reply to the probe",
                     closed);
    close(fd);
    return s;
}

static void put_le32(uint8_t *p, uint32_t v)
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
    static const uint8_t v1[9] = {Q_CHECK, 0, 0, 0, 0, 0, 0, 0, 0};
    uint8_t reply[4] = {0xff, 0xff, 0xff, 0xff};
    int closed1 = 0, closed2 = 0;
    ddp_status_t s = probe_once(host, port, deadline_ns, v1, sizeof v1, reply, 1,
                                PROBE_V1_REPLY_MS, &closed1);
    if (s == DDP_OK && reply[0] == CHECK_READY) {
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
    v2[0] = Q2_VALIDATE;
    put_le32(v2 + 1, C10D_VALIDATION_MAGIC);
    v2[5] = Q2_PING;
    put_le32(v2 + 6, nonce);
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

/* ---- the client ---------------------------------------------------------------------------- */

static c10d_client_t *impl_of(ddp_store_t *store) { return store->impl; }

static void put_u64(ddp__bytes_t *b, uint64_t v)
{
    /* c10d sends its sizes and integers in the host's byte order (tcputil::sendBytes of a
     * uint64_t/int64_t); every platform torch runs its TCPStore on is little-endian, and so is
     * this encoding. */
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(v >> (8 * i));
    ddp__bytes_append(b, le, 8);
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void put_bytes(ddp__bytes_t *b, const void *data, size_t len)
{
    put_u64(b, (uint64_t)len);
    if (len) ddp__bytes_append(b, data, len);
}

/* A key as torch's own TCPStore client sends it: with "/" in front (TCPStore::keyPrefix_), so a
 * key set here is the key a torch process reads with store.get(key), and the other way. */
static void put_key(ddp__bytes_t *b, const char *key)
{
    size_t len = strlen(key);
    put_u64(b, (uint64_t)len + 1);
    ddp__bytes_append(b, "/", 1);
    if (len) ddp__bytes_append(b, key, len);
}

/* A query type as this server's protocol numbers it (see the enum above). */
static uint8_t query_type(const c10d_client_t *c, uint8_t q)
{
    return c->v2 && q != Q_DELETE_KEY ? (uint8_t)(q + 1) : q;
}

static ddp_status_t acquire(ddp_store_t *store, int *fd)
{
    c10d_client_t *c = impl_of(store);
    if (ddp__conn_pool_take(&c->pool, fd)) return DDP_OK;
    if (c->adopted)
        return ddp__error(DDP_ERR_REMOTE, "c10d store %s: the adopted connection was dropped",
                          c->host);
    int64_t deadline = deadline_after(atomic_load(&store->timeout_ms));
    ddp_status_t s = connect_retrying(c->host, c->port, deadline, fd);
    if (s != DDP_OK || !c->v2) return s;
    /* torch 2.x answers nothing on a connection that did not open with VALIDATE. */
    uint8_t validate[5] = {Q2_VALIDATE};
    put_le32(validate + 1, C10D_VALIDATION_MAGIC);
    s = send_all(c->host, c->port, *fd, validate, sizeof validate, deadline);
    if (s != DDP_OK) close(*fd);
    return s;
}

static void release(ddp_store_t *store, int fd, int healthy)
{
    ddp__conn_pool_put(&impl_of(store)->pool, fd, healthy);
}

/* What the reply to a request looks like. */
typedef enum { REPLY_NONE, REPLY_BYTE, REPLY_I64, REPLY_VECTOR } reply_shape_t;

typedef struct reply {
    uint8_t byte;
    int64_t i64;
    uint8_t *data; /* REPLY_VECTOR: malloc'd, NUL one past len */
    size_t len;
} reply_t;

/* Sends the encoded request on fd and reads a reply of the given shape. *in_sync = 1 when the
 * exchange completed, so the connection can carry the next request. */
static ddp_status_t exchange(c10d_client_t *c, int fd, const ddp__bytes_t *req, reply_shape_t shape,
                             int64_t deadline_ns, const char *what, reply_t *out, int *in_sync)
{
    *in_sync = 0;
    ddp_status_t s = send_all(c->host, c->port, fd, req->data, req->len, deadline_ns);
    if (s != DDP_OK) return s;
    uint8_t buf[8];
    switch (shape) {
    case REPLY_NONE:
        break;
    case REPLY_BYTE:
        s = recv_all(c->host, c->port, fd, buf, 1, deadline_ns, what, NULL);
        if (s == DDP_OK) out->byte = buf[0];
        break;
    case REPLY_I64:
        s = recv_all(c->host, c->port, fd, buf, 8, deadline_ns, what, NULL);
        if (s == DDP_OK) out->i64 = (int64_t)get_u64(buf);
        break;
    case REPLY_VECTOR: {
        s = recv_all(c->host, c->port, fd, buf, 8, deadline_ns, what, NULL);
        if (s != DDP_OK) break;
        uint64_t n = get_u64(buf);
        if (n > DDP_STORE_MAX_VALUE)
            return ddp__error(DDP_ERR_PROTOCOL,
                              "c10d store %s:%d: %s announces %llu bytes (at most %u accepted)",
                              c->host, c->port, what, (unsigned long long)n, DDP_STORE_MAX_VALUE);
        uint8_t *data = ddp__malloc((size_t)n + 1, "c10d store value");
        if (!data) return DDP_ERR_NO_MEMORY;
        s = n ? recv_all(c->host, c->port, fd, data, (size_t)n, deadline_ns, what, NULL) : DDP_OK;
        if (s != DDP_OK) {
            free(data);
            break;
        }
        data[n] = 0;
        out->data = data;
        out->len = (size_t)n;
        break;
    }
    }
    if (s == DDP_OK) *in_sync = 1;
    return s;
}

/* Runs one request on a pooled connection. budget_ms bounds the whole exchange. */
static ddp_status_t call(ddp_store_t *store, ddp__bytes_t *req, reply_shape_t shape,
                         int64_t budget_ms, const char *what, reply_t *out)
{
    if (req->failed) {
        ddp__bytes_free(req);
        return ddp__error(DDP_ERR_NO_MEMORY, "c10d store: out of memory encoding a request");
    }
    int fd = -1;
    ddp_status_t s = acquire(store, &fd);
    if (s == DDP_OK) {
        int in_sync = 0;
        s = exchange(impl_of(store), fd, req, shape, deadline_after(budget_ms), what, out,
                     &in_sync);
        release(store, fd, in_sync);
    }
    ddp__bytes_free(req);
    return s;
}

static int64_t handle_budget(ddp_store_t *store) { return atomic_load(&store->timeout_ms); }

static ddp_status_t c10d_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_SET));
    put_key(&b, key);
    put_bytes(&b, value, len);
    reply_t r = {0};
    /* SET has no reply: a later request on the same connection is ordered after it. */
    return call(store, &b, REPLY_NONE, handle_budget(store), "SET", &r);
}

/* WAIT for keys. The c10d server keeps a WAIT until the keys exist however long that is; the
 * client gives up after timeout_ms and closes that connection (so the late STOP_WAITING never
 * reaches a later request), which also drops the server's waiter. */
static ddp_status_t wait_keys(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int timeout_ms)
{
    c10d_client_t *c = impl_of(store);
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_WAIT));
    put_u64(&b, nkeys);
    for (size_t i = 0; i < nkeys; i++) put_key(&b, keys[i]);
    if (b.failed) {
        ddp__bytes_free(&b);
        return ddp__error(DDP_ERR_NO_MEMORY, "c10d store: out of memory encoding a request");
    }
    int fd = -1;
    ddp_status_t s = acquire(store, &fd);
    if (s != DDP_OK) {
        ddp__bytes_free(&b);
        return s;
    }
    reply_t r = {0};
    int in_sync = 0;
    s = exchange(c, fd, &b, REPLY_BYTE, deadline_after(timeout_ms), "the keys", &r, &in_sync);
    ddp__bytes_free(&b);
    release(store, fd, in_sync);
    if (s == DDP_ERR_TIMEOUT) {
        /* Name what is missing, as the other stores do. */
        unsigned char *missing = calloc(nkeys ? nkeys : 1, 1);
        int known = missing != NULL;
        for (size_t i = 0; known && i < nkeys; i++) {
            ddp__bytes_t q = {0};
            ddp__bytes_u8(&q, query_type(impl_of(store), Q_CHECK));
            put_u64(&q, 1);
            put_key(&q, keys[i]);
            reply_t one = {0};
            if (call(store, &q, REPLY_BYTE, REPLY_GRACE_MS, "CHECK", &one) != DDP_OK) known = 0;
            else missing[i] = one.byte != CHECK_READY;
        }
        char list[512] = "";
        if (known) ddp__store_format_keys(list, sizeof list, keys, nkeys, missing);
        free(missing);
        return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out after %d ms waiting for %s%s",
                          c->host, c->port, timeout_ms, known ? "keys " : "keys",
                          known ? list : "");
    }
    if (s == DDP_OK && r.byte != WAIT_STOP_WAITING)
        return ddp__error(DDP_ERR_PROTOCOL, "c10d store %s:%d: WAIT answered %u, not STOP_WAITING",
                          c->host, c->port, r.byte);
    return s;
}

static ddp_status_t c10d_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                             size_t *len)
{
    /* The server answers a GET of a missing key by dropping the connection, so wait first (what
     * torch's own client does). */
    const char *keys[1] = {key};
    ddp_status_t s = wait_keys(store, keys, 1, timeout_ms);
    if (s != DDP_OK) return s;
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_GET));
    put_key(&b, key);
    reply_t r = {0};
    s = call(store, &b, REPLY_VECTOR, handle_budget(store), "a GET reply", &r);
    if (s != DDP_OK) return s;
    *value = r.data;
    *len = r.len;
    return DDP_OK;
}

static ddp_status_t c10d_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_ADD));
    put_key(&b, key);
    put_u64(&b, (uint64_t)delta);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_I64, handle_budget(store), "an ADD reply", &r);
    if (s == DDP_ERR_REMOTE)
        return ddp__error_context(s, "adding to key '%s' (the c10d server drops the connection "
                                     "when the value is not an integer)",
                                  key);
    if (s == DDP_OK) *result = r.i64;
    return s;
}

static ddp_status_t c10d_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                     size_t expected_len, const void *desired, size_t desired_len,
                                     void **current, size_t *current_len)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_COMPARE_SET));
    put_key(&b, key);
    put_bytes(&b, expected, expected_len);
    put_bytes(&b, desired, desired_len);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_VECTOR, handle_budget(store), "a COMPARE_SET reply", &r);
    if (s != DDP_OK) return s;
    *current = r.data;
    *current_len = r.len;
    return DDP_OK;
}

static ddp_status_t c10d_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                               int *all_exist)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_CHECK));
    put_u64(&b, nkeys);
    for (size_t i = 0; i < nkeys; i++) put_key(&b, keys[i]);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_BYTE, handle_budget(store), "a CHECK reply", &r);
    if (s != DDP_OK) return s;
    if (r.byte != CHECK_READY && r.byte != CHECK_NOT_READY)
        return ddp__error(DDP_ERR_PROTOCOL, "c10d store: CHECK answered %u", r.byte);
    *all_exist = r.byte == CHECK_READY;
    return DDP_OK;
}

static ddp_status_t c10d_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int timeout_ms)
{
    return wait_keys(store, keys, nkeys, timeout_ms);
}

static ddp_status_t c10d_remove(ddp_store_t *store, const char *key, int *deleted)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_DELETE_KEY));
    put_key(&b, key);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_I64, handle_budget(store), "a DELETE_KEY reply", &r);
    if (s == DDP_OK) *deleted = r.i64 > 0;
    return s;
}

static ddp_status_t c10d_num_keys(ddp_store_t *store, int64_t *count)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), Q_GETNUMKEYS));
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_I64, handle_budget(store), "a GETNUMKEYS reply", &r);
    if (s == DDP_OK) *count = r.i64;
    return s;
}

static void c10d_destroy(ddp_store_t *store)
{
    c10d_client_t *c = impl_of(store);
    if (!c) return;
    ddp__conn_pool_destroy(&c->pool);
    free(c->host);
    free(c);
}

static const ddp__store_ops_t c10d_ops = {
    .kind = "c10d",
    .set = c10d_set,
    .get = c10d_get,
    .add = c10d_add,
    .compare_set = c10d_compare_set,
    .check = c10d_check,
    .wait = c10d_wait,
    .remove = c10d_remove,
    .num_keys = c10d_num_keys,
    .destroy = c10d_destroy,
};

static ddp_status_t check_connect_args(const char *fn, const char *host, int port, int *timeout_ms,
                                       ddp_store_t **out)
{
    if (!host || !*host)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: host is %s", fn, host ? "empty" : "NULL");
    if (port <= 0 || port > 65535)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: port %d is not in 1..65535", fn, port);
    if (*timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: timeout_ms must be >= 0 (0: DDP_TIMEOUT), got %d", fn, *timeout_ms);
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (*timeout_ms == 0) {
        ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", timeout_ms);
        if (s != DDP_OK) return ddp__error_context(s, "%s: timeout_ms 0 asks for DDP_TIMEOUT", fn);
    }
    return DDP_OK;
}

/* Makes the handle; the caller has seen a c10d server answer. */
static ddp_status_t c10d_open(const char *host, int port, int timeout_ms, ddp__store_kind_t kind,
                              ddp_store_t **out)
{
    c10d_client_t *c = ddp__calloc(1, sizeof *c, "c10d store client");
    if (!c) return DDP_ERR_NO_MEMORY;
    ddp__conn_pool_init(&c->pool);
    c->port = port;
    c->v2 = kind == DDP__STORE_KIND_C10D_V2;
    c->host = ddp__strdup(host, "store host");
    ddp_store_t *store = c->host ? ddp__store_new(&c10d_ops, c, timeout_ms) : NULL;
    if (!store) {
        ddp__conn_pool_destroy(&c->pool);
        free(c->host);
        free(c);
        return DDP_ERR_NO_MEMORY;
    }
    *out = store;
    return DDP_OK;
}

ddp_status_t ddp_store_c10d_connect(const char *host, int port, int timeout_ms, ddp_store_t **out)
{
    static const char fn[] = "ddp_store_c10d_connect";
    ddp__clear_error();
    ddp_status_t s = check_connect_args(fn, host, port, &timeout_ms, out);
    if (s != DDP_OK) return s;
    ddp__store_kind_t kind;
    s = ddp__store_probe(host, port, deadline_after(timeout_ms), &kind);
    if (s != DDP_OK) return ddp__error_context(s, "%s", fn);
    if (kind == DDP__STORE_KIND_LIBDDP)
        return ddp__error(DDP_ERR_PROTOCOL,
                          "%s: the server at %s:%d is a libddp store, not a c10d TCPStore: "
                          "connect with ddp_store_tcp_connect (or ddp_store_connect)",
                          fn, host, port);
    return c10d_open(host, port, timeout_ms, kind, out);
}

ddp_status_t ddp_store_connect(const char *host, int port, const char *token, int timeout_ms,
                               ddp_store_t **out)
{
    static const char fn[] = "ddp_store_connect";
    ddp__clear_error();
    ddp_status_t s = check_connect_args(fn, host, port, &timeout_ms, out);
    if (s != DDP_OK) return s;
    int64_t deadline = deadline_after(timeout_ms);
    ddp__store_kind_t kind;
    s = ddp__store_probe(host, port, deadline, &kind);
    if (s != DDP_OK) return ddp__error_context(s, "%s", fn);
    if (kind != DDP__STORE_KIND_LIBDDP) {
        /* c10d has no authentication: a token given for it protects nothing, say so in the log
         * rather than fail a torchrun job that exported one for other reasons. */
        if (token && *token)
            DDP_LOG(DDP_LOG_INFO, "store %s:%d is a c10d TCPStore: the token is not used", host,
                    port);
        DDP_LOG(DDP_LOG_INFO, "store %s:%d speaks c10d's TCPStore protocol (torch %s)", host,
                port, kind == DDP__STORE_KIND_C10D_V2 ? "2.x" : "1.x");
        return c10d_open(host, port, timeout_ms, kind, out);
    }
    int left = ddp__ms_left(deadline, 1000000000);
    return ddp_store_tcp_connect(host, port, token, left > 0 ? left : 1, out);
}

ddp_status_t ddp__store_c10d_adopt(int fd, int timeout_ms, ddp_store_t **out)
{
    ddp_status_t s = c10d_open("adopted", 1, timeout_ms, DDP__STORE_KIND_C10D, out);
    if (s != DDP_OK) {
        close(fd);
        return s;
    }
    c10d_client_t *c = impl_of(*out);
    c->adopted = 1;
    ddp__conn_pool_put(&c->pool, fd, 1);
    return DDP_OK;
}
