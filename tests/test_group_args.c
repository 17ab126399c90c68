/* Argument validation of every public group function: DDP_ERR_INVALID_ARGUMENT (or
 * INVALID_USAGE / UNSUPPORTED) with a text naming the argument, and the group still works after.
 * Usage: test_group_args <world> */
#include <string.h>

#include "harness.h"

#define EXPECT_ARG(expr, needle)                                                                  \
    do {                                                                                          \
        CHECK_STATUS((expr), DDP_ERR_INVALID_ARGUMENT);                                           \
        CHECK_ERROR_MENTIONS(needle);                                                             \
    } while (0)

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = NULL;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = 20000;

    /* ddp_group_create */
    EXPECT_ARG(ddp_group_create(store, rank, world, &o, NULL), "out");
    EXPECT_ARG(ddp_group_create(store, world, world, &o, &g), "rank");
    EXPECT_ARG(ddp_group_create(store, -1, world, &o, &g), "rank");
    EXPECT_ARG(ddp_group_create(store, 0, 0, &o, &g), "world_size");
    if (world > 1) EXPECT_ARG(ddp_group_create(NULL, rank, world, &o, &g), "store");
    ddp_group_options_t bad = o;
    bad.timeout_ms = -5;
    EXPECT_ARG(ddp_group_create(store, rank, world, &bad, &g), "timeout_ms");
    bad = o;
    bad.name = "";
    EXPECT_ARG(ddp_group_create(store, rank, world, &bad, &g), "name");
    bad = o;
    bad.transport = "carrier-pigeon";
    bad.name = "pigeon";
    EXPECT_ARG(ddp_group_create(store, rank, world, &bad, &g), "carrier-pigeon");
    CHECK(g == NULL);

    CHECK_OK(ddp_group_create(store, rank, world, &o, &g));
    CHECK(ddp_group_rank(g) == rank && ddp_group_size(g) == world);
    ddp_work_t *w = NULL;
    float f[8] = {0};

    /* allreduce */
    EXPECT_ARG(ddp_group_allreduce(NULL, f, f, 1, DDP_F32, DDP_SUM), "group");
    EXPECT_ARG(ddp_group_allreduce(g, NULL, f, 1, DDP_F32, DDP_SUM), "send");
    EXPECT_ARG(ddp_group_allreduce(g, f, NULL, 1, DDP_F32, DDP_SUM), "recv");
    EXPECT_ARG(ddp_group_allreduce(g, f, f, 1, (ddp_dtype_t)99, DDP_SUM), "dtype");
    EXPECT_ARG(ddp_group_allreduce(g, f, f, 1, (ddp_dtype_t)-1, DDP_SUM), "dtype");
    EXPECT_ARG(ddp_group_allreduce(g, f, f, 1, DDP_F32, (ddp_reduce_op_t)7), "op");
    EXPECT_ARG(ddp_group_allreduce(g, f, f + 1, 4, DDP_F32, DDP_SUM), "overlap");
    EXPECT_ARG(ddp_group_allreduce(g, f, f, (size_t)-1 / 2, DDP_F32, DDP_SUM), "count");
    EXPECT_ARG(ddp_group_allreduce_async(g, f, f, 1, DDP_F32, DDP_SUM, NULL), "work");
    /* NULL buffers are fine with count 0. */
    CHECK_OK(ddp_group_allreduce(g, NULL, NULL, 0, DDP_F32, DDP_SUM));

    /* broadcast */
    EXPECT_ARG(ddp_group_broadcast(g, NULL, 3, DDP_F32, 0), "buf");
    EXPECT_ARG(ddp_group_broadcast(g, f, 3, DDP_F32, world), "root");
    EXPECT_ARG(ddp_group_broadcast(g, f, 3, DDP_F32, -1), "root");
    EXPECT_ARG(ddp_group_broadcast_async(g, f, 3, DDP_F32, 0, NULL), "work");

    /* reduce_scatter: recv overlapping send anywhere but the in-place slot is refused. */
    float *rs = calloc((size_t)world * 4 + 4, sizeof(float));
    CHECK(rs);
    EXPECT_ARG(ddp_group_reduce_scatter(g, NULL, f, 4, DDP_F32, DDP_SUM), "send");
    EXPECT_ARG(ddp_group_reduce_scatter(g, rs, NULL, 4, DDP_F32, DDP_SUM), "recv");
    EXPECT_ARG(ddp_group_reduce_scatter(g, rs, rs + (size_t)rank * 4 + 1, 4, DDP_F32, DDP_SUM), "in-place");
    EXPECT_ARG(ddp_group_reduce_scatter(g, rs, f, 4, DDP_F32, (ddp_reduce_op_t)5), "op");
    CHECK_OK(ddp_group_reduce_scatter(g, rs, rs + (size_t)rank * 4, 4, DDP_F32, DDP_SUM));

    /* allgather */
    EXPECT_ARG(ddp_group_allgather(g, NULL, rs, 4, DDP_F32), "send");
    EXPECT_ARG(ddp_group_allgather(g, f, NULL, 4, DDP_F32), "recv");
    EXPECT_ARG(ddp_group_allgather(g, rs + (size_t)rank * 4 + 1, rs, 4, DDP_F32), "in-place");
    EXPECT_ARG(ddp_group_allgather(g, f, rs, 4, (ddp_dtype_t)DDP_DTYPE_COUNT), "dtype");
    CHECK_OK(ddp_group_allgather(g, rs + (size_t)rank * 4, rs, 4, DDP_F32));

    /* barrier, submit, works */
    EXPECT_ARG(ddp_group_barrier(NULL), "group");
    EXPECT_ARG(ddp_group_barrier_async(g, NULL), "work");
    EXPECT_ARG(ddp_group_submit(g, NULL, NULL, &w), "fn");
    EXPECT_ARG(ddp_work_wait(NULL), "work");
    int done = 0;
    EXPECT_ARG(ddp_work_test(NULL, &done), "work");
    CHECK_OK(ddp_group_barrier_async(g, &w));
    EXPECT_ARG(ddp_work_test(w, NULL), "done");
    EXPECT_ARG(ddp_work_on_complete(w, NULL, NULL), "fn");
    CHECK_OK(ddp_work_wait(w));
    ddp_work_free(w);
    ddp_work_free(NULL);

    /* buffers */
    void *p = NULL;
    EXPECT_ARG(ddp_group_alloc_buffer(g, 16, NULL), "out");
    EXPECT_ARG(ddp_group_free_buffer(g, NULL), "buffer");
    EXPECT_ARG(ddp_group_free_buffer(g, f), "alloc_buffer");
    CHECK_OK(ddp_group_alloc_buffer(g, 0, &p));
    CHECK(p != NULL);
    CHECK_OK(ddp_group_free_buffer(g, p));

    /* split */
    int dup[2] = {0, 0}, out_of_range[1] = {world};
    ddp_group_t *sub = NULL;
    EXPECT_ARG(ddp_group_split(g, NULL, 1, NULL, &sub), "ranks");
    EXPECT_ARG(ddp_group_split(g, dup, 0, NULL, &sub), "nranks");
    if (world > 1) EXPECT_ARG(ddp_group_split(g, dup, 2, NULL, &sub), "twice");
    EXPECT_ARG(ddp_group_split(g, out_of_range, 1, NULL, &sub), "ranks[0]");
    EXPECT_ARG(ddp_group_split(g, dup, 1, NULL, NULL), "out");

    /* AVG and PROD are allowed on u8 (wrapping product, exact average). */
    unsigned char u[3] = {(unsigned char)(200 + rank), 3, 250};
    CHECK_OK(ddp_group_allreduce(g, u, u, 3, DDP_U8, DDP_AVG));
    int want0 = 0;
    for (int r = 0; r < world; r++) want0 += 200 + r;
    CHECK(u[0] == want0 / world && u[1] == 3 && u[2] == 250);

    /* Accessors tolerate NULL. */
    CHECK(ddp_group_rank(NULL) == -1 && ddp_group_size(NULL) == 0);
    ddp_group_destroy(NULL);

    /* The group still works after all of the refused calls. */
    float x = (float)rank;
    CHECK_OK(ddp_group_allreduce(g, &x, &x, 1, DDP_F32, DDP_SUM));
    CHECK(x == (float)(world * (world - 1) / 2));
    free(rs);
    ddp_group_destroy(g);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    int rc = ddp_test_run_ranks(world, 60, rank_main, NULL);
    if (rc == 0) printf("test_group_args world=%d: ok\n", world);
    return rc;
}
