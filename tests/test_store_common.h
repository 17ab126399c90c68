/* Checks shared by the store tests: the single-process semantics every store must have, and the
 * body one rank runs against a store shared by several processes (or threads). Header-only so each
 * test program stays one file plus this. */
#ifndef DDP_TEST_STORE_COMMON_H
#define DDP_TEST_STORE_COMMON_H

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static inline void store_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* get must return exactly `want` (len bytes) with a NUL one past the end. */
static inline void expect_value(ddp_store_t *s, const char *key, const void *want, size_t len)
{
    void *v = NULL;
    size_t n = 12345;
    CHECK_OK(ddp_store_get(s, key, &v, &n));
    CHECK_MSG(n == len, "key %s: got %zu bytes, want %zu", key, n, len);
    CHECK_MSG(len == 0 || memcmp(v, want, len) == 0, "key %s: value differs", key);
    CHECK(((char *)v)[n] == 0);
    ddp_free(v);
}

static inline int64_t value_as_int(ddp_store_t *s, const char *key)
{
    void *v = NULL;
    size_t n = 0;
    CHECK_OK(ddp_store_get(s, key, &v, &n));
    char *end = NULL;
    long long x = strtoll(v, &end, 10);
    CHECK_MSG(end == (char *)v + n, "key %s holds '%s', not a decimal integer", key, (char *)v);
    ddp_free(v);
    return x;
}

static inline int key_exists(ddp_store_t *s, const char *key)
{
    int all = -1;
    CHECK_OK(ddp_store_check(s, &key, 1, &all));
    CHECK(all == 0 || all == 1);
    return all;
}

/* Everything a store must do, from one process. `tag` keeps keys apart when several suites share
 * one base store; max_key is the longest key the store takes (DDP_STORE_MAX_KEY minus what a
 * prefix store adds). Leaves the store's timeout at a few seconds. */
static inline void store_semantics(ddp_store_t *s, const char *tag, size_t max_key)
{
    char k[256], k2[256];
    CHECK_OK(ddp_store_set_timeout(s, 5000));
    CHECK(ddp_store_timeout(s) == 5000);

    /* set/get round trips: sizes 0, 1, odd, prime, large (not a multiple of anything). */
    static const size_t sizes[] = {0, 1, 7, 13, 4096, (1u << 20) + 3};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        unsigned char *buf = malloc(n + 1);
        CHECK(buf);
        for (size_t j = 0; j < n; j++) buf[j] = (unsigned char)(j * 31 + i + 1); /* has NULs */
        snprintf(k, sizeof k, "%s/value/%zu", tag, n);
        CHECK_OK(ddp_store_set(s, k, buf, n));
        expect_value(s, k, buf, n);
        free(buf);
    }
    /* Overwrite with a shorter value. */
    snprintf(k, sizeof k, "%s/value/13", tag);
    CHECK_OK(ddp_store_set(s, k, "xy", 2));
    expect_value(s, k, "xy", 2);
    /* A NULL value of length 0 is the empty value. */
    CHECK_OK(ddp_store_set(s, k, NULL, 0));
    expect_value(s, k, "", 0);

    /* add keeps decimal text; missing counts as 0. */
    int64_t r = 0;
    snprintf(k, sizeof k, "%s/counter", tag);
    CHECK_OK(ddp_store_add(s, k, 5, &r));
    CHECK(r == 5);
    expect_value(s, k, "5", 1);
    CHECK_OK(ddp_store_add(s, k, -12, &r));
    CHECK(r == -7);
    expect_value(s, k, "-7", 2);
    CHECK_OK(ddp_store_add(s, k, 0, &r));
    CHECK(r == -7);
    CHECK_OK(ddp_store_set(s, k, "100", 3));
    CHECK_OK(ddp_store_add(s, k, 1, &r));
    CHECK(r == 101);
    CHECK_OK(ddp_store_add(s, k, INT64_MAX - 101, &r));
    CHECK(r == INT64_MAX);
    CHECK_STATUS(ddp_store_add(s, k, 1, &r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS(k);
    snprintf(k, sizeof k, "%s/not-a-number", tag);
    CHECK_OK(ddp_store_set(s, k, "12abc", 5));
    CHECK_STATUS(ddp_store_add(s, k, 1, &r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("not a decimal integer");
    CHECK_ERROR_MENTIONS(k);
    expect_value(s, k, "12abc", 5); /* untouched */

    /* compare_set. */
    void *cur = NULL;
    size_t cur_len = 0;
    snprintf(k, sizeof k, "%s/cas", tag);
    /* Missing key, non-empty expected: nothing is set; the empty value comes back. */
    CHECK_OK(ddp_store_compare_set(s, k, "zz", 2, "first", 5, &cur, &cur_len));
    CHECK(cur_len == 0 && ((char *)cur)[0] == 0);
    ddp_free(cur);
    CHECK(!key_exists(s, k));
    /* Missing key, empty expected: set. */
    CHECK_OK(ddp_store_compare_set(s, k, NULL, 0, "first", 5, &cur, &cur_len));
    CHECK(cur_len == 5 && memcmp(cur, "first", 5) == 0);
    ddp_free(cur);
    /* Wrong expected: unchanged, the current value returned. */
    CHECK_OK(ddp_store_compare_set(s, k, "firs", 4, "second", 6, &cur, &cur_len));
    CHECK(cur_len == 5 && memcmp(cur, "first", 5) == 0);
    ddp_free(cur);
    CHECK_OK(ddp_store_compare_set(s, k, NULL, 0, "second", 6, &cur, &cur_len));
    CHECK(cur_len == 5 && memcmp(cur, "first", 5) == 0);
    ddp_free(cur);
    /* Right expected: swapped. */
    CHECK_OK(ddp_store_compare_set(s, k, "first", 5, "second", 6, &cur, &cur_len));
    CHECK(cur_len == 6 && memcmp(cur, "second", 6) == 0);
    ddp_free(cur);
    expect_value(s, k, "second", 6);

    /* check, delete, num_keys. */
    snprintf(k, sizeof k, "%s/present", tag);
    snprintf(k2, sizeof k2, "%s/absent", tag);
    CHECK_OK(ddp_store_set(s, k, "1", 1));
    const char *both[2] = {k, k2};
    int all = -1;
    CHECK_OK(ddp_store_check(s, both, 2, &all));
    CHECK(all == 0);
    CHECK_OK(ddp_store_check(s, both, 1, &all));
    CHECK(all == 1);
    CHECK_OK(ddp_store_check(s, both, 0, &all));
    CHECK(all == 1);
    int64_t before = -1, after = -1;
    CHECK_OK(ddp_store_num_keys(s, &before));
    CHECK(before >= 1);
    int deleted = -1;
    CHECK_OK(ddp_store_delete(s, k, &deleted));
    CHECK(deleted == 1);
    CHECK_OK(ddp_store_num_keys(s, &after));
    CHECK_MSG(after == before - 1, "num_keys %" PRId64 " -> %" PRId64, before, after);
    CHECK_OK(ddp_store_delete(s, k, &deleted));
    CHECK(deleted == 0);
    CHECK_OK(ddp_store_delete(s, k, NULL));
    CHECK(!key_exists(s, k));
    CHECK_OK(ddp_store_set(s, k, "back", 4)); /* a deleted key can come back */
    expect_value(s, k, "back", 4);
    CHECK_OK(ddp_store_num_keys(s, &after));
    CHECK(after == before);

    /* Timeouts name exactly the missing keys. */
    CHECK_STATUS(ddp_store_wait(s, both, 2, 50), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS(k2);
    char quoted[300];
    snprintf(quoted, sizeof quoted, "'%s'", k);
    CHECK_MSG(strstr(ddp_last_error(), quoted) == NULL, "'%s' names present key %s",
              ddp_last_error(), k);
    CHECK_OK(ddp_store_wait(s, both, 1, 50));
    CHECK_OK(ddp_store_wait(s, both, 0, 50));
    CHECK_OK(ddp_store_set_timeout(s, 60));
    void *v = NULL;
    size_t n = 0;
    CHECK_STATUS(ddp_store_get(s, k2, &v, &n), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS(k2);
    CHECK_STATUS(ddp_store_wait(s, both, 2, 0), DDP_ERR_TIMEOUT); /* 0: the store's timeout */
    CHECK_OK(ddp_store_set_timeout(s, 5000));

    /* The longest key works. */
    char longest[DDP_STORE_MAX_KEY + 1];
    memset(longest, 'k', max_key);
    longest[max_key] = 0;
    int tag_len = snprintf(longest, sizeof longest, "%s/", tag);
    longest[tag_len] = 'k';
    CHECK_OK(ddp_store_set(s, longest, "L", 1));
    expect_value(s, longest, "L", 1);
    CHECK_OK(ddp_store_delete(s, longest, &deleted));
    CHECK(deleted == 1);
}

/* ---- a TCP store server in a process of its own ------------------------------------------ */

/* The server runs a thread. A test that forks (ranks, clients) must not fork from a process in
 * which that thread runs: a child forked while another thread holds a lock (the allocator's, under
 * ASan) blocks forever on its first malloc. So the server lives in a child forked first, while the
 * test still has no threads, and the test talks to it over two pipes. */
typedef struct store_server_process {
    pid_t pid;
    int port;
    int command;  /* write end: one command byte */
    int response; /* read end: the answers */
} store_server_process_t;

/* What the server process reports about itself ('h' command). */
typedef struct store_server_usage {
    long peak_rss_kib; /* VmHWM from /proc/self/status */
    long cpu_ms;       /* user + system time so far */
} store_server_usage_t;

static inline void store_read_exact(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        CHECK_MSG(n > 0, "the store server process went away (read returned %zd)", n);
        p += n;
        len -= (size_t)n;
    }
}

static inline void store_write_exact(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        CHECK(n > 0);
        p += n;
        len -= (size_t)n;
    }
}

static inline long store_peak_rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    CHECK(f);
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
    fclose(f);
    CHECK_MSG(kib > 0, "no VmHWM in /proc/self/status");
    return kib;
}

/* Forks a process that serves a TCP store on 127.0.0.1 (any free port) with `token`. With
 * nofile > 0 that process's descriptor limit is set to it first; with spare_fds > 0 the process
 * then holds descriptors of /dev/null until only spare_fds remain free, as if the rest of a
 * program used them, so the server runs out of descriptors before any limit of its own. Call it
 * before the test starts any thread. */
static inline void store_server_process_start(const char *token, int nofile, int spare_fds,
                                              store_server_process_t *out)
{
    int command[2], response[2];
    CHECK(pipe(command) == 0 && pipe(response) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(command[1]);
        close(response[0]);
        if (nofile > 0) {
            struct rlimit rl = {(rlim_t)nofile, (rlim_t)nofile};
            CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
        }
        ddp_store_server_t *server = NULL;
        CHECK_OK(ddp_store_server_start("127.0.0.1", 0, token, &server));
        int port = ddp_store_server_port(server);
        if (spare_fds > 0) {
            static int held[8192];
            int nheld = 0;
            while (nheld < 8192 && (held[nheld] = open("/dev/null", O_RDONLY)) >= 0) nheld++;
            CHECK_MSG(nheld < 8192 && errno == EMFILE && nheld >= spare_fds,
                      "could not fill the descriptor table (%d held)", nheld);
            for (int i = 0; i < spare_fds; i++) close(held[--nheld]);
        }
        store_write_exact(response[1], &port, sizeof port);
        for (;;) {
            char c = 'q';
            ssize_t n = read(command[0], &c, 1);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0 || c == 'q') break; /* told to stop, or the test is gone */
            if (c == 'h') {
                struct rusage ru;
                getrusage(RUSAGE_SELF, &ru);
                store_server_usage_t u = {
                    store_peak_rss_kib(),
                    (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000L +
                        (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000L};
                store_write_exact(response[1], &u, sizeof u);
            }
        }
        ddp_store_server_stop(server);
        _exit(0);
    }
    close(command[0]);
    close(response[1]);
    out->pid = pid;
    out->command = command[1];
    out->response = response[0];
    store_read_exact(out->response, &out->port, sizeof out->port);
    CHECK(out->port > 0);
}

static inline store_server_usage_t store_server_process_usage(const store_server_process_t *sp)
{
    store_write_exact(sp->command, "h", 1);
    store_server_usage_t u;
    store_read_exact(sp->response, &u, sizeof u);
    return u;
}

/* Stops the server and checks that its process exited cleanly. */
static inline void store_server_process_stop(store_server_process_t *sp)
{
    store_write_exact(sp->command, "q", 1);
    int status = 0;
    while (waitpid(sp->pid, &status, 0) < 0) CHECK(errno == EINTR);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the store server process ended with status 0x%x", status);
    close(sp->command);
    close(sp->response);
    sp->pid = -1;
}

/* ---- many processes (or threads) on one store --------------------------------------------- */

/* Every rank sets "<name>/<rank>" and waits for all of them. */
static inline void store_barrier(ddp_store_t *s, const char *name, int rank, int world)
{
    char key[128];
    snprintf(key, sizeof key, "barrier/%s/%d", name, rank);
    CHECK_OK(ddp_store_set(s, key, "1", 1));
    char names[64][128];
    const char *keys[64];
    for (int r = 0; r < world; r++) {
        snprintf(names[r], sizeof names[r], "barrier/%s/%d", name, r);
        keys[r] = names[r];
    }
    CHECK_OK(ddp_store_wait(s, keys, (size_t)world, 0));
}

#define STORE_ADDS_PER_RANK 300
#define STORE_CAS_ROUNDS 25
#define STORE_CAS_INCREMENTS 40

/* One rank's part of the concurrency checks. Returns 0 (failures exit the process). */
static inline int store_rank_body(ddp_store_t *s, int rank, int world)
{
    char key[128];
    int64_t r = 0;
    CHECK_OK(ddp_store_set_timeout(s, 60000));

    /* 1. add is atomic: world x K adds of 1 give world*K exactly, each result seen once. */
    int64_t last = 0;
    for (int i = 0; i < STORE_ADDS_PER_RANK; i++) {
        CHECK_OK(ddp_store_add(s, "counter", 1, &r));
        CHECK_MSG(r > last && r <= (int64_t)world * STORE_ADDS_PER_RANK,
                  "rank %d: add returned %" PRId64 " after %" PRId64, rank, r, last);
        last = r;
    }
    /* Adds of other deltas interleave too. */
    CHECK_OK(ddp_store_add(s, "mixed", rank + 1, &r));
    CHECK_OK(ddp_store_add(s, "mixed", -1, &r));
    store_barrier(s, "adds", rank, world);
    CHECK_MSG(value_as_int(s, "counter") == (int64_t)world * STORE_ADDS_PER_RANK,
              "rank %d: counter is %" PRId64 ", want %d", rank, value_as_int(s, "counter"),
              world * STORE_ADDS_PER_RANK);
    CHECK(value_as_int(s, "mixed") == (int64_t)world * (world + 1) / 2 - world);

    /* 2. compare_set races: in each round exactly one rank's missing->mine swap wins. */
    for (int round = 0; round < STORE_CAS_ROUNDS; round++) {
        char mine[32];
        snprintf(key, sizeof key, "leader/%d", round);
        int len = snprintf(mine, sizeof mine, "rank-%d", rank);
        void *cur = NULL;
        size_t cur_len = 0;
        CHECK_OK(ddp_store_compare_set(s, key, NULL, 0, mine, (size_t)len, &cur, &cur_len));
        int won = cur_len == (size_t)len && memcmp(cur, mine, (size_t)len) == 0;
        CHECK_MSG(cur_len >= 6 && memcmp(cur, "rank-", 5) == 0, "round %d: current '%s'", round,
                  (char *)cur);
        ddp_free(cur);
        snprintf(key, sizeof key, "wins/%d", round);
        if (won) CHECK_OK(ddp_store_add(s, key, 1, &r));
    }
    /* A counter bumped only through compare_set loops ends exact as well. Values are
     * "<count>:<rank>" so that seeing one's own desired value proves one's own swap won (two
     * ranks never desire the same bytes). */
    for (int i = 0; i < STORE_CAS_INCREMENTS; i++) {
        for (int attempt = 0;; attempt++) {
            CHECK_MSG(attempt < 100000, "rank %d: compare_set never succeeded", rank);
            void *v = NULL;
            size_t n = 0;
            int have = key_exists(s, "cas-counter");
            long long old = 0;
            char expected[32] = "";
            if (have) {
                CHECK_OK(ddp_store_get(s, "cas-counter", &v, &n));
                snprintf(expected, sizeof expected, "%s", (char *)v);
                old = atoll(v);
                ddp_free(v);
            }
            char desired[32];
            int dlen = snprintf(desired, sizeof desired, "%lld:%d", old + 1, rank);
            void *cur = NULL;
            size_t cur_len = 0;
            CHECK_OK(ddp_store_compare_set(s, "cas-counter", expected, strlen(expected), desired,
                                           (size_t)dlen, &cur, &cur_len));
            int ok = cur_len == (size_t)dlen && memcmp(cur, desired, (size_t)dlen) == 0;
            ddp_free(cur);
            if (ok) break;
        }
    }
    store_barrier(s, "cas", rank, world);
    for (int round = 0; round < STORE_CAS_ROUNDS; round++) {
        snprintf(key, sizeof key, "wins/%d", round);
        CHECK_MSG(value_as_int(s, key) == 1, "round %d: %" PRId64 " winners", round,
                  value_as_int(s, key));
    }
    void *final = NULL;
    size_t final_len = 0;
    CHECK_OK(ddp_store_get(s, "cas-counter", &final, &final_len));
    CHECK_MSG(atoll(final) == (long long)world * STORE_CAS_INCREMENTS, "cas-counter %s, want %d",
              (char *)final, world * STORE_CAS_INCREMENTS);
    ddp_free(final);

    /* 3. get blocks until another rank sets the key; values of every size arrive intact. The last
     * rank publishes after a pause, so the others really wait. */
    static const size_t sizes[] = {0, 1, 7, 13, 65537, (3u << 20) + 1};
    const size_t nsizes = sizeof sizes / sizeof sizes[0];
    int publisher = world - 1;
    if (rank == publisher) {
        store_sleep_ms(150);
        for (size_t i = 0; i < nsizes; i++) {
            unsigned char *buf = malloc(sizes[i] + 1);
            CHECK(buf);
            for (size_t j = 0; j < sizes[i]; j++) buf[j] = (unsigned char)(j * 7 + i);
            snprintf(key, sizeof key, "late/%zu", sizes[i]);
            CHECK_OK(ddp_store_set(s, key, buf, sizes[i]));
            free(buf);
        }
    }
    for (size_t i = 0; i < nsizes; i++) {
        unsigned char *buf = malloc(sizes[i] + 1);
        CHECK(buf);
        for (size_t j = 0; j < sizes[i]; j++) buf[j] = (unsigned char)(j * 7 + i);
        snprintf(key, sizeof key, "late/%zu", sizes[i]);
        expect_value(s, key, buf, sizes[i]);
        free(buf);
    }

    /* 4. wait with a short timeout names exactly the missing keys. */
    char never[64];
    snprintf(never, sizeof never, "never/%d", rank);
    const char *keys[2] = {"counter", never};
    CHECK_STATUS(ddp_store_wait(s, keys, 2, 80), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS(never);
    CHECK_MSG(strstr(ddp_last_error(), "'counter'") == NULL, "'%s' names a present key",
              ddp_last_error());

    /* 5. delete / check / num_keys on keys of one's own. */
    snprintf(key, sizeof key, "own/%d", rank);
    CHECK(!key_exists(s, key));
    CHECK_OK(ddp_store_set(s, key, "x", 1));
    CHECK(key_exists(s, key));
    int64_t count = 0;
    CHECK_OK(ddp_store_num_keys(s, &count));
    CHECK(count >= 1);
    int deleted = -1;
    CHECK_OK(ddp_store_delete(s, key, &deleted));
    CHECK(deleted == 1);
    CHECK_OK(ddp_store_delete(s, key, &deleted));
    CHECK(deleted == 0);
    CHECK(!key_exists(s, key));
    store_barrier(s, "end", rank, world);
    return 0;
}

#endif
