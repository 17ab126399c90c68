/* Bad values of DDP_* variables are errors at the call that reads them (issue 12): the call returns
 * DDP_ERR_INVALID_ARGUMENT and its error text names the variable and the value, instead of the
 * value silently becoming the default or being clamped. Valid values keep their meaning.
 * Usage: test_config <part>, part one of: group, shm, store, ddprun. */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

typedef struct {
    const char *name;
    const char *value;
} setting_t;

/* The bad values the issue lists, then a few more of each kind. */
static const setting_t bad_timeouts[] = {
    {"DDP_TIMEOUT", "5s"}, {"DDP_TIMEOUT", "abc"},     {"DDP_TIMEOUT", "-1"},
    {"DDP_TIMEOUT", "0"},  {"DDP_TIMEOUT", "3000000"}, {"DDP_TIMEOUT", "inf"},
    {"DDP_TIMEOUT", "nan"}, {"DDP_TIMEOUT", "0x10"},   {"DDP_TIMEOUT", "1e400"},
    {"DDP_TIMEOUT", "30 "},
};

/* Variables the group reads, whatever the transport turns out to be. */
static const setting_t bad_group_settings[] = {
    {"DDP_TRANSPORT", "nope"},
    {"DDP_TRANSPORT", "SHM"},
    {"DDP_HIERARCHICAL", "yes"},
    {"DDP_HIERARCHICAL", "2"},
    {"DDP_HIERARCHICAL", "-1"},
    {"DDP_LOG_LEVEL", "verbose"},
    {"DDP_LOG_LEVEL", "WARN"},
};

/* The shared-memory transport's knobs (read when a group of 2+ ranks on one host forms). */
static const setting_t bad_shm_settings[] = {
    {"DDP_SHM_ROUND_BYTES", "abc"},
    {"DDP_SHM_ROUND_BYTES", "1k"},
    {"DDP_SHM_ROUND_BYTES", "100"},
    {"DDP_SHM_ROUND_BYTES", "99999999"},
    {"DDP_SHM_ALLREDUCE_ROUND_BYTES", "0"},
    {"DDP_SHM_ALLREDUCE_ROUND_BYTES", "2097152"},
    {"DDP_SHM_ONESHOT_BYTES", "-1"},
    {"DDP_SHM_ONESHOT_BYTES", "2000000"},
    {"DDP_SHM_YIELD_NS", "fast"},
    {"DDP_SHM_YIELD_NS", "-5"},
    {"DDP_SHM_YIELD_NS", "200000000"},
    {"DDP_SHM_SPIN_NS", "x"},
    {"DDP_SHM_SPIN_NS", "-1"},
    {"DDP_SHM_CMA", "on"},
    {"DDP_SHM_CMA", "OFF"},
    {"DDP_SHM_CMA_BYTES", "-1"},
    {"DDP_SHM_CMA_BYTES", "1M"},
    {"DDP_SHM_CMA_HUGEPAGES", "2"},
    {"DDP_SHM_MAP", "yes"},
    {"DDP_SHM_MAP", "AUTO"},
    {"DDP_SHM_TUNE", "always"},
    {"DDP_SHM_STAGED_STORES", "streaming"},
    {"DDP_SHM_STAGED_ROUNDS", "1M"},
    {"DDP_SHM_MAPPED_STORES", "stream"},
    {"DDP_SHM_MAP_WATCH", "on"},
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static const char *const all_names[] = {
    "DDP_TIMEOUT",           "DDP_TRANSPORT",         "DDP_HIERARCHICAL",
    "DDP_LOG_LEVEL",         "DDP_SHM_ROUND_BYTES",   "DDP_SHM_ALLREDUCE_ROUND_BYTES",
    "DDP_SHM_ONESHOT_BYTES", "DDP_SHM_YIELD_NS",      "DDP_SHM_SPIN_NS",
    "DDP_SHM_CMA",           "DDP_SHM_CMA_BYTES",     "DDP_SHM_CMA_HUGEPAGES",
    "DDP_SHM_TUNE",          "DDP_SHM_STAGED_STORES", "DDP_SHM_STAGED_ROUNDS",
    "DDP_SHM_MAP",           "DDP_SHM_MAPPED_STORES", "DDP_SHM_MAP_WATCH",
};

static void clear_settings(void)
{
    for (size_t i = 0; i < COUNT(all_names); i++) unsetenv(all_names[i]);
}

/* The status must be DDP_ERR_INVALID_ARGUMENT and the error text must name the variable and quote
 * the value. */
static void expect_rejected(ddp_status_t s, const setting_t *bad, const char *call)
{
    const char *text = ddp_last_error();
    char quoted[128];
    snprintf(quoted, sizeof quoted, "'%s'", bad->value);
    CHECK_MSG(s == DDP_ERR_INVALID_ARGUMENT, "%s with %s='%s' returned %s (error text: %s)", call,
              bad->name, bad->value, ddp_status_string(s), text);
    CHECK_MSG(strstr(text, bad->name) && strstr(text, quoted),
              "%s with %s='%s': error text '%s' does not name the variable and the value", call,
              bad->name, bad->value, text);
}

/* A group over `store`; timeout_ms 0 leaves the timeout to DDP_TIMEOUT. */
static ddp_status_t create_group(ddp_store_t *store, int rank, int world, int timeout_ms,
                                 ddp_group_t **out)
{
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = timeout_ms;
    return ddp_group_create(store, rank, world, timeout_ms ? &o : NULL, out);
}

/* ---- group: world 1, each bad value of every variable the group reads ----------------------- */

static void check_group_rejects(const setting_t *bad, int timeout_ms)
{
    ddp_store_t *store = NULL;
    clear_settings();
    CHECK_OK(ddp_store_hash_create(&store));
    setenv(bad->name, bad->value, 1);
    ddp_group_t *g = NULL;
    ddp_status_t s = create_group(store, 0, 1, timeout_ms, &g);
    expect_rejected(s, bad, "ddp_group_create");
    CHECK(g == NULL);
    unsetenv(bad->name);
    ddp_store_destroy(store);
}

static void part_group(void)
{
    /* DDP_TIMEOUT is the group's default timeout. */
    for (size_t i = 0; i < COUNT(bad_timeouts); i++) check_group_rejects(&bad_timeouts[i], 0);
    for (size_t i = 0; i < COUNT(bad_group_settings); i++) {
        check_group_rejects(&bad_group_settings[i], 0);
        check_group_rejects(&bad_group_settings[i], 5000);
    }
    /* A world-1 group reads every DDP_SHM_* too: a typo shows on the first small run, not on
     * the first run with two ranks on a host. */
    for (size_t i = 0; i < COUNT(bad_shm_settings); i++)
        check_group_rejects(&bad_shm_settings[i], 0);

    /* Valid values keep their meaning: fractional seconds, whole seconds, empty = unset. */
    struct {
        const char *value;
        int ms;
    } good[] = {{"2.5", 2500}, {"30", 30000}, {"0.5", 500}, {"", 300000}, {"2000000", 2000000000}};
    for (size_t i = 0; i < COUNT(good); i++) {
        clear_settings();
        ddp_store_t *store = NULL;
        CHECK_OK(ddp_store_hash_create(&store));
        setenv("DDP_TIMEOUT", good[i].value, 1);
        ddp_group_t *g = NULL;
        CHECK_OK(create_group(store, 0, 1, 0, &g));
        CHECK_MSG(ddp_group_timeout_ms(g) == good[i].ms, "DDP_TIMEOUT='%s' gave %d ms",
                  good[i].value, ddp_group_timeout_ms(g));
        ddp_group_destroy(g);
        ddp_store_destroy(store);
    }
    clear_settings();
    setenv("DDP_TRANSPORT", "auto", 1);
    setenv("DDP_HIERARCHICAL", "0", 1);
    setenv("DDP_LOG_LEVEL", "none", 1);
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_hash_create(&store));
    ddp_group_t *g = NULL;
    CHECK_OK(create_group(store, 0, 1, 0, &g));
    ddp_group_destroy(g);
    ddp_store_destroy(store);
    clear_settings();
}

/* ---- shm: two ranks on one host, where the shm transport really reads its knobs ------------- */

static int shm_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    const setting_t *bad = arg;
    clear_settings();
    setenv(bad->name, bad->value, 1);
    ddp_group_t *g = NULL;
    ddp_status_t s = create_group(store, rank, world, 5000, &g);
    expect_rejected(s, bad, "ddp_group_create (2 ranks, shm)");
    return 0;
}

static int shm_good_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    clear_settings();
    setenv("DDP_TRANSPORT", "shm", 1);
    setenv("DDP_SHM_ROUND_BYTES", "4096", 1);
    setenv("DDP_SHM_ALLREDUCE_ROUND_BYTES", "1048576", 1);
    setenv("DDP_SHM_ONESHOT_BYTES", "0", 1);
    setenv("DDP_SHM_YIELD_NS", "100000000", 1);
    setenv("DDP_SHM_SPIN_NS", "0", 1);
    setenv("DDP_SHM_CMA", "off", 1);
    setenv("DDP_SHM_CMA_BYTES", "0", 1);
    setenv("DDP_SHM_CMA_HUGEPAGES", "0", 1);
    setenv("DDP_SHM_TUNE", "probe", 1);
    setenv("DDP_SHM_STAGED_STORES", "plain", 1);
    setenv("DDP_SHM_STAGED_ROUNDS", "long", 1);
    setenv("DDP_SHM_MAP", "off", 1);
    setenv("DDP_TIMEOUT", "2.5", 1);
    ddp_group_t *g = NULL;
    CHECK_OK(create_group(store, rank, world, 0, &g));
    CHECK(ddp_group_timeout_ms(g) == 2500);
    CHECK(strcmp(ddp_group_transport(g), "shm") == 0);
    int64_t x[3000];
    for (int i = 0; i < 3000; i++) x[i] = rank + 1;
    CHECK_OK(ddp_group_allreduce(g, x, x, 3000, DDP_I64, DDP_SUM));
    for (int i = 0; i < 3000; i++) CHECK(x[i] == 3);
    ddp_group_destroy(g);
    return 0;
}

static void part_shm(void)
{
    for (size_t i = 0; i < COUNT(bad_shm_settings); i++) {
        setting_t bad = bad_shm_settings[i];
        CHECK_MSG(ddp_test_run_ranks(2, 30, shm_rank, &bad) == 0, "2 ranks with %s='%s'",
                  bad.name, bad.value);
    }
    CHECK(ddp_test_run_ranks(2, 30, shm_good_rank, NULL) == 0);
}

/* ---- store: creation needs DDP_TIMEOUT for its default timeout ------------------------------ */

static void part_store(void)
{
    clear_settings();
    ddp_store_server_t *server = NULL;
    CHECK_OK(ddp_store_server_start("127.0.0.1", 0, "config-test", &server));
    int port = ddp_store_server_port(server);
    ddp_store_t *base = NULL;
    CHECK_OK(ddp_store_hash_create(&base));
    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[600];
    snprintf(path, sizeof path, "%s/store", dir);

    for (size_t i = 0; i < COUNT(bad_timeouts); i++) {
        const setting_t *bad = &bad_timeouts[i];
        setenv(bad->name, bad->value, 1);
        ddp_store_t *store = NULL;
        expect_rejected(ddp_store_hash_create(&store), bad, "ddp_store_hash_create");
        CHECK(store == NULL);
        expect_rejected(ddp_store_file_create(path, &store), bad, "ddp_store_file_create");
        CHECK(store == NULL);
        /* timeout_ms 0 asks for DDP_TIMEOUT. */
        expect_rejected(ddp_store_tcp_connect("127.0.0.1", port, "config-test", 0, &store), bad,
                        "ddp_store_tcp_connect");
        CHECK(store == NULL);
        /* A timeout given explicitly does not need DDP_TIMEOUT, nor does a prefix store (it
         * takes its base's timeout). */
        CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, "config-test", 3000, &store));
        CHECK(ddp_store_timeout(store) == 3000);
        ddp_store_destroy(store);
        CHECK_OK(ddp_store_prefix_create(base, "p", &store));
        ddp_store_destroy(store);
    }

    struct {
        const char *value;
        int ms;
    } good[] = {{"2.5", 2500}, {"30", 30000}, {"", 300000}};
    for (size_t i = 0; i < COUNT(good); i++) {
        setenv("DDP_TIMEOUT", good[i].value, 1);
        ddp_store_t *store = NULL;
        CHECK_OK(ddp_store_hash_create(&store));
        CHECK(ddp_store_timeout(store) == good[i].ms);
        ddp_store_destroy(store);
        CHECK_OK(ddp_store_file_create(path, &store));
        CHECK(ddp_store_timeout(store) == good[i].ms);
        ddp_store_destroy(store);
        CHECK_OK(ddp_store_tcp_connect("127.0.0.1", port, "config-test", 0, &store));
        CHECK(ddp_store_timeout(store) == good[i].ms);
        ddp_store_destroy(store);
    }
    clear_settings();
    ddp_store_destroy(base);
    ddp_store_server_stop(server);
}

/* ---- ddprun: refuses to start on a bad value (exit 2) ---------------------------------------- */

#ifdef DDPRUN_PATH
/* Runs ddprun with `args` and `name`=`value` set; returns its exit code and its stdout and stderr
 * (first bytes) in `out`. */
static int run_ddprun(const char *name, const char *value, const char *const *args, char *out,
                      size_t out_len)
{
    char path[] = "/tmp/ddp-config-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    unlink(path);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        clear_settings();
        if (name) setenv(name, value, 1);
        const char *argv[16] = {DDPRUN_PATH};
        for (int i = 0; args[i] && i < 14; i++) argv[i + 1] = args[i];
        execv(DDPRUN_PATH, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    ssize_t n = pread(fd, out, out_len - 1, 0);
    out[n > 0 ? n : 0] = '\0';
    close(fd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
#endif

static void part_ddprun(void)
{
#ifdef DDPRUN_PATH
    char out[8192];
    const char *run_true[] = {"-n", "1", "true", NULL};
    const setting_t
        *all_bad[COUNT(bad_timeouts) + COUNT(bad_group_settings) + COUNT(bad_shm_settings)];
    size_t n = 0;
    for (size_t i = 0; i < COUNT(bad_timeouts); i++) all_bad[n++] = &bad_timeouts[i];
    for (size_t i = 0; i < COUNT(bad_group_settings); i++) all_bad[n++] = &bad_group_settings[i];
    for (size_t i = 0; i < COUNT(bad_shm_settings); i++) all_bad[n++] = &bad_shm_settings[i];
    for (size_t i = 0; i < n; i++) {
        int code = run_ddprun(all_bad[i]->name, all_bad[i]->value, run_true, out, sizeof out);
        char quoted[128];
        snprintf(quoted, sizeof quoted, "'%s'", all_bad[i]->value);
        CHECK_MSG(code == 2, "ddprun with %s='%s' exited %d: %s", all_bad[i]->name,
                  all_bad[i]->value, code, out);
        CHECK_MSG(strstr(out, all_bad[i]->name) && strstr(out, quoted),
                  "ddprun with %s='%s' said '%s'", all_bad[i]->name, all_bad[i]->value, out);
    }
    /* Valid values start the job. */
    CHECK(run_ddprun("DDP_TIMEOUT", "2.5", run_true, out, sizeof out) == 0);
    CHECK(run_ddprun("DDP_TIMEOUT", "30", run_true, out, sizeof out) == 0);
    CHECK(run_ddprun(NULL, NULL, run_true, out, sizeof out) == 0);
    /* --print-config still prints the table, with what each variable accepts, even when a value
     * is bad (that is when it is most useful). */
    const char *print[] = {"--print-config", NULL};
    CHECK(run_ddprun("DDP_TIMEOUT", "5s", print, out, sizeof out) == 0);
    CHECK_MSG(strstr(out, "DDP_TIMEOUT") && strstr(out, "5s") && strstr(out, "MASTER_PORT") &&
                  strstr(out, "none|error|warn|info|debug") &&
                  strstr(out, "auto|shm|tcp|mpi|hierarchical"),
              "--print-config printed: %s", out);
#else
    printf("test_config ddprun: skipped (no ddprun in this build)\n");
#endif
}

int main(int argc, char **argv)
{
    const char *part = argc > 1 ? argv[1] : "group";
    if (strcmp(part, "group") == 0) part_group();
    else if (strcmp(part, "shm") == 0) part_shm();
    else if (strcmp(part, "store") == 0) part_store();
    else if (strcmp(part, "ddprun") == 0) part_ddprun();
    else {
        fprintf(stderr, "usage: test_config group|shm|store|ddprun\n");
        return 2;
    }
    printf("test_config %s: ok\n", part);
    return 0;
}
