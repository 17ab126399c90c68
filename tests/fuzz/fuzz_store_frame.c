/* Fuzz target for the TCP store's frame codec (src/store/tcp_frame.c): splits the input into
 * frames under both size limits, decodes every complete one, and checks that a decoded request
 * re-encodes to exactly the bytes it came from (the encoding is canonical). Built for libFuzzer
 * with clang (tests/fuzz/fuzz.cmake); linked with fuzz_main.c it replays the seed corpus plus
 * deterministic mutations of it, which ctest runs with any compiler. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/tcp_frame.h"

static void must(int cond, const char *what)
{
    if (!cond) {
        fprintf(stderr, "fuzz_store_frame: invariant broken: %s\n", what);
        abort();
    }
}

static void one_payload(const uint8_t *payload, size_t len)
{
    ddp__store_request_t req;
    char reason[128];
    if (ddp__store_request_decode(payload, len, &req, reason, sizeof reason) != 0) {
        must(reason[0] != 0, "a rejected request has a reason");
        ddp__store_request_free(&req);
        return;
    }
    for (uint32_t i = 0; i < req.nkeys; i++) must(strlen(req.keys[i]) <= DDP_STORE_MAX_KEY, "key length");
    must(req.value_len <= DDP_STORE_MAX_VALUE, "value length");
    must(req.expected_len <= DDP_STORE_MAX_VALUE, "expected length");
    ddp__bytes_t b = {0};
    ddp__store_request_encode(&b, &req);
    must(!b.failed, "encoding allocates");
    must(b.len == len + DDP__STORE_FRAME_HEADER, "re-encoded length");
    must(ddp__load_u32(b.data) == len, "re-encoded prefix");
    must(memcmp(b.data + DDP__STORE_FRAME_HEADER, payload, len) == 0, "re-encoded bytes");
    ddp__bytes_free(&b);
    ddp__store_request_free(&req);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The input as a stream of frames, the way the server consumes a connection's bytes. */
    for (int authenticated = 0; authenticated < 2; authenticated++) {
        size_t limit = authenticated ? DDP__STORE_MAX_FRAME : DDP__STORE_MAX_AUTH_FRAME;
        size_t off = 0;
        for (;;) {
            size_t payload_len = 0;
            const char *why = NULL;
            int r = ddp__store_frame_split(data + off, size - off, limit, &payload_len, &why);
            if (r == DDP__FRAME_BAD) {
                must(why != NULL, "a bad frame has a reason");
                break;
            }
            if (r == DDP__FRAME_NEED_MORE) break;
            must(payload_len >= 1 && payload_len <= limit, "payload within the limit");
            must(DDP__STORE_FRAME_HEADER + payload_len <= size - off, "frame within the input");
            one_payload(data + off + DDP__STORE_FRAME_HEADER, payload_len);
            off += DDP__STORE_FRAME_HEADER + payload_len;
        }
    }
    /* The input as one payload. */
    one_payload(data, size);
    return 0;
}
