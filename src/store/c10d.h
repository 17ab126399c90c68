/* Telling libddp's store protocol from PyTorch's c10d TCPStore protocol (src/store/c10d_client.c).
 * Internal: the public entry points are ddp_store_connect and ddp_store_c10d_connect. */
#ifndef DDP_STORE_C10D_H
#define DDP_STORE_C10D_H

#include <stdint.h>

#include "ddp/store.h"

typedef enum { DDP__STORE_KIND_LIBDDP = 1, DDP__STORE_KIND_C10D = 2 } ddp__store_kind_t;

/* Connects to host:port (retrying while nothing listens, until deadline_ns), sends c10d's CHECK
 * of zero keys and tells by the answer which protocol the server speaks: a c10d server answers
 * READY, a libddp server closes the connection at once. DDP_ERR_PROTOCOL (with a message) when
 * the server does neither within 5 s; DDP_ERR_TIMEOUT when nothing listens before the deadline. */
ddp_status_t ddp__store_probe(const char *host, int port, int64_t deadline_ns,
                              ddp__store_kind_t *kind);

/* Test entry (tests/fuzz/fuzz_c10d_reply.c): a c10d client handle that runs its requests on the
 * connected socket fd (taken over: the handle closes it) and, once that connection is dropped
 * after a failed exchange, fails every later call at once instead of connecting anew, so a fuzz
 * target can play the server's side from a byte string. */
ddp_status_t ddp__store_c10d_adopt(int fd, int timeout_ms, ddp_store_t **out);

#endif
