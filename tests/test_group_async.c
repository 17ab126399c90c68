/* Asynchronous works, tasks, callbacks, several groups at once, split subgroups and segment
 * buffers from ddp_group_alloc_buffer.
 * Usage: test_group_async <world> */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"

#define INFLIGHT 100

/* 100 allreduces of different sizes in flight, waited in reverse order. */
static void test_many_in_flight(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    float *bufs[INFLIGHT];
    size_t counts[INFLIGHT];
    ddp_work_t *works[INFLIGHT];
    for (int k = 0; k < INFLIGHT; k++) {
        counts[k] = (size_t)(k * 997) % 20011; /* 0 .. ~20000, includes 0 and odd sizes */
        if (k == 50) counts[k] = 300007;       /* one through the staged path */
        bufs[k] = malloc((counts[k] + 1) * sizeof(float));
        CHECK(bufs[k]);
        for (size_t i = 0; i < counts[k]; i++) bufs[k][i] = (float)(rank + 1) * (float)(k + 1) + (float)(i % 5);
        CHECK_OK(ddp_group_allreduce_async(g, bufs[k], bufs[k], counts[k], DDP_F32, DDP_SUM, &works[k]));
    }
    float ranks_sum = (float)(world * (world + 1) / 2);
    for (int k = INFLIGHT - 1; k >= 0; k--) {
        CHECK_OK(ddp_work_wait(works[k]));
        int done = 0;
        CHECK_OK(ddp_work_test(works[k], &done));
        CHECK(done == 1);
        for (size_t i = 0; i < counts[k]; i++) {
            float want = ranks_sum * (float)(k + 1) + (float)world * (float)(i % 5);
            CHECK_MSG(bufs[k][i] == want, "work %d element %zu: %g, want %g", k, i, bufs[k][i], want);
        }
        ddp_work_free(works[k]);
        free(bufs[k]);
    }
}

/* A blocking call issued after async works runs after them, though a blocking call on an idle
 * group runs on the calling thread: a sum then a max of the same buffer gives sum(r+1), the
 * other order world * world. Sizes from one element (the async work may still be queued) to
 * 256 Ki (it is running). */
static void test_blocking_after_async(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t n = 1 << 18;
    float *x = malloc(n * sizeof(float));
    CHECK(x);
    float want = (float)(world * (world + 1) / 2);
    for (int k = 0; k < 200; k++) {
        size_t count = k % 2 ? 1 : (size_t)1 << (k % 19);
        for (size_t i = 0; i < count; i++) x[i] = (float)(rank + 1);
        ddp_work_t *w = NULL;
        CHECK_OK(ddp_group_allreduce_async(g, x, x, count, DDP_F32, DDP_SUM, &w));
        CHECK_OK(ddp_group_allreduce(g, x, x, count, DDP_F32, DDP_MAX));
        int done = 0;
        CHECK_OK(ddp_work_test(w, &done));
        CHECK_MSG(done == 1, "round %d: the async work is not done after a blocking call behind it", k);
        CHECK_OK(ddp_work_wait(w));
        ddp_work_free(w);
        for (size_t i = 0; i < count; i++)
            CHECK_MSG(x[i] == want, "round %d, %zu elements: element %zu is %g, want %g", k, count,
                      i, x[i], want);
    }
    free(x);
}

/* Two groups on one store, collectives interleaved, plus a subgroup from ddp_group_split. */
static void test_two_groups_and_split(ddp_group_t *a, ddp_store_t *store)
{
    int rank = ddp_group_rank(a), world = ddp_group_size(a);
    ddp_group_options_t ob = DDP_GROUP_OPTIONS_INIT;
    ob.name = "second";
    ob.timeout_ms = 30000;
    ddp_group_t *b = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &ob, &b));
    CHECK(ddp_group_size(b) == world && ddp_group_rank(b) == rank);
    for (int round = 0; round < 20; round++) {
        int64_t xa = rank + round, xb = 100 * rank - round;
        ddp_work_t *wa = NULL, *wb = NULL;
        CHECK_OK(ddp_group_allreduce_async(a, &xa, &xa, 1, DDP_I64, DDP_SUM, &wa));
        CHECK_OK(ddp_group_allreduce_async(b, &xb, &xb, 1, DDP_I64, DDP_MAX, &wb));
        CHECK_OK(ddp_work_wait(wb));
        CHECK_OK(ddp_work_wait(wa));
        CHECK(xa == (int64_t)world * (world - 1) / 2 + (int64_t)world * round);
        CHECK(xb == 100 * (world - 1) - round);
        ddp_work_free(wa);
        ddp_work_free(wb);
    }

    /* Subgroup: every rank but rank 0 (or just rank 0 in a world of 1), listed in reverse order
     * so that subgroup ranks are the reverse of parent ranks. */
    int members[8], n = 0;
    for (int r = world - 1; r >= (world > 1 ? 1 : 0); r--) members[n++] = r;
    ddp_group_t *sub = NULL;
    CHECK_OK(ddp_group_split(a, members, n, NULL, &sub));
    int listed = world == 1 || rank != 0;
    CHECK((sub != NULL) == listed);
    if (sub) {
        CHECK(ddp_group_size(sub) == n);
        CHECK(ddp_group_rank(sub) == world - 1 - rank);
        int32_t v = rank;
        CHECK_OK(ddp_group_allreduce(sub, &v, &v, 1, DDP_I32, DDP_SUM));
        int32_t want = 0;
        for (int i = 0; i < n; i++) want += members[i];
        CHECK(v == want);
        int32_t who = rank;
        CHECK_OK(ddp_group_broadcast(sub, &who, 1, DDP_I32, 0)); /* sub rank 0 = parent world-1 */
        CHECK(who == world - 1);
        ddp_group_destroy(sub);
    }
    CHECK_OK(ddp_group_barrier(a));
    CHECK_OK(ddp_group_barrier(b));
    ddp_group_destroy(b);
}

/* A task chains blocking collectives inline; async works around it keep their order. */
struct task_arg {
    float *data;
    size_t n;
    int wait_refused;
    ddp_work_t *other;
};

static ddp_status_t chained_task(ddp_group_t *g, void *p)
{
    struct task_arg *t = p;
    ddp_status_t s = ddp_group_allreduce(g, t->data, t->data, t->n, DDP_F32, DDP_SUM);
    if (s != DDP_OK) return s;
    for (size_t i = 0; i < t->n; i++) t->data[i] *= 0.5f; /* "compute" between collectives */
    s = ddp_group_allreduce(g, t->data, t->data, t->n, DDP_F32, DDP_MAX);
    if (s != DDP_OK) return s;
    t->wait_refused = ddp_work_wait(t->other) == DDP_ERR_INVALID_USAGE;
    return ddp_group_barrier(g);
}

static ddp_status_t failing_task(ddp_group_t *g, void *p)
{
    (void)g;
    (void)p;
    return DDP_ERR_INVALID_USAGE;
}

static atomic_int callbacks_run;
static void on_done(void *arg, ddp_status_t s)
{
    CHECK(s == DDP_OK);
    atomic_fetch_add(&callbacks_run, *(int *)arg);
}

static void test_tasks(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t n = 4099;
    float *data = malloc(n * sizeof(float));
    CHECK(data);
    for (size_t i = 0; i < n; i++) data[i] = (float)(rank + (int)(i % 3));
    int64_t before = rank, after = rank;
    ddp_work_t *w_before = NULL, *w_task = NULL, *w_after = NULL;
    CHECK_OK(ddp_group_allreduce_async(g, &before, &before, 1, DDP_I64, DDP_SUM, &w_before));
    struct task_arg t = {data, n, 0, w_before};
    CHECK_OK(ddp_group_submit(g, chained_task, &t, &w_task));
    CHECK_OK(ddp_group_allreduce_async(g, &after, &after, 1, DDP_I64, DDP_MAX, &w_after));
    int one = 1, ten = 10;
    atomic_store(&callbacks_run, 0);
    CHECK_OK(ddp_work_on_complete(w_task, on_done, &one));
    CHECK_STATUS(ddp_work_on_complete(w_task, on_done, &one), DDP_ERR_INVALID_USAGE);
    CHECK_OK(ddp_work_wait(w_after));
    CHECK_OK(ddp_work_wait(w_task));
    CHECK_OK(ddp_work_wait(w_before));
    CHECK(t.wait_refused == 1);
    CHECK(before == (int64_t)world * (world - 1) / 2);
    CHECK(after == world - 1);
    /* sum over ranks of (r + i%3), halved, then max over ranks (all equal). */
    for (size_t i = 0; i < n; i++) {
        float want = 0.5f * (float)(world * (world - 1) / 2 + world * (int)(i % 3));
        CHECK_MSG(data[i] == want, "task result %zu: %g want %g", i, data[i], want);
    }
    /* Callback on an already completed work runs at once on this thread. */
    CHECK_OK(ddp_work_on_complete(w_before, on_done, &ten));
    CHECK(atomic_load(&callbacks_run) == 11);
    ddp_work_free(w_before);
    ddp_work_free(w_task);
    ddp_work_free(w_after);

    /* A task's own failure is the work's status and does not break the group. */
    ddp_work_t *wf = NULL;
    CHECK_OK(ddp_group_submit(g, failing_task, NULL, &wf));
    CHECK_STATUS(ddp_work_wait(wf), DDP_ERR_INVALID_USAGE);
    ddp_work_free(wf);
    CHECK_OK(ddp_group_barrier(g));

    /* A freed work that is still running completes anyway (detached). */
    float x = 1.0f;
    ddp_work_t *wd = NULL;
    CHECK_OK(ddp_group_allreduce_async(g, &x, &x, 1, DDP_F32, DDP_SUM, &wd));
    ddp_work_free(wd);
    CHECK_OK(ddp_group_barrier(g));
    CHECK(x == (float)world);
    free(data);
}

/* Buffers in the transport's memory: zeroed, aligned, usable in place and out of place, mixed
 * with ordinary memory on some ranks. */
static void test_segment_buffers(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    const size_t sizes[] = {1, 4099, (1u << 20) + 3};
    for (size_t si = 0; si < 3; si++) {
        size_t n = sizes[si];
        float *buf = NULL;
        CHECK_OK(ddp_group_alloc_buffer(g, 2 * n * sizeof(float), (void **)&buf));
        CHECK(((uintptr_t)buf & 63) == 0);
        for (size_t i = 0; i < 2 * n; i++) CHECK_MSG(buf[i] == 0.0f, "buffer not zeroed at %zu", i);
        for (size_t i = 0; i < n; i++) buf[i] = (float)((rank + 1) * (int)(i % 7 + 1));
        /* In place. */
        CHECK_OK(ddp_group_allreduce(g, buf, buf, n, DDP_F32, DDP_SUM));
        float tri = (float)(world * (world + 1) / 2);
        for (size_t i = 0; i < n; i++)
            CHECK_MSG(buf[i] == tri * (float)(i % 7 + 1), "segment allreduce n=%zu at %zu: %g", n, i, buf[i]);
        /* Out of place inside the same buffer: recv is the second half. */
        CHECK_OK(ddp_group_allreduce(g, buf, buf + n, n, DDP_F32, DDP_MAX));
        for (size_t i = 0; i < n; i++) CHECK(buf[n + i] == tri * (float)(i % 7 + 1));
        /* Rank 0 passes ordinary memory, the others the segment: still correct. */
        float *plain = malloc(n * sizeof(float));
        CHECK(plain);
        float *mine = rank == 0 ? plain : buf;
        for (size_t i = 0; i < n; i++) mine[i] = (float)rank;
        CHECK_OK(ddp_group_allreduce(g, mine, mine, n, DDP_F32, DDP_SUM));
        for (size_t i = 0; i < n; i++) CHECK(mine[i] == (float)(world * (world - 1) / 2));
        /* f16 and i64 on the segment too. */
        uint16_t *h = (uint16_t *)buf;
        for (size_t i = 0; i < n; i++) h[i] = ddp_f32_to_f16((float)(rank + 1) * 0.5f);
        CHECK_OK(ddp_group_allreduce(g, h, h, n, DDP_F16, DDP_AVG));
        for (size_t i = 0; i < n; i++)
            CHECK(ddp_f16_to_f32(h[i]) == ddp_f16_to_f32(ddp_f32_to_f16(0.5f * (float)(world + 1) / 2.0f)));
        free(plain);
        CHECK_OK(ddp_group_free_buffer(g, buf));
    }
}

struct run_arg {
    int world;
};

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_options_t opts = DDP_GROUP_OPTIONS_INIT;
    opts.timeout_ms = 30000;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &opts, &g));
    CHECK(strcmp(ddp_group_transport(g), world == 1 ? "self" : "shm") == 0);
    CHECK(ddp_group_timeout_ms(g) == 30000);
    test_many_in_flight(g);
    test_blocking_after_async(g);
    test_two_groups_and_split(g, store);
    test_tasks(g);
    test_segment_buffers(g);

    /* A work handle outlives its group: destroy waits for the queued work, after which the
     * handle still answers. */
    int64_t last = rank;
    ddp_work_t *w = NULL;
    CHECK_OK(ddp_group_allreduce_async(g, &last, &last, 1, DDP_I64, DDP_SUM, &w));
    ddp_group_destroy(g);
    int done = 0;
    CHECK_OK(ddp_work_test(w, &done));
    CHECK(done == 1);
    CHECK_OK(ddp_work_wait(w));
    CHECK(last == (int64_t)world * (world - 1) / 2);
    ddp_work_free(w);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    int rc = ddp_test_run_ranks(world, 100, rank_main, NULL);
    if (rc == 0) printf("test_group_async world=%d: ok\n", world);
    return rc;
}
