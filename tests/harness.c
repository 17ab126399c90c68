/* Multi-process test runner: forks the ranks, shares a file store between them, enforces a
 * timeout and reports which rank failed. */
#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *ddp_test_tmpdir(void)
{
    static char path[512];
    const char *base = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/ddp-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(path)) return NULL;
    return path;
}

void ddp_test_put(ddp_dtype_t dt, void *buf, size_t i, double v)
{
    switch (dt) {
    case DDP_F32: ((float *)buf)[i] = (float)v; break;
    case DDP_F64: ((double *)buf)[i] = v; break;
    case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DDP_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

double ddp_test_get(ddp_dtype_t dt, const void *buf, size_t i)
{
    switch (dt) {
    case DDP_F32: return ((const float *)buf)[i];
    case DDP_F64: return ((const double *)buf)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_I32: return ((const int32_t *)buf)[i];
    case DDP_I64: return (double)((const int64_t *)buf)[i];
    case DDP_U8: return ((const uint8_t *)buf)[i];
    default: return 0;
    }
}

double ddp_test_fold(ddp_reduce_op_t op, double acc, double x)
{
    switch (op) {
    case DDP_SUM:
    case DDP_AVG: return acc + x;
    case DDP_PROD: return acc * x;
    case DDP_MIN: return x < acc ? x : acc;
    case DDP_MAX: return x > acc ? x : acc;
    default: return acc;
    }
}

double ddp_test_random(unsigned long long *state)
{
    unsigned long long z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (double)(z >> 11) / (double)(1ULL << 52) - 1.0;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int ddp_test_run_ranks(int world, int timeout_s, ddp_test_rank_fn fn, void *arg)
{
    if (world < 1 || world > 64) {
        fprintf(stderr, "harness: bad world size %d\n", world);
        return 1;
    }
    const char *dir = ddp_test_tmpdir();
    if (!dir) {
        perror("harness: mkdtemp");
        return 1;
    }
    char store_path[600];
    snprintf(store_path, sizeof store_path, "%s/store", dir);
    char dir_copy[512];
    snprintf(dir_copy, sizeof dir_copy, "%s", dir);
    fflush(stdout);
    fflush(stderr);

    pid_t pids[64];
    for (int r = 0; r < world; r++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("harness: fork");
            for (int k = 0; k < r; k++) kill(pids[k], SIGKILL);
            return 1;
        }
        if (pid == 0) {
            ddp_store_t *store = NULL;
            ddp_status_t s = ddp_store_file_create(store_path, &store);
            if (s != DDP_OK) {
                fprintf(stderr, "rank %d: file store: %s: %s\n", r, ddp_status_string(s),
                        ddp_last_error());
                _exit(1);
            }
            int rc = fn(r, world, store, arg);
            ddp_store_destroy(store);
            fflush(stdout);
            fflush(stderr);
            _exit(rc == 0 ? 0 : 1);
        }
        pids[r] = pid;
    }

    int failed = 0, remaining = world;
    int status_of[64];
    int done[64] = {0};
    double deadline_ms = (double)timeout_s * 1000.0;
    double waited_ms = 0;
    while (remaining > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int r = 0; r < world; r++) {
                if (pids[r] == pid && !done[r]) {
                    done[r] = 1;
                    status_of[r] = status;
                    remaining--;
                    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
                        if (WIFSIGNALED(status))
                            fprintf(stderr, "harness: rank %d killed by signal %d\n", r, WTERMSIG(status));
                        else
                            fprintf(stderr, "harness: rank %d exited with status %d\n", r, WEXITSTATUS(status));
                        failed = 1;
                    }
                }
            }
            continue;
        }
        if (pid < 0 && errno != EINTR) break;
        if (waited_ms >= deadline_ms) {
            for (int r = 0; r < world; r++) {
                if (!done[r]) {
                    fprintf(stderr, "harness: rank %d still running after %d s: killing it\n", r, timeout_s);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    done[r] = 1;
                    remaining--;
                }
            }
            failed = 1;
            break;
        }
        sleep_ms(5);
        waited_ms += 5;
    }
    (void)status_of;
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_copy);
    if (system(cmd) != 0) fprintf(stderr, "harness: could not remove %s\n", dir_copy);
    return failed;
}

struct group_run {
    const ddp_group_options_t *options;
    ddp_test_group_fn fn;
    void *arg;
};

static int run_with_group(int rank, int world, ddp_store_t *store, void *arg)
{
    struct group_run *run = arg;
    ddp_group_t *group = NULL;
    ddp_status_t s = ddp_group_create(store, rank, world, run->options, &group);
    if (s != DDP_OK) {
        fprintf(stderr, "rank %d: ddp_group_create: %s: %s\n", rank, ddp_status_string(s),
                ddp_last_error());
        return 1;
    }
    int rc = run->fn(group, run->arg);
    ddp_group_destroy(group);
    return rc;
}

int ddp_test_run_group(int world, int timeout_s, const ddp_group_options_t *options,
                       ddp_test_group_fn fn, void *arg)
{
    struct group_run run = {options, fn, arg};
    return ddp_test_run_ranks(world, timeout_s, run_with_group, &run);
}

int ddp_test_stopper_start(int stop_ms, int *orders)
{
    int cmd[2];
    if (pipe(cmd) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(cmd[0]);
        close(cmd[1]);
        return -1;
    }
    if (pid == 0) {
        close(cmd[1]);
        int order[2];
        while (read(cmd[0], order, sizeof order) == (ssize_t)sizeof order) {
            sleep_ms(order[1]);
            kill(order[0], SIGSTOP);
            sleep_ms(stop_ms);
            kill(order[0], SIGCONT);
        }
        _exit(0);
    }
    close(cmd[0]);
    *orders = cmd[1];
    return (int)pid;
}

int ddp_test_stopper_order(int orders, int pid, int delay_ms)
{
    int order[2] = {pid, delay_ms};
    return write(orders, order, sizeof order) == (ssize_t)sizeof order ? 0 : -1;
}

/* ---- inputs whose sums depend on their order --------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

float ddp_test_input_f32(int rank, size_t i, int k)
{
    uint64_t h = mix64(((uint64_t)rank << 48) ^ ((uint64_t)k << 40) ^ i);
    float m = (float)((int)(h % 2001) - 1000) * 1e-3f;
    static const float scale[5] = {1e-3f, 1.0f, 7.0f, 1e3f, 3e5f};
    return m * scale[(h >> 20) % 5];
}

void ddp_test_fill(void *buf, ddp_dtype_t dt, int rank, size_t n, int k)
{
    for (size_t i = 0; i < n; i++) {
        float x = ddp_test_input_f32(rank, i, k);
        switch (dt) {
        case DDP_F32: ((float *)buf)[i] = x; break;
        case DDP_F64: ((double *)buf)[i] = (double)x * 1.000001; break;
        case DDP_I32: ((int32_t *)buf)[i] = (int32_t)(x * 1000.0f); break;
        case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16(x); break;
        case DDP_F16: {
            uint64_t h = mix64(((uint64_t)rank << 48) ^ ((uint64_t)k << 40) ^ i ^ 77);
            ((uint16_t *)buf)[i] =
                (uint16_t)((h & 0x8000) | ((5 + (h >> 16) % 21) << 10) | ((h >> 32) & 0x3ff));
            break;
        }
        default: abort();
        }
    }
}

/* ---- a rank killed ------------------------------------------------------------------------ */

static int count_ddp_shm_files(void)
{
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strstr(e->d_name, "ddp")) n++;
    closedir(d);
    return n;
}

int ddp_test_run_victim(int world, ddp_test_victim_fn fn)
{
    if (world < 2) return 0;
    int before = count_ddp_shm_files();
    const char *dir = ddp_test_tmpdir();
    if (!dir) return 1;
    char path[600];
    snprintf(path, sizeof path, "%s/store", dir);
    pid_t pids[64];
    if (world > 64) return 1;
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] < 0) return 1;
        if (pids[r] == 0) _exit(fn(r, world, path));
    }
    int failed = 0;
    for (int r = 0; r < world; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        if (r == world - 1) {
            if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
                fprintf(stderr, "victim rank %d was not killed (status %d)\n", r, status);
                failed = 1;
            }
        } else if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            fprintf(stderr, "rank %d failed (status %d)\n", r, status);
            failed = 1;
        }
    }
    int after = count_ddp_shm_files();
    if (after > before) {
        fprintf(stderr, "/dev/shm holds %d ddp segments after the test (%d before)\n", after,
                before);
        failed = 1;
    }
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) failed = 1;
    return failed;
}
