/* Waiters that went to sleep are woken by a late rank's arrival, on every path that publishes a
 * step: the mailbox (8 B) and one-shot (4 KiB) allreduces, which publish with a release store
 * and check for sleepers inside their wait; the staged allreduce (64 KiB) and the barrier,
 * which check at once; and the same through the progress thread (asynchronous works).
 *
 * In every round the last rank arrives LATE_MS after the others, which by then sleep on the
 * futex (DDP_SHM_YIELD_NS is set to 100 us here, so they stop yielding at once). Sleepers nap
 * longer than the test may run (ddp__shm_set_nap_ns), and between rounds the ranks meet in the
 * store, not in the segment, so no later publication can wake a sleeper whose wake-up was lost:
 * a lost wake-up is a hang, which the harness reports (no wall-clock bound is asserted: the
 * latency of a wake-up is measured by ddp-bench, not here). Without the wake-up on return from
 * the wait, or the one of the immediate path, the test hangs.
 * Usage: test_shm_wakeup <world> */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "transport/shm/shm.h"

#define ROUNDS 12
#define LATE_MS 30

static void sleep_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* One round of kind `kind` (0: 8 B, 1: 4 KiB, 2: 64 KiB allreduce, 3: barrier); async through
 * the progress thread when `async`. Checks the sums. */
static void one_round(ddp_group_t *g, int kind, int async, int round, float *buf)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    static const size_t counts[3] = {2, 1024, 16384};
    if (kind == 3) {
        CHECK_OK(ddp_group_barrier(g));
        return;
    }
    size_t n = counts[kind];
    for (size_t i = 0; i < n; i++) buf[i] = (float)(rank + 1) + (float)(i % 7) + (float)round;
    if (async) {
        ddp_work_t *w = NULL;
        CHECK_OK(ddp_group_allreduce_async(g, buf, buf, n, DDP_F32, DDP_SUM, &w));
        CHECK_OK(ddp_work_wait(w));
        ddp_work_free(w);
    } else {
        CHECK_OK(ddp_group_allreduce(g, buf, buf, n, DDP_F32, DDP_SUM));
    }
    float ranks = (float)(world * (world + 1) / 2);
    for (size_t i = 0; i < n; i++) {
        float want = ranks + (float)world * ((float)(i % 7) + (float)round);
        CHECK_MSG(buf[i] == want, "kind %d round %d element %zu: %g, want %g", kind, round, i,
                  buf[i], want);
    }
}

/* The ranks other than the late one report the end of a round in the store; the late rank waits
 * for them there before it sleeps and arrives at the next round. */
static void round_done(ddp_store_t *store, int rank, int world, int late, int step)
{
    char key[64];
    if (!late) {
        snprintf(key, sizeof key, "done/%d/%d", step, rank);
        CHECK_OK(ddp_store_set(store, key, "1", 1));
        return;
    }
    for (int r = 0; r < world - 1; r++) {
        snprintf(key, sizeof key, "done/%d/%d", step, r);
        const char *keys[1] = {key};
        CHECK_OK(ddp_store_wait(store, keys, 1, 300000));
    }
}

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = 300000; /* longer than the harness waits: a lost wake-up is a hang */
    o.transport = "shm";
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &o, &g));
    int late = rank == world - 1;
    float *buf = malloc(16384 * sizeof(float));
    CHECK(buf);
    int step = 0;
    for (int async = 0; async <= 1; async++) {
        for (int kind = 0; kind < 4; kind++) {
            if (async && kind == 3) continue; /* no asynchronous barrier */
            CHECK_OK(ddp_group_barrier(g));
            for (int round = 0; round < ROUNDS; round++) {
                if (late) sleep_ms(LATE_MS);
                one_round(g, kind, async, round, buf);
                round_done(store, rank, world, late, step++);
            }
        }
    }
    free(buf);
    ddp_group_destroy(g);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    /* Short yield phases, so that every waiter reaches the futex within the late rank's delay. */
    setenv("DDP_SHM_YIELD_NS", "100000", 1);
    ddp__shm_set_nap_ns(3600LL * 1000000000LL);
    return ddp_test_run_ranks(world, 90, rank_main, NULL);
}
