/* The MPI transport in processes not started by mpirun: the test harness forks two ranks that
 * share a file store, each initialises MPI as a singleton (rank 0 of 1), and asking for a group of
 * two must fail on both with DDP_ERR_INVALID_ARGUMENT naming both views and pointing at mpirun,
 * never hang. Also the plain argument checks of create and run. */
#include <string.h>

#include "harness.h"
#include "transport/mpi/mpi_internal.h"

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    void *state = NULL;
    CHECK_STATUS(ddp__transport_mpi.create(store, "singleton", rank, world, 5000, &state),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("MPI_COMM_WORLD has only 1");
    CHECK_ERROR_MENTIONS("mpirun");
    /* Without a store the same mismatch is named too. */
    CHECK_STATUS(ddp__transport_mpi.create(NULL, "singleton", rank, world, 5000, &state),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("MPI_COMM_WORLD says rank 0 of 1");
    /* A group of one is fine, and works. */
    CHECK_OK(ddp__transport_mpi.create(NULL, "one", 0, 1, 5000, &state));
    double x[3] = {1, 2, 3};
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = DDP__ALLREDUCE;
    c.seq = 1;
    c.send = x;
    c.recv = x;
    c.count = 3;
    c.dtype = DDP_F64;
    c.op = DDP_AVG;
    c.deadline_ns = INT64_MAX;
    CHECK_OK(ddp__transport_mpi.run(state, &c));
    CHECK(x[0] == 1 && x[2] == 3);
    /* Argument checks of run. */
    c.dtype = (ddp_dtype_t)99;
    CHECK_STATUS(ddp__transport_mpi.run(state, &c), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("dtype 99");
    c.dtype = DDP_F64;
    c.kind = DDP__BROADCAST;
    c.root = 1;
    CHECK_STATUS(ddp__transport_mpi.run(state, &c), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("root 1");
    c.kind = DDP__ALLREDUCE;
    c.root = 0;
    c.send = NULL;
    CHECK_STATUS(ddp__transport_mpi.run(state, &c), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("send buffer is NULL");
    CHECK_STATUS(ddp__transport_mpi.run(NULL, &c), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp__transport_mpi.run(state, NULL), DDP_ERR_INVALID_ARGUMENT);
    ddp__transport_mpi.destroy(state);
    ddp__transport_mpi.destroy(NULL);
    return 0;
}

int main(void)
{
    return ddp_test_run_ranks(2, 60, rank_main, NULL);
}
