/* ddp_group_split on a parent that failed: DDP_ERR_ABORTED at once on every rank, quoting the
 * cause, never DDP_OK and never a wait for the whole timeout.
 *   mismatch - the ranks disagree on a collective (DDP_ERR_MISMATCH everywhere), then split.
 *   dead     - the last rank exits right after the group is created; the others split with a
 *              60 s timeout and must fail within 20 s, naming the dead rank.
 * Usage: test_group_split_errors WORLD mismatch|dead   (shm, the transport of one host) */
#include <string.h>
#include <unistd.h>

#include "harness.h"

static const char *mode;

static int split_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.name = "parent";
    o.timeout_ms = 60000;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &o, &g));
    int all[4] = {0, 1, 2, 3};
    ddp_group_t *sub = NULL;
    if (!strcmp(mode, "mismatch")) {
        float buf[16] = {0};
        CHECK_STATUS(ddp_group_allreduce(g, buf, buf, rank == world - 1 ? 11 : 10, DDP_F32,
                                         DDP_SUM),
                     DDP_ERR_MISMATCH);
        CHECK_STATUS(ddp_group_split(g, all, world, NULL, &sub), DDP_ERR_ABORTED);
        CHECK_ERROR_MENTIONS("mismatch");
        CHECK(sub == NULL);
    } else {
        if (rank == world - 1) _exit(0); /* dies without leaving the group */
        double t0 = ddp_time_us();
        CHECK_STATUS(ddp_group_split(g, all, world, NULL, &sub), DDP_ERR_ABORTED);
        double waited_s = (ddp_time_us() - t0) / 1e6;
        char who[32];
        snprintf(who, sizeof who, "rank %d", world - 1);
        CHECK_ERROR_MENTIONS(who);
        /* A bound, not a timing measurement: the old code waited the whole 60 s. */
        CHECK_MSG(waited_s < 20.0, "split took %.1f s to notice the dead rank", waited_s);
        CHECK(sub == NULL);
    }
    ddp_group_destroy(g);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s WORLD mismatch|dead\n", argv[0]);
        return 2;
    }
    mode = argv[2];
    return ddp_test_run_ranks(atoi(argv[1]), 90, split_rank, NULL);
}
