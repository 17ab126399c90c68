/* The idle-connection pool of the TCP store clients (conn_pool.h): a mutex-guarded list of file
 * descriptors, dropped as a whole in a forked child. */
#include "store/conn_pool.h"

#include <stdlib.h>
#include <unistd.h>

struct ddp__pooled_conn {
    int fd;
    struct ddp__pooled_conn *next;
};

void ddp__conn_pool_init(ddp__conn_pool_t *pool)
{
    pthread_mutex_init(&pool->mutex, NULL);
    pool->idle = NULL;
    pool->pid = getpid();
}

/* Closes the idle list; the caller holds the mutex or is the only user. */
static void close_idle(ddp__conn_pool_t *pool)
{
    while (pool->idle) {
        struct ddp__pooled_conn *p = pool->idle;
        pool->idle = p->next;
        close(p->fd);
        free(p);
    }
}

int ddp__conn_pool_take(ddp__conn_pool_t *pool, int *fd)
{
    pthread_mutex_lock(&pool->mutex);
    if (pool->pid != getpid()) {
        /* A forked child must not talk on its parent's connections (the two would interleave
         * frames on one stream): drop its copies and open its own. */
        close_idle(pool);
        pool->pid = getpid();
    }
    struct ddp__pooled_conn *p = pool->idle;
    if (p) pool->idle = p->next;
    pthread_mutex_unlock(&pool->mutex);
    if (!p) return 0;
    *fd = p->fd;
    free(p);
    return 1;
}

void ddp__conn_pool_put(ddp__conn_pool_t *pool, int fd, int healthy)
{
    struct ddp__pooled_conn *p = healthy ? malloc(sizeof *p) : NULL;
    if (!p) {
        close(fd);
        return;
    }
    p->fd = fd;
    pthread_mutex_lock(&pool->mutex);
    p->next = pool->idle;
    pool->idle = p;
    pthread_mutex_unlock(&pool->mutex);
}

void ddp__conn_pool_destroy(ddp__conn_pool_t *pool)
{
    close_idle(pool);
    pthread_mutex_destroy(&pool->mutex);
}
