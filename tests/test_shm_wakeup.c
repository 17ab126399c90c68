/* Waiters that went to sleep are woken by a late rank's arrival, on every path that publishes a
 * step: the mailbox (8 B) and one-shot (4 KiB) allreduces, which publish with a release store
 * and check for sleepers inside their wait; the staged allreduce (64 KiB) and the barrier,
 * which check at once; and the same through the progress thread (asynchronous works).
 *
 * In every round one rank (in turn) arrives late by LATE_MS; the others have long passed their
 * spin and yield phases (DDP_SHM_YIELD_NS is set to 100 us here) and sleep on the futex. A lost
 * wake-up is not a hang: a sleeper naps at most 100 ms before it looks again, so a lost wake-up
 * costs up to 100 ms, ~50 ms on average. The check is that the rounds take about half of what
 * losing one wake-up per round would cost on average: over ten times what they take here
 * (~100 ms for 40 rounds). Without the wake-up of either publishing path (tried): 2.2-5.9 s.
 * Usage: test_shm_wakeup <world> */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

#define ROUNDS 40
#define LATE_MS 2

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

static int rank_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    float *buf = malloc(16384 * sizeof(float));
    CHECK(buf);
    for (int async = 0; async <= 1; async++) {
        for (int kind = 0; kind < 4; kind++) {
            if (async && kind == 3) continue; /* no asynchronous barrier */
            CHECK_OK(ddp_group_barrier(g));
            double start = ddp_time_us();
            for (int round = 0; round < ROUNDS; round++) {
                if (round % world == rank) sleep_ms(LATE_MS);
                one_round(g, kind, async, round, buf);
            }
            double ms = (ddp_time_us() - start) / 1000.0;
            /* Late arrivals alone: ROUNDS * LATE_MS = 80 ms. One lost wake-up per round would
             * add ~50 ms each on average, 2000 ms in all. */
            double limit = ROUNDS * (LATE_MS + 25.0);
            CHECK_MSG(ms < limit,
                      "rank %d, %s kind %d: %d rounds took %.0f ms (limit %.0f): sleepers are "
                      "not woken by the late rank's arrival",
                      rank, async ? "async" : "blocking", kind, ROUNDS, ms, limit);
        }
    }
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    /* Short yield phases, so that every waiter reaches the futex within the late rank's delay. */
    setenv("DDP_SHM_YIELD_NS", "100000", 1);
    setenv("DDP_TRANSPORT", "shm", 1);
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = 30000;
    return ddp_test_run_group(world, 100, &o, rank_main, NULL);
}
