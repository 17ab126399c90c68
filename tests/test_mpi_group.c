/* Process groups over the MPI transport through the public API, under mpirun with 1-4 processes,
 * in an application that initialised MPI itself: async collectives in flight together, f16 and
 * bf16 reduced in f32, a split subgroup, a mismatch through the group (every rank fails, the
 * group is broken), and the transport must leave the application's MPI initialised.
 * With --funneled the application initialises MPI with MPI_THREAD_FUNNELED, which the transport
 * must refuse (its progress thread calls MPI) with a status, not a crash; with --serialized,
 * MPI_THREAD_SERIALIZED, under which the transport serialises its own MPI calls. */
#include <math.h>
#include <mpi.h>
#include <string.h>

#include "harness.h"
#include "transport/mpi/mpi_internal.h"

static int g_rank, g_world;

static ddp_store_t *shared_store(void)
{
    char path[600] = "";
    if (g_rank == 0) {
        const char *dir = ddp_test_tmpdir();
        CHECK(dir);
        snprintf(path, sizeof path, "%s/store", dir);
    }
    CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(path, &store));
    return store;
}

static void test_collectives(ddp_group_t *g)
{
    int w = ddp_group_size(g), r = ddp_group_rank(g);
    CHECK(strcmp(ddp_group_transport(g), w == 1 ? "self" : "mpi") == 0);
    /* Several works in flight, waited in reverse order. */
    enum { NWORKS = 12, N = 4099 };
    static float bufs[NWORKS][N];
    ddp_work_t *works[NWORKS];
    for (int k = 0; k < NWORKS; k++) {
        for (int i = 0; i < N; i++) bufs[k][i] = (float)(r + 1) * (float)(i % 97 + k);
        CHECK_OK(ddp_group_allreduce_async(g, bufs[k], bufs[k], N, DDP_F32, DDP_SUM, &works[k]));
    }
    for (int k = NWORKS - 1; k >= 0; k--) {
        CHECK_OK(ddp_work_wait(works[k]));
        ddp_work_free(works[k]);
    }
    float ranks_sum = (float)w * (float)(w + 1) / 2.0f;
    for (int k = 0; k < NWORKS; k++)
        for (int i = 0; i < N; i++) CHECK(bufs[k][i] == ranks_sum * (float)(i % 97 + k));

    /* f16 AVG: 1000 + rank/8 is not a sum f16 can hold exactly, but the f32 sum is exact and
     * rounded once; the reference rounds the exact average once too. */
    uint16_t h[7];
    for (int i = 0; i < 7; i++) h[i] = ddp_f32_to_f16(1000.0f + (float)i + (float)r / 8.0f);
    CHECK_OK(ddp_group_allreduce(g, h, h, 7, DDP_F16, DDP_AVG));
    for (int i = 0; i < 7; i++) {
        double exact = 0;
        for (int q = 0; q < w; q++)
            exact += ddp_f16_to_f32(ddp_f32_to_f16(1000.0f + (float)i + (float)q / 8.0f));
        CHECK_MSG(h[i] == ddp_f32_to_f16((float)(exact / w)), "f16 avg element %d: %g vs %g", i,
                  ddp_f16_to_f32(h[i]), exact / w);
    }
    /* bf16 sum of 1 + 2^-8 * rank: halfway cases would show double rounding. */
    uint16_t b[5];
    for (int i = 0; i < 5; i++) b[i] = ddp_f32_to_bf16(1.0f + (float)r * 0x1.0p-7f);
    CHECK_OK(ddp_group_allreduce(g, b, b, 5, DDP_BF16, DDP_SUM));
    float exact = 0;
    for (int q = 0; q < w; q++)
        exact += ddp_bf16_to_f32(ddp_f32_to_bf16(1.0f + (float)q * 0x1.0p-7f));
    for (int i = 0; i < 5; i++) CHECK(b[i] == ddp_f32_to_bf16(exact));

    /* Broadcast, reduce_scatter, allgather, barrier. */
    int64_t v[3] = {r, r, r};
    CHECK_OK(ddp_group_broadcast(g, v, 3, DDP_I64, w - 1));
    CHECK(v[0] == w - 1 && v[2] == w - 1);
    int32_t rs_in[64 * 3], rs_out[3];
    for (int i = 0; i < 3 * w; i++) rs_in[i] = i + 1000 * r;
    CHECK_OK(ddp_group_reduce_scatter(g, rs_in, rs_out, 3, DDP_I32, DDP_MAX));
    for (int i = 0; i < 3; i++) CHECK(rs_out[i] == 3 * r + i + 1000 * (w - 1));
    double mine = r * 0.5, all[64];
    CHECK_OK(ddp_group_allgather(g, &mine, all, 1, DDP_F64));
    for (int q = 0; q < w; q++) CHECK(all[q] == q * 0.5);
    CHECK_OK(ddp_group_barrier(g));
}

static void test_split(ddp_group_t *g)
{
    /* Odd world ranks, in descending order. */
    int members[64], n = 0;
    for (int q = g_world - 1; q >= 0; q--)
        if (q % 2 == 1) members[n++] = q;
    if (n == 0) return;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.transport = "mpi";
    ddp_group_t *sub = NULL;
    CHECK_OK(ddp_group_split(g, members, n, &o, &sub));
    if (g_rank % 2 == 0) {
        CHECK(sub == NULL);
        return;
    }
    CHECK(sub != NULL);
    CHECK(ddp_group_size(sub) == n);
    CHECK(members[ddp_group_rank(sub)] == g_rank);
    int32_t x = g_rank;
    CHECK_OK(ddp_group_allreduce(sub, &x, &x, 1, DDP_I32, DDP_SUM));
    int32_t want = 0;
    for (int i = 0; i < n; i++) want += members[i];
    CHECK(x == want);
    int32_t first = g_rank;
    CHECK_OK(ddp_group_broadcast(sub, &first, 1, DDP_I32, 0));
    CHECK(first == members[0]);
    ddp_group_destroy(sub);
}

static void test_mismatch(ddp_store_t *store)
{
    if (g_world < 2) return;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.transport = "mpi";
    o.name = "mismatch";
    o.timeout_ms = 20000;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, g_rank, g_world, &o, &g));
    float x[9] = {0};
    size_t count = g_rank == 1 ? 9 : 8;
    CHECK_STATUS(ddp_group_allreduce(g, x, x, count, DDP_F32, DDP_SUM), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("count 8");
    CHECK_ERROR_MENTIONS("count 9");
    CHECK_ERROR_MENTIONS("rank 1");
    /* The group is broken, whatever comes next. */
    CHECK(ddp_group_barrier(g) != DDP_OK);
    ddp_group_destroy(g);
}

static int run_funneled(void)
{
    int provided = 0;
    CHECK(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    if (provided >= MPI_THREAD_SERIALIZED) {
        /* This MPI gave more than asked: nothing to refuse. */
        MPI_Finalize();
        return 0;
    }
    void *state = NULL;
    CHECK_STATUS(ddp__transport_mpi.create(NULL, "funneled", g_rank, g_world, 5000, &state),
                 DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("MPI_THREAD_FUNNELED");
    CHECK_ERROR_MENTIONS("MPI_THREAD_MULTIPLE");
    MPI_Finalize();
    if (g_rank == 0) printf("test_mpi_group --funneled: %d ranks passed\n", g_world);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--funneled") == 0) return run_funneled();
    /* --serialized: the transport must then serialise its own MPI calls (one lock). */
    int serialized = argc > 1 && strcmp(argv[1], "--serialized") == 0;
    int want = serialized ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE;
    int provided = 0;
    CHECK(MPI_Init_thread(&argc, &argv, want, &provided) == MPI_SUCCESS);
    CHECK(provided >= want);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    CHECK(g_world <= 64);

    ddp_store_t *store = shared_store();
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.transport = "mpi";
    o.timeout_ms = 60000;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, g_rank, g_world, &o, &g));
    CHECK(ddp_group_rank(g) == g_rank && ddp_group_size(g) == g_world);
    if (g_world > 1) CHECK(ddp__mpi_thread_level() == provided);
    test_collectives(g);
    test_split(g);
    ddp_group_destroy(g);
    test_mismatch(store);

    /* The transport did not finalise the application's MPI. */
    int finalized = 1;
    MPI_Finalized(&finalized);
    CHECK(!finalized);
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_destroy(store);
    if (g_rank == 0) printf("test_mpi_group: %d ranks passed\n", g_world);
    MPI_Finalize();
    return 0;
}
