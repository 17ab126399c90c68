/* Failures reach every rank as errors, never as wrong data or a hang: fingerprint mismatches
 * (count, dtype, root, op, kind; small and large), a rank that never calls (timeout naming it),
 * a rank killed with SIGKILL in the middle of a collective (the others fail naming it, and no
 * segment is left in /dev/shm), and the broken group's DDP_ERR_ABORTED afterwards.
 * A rank that destroys its group while the others wait for it makes them fail at once, naming it.
 * Usage: test_group_errors <world> <mismatch|timeout|kill|leave> */
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static ddp_group_t *make_group(ddp_store_t *store, int rank, int world, const char *name,
                               int timeout_ms)
{
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.name = name;
    o.timeout_ms = timeout_ms;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &o, &g));
    return g;
}

/* ---- mismatch ----------------------------------------------------------------------------- */

enum { MM_COUNT, MM_COUNT_LARGE, MM_SMALL_VS_LARGE, MM_DTYPE, MM_ROOT, MM_OP, MM_KIND, MM_CASES };

/* ddp_work_on_complete callback: copies the failure's text (ddp_last_error() inside fn), then
 * says so (it may run on the progress thread). */
typedef struct seen_error {
    char text[512];
    _Atomic int done;
} seen_error_t;

static void record_error(void *arg, ddp_status_t status)
{
    seen_error_t *seen = arg;
    if (status != DDP_OK) snprintf(seen->text, sizeof seen->text, "%s", ddp_last_error());
    atomic_store(&seen->done, 1);
}

static int mismatch_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    int odd = rank == world - 1; /* the last rank disagrees */
    for (int mm = 0; mm < MM_CASES; mm++) {
        char name[32];
        snprintf(name, sizeof name, "mismatch%d", mm);
        ddp_group_t *g = make_group(store, rank, world, name, 20000);
        CHECK_OK(ddp_group_barrier(g));
        size_t big = 300000;
        float *buf = calloc(big + 8, sizeof(float));
        CHECK(buf);
        ddp_status_t s = DDP_OK;
        const char *a = NULL, *b = NULL; /* texts both sides must appear with */
        switch (mm) {
        case MM_COUNT:
            s = ddp_group_allreduce(g, buf, buf, odd ? 11 : 10, DDP_F32, DDP_SUM);
            a = "count 10";
            b = "count 11";
            break;
        case MM_COUNT_LARGE:
            s = ddp_group_allreduce(g, buf, buf, odd ? big + 1 : big, DDP_F32, DDP_SUM);
            a = "count 300000 ";
            b = "count 300001 ";
            break;
        case MM_SMALL_VS_LARGE:
            s = ddp_group_allreduce(g, buf, buf, odd ? 7 : big, DDP_F32, DDP_SUM);
            a = "count 300000 ";
            b = "count 7 ";
            break;
        case MM_DTYPE:
            s = ddp_group_allreduce(g, buf, buf, 10, odd ? DDP_I32 : DDP_F32, DDP_SUM);
            a = "allreduce f32";
            b = "allreduce i32";
            break;
        case MM_ROOT:
            s = ddp_group_broadcast(g, buf, 10, DDP_F32, odd ? world - 1 : 0);
            a = "root 0";
            b = world > 1 ? (world == 2 ? "root 1" : (world == 3 ? "root 2" : "root 3")) : "root 0";
            break;
        case MM_OP:
            s = ddp_group_allreduce(g, buf, buf, 10, DDP_F32, odd ? DDP_MAX : DDP_SUM);
            a = "f32 sum";
            b = "f32 max";
            break;
        case MM_KIND:
            s = odd ? ddp_group_allgather(g, buf, buf + 8, 1, DDP_F32)
                    : ddp_group_allreduce(g, buf, buf, 1, DDP_F32, DDP_SUM);
            a = "allreduce";
            b = "allgather";
            break;
        }
        if (world == 1) {
            CHECK_OK(s); /* nobody to disagree with */
        } else {
            CHECK_STATUS(s, DDP_ERR_MISMATCH);
            CHECK_ERROR_MENTIONS(a);
            CHECK_ERROR_MENTIONS(b);
            char rank_text[32];
            snprintf(rank_text, sizeof rank_text, "rank %d called", world - 1);
            CHECK_ERROR_MENTIONS(rank_text);
            /* Broken: later calls fail with ABORTED carrying the cause. */
            CHECK_STATUS(ddp_group_barrier(g), DDP_ERR_ABORTED);
            CHECK_ERROR_MENTIONS("mismatch");
            ddp_work_t *w = NULL;
            int64_t x = 1;
            CHECK_STATUS(ddp_group_allreduce_async(g, &x, &x, 1, DDP_I64, DDP_SUM, &w),
                         DDP_ERR_ABORTED);
        }
        free(buf);
        ddp_group_destroy(g);
    }
    /* Queued works behind the failing one all fail with ABORTED. */
    ddp_group_t *g = make_group(store, rank, world, "queued", 20000);
    if (world > 1) {
        int32_t v[4] = {0};
        ddp_work_t *w[4];
        CHECK_OK(ddp_group_allreduce_async(g, v, v, odd ? 2 : 1, DDP_I32, DDP_SUM, &w[0]));
        /* A completion callback reads the failure's text from ddp_last_error(): on the progress
         * thread here (most likely), on this thread for the works below, already complete. */
        static seen_error_t seen[4];
        memset(seen, 0, sizeof seen);
        CHECK_OK(ddp_work_on_complete(w[0], record_error, &seen[0]));
        /* Issued while the first may already have failed: then the issue itself is refused. */
        for (int k = 1; k < 4; k++) {
            w[k] = NULL;
            ddp_status_t s = ddp_group_allreduce_async(g, v + k, v + k, 1, DDP_I32, DDP_SUM, &w[k]);
            CHECK_MSG(s == DDP_OK || s == DDP_ERR_ABORTED, "issue returned %s", ddp_status_string(s));
            if (s == DDP_ERR_ABORTED) CHECK_ERROR_MENTIONS("count 2");
        }
        CHECK_STATUS(ddp_work_wait(w[0]), DDP_ERR_MISMATCH);
        for (int k = 1; k < 4; k++) {
            if (!w[k]) continue;
            CHECK_STATUS(ddp_work_wait(w[k]), DDP_ERR_ABORTED);
            CHECK_ERROR_MENTIONS("count 2");
            CHECK_OK(ddp_work_on_complete(w[k], record_error, &seen[k]));
            CHECK_MSG(atomic_load(&seen[k].done) && strstr(seen[k].text, "count 2"),
                      "callback of an aborted work saw '%s'", seen[k].text);
        }
        /* w[0]'s callback ran by the time its wait returned, or runs right after: wait for it. */
        for (int spin = 0; spin < 5000 && !atomic_load(&seen[0].done); spin++) usleep(1000);
        CHECK_MSG(atomic_load(&seen[0].done) && strstr(seen[0].text, "count 2"),
                  "callback of the failed work saw '%s'", seen[0].text);
        for (int k = 0; k < 4; k++) ddp_work_free(w[k]);
    }
    ddp_group_destroy(g);
    return 0;
}

/* ---- a rank that never calls ------------------------------------------------------------- */

static int timeout_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(store, rank, world, "timeout", 1000);
    CHECK_OK(ddp_group_barrier(g)); /* seq 1 on everyone */
    int lazy = world - 1;
    if (rank == lazy && world > 1) {
        usleep(5000 * 1000); /* never calls seq 2; leaves well after the others gave up */
    } else {
        float x[5] = {1, 2, 3, 4, 5};
        ddp_status_t s = ddp_group_allreduce(g, x, x, 5, DDP_F32, DDP_SUM);
        if (world == 1) {
            CHECK_OK(s);
        } else {
            CHECK_STATUS(s, DDP_ERR_TIMEOUT);
            char who[64];
            snprintf(who, sizeof who, "rank %d (at seq 1)", lazy);
            CHECK_ERROR_MENTIONS(who);
            CHECK_ERROR_MENTIONS("seq 2");
            CHECK_STATUS(ddp_group_barrier(g), DDP_ERR_ABORTED);
            CHECK_ERROR_MENTIONS(who);
        }
    }
    ddp_group_destroy(g);
    return 0;
}

/* ---- a rank that leaves (destroys its group) while the others wait ------------------------ */

static int leave_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(store, rank, world, "leave", 30000);
    CHECK_OK(ddp_group_barrier(g));
    if (rank == world - 1 && world > 1) {
        ddp_group_destroy(g); /* never calls seq 2 */
        return 0;
    }
    int32_t x = 1;
    ddp_status_t s = ddp_group_allreduce(g, &x, &x, 1, DDP_I32, DDP_SUM);
    if (world == 1) {
        CHECK_OK(s);
    } else {
        /* Not a 30 s timeout: the leaver's flag ends the wait at once, naming it. */
        CHECK_STATUS(s, DDP_ERR_REMOTE);
        char who[64];
        snprintf(who, sizeof who, "rank %d left the group", world - 1);
        CHECK_ERROR_MENTIONS(who);
    }
    ddp_group_destroy(g);
    return 0;
}

/* ---- a rank killed mid-collective --------------------------------------------------------- */

/* Runs rank `rank` of the kill test; the victim is killed by SIGKILL during a large allreduce. */
static int kill_rank(int rank, int world, const char *store_path)
{
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(store_path, &store));
    ddp_group_t *g = make_group(store, rank, world, "kill", 30000);
    CHECK_OK(ddp_group_barrier(g));
    size_t n = 4u << 20;
    float *buf = calloc(n, sizeof(float));
    CHECK(buf);
    int victim = world - 1;
    if (rank == victim) {
        ddp_work_t *w = NULL;
        CHECK_OK(ddp_group_allreduce_async(g, buf, buf, n, DDP_F32, DDP_SUM, &w));
        usleep(20 * 1000);
        raise(SIGKILL);
    }
    ddp_status_t s = DDP_OK;
    for (int k = 0; k < 5 && s == DDP_OK; k++)
        s = ddp_group_allreduce(g, buf, buf, n, DDP_F32, DDP_SUM);
    CHECK_MSG(s == DDP_ERR_REMOTE, "rank %d got %s (%s), want DDP_ERR_REMOTE", rank,
              ddp_status_string(s), ddp_last_error());
    char who[32];
    snprintf(who, sizeof who, "rank %d", victim);
    CHECK_ERROR_MENTIONS(who);
    CHECK_STATUS(ddp_group_barrier(g), DDP_ERR_ABORTED);
    ddp_group_destroy(g);
    ddp_store_destroy(store);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    const char *mode = argc > 2 ? argv[2] : "mismatch";
    int rc;
    if (!strcmp(mode, "mismatch")) rc = ddp_test_run_ranks(world, 100, mismatch_rank, NULL);
    else if (!strcmp(mode, "timeout")) rc = ddp_test_run_ranks(world, 60, timeout_rank, NULL);
    else if (!strcmp(mode, "kill")) rc = ddp_test_run_victim(world, kill_rank);
    else if (!strcmp(mode, "leave")) rc = ddp_test_run_ranks(world, 60, leave_rank, NULL);
    else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    if (rc == 0) printf("test_group_errors world=%d %s: ok\n", world, mode);
    return rc;
}
