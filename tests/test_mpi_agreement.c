/* Every rank agrees on every outcome over the MPI transport (started by mpirun, no store), as
 * test_agreement checks for shm and tcp:
 *   late - for each kind and size class, the last rank calls only after every other rank has
 *          timed out (it waits for them in a barrier of the parent group): every rank must fail
 *          (before, the late rank got DDP_OK from the barrier and from an allreduce small
 *          enough to ride in the fingerprint exchange).
 *   stop - a stopper process SIGSTOPs a random rank at a random moment of a loop of mixed
 *          collectives for longer than the timeout: every rank must fail at the same collective.
 * Outcomes are compared through a second group with a long timeout.
 * Usage: mpirun -np N test_mpi_agreement late|stop */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

/* 2 s: with 3 oversubscribed ranks polling MPI on 2 loaded cores, 1 s was seen to pass in a
 * fingerprint exchange that every rank had entered. */
#define TIMEOUT_MS 2000

static ddp_group_t *make_group(int timeout_ms)
{
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = timeout_ms;
    o.transport = "mpi";
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(&o, &g));
    return g;
}

/* Collective i of the loop (the same on every rank): i % 7 the kind, i / 7 the size. */
static ddp_status_t one_collective(ddp_group_t *g, unsigned i, float *a, float *b)
{
    static const size_t counts[] = {2, 1000, 300000};
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t n = counts[(i / 7) % 3];
    for (size_t k = 0; k < n * (size_t)world; k++) a[k] = (float)(rank + 1) + (float)(k % 5);
    ddp_status_t s;
    switch (i % 7) {
    case 0:
    case 1:
    case 2:
        s = ddp_group_allreduce(g, a, b, n, DDP_F32, DDP_SUM);
        if (s == DDP_OK)
            for (size_t k = 0; k < n; k++) {
                float want = (float)(world * (world + 1) / 2) + (float)world * (float)(k % 5);
                CHECK_MSG(b[k] == want, "collective %u: element %zu is %g, want %g", i, k, b[k],
                          want);
            }
        return s;
    case 3: return ddp_group_barrier(g);
    case 4: return ddp_group_broadcast(g, a, n, DDP_F32, 0);
    case 5: return ddp_group_allgather(g, a, b, n, DDP_F32);
    default: return ddp_group_reduce_scatter(g, a, b, n, DDP_F32, DDP_SUM);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2 || (strcmp(argv[1], "late") && strcmp(argv[1], "stop"))) {
        fprintf(stderr, "usage: mpirun -np N %s late|stop\n", argv[0]);
        return 2;
    }
    unsetenv("MASTER_ADDR");
    unsetenv("DDP_TRANSPORT");
    int late_mode = !strcmp(argv[1], "late");
    /* The stopper is forked before MPI starts (in the first group's creation). */
    int orders = -1, stopper = -1;
    const char *rank_text = getenv("OMPI_COMM_WORLD_RANK");
    if (!late_mode && rank_text && atoi(rank_text) == 0) {
        stopper = ddp_test_stopper_start(TIMEOUT_MS * 2, &orders);
        CHECK(stopper > 0);
    }
    ddp_group_t *coord = make_group(120000);
    int rank = ddp_group_rank(coord), world = ddp_group_size(coord);
    float *a = calloc(300000 * 4, sizeof(float)), *b = calloc(300000 * 4, sizeof(float));
    CHECK(a && b);
    unsigned long long seed = 0x5eed0000ULL + (unsigned long long)time(NULL);
    static const unsigned cases[] = {0, 1, 2, 3, 4, 5, 6, 7, 14, 18, 19, 20};
    int rounds = late_mode ? (int)(sizeof cases / sizeof cases[0]) : 4;
    for (int round = 0; round < rounds; round++) {
        CHECK_OK(ddp_group_barrier(coord));
        /* The group under test is split off the long-timeout one: its creation (a collective
         * communicator creation) then waits as long as the parent may, while its collectives
         * time out after TIMEOUT_MS. Created with TIMEOUT_MS itself, creation timed out with 5
         * oversubscribed ranks (two tests at once) on 2 cores. */
        ddp_group_options_t so = DDP_GROUP_OPTIONS_INIT;
        so.timeout_ms = TIMEOUT_MS;
        int members[64];
        for (int r = 0; r < world; r++) members[r] = r;
        ddp_group_t *g = NULL;
        CHECK_OK(ddp_group_split(coord, members, world, &so, &g));
        CHECK_OK(ddp_group_barrier(g));
        unsigned i;
        ddp_status_t s;
        if (late_mode) {
            i = cases[round];
            /* No fixed sleep: the late rank waits in a barrier of the long-timeout parent that
             * the on-time ranks enter only after their collective failed, so it calls only once
             * every other rank has given up, however the machine schedules them. (This needs
             * the groups kept apart: before the transport kept a failed group's communicator,
             * the late rank's record of the previous round's group, parked by Open MPI for its
             * reused context id, completed this round's exchange on the on-time ranks, which
             * returned DDP_OK and the late rank's data while it sat in this barrier.) */
            char text[2048];
            if (rank == world - 1) {
                CHECK_OK(ddp_group_barrier(coord));
                s = one_collective(g, i, a, b);
                snprintf(text, sizeof text, "%s", ddp_last_error());
                CHECK_MSG(s != DDP_OK, "case %u: late rank %d returned DDP_OK although the "
                          "others gave up", i, rank);
            } else {
                s = one_collective(g, i, a, b);
                snprintf(text, sizeof text, "%s", ddp_last_error());
                CHECK_OK(ddp_group_barrier(coord));
                /* The late rank sent nothing on g before this rank gave up: a timeout in the
                 * fingerprint exchange naming it, this rank's own or another on-time rank's
                 * (whose abort notice, quoting it, may arrive first), and nothing else. */
                char want[64];
                snprintf(want, sizeof want, "rank %d (last seen at seq 1)", world - 1);
                CHECK_MSG((s == DDP_ERR_TIMEOUT || s == DDP_ERR_REMOTE) &&
                              strstr(text, "timed out in the fingerprint exchange") &&
                              strstr(text, want),
                          "case %u: on-time rank %d returned %s, not a timeout naming rank %d: "
                          "%s", i, rank, ddp_status_string(s), world - 1, s ? text : "");
            }
            fprintf(stderr, "rank %d case %u: %s: %s\n", rank, i, ddp_status_string(s), text);
        } else {
            int64_t pids[64], me = (int64_t)getpid();
            CHECK_OK(ddp_group_allgather(coord, &me, pids, 1, DDP_I64));
            if (rank == 0) {
                int victim = (int)((ddp_test_random(&seed) + 1.0) * 0.5 * world) % world;
                CHECK(ddp_test_stopper_order(orders, (int)pids[victim],
                                             (int)((ddp_test_random(&seed) + 1.0) * 40.0)) == 0);
            }
            for (i = 0; (s = one_collective(g, i, a, b)) == DDP_OK; i++) {
            }
            /* Every rank must have failed at the same collective. */
            int64_t at = (int64_t)i, all[64];
            char text[400];
            snprintf(text, sizeof text, "%s", ddp_last_error());
            CHECK_OK(ddp_group_allgather(coord, &at, all, 1, DDP_I64));
            /* MPI offers no shared atomic word: a rank stopped while the messages of one step
             * (the fingerprint exchange or the commit round) are partly delivered lets the ranks
             * that got them finish that collective while the others time out in it
             * (docs/mpi-transport.md, "Agreement"). That split, by exactly one collective, is
             * the one this test tolerates; a rank that fails must then have failed in its own
             * collective's exchange or commit, and nothing else may differ. */
            int64_t lo = at, hi = at;
            for (int r = 0; r < world; r++) {
                if (all[r] < lo) lo = all[r];
                if (all[r] > hi) hi = all[r];
            }
            if (hi == lo + 1) {
                if (at == lo)
                    CHECK_MSG(strstr(text, "fingerprint exchange") || strstr(text, "commit round") ||
                                  strstr(text, "gave up on it") || strstr(text, "aborted the group"),
                              "round %d: rank %d failed collective %u, which others finished, "
                              "outside an exchange: %s", round, rank, i, text);
                fprintf(stderr, "rank %d round %d: a torn step: the ranks failed at collectives "
                        "%lld and %lld\n", rank, round, (long long)lo, (long long)hi);
                ddp_group_destroy(g);
                continue;
            }
            for (int r = 0; r < world; r++)
                CHECK_MSG(all[r] == at, "round %d: rank %d failed at collective %u but rank %d at "
                          "%lld; this rank's error: %s", round, rank, i, r, (long long)all[r],
                          text);
            fprintf(stderr, "rank %d round %d: all failed at collective %u: %s\n", rank, round, i,
                    text);
        }
        ddp_group_destroy(g);
    }
    CHECK_OK(ddp_group_barrier(coord));
    ddp_group_destroy(coord);
    if (stopper > 0) {
        close(orders);
        waitpid(stopper, NULL, 0);
    }
    /* a and b stay allocated: MPI cannot cancel a collective, and the requests of the failed
     * ones may still complete into them until MPI_Finalize runs at exit (docs/mpi-transport.md,
     * "Limits"). */
    return 0;
}
