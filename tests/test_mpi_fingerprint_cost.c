/* Not a test but a measurement (built next to the MPI tests, run by bench/compare_mpi.sh): what
 * the MPI transport adds to a bare MPI_Iallreduce + MPI_Test loop, and how much of that is the
 * fingerprint exchange. Run: mpirun -np 2 tests/test_mpi_fingerprint_cost [iters]
 *
 * Three ways, interleaved round by round so that the machine's noise hits all alike:
 *   raw    MPI_Iallreduce on a duplicated communicator, polled with MPI_Test
 *   ddp    ddp__transport_mpi.run: fingerprint exchange, then the same MPI_Iallreduce
 *   fp     a barrier through the transport, i.e. the fingerprint exchange alone
 * Each cell is the median over rounds of the mean time per iteration, max over ranks; the
 * minimum over rounds follows (on a shared, loaded machine the least disturbed round). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "harness.h"
#include "transport/mpi/mpi_internal.h"

enum { ROUNDS = 11 };

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double max_over_ranks(double t)
{
    double m = 0;
    MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    if (iters < 1) iters = 1;
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "cost", rank, world, 60000, &t));
    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);

    static const size_t sizes[] = {8, 64, 512, 4096, 32768, 262144, 2097152};
    size_t max_count = sizes[sizeof sizes / sizeof sizes[0] - 1] / 4;
    float *send = malloc(max_count * sizeof *send), *recv = malloc(max_count * sizeof *recv);
    CHECK(send && recv);
    for (size_t i = 0; i < max_count; i++) send[i] = (float)(i % 13);
    uint64_t seq = 0;
    if (rank == 0) {
        printf("# MPI transport cost per allreduce (f32 sum), %d ranks, MPI thread level %d\n",
               world, ddp__mpi_thread_level());
        printf("# %10s %12s %12s %12s %12s %10s   %s\n", "bytes", "raw(us)", "ddp(us)",
               "fp-only(us)", "ddp-raw(us)", "ddp/raw", "min over rounds: raw ddp fp-only");
    }
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t count = sizes[si] / 4;
        int n = sizes[si] >= 262144 ? (iters / 20 > 0 ? iters / 20 : 1) : iters;
        double raw_t[ROUNDS], ddp_t[ROUNDS], fp_t[ROUNDS];
        for (int round = 0; round < ROUNDS; round++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = ddp__now_us();
            for (int k = 0; k < n; k++) {
                MPI_Request req;
                MPI_Iallreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, raw, &req);
                int done = 0;
                while (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
            }
            raw_t[round] = max_over_ranks((ddp__now_us() - t0) / n);

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = ddp__now_us();
            for (int k = 0; k < n; k++) {
                ddp__collective_t c;
                memset(&c, 0, sizeof c);
                c.kind = DDP__ALLREDUCE;
                c.seq = ++seq;
                c.send = send;
                c.recv = recv;
                c.count = count;
                c.dtype = DDP_F32;
                c.op = DDP_SUM;
                c.deadline_ns = ddp__now_ns() + 60000000000LL;
                CHECK_OK(ddp__transport_mpi.run(t, &c));
            }
            ddp_t[round] = max_over_ranks((ddp__now_us() - t0) / n);

            MPI_Barrier(MPI_COMM_WORLD);
            t0 = ddp__now_us();
            for (int k = 0; k < n; k++) {
                ddp__collective_t c;
                memset(&c, 0, sizeof c);
                c.kind = DDP__BARRIER;
                c.seq = ++seq;
                c.deadline_ns = ddp__now_ns() + 60000000000LL;
                CHECK_OK(ddp__transport_mpi.run(t, &c));
            }
            fp_t[round] = max_over_ranks((ddp__now_us() - t0) / n);
        }
        qsort(raw_t, ROUNDS, sizeof(double), cmp_double);
        qsort(ddp_t, ROUNDS, sizeof(double), cmp_double);
        qsort(fp_t, ROUNDS, sizeof(double), cmp_double);
        double r = raw_t[ROUNDS / 2], d = ddp_t[ROUNDS / 2], f = fp_t[ROUNDS / 2];
        if (rank == 0)
            printf("  %10zu %12.2f %12.2f %12.2f %12.2f %10.2f   min: %.2f %.2f %.2f\n", sizes[si],
                   r, d, f, d - r, d / r, raw_t[0], ddp_t[0], fp_t[0]);
    }
    ddp__transport_mpi.destroy(t);
    MPI_Comm_free(&raw);
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
