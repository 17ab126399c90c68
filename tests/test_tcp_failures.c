/* Failures of the TCP transport, each in forked ranks on loopback:
 *   mismatch  - one rank calls a different collective: DDP_ERR_MISMATCH on every rank, naming both
 *               sides; the transport is broken afterwards (DDP_ERR_ABORTED).
 *   timeout   - the last rank never calls: every other rank gets DDP_ERR_TIMEOUT naming it and
 *               the last sequence number heard from it.
 *   kill      - the last rank dies (its process exits without a goodbye) in the middle of a job:
 *               every survivor gets DDP_ERR_REMOTE naming it, long before the deadline.
 *   intruder  - while the ranks rendezvous, a stranger connects to the last rank with garbage,
 *               with a wrong token, without a token, with another group name and with bad ranks,
 *               and one connection stays silent: each is closed, and the job goes on to a correct
 *               allreduce.
 *   abort     - another thread aborts rank 0 while it waits in a collective: rank 0 gets
 *               DDP_ERR_ABORTED with the reason, the others DDP_ERR_REMOTE carrying it.
 *   ifname    - DDP_SOCKET_IFNAME names an interface that does not exist: create fails with
 *               DDP_ERR_NOT_FOUND naming it; with DDP_SOCKET_IFNAME=lo the job runs.
 * Usage: test_tcp_failures WORLD MODE */
#include <errno.h>
#include <pthread.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "harness.h"
#include "transport/tcp/tcp.h"

static const char *mode;
static const char *const token = "failure-test-token";

static ddp_status_t run_allreduce(void *state, uint64_t seq, float *buf, size_t count,
                                  int timeout_ms)
{
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = DDP__ALLREDUCE;
    c.seq = seq;
    c.send = buf;
    c.recv = buf;
    c.count = count;
    c.dtype = DDP_F32;
    c.op = DDP_SUM;
    c.deadline_ns = ddp__now_ns() + (int64_t)timeout_ms * 1000000LL;
    return ddp__transport_tcp.run(state, &c);
}

static void fill(float *buf, size_t count, int rank)
{
    for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1) + (float)(i % 7);
}

static void check_sum(const float *buf, size_t count, int world)
{
    for (size_t i = 0; i < count; i++) {
        float want = (float)(world * (world + 1) / 2) + (float)world * (float)(i % 7);
        CHECK_MSG(buf[i] == want, "element %zu is %g, want %g", i, buf[i], want);
    }
}

static int mismatch(int rank, int world, void *state)
{
    float buf[100];
    fill(buf, 100, rank);
    CHECK_OK(run_allreduce(state, 1, buf, 100, 20000));
    check_sum(buf, 100, world);
    /* The last rank asks for 99 elements instead of 100. */
    fill(buf, 100, rank);
    ddp_status_t s = run_allreduce(state, 2, buf, rank == world - 1 ? 99 : 100, 20000);
    CHECK_STATUS(s, DDP_ERR_MISMATCH);
    char last[32];
    snprintf(last, sizeof last, "rank %d called", world - 1);
    CHECK_ERROR_MENTIONS("rank 0 called seq 2 allreduce f32 sum count 100");
    CHECK_ERROR_MENTIONS(last);
    CHECK_ERROR_MENTIONS("count 99");
    CHECK_STATUS(run_allreduce(state, 3, buf, 100, 20000), DDP_ERR_ABORTED);
    return 0;
}

static int timeout(int rank, int world, void *state)
{
    float buf[100];
    fill(buf, 100, rank);
    CHECK_OK(run_allreduce(state, 1, buf, 100, 20000));
    if (rank == world - 1) {
        /* Never arrives at seq 2; stays alive (sockets open) past everyone's deadline. */
        sleep(4);
        return 0;
    }
    ddp_status_t s = run_allreduce(state, 2, buf, 100, 1500);
    /* Every rank that arrived names the one that did not, with the last seq heard from it. */
    char name[64];
    snprintf(name, sizeof name, "rank %d (at seq 1) did not arrive", world - 1);
    CHECK_STATUS(s, DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS(name);
    CHECK_ERROR_MENTIONS("seq 2");
    return 0;
}

static int killed(int rank, int world, void *state)
{
    size_t count = 300000;
    float *buf = malloc(count * sizeof *buf);
    CHECK(buf);
    for (int seq = 1; seq <= 3; seq++) {
        fill(buf, count, rank);
        CHECK_OK(run_allreduce(state, (uint64_t)seq, buf, count, 20000));
        check_sum(buf, count, world);
    }
    if (rank == world - 1) {
        /* Dies like a killed process: the kernel closes its sockets, nothing is said. */
        fflush(stdout);
        fflush(stderr);
        _exit(0);
    }
    int64_t start = ddp__now_ns();
    fill(buf, count, rank);
    ddp_status_t s = run_allreduce(state, 4, buf, count, 25000);
    double took = (double)(ddp__now_ns() - start) / 1e9;
    CHECK_STATUS(s, DDP_ERR_REMOTE);
    char name[32];
    snprintf(name, sizeof name, "rank %d", world - 1);
    CHECK_ERROR_MENTIONS(name);
    printf("rank %d noticed the death in %.3f s: %s\n", rank, took, ddp_last_error());
    CHECK_STATUS(run_allreduce(state, 5, buf, count, 20000), DDP_ERR_ABORTED);
    free(buf);
    return 0;
}

static void *abort_later(void *state)
{
    usleep(300 * 1000);
    ddp__transport_tcp.abort(state, "test abort from another thread");
    return NULL;
}

static int aborted(int rank, int world, void *state, ddp_store_t *store)
{
    float buf[1000];
    fill(buf, 1000, rank);
    const char *keys[1] = {"rank0/aborted"};
    if (rank == 0) {
        pthread_t th;
        CHECK(pthread_create(&th, NULL, abort_later, state) == 0);
        /* The others are not there yet: this waits until the abort wakes it. */
        CHECK_STATUS(run_allreduce(state, 1, buf, 1000, 20000), DDP_ERR_ABORTED);
        CHECK_ERROR_MENTIONS("test abort from another thread");
        pthread_join(th, NULL);
        CHECK_OK(ddp_store_set(store, keys[0], "1", 1));
        CHECK_STATUS(run_allreduce(state, 2, buf, 1000, 20000), DDP_ERR_ABORTED);
        return 0;
    }
    CHECK_OK(ddp_store_wait(store, keys, 1, 20000));
    ddp_status_t s = run_allreduce(state, 1, buf, 1000, 20000);
    CHECK_MSG(s == DDP_ERR_REMOTE, "rank %d got %s: %s", rank, ddp_status_string(s),
              ddp_last_error());
    CHECK_ERROR_MENTIONS("test abort from another thread");
    (void)world;
    return 0;
}

/* ---- the intruder ------------------------------------------------------------------------ */
static int connect_published(const char *published)
{
    char host[64], port[16];
    CHECK(sscanf(published, "%63s %15s", host, port) == 2);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    CHECK(getaddrinfo(host, port, &hints, &res) == 0);
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    CHECK_MSG(connect(fd, res->ai_addr, res->ai_addrlen) == 0, "connect: %s", strerror(errno));
    freeaddrinfo(res);
    return fd;
}

/* The rank must close the connection (EOF or reset) without sending anything. */
static void expect_closed(int fd, const char *what)
{
    struct pollfd p = {fd, POLLIN, 0};
    CHECK_MSG(poll(&p, 1, 20000) == 1, "%s: connection not closed within 20 s", what);
    char b[16];
    ssize_t n = recv(fd, b, sizeof b, 0);
    CHECK_MSG(n <= 0, "%s: the rank answered %zd bytes instead of closing", what, n);
    close(fd);
    printf("intruder: %s refused and closed\n", what);
}

static void send_hello(int fd, const char *tok, const char *group, int from, int to, int world)
{
    char buf[2048];
    ddp__tcp_hello_t h = {DDP_TCP_HELLO_MAGIC, DDP_TCP_VERSION, from, to, world,
                          (uint32_t)strlen(tok), (uint32_t)strlen(group), 0};
    memcpy(buf, &h, sizeof h);
    memcpy(buf + sizeof h, tok, strlen(tok));
    memcpy(buf + sizeof h + strlen(tok), group, strlen(group));
    size_t len = sizeof h + strlen(tok) + strlen(group);
    CHECK(send(fd, buf, len, MSG_NOSIGNAL) == (ssize_t)len);
}

static int intruder(int world, ddp_store_t *store)
{
    int target = world - 1; /* the highest rank accepts from every other */
    char key[128];
    snprintf(key, sizeof key, "tcp-fail/tcp/addr/%d", target);
    void *v = NULL;
    size_t len = 0;
    CHECK_OK(ddp_store_get(store, key, &v, &len));
    char published[128];
    snprintf(published, sizeof published, "%s", (char *)v);
    ddp_free(v);

    int silent = connect_published(published); /* says nothing, ever */

    int fd = connect_published(published);
    const char garbage[] = "GET / HTTP/1.0\r\n\r\n\x01\x02\x03 not a hello at all, padding.....";
    CHECK(send(fd, garbage, sizeof garbage, MSG_NOSIGNAL) == (ssize_t)sizeof garbage);
    expect_closed(fd, "garbage");

    fd = connect_published(published);
    send_hello(fd, "wrong-token", "tcp-fail", 0, target, world);
    expect_closed(fd, "wrong token");

    fd = connect_published(published);
    send_hello(fd, "", "tcp-fail", 0, target, world);
    expect_closed(fd, "no token");

    fd = connect_published(published);
    send_hello(fd, token, "another-group", 0, target, world);
    expect_closed(fd, "another group");

    fd = connect_published(published);
    send_hello(fd, token, "tcp-fail", target, target, world);
    expect_closed(fd, "bad ranks");

    fd = connect_published(published);
    ddp__tcp_hello_t h = {DDP_TCP_HELLO_MAGIC, DDP_TCP_VERSION, 0, target, world, 100000, 5, 0};
    CHECK(send(fd, &h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
    expect_closed(fd, "oversized hello");

    CHECK_OK(ddp_store_set(store, "intruder/done", "1", 1));
    /* Keep the silent connection open until the ranks are done. */
    const char *keys[1] = {"ranks/done"};
    CHECK_OK(ddp_store_wait(store, keys, 1, 60000));
    close(silent);
    return 0;
}

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    int ranks = strcmp(mode, "intruder") == 0 ? world - 1 : world;
    if (rank == ranks) return intruder(ranks, store);
    if (strcmp(mode, "intruder") == 0 && rank == 0) {
        /* Rank 0 connects last, so the last rank is still accepting while the stranger calls. */
        const char *keys[1] = {"intruder/done"};
        CHECK_OK(ddp_store_wait(store, keys, 1, 60000));
    }
    void *state = NULL;
    if (strcmp(mode, "ifname") == 0) {
        setenv("DDP_SOCKET_IFNAME", "nosuchif0", 1);
        CHECK_STATUS(ddp__transport_tcp.create(store, "tcp-fail-bad", rank, ranks, 5000, &state),
                     DDP_ERR_NOT_FOUND);
        CHECK_ERROR_MENTIONS("DDP_SOCKET_IFNAME=nosuchif0");
        setenv("DDP_SOCKET_IFNAME", "lo", 1);
    }
    CHECK_OK(ddp__transport_tcp.create(store, "tcp-fail", rank, ranks, 60000, &state));
    int rc = 0;
    if (strcmp(mode, "mismatch") == 0) rc = mismatch(rank, ranks, state);
    else if (strcmp(mode, "timeout") == 0) rc = timeout(rank, ranks, state);
    else if (strcmp(mode, "kill") == 0) rc = killed(rank, ranks, state);
    else if (strcmp(mode, "abort") == 0) rc = aborted(rank, ranks, state, store);
    else {
        float buf[1001];
        fill(buf, 1001, rank);
        CHECK_OK(run_allreduce(state, 1, buf, 1001, 20000));
        check_sum(buf, 1001, ranks);
        int64_t n = 0;
        CHECK_OK(ddp_store_add(store, "ranks/finished", 1, &n));
        if (n == ranks) CHECK_OK(ddp_store_set(store, "ranks/done", "1", 1));
    }
    ddp__transport_tcp.destroy(state);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_tcp_failures WORLD mismatch|timeout|kill|intruder|ifname|abort\n");
        return 2;
    }
    int world = atoi(argv[1]);
    mode = argv[2];
    setenv("DDP_STORE_TOKEN", token, 1);
    int procs = strcmp(mode, "intruder") == 0 ? world + 1 : world;
    return ddp_test_run_ranks(procs, 90, rank_main, NULL);
}
