/* Several processes (threads for the in-memory store) hammer one store at once: atomic add,
 * compare_set races with exactly one winner, get blocking until another rank sets, wait timeouts
 * naming the missing keys, delete/check/num_keys. Usage: test_store_multi file|tcp|hash WORLD.
 * The TCP server runs in a process of its own, so the ranks are forked from a process without
 * threads. */
#include <pthread.h>
#include <string.h>

#include "test_store_common.h"

static int tcp_port;

static int file_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    return store_rank_body(store, rank, world);
}

/* The harness hands each rank a file store; this rank talks to the TCP server instead. */
static int tcp_rank(int rank, int world, ddp_store_t *file_store, void *arg)
{
    (void)file_store;
    (void)arg;
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", tcp_port, "multi-secret", 20000, &s));
    int rc = store_rank_body(s, rank, world);
    ddp_store_destroy(s);
    return rc;
}

struct thread_arg {
    ddp_store_t *store;
    int rank, world;
};

static void *hash_rank(void *p)
{
    struct thread_arg *a = p;
    store_rank_body(a->store, a->rank, a->world);
    return NULL;
}

int main(int argc, char **argv)
{
    CHECK_MSG(argc == 3, "usage: %s file|tcp|hash WORLD", argv[0]);
    const char *kind = argv[1];
    int world = atoi(argv[2]);
    CHECK(world >= 1 && world <= 8);
    if (strcmp(kind, "file") == 0) {
        CHECK(ddp_test_run_ranks(world, 100, file_rank, NULL) == 0);
    } else if (strcmp(kind, "tcp") == 0) {
        /* Not a server thread here: the harness forks the ranks from this process, and a child
         * forked while the server thread holds the allocator's lock hangs (seen under ASan). */
        store_server_process_t server;
        store_server_process_start("multi-secret", 0, 0, &server);
        tcp_port = server.port;
        int rc = ddp_test_run_ranks(world, 100, tcp_rank, NULL);
        /* The server saw every rank's keys. */
        ddp_store_t *s = NULL;
        CHECK_OK(ddp_store_tcp_connect("127.0.0.1", tcp_port, "multi-secret", 5000, &s));
        if (rc == 0) CHECK(value_as_int(s, "counter") == (int64_t)world * STORE_ADDS_PER_RANK);
        ddp_store_destroy(s);
        store_server_process_stop(&server);
        CHECK(rc == 0);
    } else if (strcmp(kind, "hash") == 0) {
        ddp_store_t *s = NULL;
        CHECK_OK(ddp_store_hash_create(&s));
        pthread_t threads[8];
        struct thread_arg args[8];
        for (int r = 0; r < world; r++) {
            args[r] = (struct thread_arg){s, r, world};
            CHECK(pthread_create(&threads[r], NULL, hash_rank, &args[r]) == 0);
        }
        for (int r = 0; r < world; r++) pthread_join(threads[r], NULL);
        ddp_store_destroy(s);
    } else {
        CHECK_MSG(0, "unknown store kind %s", kind);
    }
    printf("test_store_multi %s %d: ok\n", kind, world);
    return 0;
}
