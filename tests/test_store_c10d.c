/* The c10d TCPStore client against a real torch.distributed.TCPStore (tests/c10d_store_host.py,
 * run by the python3 that has torch), and the probe that tells the protocols apart.
 *   ops        every operation of the subset, values crossing between Python and C both ways,
 *              timeouts naming the missing key, a blocked get beside other calls
 *   group      3 ranks started the way torchrun starts workers (RANK, WORLD_SIZE, MASTER_ADDR,
 *              MASTER_PORT naming the c10d store, no libddp store) form a group over shm
 *   restart    a torchrun restart on the same store after a half-done attempt (its keys are
 *              prefixed by TORCHELASTIC_RESTART_COUNT)
 *   recognise  ddp_store_tcp_connect to a c10d store fails at once naming c10d (long and empty
 *              token); ddp_store_c10d_connect to a libddp store fails at once naming it;
 *              ddp_store_connect picks the right client for both, and names a server that
 *              speaks neither within seconds */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#ifndef PYTHON_WITH_TORCH
#define PYTHON_WITH_TORCH "/usr/bin/python3"
#endif

typedef struct host {
    pid_t pid;
    int to_host; /* its stdin: closing it ends the host */
    int port;
} host_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static host_t start_host(int check)
{
    int in[2], out[2];
    CHECK(pipe(in) == 0 && pipe(out) == 0);
    host_t h = {0};
    h.pid = fork();
    CHECK(h.pid >= 0);
    if (h.pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed test must not leave the store running */
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[1]);
        close(out[0]);
        /* C10D_PYTHON picks another torch's server (tests/c10d.cmake runs the cases once per
         * torch: 1.x's protocol and 2.x's). */
        const char *python = getenv("C10D_PYTHON") ? getenv("C10D_PYTHON") : PYTHON_WITH_TORCH;
        execlp(python, python, C10D_HOST_SCRIPT, check ? "--check" : NULL, (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    h.to_host = in[1];
    char line[64] = "";
    size_t n = 0;
    while (n < sizeof line - 1) {
        ssize_t r = read(out[0], line + n, 1);
        if (r <= 0 || line[n] == '\n') break;
        n++;
    }
    line[n] = '\0';
    close(out[0]);
    h.port = atoi(line);
    CHECK_MSG(h.port > 0, "the c10d store host printed '%s'", line);
    return h;
}

/* Ends the host; returns its exit code. */
static int stop_host(host_t *h)
{
    close(h->to_host);
    int status = 0;
    CHECK(waitpid(h->pid, &status, 0) == h->pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void check_value(ddp_store_t *s, const char *key, const char *want)
{
    void *v = NULL;
    size_t len = 0;
    CHECK_OK(ddp_store_get(s, key, &v, &len));
    CHECK_MSG(len == strlen(want) && memcmp(v, want, len) == 0, "%s is '%.*s', not '%s'", key,
              (int)len, (const char *)v, want);
    ddp_free(v);
}

typedef struct late_get {
    ddp_store_t *store;
    ddp_status_t status;
} late_get_t;

static void *get_late(void *arg)
{
    late_get_t *g = arg;
    void *v = NULL;
    size_t len = 0;
    g->status = ddp_store_get(g->store, "late", &v, &len);
    if (g->status == DDP_OK && (len != 4 || memcmp(v, "here", 4) != 0)) g->status = DDP_ERR_MISMATCH;
    ddp_free(v);
    return NULL;
}

static void test_ops(void)
{
    host_t h = start_host(1);
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_c10d_connect("127.0.0.1", h.port, 20000, &s));
    check_value(s, "from_py", "hello from python");
    CHECK_OK(ddp_store_set(s, "from_c", "hello from C", 12));
    check_value(s, "from_c", "hello from C");

    int64_t v = 0;
    CHECK_OK(ddp_store_add(s, "counter", 5, &v));
    CHECK(v == 5);
    CHECK_OK(ddp_store_add(s, "counter", 37, &v));
    CHECK(v == 42);
    check_value(s, "counter", "42"); /* kept as decimal text, as libddp's stores keep it */

    /* compare_set: a missing key with an empty expected value is set; a match replaces; a
     * mismatch leaves the value and returns it. */
    void *cur = NULL;
    size_t cur_len = 0;
    CHECK_OK(ddp_store_compare_set(s, "cas", NULL, 0, "one", 3, &cur, &cur_len));
    CHECK(cur_len == 3 && memcmp(cur, "one", 3) == 0);
    ddp_free(cur);
    CHECK_OK(ddp_store_compare_set(s, "cas", "one", 3, "two", 3, &cur, &cur_len));
    CHECK(cur_len == 3 && memcmp(cur, "two", 3) == 0);
    ddp_free(cur);
    CHECK_OK(ddp_store_compare_set(s, "cas", "zzz", 3, "three", 5, &cur, &cur_len));
    CHECK(cur_len == 3 && memcmp(cur, "two", 3) == 0);
    ddp_free(cur);

    int all = -1;
    const char *both[] = {"from_py", "from_c"};
    CHECK_OK(ddp_store_check(s, both, 2, &all));
    CHECK(all == 1);
    const char *some[] = {"from_py", "nope"};
    CHECK_OK(ddp_store_check(s, some, 2, &all));
    CHECK(all == 0);
    CHECK_OK(ddp_store_wait(s, both, 2, 5000));

    /* A wait that cannot be met times out in its time and names the missing key only; the
     * handle keeps working afterwards. */
    double t0 = now_s();
    CHECK_STATUS(ddp_store_wait(s, some, 2, 300), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("'nope'");
    CHECK_MSG(strstr(ddp_last_error(), "'from_py'") == NULL, "names a present key: %s",
              ddp_last_error());
    void *val = NULL;
    size_t len = 0;
    CHECK_OK(ddp_store_set_timeout(s, 300));
    CHECK_STATUS(ddp_store_get(s, "nope", &val, &len), DDP_ERR_TIMEOUT);
    CHECK_OK(ddp_store_set_timeout(s, 20000));
    CHECK_MSG(now_s() - t0 < 5, "two 300 ms timeouts took %.1f s", now_s() - t0);
    check_value(s, "from_py", "hello from python");

    /* A get blocked on a missing key does not hold up the handle's other calls. */
    late_get_t g = {.store = s, .status = DDP_ERR_REMOTE};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, get_late, &g) == 0);
    usleep(200000);
    check_value(s, "from_c", "hello from C");
    CHECK_OK(ddp_store_set(s, "late", "here", 4));
    pthread_join(th, NULL);
    CHECK_OK(g.status);

    int deleted = -1;
    CHECK_OK(ddp_store_set(s, "deleted_by_c", "x", 1));
    CHECK_OK(ddp_store_delete(s, "deleted_by_c", &deleted));
    CHECK(deleted == 1);
    CHECK_OK(ddp_store_delete(s, "deleted_by_c", &deleted));
    CHECK(deleted == 0);
    int64_t keys = 0;
    CHECK_OK(ddp_store_num_keys(s, &keys));
    CHECK_MSG(keys >= 5, "num_keys %lld", (long long)keys); /* from_py from_c counter cas late */

    /* ddp_store_connect finds the same store by itself. */
    ddp_store_t *auto_store = NULL;
    CHECK_OK(ddp_store_connect("127.0.0.1", h.port, "unused-token", 20000, &auto_store));
    check_value(auto_store, "from_c", "hello from C");
    ddp_store_destroy(auto_store);
    ddp_store_destroy(s);
    int code = stop_host(&h);
    CHECK_MSG(code == 0, "the Python side of the store saw wrong values (exit %d)", code);
    printf("ops: ok\n");
}

/* One rank started as torchrun starts a worker. */
static int group_rank(int rank, int world, int port)
{
    char text[32];
    unsetenv("DDP_STORE_ADDR");
    unsetenv("DDP_STORE_PORT");
    unsetenv("DDP_STORE_TOKEN");
    unsetenv("DDP_TRANSPORT");
    snprintf(text, sizeof text, "%d", rank);
    setenv("RANK", text, 1);
    setenv("LOCAL_RANK", text, 1);
    snprintf(text, sizeof text, "%d", world);
    setenv("WORLD_SIZE", text, 1);
    setenv("LOCAL_WORLD_SIZE", text, 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    snprintf(text, sizeof text, "%d", port);
    setenv("MASTER_PORT", text, 1);
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(NULL, &g));
    CHECK_MSG(strcmp(ddp_group_transport(g), "shm") == 0, "transport %s", ddp_group_transport(g));
    float x[1000];
    for (int i = 0; i < 1000; i++) x[i] = (float)(rank + 1) * (float)i;
    CHECK_OK(ddp_group_allreduce(g, x, x, 1000, DDP_F32, DDP_SUM));
    float factor = (float)(world * (world + 1) / 2);
    for (int i = 0; i < 1000; i++) CHECK(x[i] == factor * (float)i);
    ddp_group_destroy(g);
    return 0;
}

static void test_group(void)
{
    host_t h = start_host(0);
    enum { WORLD = 3 };
    pid_t pids[WORLD];
    for (int r = 0; r < WORLD; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(60);
            _exit(group_rank(r, WORLD, h.port));
        }
    }
    for (int r = 0; r < WORLD; r++) {
        int status = 0;
        CHECK(waitpid(pids[r], &status, 0) == pids[r]);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d failed (status %d)", r,
                  status);
    }
    CHECK(stop_host(&h) == 0);
    printf("group: 3 ranks over shm through a c10d TCPStore: ok\n");
}

/* torchrun restarts workers on the same store: attempt 0's rank 0 bumps the group's instance
 * counter and dies before rank 1 arrives; attempt 1's two ranks must still meet (each attempt's
 * keys under their own prefix, from TORCHELASTIC_RESTART_COUNT), not disagree on the instance
 * and wait out the timeout. */
static void test_restart(void)
{
    host_t h = start_host(0);
    setenv("DDP_TIMEOUT", "20", 1);
    setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
    pid_t lone = fork();
    CHECK(lone >= 0);
    if (lone == 0) {
        alarm(60);
        _exit(group_rank(0, 2, h.port));
    }
    usleep(1500000); /* it has connected and counted itself by now; it waits for rank 1 */
    kill(lone, SIGKILL);
    waitpid(lone, NULL, 0);

    setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
    double t0 = now_s();
    pid_t pids[2];
    for (int r = 0; r < 2; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(60);
            _exit(group_rank(r, 2, h.port));
        }
    }
    for (int r = 0; r < 2; r++) {
        int status = 0;
        CHECK(waitpid(pids[r], &status, 0) == pids[r]);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "attempt 1 rank %d failed (status %d)", r, status);
    }
    CHECK_MSG(now_s() - t0 < 15, "attempt 1 took %.1f s", now_s() - t0);
    CHECK(stop_host(&h) == 0);
    printf("restart: attempt 1 met after attempt 0 died half-way: ok (%.1f s)\n", now_s() - t0);
}

static void test_recognise(void)
{
    host_t h = start_host(0);
    /* A libddp client meeting a c10d store: named at once, whatever the token's length (a long
     * one makes c10d drop the connection, an empty one makes it wait for more bytes). */
    const char *tokens[] = {"0123456789abcdef0123456789abcdef", ""};
    for (int i = 0; i < 2; i++) {
        ddp_store_t *s = NULL;
        double t0 = now_s();
        CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", h.port, tokens[i], 60000, &s),
                     DDP_ERR_PROTOCOL);
        CHECK_ERROR_MENTIONS("c10d");
        double took = now_s() - t0;
        CHECK_MSG(took < 10, "recognised after %.1f s", took);
        printf("recognise: libddp client -> c10d store (token of %zu bytes): %.2f s: %s\n",
               strlen(tokens[i]), took, ddp_last_error());
    }
    CHECK(stop_host(&h) == 0);

    /* A c10d client meeting a libddp store: named at once; ddp_store_connect uses it. */
    ddp_store_server_t *server = NULL;
    CHECK_OK(ddp_store_server_start("127.0.0.1", 0, "tok", &server));
    int port = ddp_store_server_port(server);
    ddp_store_t *s = NULL;
    double t0 = now_s();
    CHECK_STATUS(ddp_store_c10d_connect("127.0.0.1", port, 60000, &s), DDP_ERR_PROTOCOL);
    CHECK_ERROR_MENTIONS("libddp store");
    CHECK(now_s() - t0 < 5);
    CHECK_OK(ddp_store_connect("127.0.0.1", port, "tok", 20000, &s));
    CHECK_OK(ddp_store_set(s, "k", "v", 1));
    check_value(s, "k", "v");
    ddp_store_destroy(s);
    ddp_store_server_stop(server);

    /* A server that accepts and never answers (a listening socket nobody serves). */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, 8) == 0);
    socklen_t sl = sizeof sa;
    CHECK(getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
    t0 = now_s();
    CHECK_STATUS(ddp_store_connect("127.0.0.1", ntohs(sa.sin_port), "tok", 60000, &s),
                 DDP_ERR_PROTOCOL);
    CHECK_ERROR_MENTIONS("neither");
    double took = now_s() - t0;
    CHECK_MSG(took < 15, "a silent server named after %.1f s", took);
    printf("recognise: silent server named after %.1f s: %s\n", took, ddp_last_error());
    close(fd);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    const char *which = argc > 1 ? argv[1] : "ops";
    if (strcmp(which, "ops") == 0) test_ops();
    else if (strcmp(which, "group") == 0) test_group();
    else if (strcmp(which, "recognise") == 0) test_recognise();
    else if (strcmp(which, "restart") == 0) test_restart();
    else {
        fprintf(stderr, "usage: test_store_c10d ops|group|recognise|restart\n");
        return 2;
    }
    return 0;
}
