/* PyTorch's c10d TCPStore wire as libddp's store code shares it: the query numbers, dialing and
 * whole-buffer I/O (c10d_wire.c), the probe that tells libddp's store protocol from c10d's
 * (c10d_wire.c), and the c10d client's constructor (c10d_client.c). Internal: the public entry
 * points are ddp_store_connect and ddp_store_c10d_connect (store_connect.c). */
#ifndef DDP_STORE_C10D_H
#define DDP_STORE_C10D_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/store.h"

/* c10d's query types (torch/csrc/distributed/c10d/TCPStore.cpp, enum QueryType, torch 1.13).
 * torch 2.x put VALIDATE (0) in front, so SET..GETNUMKEYS are one higher there; it dropped
 * WATCH_KEY, which leaves DELETE_KEY at 8 in both (c10d_client.c's query_type()). */
enum {
    C10D_Q_SET = 0,
    C10D_Q_COMPARE_SET = 1,
    C10D_Q_GET = 2,
    C10D_Q_ADD = 3,
    C10D_Q_CHECK = 4,
    C10D_Q_WAIT = 5,
    C10D_Q_GETNUMKEYS = 6,
    C10D_Q_WATCH_KEY = 7, /* not used: needs a callback connection */
    C10D_Q_DELETE_KEY = 8,
};
enum { C10D_Q2_VALIDATE = 0, C10D_Q2_PING = 13 };
/* torch 2.x's VALIDATE carries this number (c10d::detail::validationMagicNumber). */
#define C10D_VALIDATION_MAGIC 0x3C85F7CEu
enum { C10D_CHECK_READY = 0, C10D_CHECK_NOT_READY = 1 };
enum { C10D_WAIT_STOP_WAITING = 0 };

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

/* One TCP connection to host:port (TCP_NODELAY), retrying with backoff while nothing listens,
 * until deadline_ns. DDP_ERR_TIMEOUT naming host:port when none was made in time. */
ddp_status_t ddp__c10d_dial(const char *host, int port, int64_t deadline_ns, int *out_fd);

/* Sends len bytes before the deadline; errors name "c10d store host:port". */
ddp_status_t ddp__c10d_send_all(const char *host, int port, int fd, const uint8_t *data,
                                size_t len, int64_t deadline_ns);

/* Reads exactly len bytes before the deadline; errors name `what` was awaited. A connection
 * closed (or reset) before the first byte is DDP_ERR_REMOTE with *closed = 1 when closed is not
 * NULL (the probe needs to know). */
ddp_status_t ddp__c10d_recv_all(const char *host, int port, int fd, uint8_t *data, size_t len,
                                int64_t deadline_ns, const char *what, int *closed);

/* Stores v little-endian in p[0..3], as c10d's VALIDATE and PING carry their numbers. */
void ddp__c10d_put_le32(uint8_t *p, uint32_t v);

/* A c10d client handle for host:port speaking `kind`'s protocol (C10D or C10D_V2); the caller
 * has seen the server answer a probe. Connections are opened as calls need them. */
ddp_status_t ddp__store_c10d_open(const char *host, int port, int timeout_ms,
                                  ddp__store_kind_t kind, ddp_store_t **out);

/* Test entry (tests/fuzz/fuzz_c10d_reply.c): a c10d client handle that runs its requests on the
 * connected socket fd (taken over: the handle closes it) and, once that connection is dropped
 * after a failed exchange, fails every later call at once instead of connecting anew, so a fuzz
 * target can play the server's side from a byte string. */
ddp_status_t ddp__store_c10d_adopt(int fd, int timeout_ms, ddp_store_t **out);

#endif
