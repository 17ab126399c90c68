/* The TCP store's wire format (docs/store-protocol.md): length-prefixed frames, requests and
 * responses. Pure functions over byte buffers, no sockets, so the server, the client and the fuzz
 * target (tests/fuzz/fuzz_store_frame.c) share one parser. */
#ifndef DDP_STORE_TCP_FRAME_H
#define DDP_STORE_TCP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/store.h"

/* Largest payload of any frame: a compare_set carries two values and a key. */
#define DDP__STORE_MAX_FRAME (2u * DDP_STORE_MAX_VALUE + 65536u)
/* Largest payload before authentication: an AUTH frame with the longest token. */
#define DDP__STORE_MAX_TOKEN 4096u
#define DDP__STORE_MAX_AUTH_FRAME (1u + DDP__STORE_MAX_TOKEN)
#define DDP__STORE_FRAME_HEADER 4u

enum ddp__store_opcode {
    DDP__STORE_OP_AUTH = 1,
    DDP__STORE_OP_SET = 2,
    DDP__STORE_OP_GET = 3,
    DDP__STORE_OP_ADD = 4,
    DDP__STORE_OP_COMPARE_SET = 5,
    DDP__STORE_OP_CHECK = 6,
    DDP__STORE_OP_WAIT = 7,
    DDP__STORE_OP_DELETE = 8,
    DDP__STORE_OP_NUM_KEYS = 9,
};

/* Result byte that opens every response payload. */
enum { DDP__STORE_REPLY_OK = 0, DDP__STORE_REPLY_ERROR = 1 };

enum ddp__frame_result { DDP__FRAME_BAD = -1, DDP__FRAME_NEED_MORE = 0, DDP__FRAME_READY = 1 };

/* Looks at the bytes received so far. READY: buf begins with a whole frame whose payload is
 * buf[4 .. 4 + *payload_len). NEED_MORE: not yet. BAD: the length prefix is 0 or above
 * max_payload; *reason says why (static text). */
int ddp__store_frame_split(const uint8_t *buf, size_t len, size_t max_payload,
                           size_t *payload_len, const char **reason);

/* A decoded request. keys (and the strings they point to) are owned by the request; token, value
 * and expected point into the payload it was decoded from. */
typedef struct ddp__store_request {
    uint8_t op;
    uint32_t timeout_ms;  /* GET, WAIT */
    int64_t delta;        /* ADD */
    char **keys;          /* SET GET ADD COMPARE_SET DELETE: one; CHECK WAIT: nkeys */
    uint32_t nkeys;
    const uint8_t *value; /* SET: value; COMPARE_SET: desired; AUTH: token */
    size_t value_len;
    const uint8_t *expected; /* COMPARE_SET */
    size_t expected_len;
} ddp__store_request_t;

/* Decodes a request payload. Returns 0, or -1 with a reason written to reason[reason_size] for a
 * malformed one (unknown op, truncated field, trailing bytes, key too long or holding a NUL, value
 * too large). Free with ddp__store_request_free (also after a failure). */
int ddp__store_request_decode(const uint8_t *payload, size_t len, ddp__store_request_t *req,
                              char *reason, size_t reason_size);
void ddp__store_request_free(ddp__store_request_t *req);

/* A growable byte buffer for building frames. */
typedef struct ddp__bytes {
    uint8_t *data;
    size_t len, cap;
    int failed; /* an allocation failed: the content is incomplete */
} ddp__bytes_t;

void ddp__bytes_reserve(ddp__bytes_t *b, size_t more);
void ddp__bytes_append(ddp__bytes_t *b, const void *data, size_t len);
void ddp__bytes_u8(ddp__bytes_t *b, uint8_t v);
void ddp__bytes_u32(ddp__bytes_t *b, uint32_t v);
void ddp__bytes_u64(ddp__bytes_t *b, uint64_t v);
void ddp__bytes_free(ddp__bytes_t *b);
/* Starts a frame (reserves its length prefix) and returns where it starts; frame_end fills in the
 * length. */
size_t ddp__bytes_frame_begin(ddp__bytes_t *b);
void ddp__bytes_frame_end(ddp__bytes_t *b, size_t start);

/* Appends the frame of a request. Keys are C strings. */
void ddp__store_request_encode(ddp__bytes_t *b, const ddp__store_request_t *req);

/* Reads big-endian integers. */
uint32_t ddp__load_u32(const uint8_t *p);
uint64_t ddp__load_u64(const uint8_t *p);

#endif
