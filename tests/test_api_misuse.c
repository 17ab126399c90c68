/* Bad-input review of every public function (every header in include/ddp): each call with a NULL pointer,
 * an out-of-range enum, an overflowing count, a bad rank or timeout, or in the wrong order must
 * return the documented status with a message naming the argument, and must neither crash, hang
 * nor print anything (stdout and stderr are captured around every call).
 * Run one section: test_api_misuse <core|store|group|group2|reducer|hooks|powersgd|shard|fsdp>.
 * Findings in areas still being written are kept under DDP_MISUSE_PENDING (off by default). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "harness.h"
#ifdef DDP_MISUSE_HAVE_POWERSGD
#include "ddp/powersgd.h"
#endif

/* ---- capture of stdout and stderr around each call ------------------------------------------ */

static int capture_fd = -1;
static int saved_out = -1, saved_err = -1;
static char last_text[4096];
/* With DDP_MISUSE_SURVEY=1 a failed expectation is printed and the run goes on (exit 1 at the
 * end), to list every finding at once; by default the first failure stops the test. */
static int survey = 0;
/* status.h: the text is empty when the last call succeeded. Checked after every EXPECT_OK where
 * the area clears it (see main); the other areas are findings. */
static int check_cleared = 0;
static int failures = 0;
static void expect_failed(void)
{
    failures++;
    if (!survey) exit(1);
}

static void capture_begin(void)
{
    if (capture_fd < 0) {
        char path[] = "/tmp/ddp-misuse-XXXXXX";
        capture_fd = mkstemp(path);
        CHECK(capture_fd >= 0);
        unlink(path);
    }
    fflush(stdout);
    fflush(stderr);
    CHECK(ftruncate(capture_fd, 0) == 0);
    CHECK(lseek(capture_fd, 0, SEEK_SET) == 0);
    saved_out = dup(1);
    saved_err = dup(2);
    CHECK(saved_out >= 0 && saved_err >= 0);
    dup2(capture_fd, 1);
    dup2(capture_fd, 2);
}

static void capture_end(const char *what, int line)
{
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(saved_out);
    close(saved_err);
    /* Copy the error text at once: it is valid only until the next libddp call. */
    snprintf(last_text, sizeof last_text, "%s", ddp_last_error());
    off_t n = lseek(capture_fd, 0, SEEK_END);
    if (n > 0) {
        char buf[1024] = {0};
        ssize_t got = pread(capture_fd, buf, sizeof buf - 1, 0);
        (void)got;
        fprintf(stderr, "%s:%d: %s printed on its own: %s\n", __FILE__, line, what, buf);
        exit(1);
    }
}

/* expr must return `want`, leave a non-empty error text that mentions `needle`, print nothing. */
#define EXPECT(expr, want, needle)                                                                \
    do {                                                                                          \
        capture_begin();                                                                          \
        ddp_status_t expect_status_ = (expr);                                                     \
        capture_end(#expr, __LINE__);                                                             \
        if (expect_status_ != (want)) {                                                           \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (error text: %s)\n", __FILE__,    \
                    __LINE__, #expr, ddp_status_string(expect_status_), ddp_status_string(want), \
                    last_text);                                                                   \
            expect_failed();                                                                      \
        }                                                                                         \
        if (last_text[0] == '\0' || strstr(last_text, (needle)) == NULL) {                        \
            fprintf(stderr, "%s:%d: %s: error text '%s' does not mention '%s'\n", __FILE__,       \
                    __LINE__, #expr, last_text, (needle));                                        \
            expect_failed();                                                                      \
        }                                                                                         \
    } while (0)

#define EXPECT_BAD(expr, needle) EXPECT(expr, DDP_ERR_INVALID_ARGUMENT, needle)
#define EXPECT_USAGE(expr, needle) EXPECT(expr, DDP_ERR_INVALID_USAGE, needle)

/* expr must return DDP_OK and print nothing. */
#define EXPECT_OK(expr)                                                                           \
    do {                                                                                          \
        capture_begin();                                                                          \
        ddp_status_t expect_status_ = (expr);                                                     \
        capture_end(#expr, __LINE__);                                                             \
        if (expect_status_ != DDP_OK) {                                                           \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr,             \
                    ddp_status_string(expect_status_), last_text);                                \
            expect_failed();                                                                      \
        } else if (check_cleared && last_text[0] != '\0') {                                     \
            fprintf(stderr, "%s:%d: %s succeeded but left the error text '%s'\n", __FILE__,      \
                    __LINE__, #expr, last_text);                                                  \
            expect_failed();                                                                      \
        }                                                                                         \
    } while (0)

/* A statement (a void call, a getter) that must not crash or print. */
#define QUIET(stmt)                                                                               \
    do {                                                                                          \
        capture_begin();                                                                          \
        stmt;                                                                                     \
        capture_end(#stmt, __LINE__);                                                             \
    } while (0)

static const ddp_dtype_t BAD_DTYPE = (ddp_dtype_t)99;
static const ddp_dtype_t NEG_DTYPE = (ddp_dtype_t)-1;
static const ddp_reduce_op_t BAD_OP = (ddp_reduce_op_t)-1;
static const ddp_reduce_op_t BIG_OP = (ddp_reduce_op_t)99;

static void clear_launcher_env(void)
{
    static const char *names[] = {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "DDP_STORE_TOKEN", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
        "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) unsetenv(names[i]);
}

static char *repeat_char(char c, size_t n)
{
    char *s = malloc(n + 1);
    CHECK(s);
    memset(s, c, n);
    s[n] = '\0';
    return s;
}

/* ---- status, types, config, env, trace ------------------------------------------------------- */

static void check_core(void)
{
    const char *text = NULL;
    QUIET(text = ddp_status_string((ddp_status_t)99));
    CHECK(text && text[0]);
    QUIET(text = ddp_status_string((ddp_status_t)INT_MIN));
    CHECK(text && text[0]);
    QUIET(text = ddp_last_error());
    CHECK(text);
    QUIET(ddp_free(NULL));

    size_t size = 1;
    QUIET(size = ddp_dtype_size(BAD_DTYPE));
    CHECK(size == 0);
    QUIET(size = ddp_dtype_size(NEG_DTYPE));
    CHECK(size == 0);
    QUIET(size = ddp_dtype_size(DDP_DTYPE_COUNT));
    CHECK(size == 0);
    QUIET(text = ddp_dtype_name(NEG_DTYPE));
    CHECK(strcmp(text, "invalid") == 0);
    QUIET(text = ddp_reduce_op_name(BAD_OP));
    CHECK(strcmp(text, "invalid") == 0);
    QUIET(text = ddp_reduce_op_name(DDP_OP_COUNT));
    CHECK(strcmp(text, "invalid") == 0);

    ddp_dtype_t dtype = DDP_F64;
    ddp_reduce_op_t op = DDP_MAX;
    EXPECT_BAD(ddp_dtype_parse(NULL, &dtype), "name");
    EXPECT_BAD(ddp_dtype_parse("f32", NULL), "out");
    EXPECT_BAD(ddp_dtype_parse("", &dtype), "dtype");
    EXPECT_BAD(ddp_dtype_parse("float99", &dtype), "float99");
    EXPECT_BAD(ddp_dtype_parse("invalid", &dtype), "invalid");
    EXPECT_BAD(ddp_dtype_parse("f32 ", &dtype), "f32 ");
    CHECK(dtype == DDP_F64); /* outputs are set only on success */
    EXPECT_BAD(ddp_reduce_op_parse(NULL, &op), "name");
    EXPECT_BAD(ddp_reduce_op_parse("sum", NULL), "out");
    EXPECT_BAD(ddp_reduce_op_parse("", &op), "reduce op");
    EXPECT_BAD(ddp_reduce_op_parse("mean", &op), "mean");
    CHECK(op == DDP_MAX);

    /* Conversions of special values must not trap (UBSan) and keep NaN a NaN. */
    float f = 0;
    QUIET(f = ddp_f16_to_f32(0x7e00));
    CHECK(isnan(f));
    QUIET(f = ddp_bf16_to_f32(0x7fc1));
    CHECK(isnan(f));
    uint16_t h = 0;
    QUIET(h = ddp_f32_to_f16(NAN));
    CHECK(isnan(ddp_f16_to_f32(h)));
    QUIET(h = ddp_f32_to_f16(1e30f));
    CHECK(isinf(ddp_f16_to_f32(h)));
    QUIET(h = ddp_f32_to_bf16(-NAN));
    CHECK(isnan(ddp_bf16_to_f32(h)));

    /* config */
    size_t nvars = 0;
    QUIET(nvars = ddp_env_vars(NULL));
    CHECK(nvars > 0);
    EXPECT_BAD(ddp_config_print(NULL), "out");
    EXPECT_BAD(ddp_config_timeout_ms(NULL), "timeout_ms");
    static const char *bad_timeouts[] = {"abc", "-5", "0", "1e400", "nan", "", "99999999999"};
    for (size_t i = 0; i < sizeof bad_timeouts / sizeof bad_timeouts[0]; i++) {
        setenv("DDP_TIMEOUT", bad_timeouts[i], 1);
        int ms = 0;
        QUIET(ms = ddp_default_timeout_ms());
        CHECK_MSG(ms > 0, "DDP_TIMEOUT='%s' gave a timeout of %d ms", bad_timeouts[i], ms);
        if (bad_timeouts[i][0]) EXPECT_BAD(ddp_config_timeout_ms(&ms), "DDP_TIMEOUT");
    }
    unsetenv("DDP_TIMEOUT");

    /* env */
    ddp_env_t env;
    clear_launcher_env();
    EXPECT_BAD(ddp_env_read(NULL), "out");
    EXPECT(ddp_env_read(&env), DDP_ERR_NOT_FOUND, "RANK");
    setenv("WORLD_SIZE", "2", 1);
    EXPECT_BAD(ddp_env_read(&env), "RANK");
    setenv("RANK", "abc", 1);
    EXPECT_BAD(ddp_env_read(&env), "RANK");
    setenv("RANK", "-1", 1);
    EXPECT_BAD(ddp_env_read(&env), "RANK");
    setenv("RANK", "2", 1);
    EXPECT_BAD(ddp_env_read(&env), "RANK");
    setenv("RANK", "99999999999999999999999", 1);
    EXPECT_BAD(ddp_env_read(&env), "RANK");
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "0", 1);
    EXPECT_BAD(ddp_env_read(&env), "WORLD_SIZE");
    setenv("WORLD_SIZE", "-3", 1);
    EXPECT_BAD(ddp_env_read(&env), "WORLD_SIZE");
    setenv("WORLD_SIZE", "2", 1);
    setenv("LOCAL_RANK", "1", 1);
    EXPECT_BAD(ddp_env_read(&env), "LOCAL_WORLD_SIZE");
    setenv("LOCAL_WORLD_SIZE", "3", 1);
    EXPECT_BAD(ddp_env_read(&env), "LOCAL_WORLD_SIZE");
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    EXPECT_BAD(ddp_env_read(&env), "LOCAL_RANK");
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    EXPECT_BAD(ddp_env_read(&env), "MASTER_PORT");
    setenv("MASTER_PORT", "70000", 1);
    EXPECT_BAD(ddp_env_read(&env), "MASTER_PORT");
    setenv("MASTER_PORT", "0", 1);
    EXPECT_BAD(ddp_env_read(&env), "MASTER_PORT");
    setenv("MASTER_PORT", "29500", 1);
    char *long_text = repeat_char('a', 300);
    setenv("MASTER_ADDR", long_text, 1);
    EXPECT_BAD(ddp_env_read(&env), "MASTER_ADDR");
    setenv("MASTER_ADDR", "", 1);
    EXPECT_BAD(ddp_env_read(&env), "MASTER_ADDR");
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("DDP_STORE_TOKEN", long_text, 1);
    EXPECT_BAD(ddp_env_read(&env), "DDP_STORE_TOKEN");
    unsetenv("DDP_STORE_TOKEN");
    EXPECT_OK(ddp_env_read(&env));
    CHECK(env.rank == 1 && env.world_size == 2 && env.master_port == 29500);
    clear_launcher_env();
    setenv("OMPI_COMM_WORLD_SIZE", "x", 1);
    EXPECT_BAD(ddp_env_read(&env), "OMPI_COMM_WORLD_SIZE");
    clear_launcher_env();

    /* trace */
    ddp_trace_t *trace = NULL;
    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[512];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    EXPECT_BAD(ddp_trace_open(NULL, 0, &trace), "path");
    EXPECT_BAD(ddp_trace_open(path, 0, NULL), "out");
    EXPECT(ddp_trace_open("", 0, &trace), DDP_ERR_SYSTEM, "trace file");
    EXPECT(ddp_trace_open("/nonexistent-dir/x/trace.json", 0, &trace), DDP_ERR_SYSTEM,
           "/nonexistent-dir/x/trace.json");
    CHECK(trace == NULL);
    EXPECT_OK(ddp_trace_open(path, 0, &trace));
    EXPECT_BAD(ddp_trace_span(NULL, "a", "b", 0, 0, 1), "trace");
    EXPECT_BAD(ddp_trace_span(trace, NULL, "b", 0, 0, 1), "name");
    EXPECT_BAD(ddp_trace_span(trace, "a", "b", 0, NAN, 1), "start_us");
    EXPECT_BAD(ddp_trace_span(trace, "a", "b", 0, 0, INFINITY), "end_us");
    EXPECT_BAD(ddp_trace_name_lane(NULL, 0, "x"), "trace");
    EXPECT_BAD(ddp_trace_name_lane(trace, 0, NULL), "name");
    EXPECT_OK(ddp_trace_span(trace, "quote\" back\\ ctl\x01", NULL, -1, 5, 2));
    EXPECT_OK(ddp_trace_close(trace));
    trace = NULL;
    EXPECT_OK(ddp_trace_close(trace));
    /* The file is still valid JSON-ish: no "nan" or "inf" reached it. */
    FILE *f2 = fopen(path, "r");
    CHECK(f2);
    char content[4096] = {0};
    size_t got = fread(content, 1, sizeof content - 1, f2);
    fclose(f2);
    CHECK(got > 0);
    CHECK(strstr(content, "nan") == NULL && strstr(content, "inf") == NULL);
    double t = 0;
    QUIET(t = ddp_time_us());
    CHECK(t > 0);
    free(long_text);
}

/* ---- stores ------------------------------------------------------------------------------------ */

/* The operations of one store handle with bad arguments. */
static void check_store_ops(ddp_store_t *store, const char *kind)
{
    fprintf(stderr, "  store ops on %s\n", kind);
    EXPECT_OK(ddp_store_set_timeout(store, 300));
    EXPECT_BAD(ddp_store_set_timeout(NULL, 100), "store");
    EXPECT_BAD(ddp_store_set_timeout(store, 0), "timeout_ms");
    EXPECT_BAD(ddp_store_set_timeout(store, -5), "timeout_ms");
    CHECK(ddp_store_timeout(store) == 300);
    int timeout = 1;
    QUIET(timeout = ddp_store_timeout(NULL));
    (void)timeout;

    char *long_key = repeat_char('k', DDP_STORE_MAX_KEY + 1);
    void *value = NULL;
    size_t len = 0;
    int64_t result = 0;
    int flag = -1;

    EXPECT_BAD(ddp_store_set(NULL, "k", "v", 1), "store");
    EXPECT_BAD(ddp_store_set(store, NULL, "v", 1), "key");
    EXPECT_BAD(ddp_store_set(store, long_key, "v", 1), "key");
    EXPECT_BAD(ddp_store_set(store, "k", NULL, 1), "value");
    EXPECT_BAD(ddp_store_set(store, "k", "v", SIZE_MAX), "value");
    EXPECT_BAD(ddp_store_set(store, "k", "v", (size_t)DDP_STORE_MAX_VALUE + 1), "value");
    EXPECT_OK(ddp_store_set(store, "empty", NULL, 0));

    EXPECT_BAD(ddp_store_get(NULL, "k", &value, &len), "store");
    EXPECT_BAD(ddp_store_get(store, NULL, &value, &len), "key");
    EXPECT_BAD(ddp_store_get(store, long_key, &value, &len), "key");
    EXPECT_BAD(ddp_store_get(store, "empty", NULL, &len), "value");
    EXPECT_BAD(ddp_store_get(store, "empty", &value, NULL), "len");
    EXPECT(ddp_store_get(store, "missing-key", &value, &len), DDP_ERR_TIMEOUT, "missing-key");
    CHECK(value == NULL);

    EXPECT_BAD(ddp_store_add(NULL, "n", 1, &result), "store");
    EXPECT_BAD(ddp_store_add(store, NULL, 1, &result), "key");
    EXPECT_BAD(ddp_store_add(store, long_key, 1, &result), "key");
    EXPECT_BAD(ddp_store_add(store, "n", 1, NULL), "result");
    EXPECT_OK(ddp_store_set(store, "text", "abc", 3));
    /* A value that is not an integer, and overflow: a usage error naming the key. */
    EXPECT_USAGE(ddp_store_add(store, "text", 1, &result), "text");
    EXPECT_OK(ddp_store_add(store, "n", INT64_MAX, &result));
    CHECK(result == INT64_MAX);
    EXPECT_USAGE(ddp_store_add(store, "n", 1, &result), "n':");
    EXPECT_OK(ddp_store_add(store, "m", INT64_MIN, &result));
    EXPECT_USAGE(ddp_store_add(store, "m", -1, &result), "m':");

    size_t clen = 0;
    EXPECT_BAD(ddp_store_compare_set(NULL, "c", NULL, 0, "d", 1, &value, &clen), "store");
    EXPECT_BAD(ddp_store_compare_set(store, NULL, NULL, 0, "d", 1, &value, &clen), "key");
    EXPECT_BAD(ddp_store_compare_set(store, long_key, NULL, 0, "d", 1, &value, &clen), "key");
    EXPECT_BAD(ddp_store_compare_set(store, "c", NULL, 3, "d", 1, &value, &clen), "expected");
    EXPECT_BAD(ddp_store_compare_set(store, "c", NULL, 0, NULL, 1, &value, &clen), "desired");
    EXPECT_BAD(ddp_store_compare_set(store, "c", NULL, 0, "d", SIZE_MAX, &value, &clen),
               "desired");
    EXPECT_BAD(ddp_store_compare_set(store, "c", NULL, 0, "d", 1, NULL, &clen), "current");
    EXPECT_BAD(ddp_store_compare_set(store, "c", NULL, 0, "d", 1, &value, NULL), "current_len");

    const char *keys[] = {"empty", NULL};
    const char *long_keys[] = {long_key};
    EXPECT_BAD(ddp_store_check(NULL, keys, 1, &flag), "store");
    EXPECT_BAD(ddp_store_check(store, NULL, 1, &flag), "keys");
    EXPECT_BAD(ddp_store_check(store, keys, 2, &flag), "keys");
    EXPECT_BAD(ddp_store_check(store, long_keys, 1, &flag), "key");
    EXPECT_BAD(ddp_store_check(store, keys, 1, NULL), "all_exist");
    EXPECT_OK(ddp_store_check(store, NULL, 0, &flag));
    CHECK(flag == 1);

    EXPECT_BAD(ddp_store_wait(NULL, keys, 1, 100), "store");
    EXPECT_BAD(ddp_store_wait(store, NULL, 1, 100), "keys");
    EXPECT_BAD(ddp_store_wait(store, keys, 2, 100), "keys");
    EXPECT_BAD(ddp_store_wait(store, long_keys, 1, 100), "key");
    EXPECT_BAD(ddp_store_wait(store, keys, 1, -1), "timeout_ms");
    const char *missing[] = {"empty", "never-set"};
    EXPECT(ddp_store_wait(store, missing, 2, 100), DDP_ERR_TIMEOUT, "never-set");

    EXPECT_BAD(ddp_store_delete(NULL, "k", &flag), "store");
    EXPECT_BAD(ddp_store_delete(store, NULL, &flag), "key");
    EXPECT_BAD(ddp_store_delete(store, long_key, &flag), "key");
    EXPECT_OK(ddp_store_delete(store, "never-set", NULL));

    int64_t count = 0;
    EXPECT_BAD(ddp_store_num_keys(NULL, &count), "store");
    EXPECT_BAD(ddp_store_num_keys(store, NULL), "count");
    free(long_key);
}

static void check_store(void)
{
    ddp_store_t *store = NULL;
    EXPECT_BAD(ddp_store_hash_create(NULL), "out");
    EXPECT_OK(ddp_store_hash_create(&store));
    check_store_ops(store, "hash");

    ddp_store_t *prefix = NULL;
    char *long_prefix = repeat_char('p', DDP_STORE_MAX_KEY + 1);
    EXPECT_BAD(ddp_store_prefix_create(NULL, "p", &prefix), "base");
    EXPECT_BAD(ddp_store_prefix_create(store, NULL, &prefix), "prefix");
    EXPECT_BAD(ddp_store_prefix_create(store, "p", NULL), "out");
    EXPECT_BAD(ddp_store_prefix_create(store, long_prefix, &prefix), "prefix");
    CHECK(prefix == NULL);
    EXPECT_OK(ddp_store_prefix_create(store, "p", &prefix));
    check_store_ops(prefix, "prefix");
    QUIET(ddp_store_destroy(prefix));
    QUIET(ddp_store_destroy(store));
    store = NULL;
    QUIET(ddp_store_destroy(store));

    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[512];
    snprintf(path, sizeof path, "%s/store", dir);
    EXPECT_BAD(ddp_store_file_create(NULL, &store), "path");
    EXPECT_BAD(ddp_store_file_create(path, NULL), "out");
    EXPECT_BAD(ddp_store_file_create("", &store), "path");
    EXPECT(ddp_store_file_create("/nonexistent-dir/x/store", &store), DDP_ERR_NOT_FOUND,
           "/nonexistent-dir/x/store");
    CHECK(store == NULL);
    EXPECT_OK(ddp_store_file_create(path, &store));
    check_store_ops(store, "file");
    QUIET(ddp_store_destroy(store));
    store = NULL;

    ddp_store_server_t *server = NULL;
    EXPECT_BAD(ddp_store_server_start(NULL, 0, NULL, NULL), "out");
    EXPECT_BAD(ddp_store_server_start(NULL, -1, NULL, &server), "port");
    EXPECT_BAD(ddp_store_server_start(NULL, 70000, NULL, &server), "port");
    EXPECT_BAD(ddp_store_server_start("not an address", 0, NULL, &server), "not an address");
    CHECK(server == NULL);
    int port = 1;
    QUIET(port = ddp_store_server_port(NULL));
    CHECK(port <= 0);
    QUIET(ddp_store_server_stop(NULL));
    EXPECT_OK(ddp_store_server_start(NULL, 0, "secret", &server));
    port = ddp_store_server_port(server);
    CHECK(port > 0);
    EXPECT_BAD(ddp_store_tcp_connect(NULL, port, "secret", 1000, &store), "host");
    EXPECT_BAD(ddp_store_tcp_connect("", port, "secret", 1000, &store), "host");
    EXPECT_BAD(ddp_store_tcp_connect("127.0.0.1", -1, "secret", 1000, &store), "port");
    EXPECT_BAD(ddp_store_tcp_connect("127.0.0.1", 0, "secret", 1000, &store), "port");
    EXPECT_BAD(ddp_store_tcp_connect("127.0.0.1", 65536, "secret", 1000, &store), "port");
    EXPECT_BAD(ddp_store_tcp_connect("127.0.0.1", port, "secret", -1, &store), "timeout_ms");
    EXPECT_BAD(ddp_store_tcp_connect("127.0.0.1", port, "secret", 1000, NULL), "out");
    char *long_host = repeat_char('h', 4000);
    EXPECT_BAD(ddp_store_tcp_connect(long_host, port, "secret", 1000, &store), "host");
    free(long_host);
    CHECK(store == NULL);
    /* A wrong token is refused by the server, within the timeout, with a status (not a hang). */
    ddp_status_t s = DDP_OK;
    QUIET(s = ddp_store_tcp_connect("127.0.0.1", port, "wrong", 500, &store));
    if (s == DDP_OK) {
        /* Some servers only refuse at the first request: that must fail instead. */
        void *v = NULL;
        size_t l = 0;
        QUIET(s = ddp_store_get(store, "x", &v, &l));
        CHECK(s != DDP_OK);
        QUIET(ddp_store_destroy(store));
    }
    store = NULL;
    EXPECT_OK(ddp_store_tcp_connect("127.0.0.1", port, "secret", 2000, &store));
    check_store_ops(store, "tcp");
    QUIET(ddp_store_destroy(store));
    QUIET(ddp_store_server_stop(server));
    free(long_prefix);
}

/* ---- one-rank group ---------------------------------------------------------------------------- */

static ddp_status_t ok_task(ddp_group_t *group, void *arg)
{
    (void)group;
    (void)arg;
    return DDP_OK;
}

static void noop_callback(void *arg, ddp_status_t status)
{
    (void)arg;
    (void)status;
}

static ddp_group_t *make_group1(ddp_store_t **store_out)
{
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_hash_create(&store));
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 5000;
    ddp_group_t *group = NULL;
    CHECK_OK(ddp_group_create(store, 0, 1, &options, &group));
    *store_out = store;
    return group;
}

/* Argument checks of the collectives, shared by the 1-rank and 2-rank runs. */
static void check_collective_args(ddp_group_t *group)
{
    float buf[8] = {0};
    float out[8] = {0};
    ddp_work_t *work = NULL;
    const size_t huge = SIZE_MAX / 2; /* times the dtype size, overflows */

    EXPECT_BAD(ddp_group_allreduce_async(NULL, buf, out, 1, DDP_F32, DDP_SUM, &work), "group");
    EXPECT_BAD(ddp_group_allreduce_async(group, NULL, out, 1, DDP_F32, DDP_SUM, &work), "send");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, NULL, 1, DDP_F32, DDP_SUM, &work), "recv");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, SIZE_MAX, DDP_F32, DDP_SUM, &work),
               "count");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, huge, DDP_F64, DDP_SUM, &work), "count");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, 1, BAD_DTYPE, DDP_SUM, &work), "dtype");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, 1, NEG_DTYPE, DDP_SUM, &work), "dtype");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, 1, DDP_F32, BAD_OP, &work), "op");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, 1, DDP_F32, BIG_OP, &work), "op");
    EXPECT_BAD(ddp_group_allreduce_async(group, buf, out, 1, DDP_F32, DDP_SUM, NULL), "work");
    CHECK(work == NULL);
    EXPECT_BAD(ddp_group_allreduce(NULL, buf, out, 1, DDP_F32, DDP_SUM), "group");
    EXPECT_BAD(ddp_group_allreduce(group, NULL, out, 1, DDP_F32, DDP_SUM), "send");
    EXPECT_BAD(ddp_group_allreduce(group, buf, out, SIZE_MAX, DDP_F32, DDP_SUM), "count");
    EXPECT_BAD(ddp_group_allreduce(group, buf, out, 1, BAD_DTYPE, DDP_SUM), "dtype");
    EXPECT_BAD(ddp_group_allreduce(group, buf, out, 1, DDP_F32, BAD_OP), "op");

    int world = ddp_group_size(group);
    EXPECT_BAD(ddp_group_broadcast_async(NULL, buf, 1, DDP_F32, 0, &work), "group");
    EXPECT_BAD(ddp_group_broadcast_async(group, NULL, 1, DDP_F32, 0, &work), "buf");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, huge, DDP_F32, 0, &work), "count");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, 1, BAD_DTYPE, 0, &work), "dtype");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, 1, DDP_F32, -1, &work), "root");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, 1, DDP_F32, world, &work), "root");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, 1, DDP_F32, INT_MIN, &work), "root");
    EXPECT_BAD(ddp_group_broadcast_async(group, buf, 1, DDP_F32, 0, NULL), "work");
    EXPECT_BAD(ddp_group_broadcast(group, buf, 1, DDP_F32, world), "root");
    EXPECT_BAD(ddp_group_broadcast(NULL, buf, 1, DDP_F32, 0), "group");

    EXPECT_BAD(ddp_group_reduce_scatter_async(NULL, buf, out, 1, DDP_F32, DDP_SUM, &work),
               "group");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, NULL, out, 1, DDP_F32, DDP_SUM, &work),
               "send");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, NULL, 1, DDP_F32, DDP_SUM, &work),
               "recv");
    /* recv_count * world * dtype size overflows even when recv_count * dtype size does not. */
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, out, SIZE_MAX / 4, DDP_F32, DDP_SUM,
                                              &work),
               "recv_count");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, out, SIZE_MAX, DDP_U8, DDP_SUM, &work),
               "recv_count");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, out, 1, BAD_DTYPE, DDP_SUM, &work),
               "dtype");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, out, 1, DDP_F32, BAD_OP, &work), "op");
    EXPECT_BAD(ddp_group_reduce_scatter_async(group, buf, out, 1, DDP_F32, DDP_SUM, NULL), "work");
    EXPECT_BAD(ddp_group_reduce_scatter(group, buf, out, 1, DDP_F32, BIG_OP), "op");

    EXPECT_BAD(ddp_group_allgather_async(NULL, buf, out, 1, DDP_F32, &work), "group");
    EXPECT_BAD(ddp_group_allgather_async(group, NULL, out, 1, DDP_F32, &work), "send");
    EXPECT_BAD(ddp_group_allgather_async(group, buf, NULL, 1, DDP_F32, &work), "recv");
    EXPECT_BAD(ddp_group_allgather_async(group, buf, out, SIZE_MAX / 4, DDP_F32, &work),
               "send_count");
    EXPECT_BAD(ddp_group_allgather_async(group, buf, out, SIZE_MAX, DDP_U8, &work), "send_count");
    EXPECT_BAD(ddp_group_allgather_async(group, buf, out, 1, BAD_DTYPE, &work), "dtype");
    EXPECT_BAD(ddp_group_allgather_async(group, buf, out, 1, DDP_F32, NULL), "work");
    EXPECT_BAD(ddp_group_allgather(group, buf, out, 1, NEG_DTYPE), "dtype");

    EXPECT_BAD(ddp_group_barrier_async(NULL, &work), "group");
    EXPECT_BAD(ddp_group_barrier_async(group, NULL), "work");
    EXPECT_BAD(ddp_group_barrier(NULL), "group");

    EXPECT_BAD(ddp_group_submit(NULL, ok_task, NULL, &work), "group");
    EXPECT_BAD(ddp_group_submit(group, NULL, NULL, &work), "fn");
    EXPECT_BAD(ddp_group_submit(group, ok_task, NULL, NULL), "work");

    void *mem = NULL;
    EXPECT_BAD(ddp_group_alloc_buffer(NULL, 64, &mem), "group");
    EXPECT_BAD(ddp_group_alloc_buffer(group, 64, NULL), "out");
    EXPECT_BAD(ddp_group_alloc_buffer(group, SIZE_MAX, &mem), "bytes");
    EXPECT_BAD(ddp_group_alloc_buffer(group, SIZE_MAX - 32, &mem), "bytes");
    CHECK(mem == NULL);
    EXPECT_BAD(ddp_group_free_buffer(NULL, buf), "group");
    EXPECT_BAD(ddp_group_free_buffer(group, NULL), "buffer");
    EXPECT_BAD(ddp_group_free_buffer(group, buf), "buffer"); /* never allocated */

    /* None of the rejected calls consumed a sequence number: a good collective still works. */
    for (int i = 0; i < 8; i++) buf[i] = (float)(i + 1);
    EXPECT_OK(ddp_group_allreduce(group, buf, out, 8, DDP_F32, DDP_SUM));
    for (int i = 0; i < 8; i++) CHECK(out[i] == (float)((i + 1) * world));
    /* count 0 is valid. */
    EXPECT_OK(ddp_group_allreduce(group, buf, out, 0, DDP_F32, DDP_SUM));
}

/* Misuse of works and buffers (valid on every world size: every rank does the same). */
static void check_work_misuse(ddp_group_t *group)
{
    float buf[4] = {1, 2, 3, 4};
    ddp_work_t *work = NULL;
    int done = -1;
    EXPECT_BAD(ddp_work_wait(NULL), "work");
    EXPECT_BAD(ddp_work_test(NULL, &done), "work");
    EXPECT_OK(ddp_group_allreduce_async(group, buf, buf, 4, DDP_F32, DDP_SUM, &work));
    EXPECT_BAD(ddp_work_test(work, NULL), "done");
    EXPECT_BAD(ddp_work_on_complete(NULL, noop_callback, NULL), "work");
    EXPECT_BAD(ddp_work_on_complete(work, NULL, NULL), "fn");
    EXPECT_OK(ddp_work_on_complete(work, noop_callback, NULL));
    EXPECT_USAGE(ddp_work_on_complete(work, noop_callback, NULL), "work");
    EXPECT_OK(ddp_work_wait(work));
    /* A second wait returns the same status at once, or says it was waited on: never a hang. */
    ddp_status_t again = DDP_ERR_SYSTEM;
    QUIET(again = ddp_work_wait(work));
    CHECK_MSG(again == DDP_OK || again == DDP_ERR_INVALID_USAGE, "second wait returned %s",
              ddp_status_string(again));
    EXPECT_OK(ddp_work_test(work, &done));
    CHECK(done == 1);
    QUIET(ddp_work_free(work));
    work = NULL;
    QUIET(ddp_work_free(work));

    /* A task's error status and text reach the waiter. */
    EXPECT_OK(ddp_group_submit(group, ok_task, NULL, &work));
    EXPECT_OK(ddp_work_wait(work));
    QUIET(ddp_work_free(work));

    void *mem = NULL;
    EXPECT_OK(ddp_group_alloc_buffer(group, 100, &mem));
    CHECK(mem && ((uintptr_t)mem % 64) == 0);
    EXPECT_BAD(ddp_group_free_buffer(group, (char *)mem + 1), "buffer"); /* inside, not start */
    EXPECT_OK(ddp_group_free_buffer(group, mem));
    EXPECT_BAD(ddp_group_free_buffer(group, mem), "buffer"); /* twice */
}

static void check_group(void)
{
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_hash_create(&store));
    ddp_group_t *group = NULL;
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 300;
    /* A NULL store is refused even for world 1 (store-less groups are internal, for MPI). */
    EXPECT_BAD(ddp_group_create(NULL, 0, 1, &options, &group), "store");
    EXPECT_BAD(ddp_group_create(NULL, 0, 2, &options, &group), "store");
    EXPECT_BAD(ddp_group_create(store, -1, 1, &options, &group), "rank");
    EXPECT_BAD(ddp_group_create(store, 1, 1, &options, &group), "rank");
    EXPECT_BAD(ddp_group_create(store, INT_MIN, 1, &options, &group), "rank");
    EXPECT_BAD(ddp_group_create(store, 0, 0, &options, &group), "world_size");
    EXPECT_BAD(ddp_group_create(store, 0, -4, &options, &group), "world_size");
    EXPECT_BAD(ddp_group_create(store, 0, 1, &options, NULL), "out");
    options.timeout_ms = -1;
    EXPECT_BAD(ddp_group_create(store, 0, 1, &options, &group), "timeout_ms");
    options.timeout_ms = 300;
    options.transport = "carrier-pigeon";
    EXPECT_BAD(ddp_group_create(store, 0, 1, &options, &group), "carrier-pigeon");
    options.transport = NULL;
    char *long_name = repeat_char('n', DDP_STORE_MAX_KEY + 1);
    options.name = long_name;
    EXPECT_BAD(ddp_group_create(store, 0, 1, &options, &group), "name");
    options.name = "";
    EXPECT_BAD(ddp_group_create(store, 0, 1, &options, &group), "name");
    options.name = NULL;
    CHECK(group == NULL);
    /* A world nobody else joins: a timeout naming who is missing, not a hang or a huge
     * allocation. */
    ddp_status_t s = DDP_OK;
    QUIET(s = ddp_group_create(store, 0, INT_MAX, &options, &group));
    CHECK_MSG(s == DDP_ERR_TIMEOUT || s == DDP_ERR_INVALID_ARGUMENT || s == DDP_ERR_NO_MEMORY,
              "world INT_MAX: %s", ddp_status_string(s));
    CHECK(group == NULL);
    free(long_name);

    clear_launcher_env();
    EXPECT_BAD(ddp_group_create_from_env(NULL, NULL), "out");
    EXPECT(ddp_group_create_from_env(NULL, &group), DDP_ERR_NOT_FOUND, "RANK");
    CHECK(group == NULL);

    int v = 0;
    QUIET(v = ddp_group_rank(NULL));
    CHECK(v < 0);
    QUIET(v = ddp_group_size(NULL));
    CHECK(v <= 0);
    QUIET(v = ddp_group_timeout_ms(NULL));
    const char *name = NULL;
    QUIET(name = ddp_group_transport(NULL));
    CHECK(name != NULL);
    QUIET(ddp_group_destroy(NULL));

    ddp_store_destroy(store);
    group = make_group1(&store);
    CHECK(strcmp(ddp_group_transport(group), "self") == 0);

    ddp_group_t *sub = NULL;
    int ranks[3] = {0, 0, 5};
    EXPECT_BAD(ddp_group_split(NULL, ranks, 1, NULL, &sub), "parent");
    EXPECT_BAD(ddp_group_split(NULL, ranks, 1, NULL, &sub), "NULL");
    EXPECT_BAD(ddp_group_split(group, NULL, 1, NULL, &sub), "ranks");
    EXPECT_BAD(ddp_group_split(group, ranks, -1, NULL, &sub), "nranks");
    EXPECT_BAD(ddp_group_split(group, ranks, 0, NULL, &sub), "nranks");
    EXPECT_BAD(ddp_group_split(group, ranks, 2, NULL, &sub), "nranks"); /* more than world */
    EXPECT_BAD(ddp_group_split(group, ranks + 2, 1, NULL, &sub), "ranks");
    EXPECT_BAD(ddp_group_split(group, ranks, 1, NULL, NULL), "out");
    CHECK(sub == NULL);

    check_collective_args(group);
    check_work_misuse(group);
    QUIET(ddp_group_destroy(group));
    group = NULL;
    QUIET(ddp_group_destroy(group));
    ddp_store_destroy(store);
}

/* ---- two ranks: collective misuse ------------------------------------------------------------- */

static int group2_body(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group);
    check_collective_args(group);
    check_work_misuse(group);

    ddp_group_t *sub = NULL;
    int dup[2] = {0, 0};
    int out_of_range[2] = {0, ddp_group_size(group)};
    EXPECT_BAD(ddp_group_split(group, dup, 2, NULL, &sub), "ranks");
    EXPECT_BAD(ddp_group_split(group, out_of_range, 2, NULL, &sub), "ranks");
    CHECK(sub == NULL);

    (void)rank;
    return 0;
}

static int group2_mismatch_body(ddp_group_t *group, void *arg)
{
    int kind = *(const int *)arg;
    int rank = ddp_group_rank(group);
    float buf[8] = {0};
    ddp_status_t s = DDP_OK;
    const char *needle = "";
    capture_begin();
    switch (kind) {
    case 0: /* different counts */
        s = ddp_group_allreduce(group, buf, buf, rank == 0 ? 4 : 5, DDP_F32, DDP_SUM);
        needle = "count 5";
        break;
    case 1: /* different dtypes */
        s = ddp_group_allreduce(group, buf, buf, 2, rank == 0 ? DDP_F32 : DDP_I32, DDP_SUM);
        needle = "i32";
        break;
    case 2: /* different roots */
        s = ddp_group_broadcast(group, buf, 2, DDP_F32, rank);
        needle = ddp_group_size(group) == 2 ? "root 1" : "root ";
        break;
    case 3: /* different collectives */
        s = rank == 0 ? ddp_group_allreduce(group, buf, buf, 2, DDP_F32, DDP_SUM)
                      : ddp_group_broadcast(group, buf, 2, DDP_F32, 0);
        needle = "broadcast";
        break;
    case 4:   /* different buffer sizes (both round up to one page) */
    case 5: { /* only the last rank differs: the others learn it from rank 0's comparison */
        void *mem = NULL;
        int odd = kind == 4 ? rank == 0 : rank == ddp_group_size(group) - 1;
        s = ddp_group_alloc_buffer(group, odd ? 128 : 64, &mem);
        needle = "64 bytes";
        if (s == DDP_OK) ddp_group_free_buffer(group, mem);
        break;
    }
    default:
        break;
    }
    capture_end("mismatched collective", __LINE__);
    CHECK_MSG(s == DDP_ERR_MISMATCH, "kind %d rank %d: %s (%s)", kind, rank,
              ddp_status_string(s), last_text);
    CHECK_MSG(strstr(last_text, needle) != NULL, "kind %d rank %d: '%s' does not mention '%s'",
              kind, rank, last_text, needle);
    if (kind >= 4) /* the text names both sizes, on every rank */
        CHECK_MSG(strstr(last_text, "128 bytes") != NULL, "kind %d rank %d: '%s' lacks 128 bytes",
                  kind, rank, last_text);
    /* The group is broken now: later calls say so instead of hanging. */
    EXPECT(ddp_group_barrier(group), DDP_ERR_ABORTED, "");
    return 0;
}

static void check_group_world(int world)
{
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 10000;
    CHECK(ddp_test_run_group(world, 60, &options, group2_body, NULL) == 0);
    int kinds[] = {0, 1, 2, 3, 4, 5};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        fprintf(stderr, "  mismatch kind %d\n", kinds[i]);
        CHECK(ddp_test_run_group(world, 60, &options, group2_mismatch_body, &kinds[i]) == 0);
    }
    /* Buffer sizes over TCP, whose buffers are ordinary memory: the group checks them. */
    options.transport = "tcp";
    for (int kind = 4; kind <= 5; kind++) {
        fprintf(stderr, "  mismatch kind %d over tcp\n", kind);
        CHECK(ddp_test_run_group(world, 60, &options, group2_mismatch_body, &kind) == 0);
    }
}

static void check_group2(void) { check_group_world(2); }
static void check_group3(void) { check_group_world(3); }

/* ---- reducer, bucket assignment, legacy -------------------------------------------------------- */

static void check_reducer(void)
{
    ddp_store_t *store = NULL;
    ddp_group_t *group = make_group1(&store);

    float w[12] = {0}, b[5] = {0}, g[12] = {0}, stats_data[3] = {0};
    ddp_param_t params[2] = {
        {"w", w, 12, DDP_F32, 3, 0, NULL},
        {"b", b, 5, DDP_F32, 0, 0, NULL},
    };
    ddp_buffer_t buffers[1] = {{"stats", stats_data, 3, DDP_F32}};
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    ddp_reducer_t *reducer = NULL;

    EXPECT_BAD(ddp_reducer_create(NULL, params, 2, buffers, 1, &config, &reducer), "group");
    EXPECT_BAD(ddp_reducer_create(group, NULL, 2, buffers, 1, &config, &reducer), "params");
    EXPECT_BAD(ddp_reducer_create(group, params, 2, NULL, 1, &config, &reducer), "buffers");
    EXPECT_BAD(ddp_reducer_create(group, params, 2, buffers, 1, &config, NULL), "out");
    EXPECT_BAD(ddp_reducer_create(group, params, SIZE_MAX, buffers, 1, &config, &reducer),
               "nparams");

    ddp_param_t bad[2];
#define WITH_BAD_PARAM(field, value, needle)                                                      \
    do {                                                                                          \
        memcpy(bad, params, sizeof bad);                                                          \
        bad[1].field = value;                                                                     \
        EXPECT_BAD(ddp_reducer_create(group, bad, 2, buffers, 1, &config, &reducer), needle);     \
        CHECK(reducer == NULL);                                                                   \
    } while (0)
    WITH_BAD_PARAM(name, NULL, "name");
    WITH_BAD_PARAM(name, "w", "w"); /* duplicate name of another tensor */
    WITH_BAD_PARAM(data, NULL, "data");
    WITH_BAD_PARAM(dtype, BAD_DTYPE, "dtype");
    WITH_BAD_PARAM(dtype, DDP_I32, "dtype");
    WITH_BAD_PARAM(rows, 2, "rows"); /* 5 % 2 != 0 */
    WITH_BAD_PARAM(rows, 6, "rows"); /* more rows than elements */
    WITH_BAD_PARAM(numel, SIZE_MAX, "numel");
    WITH_BAD_PARAM(numel, SIZE_MAX / 2, "numel");
    WITH_BAD_PARAM(sparse, 1, "rows"); /* sparse needs rows */
    /* user_grads without a gradient pointer */
    config.user_grads = 1;
    EXPECT_BAD(ddp_reducer_create(group, params, 2, buffers, 1, &config, &reducer), "grad");
    config.user_grads = 0;
    config.bucket_cap_bytes = 0;
    EXPECT_BAD(ddp_reducer_create(group, params, 2, buffers, 1, &config, &reducer),
               "bucket_cap_bytes");
    config.bucket_cap_bytes = (size_t)25 << 20;
    ddp_buffer_t bad_buffer = buffers[0];
    bad_buffer.data = NULL;
    EXPECT_BAD(ddp_reducer_create(group, params, 2, &bad_buffer, 1, &config, &reducer), "data");
    bad_buffer = buffers[0];
    bad_buffer.dtype = BAD_DTYPE;
    EXPECT_BAD(ddp_reducer_create(group, params, 2, &bad_buffer, 1, &config, &reducer), "dtype");
    bad_buffer = buffers[0];
    bad_buffer.numel = SIZE_MAX;
    EXPECT_BAD(ddp_reducer_create(group, params, 2, &bad_buffer, 1, &config, &reducer), "numel");
    CHECK(reducer == NULL);

    EXPECT_OK(ddp_reducer_create(group, params, 2, buffers, 1, &config, &reducer));
    void *grad = NULL;
    EXPECT_BAD(ddp_reducer_grad(NULL, 0, &grad), "reducer");
    EXPECT_BAD(ddp_reducer_grad(reducer, 2, &grad), "index");
    EXPECT_BAD(ddp_reducer_grad(reducer, SIZE_MAX, &grad), "index");
    EXPECT_BAD(ddp_reducer_grad(reducer, 0, NULL), "grad");
    EXPECT_BAD(ddp_reducer_zero_grad(NULL), "reducer");
    EXPECT_BAD(ddp_reducer_prepare(NULL), "reducer");
    EXPECT_BAD(ddp_reducer_grad_ready(NULL, 0), "reducer");
    EXPECT_BAD(ddp_reducer_finalize(NULL), "reducer");
    EXPECT_BAD(ddp_reducer_set_sync(NULL, 1), "reducer");

    /* Order: finalize and grad_ready before prepare. */
    EXPECT_USAGE(ddp_reducer_finalize(reducer), "prepare");
    EXPECT_USAGE(ddp_reducer_grad_ready(reducer, 0), "prepare");
    EXPECT_OK(ddp_reducer_prepare(reducer));
    EXPECT_BAD(ddp_reducer_grad_ready(reducer, 2), "index");
    EXPECT_BAD(ddp_reducer_grad_ready(reducer, SIZE_MAX), "index");
    EXPECT_OK(ddp_reducer_grad_ready(reducer, 0));
    EXPECT_USAGE(ddp_reducer_grad_ready(reducer, 0), "w"); /* twice: names the parameter */
    /* finalize with a parameter never marked (find_unused_parameters = 0) */
    EXPECT_USAGE(ddp_reducer_finalize(reducer), "b");
    ddp_reducer_destroy(reducer);
    reducer = NULL;

    EXPECT_OK(ddp_reducer_create(group, params, 2, buffers, 1, &config, &reducer));
    EXPECT_OK(ddp_reducer_prepare(reducer));
    EXPECT_USAGE(ddp_reducer_prepare(reducer), "finalize"); /* twice without finalize */
    EXPECT_OK(ddp_reducer_grad_ready(reducer, 0));
    EXPECT_OK(ddp_reducer_grad_ready(reducer, 1));
    EXPECT_OK(ddp_reducer_finalize(reducer));

    int64_t rows_idx[2] = {0, 1};
    const int64_t *out_idx = NULL;
    const void *out_values = NULL;
    size_t nrows = 0;
    EXPECT_BAD(ddp_reducer_sparse_grad(NULL, 0, rows_idx, g, 1), "reducer");
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 9, rows_idx, g, 1), "index");
    EXPECT_OK(ddp_reducer_prepare(reducer));
    EXPECT_USAGE(ddp_reducer_sparse_grad(reducer, 0, rows_idx, g, 1), "'w'"); /* dense param */
    EXPECT_BAD(ddp_reducer_sparse_result(NULL, 0, &out_idx, &out_values, &nrows), "reducer");
    EXPECT_BAD(ddp_reducer_sparse_result(reducer, 7, &out_idx, &out_values, &nrows), "index");
    EXPECT_USAGE(ddp_reducer_sparse_result(reducer, 0, &out_idx, &out_values, &nrows), "'w'");

    const size_t *bparams = NULL;
    size_t bn = 0, count = 7;
    QUIET(count = ddp_reducer_bucket_count(NULL));
    CHECK(count == 0);
    CHECK(ddp_reducer_bucket_count(reducer) >= 1);
    EXPECT_BAD(ddp_reducer_bucket_params(NULL, 0, &bparams, &bn), "reducer");
    EXPECT_BAD(ddp_reducer_bucket_params(reducer, 99, &bparams, &bn), "bucket");
    EXPECT_BAD(ddp_reducer_bucket_params(reducer, 0, NULL, &bn), "params");
    EXPECT_BAD(ddp_reducer_bucket_params(reducer, 0, &bparams, NULL), "nparams");
    ddp_reducer_stats_t stats;
    EXPECT_BAD(ddp_reducer_stats(NULL, &stats), "reducer");
    EXPECT_BAD(ddp_reducer_stats(reducer, NULL), "out");
    QUIET(ddp_reducer_destroy(reducer));
    reducer = NULL;
    QUIET(ddp_reducer_destroy(reducer));

    /* A sparse parameter: indices out of range, NULL rows. */
    float table[12] = {0}, rows_values[8] = {0};
    ddp_param_t sparse_params[1] = {{"emb", table, 12, DDP_F32, 3, 1, NULL}};
    EXPECT_OK(ddp_reducer_create(group, sparse_params, 1, NULL, 0, &config, &reducer));
    EXPECT_OK(ddp_reducer_prepare(reducer));
    int64_t bad_rows[2] = {0, 3};
    int64_t neg_rows[1] = {-1};
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 0, NULL, rows_values, 1), "indices");
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 0, rows_idx, NULL, 1), "values");
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 0, bad_rows, rows_values, 2), "indices");
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 0, neg_rows, rows_values, 1), "indices");
    EXPECT_BAD(ddp_reducer_sparse_grad(reducer, 0, rows_idx, rows_values, SIZE_MAX), "nrows");
    EXPECT_USAGE(ddp_reducer_sparse_result(reducer, 0, &out_idx, &out_values, &nrows), "finalize");
    EXPECT_OK(ddp_reducer_sparse_grad(reducer, 0, rows_idx, rows_values, 2));
    EXPECT_OK(ddp_reducer_finalize(reducer));
    EXPECT_BAD(ddp_reducer_sparse_result(reducer, 0, NULL, &out_values, &nrows), "indices");
    EXPECT_BAD(ddp_reducer_sparse_result(reducer, 0, &out_idx, NULL, &nrows), "values");
    EXPECT_BAD(ddp_reducer_sparse_result(reducer, 0, &out_idx, &out_values, NULL), "nrows");
    EXPECT_OK(ddp_reducer_sparse_result(reducer, 0, &out_idx, &out_values, &nrows));
    CHECK(nrows == 2);
    /* Marked twice: a usage error at once, and the iteration's finalize reports it too. */
    EXPECT_OK(ddp_reducer_prepare(reducer));
    EXPECT_OK(ddp_reducer_sparse_grad(reducer, 0, rows_idx, rows_values, 2));
    EXPECT_USAGE(ddp_reducer_sparse_grad(reducer, 0, rows_idx, rows_values, 2), "emb");
    EXPECT_USAGE(ddp_reducer_grad_ready(reducer, 0), "emb");
    EXPECT_USAGE(ddp_reducer_finalize(reducer), "emb");
    ddp_reducer_destroy(reducer);
    reducer = NULL;

    /* bucket assignment */
    ddp_bucket_assignment_t assignment;
    size_t limits[2] = {64, 128};
    size_t order_bad[2] = {0, 5};
    size_t order_dup[2] = {1, 1};
    EXPECT_BAD(ddp_compute_bucket_assignment(NULL, 2, limits, 2, NULL, &assignment), "params");
    EXPECT_BAD(ddp_compute_bucket_assignment(params, 2, NULL, 2, NULL, &assignment), "limits");
    EXPECT_BAD(ddp_compute_bucket_assignment(params, 2, limits, 0, NULL, &assignment), "limits");
    EXPECT_BAD(ddp_compute_bucket_assignment(params, 2, limits, 2, order_bad, &assignment),
               "order");
    EXPECT_BAD(ddp_compute_bucket_assignment(params, 2, limits, 2, order_dup, &assignment),
               "order");
    EXPECT_BAD(ddp_compute_bucket_assignment(params, 2, limits, 2, NULL, NULL), "out");
    memcpy(bad, params, sizeof bad);
    bad[0].dtype = BAD_DTYPE;
    EXPECT_BAD(ddp_compute_bucket_assignment(bad, 2, limits, 2, NULL, &assignment), "dtype");
    memcpy(bad, params, sizeof bad);
    bad[0].numel = SIZE_MAX;
    EXPECT_BAD(ddp_compute_bucket_assignment(bad, 2, limits, 2, NULL, &assignment), "numel");
    EXPECT_OK(ddp_compute_bucket_assignment(params, 0, limits, 2, NULL, &assignment));
    CHECK(assignment.nbuckets == 0);
    QUIET(ddp_bucket_assignment_free(&assignment));
    QUIET(ddp_bucket_assignment_free(NULL));

    /* legacy */
    ddp_legacy_t *legacy = NULL;
    ddp_param_t lp[1] = {{"w", w, 12, DDP_F32, 0, 0, g}};
    EXPECT_BAD(ddp_legacy_create(NULL, lp, 1, 0, &legacy), "group");
    EXPECT_BAD(ddp_legacy_create(group, NULL, 1, 0, &legacy), "params");
    EXPECT_BAD(ddp_legacy_create(group, lp, 1, 0, NULL), "out");
    lp[0].grad = NULL;
    EXPECT_BAD(ddp_legacy_create(group, lp, 1, 0, &legacy), "grad");
    lp[0].grad = g;
    lp[0].dtype = BAD_DTYPE;
    EXPECT_BAD(ddp_legacy_create(group, lp, 1, 0, &legacy), "dtype");
    lp[0].dtype = DDP_F32;
    lp[0].numel = SIZE_MAX;
    EXPECT_BAD(ddp_legacy_create(group, lp, 1, 0, &legacy), "numel");
    lp[0].numel = 12;
    CHECK(legacy == NULL);
    EXPECT_BAD(ddp_legacy_set_sync(NULL, 1), "legacy");
    EXPECT_BAD(ddp_legacy_allreduce(NULL, NULL), "legacy");
    EXPECT_OK(ddp_legacy_create(group, lp, 1, 0, &legacy));
    EXPECT_OK(ddp_legacy_allreduce(legacy, NULL));
    QUIET(ddp_legacy_destroy(legacy));
    QUIET(ddp_legacy_destroy(NULL));

    ddp_group_destroy(group);
    ddp_store_destroy(store);
}

/* ---- hooks ------------------------------------------------------------------------------------ */

static void check_hooks(void)
{
    ddp_half_hook_state_t *half = NULL, *bhalf = NULL;
    EXPECT_BAD(ddp_half_hook_state_create(DDP_F32, &half), "wire_dtype");
    EXPECT_BAD(ddp_half_hook_state_create(BAD_DTYPE, &half), "wire_dtype");
    EXPECT_BAD(ddp_half_hook_state_create(DDP_F16, NULL), "out");
    CHECK(half == NULL);
    QUIET(ddp_half_hook_state_destroy(NULL));
    EXPECT_OK(ddp_half_hook_state_create(DDP_F16, &half));
    EXPECT_OK(ddp_half_hook_state_create(DDP_BF16, &bhalf));
    ddp_hook_stats_t hs;
    EXPECT_BAD(ddp_half_hook_stats(NULL, &hs), "state");
    EXPECT_BAD(ddp_half_hook_stats(half, NULL), "out");

    ddp_store_t *store = NULL;
    ddp_group_t *group = make_group1(&store);
    float data[6] = {1, 2, 3, 4, 5, 6};
    size_t pidx[1] = {0}, offs[1] = {0}, numels[1] = {6}, rows[1] = {0};
    ddp_comm_bucket_t bucket = {0, data, 6, DDP_F32, 1, pidx, offs, numels, rows, 0, 1, 0};
    ddp_work_t *work = NULL;
    EXPECT_BAD(ddp_hook_fp16(NULL, group, &bucket, &work), "state");
    EXPECT_BAD(ddp_hook_fp16(bhalf, group, &bucket, &work), "state"); /* wrong wire dtype */
    EXPECT_BAD(ddp_hook_bf16(half, group, &bucket, &work), "state");
    EXPECT_BAD(ddp_hook_fp16(half, NULL, &bucket, &work), "group");
    EXPECT_BAD(ddp_hook_fp16(half, group, NULL, &work), "bucket");
    EXPECT_BAD(ddp_hook_fp16(half, group, &bucket, NULL), "work");
    ddp_comm_bucket_t bad = bucket;
    bad.data = NULL;
    EXPECT_BAD(ddp_hook_fp16(half, group, &bad, &work), "data");
    /* Regression (fixed in 422a99f): dtype 99 was DDP_ERR_UNSUPPORTED, numel SIZE_MAX was
     * DDP_ERR_NO_MEMORY after trying to allocate. */
    bad = bucket;
    bad.dtype = BAD_DTYPE;
    EXPECT_BAD(ddp_hook_bf16(bhalf, group, &bad, &work), "dtype");
    bad = bucket;
    bad.numel = SIZE_MAX;
    EXPECT_BAD(ddp_hook_fp16(half, group, &bad, &work), "numel");
    bad = bucket;
    bad.dtype = DDP_I32;
    EXPECT(ddp_hook_fp16(half, group, &bad, &work), DDP_ERR_UNSUPPORTED, "dtype");
    CHECK(work == NULL);
    EXPECT_OK(ddp_hook_fp16(half, group, &bucket, &work));
    EXPECT_OK(ddp_work_wait(work));
    ddp_work_free(work);
    CHECK(data[5] == 6.0f);

    EXPECT(ddp_hook_error(DDP_ERR_MISMATCH, "custom %d", 42), DDP_ERR_MISMATCH, "custom 42");
    const char *null_format = NULL;
    ddp_status_t s = DDP_OK;
#ifdef __clang__
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wformat-security"
#endif
    QUIET(s = ddp_hook_error(DDP_ERR_REMOTE, null_format));
#ifdef __clang__
#pragma clang diagnostic pop
#endif
    CHECK(s == DDP_ERR_REMOTE);

    ddp_half_hook_state_destroy(half);
    ddp_half_hook_state_destroy(bhalf);
    ddp_group_destroy(group);
    ddp_store_destroy(store);
}

#ifdef DDP_MISUSE_HAVE_POWERSGD
static void check_powersgd(void)
{
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    ddp_powersgd_state_t *state = NULL;
    EXPECT_BAD(ddp_powersgd_state_create(NULL, &state), "config");
    EXPECT_BAD(ddp_powersgd_state_create(&pc, NULL), "out");
#define WITH_BAD_PC(field, value)                                                                 \
    do {                                                                                          \
        pc = (ddp_powersgd_config_t)DDP_POWERSGD_CONFIG_INIT;                                     \
        pc.field = value;                                                                         \
        EXPECT_BAD(ddp_powersgd_state_create(&pc, &state), #field);                               \
        CHECK(state == NULL);                                                                     \
    } while (0)
    WITH_BAD_PC(matrix_approximation_rank, 0);
    WITH_BAD_PC(matrix_approximation_rank, -3);
    WITH_BAD_PC(min_compression_rate, -1.0);
    WITH_BAD_PC(min_compression_rate, NAN);
    WITH_BAD_PC(orthogonalization_epsilon, -1.0);
    WITH_BAD_PC(orthogonalization_epsilon, NAN);
    pc = (ddp_powersgd_config_t)DDP_POWERSGD_CONFIG_INIT;
    pc.start_powersgd_iter = 0; /* compress from the first bucket, so the layout is read */
    QUIET(ddp_powersgd_state_destroy(NULL));
    EXPECT_OK(ddp_powersgd_state_create(&pc, &state));
    ddp_powersgd_stats_t ps;
    EXPECT_BAD(ddp_powersgd_stats(NULL, &ps), "state");
    EXPECT_BAD(ddp_powersgd_stats(state, NULL), "out");

    ddp_store_t *store = NULL;
    ddp_group_t *group = make_group1(&store);
    float data[6] = {1, 2, 3, 4, 5, 6};
    size_t pidx[1] = {0}, offs[1] = {0}, numels[1] = {6}, rows[1] = {2};
    ddp_comm_bucket_t bucket = {0, data, 6, DDP_F32, 1, pidx, offs, numels, rows, 0, 1, 0};
    ddp_work_t *work = NULL;
    EXPECT_BAD(ddp_powersgd_hook(NULL, group, &bucket, &work), "state");
    EXPECT_BAD(ddp_powersgd_hook(state, NULL, &bucket, &work), "group");
    EXPECT_BAD(ddp_powersgd_hook(state, group, NULL, &work), "bucket");
    EXPECT_BAD(ddp_powersgd_hook(state, group, &bucket, NULL), "work");
    ddp_comm_bucket_t bad = bucket;
    bad.data = NULL;
    EXPECT_BAD(ddp_powersgd_hook(state, group, &bad, &work), "data");
    size_t bad_offs[1] = {3}; /* parameter runs past the bucket */
    bad = bucket;
    bad.offsets = bad_offs;
    EXPECT_BAD(ddp_powersgd_hook(state, group, &bad, &work), "beyond the bucket");
    /* Regression (fixed in 422a99f): dtype 99 was DDP_ERR_UNSUPPORTED; rows that do not divide
     * numel were accepted (the matrix view silently dropped elements). */
    bad = bucket;
    bad.dtype = BAD_DTYPE;
    EXPECT_BAD(ddp_powersgd_hook(state, group, &bad, &work), "dtype");
    size_t bad_rows[1] = {4}; /* 6 % 4 != 0 */
    bad = bucket;
    bad.rows = bad_rows;
    EXPECT_BAD(ddp_powersgd_hook(state, group, &bad, &work), "rows");
    CHECK(work == NULL);

    int c = -1;
    QUIET(c = ddp_powersgd_should_compress(0, 0, 1, 2.0));
    CHECK(c == 0);
    QUIET(c = ddp_powersgd_should_compress(SIZE_MAX, SIZE_MAX, 1, 2.0));
    QUIET(c = ddp_powersgd_should_compress(100, 100, -1, 2.0));
    CHECK(c == 0);
    QUIET(c = ddp_powersgd_should_compress(100, 100, 1, 0.0));
    QUIET(c = ddp_powersgd_should_compress(100, 100, INT_MAX, 2.0));
    CHECK(c == 0);

    ddp_powersgd_state_destroy(state);
    ddp_group_destroy(group);
    ddp_store_destroy(store);
}
#endif

/* ---- shard -------------------------------------------------------------------------------------- */

static void on_shard(void *arg, const void *shard, size_t count)
{
    (void)arg;
    (void)shard;
    (void)count;
}

static void check_shard(void)
{
    ddp_store_t *store = NULL;
    ddp_group_t *group = make_group1(&store);
    float in[8] = {1, 2, 3, 4, 5, 6, 7, 8};

    ddp_rs_bucketer_t *bucketer = NULL;
    EXPECT_BAD(ddp_rs_bucketer_create(1024, NULL), "out");
    QUIET(ddp_rs_bucketer_destroy(NULL));
    EXPECT_OK(ddp_rs_bucketer_create(1024, &bucketer));
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(NULL, group, in, 1, DDP_F32, DDP_SUM,
                                                    on_shard, NULL),
               "bucketer");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, NULL, in, 1, DDP_F32, DDP_SUM,
                                                    on_shard, NULL),
               "group");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, NULL, 1, DDP_F32, DDP_SUM,
                                                    on_shard, NULL),
               "input");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, in, SIZE_MAX, DDP_F32,
                                                    DDP_SUM, on_shard, NULL),
               "count");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, in, SIZE_MAX / 2, DDP_F32,
                                                    DDP_SUM, on_shard, NULL),
               "count");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, in, 1, BAD_DTYPE, DDP_SUM,
                                                    on_shard, NULL),
               "dtype");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, in, 1, DDP_F32, BAD_OP,
                                                    on_shard, NULL),
               "op");
    const void *blocks[2] = {in, NULL};
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_blocks_async(bucketer, group, NULL, 1, DDP_F32,
                                                           DDP_SUM, on_shard, NULL),
               "blocks");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_blocks_async(NULL, group, blocks, 1, DDP_F32,
                                                           DDP_SUM, on_shard, NULL),
               "bucketer");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_blocks_async(bucketer, group, blocks, 1, NEG_DTYPE,
                                                           DDP_SUM, on_shard, NULL),
               "dtype");
    EXPECT_BAD(ddp_rs_bucketer_reduce_scatter_blocks_async(bucketer, group, blocks, SIZE_MAX,
                                                           DDP_F32, DDP_SUM, on_shard, NULL),
               "count");
    EXPECT_BAD(ddp_rs_bucketer_flush(NULL), "bucketer");
    EXPECT_BAD(ddp_rs_bucketer_teardown(NULL), "bucketer");
    EXPECT_BAD(ddp_rs_bucketer_setup(NULL), "bucketer");
    uint64_t flushes = 0, direct = 0;
    EXPECT_BAD(ddp_rs_bucketer_counts(NULL, &flushes, &direct), "bucketer");
    size_t bytes = 1;
    QUIET(bytes = ddp_rs_bucketer_memory_bytes(NULL));
    CHECK(bytes == 0);
    /* teardown with an unflushed input is a usage error naming the bucket */
    EXPECT_OK(ddp_rs_bucketer_reduce_scatter_async(bucketer, group, in, 2, DDP_F32, DDP_SUM,
                                                   on_shard, NULL));
    EXPECT_USAGE(ddp_rs_bucketer_teardown(bucketer), "bucket");
    EXPECT_OK(ddp_rs_bucketer_flush(bucketer));
    EXPECT_OK(ddp_rs_bucketer_teardown(bucketer));
    /* destroy keeps the caller's error text (e.g. the failure a cleanup path reports). */
    EXPECT_BAD(ddp_rs_bucketer_flush(NULL), "bucketer");
    QUIET(ddp_rs_bucketer_destroy(bucketer));
    CHECK(strstr(ddp_last_error(), "bucketer is NULL") != NULL);

    /* optimizer */
    float p[5] = {1, 2, 3, 4, 5}, gr[5] = {0};
    ddp_param_t params[1] = {{"p", p, 5, DDP_F32, 0, 0, NULL}};
    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    ddp_optim_t *optim = NULL;
    EXPECT_BAD(ddp_optim_create(NULL, 1, &oc, &optim), "params");
    EXPECT_BAD(ddp_optim_create(params, 1, NULL, &optim), "config");
    EXPECT_BAD(ddp_optim_create(params, 1, &oc, NULL), "out");
#define WITH_BAD_OC(field, value, needle)                                                         \
    do {                                                                                          \
        oc = (ddp_optim_config_t)DDP_OPTIM_CONFIG_INIT;                                           \
        oc.field = value;                                                                         \
        EXPECT_BAD(ddp_optim_create(params, 1, &oc, &optim), needle);                             \
        CHECK(optim == NULL);                                                                     \
    } while (0)
    WITH_BAD_OC(kind, (ddp_optim_kind_t)7, "kind");
    WITH_BAD_OC(lr, -1.0, "lr");
    WITH_BAD_OC(lr, NAN, "lr");
    WITH_BAD_OC(momentum, -0.5, "momentum");
    WITH_BAD_OC(nesterov, 1, "nesterov");
    WITH_BAD_OC(weight_decay, -1.0, "weight_decay");
    oc = (ddp_optim_config_t)DDP_OPTIM_CONFIG_INIT;
    oc.kind = DDP_OPTIM_ADAM;
    oc.beta1 = 1.0;
    EXPECT_BAD(ddp_optim_create(params, 1, &oc, &optim), "beta1");
    oc.beta1 = 0.9;
    oc.beta2 = -0.1;
    EXPECT_BAD(ddp_optim_create(params, 1, &oc, &optim), "beta2");
    oc.beta2 = 0.999;
    oc.eps = -1;
    EXPECT_BAD(ddp_optim_create(params, 1, &oc, &optim), "eps");
    oc = (ddp_optim_config_t)DDP_OPTIM_CONFIG_INIT;
    ddp_param_t bad[1];
    memcpy(bad, params, sizeof bad);
    bad[0].dtype = DDP_I32; /* f16/bf16 are updated through f32 master copies; integers never */
    EXPECT(ddp_optim_create(bad, 1, &oc, &optim), DDP_ERR_UNSUPPORTED, "dtype");
    memcpy(bad, params, sizeof bad);
    bad[0].data = NULL;
    EXPECT_BAD(ddp_optim_create(bad, 1, &oc, &optim), "data");
    /* Regression: a numel whose byte size overflows (above PTRDIFF_MAX / dtype size) was
     * accepted, and a step then wrote past the data. The limit itself is accepted (SGD without
     * momentum allocates nothing per element, so no memory is needed to create it). */
    memcpy(bad, params, sizeof bad);
    bad[0].numel = SIZE_MAX;
    EXPECT_BAD(ddp_optim_create(bad, 1, &oc, &optim), "params[0].numel");
    CHECK(optim == NULL);
    bad[0].numel = (size_t)PTRDIFF_MAX / sizeof(float) + 1;
    EXPECT_BAD(ddp_optim_create(bad, 1, &oc, &optim), "params[0].numel");
    CHECK(optim == NULL);
    bad[0].numel = (size_t)PTRDIFF_MAX / sizeof(float);
    EXPECT_OK(ddp_optim_create(bad, 1, &oc, &optim));
    ddp_optim_destroy(optim);
    optim = NULL;
    ddp_param_t bad64[1];
    memcpy(bad64, params, sizeof bad64);
    bad64[0].dtype = DDP_F64;
    bad64[0].numel = (size_t)PTRDIFF_MAX / sizeof(double) + 1; /* fits f32, not f64 */
    EXPECT_BAD(ddp_optim_create(bad64, 1, &oc, &optim), "params[0].numel");
    CHECK(optim == NULL);
    /* Each fits, their sum does not: the second is named. */
    ddp_param_t two[2];
    memcpy(&two[0], params, sizeof two[0]);
    memcpy(&two[1], params, sizeof two[1]);
    two[0].numel = two[1].numel = (size_t)PTRDIFF_MAX / sizeof(float) / 2 + 1;
    EXPECT_BAD(ddp_optim_create(two, 2, &oc, &optim), "params[1].numel");
    CHECK(optim == NULL);
    bad[0].numel = SIZE_MAX;
    QUIET(ddp_optim_destroy(NULL));
    QUIET(bytes = ddp_optim_state_bytes(NULL));
    CHECK(bytes == 0);
    EXPECT_OK(ddp_optim_create(params, 1, &oc, &optim));
    void *grads[1] = {gr};
    void *null_grads[1] = {NULL};
    EXPECT_BAD(ddp_optim_step(NULL, grads), "optim");
    EXPECT_BAD(ddp_optim_step(optim, NULL), "grads");
    EXPECT_BAD(ddp_optim_step(optim, null_grads), "grads");
    EXPECT_OK(ddp_optim_step(optim, grads));
    ddp_optim_destroy(optim);

    /* ZeRO */
    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    ddp_zero_t *zero = NULL;
    EXPECT_BAD(ddp_zero_create(NULL, params, 1, &zc, &zero), "group");
    EXPECT_BAD(ddp_zero_create(group, NULL, 1, &zc, &zero), "params");
    EXPECT_BAD(ddp_zero_create(group, params, 1, NULL, &zero), "config");
    EXPECT_BAD(ddp_zero_create(group, params, 1, &zc, NULL), "out");
    zc.stage = 3;
    EXPECT_BAD(ddp_zero_create(group, params, 1, &zc, &zero), "stage");
    zc.stage = 0;
    EXPECT_BAD(ddp_zero_create(group, params, 1, &zc, &zero), "stage");
    zc.stage = 2;
    zc.overlap = 1;
    EXPECT_BAD(ddp_zero_create(group, params, 1, &zc, &zero), "overlap");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    zc.optim.lr = -2;
    EXPECT_BAD(ddp_zero_create(group, params, 1, &zc, &zero), "lr");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    EXPECT_BAD(ddp_zero_create(group, bad, 1, &zc, &zero), "params[0].numel");
    CHECK(zero == NULL);
    EXPECT_BAD(ddp_zero_create(group, bad64, 1, &zc, &zero), "params[0].numel");
    CHECK(zero == NULL);
    zc.stage = 2;
    EXPECT_BAD(ddp_zero_create(group, two, 2, &zc, &zero), "params[1].numel");
    zc.stage = 1;
    CHECK(zero == NULL);
    QUIET(ddp_zero_destroy(NULL));
    QUIET(bytes = ddp_zero_state_bytes(NULL));
    CHECK(bytes == 0);
    QUIET(bytes = ddp_zero_owned_numel(NULL));
    CHECK(bytes == 0);

    EXPECT_OK(ddp_zero_create(group, params, 1, &zc, &zero));
    int owner = 5;
    EXPECT_BAD(ddp_zero_step(NULL, grads), "zero");
    EXPECT_BAD(ddp_zero_step(zero, NULL), "grads");
    EXPECT_BAD(ddp_zero_step(zero, null_grads), "grads");
    EXPECT_USAGE(ddp_zero_grad_ready(zero, 0, gr), "stage");
    EXPECT_BAD(ddp_zero_param_owner(NULL, 0, &owner), "zero");
    EXPECT_BAD(ddp_zero_param_owner(zero, 1, &owner), "index");
    EXPECT_BAD(ddp_zero_param_owner(zero, 0, NULL), "rank");
    EXPECT_OK(ddp_zero_param_owner(zero, 0, &owner));
    CHECK(owner == 0);
    float data[5] = {1, 2, 3, 4, 5};
    size_t pidx[1] = {0}, offs[1] = {0}, numels[1] = {5}, rows[1] = {0};
    ddp_comm_bucket_t bucket = {0, data, 5, DDP_F32, 1, pidx, offs, numels, rows, 0, 1, 0};
    ddp_work_t *work = NULL;
    EXPECT_BAD(ddp_zero_hook(NULL, group, &bucket, &work), "state");
    /* A ZeRO object without overlap as the hook state. */
    EXPECT_BAD(ddp_zero_hook(zero, group, &bucket, &work), "overlap");
    CHECK(work == NULL);
    ddp_zero_destroy(zero);
    zero = NULL;

    zc.stage = 2;
    EXPECT_OK(ddp_zero_create(group, params, 1, &zc, &zero));
    EXPECT_BAD(ddp_zero_grad_ready(NULL, 0, gr), "zero");
    EXPECT_BAD(ddp_zero_grad_ready(zero, 1, gr), "index");
    EXPECT_BAD(ddp_zero_grad_ready(zero, SIZE_MAX, gr), "index");
    EXPECT_BAD(ddp_zero_grad_ready(zero, 0, NULL), "grad");
    EXPECT_OK(ddp_zero_grad_ready(zero, 0, gr));
    EXPECT_USAGE(ddp_zero_grad_ready(zero, 0, gr), "p");
    EXPECT_OK(ddp_zero_step(zero, NULL));
    EXPECT_OK(ddp_zero_param_owner(zero, 0, &owner));
    CHECK(owner == -1);
    ddp_zero_destroy(zero);

    zc.stage = 1;
    zc.overlap = 1;
    EXPECT_OK(ddp_zero_create(group, params, 1, &zc, &zero));
    EXPECT_BAD(ddp_zero_step(zero, grads), "grads"); /* overlap: grads must be NULL */
    EXPECT_BAD(ddp_zero_hook(zero, NULL, &bucket, &work), "group");
    EXPECT_BAD(ddp_zero_hook(zero, group, NULL, &work), "bucket");
    EXPECT_BAD(ddp_zero_hook(zero, group, &bucket, NULL), "work");
    size_t bad_pidx[1] = {3};
    ddp_comm_bucket_t bad_bucket = bucket;
    bad_bucket.params = bad_pidx;
    EXPECT_BAD(ddp_zero_hook(zero, group, &bad_bucket, &work), "parameter 3");
    ddp_zero_destroy(zero);

    ddp_group_destroy(group);
    ddp_store_destroy(store);
}

static void check_fsdp(void)
{
    ddp_store_t *store = NULL;
    ddp_group_t *group = make_group1(&store);
    float w[6] = {1, 2, 3, 4, 5, 6}, b[2] = {0};
    ddp_param_t params[2] = {{"w", w, 6, DDP_F32, 0, 0, NULL}, {"b", b, 2, DDP_F32, 0, 0, NULL}};
    ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
    QUIET(ddp_fsdp_config_init(NULL));
    ddp_fsdp_t *f = NULL;
    EXPECT_BAD(ddp_fsdp_create(group, params, 2, NULL, 2, &fc, NULL), "out");
    EXPECT_BAD(ddp_fsdp_create(NULL, params, 2, NULL, 2, &fc, &f), "group");
    EXPECT_BAD(ddp_fsdp_create(group, params, 2, NULL, 2, NULL, &f), "config");
    EXPECT_BAD(ddp_fsdp_create(group, NULL, 2, NULL, 2, &fc, &f), "params");
    EXPECT_BAD(ddp_fsdp_create(group, params, 2, NULL, 0, &fc, &f), "nunits");
    ddp_param_t bad[2];
    memcpy(bad, params, sizeof bad);
    bad[0].dtype = DDP_I32;
    EXPECT(ddp_fsdp_create(group, bad, 2, NULL, 2, &fc, &f), DDP_ERR_UNSUPPORTED, "dtype");
    memcpy(bad, params, sizeof bad);
    bad[1].numel = SIZE_MAX;
    EXPECT_BAD(ddp_fsdp_create(group, bad, 2, NULL, 2, &fc, &f), "params[1].numel");
    memcpy(bad, params, sizeof bad);
    bad[0].data = NULL;
    EXPECT_BAD(ddp_fsdp_create(group, bad, 2, NULL, 2, &fc, &f), "data");
    fc.optim.kind = (ddp_optim_kind_t)7;
    EXPECT_BAD(ddp_fsdp_create(group, params, 2, NULL, 2, &fc, &f), "kind");
    fc.optim.kind = DDP_OPTIM_SGD;
    CHECK(f == NULL);
    QUIET(ddp_fsdp_destroy(NULL));
    EXPECT_OK(ddp_fsdp_create(group, params, 2, NULL, 2, &fc, &f));

    void *ptr = NULL;
    double x = 0;
    size_t n = 0;
    ddp_fsdp_memory_t m;
    EXPECT_BAD(ddp_fsdp_prefetch(NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_prefetch(f, 2), "unit 2");
    EXPECT_BAD(ddp_fsdp_gather(NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_gather(f, SIZE_MAX), "unit");
    EXPECT_BAD(ddp_fsdp_release(NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_release(f, 2), "unit 2");
    EXPECT_BAD(ddp_fsdp_param(NULL, 0, &ptr), "fsdp");
    EXPECT_BAD(ddp_fsdp_param(f, 0, NULL), "data");
    EXPECT_BAD(ddp_fsdp_param(f, 2, &ptr), "index 2");
    EXPECT_USAGE(ddp_fsdp_param(f, 1, &ptr), "ddp_fsdp_gather");
    EXPECT_BAD(ddp_fsdp_grad(NULL, 0, &ptr), "fsdp");
    EXPECT_BAD(ddp_fsdp_grad(f, 0, NULL), "grad");
    EXPECT_BAD(ddp_fsdp_grad(f, 2, &ptr), "index 2");
    EXPECT_BAD(ddp_fsdp_grad_ready(NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_grad_ready(f, 2), "unit 2");
    EXPECT_BAD(ddp_fsdp_set_sync(NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_step(NULL), "fsdp");
    EXPECT_BAD(ddp_fsdp_grad_norm(NULL, &x), "fsdp");
    EXPECT_BAD(ddp_fsdp_grad_norm(f, NULL), "norm");
    EXPECT_BAD(ddp_fsdp_set_lr(NULL, 0, 0.1), "fsdp");
    EXPECT_BAD(ddp_fsdp_set_lr(f, 5, 0.1), "group 5");
    EXPECT_BAD(ddp_fsdp_set_lr(f, 0, -1), "lr");
    EXPECT_BAD(ddp_fsdp_scale_lr(NULL, 1), "fsdp");
    EXPECT_BAD(ddp_fsdp_scale_lr(f, NAN), "factor");
    EXPECT_BAD(ddp_fsdp_get_lr(NULL, 0, &x), "fsdp");
    EXPECT_BAD(ddp_fsdp_get_lr(f, 0, NULL), "lr");
    EXPECT_BAD(ddp_fsdp_memory(NULL, &m), "fsdp");
    EXPECT_BAD(ddp_fsdp_memory(f, NULL), "out");
    EXPECT_BAD(ddp_fsdp_param_shard(NULL, 0, NULL, NULL, NULL), "fsdp");
    EXPECT_BAD(ddp_fsdp_param_shard(f, 9, NULL, NULL, NULL), "index 9");
    EXPECT_OK(ddp_fsdp_param_shard(f, 1, NULL, NULL, &n));
    CHECK(n == 2);
    EXPECT_BAD(ddp_fsdp_state_size(NULL, &n), "fsdp");
    EXPECT_BAD(ddp_fsdp_state_size(f, NULL), "bytes");
    EXPECT_OK(ddp_fsdp_state_size(f, &n));
    EXPECT_BAD(ddp_fsdp_state_save(NULL, w, n), "fsdp");
    EXPECT_BAD(ddp_fsdp_state_save(f, NULL, n), "buf");
    EXPECT_BAD(ddp_fsdp_state_save(f, w, 4), "size");
    size_t sizes[1] = {n};
    const void *blobs[1] = {NULL};
    EXPECT_BAD(ddp_fsdp_state_load(NULL, blobs, sizes, 1), "fsdp");
    EXPECT_BAD(ddp_fsdp_state_load(f, NULL, sizes, 1), "blobs");
    EXPECT_BAD(ddp_fsdp_state_load(f, blobs, sizes, 1), "blob 0 is NULL");
    EXPECT_BAD(ddp_fsdp_state_load(f, blobs, sizes, 0), "nblobs");
    EXPECT_BAD(ddp_fsdp_consolidated_optim_size(NULL, &n), "fsdp");
    EXPECT_BAD(ddp_fsdp_consolidated_optim_size(f, NULL), "bytes");
    EXPECT_BAD(ddp_fsdp_consolidate(NULL, 0, NULL, NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_consolidate(f, -1, NULL, NULL, 0), "root");
    EXPECT_BAD(ddp_fsdp_consolidate(f, 0, NULL, NULL, 0), "params");
    EXPECT_BAD(ddp_fsdp_load_consolidated(NULL, NULL, NULL, 0), "fsdp");
    EXPECT_BAD(ddp_fsdp_load_consolidated(f, NULL, NULL, 0), "params");
    /* Order: a step with a unit gathered, a parameter of a prefetching unit. */
    EXPECT_OK(ddp_fsdp_gather(f, 0));
    EXPECT_USAGE(ddp_fsdp_step(f), "release");
    EXPECT_OK(ddp_fsdp_release(f, 0));
    EXPECT_OK(ddp_fsdp_step(f));
    ddp_fsdp_destroy(f);

    ddp_group_destroy(group);
    ddp_store_destroy(store);
}

int main(int argc, char **argv)
{
    unsetenv("DDP_LOG_LEVEL");
    survey = getenv("DDP_MISUSE_SURVEY") != NULL;
    unsetenv("DDP_TRANSPORT");
    const char *section = argc > 1 ? argv[1] : "all";
    int all = strcmp(section, "all") == 0;
    int ran = 0;
#define SECTION(name, fn)                                                                         \
    if (all || strcmp(section, name) == 0) {                                                      \
        fprintf(stderr, "section %s\n", name);                                                    \
        check_cleared = 1; /* every success clears the text (ddp/status.h), group's included */ \
        fn();                                                                                     \
        ran = 1;                                                                                  \
    }
    SECTION("core", check_core);
    SECTION("store", check_store);
    SECTION("group", check_group);
    SECTION("group2", check_group2);
    SECTION("group3", check_group3);
    SECTION("reducer", check_reducer);
    SECTION("hooks", check_hooks);
#ifdef DDP_MISUSE_HAVE_POWERSGD
    SECTION("powersgd", check_powersgd);
#else
    if (strcmp(section, "powersgd") == 0) {
        fprintf(stderr, "libddp_powersgd is not built: nothing to check\n");
        ran = 1;
    }
#endif
    SECTION("shard", check_shard);
    SECTION("fsdp", check_fsdp);
    CHECK_MSG(ran, "unknown section '%s'", section);
    if (capture_fd >= 0) close(capture_fd);
    if (failures) {
        fprintf(stderr, "%d expectations failed\n", failures);
        return 1;
    }
    fprintf(stderr, "ok\n");
    return 0;
}
