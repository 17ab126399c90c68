/* The TCP store server under hostile and broken clients: random bytes, oversized and zero length
 * prefixes, truncated frames, clients stalled mid-frame, malformed requests, a client that never
 * reads its replies, a parked waiter that vanishes, a wrong or missing token. Each must close (or
 * merely idle) only its own connection while a well-behaved client keeps working throughout. Also
 * connect retries before the server is up, and a parked get when the server stops. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store/tcp_frame.h"
#include "test_store_common.h"

#define TOKEN "abuse-token"

static int port;
static atomic_int stop_good;
static atomic_long good_ops;

/* ---- raw sockets ------------------------------------------------------------------------- */

static int raw_connect(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    return fd;
}

static void raw_send(int fd, const void *data, size_t len)
{
    const char *p = data;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return; /* the server may already have closed us: fine */
        p += n;
        len -= (size_t)n;
    }
}

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Sends a frame whose length prefix is `claimed` followed by `len` payload bytes. */
static void raw_frame(int fd, uint32_t claimed, const void *payload, size_t len)
{
    uint8_t h[4];
    put32(h, claimed);
    raw_send(fd, h, 4);
    if (len) raw_send(fd, payload, len);
}

/* Reads one reply frame; returns its result byte (0 ok, 1 error) or -1 if the connection
 * closed. */
static int raw_reply(int fd)
{
    uint8_t h[4];
    size_t got = 0;
    while (got < 4) {
        ssize_t n = recv(fd, h + got, 4 - got, 0);
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    uint32_t len = ddp__load_u32(h);
    CHECK(len >= 1 && len < (1u << 26));
    uint8_t *p = malloc(len);
    CHECK(p);
    got = 0;
    while (got < len) {
        ssize_t n = recv(fd, p + got, len - got, 0);
        if (n <= 0) {
            free(p);
            return -1;
        }
        got += (size_t)n;
    }
    int r = p[0];
    free(p);
    return r;
}

static int raw_authenticated(void)
{
    int fd = raw_connect();
    uint8_t payload[1 + sizeof TOKEN];
    payload[0] = DDP__STORE_OP_AUTH;
    memcpy(payload + 1, TOKEN, sizeof TOKEN - 1);
    raw_frame(fd, sizeof payload - 1, payload, sizeof payload - 1);
    CHECK(raw_reply(fd) == DDP__STORE_REPLY_OK);
    return fd;
}

/* The server must close this connection (replies before the close are skipped). Waits at most
 * 20 s so a broken server fails the test instead of hanging it. */
static void expect_closed(int fd, const char *what)
{
    char buf[65536];
    for (int waited = 0; waited < 20000;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int n = poll(&p, 1, 100);
        if (n == 0) {
            waited += 100;
            continue;
        }
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno == ECONNRESET)) {
            close(fd);
            return;
        }
    }
    CHECK_MSG(0, "server did not close the connection after: %s", what);
}

/* ---- the well-behaved client ------------------------------------------------------------- */

/* Set/get/add/compare_set/wait through a proper client; any failure ends the test. The store's
 * timeout (5 s) is what "promptly" means: a stalled server turns into DDP_ERR_TIMEOUT here. */
/* `who` keeps each client's keys apart: two clients writing one key would race each other's
 * read-back. */
static void good_round(ddp_store_t *s, const char *who, long i)
{
    char key[64], val[64];
    snprintf(key, sizeof key, "%s/%ld", who, i % 50);
    int n = snprintf(val, sizeof val, "value-%ld", i);
    CHECK_OK(ddp_store_set(s, key, val, (size_t)n));
    expect_value(s, key, val, (size_t)n);
    int64_t r = 0;
    CHECK_OK(ddp_store_add(s, "good-counter", 1, &r));
    const char *keys[1] = {key};
    CHECK_OK(ddp_store_wait(s, keys, 1, 0));
    atomic_fetch_add(&good_ops, 1);
}

static void *good_client(void *arg)
{
    (void)arg;
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, TOKEN, 5000, &s));
    for (long i = 0; !atomic_load(&stop_good); i++) {
        good_round(s, "good", i);
        store_sleep_ms(2);
    }
    ddp_store_destroy(s);
    return NULL;
}

/* A fresh client does one round right now: the server still serves new connections. */
static void fresh_client_works(void)
{
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, TOKEN, 5000, &s));
    good_round(s, "fresh", 1000);
    ddp_store_destroy(s);
}

/* ---- the abuse --------------------------------------------------------------------------- */

static unsigned long long rng = 12345;

static uint8_t random_byte(void) { return (uint8_t)((ddp_test_random(&rng) + 1.0) * 127.9); }

static void random_garbage(void)
{
    for (int i = 0; i < 40; i++) {
        int fd = i % 2 ? raw_authenticated() : raw_connect();
        size_t len = 1 + (size_t)((ddp_test_random(&rng) + 1.0) * 3000);
        uint8_t *junk = malloc(len);
        CHECK(junk);
        for (size_t j = 0; j < len; j++) junk[j] = random_byte();
        if (i % 4 == 3) {
            /* Random content in a well-formed frame: decoding must reject it safely (or accept a
             * lucky valid request). */
            raw_frame(fd, (uint32_t)len, junk, len);
        } else {
            raw_send(fd, junk, len);
        }
        free(junk);
        shutdown(fd, SHUT_WR); /* whatever was incomplete is now truncated for good */
        expect_closed(fd, "random bytes");
    }
}

static void bad_lengths(void)
{
    int fd = raw_connect();
    raw_frame(fd, 0xFFFFFFFFu, NULL, 0);
    expect_closed(fd, "length 0xFFFFFFFF before authentication");

    fd = raw_connect();
    raw_frame(fd, DDP__STORE_MAX_AUTH_FRAME + 1, NULL, 0);
    expect_closed(fd, "length above the authentication limit");

    fd = raw_authenticated();
    raw_frame(fd, DDP__STORE_MAX_FRAME + 1, NULL, 0);
    expect_closed(fd, "length above the frame limit after authentication");

    fd = raw_authenticated();
    raw_frame(fd, 0, NULL, 0);
    expect_closed(fd, "zero length frame");
}

static void malformed_requests(void)
{
    struct {
        const char *what;
        uint8_t bytes[32];
        size_t len;
    } cases[] = {
        {"unknown op", {0x77}, 1},
        {"SET key length beyond the frame", {DDP__STORE_OP_SET, 0, 0, 1, 0, 'k'}, 6},
        {"key with a NUL", {DDP__STORE_OP_DELETE, 0, 0, 0, 3, 'a', 0, 'b'}, 8},
        {"GET truncated timeout", {DDP__STORE_OP_GET, 0, 0}, 3},
        {"DELETE with trailing bytes", {DDP__STORE_OP_DELETE, 0, 0, 0, 1, 'k', 9}, 7},
        {"WAIT with 2^32-1 keys", {DDP__STORE_OP_WAIT, 0, 0, 0, 10, 0xff, 0xff, 0xff, 0xff}, 9},
        {"CHECK with 0 keys", {DDP__STORE_OP_CHECK, 0, 0, 0, 0}, 5},
        {"ADD truncated delta", {DDP__STORE_OP_ADD, 1, 2, 3}, 4},
        {"COMPARE_SET expected beyond the frame",
         {DDP__STORE_OP_COMPARE_SET, 0, 0, 0, 1, 'k', 0, 0, 1, 0}, 10},
        {"empty key count", {DDP__STORE_OP_NUM_KEYS, 1}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = raw_authenticated();
        raw_frame(fd, (uint32_t)cases[i].len, cases[i].bytes, cases[i].len);
        expect_closed(fd, cases[i].what); /* without a shutdown: the server closes by itself */
    }
    /* A request before AUTH. */
    int fd = raw_connect();
    uint8_t num_keys = DDP__STORE_OP_NUM_KEYS;
    raw_frame(fd, 1, &num_keys, 1);
    expect_closed(fd, "a request before AUTH");
}

/* Connections that stop mid-frame and stay open: the server just waits on them. Returned so the
 * caller can close them at the end, after the good client has worked around them. */
static int stalled[4];

static void stall_mid_frame(void)
{
    uint8_t partial[10] = {DDP__STORE_OP_SET, 0, 0, 0, 50};
    stalled[0] = raw_authenticated();
    raw_frame(stalled[0], 100, partial, sizeof partial);
    stalled[1] = raw_connect();
    raw_send(stalled[1], "\0\0", 2); /* half a length prefix */
    stalled[2] = raw_connect();       /* connected, silent */
    /* A huge (allowed) frame of which only the start arrives. */
    stalled[3] = raw_authenticated();
    raw_frame(stalled[3], DDP__STORE_MAX_FRAME, partial, sizeof partial);
}

/* Asks for a large value repeatedly and never reads: the server must buffer, not block. */
static int slow_reader;

static void never_reads(void)
{
    size_t len = 16u << 20;
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, TOKEN, 5000, &s));
    char *big = malloc(len);
    CHECK(big);
    memset(big, 'B', len);
    CHECK_OK(ddp_store_set(s, "big", big, len));
    free(big);
    ddp_store_destroy(s);

    slow_reader = raw_authenticated();
    uint8_t get[13] = {DDP__STORE_OP_GET, 0, 0, 0x13, 0x88, 0, 0, 0, 3, 'b', 'i', 'g'};
    for (int i = 0; i < 4; i++) raw_frame(slow_reader, 12, get, 12);
}

/* A get parked server-side whose client disappears; the later set must not trip over it. */
static void vanished_waiter(void)
{
    int fd = raw_authenticated();
    uint8_t get[16] = {DDP__STORE_OP_GET, 0, 0, 0xea, 0x60, 0, 0, 0, 6, 'v', 'a', 'n', 'i', 's', 'h', 0};
    raw_frame(fd, 15, get, 15);
    store_sleep_ms(50);
    close(fd);
    store_sleep_ms(50);
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, TOKEN, 5000, &s));
    CHECK_OK(ddp_store_set(s, "vanish", "x", 1));
    expect_value(s, "vanish", "x", 1);
    ddp_store_destroy(s);
}

static void wrong_tokens(void)
{
    ddp_store_t *s = NULL;
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", port, "not-the-token", 5000, &s),
                 DDP_ERR_PROTOCOL);
    CHECK_ERROR_MENTIONS("token");
    CHECK(s == NULL);
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", port, NULL, 5000, &s), DDP_ERR_PROTOCOL);
    CHECK_ERROR_MENTIONS("token");
    /* One byte short, one byte long: the comparison covers lengths too. */
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", port, "abuse-toke", 5000, &s),
                 DDP_ERR_PROTOCOL);
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", port, TOKEN "n", 5000, &s), DDP_ERR_PROTOCOL);
    /* A raw client with the wrong token gets an error reply, then the close. */
    int fd = raw_connect();
    uint8_t payload[6] = {DDP__STORE_OP_AUTH, 'w', 'r', 'o', 'n', 'g'};
    raw_frame(fd, 6, payload, 6);
    CHECK(raw_reply(fd) == DDP__STORE_REPLY_ERROR);
    expect_closed(fd, "a wrong token");
}

/* ---- scenarios around the server's lifetime ---------------------------------------------- */

struct delayed_server {
    int port;
    ddp_store_server_t *server;
};

static void *start_later(void *arg)
{
    struct delayed_server *d = arg;
    store_sleep_ms(300);
    CHECK_OK(ddp_store_server_start("127.0.0.1", d->port, NULL, &d->server));
    return NULL;
}

static void connect_retries_until_up(void)
{
    /* Find a free port, then leave it free for a moment. */
    ddp_store_server_t *probe = NULL;
    CHECK_OK(ddp_store_server_start(NULL, 0, NULL, &probe));
    struct delayed_server d = {ddp_store_server_port(probe), NULL};
    ddp_store_server_stop(probe);

    ddp_store_t *s = NULL;
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", d.port, NULL, 200, &s), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("could not connect");

    pthread_t t;
    CHECK(pthread_create(&t, NULL, start_later, &d) == 0);
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", d.port, NULL, 20000, &s));
    pthread_join(t, NULL);
    /* No token on the server: any token is accepted. */
    ddp_store_t *s2 = NULL;
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", d.port, "anything", 5000, &s2));
    CHECK_OK(ddp_store_set(s, "k", "v", 1));
    expect_value(s2, "k", "v", 1);
    ddp_store_destroy(s2);
    ddp_store_destroy(s);
    ddp_store_server_stop(d.server);
}

struct parked {
    ddp_store_t *store;
    ddp_status_t status;
};

static void *parked_get(void *arg)
{
    struct parked *p = arg;
    void *v = NULL;
    size_t n = 0;
    p->status = ddp_store_get(p->store, "never-set", &v, &n);
    return NULL;
}

static void server_stops_under_a_waiter(void)
{
    ddp_store_server_t *server = NULL;
    CHECK_OK(ddp_store_server_start(NULL, 0, NULL, &server));
    struct parked p = {NULL, DDP_OK};
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", ddp_store_server_port(server), NULL, 60000,
                                   &p.store));
    pthread_t t;
    CHECK(pthread_create(&t, NULL, parked_get, &p) == 0);
    store_sleep_ms(200);
    ddp_store_server_stop(server);
    pthread_join(t, NULL); /* would take 60 s if the client did not notice */
    CHECK_STATUS(p.status, DDP_ERR_REMOTE);
    ddp_store_destroy(p.store);
}

/* A server out of file descriptors keeps serving its connections, and accepts again once some
 * close. It runs in a child with a low descriptor limit; its CPU time while connections wait in
 * the accept queue is printed (a spinning accept loop would burn a whole core). */
static void out_of_descriptors(void)
{
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit rl = {24, 24};
        CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
        ddp_store_server_t *server = NULL;
        CHECK_OK(ddp_store_server_start(NULL, 0, TOKEN, &server));
        int p = ddp_store_server_port(server);
        CHECK(write(to_parent[1], &p, sizeof p) == (ssize_t)sizeof p);
        char done;
        CHECK(read(to_child[0], &done, 1) == 1); /* the parent says when */
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        printf("out_of_descriptors: server process used %.3f s of CPU\n",
               (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
                   ru.ru_stime.tv_usec / 1e6);
        fflush(stdout);
        ddp_store_server_stop(server);
        _exit(0);
    }
    CHECK(read(to_parent[0], &port, sizeof port) == (ssize_t)sizeof port);
    enum { FLOOD = 40 };
    int fds[FLOOD];
    for (int i = 0; i < FLOOD; i++) fds[i] = raw_connect(); /* more than the server can accept */
    store_sleep_ms(500);
    for (int i = 0; i < FLOOD; i++) close(fds[i]);
    store_sleep_ms(300);
    fresh_client_works(); /* accepted once descriptors are free again */
    CHECK(write(to_child[1], "x", 1) == 1);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(to_child[0]);
    close(to_child[1]);
    close(to_parent[0]);
    close(to_parent[1]);
}

int main(void)
{
    ddp_store_server_t *server = NULL;
    CHECK_OK(ddp_store_server_start(NULL, 0, TOKEN, &server));
    port = ddp_store_server_port(server);

    pthread_t good;
    CHECK(pthread_create(&good, NULL, good_client, NULL) == 0);

    stall_mid_frame();
    random_garbage();
    fresh_client_works();
    bad_lengths();
    malformed_requests();
    fresh_client_works();
    never_reads();
    vanished_waiter();
    wrong_tokens();
    fresh_client_works();
    /* The stalled clients go away mid-frame. */
    for (int i = 0; i < 4; i++) close(stalled[i]);
    close(slow_reader);
    fresh_client_works();

    atomic_store(&stop_good, 1);
    pthread_join(good, NULL);
    CHECK(atomic_load(&good_ops) > 0);
    ddp_store_server_stop(server);

    connect_retries_until_up();
    server_stops_under_a_waiter();
    out_of_descriptors();
    printf("test_store_tcp_abuse: ok (%ld good rounds alongside)\n", atomic_load(&good_ops));
    return 0;
}
