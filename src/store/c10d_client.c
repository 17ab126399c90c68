/* A client of PyTorch's c10d TCPStore (torch 1.x's and 2.x's wire protocols,
 * docs/store-protocol.md), so a libddp program started the way torchrun starts workers - a
 * TCPStore on MASTER_ADDR:MASTER_PORT and no libddp store - rendezvous through it. The wire
 * basics it shares with the probe are in c10d_wire.c; the front doors that probe and then open
 * this handle (ddp_store_connect, ddp_store_c10d_connect) are in store_connect.c.
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
    return c->v2 && q != C10D_Q_DELETE_KEY ? (uint8_t)(q + 1) : q;
}

static ddp_status_t acquire(ddp_store_t *store, int *fd)
{
    c10d_client_t *c = impl_of(store);
    if (ddp__conn_pool_take(&c->pool, fd)) return DDP_OK;
    if (c->adopted)
        return ddp__error(DDP_ERR_REMOTE, "c10d store %s: the adopted connection was dropped",
                          c->host);
    int64_t deadline = ddp__deadline_precise_ns(atomic_load(&store->timeout_ms));
    ddp_status_t s = ddp__c10d_dial(c->host, c->port, deadline, fd);
    if (s != DDP_OK || !c->v2) return s;
    /* torch 2.x answers nothing on a connection that did not open with VALIDATE. */
    uint8_t validate[5] = {C10D_Q2_VALIDATE};
    ddp__c10d_put_le32(validate + 1, C10D_VALIDATION_MAGIC);
    s = ddp__c10d_send_all(c->host, c->port, *fd, validate, sizeof validate, deadline);
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
    ddp_status_t s = ddp__c10d_send_all(c->host, c->port, fd, req->data, req->len, deadline_ns);
    if (s != DDP_OK) return s;
    uint8_t buf[8];
    switch (shape) {
    case REPLY_NONE:
        break;
    case REPLY_BYTE:
        s = ddp__c10d_recv_all(c->host, c->port, fd, buf, 1, deadline_ns, what, NULL);
        if (s == DDP_OK) out->byte = buf[0];
        break;
    case REPLY_I64:
        s = ddp__c10d_recv_all(c->host, c->port, fd, buf, 8, deadline_ns, what, NULL);
        if (s == DDP_OK) out->i64 = (int64_t)get_u64(buf);
        break;
    case REPLY_VECTOR: {
        s = ddp__c10d_recv_all(c->host, c->port, fd, buf, 8, deadline_ns, what, NULL);
        if (s != DDP_OK) break;
        uint64_t n = get_u64(buf);
        if (n > DDP_STORE_MAX_VALUE)
            return ddp__error(DDP_ERR_PROTOCOL,
                              "c10d store %s:%d: %s announces %llu bytes (at most %u accepted)",
                              c->host, c->port, what, (unsigned long long)n, DDP_STORE_MAX_VALUE);
        uint8_t *data = ddp__malloc((size_t)n + 1, "c10d store value");
        if (!data) return DDP_ERR_NO_MEMORY;
        s = n ? ddp__c10d_recv_all(c->host, c->port, fd, data, (size_t)n, deadline_ns, what, NULL) : DDP_OK;
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
        s = exchange(impl_of(store), fd, req, shape, ddp__deadline_precise_ns(budget_ms), what, out,
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_SET));
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_WAIT));
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
    s = exchange(c, fd, &b, REPLY_BYTE, ddp__deadline_precise_ns(timeout_ms), "the keys", &r, &in_sync);
    ddp__bytes_free(&b);
    release(store, fd, in_sync);
    if (s == DDP_ERR_TIMEOUT) {
        /* Name what is missing, as the other stores do. */
        unsigned char *missing = calloc(nkeys ? nkeys : 1, 1);
        int known = missing != NULL;
        for (size_t i = 0; known && i < nkeys; i++) {
            ddp__bytes_t q = {0};
            ddp__bytes_u8(&q, query_type(impl_of(store), C10D_Q_CHECK));
            put_u64(&q, 1);
            put_key(&q, keys[i]);
            reply_t one = {0};
            if (call(store, &q, REPLY_BYTE, REPLY_GRACE_MS, "CHECK", &one) != DDP_OK) known = 0;
            else missing[i] = one.byte != C10D_CHECK_READY;
        }
        char list[512] = "";
        if (known) ddp__store_format_keys(list, sizeof list, keys, nkeys, missing);
        free(missing);
        return ddp__error(DDP_ERR_TIMEOUT, "c10d store %s:%d: timed out after %d ms waiting for %s%s",
                          c->host, c->port, timeout_ms, known ? "keys " : "keys",
                          known ? list : "");
    }
    if (s == DDP_OK && r.byte != C10D_WAIT_STOP_WAITING)
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_GET));
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_ADD));
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_COMPARE_SET));
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_CHECK));
    put_u64(&b, nkeys);
    for (size_t i = 0; i < nkeys; i++) put_key(&b, keys[i]);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_BYTE, handle_budget(store), "a CHECK reply", &r);
    if (s != DDP_OK) return s;
    if (r.byte != C10D_CHECK_READY && r.byte != C10D_CHECK_NOT_READY)
        return ddp__error(DDP_ERR_PROTOCOL, "c10d store: CHECK answered %u", r.byte);
    *all_exist = r.byte == C10D_CHECK_READY;
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
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_DELETE_KEY));
    put_key(&b, key);
    reply_t r = {0};
    ddp_status_t s = call(store, &b, REPLY_I64, handle_budget(store), "a DELETE_KEY reply", &r);
    if (s == DDP_OK) *deleted = r.i64 > 0;
    return s;
}

static ddp_status_t c10d_num_keys(ddp_store_t *store, int64_t *count)
{
    ddp__bytes_t b = {0};
    ddp__bytes_u8(&b, query_type(impl_of(store), C10D_Q_GETNUMKEYS));
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

ddp_status_t ddp__store_c10d_open(const char *host, int port, int timeout_ms,
                                  ddp__store_kind_t kind, ddp_store_t **out)
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

ddp_status_t ddp__store_c10d_adopt(int fd, int timeout_ms, ddp_store_t **out)
{
    ddp_status_t s = ddp__store_c10d_open("adopted", 1, timeout_ms, DDP__STORE_KIND_C10D, out);
    if (s != DDP_OK) {
        close(fd);
        return s;
    }
    c10d_client_t *c = impl_of(*out);
    c->adopted = 1;
    ddp__conn_pool_put(&c->pool, fd, 1);
    return DDP_OK;
}
