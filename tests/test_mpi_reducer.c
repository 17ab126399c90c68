/* The Reducer over the MPI transport, under mpirun with 1-4 processes: a small MLP trained with
 * SGD, each rank on its shard of the global batch with gradients averaged by the Reducer, must
 * follow one process training on the whole batch (computed inside every rank as the reference):
 * gradients within a tight tolerance at every step, parameters bitwise identical on every rank
 * after every step. Small buckets give several bucket allreduces per step, some small enough
 * to travel inside the MPI transport's fingerprint record and some not.
 *
 * Model: out = W2 tanh(W1 x + b1) + b2, loss = mean over samples of |out - y|^2 / 2. */
#include <math.h>
#include <mpi.h>
#include <string.h>

#include "harness.h"

enum { IN = 9, HID = 16, OUT = 3, BATCH = 24, STEPS = 5, NP = 4 };
static const size_t numel[NP] = {HID * IN, HID, OUT * HID, OUT};
static const char *const names[NP] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

static int g_rank, g_world;

static double uniform(unsigned long long *state) { return ddp_test_random(state); }

static double get(ddp_dtype_t d, const void *p, size_t i)
{
    return d == DDP_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}

static void put(ddp_dtype_t d, void *p, size_t i, double v)
{
    if (d == DDP_F32) ((float *)p)[i] = (float)v;
    else ((double *)p)[i] = v;
}

/* Gradients (in double) of the loss averaged over samples [first, first + n) of step `step`,
 * for the parameters p (in dtype d). */
static void gradients(ddp_dtype_t d, void *const p[NP], int step, size_t first, size_t n,
                      double *g[NP])
{
    for (int k = 0; k < NP; k++) memset(g[k], 0, numel[k] * sizeof(double));
    for (size_t s = first; s < first + n; s++) {
        unsigned long long seed = 1000003ULL * (unsigned long long)(step + 1) + s;
        double x[IN], y[OUT], h[HID], o[OUT], dout[OUT], dh[HID];
        for (int i = 0; i < IN; i++) x[i] = uniform(&seed);
        for (int j = 0; j < OUT; j++) y[j] = uniform(&seed);
        for (int i = 0; i < HID; i++) {
            double a = get(d, p[1], (size_t)i);
            for (int k = 0; k < IN; k++) a += get(d, p[0], (size_t)(i * IN + k)) * x[k];
            h[i] = tanh(a);
        }
        for (int j = 0; j < OUT; j++) {
            double a = get(d, p[3], (size_t)j);
            for (int i = 0; i < HID; i++) a += get(d, p[2], (size_t)(j * HID + i)) * h[i];
            o[j] = a;
            dout[j] = (o[j] - y[j]) / (double)n;
        }
        for (int i = 0; i < HID; i++) {
            double a = 0;
            for (int j = 0; j < OUT; j++) a += get(d, p[2], (size_t)(j * HID + i)) * dout[j];
            dh[i] = a * (1 - h[i] * h[i]);
        }
        for (int j = 0; j < OUT; j++) {
            g[3][j] += dout[j];
            for (int i = 0; i < HID; i++) g[2][j * HID + i] += dout[j] * h[i];
        }
        for (int i = 0; i < HID; i++) {
            g[1][i] += dh[i];
            for (int k = 0; k < IN; k++) g[0][i * IN + k] += dh[i] * x[k];
        }
    }
}

static uint64_t hash_params(ddp_dtype_t d, void *const p[NP])
{
    uint64_t h = 1469598103934665603ULL;
    for (int k = 0; k < NP; k++) {
        const unsigned char *b = p[k];
        for (size_t i = 0; i < numel[k] * ddp_dtype_size(d); i++) h = (h ^ b[i]) * 1099511628211ULL;
    }
    return h;
}

static void train(ddp_group_t *group, ddp_dtype_t d)
{
    size_t esz = ddp_dtype_size(d);
    void *p[NP], *ref[NP];
    double *g[NP], *gref[NP];
    unsigned long long mine = 99 + (unsigned long long)g_rank, same = 99;
    for (int k = 0; k < NP; k++) {
        p[k] = malloc(numel[k] * esz);
        ref[k] = malloc(numel[k] * esz);
        g[k] = malloc(numel[k] * sizeof(double));
        gref[k] = malloc(numel[k] * sizeof(double));
        CHECK(p[k] && ref[k] && g[k] && gref[k]);
        /* Different values on every rank: the Reducer must broadcast rank 0's at create. */
        for (size_t i = 0; i < numel[k]; i++) {
            put(d, p[k], i, 0.5 * uniform(&mine));
            put(d, ref[k], i, 0.5 * uniform(&same));
        }
    }
    ddp_param_t params[NP];
    memset(params, 0, sizeof params);
    for (int k = 0; k < NP; k++) {
        params[k].name = names[k];
        params[k].data = p[k];
        params[k].numel = numel[k];
        params[k].dtype = d;
        params[k].rows = k % 2 == 0 ? numel[k] / (k == 0 ? IN : HID) : 0;
    }
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    config.first_bucket_bytes = 64;
    config.bucket_cap_bytes = 256;
    ddp_reducer_t *reducer = NULL;
    CHECK_OK(ddp_reducer_create(group, params, NP, NULL, 0, &config, &reducer));
    CHECK(hash_params(d, p) == hash_params(d, ref));
    CHECK(ddp_reducer_bucket_count(reducer) >= 2);

    size_t shard = BATCH / (size_t)g_world;
    double tol = d == DDP_F32 ? 2e-6 : 1e-13;
    const double lr = 0.2;
    uint64_t hashes[64];
    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(ddp_reducer_prepare(reducer));
        gradients(d, p, step, (size_t)g_rank * shard, shard, g);
        /* Backward order: the last layer's gradients are ready first. */
        for (int k = NP - 1; k >= 0; k--) {
            void *bucket_grad = NULL;
            CHECK_OK(ddp_reducer_grad(reducer, (size_t)k, &bucket_grad));
            for (size_t i = 0; i < numel[k]; i++) put(d, bucket_grad, i, g[k][i]);
            CHECK_OK(ddp_reducer_grad_ready(reducer, (size_t)k));
        }
        CHECK_OK(ddp_reducer_finalize(reducer));
        gradients(d, ref, step, 0, BATCH, gref);
        for (int k = 0; k < NP; k++) {
            void *avg = NULL;
            CHECK_OK(ddp_reducer_grad(reducer, (size_t)k, &avg));
            double scale = 0;
            for (size_t i = 0; i < numel[k]; i++) scale = fmax(scale, fabs(gref[k][i]));
            for (size_t i = 0; i < numel[k]; i++) {
                double got = get(d, avg, i);
                CHECK_MSG(fabs(got - gref[k][i]) <= tol * (scale + 1e-30) * (g_world + 2),
                          "%s rank %d step %d %s[%zu]: %.17g, one process %.17g",
                          ddp_dtype_name(d), g_rank, step, names[k], i, got, gref[k][i]);
                put(d, p[k], i, get(d, p[k], i) - lr * got);
                put(d, ref[k], i, get(d, ref[k], i) - lr * gref[k][i]);
            }
        }
        CHECK_OK(ddp_reducer_zero_grad(reducer));
        uint64_t h = hash_params(d, p);
        CHECK_OK(ddp_group_allgather(group, &h, hashes, 1, DDP_I64));
        for (int q = 0; q < g_world; q++)
            CHECK_MSG(hashes[q] == h, "%s step %d: parameters of rank %d differ from rank %d's",
                      ddp_dtype_name(d), step, q, g_rank);
    }
    /* Still close to the one-process run after every step's rounding. */
    for (int k = 0; k < NP; k++)
        for (size_t i = 0; i < numel[k]; i++)
            CHECK(fabs(get(d, p[k], i) - get(d, ref[k], i)) <= 1e3 * tol);
    ddp_reducer_destroy(reducer);
    for (int k = 0; k < NP; k++) {
        free(p[k]);
        free(ref[k]);
        free(g[k]);
        free(gref[k]);
    }
}

int main(int argc, char **argv)
{
    int provided = 0;
    CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    CHECK(g_world <= 64 && BATCH % g_world == 0);

    char path[600] = "";
    if (g_rank == 0) {
        const char *dir = ddp_test_tmpdir();
        CHECK(dir);
        snprintf(path, sizeof path, "%s/store", dir);
    }
    CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(path, &store));
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.transport = "mpi";
    o.timeout_ms = 60000;
    ddp_group_t *group = NULL;
    CHECK_OK(ddp_group_create(store, g_rank, g_world, &o, &group));
    CHECK(strcmp(ddp_group_transport(group), g_world == 1 ? "self" : "mpi") == 0);
    train(group, DDP_F32);
    train(group, DDP_F64);
    ddp_group_destroy(group);
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_destroy(store);
    if (g_rank == 0) printf("test_mpi_reducer: %d ranks passed\n", g_world);
    MPI_Finalize();
    return 0;
}
