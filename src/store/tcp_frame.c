/* Frame splitting, request decoding and encoding for the TCP store. Every length read from the
 * wire is checked against the bytes that remain before it is used, so any input either decodes or
 * is rejected with a reason; nothing here reads out of bounds or allocates more than the input
 * justifies. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/tcp_frame.h"

uint32_t ddp__load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

uint64_t ddp__load_u64(const uint8_t *p)
{
    return (uint64_t)ddp__load_u32(p) << 32 | ddp__load_u32(p + 4);
}

int ddp__store_frame_split(const uint8_t *buf, size_t len, size_t max_payload,
                           size_t *payload_len, const char **reason)
{
    if (len < DDP__STORE_FRAME_HEADER) return DDP__FRAME_NEED_MORE;
    uint32_t n = ddp__load_u32(buf);
    if (n == 0) {
        *reason = "empty frame (length prefix 0)";
        return DDP__FRAME_BAD;
    }
    if (n > max_payload) {
        *reason = "frame length prefix above the limit";
        return DDP__FRAME_BAD;
    }
    if (len - DDP__STORE_FRAME_HEADER < n) return DDP__FRAME_NEED_MORE;
    *payload_len = n;
    return DDP__FRAME_READY;
}

/* ---- decoding ---------------------------------------------------------------------------- */

struct reader {
    const uint8_t *p;
    size_t left;
    char *reason;
    size_t reason_size;
};

static int fail(struct reader *r, const char *what)
{
    if (r->reason[0] == 0) snprintf(r->reason, r->reason_size, "%s", what);
    return -1;
}

static int read_u32(struct reader *r, uint32_t *v, const char *what)
{
    if (r->left < 4) return fail(r, what);
    *v = ddp__load_u32(r->p);
    r->p += 4;
    r->left -= 4;
    return 0;
}

static int read_u64(struct reader *r, uint64_t *v, const char *what)
{
    if (r->left < 8) return fail(r, what);
    *v = ddp__load_u64(r->p);
    r->p += 8;
    r->left -= 8;
    return 0;
}

/* A length-prefixed blob: u32 length then bytes. */
static int read_blob(struct reader *r, const uint8_t **data, size_t *len, size_t max,
                     const char *what)
{
    uint32_t n;
    if (read_u32(r, &n, what) != 0) return -1;
    if (n > max || n > r->left) return fail(r, what);
    *data = r->p;
    *len = n;
    r->p += n;
    r->left -= n;
    return 0;
}

/* Reads `count` keys into req->keys (one allocation: the pointer array then the strings). */
static int read_keys(struct reader *r, ddp__store_request_t *req, uint32_t count)
{
    /* Each key takes at least its 4-byte length: refuse counts the payload cannot hold before
     * allocating anything for them. */
    if (count == 0) return fail(r, "key count is 0");
    if (count > r->left / 4) return fail(r, "key count larger than the frame can hold");
    struct reader scan = *r;
    size_t text = 0;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *k;
        size_t n;
        if (read_blob(&scan, &k, &n, DDP_STORE_MAX_KEY, "truncated or too long key") != 0)
            return -1; /* scan shares r's reason buffer: the reason is written */
        if (memchr(k, 0, n)) return fail(r, "key contains a NUL byte");
        text += n + 1;
    }
    char **keys = malloc(count * sizeof(char *) + text);
    if (!keys) return fail(r, "out of memory for keys");
    char *out = (char *)(keys + count);
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *k = NULL;
        size_t n = 0;
        (void)read_blob(r, &k, &n, DDP_STORE_MAX_KEY, "key");
        memcpy(out, k, n);
        out[n] = 0;
        keys[i] = out;
        out += n + 1;
    }
    req->keys = keys;
    req->nkeys = count;
    return 0;
}

int ddp__store_request_decode(const uint8_t *payload, size_t len, ddp__store_request_t *req,
                              char *reason, size_t reason_size)
{
    memset(req, 0, sizeof *req);
    char dummy[1];
    if (!reason || reason_size == 0) {
        reason = dummy;
        reason_size = sizeof dummy;
    }
    reason[0] = 0;
    struct reader r = {payload, len, reason, reason_size};
    if (len < 1) return fail(&r, "empty payload");
    req->op = payload[0];
    r.p++;
    r.left--;
    uint32_t u32 = 0;
    uint64_t u64 = 0;
    switch (req->op) {
    case DDP__STORE_OP_AUTH:
        if (r.left > DDP__STORE_MAX_TOKEN) return fail(&r, "token too long");
        req->value = r.p;
        req->value_len = r.left;
        r.left = 0;
        break;
    case DDP__STORE_OP_SET:
        if (read_keys(&r, req, 1) != 0) return -1;
        if (r.left > DDP_STORE_MAX_VALUE) return fail(&r, "value too large");
        req->value = r.p;
        req->value_len = r.left;
        r.left = 0;
        break;
    case DDP__STORE_OP_GET:
        if (read_u32(&r, &req->timeout_ms, "truncated timeout") != 0) return -1;
        if (read_keys(&r, req, 1) != 0) return -1;
        break;
    case DDP__STORE_OP_ADD:
        if (read_u64(&r, &u64, "truncated delta") != 0) return -1;
        req->delta = (int64_t)u64;
        if (read_keys(&r, req, 1) != 0) return -1;
        break;
    case DDP__STORE_OP_COMPARE_SET:
        if (read_keys(&r, req, 1) != 0) return -1;
        if (read_blob(&r, &req->expected, &req->expected_len, DDP_STORE_MAX_VALUE,
                      "truncated or too large expected value") != 0)
            return -1;
        if (r.left > DDP_STORE_MAX_VALUE) return fail(&r, "desired value too large");
        req->value = r.p;
        req->value_len = r.left;
        r.left = 0;
        break;
    case DDP__STORE_OP_CHECK:
        if (read_u32(&r, &u32, "truncated key count") != 0) return -1;
        if (read_keys(&r, req, u32) != 0) return -1;
        break;
    case DDP__STORE_OP_WAIT:
        if (read_u32(&r, &req->timeout_ms, "truncated timeout") != 0) return -1;
        if (read_u32(&r, &u32, "truncated key count") != 0) return -1;
        if (read_keys(&r, req, u32) != 0) return -1;
        break;
    case DDP__STORE_OP_DELETE:
        if (read_keys(&r, req, 1) != 0) return -1;
        break;
    case DDP__STORE_OP_NUM_KEYS:
        break;
    default:
        snprintf(reason, reason_size, "unknown request type %u", (unsigned)req->op);
        return -1;
    }
    if (r.left != 0) return fail(&r, "trailing bytes after the request");
    return 0;
}

void ddp__store_request_free(ddp__store_request_t *req)
{
    free(req->keys);
    req->keys = NULL;
    req->nkeys = 0;
}

/* ---- encoding ---------------------------------------------------------------------------- */

void ddp__bytes_reserve(ddp__bytes_t *b, size_t more)
{
    if (b->failed) return;
    if (b->len + more <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    uint8_t *d = realloc(b->data, cap);
    if (!d) {
        b->failed = 1;
        return;
    }
    b->data = d;
    b->cap = cap;
}

void ddp__bytes_append(ddp__bytes_t *b, const void *data, size_t len)
{
    ddp__bytes_reserve(b, len);
    if (b->failed || len == 0) return;
    memcpy(b->data + b->len, data, len);
    b->len += len;
}

void ddp__bytes_u8(ddp__bytes_t *b, uint8_t v) { ddp__bytes_append(b, &v, 1); }

void ddp__bytes_u32(ddp__bytes_t *b, uint32_t v)
{
    uint8_t p[4] = {(uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
    ddp__bytes_append(b, p, 4);
}

void ddp__bytes_u64(ddp__bytes_t *b, uint64_t v)
{
    ddp__bytes_u32(b, (uint32_t)(v >> 32));
    ddp__bytes_u32(b, (uint32_t)v);
}

void ddp__bytes_free(ddp__bytes_t *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

size_t ddp__bytes_frame_begin(ddp__bytes_t *b)
{
    size_t start = b->len;
    ddp__bytes_u32(b, 0);
    return start;
}

void ddp__bytes_frame_end(ddp__bytes_t *b, size_t start)
{
    if (b->failed) return;
    uint32_t n = (uint32_t)(b->len - start - DDP__STORE_FRAME_HEADER);
    uint8_t *p = b->data + start;
    p[0] = (uint8_t)(n >> 24);
    p[1] = (uint8_t)(n >> 16);
    p[2] = (uint8_t)(n >> 8);
    p[3] = (uint8_t)n;
}

static void put_key(ddp__bytes_t *b, const char *key)
{
    size_t n = strlen(key);
    ddp__bytes_u32(b, (uint32_t)n);
    ddp__bytes_append(b, key, n);
}

void ddp__store_request_encode(ddp__bytes_t *b, const ddp__store_request_t *req)
{
    size_t start = ddp__bytes_frame_begin(b);
    ddp__bytes_u8(b, req->op);
    switch (req->op) {
    case DDP__STORE_OP_AUTH:
        ddp__bytes_append(b, req->value, req->value_len);
        break;
    case DDP__STORE_OP_SET:
        put_key(b, req->keys[0]);
        ddp__bytes_append(b, req->value, req->value_len);
        break;
    case DDP__STORE_OP_GET:
        ddp__bytes_u32(b, req->timeout_ms);
        put_key(b, req->keys[0]);
        break;
    case DDP__STORE_OP_ADD:
        ddp__bytes_u64(b, (uint64_t)req->delta);
        put_key(b, req->keys[0]);
        break;
    case DDP__STORE_OP_COMPARE_SET:
        put_key(b, req->keys[0]);
        ddp__bytes_u32(b, (uint32_t)req->expected_len);
        ddp__bytes_append(b, req->expected, req->expected_len);
        ddp__bytes_append(b, req->value, req->value_len);
        break;
    case DDP__STORE_OP_WAIT:
        ddp__bytes_u32(b, req->timeout_ms);
        ddp__bytes_u32(b, req->nkeys);
        for (uint32_t i = 0; i < req->nkeys; i++) put_key(b, req->keys[i]);
        break;
    case DDP__STORE_OP_CHECK:
        ddp__bytes_u32(b, req->nkeys);
        for (uint32_t i = 0; i < req->nkeys; i++) put_key(b, req->keys[i]);
        break;
    case DDP__STORE_OP_DELETE:
        put_key(b, req->keys[0]);
        break;
    default:
        break;
    }
    ddp__bytes_frame_end(b, start);
}
