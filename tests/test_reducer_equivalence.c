/* Equivalence: an MLP trained with SGD by N ranks, each on its shard of the global batch and
 * averaging gradients through the Reducer, must match one process computing the whole batch
 * (run inside every rank as the reference): gradients within 1e-6 relative (f32; 1e-12 for f64)
 * at every step, and parameters bitwise identical on every rank after every step (allgathered
 * hashes). Small buckets make several buckets (and a rebuild after the first step).
 *
 * usage: test_reducer_equivalence WORLD f32|f64 small|default */
#include <math.h>
#include <string.h>

#include "harness.h"

#define NLAYERS 3
static const size_t dims[NLAYERS + 1] = {13, 17, 11, 5};
#define BATCH 12 /* divisible by 1, 2, 3 and 4 */
#define STEPS 4
#define NPARAMS (2 * NLAYERS)

typedef struct args {
    ddp_dtype_t dtype;
    int small_buckets;
} args_t;

typedef struct model {
    ddp_dtype_t dtype;
    void *p[NPARAMS]; /* W0 b0 W1 b1 W2 b2, W is out x in */
    size_t n[NPARAMS];
} model_t;

static double get(ddp_dtype_t d, const void *p, size_t i)
{
    return d == DDP_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}
static void put(ddp_dtype_t d, void *p, size_t i, double v)
{
    if (d == DDP_F32) ((float *)p)[i] = (float)v;
    else ((double *)p)[i] = v;
}

static void model_init(model_t *m, ddp_dtype_t dtype, unsigned long long seed)
{
    m->dtype = dtype;
    for (int l = 0; l < NLAYERS; l++) {
        m->n[2 * l] = dims[l + 1] * dims[l];
        m->n[2 * l + 1] = dims[l + 1];
    }
    for (int i = 0; i < NPARAMS; i++) {
        m->p[i] = calloc(m->n[i], ddp_dtype_size(dtype));
        for (size_t e = 0; e < m->n[i]; e++) put(dtype, m->p[i], e, 0.5 * ddp_test_random(&seed));
    }
}

static void model_free(model_t *m)
{
    for (int i = 0; i < NPARAMS; i++) free(m->p[i]);
}

static void sample(size_t s, double *x, double *y)
{
    unsigned long long seed = 1000 + s;
    for (size_t i = 0; i < dims[0]; i++) x[i] = ddp_test_random(&seed);
    for (size_t i = 0; i < dims[NLAYERS]; i++) y[i] = ddp_test_random(&seed);
}

/* Forward + backward of samples [first, first+count) of step `step`; loss is the mean over
 * `count` of 0.5 * |out - y|^2 with tanh hidden layers. Gradients (in double) go to g[i] in the
 * order backward produces them; `ready(i)` is called right after parameter i is complete. */
typedef void (*ready_fn)(void *ctx, int param, const double *grad);

static void backward(const model_t *m, int step, size_t first, size_t count, ready_fn ready,
                     void *ctx)
{
    double act[NLAYERS + 1][32], pre[NLAYERS + 1][32];
    double *g[NPARAMS];
    for (int i = 0; i < NPARAMS; i++) g[i] = calloc(m->n[i], sizeof(double));
    for (size_t s = first; s < first + count; s++) {
        double y[32];
        sample((size_t)step * BATCH + s, act[0], y);
        for (int l = 0; l < NLAYERS; l++) {
            for (size_t o = 0; o < dims[l + 1]; o++) {
                double z = get(m->dtype, m->p[2 * l + 1], o);
                for (size_t i = 0; i < dims[l]; i++)
                    z += get(m->dtype, m->p[2 * l], o * dims[l] + i) * act[l][i];
                pre[l + 1][o] = z;
                act[l + 1][o] = l + 1 < NLAYERS ? tanh(z) : z;
            }
        }
        double delta[32];
        for (size_t o = 0; o < dims[NLAYERS]; o++)
            delta[o] = (act[NLAYERS][o] - y[o]) / (double)count;
        for (int l = NLAYERS - 1; l >= 0; l--) {
            double prev[32] = {0};
            for (size_t o = 0; o < dims[l + 1]; o++) {
                g[2 * l + 1][o] += delta[o];
                for (size_t i = 0; i < dims[l]; i++) {
                    g[2 * l][o * dims[l] + i] += delta[o] * act[l][i];
                    prev[i] += get(m->dtype, m->p[2 * l], o * dims[l] + i) * delta[o];
                }
            }
            if (l > 0)
                for (size_t i = 0; i < dims[l]; i++)
                    delta[i] = prev[i] * (1.0 - tanh(pre[l][i]) * tanh(pre[l][i]));
        }
    }
    /* Report in backward order: last layer first, bias then weight. */
    for (int l = NLAYERS - 1; l >= 0; l--) {
        ready(ctx, 2 * l + 1, g[2 * l + 1]);
        ready(ctx, 2 * l, g[2 * l]);
    }
    for (int i = 0; i < NPARAMS; i++) free(g[i]);
}

typedef struct ddp_ctx {
    ddp_reducer_t *reducer;
    const model_t *m;
} ddp_ctx_t;

static void ddp_ready(void *c, int param, const double *grad)
{
    ddp_ctx_t *ctx = c;
    void *g = NULL;
    CHECK_OK(ddp_reducer_grad(ctx->reducer, (size_t)param, &g));
    for (size_t e = 0; e < ctx->m->n[param]; e++)
        put(ctx->m->dtype, g, e, get(ctx->m->dtype, g, e) + grad[e]);
    CHECK_OK(ddp_reducer_grad_ready(ctx->reducer, (size_t)param));
}

typedef struct ref_ctx {
    const model_t *m;
    void *g[NPARAMS];
} ref_ctx_t;

static void ref_ready(void *c, int param, const double *grad)
{
    ref_ctx_t *ctx = c;
    for (size_t e = 0; e < ctx->m->n[param]; e++) put(ctx->m->dtype, ctx->g[param], e, grad[e]);
}

static uint64_t hash_model(const model_t *m)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < NPARAMS; i++) {
        const unsigned char *b = m->p[i];
        for (size_t k = 0; k < m->n[i] * ddp_dtype_size(m->dtype); k++)
            h = (h ^ b[k]) * 1099511628211ULL;
    }
    return h;
}

static int run(ddp_group_t *group, void *arg)
{
    const args_t *a = arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    double tol = a->dtype == DDP_F32 ? 1e-6 : 1e-12;
    const double lr = 0.1;
    model_t m, ref;
    /* Different initial values on every rank: create must broadcast rank 0's. */
    model_init(&m, a->dtype, 7 + (unsigned long long)rank * 1000);
    model_init(&ref, a->dtype, 7);

    static const char *names[NPARAMS] = {"fc0.weight", "fc0.bias", "fc1.weight",
                                         "fc1.bias",   "fc2.weight", "fc2.bias"};
    ddp_param_t params[NPARAMS];
    memset(params, 0, sizeof params);
    for (int i = 0; i < NPARAMS; i++) {
        params[i].name = names[i];
        params[i].data = m.p[i];
        params[i].numel = m.n[i];
        params[i].dtype = a->dtype;
        params[i].rows = i % 2 == 0 ? dims[i / 2 + 1] : 0;
    }
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    if (a->small_buckets) {
        config.first_bucket_bytes = 100;
        config.bucket_cap_bytes = 600;
    }
    ddp_reducer_t *reducer = NULL;
    CHECK_OK(ddp_reducer_create(group, params, NPARAMS, NULL, 0, &config, &reducer));
    CHECK(hash_model(&m) == hash_model(&ref)); /* rank 0's values everywhere */
    if (a->small_buckets) CHECK(ddp_reducer_bucket_count(reducer) > 2);
    else CHECK(ddp_reducer_bucket_count(reducer) == 1);

    ref_ctx_t rc = {&ref, {0}};
    for (int i = 0; i < NPARAMS; i++) rc.g[i] = calloc(ref.n[i], ddp_dtype_size(a->dtype));
    size_t shard = BATCH / (size_t)world;
    uint64_t *hashes = calloc((size_t)world, sizeof(uint64_t));

    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(ddp_reducer_prepare(reducer));
        ddp_ctx_t dc = {reducer, &m};
        backward(&m, step, (size_t)rank * shard, shard, ddp_ready, &dc);
        CHECK_OK(ddp_reducer_finalize(reducer));
        backward(&ref, step, 0, BATCH, ref_ready, &rc);

        for (int i = 0; i < NPARAMS; i++) {
            void *g = NULL;
            CHECK_OK(ddp_reducer_grad(reducer, (size_t)i, &g));
            double scale = 0;
            for (size_t e = 0; e < m.n[i]; e++) scale = fmax(scale, fabs(get(a->dtype, rc.g[i], e)));
            for (size_t e = 0; e < m.n[i]; e++) {
                double x = get(a->dtype, g, e), want = get(a->dtype, rc.g[i], e);
                CHECK_MSG(fabs(x - want) <= tol * scale + 1e-300,
                          "rank %d step %d %s[%zu]: %.17g vs reference %.17g", rank, step,
                          names[i], e, x, want);
            }
            /* SGD on both models. */
            for (size_t e = 0; e < m.n[i]; e++) {
                put(a->dtype, m.p[i], e, get(a->dtype, m.p[i], e) - lr * get(a->dtype, g, e));
                put(a->dtype, ref.p[i], e,
                    get(a->dtype, ref.p[i], e) - lr * get(a->dtype, rc.g[i], e));
            }
        }
        CHECK_OK(ddp_reducer_zero_grad(reducer));
        uint64_t h = hash_model(&m);
        CHECK_OK(ddp_group_allgather(group, &h, hashes, 1, DDP_I64));
        for (int q = 0; q < world; q++)
            CHECK_MSG(hashes[q] == h, "step %d: parameters of rank %d differ from rank %d's",
                      step, q, rank);
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(reducer, &st));
        CHECK(st.iteration == (uint64_t)step);
        CHECK(st.nbuckets == ddp_reducer_bucket_count(reducer));
    }
    /* The model stayed close to the one-process reference. */
    for (int i = 0; i < NPARAMS; i++)
        for (size_t e = 0; e < m.n[i]; e++)
            CHECK(fabs(get(a->dtype, m.p[i], e) - get(a->dtype, ref.p[i], e)) <= 1e3 * tol);

    free(hashes);
    for (int i = 0; i < NPARAMS; i++) free(rc.g[i]);
    ddp_reducer_destroy(reducer);
    model_free(&m);
    model_free(&ref);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    args_t a = {DDP_F32, 1};
    if (argc > 2 && strcmp(argv[2], "f64") == 0) a.dtype = DDP_F64;
    if (argc > 3 && strcmp(argv[3], "default") == 0) a.small_buckets = 0;
    int rc = ddp_test_run_group(world, 60, NULL, run, &a);
    printf("test_reducer_equivalence world=%d %s %s: %s\n", world, ddp_dtype_name(a.dtype),
           a.small_buckets ? "small" : "default", rc ? "FAILED" : "ok");
    return rc;
}
