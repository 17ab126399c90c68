/* Legacy mode (fairseq's flat-buffer allreduce after backward) gives the Reducer's result: the
 * same gradients averaged both ways agree, with a small buffer (several flushes, a parameter
 * larger than the buffer reduced alone, mixed dtypes) and with the default buffer; a missing
 * gradient is zero-filled and takes part; set_sync(0) leaves gradients alone.
 *
 * usage: test_legacy WORLD */
#include <math.h>
#include <string.h>

#include "harness.h"

#define NP 6
static const size_t sizes[NP] = {7, 1, 50, 13, 0, 19};
static const ddp_dtype_t dtypes[NP] = {DDP_F32, DDP_F64, DDP_F32, DDP_F64, DDP_F32, DDP_F32};
static const char *names[NP] = {"a", "b", "big", "c", "empty", "d"};

static double get(ddp_dtype_t d, const void *p, size_t i)
{
    return d == DDP_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}
static void put(ddp_dtype_t d, void *p, size_t i, double v)
{
    if (d == DDP_F32) ((float *)p)[i] = (float)v;
    else ((double *)p)[i] = v;
}
static double gval(int rank, size_t i, size_t e, int step)
{
    return 0.37 * (rank + 1) + 0.011 * (double)i - 0.003 * (double)e + step;
}

static int run(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    double data[NP][64], lgrad[NP][64], rgrad[NP][64];
    ddp_param_t lp[NP], rp[NP];
    memset(lp, 0, sizeof lp);
    for (int i = 0; i < NP; i++) {
        lp[i].name = names[i];
        lp[i].data = data[i];
        lp[i].numel = sizes[i];
        lp[i].dtype = dtypes[i];
        lp[i].grad = lgrad[i];
        rp[i] = lp[i];
        rp[i].grad = rgrad[i];
    }
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.user_grads = 1;
    c.find_unused_parameters = 1;
    c.first_bucket_bytes = 64;
    c.bucket_cap_bytes = 128;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, rp, NP, NULL, 0, &c, &r));
    for (int variant = 0; variant < 2; variant++) {
        ddp_legacy_t *l = NULL;
        CHECK_OK(ddp_legacy_create(group, lp, NP, variant == 0 ? 20 : 0, &l));
        for (int step = 0; step < 2; step++) {
            /* Rank 0 has no gradient for "c" in step 0. */
            unsigned char has[NP] = {1, 1, 1, 1, 1, 1};
            if (rank == 0 && step == 0) has[3] = 0;
            for (int i = 0; i < NP; i++)
                for (size_t e = 0; e < sizes[i]; e++) {
                    double v = has[i] ? gval(rank, (size_t)i, e, step) : 12345.0; /* stale */
                    put(dtypes[i], lgrad[i], e, v);
                    put(dtypes[i], rgrad[i], e, has[i] ? v : 0.0);
                }
            CHECK_OK(ddp_legacy_allreduce(l, has));
            CHECK_OK(ddp_reducer_prepare(r));
            for (int i = NP; i-- > 0;)
                if (has[i]) CHECK_OK(ddp_reducer_grad_ready(r, (size_t)i));
            CHECK_OK(ddp_reducer_finalize(r));
            for (int i = 0; i < NP; i++)
                for (size_t e = 0; e < sizes[i]; e++) {
                    double x = get(dtypes[i], lgrad[i], e), y = get(dtypes[i], rgrad[i], e);
                    double want = 0;
                    for (int q = 0; q < world; q++)
                        want += (q == 0 && step == 0 && i == 3) ? 0 : gval(q, (size_t)i, e, step);
                    want /= world;
                    double tol = dtypes[i] == DDP_F32 ? 1e-6 : 1e-12;
                    CHECK_MSG(fabs(x - y) <= tol * (1 + fabs(y)),
                              "variant %d step %d %s[%zu]: legacy %.17g, reducer %.17g", variant,
                              step, names[i], e, x, y);
                    CHECK(fabs(x - want) <= tol * (1 + fabs(want)));
                }
        }
        /* no_sync: nothing happens. */
        CHECK_OK(ddp_legacy_set_sync(l, 0));
        put(DDP_F32, lgrad[0], 0, 1000.0 + rank);
        CHECK_OK(ddp_legacy_allreduce(l, NULL));
        CHECK(get(DDP_F32, lgrad[0], 0) == 1000.0 + rank);
        CHECK_OK(ddp_legacy_set_sync(l, 1));
        ddp_legacy_destroy(l);
    }
    ddp_reducer_destroy(r);
    ddp_legacy_destroy(NULL);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    int rc = ddp_test_run_group(world, 60, NULL, run, NULL);
    printf("test_legacy world=%d: %s\n", world, rc ? "FAILED" : "ok");
    return rc;
}
