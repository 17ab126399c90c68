/* ddprun end to end: runs the real build/ddprun with this program as the worker. Each ctest entry
 * runs one scenario (argv[1]): env, multinode, failure, multinode-failure, blame, signals,
 * output, tty, options, bind. Worker modes (argv[1] = worker-*) are what ddprun starts. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#ifndef DDPRUN_PATH
#error "DDPRUN_PATH must name the ddprun binary"
#endif

static char self_path[4096];
static char dir[512];

/* ---- small helpers ------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void make_dir(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/ddprun-test-XXXXXX", base && *base ? base : "/tmp");
    CHECK(mkdtemp(dir) != NULL);
}

/* Whole file as a NUL-terminated string (NULL when missing). Caller frees. */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    CHECK(buf);
    size_t n;
    while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2) {
            cap *= 2;
            buf = realloc(buf, cap);
            CHECK(buf);
        }
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

static void write_text(const char *path, const char *text)
{
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    CHECK(f);
    fputs(text, f);
    CHECK(fclose(f) == 0);
    CHECK(rename(tmp, path) == 0);
}

/* Non-overlapping occurrences. By hand: a sanitizer's strstr measures the whole haystack on
 * every call, which made this quadratic on the 300 kB outputs. */
static size_t count_of(const char *haystack, const char *needle)
{
    size_t n = 0, m = strlen(needle);
    for (const char *p = haystack; *p;) {
        size_t k = 0;
        while (k < m && p[k] == needle[k]) k++;
        if (k == m) {
            n++;
            p += m;
        } else {
            p++;
        }
    }
    return n;
}

/* A process that is gone or a zombie nobody reaped counts as dead. */
static int process_alive(pid_t pid)
{
    if (kill(pid, 0) != 0) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    char *stat = read_text(path);
    if (!stat) return 0;
    const char *close_paren = strrchr(stat, ')');
    int alive = !(close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z');
    free(stat);
    return alive;
}

/* Waits (a few seconds at most) for every pid listed in dir/pids.* to be gone. Unless
 * `may_be_none`, at least one worker must have written its pids. */
static void check_processes_gone(int nfiles, int may_be_none)
{
    int found = 0;
    for (int r = 0; r < nfiles; r++) {
        char path[700];
        snprintf(path, sizeof path, "%s/pids.%d", dir, r);
        char *text = read_text(path);
        if (!text) continue;
        found++;
        char *save = NULL;
        for (char *tok = strtok_r(text, " \n", &save); tok; tok = strtok_r(NULL, " \n", &save)) {
            pid_t pid = (pid_t)atoi(tok);
            CHECK(pid > 1);
            double until = now_s() + 5.0;
            while (process_alive(pid) && now_s() < until) sleep_ms(20);
            CHECK_MSG(!process_alive(pid), "process %d (listed by rank %d) outlived ddprun",
                      (int)pid, r);
        }
        free(text);
    }
    CHECK_MSG(found > 0 || may_be_none, "no worker wrote its pids");
}

static void check_no_process_left(int nfiles) { check_processes_gone(nfiles, 0); }

/* Whether the NUL-separated file (an environ or cmdline in /proc) holds the entry `want`. */
static int proc_list_has(const char *path, const char *want)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    static char buf[1 << 18];
    ssize_t len = 0, n;
    while (len < (ssize_t)sizeof buf - 1 && (n = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
        len += n;
    close(fd);
    buf[len < 0 ? 0 : len] = '\0';
    for (ssize_t at = 0; at < len; at += (ssize_t)strlen(buf + at) + 1) {
        if (strcmp(buf + at, want) == 0) return 1;
    }
    return 0;
}

/* Live processes (not zombies) whose environment holds `env_entry` or whose argv holds `arg`. */
static int count_marked(const char *env_entry, const char *arg)
{
    DIR *proc = opendir("/proc");
    CHECK(proc);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(proc))) {
        pid_t pid = (pid_t)atoi(e->d_name);
        if (pid <= 0 || pid == getpid()) continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
        int marked = proc_list_has(path, env_entry);
        snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
        if (!marked) marked = proc_list_has(path, arg);
        if (marked && process_alive(pid)) n++;
    }
    closedir(proc);
    return n;
}

/* Waits until dir/pids.0 .. pids.(n-1) all exist. */
static void wait_for_pid_files(int n)
{
    double until = now_s() + 20.0;
    for (int r = 0; r < n; r++) {
        char path[700];
        snprintf(path, sizeof path, "%s/pids.%d", dir, r);
        while (access(path, F_OK) != 0) {
            CHECK_MSG(now_s() < until, "rank %d never started", r);
            sleep_ms(20);
        }
    }
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    socklen_t len = sizeof a;
    CHECK(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* ---- running ddprun ------------------------------------------------------------------------ */

typedef struct run {
    pid_t pid;
    char out_path[700];
    char err_path[700];
    double started;
} run_t;

/* Starts ddprun with `args` (NULL-terminated); its stdout/stderr go to dir/<name>.out/.err.
 * `token` (may be NULL) becomes DDP_STORE_TOKEN in ddprun's environment; NULL unsets it. */
static run_t start_ddprun(const char *name, const char *token, const char *const *args)
{
    run_t r;
    snprintf(r.out_path, sizeof r.out_path, "%s/%s.out", dir, name);
    snprintf(r.err_path, sizeof r.err_path, "%s/%s.err", dir, name);
    const char *argv[64];
    int n = 0;
    argv[n++] = DDPRUN_PATH;
    for (int i = 0; args[i]; i++) {
        CHECK(n < 63);
        argv[n++] = args[i];
    }
    argv[n] = NULL;
    fflush(stdout);
    fflush(stderr);
    r.started = now_s();
    r.pid = fork();
    CHECK(r.pid >= 0);
    if (r.pid == 0) {
        int out = open(r.out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int err = open(r.err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0 || err < 0) _exit(126);
        dup2(out, 1);
        dup2(err, 2);
        if (token) setenv("DDP_STORE_TOKEN", token, 1);
        else unsetenv("DDP_STORE_TOKEN");
        execv(DDPRUN_PATH, (char *const *)argv);
        _exit(126);
    }
    return r;
}

/* Waits for ddprun; returns its wait status and the seconds it ran. Kills it after timeout_s. */
static int wait_ddprun(run_t *r, double timeout_s, double *seconds)
{
    int status = 0;
    for (;;) {
        pid_t got = waitpid(r->pid, &status, WNOHANG);
        if (got == r->pid) break;
        CHECK(got == 0);
        if (now_s() - r->started > timeout_s) {
            kill(r->pid, SIGKILL);
            waitpid(r->pid, &status, 0);
            char *err = read_text(r->err_path);
            fprintf(stderr, "ddprun stderr:\n%s\n", err ? err : "");
            CHECK_MSG(0, "ddprun ran past %g s", timeout_s);
        }
        sleep_ms(10);
    }
    if (seconds) *seconds = now_s() - r->started;
    return status;
}

static void dump(const run_t *r)
{
    char *out = read_text(r->out_path), *err = read_text(r->err_path);
    fprintf(stderr, "---- stdout\n%s---- stderr\n%s----\n", out ? out : "", err ? err : "");
    free(out);
    free(err);
}

static int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

/* ---- worker modes -------------------------------------------------------------------------- */

static int env_int(const char *name)
{
    const char *v = getenv(name);
    CHECK_MSG(v != NULL, "%s is not set", name);
    return atoi(v);
}

/* Records pids ("<pid> [<child pid>]") in <dir>/pids.<RANK>. */
static void write_pids(const char *d, pid_t extra)
{
    char path[700], text[64];
    snprintf(path, sizeof path, "%s/pids.%d", d, env_int("RANK"));
    if (extra > 0) snprintf(text, sizeof text, "%d %d\n", (int)getpid(), (int)extra);
    else snprintf(text, sizeof text, "%d\n", (int)getpid());
    write_text(path, text);
}

/* A child in the worker's process group, as a data loader or a shell pipeline would leave. */
static pid_t spawn_sleeper(void)
{
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        for (int i = 0; i < 600; i++) sleep_ms(100);
        _exit(0);
    }
    return pid;
}

/* 1 when something accepts TCP connections on addr:port. */
static int port_listens(const char *addr, int port)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1) return 0;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    int ok = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return ok;
}

/* worker-env DIR: writes what it was given, checks ddp_env_read agrees, and meets every other
 * rank through the TCP store ddprun hosts. */
static int worker_env(const char *d)
{
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.source, "torchrun") == 0);
    CHECK(env.rank == env_int("RANK") && env.world_size == env_int("WORLD_SIZE"));
    CHECK(env.local_rank == env_int("LOCAL_RANK"));
    CHECK(env.local_world_size == env_int("LOCAL_WORLD_SIZE"));
    /* ddprun's store is named by DDP_STORE_*; MASTER_ADDR/MASTER_PORT are left to torch: the
     * same host, another port, and nothing listening on it yet. */
    CHECK(env.master_port == env_int("DDP_STORE_PORT") && env.master_port > 0);
    CHECK(strcmp(env.store_source, "DDP_STORE_ADDR") == 0);
    CHECK(getenv("MASTER_ADDR") && strcmp(getenv("MASTER_ADDR"), env.master_addr) == 0);
    int torch_port = env_int("MASTER_PORT");
    CHECK(torch_port > 0 && torch_port <= 65535 && torch_port != env.master_port);
    CHECK_MSG(!port_listens(env.master_addr, torch_port), "MASTER_PORT %d is taken", torch_port);
    CHECK(strlen(env.token) >= 16);

    char path[700], text[1024];
    snprintf(path, sizeof path, "%s/env.%d", d, env.rank);
    snprintf(text, sizeof text, "%d %d %d %d %d %s %d %s %d\n", env.rank, env.world_size,
             env.local_rank, env.local_world_size, env_int("GROUP_RANK"), env.master_addr,
             env.master_port, env.token, torch_port);
    write_text(path, text);

    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_tcp_connect(env.master_addr, env.master_port, env.token, 20000, &store));
    char key[64];
    snprintf(key, sizeof key, "test/rank/%d", env.rank);
    CHECK_OK(ddp_store_set(store, key, text, strlen(text)));
    for (int r = 0; r < env.world_size; r++) {
        snprintf(key, sizeof key, "test/rank/%d", r);
        const char *k = key;
        CHECK_OK(ddp_store_wait(store, &k, 1, 20000));
    }
    int64_t arrived = 0;
    CHECK_OK(ddp_store_add(store, "test/arrived", 1, &arrived));
    CHECK(arrived >= 1 && arrived <= env.world_size);
    ddp_store_destroy(store);
    return 0;
}

/* worker-fail DIR R CODE: rank R exits with CODE once every rank has started; the others wait
 * (with a child of their own) until they are killed. */
static int worker_fail(const char *d, int fail_rank, int code, int world)
{
    int rank = env_int("RANK");
    pid_t child = spawn_sleeper();
    write_pids(d, child);
    if (rank == fail_rank) {
        for (int r = 0; r < world; r++) {
            char path[700];
            snprintf(path, sizeof path, "%s/pids.%d", d, r);
            for (int i = 0; i < 2000 && access(path, F_OK) != 0; i++) sleep_ms(10);
        }
        printf("rank %d failing with %d\n", rank, code);
        fflush(stdout);
        if (code < 0) kill(getpid(), -code); /* a negative code: die by that signal */
        exit(code);
    }
    for (int i = 0; i < 1200; i++) sleep_ms(100);
    return 0;
}

/* worker-late-fail DIR R: rank R exits 7 after a second; every other rank succeeds at once. */
static int worker_late_fail(const char *d, int fail_rank)
{
    write_pids(d, 0);
    if (env_int("RANK") != fail_rank) return 0;
    sleep_ms(1000);
    return 7;
}

/* worker-peer-kill DIR VICTIM: the TCP failure in small. Rank VICTIM listens on a Unix socket,
 * accepts one connection from every other rank and then dies by SIGKILL; the others block reading
 * their connection and exit 1 the moment it resets, as a libddp rank exits on DDP_ERR_REMOTE.
 * VICTIM is the last rank, started last, so when ddprun finds both a survivor and the victim
 * exited, waitpid(-1) (oldest child first) reports the survivor first. */
static int worker_peer_kill(const char *d, int victim)
{
    int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s/peer.sock", d);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    if (rank == victim) {
        CHECK(bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0);
        CHECK(listen(fd, world) == 0);
        int peers[64];
        CHECK(world - 1 <= 64);
        for (int i = 0; i < world - 1; i++) CHECK((peers[i] = accept(fd, NULL, NULL)) >= 0);
        kill(getpid(), SIGKILL);
        return 0;
    }
    double until = now_s() + 20.0;
    while (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        CHECK_MSG(now_s() < until, "rank %d could not reach the victim", rank);
        sleep_ms(5);
    }
    char byte;
    while (read(fd, &byte, 1) < 0 && errno == EINTR) {
    }
    _exit(1); /* "the connection to the victim was reset" */
}

/* worker-sleep DIR IGNORE_TERM: waits to be stopped. */
static int worker_sleep(const char *d, int ignore_term)
{
    if (ignore_term) signal(SIGTERM, SIG_IGN);
    pid_t child = spawn_sleeper();
    write_pids(d, child);
    for (int i = 0; i < 1200; i++) sleep_ms(100);
    return 0;
}

/* worker-output: lines on both streams, a 100000-byte line and a last line without newline. */
static int worker_output(void)
{
    int rank = env_int("RANK");
    for (int i = 0; i < 50; i++) {
        printf("hello %d from %d\n", i, rank);
        fflush(stdout);
        fprintf(stderr, "err %d from %d\n", i, rank);
    }
    char *long_line = malloc(100001);
    CHECK(long_line);
    memset(long_line, 'x', 100000);
    long_line[100000] = '\0';
    printf("%s\n", long_line);
    free(long_line);
    printf("split ");
    fflush(stdout);
    sleep_ms(50);
    printf("line %d\ntail %d", rank, rank);
    fflush(stdout);
    return 0;
}

/* ---- scenarios ----------------------------------------------------------------------------- */

static void check_env_files(int world, int nproc, int port_expected, const char *token_expected)
{
    char first_port[32] = "", first_token[256] = "";
    int first_torch_port = 0;
    for (int r = 0; r < world; r++) {
        char path[700];
        snprintf(path, sizeof path, "%s/env.%d", dir, r);
        char *text = read_text(path);
        CHECK_MSG(text, "rank %d wrote no environment", r);
        int rank, ws, lr, lws, group, port, torch_port;
        char addr[256], token[256];
        CHECK(sscanf(text, "%d %d %d %d %d %255s %d %255s %d", &rank, &ws, &lr, &lws, &group, addr,
                     &port, token, &torch_port) == 9);
        /* Every rank, on every node, is told the same MASTER_PORT for torch. */
        if (r == 0) first_torch_port = torch_port;
        CHECK_MSG(torch_port == first_torch_port, "rank %d has MASTER_PORT %d, rank 0 %d", r,
                  torch_port, first_torch_port);
        CHECK(rank == r && ws == world && lws == nproc);
        CHECK(lr == r % nproc && group == r / nproc);
        CHECK(strcmp(addr, "127.0.0.1") == 0);
        if (port_expected) CHECK(port == port_expected);
        if (token_expected) CHECK(strcmp(token, token_expected) == 0);
        char port_text[32];
        snprintf(port_text, sizeof port_text, "%d", port);
        if (r == 0) {
            snprintf(first_port, sizeof first_port, "%s", port_text);
            snprintf(first_token, sizeof first_token, "%s", token);
        }
        CHECK(strcmp(port_text, first_port) == 0 && strcmp(token, first_token) == 0);
        free(text);
    }
    char path[700];
    snprintf(path, sizeof path, "%s/env.%d", dir, world);
    CHECK_MSG(access(path, F_OK) != 0, "a rank beyond the world size ran");
}

static void scenario_env(void)
{
    /* World sizes 1 to 4, and 8 (more ranks than cores). */
    const int worlds[] = {1, 2, 3, 4, 8};
    char *tokens_seen[5] = {0};
    for (int w = 0; w < 5; w++) {
        int n = worlds[w];
        make_dir();
        char nproc[16];
        snprintf(nproc, sizeof nproc, "%d", n);
        const char *args[] = {"-n", nproc, self_path, "worker-env", dir, NULL};
        run_t r = start_ddprun("env", "ignored-on-one-node", args);
        int status = wait_ddprun(&r, 25, NULL);
        if (exit_code(status) != 0) dump(&r);
        CHECK_MSG(exit_code(status) == 0, "ddprun -n %d exited with %d", n, exit_code(status));
        check_env_files(n, n, 0, NULL);
        /* Single node: a fresh random token, not the one in ddprun's environment. */
        char path[700];
        snprintf(path, sizeof path, "%s/env.0", dir);
        char *text = read_text(path);
        CHECK(text && strstr(text, "ignored-on-one-node") == NULL);
        tokens_seen[w] = strdup(strrchr(text, ' ') + 1);
        for (int k = 0; k < w; k++) CHECK(strcmp(tokens_seen[k], tokens_seen[w]) != 0);
        free(text);
    }
    for (int w = 0; w < 5; w++) free(tokens_seen[w]);

    /* --token and --master-port are honoured on one node. */
    make_dir();
    int port = free_port();
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", port);
    const char *args[] = {"-n", "3", "--master-port", port_text, "--token=tok-123456789abcdef",
                          "--master-addr", "127.0.0.1", self_path, "worker-env", dir, NULL};
    run_t r = start_ddprun("env-port", NULL, args);
    int status = wait_ddprun(&r, 25, NULL);
    if (exit_code(status) != 0) dump(&r);
    CHECK(exit_code(status) == 0);
    check_env_files(3, 3, port, "tok-123456789abcdef");
}

static void scenario_multinode(void)
{
    /* nodes x workers per node: world sizes 2, 4 and 3 (three ddprun processes). */
    const int shapes[][2] = {{2, 1}, {2, 2}, {3, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int nnodes = shapes[s][0], nproc = shapes[s][1];
        make_dir();
        char port_text[16], nnodes_text[16], nproc_text[16], node_text[4][16];
        int port = free_port();
        snprintf(port_text, sizeof port_text, "%d", port);
        snprintf(nnodes_text, sizeof nnodes_text, "%d", nnodes);
        snprintf(nproc_text, sizeof nproc_text, "%d", nproc);
        run_t runs[4];
        /* Start the last node first: it must wait for node 0's store. */
        for (int k = nnodes - 1; k >= 0; k--) {
            snprintf(node_text[k], sizeof node_text[k], "%d", k);
            const char *args[] = {"-n", nproc_text, "--nnodes", nnodes_text, "--node-rank",
                                  node_text[k], "--master-addr", "127.0.0.1", "--master-port",
                                  port_text, self_path, "worker-env", dir, NULL};
            char name[32];
            snprintf(name, sizeof name, "node%d", k);
            runs[k] = start_ddprun(name, "multi-node-secret", args);
            if (k == nnodes - 1) sleep_ms(300);
        }
        for (int k = 0; k < nnodes; k++) {
            int status = wait_ddprun(&runs[k], 25, NULL);
            if (exit_code(status) != 0) dump(&runs[k]);
            CHECK_MSG(exit_code(status) == 0, "node %d of %d exited with %d", k, nnodes,
                      exit_code(status));
        }
        check_env_files(nnodes * nproc, nproc, port, "multi-node-secret");
    }

    /* Two ddprun claiming the same node rank: one of them is refused, the job still runs. */
    make_dir();
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", free_port());
    run_t runs[3];
    const char *node_ranks[3] = {"0", "1", "1"};
    for (int k = 0; k < 3; k++) {
        const char *args[] = {"-n", "1", "--nnodes", "2", "--node-rank", node_ranks[k],
                              "--master-port", port_text, "sh", "-c", "sleep 3", NULL};
        runs[k] = start_ddprun(k == 0 ? "dup0" : k == 1 ? "dup1" : "dup2", "secret", args);
    }
    CHECK(exit_code(wait_ddprun(&runs[0], 25, NULL)) == 0);
    int refused = 0;
    for (int k = 1; k < 3; k++) {
        int code = exit_code(wait_ddprun(&runs[k], 25, NULL));
        char *err = read_text(runs[k].err_path);
        if (code != 0) {
            CHECK_MSG(code == 1 && strstr(err, "--node-rank 1 is already taken by ddprun pid"),
                      "duplicate node rank: exit %d: %s", code, err);
            refused++;
        }
        free(err);
    }
    CHECK(refused == 1);

    /* Nodes started with different -n: both stop, naming the mismatch. */
    make_dir();
    snprintf(port_text, sizeof port_text, "%d", free_port());
    for (int k = 0; k < 2; k++) {
        const char *args[] = {"-n", k ? "1" : "2", "--nnodes", "2", "--node-rank", k ? "1" : "0",
                              "--master-port", port_text, self_path, "worker-sleep", dir, "0",
                              NULL};
        runs[k] = start_ddprun(k ? "mismatch1" : "mismatch0", "secret", args);
    }
    for (int k = 0; k < 2; k++) {
        int code = exit_code(wait_ddprun(&runs[k], 25, NULL));
        char *err = read_text(runs[k].err_path);
        CHECK_MSG(code == 1 && strstr(err, "node 1 was started with nnodes=2 nproc=1 but node 0 "
                                           "with nnodes=2 nproc=2"),
                  "node %d: exit %d: %s", k, code, err);
        free(err);
    }
    /* Node 0's workers may be stopped before they wrote anything. */
    check_processes_gone(2, 1);

    /* Refused: several nodes without a shared token or port. */
    make_dir();
    const char *no_token[] = {"-n", "1", "--nnodes", "2", "--master-port", "4000", "true", NULL};
    run_t r = start_ddprun("no-token", NULL, no_token);
    int status = wait_ddprun(&r, 10, NULL);
    CHECK(exit_code(status) == 2);
    char *err = read_text(r.err_path);
    CHECK(err && strstr(err, "DDP_STORE_TOKEN") && strstr(err, "--token"));
    free(err);
    const char *no_port[] = {"-n", "1", "--nnodes", "2", "--token", "t", "true", NULL};
    r = start_ddprun("no-port", NULL, no_port);
    CHECK(exit_code(wait_ddprun(&r, 10, NULL)) == 2);
    err = read_text(r.err_path);
    CHECK(err && strstr(err, "--master-port"));
    free(err);
}

static void scenario_failure(void)
{
    /* World sizes 1 to 4; a different rank fails each time. */
    for (int n = 1; n <= 4; n++) {
        make_dir();
        int fail_rank = (n * 7) % n;
        if (n == 3) fail_rank = 1;
        if (n == 4) fail_rank = 3;
        char nproc[16], fail[16], world[16];
        snprintf(nproc, sizeof nproc, "%d", n);
        snprintf(fail, sizeof fail, "%d", fail_rank);
        snprintf(world, sizeof world, "%d", n);
        const char *args[] = {"-n", nproc, "--grace", "3", self_path, "worker-fail", dir, fail,
                              "7", world, NULL};
        run_t r = start_ddprun("fail", NULL, args);
        double seconds = 0;
        int status = wait_ddprun(&r, 25, &seconds);
        char *err = read_text(r.err_path);
        char *out = read_text(r.out_path);
        char needle[64];
        snprintf(needle, sizeof needle, "rank %d (pid ", fail_rank);
        if (exit_code(status) != 1 || !strstr(err, needle)) dump(&r);
        CHECK_MSG(exit_code(status) == 1, "ddprun exited with %d", exit_code(status));
        CHECK(strstr(err, needle) && strstr(err, "exited with status 7"));
        snprintf(needle, sizeof needle, "[%d] rank %d failing with 7", fail_rank, fail_rank);
        CHECK(strstr(out, needle));
        /* The others sleep for two minutes: ddprun must have stopped them. */
        CHECK_MSG(seconds < 10.0, "ddprun took %.1f s to give up", seconds);
        check_no_process_left(n);
        free(err);
        free(out);
    }

    /* A worker killed by a signal: 128 + signal, named in the message. */
    make_dir();
    const char *args[] = {"-n", "2", self_path, "worker-fail", dir, "0", "-9", "2", NULL};
    run_t r = start_ddprun("killed", NULL, args);
    int status = wait_ddprun(&r, 25, NULL);
    char *err = read_text(r.err_path);
    if (exit_code(status) != 128 + SIGKILL) dump(&r);
    CHECK(exit_code(status) == 128 + SIGKILL);
    CHECK(strstr(err, "rank 0 (pid ") && strstr(err, "killed by signal 9 (SIGKILL)"));
    free(err);
    check_no_process_left(2);

    /* Workers that ignore SIGTERM get SIGKILL after the grace period. */
    make_dir();
    const char *stubborn[] = {"-n", "3", "--grace", "1", "--timeout", "1", self_path,
                              "worker-sleep", dir, "1", NULL};
    r = start_ddprun("stubborn", NULL, stubborn);
    status = wait_ddprun(&r, 25, NULL);
    err = read_text(r.err_path);
    if (exit_code(status) != 1) dump(&r);
    CHECK(exit_code(status) == 1);
    CHECK(strstr(err, "--timeout") && strstr(err, "SIGKILL"));
    free(err);
    check_no_process_left(3);

    /* A program that does not exist: 127 from every rank, reported, exit 1. */
    make_dir();
    const char *missing[] = {"-n", "2", "/nonexistent/ddprun-test-program", NULL};
    r = start_ddprun("missing", NULL, missing);
    status = wait_ddprun(&r, 25, NULL);
    err = read_text(r.err_path);
    CHECK(exit_code(status) == 1);
    CHECK(strstr(err, "cannot run '/nonexistent/ddprun-test-program'"));
    CHECK(strstr(err, "exited with status 127"));
    free(err);
}

/* The first line in which ddprun names a failed rank (the start of its stderr line), or NULL. */
static const char *first_blame(const char *err)
{
    for (const char *line = err; line && *line;) {
        if (strncmp(line, "ddprun: rank ", 13) == 0) return line + 8;
        line = strchr(line, '\n');
        if (line) line++;
    }
    return NULL;
}

/* One rank is SIGKILLed and the others exit 1 the moment they see it (worker-peer-kill): ddprun
 * names the killed rank and exits 128 + 9, every time. Run directly and through a shell that
 * reports its child's death as exit status 137, as `ddprun sh -c 'trainer ...'` does. */
static void scenario_blame(void)
{
    const int runs = 20;
    for (int shell = 0; shell < 2; shell++) {
        int wrong = 0;
        char first_wrong[512] = "";
        for (int i = 0; i < runs; i++) {
            make_dir();
            int n = 2 + i % 2;
            char nproc[16], victim[16];
            snprintf(nproc, sizeof nproc, "%d", n);
            snprintf(victim, sizeof victim, "%d", n - 1);
            const char *direct[] = {"-n", nproc, "--grace", "3", self_path, "worker-peer-kill",
                                    dir, victim, NULL};
            const char *wrapped[] = {"-n", nproc, "--grace", "3", "sh", "-c",
                                     "\"$0\" worker-peer-kill \"$1\" \"$2\"; exit $?",
                                     self_path, dir, victim, NULL};
            run_t r = start_ddprun("blame", NULL, shell ? wrapped : direct);
            int code = exit_code(wait_ddprun(&r, 25, NULL));
            char *err = read_text(r.err_path);
            CHECK(err);
            const char *blamed = first_blame(err);
            char want[64];
            snprintf(want, sizeof want, "rank %d (pid ", n - 1);
            const char *how = shell ? "exited with status 137" : "killed by signal 9 (SIGKILL)";
            const char *eol = blamed ? strchr(blamed, '\n') : NULL;
            int right = blamed && eol && strncmp(blamed, want, strlen(want)) == 0 &&
                        strstr(blamed, how) && strstr(blamed, how) < eol &&
                        code == 128 + SIGKILL;
            if (!right) {
                if (!wrong++) {
                    snprintf(first_wrong, sizeof first_wrong, "n=%d: exit %d, %.*s", n, code,
                             blamed && eol ? (int)(eol - blamed) : 6, blamed ? blamed : "(none)");
                }
            }
            free(err);
        }
        CHECK_MSG(wrong == 0, "%s: blamed the wrong rank in %d of %d runs; first: %s",
                  shell ? "through sh" : "direct", wrong, runs, first_wrong);
    }
}

static void scenario_multinode_failure(void)
{
    /* 2 nodes x 2 workers; rank 3 (node 1) exits 7: both ddprun stop everything and exit 1. */
    for (int failing_node = 1; failing_node >= 0; failing_node--) {
        make_dir();
        int fail_rank = failing_node == 1 ? 3 : 0;
        char port_text[16], fail[16], node_text[2][8];
        snprintf(port_text, sizeof port_text, "%d", free_port());
        snprintf(fail, sizeof fail, "%d", fail_rank);
        run_t runs[2];
        for (int k = 0; k < 2; k++) {
            snprintf(node_text[k], sizeof node_text[k], "%d", k);
            const char *args[] = {"-n", "2", "--nnodes", "2", "--node-rank", node_text[k],
                                  "--master-port", port_text, "--grace", "2", self_path,
                                  "worker-fail", dir, fail, "7", "4", NULL};
            char name[16];
            snprintf(name, sizeof name, "node%d", k);
            runs[k] = start_ddprun(name, "shared-secret", args);
        }
        for (int k = 0; k < 2; k++) {
            double seconds = 0;
            int status = wait_ddprun(&runs[k], 25, &seconds);
            char *err = read_text(runs[k].err_path);
            char needle[64];
            snprintf(needle, sizeof needle, "rank %d (pid ", fail_rank);
            if (exit_code(status) != 1 || !strstr(err, needle)) dump(&runs[k]);
            CHECK_MSG(exit_code(status) == 1, "node %d exited with %d", k, exit_code(status));
            CHECK_MSG(strstr(err, needle), "node %d does not name rank %d", k, fail_rank);
            snprintf(needle, sizeof needle, "exited with status 7 on node %d", failing_node);
            CHECK(strstr(err, needle));
            CHECK_MSG(seconds < 15.0, "node %d took %.1f s to stop", k, seconds);
            free(err);
        }
        check_no_process_left(4);
    }

    /* Node 0's workers all succeed, then rank 3 on node 1 fails: node 0 still exits 1. */
    make_dir();
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", free_port());
    run_t runs[2];
    for (int k = 0; k < 2; k++) {
        const char *args[] = {"-n", "2", "--nnodes", "2", "--node-rank", k ? "1" : "0",
                              "--master-port", port_text, self_path, "worker-late-fail", dir,
                              "3", NULL};
        runs[k] = start_ddprun(k ? "late1" : "late0", "shared-secret", args);
    }
    for (int k = 0; k < 2; k++) {
        int status = wait_ddprun(&runs[k], 25, NULL);
        char *err = read_text(runs[k].err_path);
        if (exit_code(status) != 1) dump(&runs[k]);
        CHECK_MSG(exit_code(status) == 1, "node %d exited with %d", k, exit_code(status));
        CHECK(strstr(err, "rank 3 (pid ") && strstr(err, "exited with status 7 on node 1"));
        free(err);
    }

    /* A node's ddprun killed outright: the other node notices (heartbeat or lost store), stops
     * its workers and exits 1. */
    for (int victim = 1; victim >= 0; victim--) {
        make_dir();
        snprintf(port_text, sizeof port_text, "%d", free_port());
        for (int k = 0; k < 2; k++) {
            char node[8];
            snprintf(node, sizeof node, "%d", k);
            const char *args[] = {"-n", "1", "--nnodes", "2", "--node-rank", k ? "1" : "0",
                                  "--master-port", port_text, "--heartbeat-timeout", "1",
                                  self_path, "worker-sleep", dir, "0", NULL};
            runs[k] = start_ddprun(k ? "kill1" : "kill0", "shared-secret", args);
        }
        wait_for_pid_files(2);
        sleep_ms(300); /* let both heartbeats start */
        CHECK(kill(runs[victim].pid, SIGKILL) == 0);
        int status = wait_ddprun(&runs[victim], 10, NULL);
        CHECK(WIFSIGNALED(status));
        int survivor = 1 - victim;
        status = wait_ddprun(&runs[survivor], 25, NULL);
        char *err = read_text(runs[survivor].err_path);
        if (exit_code(status) != 1) dump(&runs[survivor]);
        CHECK_MSG(exit_code(status) == 1, "node %d exited with %d", survivor, exit_code(status));
        CHECK(strstr(err, victim == 1 ? "node 1's ddprun has been silent" : "lost the store"));
        free(err);
        /* The survivor's worker and child (stopped by the survivor), the victim's worker and
         * its child (by the victim's watchdog). */
        check_no_process_left(2);
    }
}

static void scenario_signals(void)
{
    /* SIGTERM and SIGINT to ddprun reach every worker (and what they started). */
    const int sigs[] = {SIGTERM, SIGINT};
    for (int s = 0; s < 2; s++) {
        make_dir();
        const char *args[] = {"-n", "3", self_path, "worker-sleep", dir, "0", NULL};
        run_t r = start_ddprun("term", NULL, args);
        wait_for_pid_files(3);
        CHECK(kill(r.pid, sigs[s]) == 0);
        int status = wait_ddprun(&r, 20, NULL);
        if (exit_code(status) != 128 + sigs[s]) dump(&r);
        CHECK(exit_code(status) == 128 + sigs[s]);
        char *err = read_text(r.err_path);
        CHECK(strstr(err, "received"));
        free(err);
        check_no_process_left(3);
    }

    /* Workers that ignore SIGTERM: a second SIGTERM sends SIGKILL. */
    make_dir();
    const char *stubborn[] = {"-n", "2", "--grace", "60", self_path, "worker-sleep", dir, "1",
                              NULL};
    run_t r = start_ddprun("term2", NULL, stubborn);
    wait_for_pid_files(2);
    CHECK(kill(r.pid, SIGTERM) == 0);
    sleep_ms(300);
    CHECK(kill(r.pid, SIGTERM) == 0);
    int status = wait_ddprun(&r, 20, NULL);
    CHECK(exit_code(status) == 128 + SIGTERM);
    check_no_process_left(2);

    /* ddprun killed outright: the workers and their children die with it. */
    make_dir();
    const char *args[] = {"-n", "2", self_path, "worker-sleep", dir, "0", NULL};
    r = start_ddprun("kill9", NULL, args);
    wait_for_pid_files(2);
    CHECK(kill(r.pid, SIGKILL) == 0);
    status = wait_ddprun(&r, 20, NULL);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    check_no_process_left(2);

    /* The same with shells for workers, whose trees also escape the process group: a setsid
     * in a double fork (keeps the environment) and a child under `env -i` (keeps the process
     * group). Each is found by a marker of this run: in the environment or in sleep's argument. */
    make_dir();
    char env_marker[600], arg_marker[32], script[512];
    snprintf(env_marker, sizeof env_marker, "DDPRUN_TEST_TREE=%s", dir);
    snprintf(arg_marker, sizeof arg_marker, "59.%d", (int)getpid());
    snprintf(script, sizeof script,
             "sleep 60 & (setsid sleep 60 &); env -i sleep %s & wait; echo done", arg_marker);
    const char *tree[] = {"--no-prefix", "-n", "2", "env", env_marker, "sh", "-c", script, NULL};
    r = start_ddprun("kill9-tree", NULL, tree);
    /* Per rank: sh, sleep, the setsid sleep and the env -i sleep. */
    double until = now_s() + 20.0;
    int marked;
    while ((marked = count_marked(env_marker, arg_marker)) < 8) {
        CHECK_MSG(now_s() < until, "only %d of the 8 processes of the job started", marked);
        sleep_ms(20);
    }
    CHECK(kill(r.pid, SIGKILL) == 0);
    status = wait_ddprun(&r, 20, NULL);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    until = now_s() + 10.0;
    while ((marked = count_marked(env_marker, arg_marker)) > 0 && now_s() < until) sleep_ms(50);
    CHECK_MSG(marked == 0, "%d processes of the job outlived a SIGKILLed ddprun by 10 s", marked);
}

static void check_output_lines(const char *text, int world, const char *stream_word)
{
    /* Every line is whole and starts with a rank; each worker's lines keep their order. */
    int next[8] = {0};
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        CHECK_MSG(end, "output does not end with a newline");
        int rank = -1, consumed = 0;
        CHECK_MSG(sscanf(line, "[%d] %n", &rank, &consumed) == 1 && consumed > 0,
                  "line without a rank prefix: %.60s", line);
        CHECK(rank >= 0 && rank < world);
        const char *body = line + consumed;
        int i = -1, from = -1;
        char word[16];
        if (sscanf(body, "%15s %d from %d", word, &i, &from) == 3 &&
            strcmp(word, stream_word) == 0) {
            CHECK(from == rank);
            CHECK_MSG(i == next[rank], "rank %d line %d came after %d", rank, i, next[rank] - 1);
            next[rank]++;
        }
        line = end + 1;
    }
    for (int r = 0; r < world; r++) CHECK(next[r] == 50);
}

static void scenario_output(void)
{
    for (int n = 1; n <= 3; n += 2) {
        make_dir();
        char nproc[16];
        snprintf(nproc, sizeof nproc, "%d", n);
        const char *args[] = {"-n", nproc, self_path, "worker-output", NULL};
        run_t r = start_ddprun("prefix", NULL, args);
        int status = wait_ddprun(&r, 25, NULL);
        char *out = read_text(r.out_path), *err = read_text(r.err_path);
        if (exit_code(status) != 0) dump(&r);
        CHECK(exit_code(status) == 0);
        check_output_lines(out, n, "hello");
        check_output_lines(err, n, "err");
        CHECK(count_of(out, "err ") == 0 && count_of(err, "hello ") == 0);
        for (int rank = 0; rank < n; rank++) {
            char needle[64];
            snprintf(needle, sizeof needle, "[%d] split line %d\n", rank, rank);
            CHECK_MSG(strstr(out, needle), "missing '%s'", needle);
            snprintf(needle, sizeof needle, "[%d] tail %d\n", rank, rank); /* partial: flushed */
            CHECK_MSG(strstr(out, needle), "missing '%s'", needle);
        }
        CHECK(count_of(out, "x") == (size_t)n * 100000);
        free(out);
        free(err);
    }

    make_dir();
    const char *args[] = {"--no-prefix", "-n", "2", self_path, "worker-output", NULL};
    run_t r = start_ddprun("noprefix", NULL, args);
    CHECK(exit_code(wait_ddprun(&r, 25, NULL)) == 0);
    char *out = read_text(r.out_path), *err = read_text(r.err_path);
    CHECK(count_of(out, "[0] ") == 0 && count_of(out, "[1] ") == 0);
    CHECK(count_of(out, "hello 7 from 1\n") == 1 && count_of(err, "err 49 from 0\n") == 1);
    CHECK(count_of(out, "hello 0 from 0\n") == 1 && count_of(out, "[") == 0);
    CHECK(count_of(out, "x") == 200000);
    CHECK(count_of(out, "tail 0") == 1 && count_of(out, "tail 1") == 1);
    free(out);
    free(err);

    /* `ddprun ... | head -1`: once our reader is gone, the workers (writing forever) get SIGPIPE
     * and the job ends instead of running on unseen. */
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        signal(SIGPIPE, SIG_DFL);
        execl(DDPRUN_PATH, DDPRUN_PATH, "-n", "2", "yes", (char *)NULL);
        _exit(126);
    }
    close(fds[1]);
    char first[64];
    CHECK(read(fds[0], first, sizeof first) > 0);
    CHECK(first[0] == '[');
    close(fds[0]);
    run_t yes_run = {.pid = pid, .started = now_s()};
    snprintf(yes_run.err_path, sizeof yes_run.err_path, "/dev/null");
    int status = wait_ddprun(&yes_run, 20, NULL);
    CHECK_MSG(exit_code(status) == 128 + SIGPIPE, "ddprun | (closed) exited with %d",
              exit_code(status));
}

/* Runs ddprun with `args` and its stdout (and its stderr when `stderr_too`; else dir/tty.err) on
 * the slave side of a new pseudo-terminal; returns everything the terminal showed. Caller frees. */
static char *run_on_pty(const char *const *args, int stderr_too)
{
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    CHECK(master >= 0 && grantpt(master) == 0 && unlockpt(master) == 0);
    const char *slave_name = ptsname(master);
    CHECK(slave_name);
    const char *argv[32];
    int n = 0;
    argv[n++] = DDPRUN_PATH;
    for (int i = 0; args[i]; i++) {
        CHECK(n < 31);
        argv[n++] = args[i];
    }
    argv[n] = NULL;
    char err_path[700];
    snprintf(err_path, sizeof err_path, "%s/tty.err", dir);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int slave = open(slave_name, O_RDWR | O_NOCTTY);
        int err = stderr_too ? slave : open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (slave < 0 || err < 0) _exit(126);
        close(master);
        dup2(slave, 1);
        dup2(err, 2);
        execv(DDPRUN_PATH, (char *const *)argv);
        _exit(126);
    }
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    CHECK(text);
    double until = now_s() + 20.0;
    for (;;) {
        struct pollfd p = {master, POLLIN, 0};
        CHECK_MSG(now_s() < until, "ddprun on a terminal ran past 20 s");
        if (poll(&p, 1, 100) <= 0) continue;
        if (len + 1 == cap) {
            cap *= 2;
            text = realloc(text, cap);
            CHECK(text);
        }
        ssize_t got = read(master, text + len, cap - 1 - len);
        if (got <= 0) break; /* EIO: the last holder of the slave closed it */
        len += (size_t)got;
    }
    text[len] = '\0';
    close(master);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK_MSG(exit_code(status) == 0, "ddprun on a terminal exited %d: %s", exit_code(status),
              text);
    return text;
}

/* On a terminal, rank 0 writes to it itself, so a program drawing on a terminal (the trainer's
 * progress bar) still does; the other ranks stay prefixed through pipes. Each stream is handed
 * over only when it is a terminal; with --no-prefix every rank has ddprun's streams. */
static void scenario_tty(void)
{
    make_dir();
    const char *probe = "for s in 1 2; do if [ -t $s ]; then w=tty; else w=pipe; fi; "
                        "echo \"fd$s $w rank $RANK\" >&$s; done";
    const char *args[] = {"-n", "2", "sh", "-c", probe, NULL};
    char *shown = run_on_pty(args, 0);
    char path[700];
    snprintf(path, sizeof path, "%s/tty.err", dir);
    char *err = read_text(path);
    CHECK(err);
    CHECK_MSG(strstr(shown, "fd1 tty rank 0") && !strstr(shown, "[0] "),
              "rank 0 did not get the terminal: '%s'", shown);
    CHECK_MSG(strstr(shown, "[1] fd1 pipe rank 1"), "rank 1 is not prefixed: '%s'", shown);
    CHECK_MSG(strstr(err, "[0] fd2 pipe rank 0") && strstr(err, "[1] fd2 pipe rank 1"),
              "stderr (a file) is not prefixed: '%s'", err);
    free(shown);
    free(err);

    shown = run_on_pty(args, 1);
    CHECK_MSG(strstr(shown, "fd1 tty rank 0") && strstr(shown, "fd2 tty rank 0") &&
                  strstr(shown, "[1] fd1 pipe rank 1") && strstr(shown, "[1] fd2 pipe rank 1"),
              "stdout and stderr on a terminal: '%s'", shown);
    free(shown);

    const char *plain[] = {"--no-prefix", "-n", "2", "sh", "-c", probe, NULL};
    shown = run_on_pty(plain, 1);
    CHECK_MSG(strstr(shown, "fd1 tty rank 0") && strstr(shown, "fd1 tty rank 1") &&
                  strstr(shown, "fd2 tty rank 1") && !strstr(shown, "["),
              "--no-prefix on a terminal: '%s'", shown);
    free(shown);

    /* Not a terminal: every rank prefixed, as before. */
    run_t r = start_ddprun("no-tty", NULL, args);
    CHECK(exit_code(wait_ddprun(&r, 20, NULL)) == 0);
    char *out = read_text(r.out_path);
    CHECK_MSG(strstr(out, "[0] fd1 pipe rank 0") && strstr(out, "[1] fd1 pipe rank 1"),
              "without a terminal: '%s'", out);
    free(out);
}

static void scenario_options(void)
{
    make_dir();
    const char *help[] = {"--help", NULL};
    run_t r = start_ddprun("help", NULL, help);
    CHECK(exit_code(wait_ddprun(&r, 10, NULL)) == 0);
    char *out = read_text(r.out_path);
    const char *documented[] = {"-n,",        "--nnodes",      "--node-rank",  "--master-addr",
                                "--master-port", "--token",    "--no-prefix",  "--timeout",
                                "--grace",    "--heartbeat-timeout", "--print-config", "--help",
                                "RANK",       "WORLD_SIZE",    "LOCAL_RANK",   "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT",  "DDP_STORE_TOKEN", "GROUP_RANK",
                                "DDP_STORE_ADDR", "DDP_STORE_PORT"};
    for (size_t i = 0; i < sizeof documented / sizeof documented[0]; i++) {
        CHECK_MSG(strstr(out, documented[i]), "--help does not mention %s", documented[i]);
    }
    free(out);

    const char *config[] = {"--print-config", NULL};
    r = start_ddprun("config", NULL, config);
    CHECK(exit_code(wait_ddprun(&r, 10, NULL)) == 0);
    out = read_text(r.out_path);
    CHECK(strstr(out, "DDP_TIMEOUT") && strstr(out, "MASTER_PORT") && strstr(out, "DDP_STORE_TOKEN"));
    free(out);

    /* Each bad command line exits 2 with a message naming the option. */
    struct {
        const char *args[14];
        const char *mentions;
    } bad[] = {
        {{"--bogus", "-n", "1", "true"}, "--bogus"},
        {{"true"}, "-n"},
        {{"-n", "abc", "true"}, "-n"},
        {{"-n", "0", "true"}, "-n"},
        {{"-n", "2"}, "PROGRAM"},
        {{"-n", "2", "--master-port", "70000", "true"}, "--master-port"},
        {{"-n", "2", "--master-port"}, "--master-port"},
        {{"-n", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "5", "--token", "t",
          "true"},
         "--node-rank"},
        {{"-n", "2", "--nnodes", "x", "true"}, "--nnodes"},
        {{"-n", "2", "--timeout", "-3", "true"}, "--timeout"},
        {{"-n", "2", "--grace=soon", "true"}, "--grace"},
        {{"-n", "1", "--token", "", "true"}, "--token"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = start_ddprun("bad", NULL, bad[i].args);
        int code = exit_code(wait_ddprun(&r, 10, NULL));
        char *err = read_text(r.err_path);
        CHECK_MSG(code == 2, "case %zu exited %d: %s", i, code, err);
        CHECK_MSG(strstr(err, bad[i].mentions), "case %zu: '%s' does not mention %s", i, err,
                  bad[i].mentions);
        free(err);
    }

    /* "--" ends the options; the program's own options pass through. */
    make_dir();
    const char *dashdash[] = {"-n", "1", "--", "sh", "-c", "echo --help", NULL};
    r = start_ddprun("dashdash", NULL, dashdash);
    CHECK(exit_code(wait_ddprun(&r, 10, NULL)) == 0);
    out = read_text(r.out_path);
    CHECK(strcmp(out, "[0] --help\n") == 0);
    free(out);
}

/* ---- bind ---------------------------------------------------------------------------------- */

/* The CPUs this process may run on, as a bit mask (CPUs below 64 only: enough to tell bound
 * from unbound). */
static uint64_t cpu_mask_of(const char *status_line)
{
    uint64_t mask = 0;
    const char *p = status_line;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        CHECK_MSG(end != p, "cannot parse CPU list '%s'", status_line);
        p = end;
        if (*p == '-') {
            b = strtol(p + 1, &end, 10);
            p = end;
        }
        for (long c = a; c <= b && c < 64; c++) mask |= (uint64_t)1 << c;
        if (*p == ',') p++;
        else break;
    }
    return mask;
}

static uint64_t own_cpu_mask(void)
{
    char *st = read_text("/proc/self/status");
    CHECK(st);
    char *line = strstr(st, "Cpus_allowed_list:");
    CHECK(line);
    uint64_t m = cpu_mask_of(line + strlen("Cpus_allowed_list:") + strspn(line + 18, " \t"));
    free(st);
    return m;
}

/* Runs `ddprun -n N [bind option]` with workers printing their CPU list; returns each worker's
 * mask in masks[rank]. */
static void run_bind(const char *name, int n, const char *option, uint64_t *masks)
{
    make_dir();
    char nbuf[16];
    snprintf(nbuf, sizeof nbuf, "%d", n);
    const char *args[10];
    int k = 0;
    args[k++] = "-n";
    args[k++] = nbuf;
    if (option) {
        args[k++] = "--bind";
        args[k++] = option;
    }
    args[k++] = "sh";
    args[k++] = "-c";
    args[k++] = "grep Cpus_allowed_list /proc/self/status";
    args[k] = NULL;
    run_t r = start_ddprun(name, NULL, args);
    CHECK_MSG(exit_code(wait_ddprun(&r, 20, NULL)) == 0, "ddprun --bind %s failed",
              option ? option : "(default)");
    char *out = read_text(r.out_path);
    CHECK(out);
    for (int i = 0; i < n; i++) {
        char tag[48];
        snprintf(tag, sizeof tag, "[%d] Cpus_allowed_list:", i);
        char *line = strstr(out, tag);
        CHECK_MSG(line, "rank %d printed no CPU list: %s", i, out);
        line += strlen(tag);
        masks[i] = cpu_mask_of(line + strspn(line, " \t"));
    }
    free(out);
}

static int popcount64(uint64_t x)
{
    int n = 0;
    for (; x; x &= x - 1) n++;
    return n;
}

/* Workers are pinned one CPU each, in the order of ddprun's own CPUs, when asked (core) and by
 * default when N >= 2 and every CPU gets the same number (N <= CPUs or a multiple of them);
 * never with none, nor by default for 1 worker or an uneven spread; a bad value is a usage
 * error. */
static void scenario_bind(void)
{
    uint64_t own = own_cpu_mask();
    int ncpu = popcount64(own);
    CHECK(ncpu >= 1);
    uint64_t m[8];

    run_bind("core", 3, "core", m);
    uint64_t rest = own;
    for (int i = 0; i < 3; i++) {
        CHECK_MSG(popcount64(m[i]) == 1 && (m[i] & own),
                  "--bind core: rank %d may run on mask %llx (ddprun's: %llx)", i,
                  (unsigned long long)m[i], (unsigned long long)own);
        if (i < ncpu) {
            /* the i-th CPU of ddprun's set: the lowest one not yet handed out */
            CHECK_MSG(m[i] == (rest & -rest), "--bind core: rank %d got mask %llx, want %llx", i,
                      (unsigned long long)m[i], (unsigned long long)(rest & -rest));
            rest &= rest - 1;
        } else {
            CHECK_MSG(m[i] == m[i % ncpu], "--bind core: rank %d does not wrap around", i);
        }
    }

    run_bind("none", 2, "none", m);
    CHECK(m[0] == own && m[1] == own);

    run_bind("auto1", 1, NULL, m);
    CHECK_MSG(m[0] == own, "a single worker is not bound by default");

    if (ncpu >= 2) {
        run_bind("auto2", 2, NULL, m);
        CHECK_MSG(popcount64(m[0]) == 1 && popcount64(m[1]) == 1 && m[0] != m[1],
                  "2 workers on %d CPUs are not bound to two CPUs by default", ncpu);
    }
    if (ncpu >= 2 && ncpu < 8) {
        /* ncpu + 1 workers cannot be spread evenly: unbound */
        run_bind("auto-over", ncpu + 1, "auto", m);
        for (int i = 0; i <= ncpu; i++)
            CHECK_MSG(m[i] == own, "%d workers on %d CPUs: rank %d bound by default", ncpu + 1,
                      ncpu, i);
    }
    if (ncpu >= 2 && ncpu <= 4) {
        /* twice as many workers as CPUs: two on each, round robin */
        run_bind("auto-twice", 2 * ncpu, "auto", m);
        uint64_t seen = 0;
        for (int i = 0; i < 2 * ncpu; i++) {
            int ok = popcount64(m[i]) == 1 &&
                     (i < ncpu ? (m[i] & seen) == 0 : m[i] == m[i - ncpu]);
            CHECK_MSG(ok, "%d workers on %d CPUs: rank %d has mask %llx", 2 * ncpu, ncpu, i,
                      (unsigned long long)m[i]);
            seen |= m[i];
        }
        CHECK(seen == own);
    }

    make_dir();
    const char *bad[] = {"-n", "2", "--bind", "socket", "true", NULL};
    run_t r = start_ddprun("bad-bind", NULL, bad);
    CHECK(exit_code(wait_ddprun(&r, 10, NULL)) == 2);
    char *err = read_text(r.err_path);
    CHECK_MSG(err && strstr(err, "--bind"), "bad --bind value: '%s'", err ? err : "");
    free(err);
}

int main(int argc, char **argv)
{
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    CHECK(n > 0);
    self_path[n] = '\0';
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "worker-env") == 0 && argc == 3) return worker_env(argv[2]);
    if (strcmp(mode, "worker-fail") == 0 && argc == 6)
        return worker_fail(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
    if (strcmp(mode, "worker-late-fail") == 0 && argc == 4)
        return worker_late_fail(argv[2], atoi(argv[3]));
    if (strcmp(mode, "worker-sleep") == 0 && argc == 4) return worker_sleep(argv[2], atoi(argv[3]));
    if (strcmp(mode, "worker-peer-kill") == 0 && argc == 4)
        return worker_peer_kill(argv[2], atoi(argv[3]));
    if (strcmp(mode, "worker-output") == 0) return worker_output();

    signal(SIGPIPE, SIG_IGN);
    /* Bounds every rendezvous wait of ddprun and the workers if something breaks. */
    setenv("DDP_TIMEOUT", "20", 1);
    if (strcmp(mode, "env") == 0) scenario_env();
    else if (strcmp(mode, "multinode") == 0) scenario_multinode();
    else if (strcmp(mode, "failure") == 0) scenario_failure();
    else if (strcmp(mode, "multinode-failure") == 0) scenario_multinode_failure();
    else if (strcmp(mode, "blame") == 0) scenario_blame();
    else if (strcmp(mode, "signals") == 0) scenario_signals();
    else if (strcmp(mode, "output") == 0) scenario_output();
    else if (strcmp(mode, "tty") == 0) scenario_tty();
    else if (strcmp(mode, "options") == 0) scenario_options();
    else if (strcmp(mode, "bind") == 0) scenario_bind();
    else {
        fprintf(stderr, "usage: test_launcher env|multinode|failure|multinode-failure|blame|"
                        "signals|output|tty|options|bind\n");
        return 2;
    }
    printf("test_launcher %s: ok\n", mode);
    return 0;
}
