/* ddp_group_create_from_env under mpirun with no store: no ddprun, no MASTER_ADDR, and the
 * application never touches MPI. By default the group must be shared memory (self with one
 * process), met through a store rank 0 hosts and MPI announced; tcp asked by name too; and mpi
 * asked by name must be MPI_COMM_WORLD over the MPI transport. Each runs allreduces of 0, 1, 7
 * (prime) and 262147 (odd, large) elements; the mpi group also a barrier and store-less
 * subgroups (member lists compared with a collective), reporting ranks that pass different
 * lists. With --no-launcher (started without mpirun) the torchrun variables alone and no
 * MASTER_ADDR must be refused with a text naming MASTER_ADDR. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static void fill_and_check(ddp_group_t *g, size_t n)
{
    int w = ddp_group_size(g), r = ddp_group_rank(g);
    float *x = malloc((n ? n : 1) * sizeof *x);
    CHECK(x);
    for (size_t i = 0; i < n; i++) x[i] = (float)((r + 1) * (int)(i % 101));
    CHECK_OK(ddp_group_allreduce(g, x, x, n, DDP_F32, DDP_SUM));
    float ranks_sum = (float)w * (float)(w + 1) / 2.0f;
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(x[i] == ranks_sum * (float)(i % 101), "n %zu element %zu: %g", n, i, x[i]);
    /* Integers with the group rank: MAX must be the last rank. */
    int64_t v = r;
    CHECK_OK(ddp_group_allreduce(g, &v, &v, 1, DDP_I64, DDP_MAX));
    CHECK(v == w - 1);
    free(x);
}

static int under_mpirun(void)
{
    /* Nothing of torchrun's may be around: the environment must come from mpirun alone. */
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    unsetenv("DDP_STORE_ADDR");
    unsetenv("DDP_STORE_PORT");
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("LOCAL_RANK");
    unsetenv("LOCAL_WORLD_SIZE");
    unsetenv("DDP_TRANSPORT");
    const char *rank_text = getenv("OMPI_COMM_WORLD_RANK");
    const char *size_text = getenv("OMPI_COMM_WORLD_SIZE");
    CHECK_MSG(rank_text && size_text, "run this under Open MPI's mpirun");
    int rank = atoi(rank_text), world = atoi(size_text);

    static const size_t sizes[] = {0, 1, 7, 262147};
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = 60000;
    ddp_group_t *g = NULL;
    /* auto: the ranks meet at a store rank 0 hosts, whose address MPI carried (the bootstrap op
     * of the MPI module), and share memory on this one host, as under ddprun. */
    CHECK_OK(ddp_group_create_from_env(&o, &g));
    CHECK(ddp_group_rank(g) == rank && ddp_group_size(g) == world);
    CHECK_MSG(strcmp(ddp_group_transport(g), world == 1 ? "self" : "shm") == 0, "transport %s",
              ddp_group_transport(g));
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) fill_and_check(g, sizes[k]);
    ddp_group_destroy(g);
    /* A transport that needs a store, by name: the same rendezvous gives it one. */
    if (world > 1) {
        o.transport = "tcp";
        CHECK_OK(ddp_group_create_from_env(&o, &g));
        CHECK_MSG(strcmp(ddp_group_transport(g), "tcp") == 0, "transport %s",
                  ddp_group_transport(g));
        fill_and_check(g, 7);
        ddp_group_destroy(g);
    }

    /* mpi, by name: MPI_COMM_WORLD itself, store-less. */
    o.transport = "mpi";
    CHECK_OK(ddp_group_create_from_env(&o, &g));
    CHECK(ddp_group_rank(g) == rank && ddp_group_size(g) == world);
    CHECK_MSG(strcmp(ddp_group_transport(g), world == 1 ? "self" : "mpi") == 0, "transport %s",
              ddp_group_transport(g));
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) fill_and_check(g, sizes[k]);
    CHECK_OK(ddp_group_barrier(g));

    if (world > 1) {
        /* Every rank in reverse order: a store-less subgroup over MPI whose rank i is parent
         * rank world-1-i. */
        int rev[64];
        CHECK(world <= 64);
        for (int i = 0; i < world; i++) rev[i] = world - 1 - i;
        ddp_group_t *sub = NULL;
        CHECK_OK(ddp_group_split(g, rev, world, NULL, &sub));
        CHECK(sub != NULL);
        CHECK(strcmp(ddp_group_transport(sub), "mpi") == 0);
        CHECK(ddp_group_rank(sub) == world - 1 - rank && ddp_group_size(sub) == world);
        fill_and_check(sub, 7);
        CHECK_OK(ddp_group_barrier(sub));

        /* All but rank 0, reversed: rank 0 gets NULL; one member is a group of one (self). */
        ddp_group_t *rest = NULL;
        CHECK_OK(ddp_group_split(g, rev, world - 1, NULL, &rest));
        if (rank == 0) {
            CHECK(rest == NULL);
        } else {
            CHECK(rest != NULL);
            CHECK(ddp_group_rank(rest) == world - 1 - rank && ddp_group_size(rest) == world - 1);
            CHECK(strcmp(ddp_group_transport(rest), world - 1 == 1 ? "self" : "mpi") == 0);
            fill_and_check(rest, 262147);
            CHECK_OK(ddp_group_barrier(rest));
        }

        /* Rank 0 passes another list: every rank is told, and nothing hangs. */
        int one = rank == 0 ? 0 : world - 1;
        ddp_group_t *bad = NULL;
        CHECK_STATUS(ddp_group_split(g, &one, 1, NULL, &bad), DDP_ERR_MISMATCH);
        CHECK_ERROR_MENTIONS("disagree on the members");
        CHECK(bad == NULL);
        /* The parent still works after the refused split. */
        fill_and_check(g, 1);
        ddp_group_destroy(rest);
        ddp_group_destroy(sub);
    }
    CHECK_OK(ddp_group_barrier(g));
    ddp_group_destroy(g);
    return 0;
}

static int no_launcher(void)
{
    static const char *const vars[] = {
        "MASTER_ADDR", "MASTER_PORT", "DDP_STORE_ADDR", "DDP_STORE_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "DDP_TRANSPORT"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    ddp_group_t *g = NULL;
    /* No launcher at all. */
    CHECK(ddp_group_create_from_env(NULL, &g) != DDP_OK);
    CHECK(g == NULL);
    /* torchrun's rank variables without MASTER_ADDR: the text names MASTER_ADDR. */
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "3", 1);
    CHECK_STATUS(ddp_group_create_from_env(NULL, &g), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("MASTER_ADDR");
    CHECK(g == NULL);
    /* One rank needs no store: self. */
    setenv("WORLD_SIZE", "1", 1);
    CHECK_OK(ddp_group_create_from_env(NULL, &g));
    CHECK(strcmp(ddp_group_transport(g), "self") == 0);
    fill_and_check(g, 7);
    ddp_group_destroy(g);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--no-launcher") == 0) return no_launcher();
    return under_mpirun();
}
