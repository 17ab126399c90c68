/* Store API from one process: the semantics every implementation shares (hash, file, TCP and
 * prefix run the same checks), prefix isolation, and argument validation naming the argument. */
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_store_common.h"

static void validation(ddp_store_t *s)
{
    void *v = NULL;
    size_t n = 0;
    int64_t r = 0;
    int all = 0;
    char too_long[DDP_STORE_MAX_KEY + 2];
    memset(too_long, 'x', sizeof too_long - 1);
    too_long[sizeof too_long - 1] = 0;

    CHECK_STATUS(ddp_store_set(NULL, "k", "v", 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("store is NULL");
    CHECK_STATUS(ddp_store_set(s, NULL, "v", 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("key is NULL");
    CHECK_STATUS(ddp_store_set(s, too_long, "v", 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("DDP_STORE_MAX_KEY");
    CHECK_ERROR_MENTIONS("key");
    CHECK_STATUS(ddp_store_set(s, "k", NULL, 3), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("value is NULL");
    CHECK_STATUS(ddp_store_set(s, "k", "v", (size_t)DDP_STORE_MAX_VALUE + 1),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("DDP_STORE_MAX_VALUE");

    CHECK_STATUS(ddp_store_get(NULL, "k", &v, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("store");
    CHECK_STATUS(ddp_store_get(s, NULL, &v, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("key");
    CHECK_STATUS(ddp_store_get(s, too_long, &v, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_get(s, "k", NULL, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("value is NULL");
    CHECK_STATUS(ddp_store_get(s, "k", &v, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("len is NULL");

    CHECK_STATUS(ddp_store_add(NULL, "k", 1, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_add(s, NULL, 1, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_add(s, "k", 1, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("result is NULL");

    CHECK_STATUS(ddp_store_compare_set(s, "k", NULL, 1, "d", 1, &v, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("expected is NULL");
    CHECK_STATUS(ddp_store_compare_set(s, "k", NULL, 0, NULL, 2, &v, &n), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("desired is NULL");
    CHECK_STATUS(ddp_store_compare_set(s, "k", NULL, 0, "d", 1, NULL, &n),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("current is NULL");
    CHECK_STATUS(ddp_store_compare_set(s, too_long, NULL, 0, "d", 1, &v, &n),
                 DDP_ERR_INVALID_ARGUMENT);

    const char *keys[3] = {"a", NULL, "c"};
    CHECK_STATUS(ddp_store_check(s, keys, 3, &all), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("keys[1] is NULL");
    CHECK_STATUS(ddp_store_check(s, NULL, 2, &all), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("keys is NULL");
    CHECK_STATUS(ddp_store_check(s, keys, 1, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("all_exist is NULL");
    CHECK_STATUS(ddp_store_wait(s, keys, 3, 10), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("keys[1]");
    CHECK_STATUS(ddp_store_wait(s, keys, 1, -1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("timeout_ms");
    keys[1] = too_long;
    CHECK_STATUS(ddp_store_wait(s, keys, 3, 10), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("keys[1]");

    CHECK_STATUS(ddp_store_delete(NULL, "k", NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_delete(s, NULL, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_num_keys(NULL, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_num_keys(s, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("count is NULL");
    CHECK_STATUS(ddp_store_set_timeout(NULL, 10), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_set_timeout(s, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("timeout_ms");
    CHECK(ddp_store_timeout(NULL) < 0);
    ddp_store_destroy(NULL);

    /* Nothing of the rejected calls reached the store. */
    CHECK(!key_exists(s, "k"));
}

static void creation_validation(void)
{
    ddp_store_t *s = NULL;
    CHECK_STATUS(ddp_store_hash_create(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out is NULL");
    CHECK_STATUS(ddp_store_file_create(NULL, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("path is NULL");
    CHECK_STATUS(ddp_store_file_create("/tmp/x", NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_file_create("/nonexistent-dir/ddp/store", &s), DDP_ERR_NOT_FOUND);
    CHECK_ERROR_MENTIONS("/nonexistent-dir/ddp/store");
    CHECK_STATUS(ddp_store_tcp_connect(NULL, 1234, NULL, 10, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("host");
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", 0, NULL, 10, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("port");
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", 70000, NULL, 10, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", 1234, NULL, -1, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("timeout_ms");
    CHECK_STATUS(ddp_store_tcp_connect("127.0.0.1", 1234, NULL, 10, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_prefix_create(NULL, "p", &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("base is NULL");
    ddp_store_server_t *server = NULL;
    CHECK_STATUS(ddp_store_server_start(NULL, -1, NULL, &server), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("port");
    CHECK_STATUS(ddp_store_server_start(NULL, 0, NULL, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_store_server_start("not an address", 0, NULL, &server),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bind_addr");
    CHECK(ddp_store_server_port(NULL) < 0);
    ddp_store_server_stop(NULL);
}

/* Two prefixes over one base never see each other's keys; the base sees both, prefixed. */
static void prefix_isolation(ddp_store_t *base)
{
    ddp_store_t *a = NULL, *b = NULL, *nested = NULL;
    CHECK_OK(ddp_store_prefix_create(base, "job-a", &a));
    CHECK_OK(ddp_store_prefix_create(base, "job-b", &b));
    CHECK_OK(ddp_store_prefix_create(a, "inner", &nested));
    CHECK_STATUS(ddp_store_prefix_create(base, NULL, &a), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("prefix is NULL");
    CHECK_OK(ddp_store_set_timeout(b, 50));

    CHECK_OK(ddp_store_set(a, "k", "from-a", 6));
    CHECK(!key_exists(b, "k"));
    void *v = NULL;
    size_t n = 0;
    CHECK_STATUS(ddp_store_get(b, "k", &v, &n), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("job-b/k");
    CHECK_OK(ddp_store_set(b, "k", "from-b", 6));
    expect_value(a, "k", "from-a", 6);
    expect_value(b, "k", "from-b", 6);
    expect_value(base, "job-a/k", "from-a", 6);
    expect_value(base, "job-b/k", "from-b", 6);
    CHECK(!key_exists(base, "k"));

    int64_t r = 0;
    CHECK_OK(ddp_store_add(a, "n", 3, &r));
    CHECK_OK(ddp_store_add(b, "n", 10, &r));
    CHECK(r == 10);
    CHECK(value_as_int(a, "n") == 3);

    CHECK_OK(ddp_store_set(nested, "k", "deep", 4));
    expect_value(base, "job-a/inner/k", "deep", 4);
    expect_value(a, "inner/k", "deep", 4);

    int deleted = 0;
    CHECK_OK(ddp_store_delete(b, "k", &deleted));
    CHECK(deleted == 1);
    expect_value(a, "k", "from-a", 6);

    int64_t base_count = 0, prefix_count = 0;
    CHECK_OK(ddp_store_num_keys(base, &base_count));
    CHECK_OK(ddp_store_num_keys(a, &prefix_count));
    CHECK(base_count == prefix_count);

    /* A key that fits alone but not with the prefix is refused, naming it. */
    char key[DDP_STORE_MAX_KEY + 1];
    memset(key, 'z', DDP_STORE_MAX_KEY);
    key[DDP_STORE_MAX_KEY] = 0;
    CHECK_STATUS(ddp_store_set(a, key, "v", 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("DDP_STORE_MAX_KEY");
    CHECK_ERROR_MENTIONS("job-a");

    /* The prefix handle's own timeout bounds its waits; base keeps its own. */
    const char *missing[1] = {"never"};
    CHECK_STATUS(ddp_store_wait(b, missing, 1, 0), DDP_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("job-b/never");

    ddp_store_destroy(nested);
    ddp_store_destroy(a);
    ddp_store_destroy(b);
}

/* Adds to a shared counter, and sets and reads back a key of its own: replies meant for another
 * process would show up as a foreign value. */
static void store_hammer(ddp_store_t *s, const char *counter, int who, int rounds)
{
    int64_t r = 0;
    for (int i = 0; i < rounds; i++) {
        CHECK_OK(ddp_store_add(s, counter, 1, &r));
        char key[96], value[32];
        snprintf(key, sizeof key, "%s/own/%d", counter, who);
        int n = snprintf(value, sizeof value, "%d:%d", who, i);
        CHECK_OK(ddp_store_set(s, key, value, (size_t)n));
        expect_value(s, key, value, (size_t)n);
    }
}

/* A handle created before fork() keeps working in parent and children at once: each process
 * must get its own file lock / connections, or adds would be lost or replies interleaved. */
static void inherited_handle(ddp_store_t *s, const char *name)
{
    enum { CHILDREN = 3, ADDS = 200 };
    char key[64];
    snprintf(key, sizeof key, "forked/%s", name);
    int64_t r = 0;
    CHECK_OK(ddp_store_add(s, key, 0, &r)); /* the parent has used the handle before forking */
    fflush(stdout);
    pid_t pids[CHILDREN];
    for (int c = 0; c < CHILDREN; c++) {
        pids[c] = fork();
        CHECK(pids[c] >= 0);
        if (pids[c] == 0) {
            store_hammer(s, key, c + 1, ADDS);
            _exit(0);
        }
    }
    store_hammer(s, key, 0, ADDS);
    for (int c = 0; c < CHILDREN; c++) {
        int status = 0;
        CHECK(waitpid(pids[c], &status, 0) == pids[c]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    CHECK_MSG(value_as_int(s, key) == (CHILDREN + 1) * ADDS, "%s: %" PRId64 " after fork, want %d",
              name, value_as_int(s, key), (CHILDREN + 1) * ADDS);
}

/* The file store's log survives a writer that died mid-append (the torn record is cut by the
 * next writer, ignored by readers) and reports a file that is not a store log. */
static void file_recovery(const char *dir)
{
    char path[600];
    snprintf(path, sizeof path, "%s/torn", dir);
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_file_create(path, &s));
    CHECK_OK(ddp_store_set(s, "before", "1", 1));
    /* A record header promising 100 value bytes, followed by only 3 of them. */
    int fd = open(path, O_WRONLY | O_APPEND);
    CHECK(fd >= 0);
    const unsigned char torn[] = {0x44, 0x44, 0x50, 0x53, 1, 0, 0, 0, 1, 0, 0, 0, 100, 0, 0, 0,
                                  'x', 'a', 'b', 'c'};
    CHECK(write(fd, torn, sizeof torn) == (ssize_t)sizeof torn);
    close(fd);
    ddp_store_t *reader = NULL;
    CHECK_OK(ddp_store_file_create(path, &reader));
    expect_value(reader, "before", "1", 1);
    CHECK(!key_exists(reader, "x"));
    CHECK_OK(ddp_store_set(s, "after", "2", 1)); /* cuts the torn record, then appends */
    expect_value(reader, "after", "2", 1);
    expect_value(reader, "before", "1", 1);
    ddp_store_t *fresh = NULL;
    CHECK_OK(ddp_store_file_create(path, &fresh));
    expect_value(fresh, "after", "2", 1);
    int64_t count = 0;
    CHECK_OK(ddp_store_num_keys(fresh, &count));
    CHECK(count == 2);
    ddp_store_destroy(fresh);
    ddp_store_destroy(reader);
    ddp_store_destroy(s);
    unlink(path);

    snprintf(path, sizeof path, "%s/not-a-store", dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs("this is not a store log, just some text file\n", f);
    fclose(f);
    CHECK_OK(ddp_store_file_create(path, &s));
    CHECK_STATUS(ddp_store_set(s, "k", "v", 1), DDP_ERR_PROTOCOL);
    CHECK_ERROR_MENTIONS("corrupt");
    CHECK_ERROR_MENTIONS(path);
    ddp_store_destroy(s);
    unlink(path);
}

static void run_suite(ddp_store_t *s, const char *name)
{
    validation(s);
    store_semantics(s, "plain", DDP_STORE_MAX_KEY);
    ddp_store_t *p = NULL;
    CHECK_OK(ddp_store_prefix_create(s, "pfx", &p));
    store_semantics(p, "prefixed", DDP_STORE_MAX_KEY - 4);
    validation(p);
    ddp_store_destroy(p);
    prefix_isolation(s);
    if (strcmp(name, "hash") != 0) inherited_handle(s, name);
    printf("%s store: ok\n", name);
}

int main(void)
{
    creation_validation();

    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_hash_create(&s));
    run_suite(s, "hash");
    ddp_store_destroy(s);

    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[600];
    snprintf(path, sizeof path, "%s/store", dir);
    CHECK_OK(ddp_store_file_create(path, &s));
    run_suite(s, "file");
    ddp_store_destroy(s);
    /* The file keeps the keys: a new handle reads them back. */
    CHECK_OK(ddp_store_file_create(path, &s));
    expect_value(s, "plain/cas", "second", 6);
    expect_value(s, "pfx/prefixed/cas", "second", 6);
    ddp_store_destroy(s);
    unlink(path);
    file_recovery(dir);
    rmdir(dir);

    /* The suite forks (inherited_handle), so the server runs in a process of its own rather than
     * as a thread of this one: see store_server_process_start. */
    store_server_process_t server;
    store_server_process_start("api-token", 0, 0, &server);
    CHECK_OK(ddp_store_tcp_connect("127.0.0.1", server.port, "api-token", 5000, &s));
    CHECK(ddp_store_timeout(s) == 5000);
    run_suite(s, "tcp");
    ddp_store_destroy(s);
    store_server_process_stop(&server);
    return 0;
}
