/* What the TCP store server does with a request (tcp_server.h): AUTH before anything else, then
 * set/get/add/compare_set/check/wait/remove/num_keys on the server's table, get and wait parked
 * while their keys are missing and answered when a write completes them or their timeout passes.
 * The connections and the loop that calls ddp__store_server_process are in tcp_server.c; this
 * file calls nothing there (marking a connection dead and flushing its replies live here). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "store/tcp_server.h"

/* ---- replies ----------------------------------------------------------------------------- */

void ddp__store_conn_close(struct conn *c, const char *reason)
{
    if (reason) DDP_LOG(DDP_LOG_WARN, "TCP store server: closing connection from %s: %s", c->peer, reason);
    c->dead = 1;
}

void ddp__store_conn_flush(struct conn *c)
{
    while (!c->dead && c->out_sent < c->out.len) {
        ssize_t n = send(c->fd, c->out.data + c->out_sent, c->out.len - c->out_sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->out_sent += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        ddp__store_conn_close(c, n < 0 ? strerror(errno) : "send returned 0");
        return;
    }
    if (c->out_sent == c->out.len) {
        c->out.len = 0;
        c->out_sent = 0;
        if (c->out.cap > (1u << 20)) ddp__bytes_free(&c->out); /* give back a large reply */
    }
}

static void reply_ok(struct conn *c, const void *body, size_t len)
{
    size_t start = ddp__bytes_frame_begin(&c->out);
    ddp__bytes_u8(&c->out, DDP__STORE_REPLY_OK);
    ddp__bytes_append(&c->out, body, len);
    ddp__bytes_frame_end(&c->out, start);
    if (c->out.failed) ddp__store_conn_close(c, "out of memory for a reply");
}

static void reply_u64(struct conn *c, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (56 - 8 * i));
    reply_ok(c, b, 8);
}

static void reply_error(struct conn *c, ddp_status_t status, const char *text)
{
    size_t start = ddp__bytes_frame_begin(&c->out);
    ddp__bytes_u8(&c->out, DDP__STORE_REPLY_ERROR);
    ddp__bytes_u32(&c->out, (uint32_t)(int32_t)status);
    ddp__bytes_append(&c->out, text, strlen(text));
    ddp__bytes_frame_end(&c->out, start);
    if (c->out.failed) ddp__store_conn_close(c, "out of memory for a reply");
}

/* ---- requests ---------------------------------------------------------------------------- */

static int all_present(struct ddp_store_server *srv, const ddp__store_request_t *req)
{
    for (uint32_t i = 0; i < req->nkeys; i++)
        if (!ddp__kv_find(&srv->table, req->keys[i])) return 0;
    return 1;
}

/* Answers a get/wait whose keys all exist. */
static void answer_wait(struct ddp_store_server *srv, struct conn *c, const ddp__store_request_t *req)
{
    if (req->op == DDP__STORE_OP_GET) {
        ddp__kv_entry_t *e = ddp__kv_find(&srv->table, req->keys[0]);
        reply_ok(c, e->value, e->len);
    } else {
        reply_ok(c, NULL, 0);
    }
}

/* After a write: answers every parked request that is now satisfied. */
static void wake_waiters(struct ddp_store_server *srv)
{
    for (size_t i = 0; i < srv->nconns; i++) {
        struct conn *c = srv->conns[i];
        if (!c->parked || c->dead || !all_present(srv, &c->wait)) continue;
        answer_wait(srv, c, &c->wait);
        c->parked = 0;
        ddp__store_request_free(&c->wait);
        ddp__store_conn_flush(c);
    }
}

void ddp__store_server_time_out_waiter(struct ddp_store_server *srv, struct conn *c)
{
    unsigned char *missing = calloc(c->wait.nkeys, 1);
    int n = 0;
    for (uint32_t i = 0; i < c->wait.nkeys; i++) {
        int absent = ddp__kv_find(&srv->table, c->wait.keys[i]) == NULL;
        if (missing) missing[i] = (unsigned char)absent;
        n += absent;
    }
    char list[DDP_ERROR_TEXT_MAX / 2];
    ddp__store_format_keys(list, sizeof list, (const char *const *)c->wait.keys, c->wait.nkeys,
                           missing);
    free(missing);
    char text[DDP_ERROR_TEXT_MAX];
    snprintf(text, sizeof text, "timed out after %u ms waiting for %d missing key%s: %s",
             c->wait.timeout_ms, n, n == 1 ? "" : "s", list);
    reply_error(c, DDP_ERR_TIMEOUT, text);
    c->parked = 0;
    ddp__store_request_free(&c->wait);
    ddp__store_conn_flush(c);
}

/* Compares the presented token with ours in time independent of where they differ. */
static int token_matches(const struct ddp_store_server *srv, const uint8_t *token, size_t len)
{
    if (srv->token_len == 0) return 1;
    unsigned diff = (unsigned)(len != srv->token_len);
    for (size_t i = 0; i < srv->token_len; i++) {
        uint8_t presented = i < len ? token[i] : 0;
        diff |= (unsigned)(presented ^ srv->token[i]);
    }
    return diff == 0;
}

/* Handles one decoded request of an authenticated connection. Returns 1 when it wrote. */
static int handle(struct ddp_store_server *srv, struct conn *c, ddp__store_request_t *req)
{
    ddp_status_t s;
    switch (req->op) {
    case DDP__STORE_OP_AUTH:
        reply_ok(c, NULL, 0); /* re-authenticating is harmless */
        return 0;
    case DDP__STORE_OP_SET:
        s = ddp__kv_put(&srv->table, req->keys[0], req->value, req->value_len);
        if (s != DDP_OK) reply_error(c, s, ddp_last_error());
        else reply_ok(c, NULL, 0);
        return 1;
    case DDP__STORE_OP_GET:
    case DDP__STORE_OP_WAIT:
        if (all_present(srv, req)) {
            answer_wait(srv, c, req);
        } else if (req->timeout_ms == 0) {
            c->wait = *req;
            req->keys = NULL;
            ddp__store_server_time_out_waiter(srv, c);
        } else {
            c->parked = 1;
            c->wait = *req; /* takes the keys */
            req->keys = NULL;
            req->nkeys = 0;
            c->wait.value = NULL;
            c->wait_deadline_ns = ddp__now_ns() + (int64_t)req->timeout_ms * 1000000;
        }
        return 0;
    case DDP__STORE_OP_ADD: {
        ddp__kv_entry_t *e = ddp__kv_find(&srv->table, req->keys[0]);
        char text[32];
        size_t text_len = 0;
        int64_t result = 0;
        s = ddp__store_add_text(req->keys[0], e ? e->value : NULL, e ? e->len : 0, e != NULL,
                                req->delta, text, &text_len, &result);
        if (s == DDP_OK) s = ddp__kv_put(&srv->table, req->keys[0], text, text_len);
        if (s != DDP_OK) {
            reply_error(c, s, ddp_last_error());
            return 0;
        }
        reply_u64(c, (uint64_t)result);
        return 1;
    }
    case DDP__STORE_OP_COMPARE_SET: {
        ddp__kv_entry_t *e = ddp__kv_find(&srv->table, req->keys[0]);
        int wrote = 0;
        if (ddp__store_cas_matches(e ? e->value : NULL, e ? e->len : 0, e != NULL, req->expected,
                                   req->expected_len)) {
            s = ddp__kv_put(&srv->table, req->keys[0], req->value, req->value_len);
            if (s != DDP_OK) {
                reply_error(c, s, ddp_last_error());
                return 0;
            }
            e = ddp__kv_find(&srv->table, req->keys[0]);
            wrote = 1;
        }
        reply_ok(c, e ? e->value : NULL, e ? e->len : 0);
        return wrote;
    }
    case DDP__STORE_OP_CHECK: {
        uint8_t all = (uint8_t)all_present(srv, req);
        reply_ok(c, &all, 1);
        return 0;
    }
    case DDP__STORE_OP_DELETE: {
        uint8_t deleted = (uint8_t)ddp__kv_remove(&srv->table, req->keys[0]);
        reply_ok(c, &deleted, 1);
        return 0;
    }
    case DDP__STORE_OP_NUM_KEYS:
        reply_u64(c, (uint64_t)srv->table.count);
        return 0;
    }
    return 0;
}

/* Consumes the complete frames buffered on `c`, one request at a time: a parked request or an
 * unsent reply holds the rest back (so a client that never reads cannot grow our memory). */
void ddp__store_server_process(struct ddp_store_server *srv, struct conn *c)
{
    size_t off = 0;
    while (!c->dead && !c->parked && c->out.len == 0) {
        size_t limit = c->authenticated ? DDP__STORE_MAX_FRAME : DDP__STORE_MAX_AUTH_FRAME;
        size_t payload_len = 0;
        const char *why = NULL;
        int r = ddp__store_frame_split(c->in + off, c->in_len - off, limit, &payload_len, &why);
        if (r == DDP__FRAME_NEED_MORE) break;
        if (r == DDP__FRAME_BAD) {
            char text[160];
            snprintf(text, sizeof text, "%s%s", why,
                     c->authenticated ? "" : " (before authentication, limit 4101 bytes)");
            ddp__store_conn_close(c, text);
            break;
        }
        const uint8_t *payload = c->in + off + DDP__STORE_FRAME_HEADER;
        off += DDP__STORE_FRAME_HEADER + payload_len;
        ddp__store_request_t req;
        char reason[128];
        if (ddp__store_request_decode(payload, payload_len, &req, reason, sizeof reason) != 0) {
            ddp__store_request_free(&req);
            ddp__store_conn_close(c, reason);
            break;
        }
        if (!c->authenticated) {
            if (req.op != DDP__STORE_OP_AUTH) {
                ddp__store_conn_close(c, "first request is not AUTH");
            } else if (!token_matches(srv, req.value, req.value_len)) {
                /* Tell the client why, then close: it must not retry with the same token. */
                reply_error(c, DDP_ERR_PROTOCOL, "authentication failed: wrong store token");
                ddp__store_conn_flush(c);
                ddp__store_conn_close(c, "wrong token");
            } else {
                c->authenticated = 1;
                reply_ok(c, NULL, 0);
            }
            ddp__store_request_free(&req);
            if (!c->dead) ddp__store_conn_flush(c);
            continue;
        }
        int wrote = handle(srv, c, &req);
        ddp__store_request_free(&req);
        ddp__store_conn_flush(c);
        if (wrote) wake_waiters(srv);
    }
    if (off > 0 && !c->dead) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    /* Give back the memory of a large request once it has been handled. */
    if (c->in_len == 0 && c->in_cap > (1u << 20)) {
        free(c->in);
        c->in = NULL;
        c->in_cap = 0;
    }
}
