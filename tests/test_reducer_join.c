/* Uneven inputs (config.join, ddp_reducer_join) over real rank processes.
 *
 * Rank r runs a different number of iterations (its "data"), then calls ddp_reducer_join. After
 * every finalize on a rank with data, each gradient must equal the float64 reference: the sum
 * over the ranks that still have data in that iteration divided by their count (not by the
 * world size), and be bitwise identical on those ranks (checksums compared after the join). Each
 * rank applies its averaged gradients to its parameters, so a rank that joined early has a stale
 * model: after the join every rank must hold the last joiner's parameters, bitwise. A second
 * round (an "epoch") with a different split checks that the reducer returns to full averaging.
 *
 *   test_reducer_join CASE WORLD
 *   plain    bucket memory, bucket rebuild after the first iteration (grads in a permuted order)
 *   early    rank 0 and rank 1 (world > 2) have no data at all: they join before the rebuild,
 *            whose arrival order then comes from the lowest rank with data
 *   unused   find_unused_parameters, a parameter some ranks do not use in some iterations
 *   block    DDP_GRAD_MEMORY_BLOCK with pieces (piece_bytes) and grad_ready_rows
 *   fp16     the fp16 compression hook (prescaled by 1 / ranks with data)
 *   nosync   a no_sync micro-step before each synchronised one (accumulation)
 *   error    rank 0 joins at once; a rank with data leaves a parameter unmarked: finalize fails
 *            there, and the joined rank's ddp_reducer_join fails too, naming it
 *   refuse   join without config.join, join inside an iteration, join with comm_hook_averages,
 *            and a sync mismatch between ranks with data: errors naming the problem */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/hooks.h"
#include "harness.h"

#define NP 4
static const size_t numel[NP] = {37, 300, 5, 64};
static const size_t rows[NP] = {0, 20, 0, 8};
#define MAXIT 8

typedef struct {
    const char *name;
    int unused, block, fp16, nosync, early;
} case_t;

static case_t the_case;

/* Iterations rank r has in round `round`: a different count per rank. */
static int iters(int round, int r, int world)
{
    if (round == 0) {
        if (the_case.early && (r == 0 || (world > 2 && r == 1))) return 0;
        return 1 + r;
    }
    return world - r; /* round 1: the other way round, rank 0 last to join */
}

/* The gradient rank q computes for element i of parameter k in iteration t of a round. */
static double grad_value(int round, int q, int t, int k, size_t i)
{
    unsigned long long s = (unsigned long long)((((round * 8 + q) * MAXIT + t) * NP + k) * 1000003 +
                                                (long long)i * 7919 + 17);
    return ddp_test_random(&s);
}

/* find_unused: parameter 2 is used by rank q in iteration t unless (q + t) % 3 == 0. */
static int uses(int q, int t, int k)
{
    return !(the_case.unused && k == 2 && (q + t) % 3 == 0);
}

static unsigned long long checksum(const void *p, size_t bytes, unsigned long long h)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < bytes; i++) h = (h ^ c[i]) * 1099511628211ULL;
    return h;
}

static int run_round(ddp_group_t *group, ddp_reducer_t *red, float **params, int round,
                     long long *sums)
{
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    int mine = iters(round, rank, world);
    double tol = the_case.fp16 ? 2e-3 : 1e-5;
    for (int t = 0; t < mine; t++) {
        for (int micro = the_case.nosync ? 0 : 1; micro < 2; micro++) {
            CHECK_OK(ddp_reducer_set_sync(red, micro == 1));
            CHECK_OK(ddp_reducer_prepare(red));
            static const int order[NP] = {1, 3, 0, 2}; /* not the layout's: the rebuild moves */
            for (int j = 0; j < NP; j++) {
                int k = order[j];
                if (!uses(rank, t, k)) continue;
                float *g = NULL;
                CHECK_OK(ddp_reducer_grad(red, (size_t)k, (void **)&g));
                /* the no_sync micro-step contributes half, the synchronised one the other half */
                for (size_t i = 0; i < numel[k]; i++)
                    g[i] += (float)(grad_value(round, rank, t, k, i) * (the_case.nosync ? 0.5 : 1));
                if (the_case.block && rows[k]) {
                    CHECK_OK(ddp_reducer_grad_ready_rows(red, (size_t)k, rows[k] / 2, rows[k]));
                    CHECK_OK(ddp_reducer_grad_ready_rows(red, (size_t)k, 0, rows[k] / 2));
                } else {
                    CHECK_OK(ddp_reducer_grad_ready(red, (size_t)k));
                }
            }
            CHECK_OK(ddp_reducer_finalize(red));
        }
        int n = 0;
        for (int q = 0; q < world; q++) n += iters(round, q, world) > t;
        unsigned long long h = 1469598103934665603ULL;
        for (int k = 0; k < NP; k++) {
            float *g = NULL;
            CHECK_OK(ddp_reducer_grad(red, (size_t)k, (void **)&g));
            for (size_t i = 0; i < numel[k]; i++) {
                double want = 0;
                for (int q = 0; q < world; q++)
                    if (iters(round, q, world) > t && uses(q, t, k))
                        want += grad_value(round, q, t, k, i) * (the_case.nosync ? 0.5 : 1) *
                                (the_case.nosync ? 2 : 1);
                want /= n;
                CHECK_MSG(fabs(g[i] - want) <= tol * (1 + fabs(want)),
                          "round %d iteration %d rank %d: param %d [%zu] = %.9g, want %.9g (sum "
                          "over %d ranks with data / %d)",
                          round, t, rank, k, i, g[i], want, n, n);
            }
            h = checksum(g, numel[k] * sizeof(float), h);
            for (size_t i = 0; i < numel[k]; i++) params[k][i] -= 0.1f * g[i];
        }
        sums[t] = (long long)(h >> 1);
        CHECK_OK(ddp_reducer_zero_grad(red));
    }
    CHECK_OK(ddp_reducer_join(red));
    int last = 0; /* the round's last iteration: a rank that shadowed it holds its average */
    for (int q = 0; q < world; q++) last = iters(round, q, world) > last ? iters(round, q, world) : last;
    if (mine < last && !the_case.unused) {
        unsigned long long h = 1469598103934665603ULL;
        for (int k = 0; k < NP; k++) {
            float *g = NULL;
            CHECK_OK(ddp_reducer_grad(red, (size_t)k, (void **)&g));
            h = checksum(g, numel[k] * sizeof(float), h);
        }
        sums[last - 1] = (long long)(h >> 1);
    }
    CHECK_OK(ddp_reducer_zero_grad(red));
    /* Every rank with data in iteration t produced the same bits. */
    long long *all = calloc((size_t)world * MAXIT, sizeof *all);
    CHECK(all);
    CHECK_OK(ddp_group_allgather(group, sums, all, MAXIT, DDP_I64));
    for (int t = 0; t < MAXIT; t++) {
        int first = -1;
        for (int q = 0; q < world; q++) {
            int shadowed_last = t == last - 1 && !the_case.unused;
            if (iters(round, q, world) <= t && !shadowed_last) continue;
            if (first < 0) first = q;
            CHECK_MSG(all[q * MAXIT + t] == all[first * MAXIT + t],
                      "round %d iteration %d: rank %d's gradients differ from rank %d's", round,
                      t, q, first);
        }
    }
    free(all);
    /* Every rank holds the last joiner's model. */
    long long h = (long long)(checksum(params[0], numel[0] * 4, 1469598103934665603ULL) >> 1);
    for (int k = 1; k < NP; k++) h = (long long)(checksum(params[k], numel[k] * 4, (unsigned long long)h) >> 1);
    long long *hs = calloc((size_t)world, sizeof *hs);
    CHECK(hs);
    CHECK_OK(ddp_group_allgather(group, &h, hs, 1, DDP_I64));
    for (int q = 1; q < world; q++)
        CHECK_MSG(hs[q] == hs[0], "round %d: after the join rank %d's parameters differ from rank "
                                  "0's", round, q);
    free(hs);
    return 0;
}

static int case_run(ddp_group_t *group, void *arg)
{
    (void)arg;
    float *params[NP];
    ddp_param_t p[NP];
    static const char *names[NP] = {"a.bias", "b.weight", "c.bias", "d.weight"};
    for (int k = 0; k < NP; k++) {
        params[k] = calloc(numel[k], sizeof(float));
        CHECK(params[k]);
        for (size_t i = 0; i < numel[k]; i++) params[k][i] = (float)(k + 1) * 0.01f * (float)i;
        p[k] = (ddp_param_t){.name = names[k], .data = params[k], .numel = numel[k],
                             .dtype = DDP_F32, .rows = rows[k]};
    }
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.join = 1;
    c.bucket_cap_bytes = 600; /* several buckets */
    c.first_bucket_bytes = 200;
    c.find_unused_parameters = the_case.unused;
    ddp_half_hook_state_t *hs = NULL;
    if (the_case.fp16) {
        CHECK_OK(ddp_half_hook_state_create(DDP_F16, &hs));
        c.comm_hook = ddp_hook_fp16;
        c.comm_hook_state = hs;
    }
    if (the_case.block) {
        c.grad_memory = DDP_GRAD_MEMORY_BLOCK;
        c.piece_bytes = 128;
    }
    ddp_reducer_t *red = NULL;
    CHECK_OK(ddp_reducer_create(group, p, NP, NULL, 0, &c, &red));
    size_t nb0 = ddp_reducer_bucket_count(red);
    const size_t *b0 = NULL;
    size_t n0 = 0;
    CHECK_OK(ddp_reducer_bucket_params(red, 0, &b0, &n0));
    size_t first0 = n0 ? b0[0] : 99;
    long long sums[MAXIT];
    for (int round = 0; round < 2; round++) {
        memset(sums, 0, sizeof sums);
        if (run_round(group, red, params, round, sums)) return 1;
    }
    /* The rebuild (no find_unused) happened on every rank alike: the layout after it follows
     * the arrival order {1, 3, 0, 2}, so bucket 0 now starts with parameter 1. In the block mode
     * with pieces the buckets are runs of the block in address order and the arrival order is
     * in the pieces' schedule instead: the first reduction of the last iteration lies in
     * parameter 1's upper rows, marked first (before the rebuild: in parameter 3, whose bucket
     * came first). */
    if (the_case.block) {
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(red, &st));
        size_t bucket = 99, at = 0;
        for (size_t b = 0; b < ddp_reducer_bucket_count(red) && bucket == 99; b++) {
            const size_t *ps = NULL;
            size_t np = 0;
            CHECK_OK(ddp_reducer_bucket_params(red, b, &ps, &np));
            at = 0;
            for (size_t j = 0; j < np && bucket == 99; j++) {
                if (ps[j] == 1) bucket = b;
                else at += numel[ps[j]] * sizeof(float);
            }
        }
        CHECK(st.npieces > 0 && st.reductions);
        const ddp_reduction_stats_t *first = &st.reductions[0];
        size_t upper = at + numel[1] / 2 * sizeof(float), end = at + numel[1] * sizeof(float);
        CHECK_MSG(first->bucket == bucket && first->offset >= upper && first->offset < end,
                  "the first reduction after the rebuild is bucket %zu bytes [%zu, +%zu); "
                  "parameter 1's upper rows, marked first, are bucket %zu bytes [%zu, %zu)",
                  first->bucket, first->offset, first->bytes, bucket, upper, end);
    } else if (!the_case.unused) {
        const size_t *b1 = NULL;
        size_t n1 = 0;
        CHECK_OK(ddp_reducer_bucket_params(red, 0, &b1, &n1));
        CHECK_MSG(n1 > 0 && b1[0] == 1,
                  "bucket 0 starts with parameter %zu after the rebuild (before: %zu of %zu "
                  "buckets), expected 1 (the first to arrive)",
                  n1 ? b1[0] : 99, first0, nb0);
    }
    ddp_reducer_destroy(red);
    ddp_half_hook_state_destroy(hs);
    for (int k = 0; k < NP; k++) free(params[k]);
    return 0;
}

static int case_refuse(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    float w[8] = {0};
    ddp_param_t p = {.name = "w", .data = w, .numel = 8, .dtype = DDP_F32};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    ddp_reducer_t *red = NULL;
    CHECK_OK(ddp_reducer_create(group, &p, 1, NULL, 0, &c, &red));
    CHECK_STATUS(ddp_reducer_join(red), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("config.join");
    ddp_reducer_destroy(red);

    c.join = 1;
    c.comm_hook = ddp_hook_fp16; /* any hook: the refusal is about comm_hook_averages */
    c.comm_hook_averages = 1;
    CHECK(ddp_reducer_create(group, &p, 1, NULL, 0, &c, &red) != DDP_OK);
    CHECK_ERROR_MENTIONS("comm_hook_averages");

    c = (ddp_reducer_config_t)DDP_REDUCER_CONFIG_INIT;
    c.join = rank == world - 1 && world > 1 ? 0 : 1;
    if (world > 1) {
        CHECK(ddp_reducer_create(group, &p, 1, NULL, 0, &c, &red) != DDP_OK);
        CHECK_ERROR_MENTIONS("join");
    }

    c.join = 1;
    CHECK_OK(ddp_reducer_create(group, &p, 1, NULL, 0, &c, &red));
    CHECK_OK(ddp_reducer_prepare(red));
    CHECK_STATUS(ddp_reducer_join(red), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("finalize");
    CHECK_OK(ddp_reducer_grad_ready(red, 0));
    CHECK_OK(ddp_reducer_finalize(red));
    if (world > 1) {
        /* ranks with data disagree on no_sync: every rank (the joined one too) gets the error */
        CHECK_OK(ddp_reducer_set_sync(red, rank != 0));
        if (rank == world - 1 && world > 2) {
            CHECK_STATUS(ddp_reducer_join(red), DDP_ERR_INVALID_USAGE);
        } else {
            CHECK_STATUS(ddp_reducer_prepare(red), DDP_ERR_INVALID_USAGE);
        }
        CHECK_ERROR_MENTIONS("ddp_reducer_set_sync must be the same");
    }
    ddp_reducer_destroy(red);
    return 0;
}

static int case_error(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group);
    float w[8] = {0}, b[3] = {0};
    ddp_param_t p[2] = {{.name = "w", .data = w, .numel = 8, .dtype = DDP_F32},
                        {.name = "forgotten", .data = b, .numel = 3, .dtype = DDP_F32}};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.join = 1;
    ddp_reducer_t *red = NULL;
    CHECK_OK(ddp_reducer_create(group, p, 2, NULL, 0, &c, &red));
    if (rank == 0) {
        CHECK_STATUS(ddp_reducer_join(red), DDP_ERR_INVALID_USAGE);
    } else {
        CHECK_OK(ddp_reducer_prepare(red));
        CHECK_OK(ddp_reducer_grad_ready(red, 0));
        CHECK_STATUS(ddp_reducer_finalize(red), DDP_ERR_INVALID_USAGE);
    }
    CHECK_ERROR_MENTIONS("forgotten");
    ddp_reducer_destroy(red);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_reducer_join CASE WORLD\n");
        return 2;
    }
    static const case_t cases[] = {
        {"plain", 0, 0, 0, 0, 0},  {"early", 0, 0, 0, 0, 1}, {"unused", 1, 0, 0, 0, 0},
        {"block", 0, 1, 0, 0, 0},  {"fp16", 0, 0, 1, 0, 0},  {"nosync", 0, 0, 0, 1, 0},
        {"refuse", 0, 0, 0, 0, 0}, {"error", 0, 0, 0, 0, 0}};
    int world = atoi(argv[2]);
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 20000;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(cases[i].name, argv[1]) != 0) continue;
        the_case = cases[i];
        ddp_test_group_fn fn = !strcmp(argv[1], "refuse") ? case_refuse
                               : !strcmp(argv[1], "error") ? case_error
                                                           : case_run;
        int rc = ddp_test_run_group(world, 80, &options, fn, NULL);
        printf("test_reducer_join %s world=%d: %s\n", argv[1], world, rc ? "FAILED" : "ok");
        return rc;
    }
    fprintf(stderr, "unknown case %s\n", argv[1]);
    return 2;
}
