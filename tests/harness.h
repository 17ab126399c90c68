/* Test harness: assertions and a runner that starts N real rank processes sharing a file store,
 * so multi-rank tests are ordinary ctest programs. */
#ifndef DDP_TEST_HARNESS_H
#define DDP_TEST_HARNESS_H

#include <stdio.h>
#include <stdlib.h>

#include "ddp/ddp.h"

/* Fails the current process (a rank or the test) with a located message. */
#define CHECK(cond)                                                                               \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);             \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                      \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);             \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fputc('\n', stderr);                                                                  \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* The call must return DDP_OK. */
#define CHECK_OK(expr)                                                                            \
    do {                                                                                          \
        ddp_status_t check_status_ = (expr);                                                      \
        if (check_status_ != DDP_OK) {                                                            \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr,             \
                    ddp_status_string(check_status_), ddp_last_error());                          \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* The call must return `want`. */
#define CHECK_STATUS(expr, want)                                                                  \
    do {                                                                                          \
        ddp_status_t check_status_ = (expr);                                                      \
        if (check_status_ != (want)) {                                                            \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (error text: %s)\n", __FILE__,    \
                    __LINE__, #expr, ddp_status_string(check_status_), ddp_status_string(want),   \
                    ddp_last_error());                                                            \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

/* The last error text must contain `needle`. */
#define CHECK_ERROR_MENTIONS(needle)                                                              \
    CHECK_MSG(strstr(ddp_last_error(), (needle)) != NULL, "error text '%s' does not mention '%s'", \
              ddp_last_error(), (needle))

/* Body of one rank: returns 0 on success. Runs in its own process. */
typedef int (*ddp_test_rank_fn)(int rank, int world, ddp_store_t *store, void *arg);

/* Forks `world` processes; rank r runs fn(r, world, store, arg) with a file store in a fresh
 * temporary directory shared by all ranks. Returns 0 when every rank exits 0 within timeout_s;
 * otherwise prints which rank failed or hung, kills every rank and returns 1. */
int ddp_test_run_ranks(int world, int timeout_s, ddp_test_rank_fn fn, void *arg);

/* Like ddp_test_run_ranks, but each rank first creates a process group over the store (options may
 * be NULL) and hands it to fn through `group_fn`. */
typedef int (*ddp_test_group_fn)(ddp_group_t *group, void *arg);
int ddp_test_run_group(int world, int timeout_s, const ddp_group_options_t *options,
                       ddp_test_group_fn fn, void *arg);

/* Makes a fresh directory under $TMPDIR (or /tmp); returns its path (static storage per call:
 * copy it if needed), or NULL. */
const char *ddp_test_tmpdir(void);

/* A stopper: a process forked now (before the caller starts any thread, or MPI) that, for every
 * order sent with ddp_test_stopper_order, waits the order's delay, SIGSTOPs its pid, waits
 * stop_ms and SIGCONTs it. Returns its pid (-1 on failure) and the write end of its order pipe in
 * *orders; closing that ends it (then waitpid the pid). */
int ddp_test_stopper_start(int stop_ms, int *orders);
/* Sends the stopper one order; returns 0, or -1 if it could not be written. */
int ddp_test_stopper_order(int orders, int pid, int delay_ms);

/* Deterministic pseudo-random doubles in [-1, 1) from a seed (splitmix64). */
double ddp_test_random(unsigned long long *state);

/* Element i of a buffer of dtype dt, written from and read as a double (f16/bf16 through f32,
 * integers truncated), for tests that fill inputs and check results in every dtype. */
void ddp_test_put(ddp_dtype_t dt, void *buf, size_t i, double v);
double ddp_test_get(ddp_dtype_t dt, const void *buf, size_t i);

/* Rank r's input element i of case k, with magnitudes spread over eight orders so that the
 * order of a sum shows in its bits (tests comparing the bytes of different reduction paths). */
float ddp_test_input_f32(int rank, size_t i, int k);
/* n such inputs in dtype dt (f32, f64, i32, bf16 from the same floats; f16: finite halves of
 * their own, exponent 5..25). Aborts on another dtype. */
void ddp_test_fill(void *buf, ddp_dtype_t dt, int rank, size_t n, int k);

/* A rank killed in the middle of collectives: forks `world` processes running
 * fn(rank, world, store_path) on one file store; the last must die by SIGKILL, every other must
 * exit 0, and no ddp segment may be left in /dev/shm. Returns 0 when all of that held. */
typedef int (*ddp_test_victim_fn)(int rank, int world, const char *store_path);
int ddp_test_run_victim(int world, ddp_test_victim_fn fn);

/* One step of a float64 reference reduction: acc op x (SUM and AVG add; AVG's division by the
 * number of values is the caller's). */
double ddp_test_fold(ddp_reduce_op_t op, double acc, double x);

#endif
