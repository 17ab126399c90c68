/* What the files of the TCP transport share (tcp_engine.c, tcp_ring.c, tcp_transport.c): the
 * transport's state, the streams of frames the engine drives, and the functions each file
 * offers the others. Private to src/transport/tcp/. */
#ifndef DDP_TRANSPORT_TCP_TCP_PRIVATE_H
#define DDP_TRANSPORT_TCP_TCP_PRIVATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/tcp/tcp.h"

typedef struct tcp_state {
    int rank, world;
    int timeout_ms; /* the group's timeout: sets the grace of ddp__tcp_blame_grace_ns */
    char group[DDP_TCP_MAX_GROUP + 1];
    ddp__tcp_conn_t *conns;
    char *work; /* accumulation workspace, grown on demand */
    size_t work_bytes;
    char *tmp; /* one incoming chunk */
    size_t tmp_bytes;
    pthread_mutex_t lock;
    int running;
    atomic_int aborted;
    char abort_reason[256];
    int broken;
    char broken_text[DDP_ERROR_TEXT_MAX];
} tcp_state_t;

typedef struct fp_wire {
    ddp__fingerprint_t f;
    int32_t valid, pad;
} fp_wire_t;

/* ---- the progress engine ------------------------------------------------------------------
 * One ddp__tcp_exchange drives at most one outgoing and one incoming stream of frames (enough for the
 * ring, the chain and each round of the logarithmic algorithms). An outgoing piece may wait for
 * an incoming piece (its `after` index) to have arrived and been processed by `on_recv`. */
typedef struct piece {
    char *buf;
    size_t bytes;
    long after; /* send only: index of the incoming piece that must be done first, or -1 */
} piece_t;

typedef struct flow {
    int peer;
    uint32_t type;
    piece_t *pieces;
    size_t n;
    size_t cur;  /* pieces before this one are complete */
    size_t done; /* bytes of the current frame (header + payload) transferred */
    ddp__tcp_frame_t hdr;
} flow_t;

typedef void (*on_recv_fn)(void *ctx, size_t index);

/* ---- tcp_engine.c ---- */

/* "seq S allreduce ..." of c on this transport's rank, for error texts. */
void ddp__tcp_describe_c(const tcp_state_t *t, const ddp__collective_t *c, char *buf, size_t size);
/* Whether peer sent an abort frame; its reason then goes into reason. */
int ddp__tcp_pending_abort_reason(tcp_state_t *t, int peer, char *reason, size_t size);
/* How long a rank that gave up listens for others' abort frames before blaming. */
int64_t ddp__tcp_blame_grace_ns(const tcp_state_t *t);
/* Drives `out` and `in` (either may be NULL) to completion before c's deadline; fn(ctx, i) runs
 * when incoming piece i has arrived. */
ddp_status_t ddp__tcp_exchange(tcp_state_t *t, const ddp__collective_t *c, flow_t *out,
                               flow_t *in, on_recv_fn fn, void *ctx);
/* Grows *buf (of *have bytes) to at least `bytes`. */
ddp_status_t ddp__tcp_ensure(char **buf, size_t *have, size_t bytes, const char *what);
/* The fingerprint exchange every collective starts with (also the barrier); commit: this is the
 * confirming round after the data moved. */
ddp_status_t ddp__tcp_check_fingerprints(tcp_state_t *t, const ddp__collective_t *c, int commit);
/* Best effort: an abort frame with `reason` to every peer whose socket is at a frame boundary. */
void ddp__tcp_send_abort_frames(tcp_state_t *t, uint64_t seq, const char *reason);
/* Shuts every connection down, so that peers fail fast. */
void ddp__tcp_shut_all(tcp_state_t *t);

/* ---- tcp_ring.c ---- */

ddp_status_t ddp__tcp_allreduce_ring(tcp_state_t *t, const ddp__collective_t *c);
ddp_status_t ddp__tcp_reduce_scatter_ring(tcp_state_t *t, const ddp__collective_t *c);
ddp_status_t ddp__tcp_allgather_ring(tcp_state_t *t, const ddp__collective_t *c);
ddp_status_t ddp__tcp_allreduce_doubling(tcp_state_t *t, const ddp__collective_t *c);
ddp_status_t ddp__tcp_broadcast_chain(tcp_state_t *t, const ddp__collective_t *c);

#endif
