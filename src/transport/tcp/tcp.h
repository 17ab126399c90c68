/* Internals of the TCP transport shared by its files (sockets and rendezvous, the progress engine,
 * the collectives) and by tests that force an algorithm. Not installed. */
#ifndef DDP_TRANSPORT_TCP_H
#define DDP_TRANSPORT_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "transport/transport.h"

extern const ddp__transport_ops_t ddp__transport_tcp;

/* ---- wire format ----------------------------------------------------------------------------
 * Hello (connector -> acceptor, once per connection), then an acknowledgement, then frames.
 * Every frame is a 24-byte header followed by `bytes` bytes of payload; multi-byte fields are
 * in the sender's byte order (the hello's magic reveals a byte-order mismatch: refused). */
#define DDP_TCP_HELLO_MAGIC 0x44445048u /* "DDPH" */
#define DDP_TCP_ACK_MAGIC 0x44445041u   /* "DDPA" */
#define DDP_TCP_FRAME_MAGIC 0x44445446u /* "DDPF" */
#define DDP_TCP_VERSION 1u
#define DDP_TCP_MAX_TOKEN 256u
#define DDP_TCP_MAX_GROUP 1024u

typedef struct ddp__tcp_hello {
    uint32_t magic;
    uint32_t version;
    int32_t from_rank;
    int32_t to_rank;
    int32_t world;
    uint32_t token_len; /* followed by token_len bytes of token, then group_len bytes of name */
    uint32_t group_len;
    uint32_t reserved;
} ddp__tcp_hello_t;

enum { DDP_TCP_FRAME_DATA = 1, DDP_TCP_FRAME_FINGERPRINT = 2, DDP_TCP_FRAME_ABORT = 3 };

typedef struct ddp__tcp_frame {
    uint32_t magic;
    uint32_t type;
    uint64_t seq;
    uint64_t bytes;
} ddp__tcp_frame_t;

/* ---- connections ------------------------------------------------------------------------- */
typedef struct ddp__tcp_conn {
    int fd;           /* -1 for self or after close */
    int send_partial; /* 1 while a frame is half written: an abort frame cannot be inserted */
    int recv_partial;  /* 1 while a frame from this peer is half read */
    uint64_t last_seq; /* sequence number of the last frame received from this peer */
    int rcvlowat;      /* SO_RCVLOWAT in force (0 or 1: the default, wake on any byte) */
} ddp__tcp_conn_t;

/* Chooses the local address to listen on (DDP_SOCKET_IFNAME, else the address that routes to
 * MASTER_ADDR, else 127.0.0.1), listens on port 0 and writes "address port" into `published`. */
ddp_status_t ddp__tcp_listen(int *listen_fd, char *published, size_t size);

/* Connects to every rank above `rank` and accepts from every rank below, authenticating each
 * connection with the job token and group name; fills conns[world] (conns[rank].fd = -1).
 * Connections failing authentication are closed and the rendezvous goes on. */
ddp_status_t ddp__tcp_connect_all(ddp_store_t *store, const char *group_name, int rank,
                                  int world, int listen_fd, int timeout_ms,
                                  ddp__tcp_conn_t *conns);

/* The largest hello: header, token and group name. */
#define DDP_TCP_MAX_HELLO (sizeof(ddp__tcp_hello_t) + DDP_TCP_MAX_TOKEN + DDP_TCP_MAX_GROUP)

/* Writes the hello rank sends to peer into buf (DDP_TCP_MAX_HELLO bytes; token and group at most
 * DDP_TCP_MAX_TOKEN and DDP_TCP_MAX_GROUP long, which the caller checked) and returns its
 * length. */
size_t ddp__tcp_hello_encode(char *buf, int rank, int peer, int world, const char *token,
                             const char *group);

/* The acceptor's check of a hello (the first bytes a connecting stranger sends, before it is
 * authenticated), over the have bytes received so far in buf. Returns 1 when it is a complete,
 * valid hello from a lower rank of this group that is not connected yet (*from set); 0 when more
 * bytes are needed (*need: how many in all, at most sizeof(ddp__tcp_hello_t) + DDP_TCP_MAX_TOKEN
 * + DDP_TCP_MAX_GROUP); -1 when the connection must be closed (*why: static text). Reads only
 * buf[0 .. min(have, *need)); allocates nothing. Fuzzed by tests/fuzz/fuzz_tcp_hello.c. */
int ddp__tcp_hello_check(const char *buf, size_t have, const char *token, const char *group,
                         int rank, int world, const ddp__tcp_conn_t *conns, size_t *need,
                         int *from, const char **why);

/* ---- test hooks ---------------------------------------------------------------------------- */
/* Allreduce messages of at most this many bytes use recursive doubling, larger ones the ring
 * (default 64 KiB). Process-wide; tests set 0 to force the ring or SIZE_MAX to force doubling. */
void ddp__tcp_set_small_threshold(size_t bytes);
/* Bytes per pipelined chunk on the ring and the broadcast chain (default 512 KiB; min 64). */
void ddp__tcp_set_chunk_bytes(size_t bytes);

#endif
