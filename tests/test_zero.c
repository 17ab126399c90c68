/* ZeRO against plain data-parallel training: every rank trains two copies of one MLP on its share
 * of each global batch, one with the Reducer and the plain optimizer (the reference), one with the
 * ZeRO optimizer (stage 1 after the Reducer, stage 1 with the overlap hook, or stage 2 from local
 * gradients). After every step: stage 1 and overlap match the reference bitwise (same averaged
 * gradients, same update kernel), stage 2 within rounding (its average is a reduce-scatter with
 * DDP_AVG, not a prescaled allreduce); the ZeRO parameters are bitwise identical on every rank;
 * each rank's optimizer state is exactly that of its partition and the states add up to the plain
 * optimizer's.
 *
 * stage2ready hands each gradient to ddp_zero_grad_ready during backward (reduce-scatters
 * overlap backward) instead of passing them all to the step. stage1chunks is stage 1 with
 * DDP_ZERO_PARTITION_CHUNKS: stage 2's chunked layout and allgathers, from the Reducer's averaged
 * gradients, bitwise equal to the reference like stage 1.
 *
 * stage2fused (and stage2fusedready, marking gradients during backward) is stage 2 with
 * config.fused: each parameter in one reduce_scatter_apply at the step, within rounding of the
 * reference like stage 2.
 *
 * usage: test_zero args | stage1|stage1chunks|stage2|stage2ready|stage2fused|stage2fusedready|
 *        overlap sgd|nesterov|adam WORLD f32|f64 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "harness.h"

#define NLAYERS 3
static const size_t dims[NLAYERS + 1] = {13, 17, 11, 3}; /* biases of 17, 11 and 3 (< 4) */
#define NPARAMS (2 * NLAYERS)
#define BATCH 12 /* divisible by 1, 2, 3 and 4 */
#define STEPS 5
#define MAXW 32

typedef struct test_case {
    const char *mode;
    ddp_optim_config_t optim;
    ddp_dtype_t dtype;
} test_case_t;

static double get(ddp_dtype_t d, const void *p, size_t i)
{
    return d == DDP_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}
static void put(ddp_dtype_t d, void *p, size_t i, double v)
{
    if (d == DDP_F32)
        ((float *)p)[i] = (float)v;
    else
        ((double *)p)[i] = v;
}

static size_t numel_of(int i)
{
    int l = i / 2;
    return i % 2 ? dims[l + 1] : dims[l + 1] * dims[l];
}

static void sample(size_t s, double *x, double *y)
{
    unsigned long long seed = 7000 + s;
    for (size_t i = 0; i < dims[0]; i++) x[i] = ddp_test_random(&seed);
    for (size_t i = 0; i < dims[NLAYERS]; i++) y[i] = ddp_test_random(&seed);
}

typedef void (*ready_fn)(void *ctx, int param);

/* Overlap mode: pause after marking a layer ready so the hook's update surely runs before the
 * layer's weights are read again (no timing is asserted; this only widens the window). */
static int pause_after_ready;

/* Mean loss 0.5 |out - y|^2 over `count` samples starting at global sample `first` of `step`,
 * tanh hidden layers. Writes gradient i into grads[i] (params' dtype) and calls ready(ctx, i) as
 * soon as it is complete, BEFORE the layer's weights are read for its input gradient (the
 * trainer's order): the overlap hook's update must not change parameters backward still reads. */
static void backward(void *const *params, ddp_dtype_t dt, int step, size_t first, size_t count,
                     void *const *grads, ready_fn ready, void *ctx)
{
    double act[NLAYERS + 1][BATCH][MAXW];
    double delta[BATCH][MAXW], prev[BATCH][MAXW];
    double y[BATCH][MAXW];
    for (size_t s = 0; s < count; s++) sample((size_t)step * BATCH + first + s, act[0][s], y[s]);
    for (int l = 0; l < NLAYERS; l++) {
        const void *W = params[2 * l], *b = params[2 * l + 1];
        for (size_t s = 0; s < count; s++)
            for (size_t o = 0; o < dims[l + 1]; o++) {
                double z = get(dt, b, o);
                for (size_t i = 0; i < dims[l]; i++)
                    z += get(dt, W, o * dims[l] + i) * act[l][s][i];
                act[l + 1][s][o] = l + 1 < NLAYERS ? tanh(z) : z;
            }
    }
    for (size_t s = 0; s < count; s++)
        for (size_t o = 0; o < dims[NLAYERS]; o++)
            delta[s][o] = (act[NLAYERS][s][o] - y[s][o]) / (double)count;
    for (int l = NLAYERS - 1; l >= 0; l--) {
        const void *W = params[2 * l];
        for (size_t o = 0; o < dims[l + 1]; o++) {
            double gb = 0.0;
            for (size_t s = 0; s < count; s++) gb += delta[s][o];
            put(dt, grads[2 * l + 1], o, gb);
            for (size_t i = 0; i < dims[l]; i++) {
                double gw = 0.0;
                for (size_t s = 0; s < count; s++) gw += delta[s][o] * act[l][s][i];
                put(dt, grads[2 * l], o * dims[l] + i, gw);
            }
        }
        if (ready) {
            ready(ctx, 2 * l + 1);
            ready(ctx, 2 * l);
            if (pause_after_ready) nanosleep(&(struct timespec){0, 3000000}, NULL);
        }
        if (l > 0) {
            for (size_t s = 0; s < count; s++)
                for (size_t i = 0; i < dims[l]; i++) {
                    double d = 0.0;
                    for (size_t o = 0; o < dims[l + 1]; o++)
                        d += get(dt, W, o * dims[l] + i) * delta[s][o];
                    prev[s][i] = d * (1.0 - act[l][s][i] * act[l][s][i]);
                }
            memcpy(delta, prev, sizeof delta);
        }
    }
}

static void mark_ready(void *ctx, int param)
{
    CHECK_OK(ddp_reducer_grad_ready((ddp_reducer_t *)ctx, (size_t)param));
}

typedef struct zero_ready {
    ddp_zero_t *zero;
    void **grads;
} zero_ready_t;

static void mark_zero_ready(void *ctx, int param)
{
    zero_ready_t *z = ctx;
    CHECK_OK(ddp_zero_grad_ready(z->zero, (size_t)param, z->grads[param]));
}

/* Gradient pointers of a reducer after prepare. */
static void reducer_grads(ddp_reducer_t *r, void **g)
{
    for (int i = 0; i < NPARAMS; i++) CHECK_OK(ddp_reducer_grad(r, (size_t)i, &g[i]));
}

static uint64_t hash_params(void *const *p, ddp_dtype_t dt)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < NPARAMS; i++) {
        const unsigned char *b = p[i];
        for (size_t k = 0; k < numel_of(i) * ddp_dtype_size(dt); k++) {
            h ^= b[k];
            h *= 1099511628211ull;
        }
    }
    return h;
}

static int states_per_element(const ddp_optim_config_t *c)
{
    return c->kind == DDP_OPTIM_ADAM ? 2 : (c->momentum > 0 ? 1 : 0);
}

static ddp_reducer_config_t reducer_config(void)
{
    ddp_reducer_config_t rc = DDP_REDUCER_CONFIG_INIT;
    rc.bucket_cap_bytes = 256; /* several buckets, some of one parameter, some of several */
    rc.first_bucket_bytes = 128;
    rc.rebuild_buckets = 0;
    return rc;
}

static void check_state(ddp_group_t *g, ddp_zero_t *zero, ddp_optim_t *plain,
                        const test_case_t *tc, int stage)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(tc->dtype);
    size_t k = (size_t)states_per_element(&tc->optim);
    size_t owned = 0, bound = 0, max_numel = 0;
    for (int i = 0; i < NPARAMS; i++) {
        size_t n = numel_of(i);
        if (n > max_numel) max_numel = n;
        int owner = -2;
        CHECK_OK(ddp_zero_param_owner(zero, (size_t)i, &owner));
        if (stage == 2) {
            CHECK(owner == -1);
            size_t c = (n + (size_t)world - 1) / (size_t)world, lo = (size_t)rank * c;
            owned += lo < n ? (n - lo < c ? n - lo : c) : 0;
            bound += c;
        } else {
            CHECK_MSG(owner >= 0 && owner < world, "parameter %d has owner %d", i, owner);
            if (owner == rank) owned += n;
        }
    }
    CHECK_MSG(ddp_zero_owned_numel(zero) == owned, "owned %zu, expected %zu",
              ddp_zero_owned_numel(zero), owned);
    int64_t mine = (int64_t)ddp_zero_state_bytes(zero), all[8];
    CHECK_MSG((size_t)mine == k * es * owned, "rank %d holds %lld bytes of state for %zu owned "
              "elements (expected %zu)", rank, (long long)mine, owned, k * es * owned);
    CHECK_OK(ddp_group_allgather(g, &mine, all, 1, DDP_I64));
    int64_t sum = 0, owned_all = 0;
    for (int r = 0; r < world; r++) sum += all[r];
    CHECK_MSG((size_t)sum == ddp_optim_state_bytes(plain), "ZeRO state over ranks %lld bytes, "
              "plain optimizer %zu", (long long)sum, ddp_optim_state_bytes(plain));
    int64_t o = (int64_t)owned, os[8];
    CHECK_OK(ddp_group_allgather(g, &o, os, 1, DDP_I64));
    for (int r = 0; r < world; r++) owned_all += os[r];
    size_t total = 0;
    for (int i = 0; i < NPARAMS; i++) total += numel_of(i);
    CHECK((size_t)owned_all == total); /* the partition covers every element exactly once */
    /* Balanced: stage 2 to the padded chunk, stage 1 to one parameter's worth. */
    if (stage == 2)
        CHECK(owned <= bound);
    else
        CHECK_MSG(owned <= total / (size_t)world + max_numel, "rank %d owns %zu of %zu elements",
                  rank, owned, total);
}

static int rank_main(ddp_group_t *g, void *arg)
{
    const test_case_t *tc = arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    ddp_dtype_t dt = tc->dtype;
    size_t es = ddp_dtype_size(dt);
    int overlap = strcmp(tc->mode, "overlap") == 0;
    int ready_mode = strcmp(tc->mode, "stage2ready") == 0 ||
                     strcmp(tc->mode, "stage2fusedready") == 0;
    int chunks = strcmp(tc->mode, "stage1chunks") == 0;
    int fused = strncmp(tc->mode, "stage2fused", 11) == 0;
    int stage = strcmp(tc->mode, "stage2") == 0 || ready_mode || fused ? 2 : 1;
    int layout = chunks ? 2 : stage; /* what check_state expects: stage 2's chunks or whole */
    pause_after_ready = overlap;
    size_t local = BATCH / (size_t)world;

    void *pa[NPARAMS], *pb[NPARAMS], *local_grads[NPARAMS];
    ddp_param_t params_a[NPARAMS], params_b[NPARAMS];
    static const char *names[NPARAMS] = {"W0", "b0", "W1", "b1", "W2", "b2"};
    unsigned long long seed = 42; /* same on every rank (the Reducer broadcasts anyway) */
    for (int i = 0; i < NPARAMS; i++) {
        size_t n = numel_of(i);
        pa[i] = calloc(n, es);
        pb[i] = calloc(n, es);
        local_grads[i] = calloc(n, es);
        for (size_t e = 0; e < n; e++) put(dt, pa[i], e, 0.5 * ddp_test_random(&seed));
        memcpy(pb[i], pa[i], n * es);
        params_a[i] = (ddp_param_t){names[i], pa[i], n, dt, i % 2 ? 0 : dims[i / 2 + 1], 0, NULL};
        params_b[i] = params_a[i];
        params_b[i].data = pb[i];
    }

    /* Reference: Reducer + plain optimizer. */
    ddp_reducer_config_t rc = reducer_config();
    ddp_reducer_t *rb = NULL;
    CHECK_OK(ddp_reducer_create(g, params_b, NPARAMS, NULL, 0, &rc, &rb));
    ddp_optim_t *plain = NULL;
    CHECK_OK(ddp_optim_create(params_b, NPARAMS, &tc->optim, &plain));

    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    zc.stage = stage;
    zc.optim = tc->optim;
    zc.overlap = overlap;
    zc.fused = fused;
    zc.partition = chunks ? DDP_ZERO_PARTITION_CHUNKS : DDP_ZERO_PARTITION_PARAMS;
    zc.bucket_cap_bytes = 96 * es * (size_t)world; /* 96-element blocks: W0, W1 go direct */
    ddp_zero_t *zero = NULL;
    CHECK_OK(ddp_zero_create(g, params_a, NPARAMS, &zc, &zero));
    ddp_reducer_t *ra = NULL;
    if (stage == 1) {
        ddp_reducer_config_t rca = reducer_config();
        if (overlap) {
            rca.comm_hook = ddp_zero_hook;
            rca.comm_hook_state = zero;
            /* Averaging in the hook (DDP_AVG, as the default path does) rather than summing
             * prescaled buckets is what makes overlap bitwise equal to plain training on 3 ranks. */
            rca.comm_hook_averages = 1;
        }
        CHECK_OK(ddp_reducer_create(g, params_a, NPARAMS, NULL, 0, &rca, &ra));
        if (overlap) CHECK(ddp_reducer_bucket_count(ra) >= 3);
    }
    if (!overlap) check_state(g, zero, plain, tc, layout);

    uint64_t initial = hash_params(pa, dt);
    for (int step = 0; step < STEPS; step++) {
        size_t first = (size_t)rank * local;
        void *gb[NPARAMS], *ga[NPARAMS];
        CHECK_OK(ddp_reducer_prepare(rb));
        reducer_grads(rb, gb);
        backward(pb, dt, step, first, local, gb, mark_ready, rb);
        CHECK_OK(ddp_reducer_finalize(rb));
        CHECK_OK(ddp_optim_step(plain, gb));
        CHECK_OK(ddp_reducer_zero_grad(rb));

        if (ready_mode) {
            /* Reduce-scatters start during backward; the step gets no gradients. */
            zero_ready_t zr = {zero, local_grads};
            backward(pa, dt, step, first, local, local_grads, mark_zero_ready, &zr);
            CHECK_STATUS(ddp_zero_grad_ready(zero, 0, local_grads[0]), DDP_ERR_INVALID_USAGE);
            CHECK_ERROR_MENTIONS("already");
            CHECK_OK(ddp_zero_step(zero, NULL));
        } else if (stage == 2) {
            backward(pa, dt, step, first, local, local_grads, NULL, NULL);
            CHECK_OK(ddp_zero_step(zero, local_grads));
        } else {
            CHECK_OK(ddp_reducer_prepare(ra));
            reducer_grads(ra, ga);
            backward(pa, dt, step, first, local, ga, mark_ready, ra);
            CHECK_OK(ddp_reducer_finalize(ra));
            CHECK_OK(ddp_zero_step(zero, overlap ? NULL : ga));
            CHECK_OK(ddp_reducer_zero_grad(ra));
            if (overlap) {
                /* A second step without a reduced iteration would install stale updates. */
                CHECK_STATUS(ddp_zero_step(zero, NULL), DDP_ERR_INVALID_USAGE);
                CHECK_ERROR_MENTIONS("not reduced");
            }
        }

        /* Against the reference. */
        double tol = dt == DDP_F32 ? 2e-5 : 1e-11;
        for (int i = 0; i < NPARAMS; i++) {
            if (stage == 1) {
                CHECK_MSG(memcmp(pa[i], pb[i], numel_of(i) * es) == 0,
                          "step %d: parameter %s differs from plain data-parallel training", step,
                          names[i]);
                continue;
            }
            for (size_t e = 0; e < numel_of(i); e++) {
                double a = get(dt, pa[i], e), b = get(dt, pb[i], e);
                CHECK_MSG(fabs(a - b) <= tol * (1.0 + fabs(b)),
                          "step %d: %s[%zu] = %.17g with ZeRO, %.17g plain", step, names[i], e, a,
                          b);
            }
        }
        /* Replicas bitwise identical. */
        int64_t h = (int64_t)hash_params(pa, dt), hs[8];
        CHECK_OK(ddp_group_allgather(g, &h, hs, 1, DDP_I64));
        for (int r = 0; r < world; r++)
            CHECK_MSG(hs[r] == hs[0], "step %d: rank %d's parameters differ from rank 0's", step,
                      r);
    }
    CHECK(hash_params(pa, dt) != initial); /* the steps did update the parameters */
    check_state(g, zero, plain, tc, layout);

    ddp_reducer_destroy(ra);
    ddp_reducer_destroy(rb);
    ddp_zero_destroy(zero);
    ddp_optim_destroy(plain);
    for (int i = 0; i < NPARAMS; i++) {
        free(pa[i]);
        free(pb[i]);
        free(local_grads[i]);
    }
    return 0;
}

/* Argument checks (one rank). */
static int args_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    float w[4] = {1, 2, 3, 4};
    int32_t h[2] = {0, 0}; /* integers: refused (f16/bf16 are accepted, with master copies) */
    ddp_param_t p[2] = {{"w", w, 4, DDP_F32, 0, 0, NULL}, {"h", h, 2, DDP_I32, 0, 0, NULL}};
    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    ddp_zero_t *z = NULL;
    ddp_optim_t *o = NULL;

    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
    CHECK_STATUS(ddp_zero_create(NULL, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(ddp_zero_create(g, p, 1, NULL, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("config");
    zc.stage = 3;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("stage");
    zc.stage = 2;
    zc.overlap = 1;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("overlap");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    zc.fused = 1; /* stage 1 */
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("fused");
    zc.stage = 2;
    zc.optim.max_grad_norm = 1.0;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("max_grad_norm");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    zc.partition = (ddp_zero_partition_t)2;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("partition");
    zc.partition = DDP_ZERO_PARTITION_CHUNKS;
    zc.overlap = 1;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("PARTITION_CHUNKS");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    zc.optim.lr = -1;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("lr");
    zc.optim.lr = 0.1;
    zc.optim.nesterov = 1;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("nesterov");
    zc.optim.nesterov = 0;
    zc.optim.kind = DDP_OPTIM_ADAM;
    zc.optim.beta2 = 1.0;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("beta2");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    zc.overlap = 1;
    zc.optim.max_grad_norm = 1.0; /* no global norm before the first bucket's update */
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("max_grad_norm");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    uint32_t which[1] = {1};
    ddp_optim_group_t groups[1] = {{0.1, 0.0}};
    zc.optim.ngroups = 1;
    zc.optim.groups = groups;
    zc.optim.param_groups = which;
    CHECK_STATUS(ddp_zero_create(g, p, 1, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("param_groups[0]");
    zc = (ddp_zero_config_t)DDP_ZERO_CONFIG_INIT;
    CHECK_STATUS(ddp_zero_create(g, p, 2, &zc, &z), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("h");
    CHECK_STATUS(ddp_zero_create(g, NULL, 2, &zc, &z), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("params");
    CHECK_STATUS(ddp_optim_create(p, 2, &zc.optim, &o), DDP_ERR_UNSUPPORTED);
    CHECK_STATUS(ddp_optim_create(p, 1, NULL, &o), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_optim_create(p, 1, &zc.optim, NULL), DDP_ERR_INVALID_ARGUMENT);

    /* Learning rates, norms and schedules: bad arguments named; schedules at their corners. */
    CHECK_OK(ddp_optim_create(p, 1, &zc.optim, &o));
    CHECK_STATUS(ddp_optim_set_lr(NULL, 0, 0.1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("optim");
    CHECK_STATUS(ddp_optim_set_lr(o, 1, 0.1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group 1");
    CHECK_STATUS(ddp_optim_set_lr(o, DDP_OPTIM_ALL_GROUPS, -1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("lr");
    CHECK_STATUS(ddp_optim_scale_lr(o, NAN), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("factor");
    double lr = 0, norm = 0;
    CHECK_STATUS(ddp_optim_get_lr(o, 0, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_optim_scale_lr(o, 0.5));
    CHECK_OK(ddp_optim_get_lr(o, 0, &lr));
    CHECK(lr == zc.optim.lr * 0.5);
    CHECK_STATUS(ddp_optim_grad_norm(o, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_optim_grad_norm(o, &norm));
    CHECK(isnan(norm)); /* no clipping step yet */
    size_t bytes = 0;
    CHECK_STATUS(ddp_optim_state_size(o, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_optim_state_size(o, &bytes));
    CHECK_STATUS(ddp_optim_state_save(o, NULL, bytes), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("buf");
    ddp_optim_destroy(o);
    o = NULL;
    CHECK(ddp_lr_warmup_constant(0, 4, 2.0) == 0.0);
    CHECK(ddp_lr_warmup_constant(2, 4, 2.0) == 1.0);
    CHECK(ddp_lr_warmup_constant(4, 4, 2.0) == 2.0);
    CHECK(ddp_lr_warmup_cosine(4, 4, 14, 2.0, 0.0) == 2.0);
    CHECK(fabs(ddp_lr_warmup_cosine(9, 4, 14, 2.0, 0.0) - 1.0) < 1e-15);
    CHECK(fabs(ddp_lr_warmup_cosine(14, 4, 14, 2.0, 0.0)) < 1e-15);
    CHECK(ddp_lr_warmup_cosine(20, 4, 14, 2.0, 0.0) >= 0.0);
    CHECK(fabs(ddp_lr_warmup_cosine(14, 4, 14, 2.0, 0.2) - 0.2) < 1e-15);
    CHECK(ddp_lr_warmup_linear(4, 4, 14, 2.0) == 2.0);
    CHECK(ddp_lr_warmup_linear(9, 4, 14, 2.0) == 1.0);
    CHECK(ddp_lr_warmup_linear(14, 4, 14, 2.0) == 0.0);
    CHECK(ddp_lr_warmup_linear(30, 4, 14, 2.0) == 0.0);

    /* Stage 1 with one parameter: plain SGD arithmetic, checked by hand. */
    zc.optim.lr = 0.5;
    CHECK_OK(ddp_zero_create(g, p, 1, &zc, &z));
    CHECK_STATUS(ddp_zero_step(z, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("grads");
    void *nullg[1] = {NULL};
    CHECK_STATUS(ddp_zero_step(z, nullg), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("grads[0]");
    float gr[4] = {2, 2, 2, 2};
    void *gp[1] = {gr};
    CHECK_OK(ddp_zero_step(z, gp));
    CHECK(w[0] == 0.0f && w[3] == 3.0f);
    int owner = 7;
    CHECK_STATUS(ddp_zero_param_owner(z, 1, &owner), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("index");
    CHECK_OK(ddp_zero_param_owner(z, 0, &owner));
    CHECK(owner == 0);
    CHECK(ddp_zero_state_bytes(z) == 0); /* SGD without momentum keeps nothing */
    /* The hook refuses a ZeRO object made without overlap. */
    ddp_work_t *work = NULL;
    size_t idx = 0, off = 0, num = 4, rows = 0;
    ddp_comm_bucket_t bucket = {0, w, 4, DDP_F32, 1, &idx, &off, &num, &rows, 0, 1, 0};
    CHECK_STATUS(ddp_zero_hook(z, g, &bucket, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("overlap");
    CHECK_STATUS(ddp_zero_hook(NULL, g, &bucket, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_zero_grad_ready(z, 0, gr), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("stage 2");
    ddp_zero_destroy(z);

    /* Stage 2: a step without gradients for unmarked parameters names the parameter. */
    zc.stage = 2;
    CHECK_OK(ddp_zero_create(g, p, 1, &zc, &z));
    CHECK_STATUS(ddp_zero_grad_ready(z, 1, gr), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("index");
    CHECK_STATUS(ddp_zero_grad_ready(z, 0, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_zero_step(z, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("(w)");
    CHECK_OK(ddp_zero_grad_ready(z, 0, gr));
    CHECK_OK(ddp_zero_step(z, NULL)); /* w = 0 3 ... minus 0.5 * 2 */
    CHECK(w[0] == -1.0f && w[3] == 2.0f);
    ddp_zero_destroy(z);
    zc.stage = 1;

    /* Overlap: a step before the hook saw the parameter is a usage error naming it. */
    zc.overlap = 1;
    CHECK_OK(ddp_zero_create(g, p, 1, &zc, &z));
    CHECK_STATUS(ddp_zero_step(z, gp), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_zero_step(z, NULL), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("w");
    ddp_zero_destroy(z);
    zc.overlap = 0;

    /* grads NULL: each parameter's .grad as given at create (llm.c's layout: one gradient block,
     * ddp_param_t.grad pointing into it), the same update as passing the pointers. A float **
     * cannot be passed as void *const * without a cast, so this is what such a program calls.
     * Two parameters in one block; the optimizer, stage 1 and stage 2 (nothing marked, then one
     * of the two marked with its own pointer). */
    float block[6] = {2, 2, 2, 2, 4, 4};
    float wa[4] = {1, 2, 3, 4}, wb[2] = {5, 6};
    ddp_param_t pg[2] = {{"a", wa, 4, DDP_F32, 0, 0, block},
                         {"b", wb, 2, DDP_F32, 0, 0, block + 4}};
    CHECK_OK(ddp_optim_create(pg, 2, &zc.optim, &o));
    CHECK_OK(ddp_optim_step(o, NULL)); /* lr 0.5: a -= 1, b -= 2 */
    CHECK(wa[0] == 0.0f && wa[3] == 3.0f && wb[0] == 3.0f && wb[1] == 4.0f);
    ddp_optim_destroy(o);
    o = NULL;
    pg[1].grad = NULL; /* a missing .grad is named */
    CHECK_OK(ddp_optim_create(pg, 2, &zc.optim, &o));
    CHECK_STATUS(ddp_optim_step(o, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("parameter 1's .grad");
    ddp_optim_destroy(o);
    o = NULL;
    pg[1].grad = block + 4;
    for (int stage = 1; stage <= 2; stage++) {
        zc.stage = stage;
        CHECK_OK(ddp_zero_create(g, pg, 2, &zc, &z));
        CHECK_OK(ddp_zero_step(z, NULL));
        CHECK(wa[0] == -1.0f && wa[3] == 2.0f && wb[0] == 1.0f && wb[1] == 2.0f);
        if (stage == 2) { /* b marked with its own gradient, a taken from its .grad */
            float gb2[2] = {-2, -2};
            CHECK_OK(ddp_zero_grad_ready(z, 1, gb2));
            CHECK_OK(ddp_zero_step(z, NULL));
            CHECK(wa[0] == -2.0f && wb[0] == 2.0f && wb[1] == 3.0f);
        }
        ddp_zero_destroy(z);
        z = NULL;
        wa[0] = 0, wa[3] = 3, wb[0] = 3, wb[1] = 4;
    }
    zc.stage = 1;
    pg[0].grad = NULL;
    CHECK_OK(ddp_zero_create(g, pg, 2, &zc, &z));
    CHECK_STATUS(ddp_zero_step(z, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("(a) had no .grad");
    ddp_zero_destroy(z);
    ddp_zero_destroy(NULL);
    ddp_optim_destroy(NULL);
    CHECK(ddp_zero_state_bytes(NULL) == 0 && ddp_optim_state_bytes(NULL) == 0);
    return 0;
}

/* Ranks that disagree on the parameters (the last rank's first one is longer by a chunk) get an
 * error from the step on every rank, within the timeout, instead of wrong data or a hang. */
static int mismatch_main(ddp_group_t *g, void *arg)
{
    int stage = *(const int *)arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    float a[40] = {0}, b[7] = {0}, ga[40] = {0}, gb[7] = {0};
    ddp_param_t p[2] = {{"a", a, rank == world - 1 ? 34 : 30, DDP_F32, 0, 0, NULL},
                        {"b", b, 7, DDP_F32, 0, 0, NULL}};
    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    zc.stage = stage;
    zc.bucket_cap_bytes = 0; /* stage 2: every gradient its own reduce-scatter */
    ddp_zero_t *z = NULL;
    CHECK_OK(ddp_zero_create(g, p, 2, &zc, &z));
    void *grads[2] = {ga, gb};
    ddp_status_t s = ddp_zero_step(z, grads);
    CHECK_MSG(s == DDP_ERR_MISMATCH || s == DDP_ERR_REMOTE || s == DDP_ERR_ABORTED,
              "rank %d: step returned %s (%s)", rank, ddp_status_string(s), ddp_last_error());
    CHECK_ERROR_MENTIONS("zero step");
    if (rank == 0) fprintf(stderr, "rank 0: %s: %s\n", ddp_status_string(s), ddp_last_error());
    ddp_zero_destroy(z);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "args") == 0)
        return ddp_test_run_group(1, 60, NULL, args_main, NULL);
    if (argc == 4 && strcmp(argv[1], "mismatch") == 0) {
        int stage = atoi(argv[2]);
        ddp_group_options_t go = DDP_GROUP_OPTIONS_INIT;
        go.timeout_ms = 20000;
        return ddp_test_run_group(atoi(argv[3]), 60, &go, mismatch_main, &stage);
    }
    if (argc != 5) {
        fprintf(stderr, "usage: %s args | mismatch 1|2 WORLD | "
                "stage1|stage1chunks|stage2|stage2ready|stage2fused|stage2fusedready|overlap "
                "sgd|nesterov|adam WORLD f32|f64\n",
                argv[0]);
        return 2;
    }
    test_case_t tc;
    tc.mode = argv[1];
    tc.optim = (ddp_optim_config_t)DDP_OPTIM_CONFIG_INIT;
    if (strcmp(argv[2], "adam") == 0) {
        tc.optim.kind = DDP_OPTIM_ADAM;
        tc.optim.lr = 0.01;
        tc.optim.weight_decay = 1e-3;
    } else {
        tc.optim.kind = DDP_OPTIM_SGD;
        tc.optim.lr = 0.05;
        tc.optim.momentum = 0.9;
        tc.optim.weight_decay = 1e-3;
        tc.optim.nesterov = strcmp(argv[2], "nesterov") == 0;
    }
    tc.dtype = strcmp(argv[4], "f64") == 0 ? DDP_F64 : DDP_F32;
    int world = atoi(argv[3]);
    CHECK(world >= 1 && world <= 4);
    return ddp_test_run_group(world, 120, NULL, rank_main, &tc);
}
