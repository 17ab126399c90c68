/* test_group_coll's checks over the MPI transport: the same rank bodies (data against float64
 * references, send/recv, mismatches and timeouts), run by mpirun's processes over a shared file
 * store with transport "mpi". Usage: mpirun -np N test_mpi_coll <data|p2p|any|errors [CASE]>
 * The error cases run one after the other in one run (CASE picks one): each makes its groups
 * right after the previous case's groups failed, over the same processes, which the transport
 * must keep apart (before it kept a failed group's communicator, the next group timed out in its
 * first exchange, or took the failed one's messages). */
#include <mpi.h>

#define COLL_NO_MAIN
#include "test_group_coll.c"

int main(int argc, char **argv)
{
    int provided = 0;
    CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS);
    CHECK(provided >= MPI_THREAD_MULTIPLE);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    CHECK(argc > 1);
    transport = "mpi";
    char path[600] = "";
    if (rank == 0) {
        const char *dir = ddp_test_tmpdir();
        CHECK(dir);
        snprintf(path, sizeof path, "%s/store", dir);
    }
    CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(path, &store));
    int rc = 0;
    if (!strcmp(argv[1], "data")) rc = data_rank(rank, world, store, NULL);
    else if (!strcmp(argv[1], "p2p")) rc = p2p_rank(rank, world, store, NULL);
    else if (!strcmp(argv[1], "any")) rc = any_rank(rank, world, store, NULL);
    else if (!strcmp(argv[1], "errors")) {
        only_case = argc > 2 ? atoi(argv[2]) : -1;
        rc = world < 2 ? 0 : errors_rank(rank, world, store, NULL);
    }
    else rc = 2;
    ddp_store_destroy(store);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    if (rank == 0 && rc == 0) printf("test_mpi_coll %s: %d ranks passed\n", argv[1], world);
    return rc;
}
