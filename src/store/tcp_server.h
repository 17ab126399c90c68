/* The TCP store server's insides, shared by its two files: tcp_server.c (connections, the poll
 * loop, start/stop, the fuzz replay) and, below it, tcp_server_requests.c (what each request
 * does, parked waits, replies and sending them). Internal to src/store. */
#ifndef DDP_STORE_TCP_SERVER_H
#define DDP_STORE_TCP_SERVER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "store/store_impl.h"
#include "store/tcp_frame.h"

/* An unauthenticated connection's input buffer holds exactly one AUTH frame of the largest size. */
#define UNAUTH_BUFFER (DDP__STORE_FRAME_HEADER + DDP__STORE_MAX_AUTH_FRAME)
struct conn {
    int fd;
    int authenticated;
    int64_t opened_ns;
    char peer[64];
    uint8_t *in; /* received bytes not yet consumed */
    size_t in_len, in_cap;
    ddp__bytes_t out; /* responses not yet sent, from out_sent on */
    size_t out_sent;
    int parked;                /* a get/wait waits for keys */
    ddp__store_request_t wait; /* the parked request (owns its keys) */
    int64_t wait_deadline_ns;
    int dead; /* to be closed at the end of this loop turn */
};

struct ddp_store_server {
    pthread_t thread;
    int listen_fd;
    int wake[2]; /* a byte written to wake[1] stops the loop */
    int port;
    uint8_t *token;
    size_t token_len;
    ddp__kv_table_t table; /* touched only by the server thread */
    struct conn **conns;
    size_t nconns, conns_cap;
    int64_t accept_paused_until_ns; /* out of file descriptors: stop polling the listener */
    size_t unauth_limit;            /* unauthenticated connections kept at once */
    uint64_t evicted;               /* unauthenticated connections evicted, not yet logged */
    int64_t evictions_logged_ns;    /* when the last summary of evictions was logged */
};

/* Marks c to be closed at the end of this loop turn (logging the reason when there is one). */
void ddp__store_conn_close(struct conn *c, const char *reason);

/* Sends what is pending on c without blocking. */
void ddp__store_conn_flush(struct conn *c);

/* Consumes the complete frames buffered on c, one request at a time, and queues the replies: a
 * parked request or an unsent reply holds the rest back. */
void ddp__store_server_process(struct ddp_store_server *srv, struct conn *c);

/* Answers c's parked get/wait with a timeout once its deadline has passed. */
void ddp__store_server_time_out_waiter(struct ddp_store_server *srv, struct conn *c);

#endif
