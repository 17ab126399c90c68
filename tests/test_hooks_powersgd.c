/* PowerSGD hook through a real Reducer over rank processes, against references computed the
 * simple way (f64): with rank >= the gradients' rank the average is reproduced exactly (warm and
 * cold start, f32 and f64); error feedback keeps the applied updates tracking the true sum (the
 * residual stays bounded, without it the gap grows); compression statistics match the formula;
 * iterations before start_powersgd_iter are plain allreduces. Plus direct hook calls: config and
 * argument checks, the compression test, full-rank exactness, the rank-1 projection property and
 * seed determinism.
 *
 * usage: test_hooks_powersgd CASE WORLD
 *   CASE: unit exact_f32 exact_f64 feedback stats start_iter cold_start */
#include <math.h>
#include <string.h>

#include "ddp/powersgd.h"
#include "harness.h"

/* The model: matrices (compressible or too small to be worth it), vectors, sizes 0, 1, prime. */
#define NPARAMS 7
static const char *names[NPARAMS] = {"w1", "b1", "w2", "tiny", "one", "zero", "big"};
static const size_t prows[NPARAMS] = {24, 0, 13, 3, 0, 0, 300};
static const size_t pcols[NPARAMS] = {40, 24, 31, 2, 1, 0, 700};

static size_t numel_of(size_t i) { return prows[i] ? prows[i] * pcols[i] : pcols[i]; }

typedef struct scenario {
    const char *name;
    int world;
    ddp_dtype_t dtype;
    size_t nparams;  /* the first nparams of the model */
    int low_rank;    /* gradients of rank `grad_rank` (common bases), else full-rank random */
    int grad_rank;
    int constant;    /* the same gradient every step */
} scenario_t;

static double uniform(unsigned long long seed) { return ddp_test_random(&seed); }

/* Gradient element (row a, column b) of parameter i on rank q at step s. */
static double gval(const scenario_t *sc, size_t i, int q, int s, size_t a, size_t b)
{
    int step = sc->constant ? 0 : s;
    if (prows[i] && sc->low_rank) {
        double sum = 0;
        for (int k = 0; k < sc->grad_rank; k++) {
            double u = uniform(1000003ull * i + 7919ull * (unsigned)k + a * 31ull + 1);
            double v = uniform(2000003ull * i + 6007ull * (unsigned)k + b * 37ull + 2);
            double c = 1.0 + 0.5 * q + 0.8 * k + 0.3 * step;
            sum += c * u * v;
        }
        return sum;
    }
    size_t e = a * (prows[i] ? pcols[i] : 1) + b;
    return uniform(104729ull * i + 1299709ull * (unsigned)q + 15485863ull * (unsigned)step +
                   e * 2654435761ull + 3);
}

static double avg_val(const scenario_t *sc, size_t i, int s, size_t e)
{
    size_t cols = prows[i] ? pcols[i] : 1;
    double sum = 0;
    for (int q = 0; q < sc->world; q++) sum += gval(sc, i, q, s, e / cols, e % cols);
    return sum / sc->world;
}

static double load(ddp_dtype_t d, const void *p, size_t i)
{
    return d == DDP_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}
static void save(ddp_dtype_t d, void *p, size_t i, double v)
{
    if (d == DDP_F32)
        ((float *)p)[i] = (float)v;
    else
        ((double *)p)[i] = v;
}

typedef struct run {
    ddp_reducer_t *reducer;
    ddp_powersgd_state_t *state;
    void *data[NPARAMS];
} run_t;

static void run_open(run_t *run, ddp_group_t *group, const scenario_t *sc,
                     const ddp_powersgd_config_t *pc)
{
    ddp_param_t params[NPARAMS];
    size_t esize = ddp_dtype_size(sc->dtype);
    for (size_t i = 0; i < sc->nparams; i++) {
        run->data[i] = calloc(numel_of(i) + 1, esize);
        memset(&params[i], 0, sizeof params[i]);
        params[i].name = names[i];
        params[i].data = run->data[i];
        params[i].numel = numel_of(i);
        params[i].dtype = sc->dtype;
        params[i].rows = prows[i];
    }
    CHECK_OK(ddp_powersgd_state_create(pc, &run->state));
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    config.comm_hook = ddp_powersgd_hook;
    config.comm_hook_state = run->state;
    config.first_bucket_bytes = 4096; /* several buckets, several slots */
    CHECK_OK(ddp_reducer_create(group, params, sc->nparams, NULL, 0, &config, &run->reducer));
}

static void run_close(run_t *run, const scenario_t *sc)
{
    ddp_reducer_destroy(run->reducer);
    ddp_powersgd_state_destroy(run->state);
    for (size_t i = 0; i < sc->nparams; i++) free(run->data[i]);
}

/* One synchronised step: produce this rank's gradients (last parameter first, as backward). */
static void run_step(run_t *run, const scenario_t *sc, int rank, int s)
{
    CHECK_OK(ddp_reducer_prepare(run->reducer));
    for (size_t i = sc->nparams; i-- > 0;) {
        void *g = NULL;
        CHECK_OK(ddp_reducer_grad(run->reducer, i, &g));
        size_t cols = prows[i] ? pcols[i] : 1;
        for (size_t e = 0; e < numel_of(i); e++)
            save(sc->dtype, g, e, gval(sc, i, rank, s, e / cols, e % cols));
        CHECK_OK(ddp_reducer_grad_ready(run->reducer, i));
    }
    CHECK_OK(ddp_reducer_finalize(run->reducer));
}

static void *grad_of(run_t *run, size_t i)
{
    void *g = NULL;
    CHECK_OK(ddp_reducer_grad(run->reducer, i, &g));
    return g;
}

/* Largest |got - average| over parameter i, and the largest |average|. */
static double max_error(run_t *run, const scenario_t *sc, size_t i, int s, double *scale)
{
    void *g = grad_of(run, i);
    double err = 0, mx = 0;
    for (size_t e = 0; e < numel_of(i); e++) {
        double want = avg_val(sc, i, s, e), got = load(sc->dtype, g, e);
        if (!(fabs(got - want) <= err)) err = fabs(got - want); /* NaN counts as huge */
        if (fabs(want) > mx) mx = fabs(want);
    }
    if (scale) *scale = mx;
    return err;
}

static void check_identical(ddp_group_t *group, run_t *run, const scenario_t *sc, int s)
{
    int world = ddp_group_size(group);
    for (size_t i = 0; i < sc->nparams; i++) {
        size_t bytes = numel_of(i) * ddp_dtype_size(sc->dtype);
        unsigned char *all = malloc(bytes * (size_t)world + 1);
        CHECK(all != NULL);
        CHECK_OK(ddp_group_allgather(group, grad_of(run, i), all, bytes, DDP_U8));
        for (int q = 1; q < world; q++)
            CHECK_MSG(memcmp(all, all + (size_t)q * bytes, bytes) == 0,
                      "step %d: %s differs between rank 0 and rank %d", s, names[i], q);
        free(all);
    }
}

/* ---- exactness: rank >= the gradients' rank ------------------------------------------------ */
static int case_exact(ddp_group_t *group, void *arg)
{
    scenario_t *sc = arg;
    int rank = ddp_group_rank(group);
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    pc.matrix_approximation_rank = 2;
    pc.start_powersgd_iter = 0;
    pc.random_seed = 42;
    if (strcmp(sc->name, "cold_start") == 0) {
        pc.warm_start = 0;
        pc.use_error_feedback = 0;
    }
    run_t run;
    run_open(&run, group, sc, &pc);
    double tol = sc->dtype == DDP_F32 ? 2e-4 : 1e-9;
    for (int s = 0; s < 4; s++) {
        run_step(&run, sc, rank, s);
        for (size_t i = 0; i < sc->nparams; i++) {
            double scale = 0, err = max_error(&run, sc, i, s, &scale);
            CHECK_MSG(err <= tol * (1 + scale), "%s step %d: %s differs from the average by "
                      "%.3g (largest value %.3g)", sc->name, s, names[i], err, scale);
        }
        check_identical(group, &run, sc, s);
        CHECK_OK(ddp_reducer_zero_grad(run.reducer));
    }
    ddp_powersgd_stats_t st;
    CHECK_OK(ddp_powersgd_stats(run.state, &st));
    CHECK(st.plain_buckets == 0 && st.powersgd_buckets > 0);
    CHECK(st.compressed_tensors == 4 * 3); /* w1, w2, big each step */
    if (ddp_group_size(group) > 1) {
        /* Uneven inputs (config.join): a bucket of which only one rank's data is real is
         * refused, on every rank alike, before any collective. */
        double m[6] = {0};
        size_t p0[1] = {0}, o0[1] = {0}, n0[1] = {6}, r0[1] = {2};
        ddp_comm_bucket_t bj = {0, m, 6, DDP_F64, 1, p0, o0, n0, r0, 0, 1, 1};
        ddp_work_t *work = NULL;
        CHECK_STATUS(ddp_powersgd_hook(run.state, group, &bj, &work), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("uneven inputs");
        CHECK(work == NULL);
    }
    CHECK(st.compression_rate > 10);
    run_close(&run, sc);
    return 0;
}

/* ---- statistics match the formula ------------------------------------------------------------ */
static int case_stats(ddp_group_t *group, void *arg)
{
    scenario_t *sc = arg;
    int rank = ddp_group_rank(group);
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    pc.matrix_approximation_rank = 3;
    pc.min_compression_rate = 2;
    pc.start_powersgd_iter = 1;
    run_t run;
    run_open(&run, group, sc, &pc);
    int steps = 3;
    for (int s = 0; s < steps; s++) {
        run_step(&run, sc, rank, s);
        CHECK_OK(ddp_reducer_zero_grad(run.reducer));
    }
    /* Written out by hand: (n + m) r * 2 < n m, r = min(3, n, m). */
    uint64_t before = 0, after = 0, compressed = 0, plain = 0;
    for (size_t i = 0; i < sc->nparams; i++) {
        size_t n = prows[i], m = pcols[i], numel = numel_of(i);
        before += numel;
        size_t r = n < 3 ? n : 3;
        if (m < r) r = m;
        if (n > 1 && (n + m) * r * 2 < n * m) {
            after += (n + m) * r;
            compressed++;
        } else {
            after += numel;
            plain++;
        }
    }
    /* w1: (24+40)*3 = 192; w2: (13+31)*3 = 132; big: 1000*3 = 3000; the rest as they are. */
    CHECK(compressed == 3 && plain == 4);
    CHECK(after == 192 + 24 + 132 + 6 + 1 + 0 + 3000);
    ddp_powersgd_stats_t st;
    CHECK_OK(ddp_powersgd_stats(run.state, &st));
    uint64_t psgd_steps = (uint64_t)steps - 1;
    CHECK_MSG(st.numel_before == before * psgd_steps, "numel_before %llu, expected %llu",
              (unsigned long long)st.numel_before, (unsigned long long)(before * psgd_steps));
    CHECK_MSG(st.numel_after == after * psgd_steps, "numel_after %llu, expected %llu",
              (unsigned long long)st.numel_after, (unsigned long long)(after * psgd_steps));
    CHECK(fabs(st.compression_rate - (double)before / (double)after) < 1e-12);
    CHECK(st.compressed_tensors == compressed * psgd_steps);
    CHECK(st.uncompressed_tensors == plain * psgd_steps);
    size_t esize = ddp_dtype_size(sc->dtype);
    CHECK(st.wire.bytes_before == before * esize * (uint64_t)steps);
    CHECK(st.wire.bytes_after == (before + after * psgd_steps) * esize);
    CHECK(st.plain_buckets > 0 && st.powersgd_buckets > 0);
    CHECK(st.wire.buckets == st.plain_buckets + st.powersgd_buckets);
    run_close(&run, sc);
    return 0;
}

/* ---- start_powersgd_iter: plain allreduce before it ------------------------------------------ */
static int case_start_iter(ddp_group_t *group, void *arg)
{
    scenario_t *sc = arg;
    int rank = ddp_group_rank(group);
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    pc.matrix_approximation_rank = 1;
    pc.start_powersgd_iter = 3;
    run_t run;
    run_open(&run, group, sc, &pc);
    for (int s = 0; s < 5; s++) {
        run_step(&run, sc, rank, s);
        for (size_t i = 0; i < sc->nparams; i++) {
            double scale = 0, err = max_error(&run, sc, i, s, &scale);
            int compressed = i == 0 || i == 2;
            if (s < 3 || !compressed)
                CHECK_MSG(err <= 1e-6 * (1 + scale), "step %d: %s should be the exact average "
                          "(error %.3g)", s, names[i], err);
            else
                CHECK_MSG(err > 1e-3 * scale, "step %d: %s is the exact average, but a rank-1 "
                          "approximation of a full-rank average cannot be", s, names[i]);
        }
        check_identical(group, &run, sc, s);
        ddp_powersgd_stats_t st;
        CHECK_OK(ddp_powersgd_stats(run.state, &st));
        CHECK_MSG((st.powersgd_buckets == 0) == (s < 3), "step %d: %llu PowerSGD buckets", s,
                  (unsigned long long)st.powersgd_buckets);
        CHECK_OK(ddp_reducer_zero_grad(run.reducer));
    }
    run_close(&run, sc);
    return 0;
}

/* ---- error feedback: applied updates track the true sum -------------------------------------
 * The same full-rank gradients every step, rank 2. With error feedback the gap between the sum of
 * applied updates and the sum of true averages is exactly the sum of the ranks' residuals, and it
 * stays bounded; without it the gap grows with every step. */
static double feedback_gap(ddp_group_t *group, const scenario_t *sc, int use_error_feedback,
                           int steps, double *gap_half, double *vector_err)
{
    int rank = ddp_group_rank(group);
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    pc.start_powersgd_iter = 0;
    pc.use_error_feedback = use_error_feedback;
    pc.matrix_approximation_rank = 2;
    run_t run;
    run_open(&run, group, sc, &pc);
    size_t total = 0;
    for (size_t i = 0; i < sc->nparams; i++) total += numel_of(i);
    double *applied = calloc(total + 1, sizeof(double));
    CHECK(applied != NULL);
    double gap = 0;
    *gap_half = 0;
    *vector_err = 0;
    for (int s = 0; s < steps; s++) {
        run_step(&run, sc, rank, s);
        gap = 0;
        size_t at = 0;
        for (size_t i = 0; i < sc->nparams; i++) {
            void *g = grad_of(&run, i);
            for (size_t e = 0; e < numel_of(i); e++, at++) {
                applied[at] += load(sc->dtype, g, e);
                double d = fabs(applied[at] - (s + 1) * avg_val(sc, i, 0, e));
                if (prows[i] > 1 && numel_of(i) >= 100) {
                    if (d > gap) gap = d;
                } else if (!(d / (s + 1) <= *vector_err)) {
                    *vector_err = d / (s + 1);
                }
            }
        }
        if (s < steps / 2 && gap > *gap_half) *gap_half = gap;
        CHECK_OK(ddp_reducer_zero_grad(run.reducer));
    }
    free(applied);
    run_close(&run, sc);
    return gap;
}

static int case_feedback(ddp_group_t *group, void *arg)
{
    scenario_t *sc = arg;
    int steps = 120; /* the residual settles within about 30 steps at this size */
    double half_on, half_off, vec_on, vec_off;
    double on = feedback_gap(group, sc, 1, steps, &half_on, &vec_on);
    double off = feedback_gap(group, sc, 0, steps, &half_off, &vec_off);
    if (ddp_group_rank(group) == 0)
        printf("gap after %d steps: error feedback %.4g (max over the first half %.4g), without "
               "%.4g (first half %.4g)\n", steps, on, half_on, off, half_off);
    /* Vectors and small matrices are never compressed: exact either way (their residuals cancel
     * over ranks). */
    CHECK_MSG(vec_on < 1e-5 && vec_off < 1e-5, "uncompressed tensors drifted: %.3g / %.3g",
              vec_on, vec_off);
    CHECK_MSG(off > 1.6 * half_off, "without error feedback the gap should keep growing: %.4g "
              "after %d steps, %.4g by step %d", off, steps, half_off, steps / 2);
    CHECK_MSG(on < 0.25 * off, "error feedback gap %.4g is not much smaller than without "
              "(%.4g)", on, off);
    CHECK_MSG(on <= 1.5 * half_on, "error feedback gap still growing: %.4g after %d steps, "
              "at most %.4g in the first half", on, steps, half_on);
    return 0;
}

/* ---- direct hook calls ----------------------------------------------------------------------- */
static ddp_status_t call_hook(ddp_powersgd_state_t *st, ddp_group_t *group, ddp_comm_bucket_t *b)
{
    ddp_work_t *work = NULL;
    ddp_status_t s = ddp_powersgd_hook(st, group, b, &work);
    if (s != DDP_OK) return s;
    s = ddp_work_wait(work);
    ddp_work_free(work);
    return s;
}

static int case_unit(ddp_group_t *group, void *arg)
{
    (void)arg;
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    CHECK(pc.matrix_approximation_rank == 1 && pc.start_powersgd_iter == 1000 &&
          pc.min_compression_rate == 2.0 && pc.use_error_feedback == 1 && pc.warm_start == 1);
    ddp_powersgd_state_t *st = NULL;
    CHECK_STATUS(ddp_powersgd_state_create(NULL, &st), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("config");
    CHECK_STATUS(ddp_powersgd_state_create(&pc, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
    pc.matrix_approximation_rank = 0;
    CHECK_STATUS(ddp_powersgd_state_create(&pc, &st), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("matrix_approximation_rank");
    pc.matrix_approximation_rank = 1;
    pc.min_compression_rate = -1;
    CHECK_STATUS(ddp_powersgd_state_create(&pc, &st), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("min_compression_rate");
    pc.min_compression_rate = 2;
    pc.orthogonalization_epsilon = NAN;
    CHECK_STATUS(ddp_powersgd_state_create(&pc, &st), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("orthogonalization_epsilon");
    pc.orthogonalization_epsilon = 0;
    pc.warm_start = 2;
    CHECK_STATUS(ddp_powersgd_state_create(&pc, &st), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("warm_start");
    pc.warm_start = 1;
    CHECK_STATUS(ddp_powersgd_stats(NULL, NULL), DDP_ERR_INVALID_ARGUMENT);

    /* The compression test: (n + m) r * rate < n m with r = min(rank, n, m). */
    CHECK(ddp_powersgd_should_compress(24, 40, 2, 2) == 1);    /* 256 < 960 */
    CHECK(ddp_powersgd_should_compress(3, 2, 2, 2) == 0);      /* 20 >= 6 */
    CHECK(ddp_powersgd_should_compress(0, 5, 1, 2) == 0);
    CHECK(ddp_powersgd_should_compress(2, 1000, 8, 2) == 0);   /* r = 2: 4008 >= 2000 */
    CHECK(ddp_powersgd_should_compress(50, 1000, 100, 1) == 0); /* r = 50: 52500 >= 50000 */
    CHECK(ddp_powersgd_should_compress(50, 1000, 10, 1) == 1);  /* 10500 < 50000 */
    CHECK(ddp_powersgd_should_compress(10, 10, 5, 0) == 1);     /* rate 0: always */
    CHECK(ddp_powersgd_should_compress(10, 10, 5, 1) == 0);     /* 100 < 100 is false */

    /* Full rank (r = min(n, m)) reproduces the matrix exactly: P must be orthonormal. */
    pc.start_powersgd_iter = 0;
    pc.matrix_approximation_rank = 5;
    pc.min_compression_rate = 0.5; /* (5 + 7) * 5 * 0.5 = 30 < 35 */
    CHECK_OK(ddp_powersgd_state_create(&pc, &st));
    double m57[35], orig[35];
    unsigned long long seed = 7;
    for (int i = 0; i < 35; i++) orig[i] = m57[i] = ddp_test_random(&seed);
    size_t ps[1] = {0}, offs[1] = {0}, nums[1] = {35}, rws[1] = {5};
    ddp_comm_bucket_t b = {0, m57, 35, DDP_F64, 1, ps, offs, nums, rws, 0, 1, 0};
    CHECK_OK(call_hook(st, group, &b));
    for (int i = 0; i < 35; i++)
        CHECK_MSG(fabs(m57[i] - orig[i]) < 1e-12, "full-rank element %d: %.17g vs %.17g", i,
                  m57[i], orig[i]);
    ddp_powersgd_stats_t stats;
    CHECK_OK(ddp_powersgd_stats(st, &stats));
    CHECK(stats.compressed_tensors == 1 && stats.numel_after == 60 && stats.numel_before == 35);
    ddp_powersgd_state_destroy(st);

    /* Rank 1, f32, two matrices and a vector in one bucket: each matrix becomes p (pᵀ M) with
     * p a unit vector, so M - result is orthogonal to p; the vector is untouched (world 1). */
    pc.matrix_approximation_rank = 1;
    pc.min_compression_rate = 2;
    pc.use_error_feedback = 0;
    pc.warm_start = 0;
    CHECK_OK(ddp_powersgd_state_create(&pc, &st));
    enum { N1 = 12, M1 = 9, NV = 5, N2 = 17, M2 = 11 };
    size_t total = N1 * M1 + NV + N2 * M2;
    float *buf = malloc(total * sizeof(float)), *in = malloc(total * sizeof(float));
    for (size_t i = 0; i < total; i++) in[i] = buf[i] = (float)ddp_test_random(&seed);
    size_t ps3[3] = {0, 1, 2}, offs3[3] = {0, N1 * M1, N1 * M1 + NV};
    size_t nums3[3] = {N1 * M1, NV, N2 * M2}, rws3[3] = {N1, 0, N2};
    ddp_comm_bucket_t b3 = {1, buf, total, DDP_F32, 3, ps3, offs3, nums3, rws3, 0, 1, 0};
    CHECK_OK(call_hook(st, group, &b3));
    for (size_t i = 0; i < NV; i++) CHECK(buf[N1 * M1 + i] == in[N1 * M1 + i]);
    for (int mat = 0; mat < 2; mat++) {
        size_t n = mat ? N2 : N1, m = mat ? M2 : M1, off = mat ? N1 * M1 + NV : 0;
        /* p: the direction of the result's columns (all parallel). */
        double p[32], norm = 0;
        size_t col = 0;
        for (size_t k = 0; k < n; k++) {
            p[k] = buf[off + k * m + col];
            norm += p[k] * p[k];
        }
        norm = sqrt(norm);
        CHECK(norm > 0);
        for (size_t k = 0; k < n; k++) p[k] /= norm;
        for (size_t j = 0; j < m; j++) {
            double along = 0, resid = 0, scale = 0;
            for (size_t k = 0; k < n; k++) {
                along += p[k] * buf[off + k * m + j];
                resid += p[k] * (in[off + k * m + j] - buf[off + k * m + j]);
                scale += fabs(in[off + k * m + j]);
            }
            for (size_t k = 0; k < n; k++)
                CHECK_MSG(fabs(buf[off + k * m + j] - along * p[k]) < 1e-5 * (1 + scale),
                          "matrix %d is not rank 1 at (%zu, %zu)", mat, k, j);
            CHECK_MSG(fabs(resid) < 1e-5 * (1 + scale), "matrix %d column %zu: residual not "
                      "orthogonal to p (%.3g)", mat, j, resid);
        }
    }
    /* Same seed, same input: the same bits (cold start redraws Q from the seed stream). */
    ddp_powersgd_state_t *st2 = NULL;
    CHECK_OK(ddp_powersgd_state_create(&pc, &st2));
    float *again = malloc(total * sizeof(float));
    memcpy(again, in, total * sizeof(float));
    b3.data = again;
    CHECK_OK(call_hook(st2, group, &b3));
    CHECK(memcmp(again, buf, total * sizeof(float)) == 0);
    /* Another seed: another Q, another (still rank-1) approximation. */
    ddp_powersgd_state_t *st3 = NULL;
    pc.random_seed = 99;
    CHECK_OK(ddp_powersgd_state_create(&pc, &st3));
    memcpy(again, in, total * sizeof(float));
    CHECK_OK(call_hook(st3, group, &b3));
    CHECK(memcmp(again, buf, total * sizeof(float)) != 0);

    /* Bad buckets. */
    ddp_work_t *work = NULL;
    CHECK_STATUS(ddp_powersgd_hook(NULL, group, &b3, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("state");
    CHECK_STATUS(ddp_powersgd_hook(st3, NULL, &b3, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &b3, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("work");
    int32_t ints[4] = {0};
    ddp_comm_bucket_t bi = {5, ints, 4, DDP_I32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &bi, &work), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("bucket 5");
    size_t bad_off[1] = {30}, bad_num[1] = {10};
    ddp_comm_bucket_t bo = {6, m57, 35, DDP_F64, 1, ps, bad_off, bad_num, rws, 0, 1, 0};
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &bo, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("beyond");
    size_t bad_rows[1] = {4}; /* 35 % 4 != 0 */
    ddp_comm_bucket_t br = {6, m57, 35, DDP_F64, 1, ps, offs, nums, bad_rows, 0, 1, 0};
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &br, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("rows 4 does not divide");
    ddp_comm_bucket_t bd = {6, m57, 35, (ddp_dtype_t)99, 1, ps, offs, nums, rws, 0, 1, 0};
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &bd, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("dtype 99");
    bd.dtype = DDP_F64;
    bd.numel = SIZE_MAX;
    CHECK_STATUS(ddp_powersgd_hook(st3, group, &bd, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("numel");
    /* An empty bucket and a half bucket go through. */
    ddp_comm_bucket_t be = {7, NULL, 0, DDP_F32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_OK(call_hook(st3, group, &be));
    uint16_t h[2] = {ddp_f32_to_f16(2.0f), ddp_f32_to_f16(-1.0f)};
    ddp_comm_bucket_t bh = {8, h, 2, DDP_F16, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_OK(call_hook(st3, group, &bh));
    CHECK(ddp_f16_to_f32(h[0]) == 2.0f);

    free(buf);
    free(in);
    free(again);
    ddp_powersgd_state_destroy(st);
    ddp_powersgd_state_destroy(st2);
    ddp_powersgd_state_destroy(st3);
    ddp_powersgd_state_destroy(NULL);
    return 0;
}

/* ---- save/load: a resumed run continues bitwise ------------------------------------------- */
/* 8 steps straight against 4 + save + a new Reducer and state + load + 4: every averaged
 * gradient of the last 4 steps bitwise equal. PowerSGD starts at step 2, so the saved state holds
 * Q and residuals, and the new Reducer starts from its initial layout and rebuilds after its first
 * step, as a resumed trainer's does. A fresh state instead of the loaded one differs. */
static void copy_grads(run_t *run, const scenario_t *sc, unsigned char **out)
{
    for (size_t i = 0; i < sc->nparams; i++) {
        size_t bytes = numel_of(i) * ddp_dtype_size(sc->dtype);
        out[i] = malloc(bytes + 1);
        CHECK(out[i] != NULL);
        memcpy(out[i], grad_of(run, i), bytes);
    }
}

static int same_grads(run_t *run, const scenario_t *sc, unsigned char **want)
{
    for (size_t i = 0; i < sc->nparams; i++)
        if (memcmp(grad_of(run, i), want[i], numel_of(i) * ddp_dtype_size(sc->dtype))) return 0;
    return 1;
}

static int case_resume(ddp_group_t *group, void *arg)
{
    scenario_t *sc = arg;
    int rank = ddp_group_rank(group);
    ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
    pc.start_powersgd_iter = 2;
    pc.random_seed = 7;
    unsigned char *want[4][NPARAMS];
    run_t a, b, c, d;
    run_open(&a, group, sc, &pc);
    for (int s = 0; s < 8; s++) {
        run_step(&a, sc, rank, s);
        if (s >= 4) copy_grads(&a, sc, want[s - 4]);
        CHECK_OK(ddp_reducer_zero_grad(a.reducer));
    }
    run_close(&a, sc);

    run_open(&b, group, sc, &pc);
    for (int s = 0; s < 4; s++) {
        run_step(&b, sc, rank, s);
        CHECK_OK(ddp_reducer_zero_grad(b.reducer));
    }
    size_t size;
    CHECK_OK(ddp_powersgd_state_size(b.state, &size));
    unsigned char *blob = malloc(size);
    CHECK(blob != NULL);
    CHECK_STATUS(ddp_powersgd_state_save(b.state, blob, size - 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("size");
    CHECK_OK(ddp_powersgd_state_save(b.state, blob, size));
    run_close(&b, sc);

    run_open(&c, group, sc, &pc);
    /* damage and another config are refused before anything changes */
    blob[size / 2] ^= 1;
    CHECK_STATUS(ddp_powersgd_state_load(c.state, blob, size), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("corrupt");
    blob[size / 2] ^= 1;
    CHECK_STATUS(ddp_powersgd_state_load(c.state, blob, size - 8), DDP_ERR_INVALID_ARGUMENT);
    ddp_powersgd_config_t other = pc;
    other.matrix_approximation_rank = 2;
    ddp_powersgd_state_t *os;
    CHECK_OK(ddp_powersgd_state_create(&other, &os));
    CHECK_STATUS(ddp_powersgd_state_load(os, blob, size), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("rank 1");
    ddp_powersgd_state_destroy(os);
    CHECK_OK(ddp_powersgd_state_load(c.state, blob, size));
    for (int s = 4; s < 8; s++) {
        run_step(&c, sc, rank, s);
        CHECK_MSG(same_grads(&c, sc, want[s - 4]), "rank %d step %d: the resumed run's "
                  "averaged gradients differ from the uninterrupted run's", rank, s);
        CHECK_OK(ddp_reducer_zero_grad(c.reducer));
    }
    run_close(&c, sc);

    run_open(&d, group, sc, &pc); /* without the state: not the same run */
    for (int s = 4; s < 8; s++) {
        run_step(&d, sc, rank, s);
        CHECK_OK(ddp_reducer_zero_grad(d.reducer));
    }
    CHECK_MSG(!same_grads(&d, sc, want[3]), "a fresh state gave the same gradients: the test "
              "cannot tell a loaded state from none");
    run_close(&d, sc);
    for (int s = 0; s < 4; s++)
        for (size_t i = 0; i < sc->nparams; i++) free(want[s][i]);
    free(blob);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: test_hooks_powersgd CASE WORLD\n");
        return 2;
    }
    static scenario_t sc;
    sc.name = argv[1];
    sc.world = atoi(argv[2]);
    sc.dtype = DDP_F32;
    sc.nparams = NPARAMS;
    sc.low_rank = 0;
    sc.grad_rank = 2;
    ddp_test_group_fn fn = NULL;
    if (!strcmp(sc.name, "unit")) {
        fn = case_unit;
    } else if (!strcmp(sc.name, "exact_f32") || !strcmp(sc.name, "cold_start")) {
        sc.low_rank = 1;
        fn = case_exact;
    } else if (!strcmp(sc.name, "exact_f64")) {
        sc.low_rank = 1;
        sc.dtype = DDP_F64;
        fn = case_exact;
    } else if (!strcmp(sc.name, "resume")) {
        fn = case_resume;
    } else if (!strcmp(sc.name, "stats")) {
        fn = case_stats;
    } else if (!strcmp(sc.name, "start_iter")) {
        sc.nparams = NPARAMS - 1;
        fn = case_start_iter;
    } else if (!strcmp(sc.name, "feedback")) {
        sc.nparams = NPARAMS - 1;
        sc.constant = 1;
        sc.dtype = DDP_F64;
        fn = case_feedback;
    } else {
        fprintf(stderr, "unknown case %s\n", sc.name);
        return 2;
    }
    return ddp_test_run_group(sc.world, 110, NULL, fn, &sc);
}
