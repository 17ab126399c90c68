/* Waiters that went to sleep are woken by a late rank's arrival, on every path that publishes a
 * step: the mailbox (8 B) and one-shot (4 KiB) allreduces, which publish with a release store
 * and check for sleepers inside their wait; the staged allreduce (64 KiB) and the barrier,
 * which check at once; and the same through the progress thread (asynchronous works).
 *
 * In every round the last rank arrives LATE_MS after the others, which by then sleep on the
 * futex (DDP_SHM_YIELD_NS is set to 100 us here, so they stop yielding at once). A lost wake-up
 * is not a hang: a sleeper naps at most 100 ms before it looks again, and nobody else arrives
 * in between, so a waiter whose wake-up was lost returns ~100 ms after it called instead of
 * ~LATE_MS. A round is slow when a waiter took more than LATE_MS + SLOW_MS; more than a quarter
 * of slow rounds fails (a loaded machine may delay a few). Without the wake-up on return from
 * the wait (tried), 6 of 12 rounds were slow (the late rank's next arrival, 30 ms later, woke
 * the rest); without the one of the immediate path (tried), all 12.
 * Usage: test_shm_wakeup <world> */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

#define ROUNDS 12
#define LATE_MS 30
#define SLOW_MS 20

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
    int late = rank == world - 1;
    float *buf = malloc(16384 * sizeof(float));
    CHECK(buf);
    for (int async = 0; async <= 1; async++) {
        for (int kind = 0; kind < 4; kind++) {
            if (async && kind == 3) continue; /* no asynchronous barrier */
            CHECK_OK(ddp_group_barrier(g));
            int slow = 0;
            double worst = 0;
            for (int round = 0; round < ROUNDS; round++) {
                if (late) sleep_ms(LATE_MS);
                double start = ddp_time_us();
                one_round(g, kind, async, round, buf);
                double ms = (ddp_time_us() - start) / 1000.0;
                if (ms > worst) worst = ms;
                if (!late && ms > LATE_MS + SLOW_MS) slow++;
            }
            CHECK_MSG(slow <= ROUNDS / 4,
                      "rank %d, %s kind %d: %d of %d rounds took more than %d ms (worst %.1f ms) "
                      "while the late rank came after %d ms: sleepers are not woken by its arrival",
                      rank, async ? "async" : "blocking", kind, slow, ROUNDS, LATE_MS + SLOW_MS,
                      worst, LATE_MS);
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
