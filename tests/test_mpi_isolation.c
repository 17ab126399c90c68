/* Groups over the same MPI processes must never take each other's messages (store-less groups:
 * MPI_COMM_WORLD from ddp_group_create_from_env and its splits), under mpirun with 2-4 processes:
 *   stale      - group A fails because its last rank is late; that rank is released only after
 *                the others have destroyed A, and then sends its fingerprint record (and, for a
 *                data collective, its part of MPI's collective) on A. Group B, split next over
 *                the same processes, runs the very same calls (same sequence numbers, so the same
 *                fingerprints) with other data: every rank must get B's results, never A's
 *                contribution. Then A fails by a mismatch (abort notices everywhere) and B again.
 *                Open MPI reuses a freed communicator's context id and hands it messages parked
 *                for that id: before the transport kept a failed group's communicator, B
 *                returned DDP_OK with A's data, or timed out in its first exchange.
 *   interleave - the parent, a split of all ranks and a reordered split (a subset with 3 or more
 *                ranks), each with async work in flight at once and data of its own; then one
 *                split fails by a mismatch while the other two have work in flight, and a new
 *                split over the same processes works: every result is its own group's.
 * Usage: mpirun -np N test_mpi_isolation stale|interleave [--allreduce-exchange] */
#include <string.h>

#include "harness.h"
#include "transport/mpi/mpi_internal.h"

/* A's timeout. Its failure does not depend on it (the late rank is held until the others have
 * failed); it only has to cover A's first barrier with oversubscribed ranks on a loaded machine. */
#define SHORT_MS 2000
#define LONG_MS 120000

enum { N = 1000 };

static ddp_group_t *world_group(void)
{
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = LONG_MS;
    o.transport = "mpi";
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(&o, &g));
    return g;
}

static ddp_group_t *split(ddp_group_t *parent, const int *members, int n, int timeout_ms)
{
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = timeout_ms;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_split(parent, members, n, &o, &g));
    return g;
}

/* The value rank r contributes at element k in the group tagged `tag` (exact in f32). */
static float value(int tag, int r, size_t k)
{
    return (float)(tag * 1000 + (r + 1) * 10) + (float)(k % 7);
}

/* Collective `kind` (0 inline allreduce, 1 allreduce, 2 broadcast, 3 allgather,
 * 4 reduce_scatter, 5 barrier) on g with the data of `tag`; checks the result when it is OK. */
static ddp_status_t run_kind(ddp_group_t *g, int kind, int tag, float *a, float *b)
{
    int r = ddp_group_rank(g), w = ddp_group_size(g);
    size_t n = kind == 0 ? 2 : N;
    for (size_t k = 0; k < n * (size_t)w; k++) a[k] = value(tag, r, k);
    ddp_status_t s;
    switch (kind) {
    case 0:
    case 1:
        s = ddp_group_allreduce(g, a, b, n, DDP_F32, DDP_SUM);
        for (size_t k = 0; s == DDP_OK && k < n; k++) {
            float want = 0;
            for (int q = 0; q < w; q++) want += value(tag, q, k);
            CHECK_MSG(b[k] == want, "tag %d kind %d: element %zu is %g, want %g", tag, kind, k,
                      b[k], want);
        }
        return s;
    case 2:
        s = ddp_group_broadcast(g, a, n, DDP_F32, w - 1);
        for (size_t k = 0; s == DDP_OK && k < n; k++)
            CHECK_MSG(a[k] == value(tag, w - 1, k), "tag %d broadcast: element %zu is %g, want %g",
                      tag, k, a[k], value(tag, w - 1, k));
        return s;
    case 3:
        s = ddp_group_allgather(g, a, b, n, DDP_F32);
        for (int q = 0; s == DDP_OK && q < w; q++)
            for (size_t k = 0; k < n; k++)
                CHECK_MSG(b[(size_t)q * n + k] == value(tag, q, k),
                          "tag %d allgather: block %d element %zu is %g, want %g", tag, q, k,
                          b[(size_t)q * n + k], value(tag, q, k));
        return s;
    case 4:
        s = ddp_group_reduce_scatter(g, a, b, n, DDP_F32, DDP_SUM);
        for (size_t k = 0; s == DDP_OK && k < n; k++) {
            float want = 0;
            for (int q = 0; q < w; q++) want += value(tag, q, (size_t)r * n + k);
            CHECK_MSG(b[k] == want, "tag %d reduce_scatter: element %zu is %g, want %g", tag, k,
                      b[k], want);
        }
        return s;
    default: return ddp_group_barrier(g);
    }
}

static void stale(ddp_group_t *coord, float *a, float *b)
{
    /* A's buffers are never reused: MPI cannot cancel the late rank's collective on A, which may
     * still write into them (docs/mpi-transport.md, "Limits"). */
    float *a_bufs = calloc((size_t)N * 64 * 6, sizeof(float));
    float *b_bufs = calloc((size_t)N * 64 * 6, sizeof(float));
    CHECK(a_bufs && b_bufs);
    int rank = ddp_group_rank(coord), world = ddp_group_size(coord), last = world - 1;
    int all[64];
    for (int r = 0; r < world; r++) all[r] = r;
    for (int kind = 0; kind < 6; kind++) {
        ddp_group_t *ga = split(coord, all, world, SHORT_MS);
        CHECK_OK(ddp_group_barrier(ga));
        float *a_a = a_bufs + (size_t)kind * N * 64, *b_a = b_bufs + (size_t)kind * N * 64;
        ddp_status_t s;
        if (rank != last) {
            s = run_kind(ga, kind, 1, a_a, b_a);
            CHECK_MSG(s == DDP_ERR_TIMEOUT || s == DDP_ERR_REMOTE,
                      "kind %d: rank %d got %s on A without the late rank: %s", kind, rank,
                      ddp_status_string(s), ddp_last_error());
            /* A is gone here before the late rank sends anything on it. */
            ddp_group_destroy(ga);
            CHECK_OK(ddp_group_barrier(coord));
        } else {
            CHECK_OK(ddp_group_barrier(coord));
            s = run_kind(ga, kind, 1, a_a, b_a);
            CHECK_MSG(s != DDP_OK, "kind %d: the late rank got DDP_OK on A", kind);
            ddp_group_destroy(ga);
        }
        /* B: the same calls in the same order (barrier, then the collective at seq 2 as on A),
         * with B's data, a few times: any message of A that B took shows as a wrong value, a
         * mismatch or a timeout. */
        ddp_group_t *gb = split(coord, all, world, LONG_MS);
        CHECK_OK(ddp_group_barrier(gb));
        for (int rep = 0; rep < 3; rep++) {
            s = run_kind(gb, kind, 2, a, b);
            CHECK_MSG(s == DDP_OK, "kind %d: B after a failed A, round %d: %s: %s", kind, rep,
                      ddp_status_string(s), ddp_last_error());
        }
        ddp_group_destroy(gb);
    }

    /* A fails by a mismatch on every rank (each sends abort notices on A), then B. */
    for (int kind = 0; kind < 2; kind++) {
        ddp_group_t *ga = split(coord, all, world, LONG_MS);
        size_t n = kind == 0 ? 2 : N;
        for (size_t k = 0; k < n + 1; k++) a[k] = value(1, rank, k);
        ddp_status_t s = ddp_group_allreduce(ga, a, b, rank == last ? n + 1 : n, DDP_F32, DDP_SUM);
        CHECK_MSG(s == DDP_ERR_MISMATCH, "mismatch %d: rank %d got %s: %s", kind, rank,
                  ddp_status_string(s), ddp_last_error());
        ddp_group_destroy(ga);
        ddp_group_t *gb = split(coord, all, world, LONG_MS);
        for (int rep = 0; rep < 3; rep++) CHECK_OK(run_kind(gb, kind, 2, a, b));
        ddp_group_destroy(gb);
    }
}

/* Async allreduce of N elements of group tag `tag` into recv; checked by check_sum. */
static void issue_sum(ddp_group_t *g, int tag, size_t n, float *send, float *recv,
                      ddp_work_t **work)
{
    int r = ddp_group_rank(g);
    for (size_t k = 0; k < n; k++) send[k] = value(tag, r, k);
    CHECK_OK(ddp_group_allreduce_async(g, send, recv, n, DDP_F32, DDP_SUM, work));
}

static void check_sum(ddp_group_t *g, int tag, size_t n, const float *recv, ddp_work_t *work)
{
    CHECK_OK(ddp_work_wait(work));
    ddp_work_free(work);
    int w = ddp_group_size(g);
    for (size_t k = 0; k < n; k++) {
        float want = 0;
        for (int q = 0; q < w; q++) want += value(tag, q, k);
        CHECK_MSG(recv[k] == want, "group tag %d: element %zu is %g, want %g", tag, k, recv[k],
                  want);
    }
}

static void interleave(ddp_group_t *coord)
{
    int rank = ddp_group_rank(coord), world = ddp_group_size(coord);
    int all[64], rev[64];
    for (int r = 0; r < world; r++) all[r] = r;
    /* Reversed: every rank with 2 ranks (a reordering of the same processes), ranks 1.. with 3
     * or more (a subset). */
    int nrev = world == 2 ? 2 : world - 1;
    for (int i = 0; i < nrev; i++) rev[i] = world - 1 - i;
    ddp_group_t *gs = split(coord, all, world, LONG_MS);
    ddp_group_t *gt = split(coord, rev, nrev, LONG_MS); /* NULL on a non-member */
    static float send[3][N], recv[3][N];
    for (int round = 0; round < 40; round++) {
        /* Alternately inline (2 floats ride in the fingerprint record) and MPI's allreduce, on
         * all three groups at once: three progress threads in MPI together. */
        size_t n = round % 2 ? N : 2;
        ddp_work_t *wc, *ws, *wt = NULL;
        issue_sum(coord, 10, n, send[0], recv[0], &wc);
        issue_sum(gs, 20, n, send[1], recv[1], &ws);
        if (gt) issue_sum(gt, 30, n, send[2], recv[2], &wt);
        if (gt) check_sum(gt, 30, n, recv[2], wt);
        check_sum(gs, 20, n, recv[1], ws);
        check_sum(coord, 10, n, recv[0], wc);
    }
    /* gs fails by a mismatch while coord and gt have work in flight: only gs may fail. */
    for (int round = 0; round < 2; round++) {
        size_t n = round ? N : 2;
        ddp_work_t *wc, *wt = NULL;
        issue_sum(coord, 11, n, send[0], recv[0], &wc);
        if (gt) issue_sum(gt, 31, n, send[2], recv[2], &wt);
        if (round == 0) {
            ddp_status_t s = ddp_group_allreduce(gs, send[1], recv[1], rank == 0 ? 3 : 2,
                                                 DDP_F32, DDP_SUM);
            CHECK_MSG(s == DDP_ERR_MISMATCH, "rank %d: the mismatch on the split gave %s: %s",
                      rank, ddp_status_string(s), ddp_last_error());
            ddp_group_destroy(gs);
            gs = NULL;
        }
        if (gt) check_sum(gt, 31, n, recv[2], wt);
        check_sum(coord, 11, n, recv[0], wc);
    }
    /* A new split over the same processes, beside the others. */
    gs = split(coord, all, world, LONG_MS);
    for (int round = 0; round < 10; round++) {
        size_t n = round % 2 ? N : 2;
        ddp_work_t *wc, *ws, *wt = NULL;
        issue_sum(coord, 12, n, send[0], recv[0], &wc);
        issue_sum(gs, 22, n, send[1], recv[1], &ws);
        if (gt) issue_sum(gt, 32, n, send[2], recv[2], &wt);
        check_sum(coord, 12, n, recv[0], wc);
        check_sum(gs, 22, n, recv[1], ws);
        if (gt) check_sum(gt, 32, n, recv[2], wt);
    }
    ddp_group_destroy(gs);
    ddp_group_destroy(gt);
}

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "stale") && strcmp(argv[1], "interleave")) ||
        (argc == 3 && strcmp(argv[2], "--allreduce-exchange")) || argc > 3) {
        fprintf(stderr, "usage: mpirun -np N %s stale|interleave [--allreduce-exchange]\n",
                argv[0]);
        return 2;
    }
    /* Groups of any size then exchange fingerprints with one MPI_Iallreduce. */
    if (argc == 3) ddp__mpi_p2p_max_world = 0;
    unsetenv("MASTER_ADDR");
    unsetenv("DDP_TRANSPORT");
    ddp_group_t *coord = world_group();
    int rank = ddp_group_rank(coord), world = ddp_group_size(coord);
    CHECK_MSG(world >= 2 && world <= 64, "needs 2-64 ranks, not %d", world);
    float *a = calloc((size_t)N * 64, sizeof(float)), *b = calloc((size_t)N * 64, sizeof(float));
    CHECK(a && b);
    if (!strcmp(argv[1], "stale")) stale(coord, a, b);
    else interleave(coord);
    CHECK_OK(ddp_group_barrier(coord));
    ddp_group_destroy(coord);
    if (rank == 0) printf("test_mpi_isolation %s: %d ranks passed\n", argv[1], world);
    /* a and b stay allocated: the failed groups' MPI requests may still complete into them
     * until MPI_Finalize (docs/mpi-transport.md, "Limits"). */
    return 0;
}
