/* The idle-connection pool the TCP store clients share (libddp's protocol, tcp_client.c, and
 * c10d's, c10d_client.c): one request runs on one connection at a time, so concurrent callers
 * each take a connection and hand it back when their exchange completed cleanly. */
#ifndef DDP_STORE_CONN_POOL_H
#define DDP_STORE_CONN_POOL_H

#include <pthread.h>
#include <sys/types.h>

struct ddp__pooled_conn;

typedef struct ddp__conn_pool {
    pthread_mutex_t mutex;
    struct ddp__pooled_conn *idle;
    pid_t pid; /* the process the pooled connections belong to */
} ddp__conn_pool_t;

void ddp__conn_pool_init(ddp__conn_pool_t *pool);

/* Takes an idle connection: 1 and *fd, or 0 when there is none (the caller opens one). In a
 * forked child the parent's connections are closed first, never reused. Thread-safe. */
int ddp__conn_pool_take(ddp__conn_pool_t *pool, int *fd);

/* Hands fd back when `healthy` (its last exchange completed, so the stream is between frames);
 * otherwise, or when out of memory, closes it. Thread-safe. */
void ddp__conn_pool_put(ddp__conn_pool_t *pool, int fd, int healthy);

/* Closes every idle connection and frees the pool's state (not the pool itself). */
void ddp__conn_pool_destroy(ddp__conn_pool_t *pool);

#endif
