/* Telling libddp's store protocol from PyTorch's c10d TCPStore protocol (src/store/c10d_client.c).
 * Internal: the public entry points are ddp_store_connect and ddp_store_c10d_connect. */
#ifndef DDP_STORE_C10D_H
#define DDP_STORE_C10D_H

#include <stdint.h>

#include "ddp/store.h"

/* C10D: torch 1.x's TCPStore protocol. C10D_V2: torch 2.x's, where a connection opens with a
 * VALIDATE query (a magic number) and every query type after it moved up by one. */
typedef enum {
    DDP__STORE_KIND_LIBDDP = 1,
    DDP__STORE_KIND_C10D = 2,
    DDP__STORE_KIND_C10D_V2 = 3
} ddp__store_kind_t;

/* Tells which protocol the server at host:port speaks (connecting, and retrying while nothing
 * listens, until deadline_ns). First torch 1.x's CHECK of zero keys: a 1.x server answers
 * READY; a libddp server and torch 2.x's closes the connection at once or waits for a
 * VALIDATE. Then, on a new connection, torch 2.x's VALIDATE and a PING: a 2.x server echoes the
 * PING's number, a libddp server closes the connection at once. DDP_ERR_PROTOCOL (with a
 * message) when the server answers neither; DDP_ERR_TIMEOUT when nothing listens before the
 * deadline. */
ddp_status_t ddp__store_probe(const char *host, int port, int64_t deadline_ns,
                              ddp__store_kind_t *kind);

/* Test entry (tests/fuzz/fuzz_c10d_reply.c): a c10d client handle that runs its requests on the
 * connected socket fd (taken over: the handle closes it) and, once that connection is dropped
 * after a failed exchange, fails every later call at once instead of connecting anew, so a fuzz
 * target can play the server's side from a byte string. */
ddp_status_t ddp__store_c10d_adopt(int fd, int timeout_ms, ddp_store_t **out);

#endif
