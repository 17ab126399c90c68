/* fp16/bf16 communication hooks through a real Reducer over rank processes: every gradient is
 * within half-precision rounding of the exact average (computed in f64), is exactly a half value
 * (so it really travelled in half precision), is bitwise identical on every rank, and the stats
 * count half the bytes of an f32 bucket. Also the hooks' argument checks.
 *
 * usage: test_hooks_half fp16|bf16 f32|f64 WORLD     or     test_hooks_half args */
#include <math.h>
#include <string.h>

#include "harness.h"

#define NPARAMS 6
/* Sizes 0, 1, odd, prime and large (a bucket of its own past the 1 MiB first bucket). */
static const size_t numels[NPARAMS] = {0, 1, 7, 13, 1000003, 64 * 48};
static const size_t rows[NPARAMS] = {0, 0, 0, 0, 0, 64};
static const char *names[NPARAMS] = {"empty", "one", "seven", "prime", "large", "matrix"};
#define STEPS 3

typedef struct half_case {
    ddp_dtype_t wire;  /* f16 or bf16 */
    ddp_dtype_t dtype; /* of the parameters */
} half_case_t;

/* This rank's gradient: a deterministic value in [-1, 1) scaled so magnitudes span decades. */
static double gval(int rank, int step, size_t p, size_t e)
{
    unsigned long long seed = (unsigned long long)rank * 1000003ull + (unsigned long long)step *
                              7919ull + p * 104729ull + e * 2654435761ull;
    double x = ddp_test_random(&seed);
    return x * ((e % 3 == 0) ? 0.01 : (e % 3 == 1) ? 1.0 : 30.0);
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

static int run_reducer(ddp_group_t *group, void *arg)
{
    const half_case_t *hc = arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t esize = ddp_dtype_size(hc->dtype);
    ddp_param_t params[NPARAMS];
    void *data[NPARAMS];
    for (size_t i = 0; i < NPARAMS; i++) {
        data[i] = calloc(numels[i] + 1, esize);
        memset(&params[i], 0, sizeof params[i]);
        params[i].name = names[i];
        params[i].data = data[i];
        params[i].numel = numels[i];
        params[i].dtype = hc->dtype;
        params[i].rows = rows[i];
    }
    ddp_half_hook_state_t *state = NULL;
    CHECK_OK(ddp_half_hook_state_create(hc->wire, &state));
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    config.comm_hook = hc->wire == DDP_F16 ? ddp_hook_fp16 : ddp_hook_bf16;
    config.comm_hook_state = state;
    ddp_reducer_t *reducer = NULL;
    CHECK_OK(ddp_reducer_create(group, params, NPARAMS, NULL, 0, &config, &reducer));

    /* Unit roundoff of the wire type: the error bound of one rounding is |x| * u. */
    double u = hc->wire == DDP_F16 ? 0x1.0p-11 : 0x1.0p-8;
    double tiny = hc->wire == DDP_F16 ? 0x1.0p-25 : 0x1.0p-133; /* subnormal spacing / 2 */
    size_t total = 0;
    for (size_t i = 0; i < NPARAMS; i++) total += numels[i];

    for (int step = 0; step < STEPS; step++) {
        CHECK_OK(ddp_reducer_prepare(reducer));
        for (size_t i = NPARAMS; i-- > 0;) {
            void *g = NULL;
            CHECK_OK(ddp_reducer_grad(reducer, i, &g));
            for (size_t e = 0; e < numels[i]; e++) save(hc->dtype, g, e, gval(rank, step, i, e));
            CHECK_OK(ddp_reducer_grad_ready(reducer, i));
        }
        CHECK_OK(ddp_reducer_finalize(reducer));
        for (size_t i = 0; i < NPARAMS; i++) {
            void *g = NULL;
            CHECK_OK(ddp_reducer_grad(reducer, i, &g));
            for (size_t e = 0; e < numels[i]; e++) {
                double exact = 0, magnitude = 0;
                for (int q = 0; q < world; q++) {
                    double x = gval(q, step, i, e);
                    exact += x;
                    magnitude += fabs(x);
                }
                exact /= world;
                magnitude /= world;
                double got = load(hc->dtype, g, e);
                /* Each rank's prescaled value rounded once, the f32 sum rounded once. */
                double bound = u * (magnitude + fabs(exact)) * 1.001 + (world + 1) * tiny;
                CHECK_MSG(fabs(got - exact) <= bound,
                          "step %d %s[%zu] = %.9g, exact average %.9g, error %.3g > bound %.3g",
                          step, names[i], e, got, exact, fabs(got - exact), bound);
                float as_float = (float)got;
                float widened = hc->wire == DDP_F16 ? ddp_f16_to_f32(ddp_f32_to_f16(as_float))
                                                    : ddp_bf16_to_f32(ddp_f32_to_bf16(as_float));
                CHECK_MSG((double)widened == got,
                          "step %d %s[%zu] = %.9g is not a %s value: the bucket did not travel "
                          "in half precision",
                          step, names[i], e, got, ddp_dtype_name(hc->wire));
            }
            /* Bitwise identical on every rank. */
            size_t bytes = numels[i] * esize;
            unsigned char *all = malloc(bytes * (size_t)world + 1);
            CHECK(all != NULL);
            CHECK_OK(ddp_group_allgather(group, g, all, bytes, DDP_U8));
            for (int q = 1; q < world; q++)
                CHECK_MSG(memcmp(all, all + (size_t)q * bytes, bytes) == 0,
                          "step %d %s differs between rank 0 and rank %d", step, names[i], q);
            free(all);
        }
        CHECK_OK(ddp_reducer_zero_grad(reducer));
    }

    ddp_hook_stats_t stats;
    CHECK_OK(ddp_half_hook_stats(state, &stats));
    CHECK_MSG(stats.numel == (uint64_t)total * STEPS, "stats.numel %llu, expected %zu",
              (unsigned long long)stats.numel, total * STEPS);
    CHECK(stats.bytes_before == (uint64_t)(total * esize * STEPS));
    CHECK(stats.bytes_after == (uint64_t)(total * 2 * STEPS));
    CHECK(stats.buckets >= (uint64_t)STEPS * ddp_reducer_bucket_count(reducer));

    ddp_reducer_destroy(reducer);
    ddp_half_hook_state_destroy(state);
    for (size_t i = 0; i < NPARAMS; i++) free(data[i]);
    return 0;
}

/* Direct hook calls: argument checks, and a half bucket passes through unchanged in size. */
static int run_args(ddp_group_t *group, void *arg)
{
    (void)arg;
    ddp_half_hook_state_t *fp16 = NULL, *bf16 = NULL;
    CHECK_STATUS(ddp_half_hook_state_create(DDP_F32, &fp16), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("wire_dtype");
    CHECK_STATUS(ddp_half_hook_state_create(DDP_F16, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
    CHECK_OK(ddp_half_hook_state_create(DDP_F16, &fp16));
    CHECK_OK(ddp_half_hook_state_create(DDP_BF16, &bf16));

    float values[5] = {1.0f, -2.5f, 3.0e-3f, 1.0f / 3.0f, 70000.0f};
    size_t params[1] = {0}, offsets[1] = {0}, counts[1] = {5}, nrows[1] = {0};
    ddp_comm_bucket_t b = {0, values, 5, DDP_F32, 1, params, offsets, counts, nrows, 0, 1, 0};
    ddp_work_t *work = NULL;
    CHECK_STATUS(ddp_hook_fp16(NULL, group, &b, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("state");
    CHECK_STATUS(ddp_hook_fp16(bf16, group, &b, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("created for bf16");
    CHECK_STATUS(ddp_hook_bf16(bf16, NULL, &b, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(ddp_hook_bf16(bf16, group, NULL, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bucket");
    CHECK_STATUS(ddp_hook_bf16(bf16, group, &b, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("work");
    int32_t ints[2] = {1, 2};
    ddp_comm_bucket_t bi = {3, ints, 2, DDP_I32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_STATUS(ddp_hook_fp16(fp16, group, &bi, &work), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("bucket 3");
    CHECK_STATUS(ddp_half_hook_stats(NULL, NULL), DDP_ERR_INVALID_ARGUMENT);
    ddp_comm_bucket_t bad = b;
    bad.dtype = (ddp_dtype_t)99;
    CHECK_STATUS(ddp_hook_fp16(fp16, group, &bad, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("dtype 99");
    bad = b;
    bad.numel = SIZE_MAX;
    CHECK_STATUS(ddp_hook_bf16(bf16, group, &bad, &work), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("numel");

    /* World size 1: the result is the input rounded to f16 (70000 overflows to infinity). */
    CHECK_OK(ddp_hook_fp16(fp16, group, &b, &work));
    CHECK_OK(ddp_work_wait(work));
    ddp_work_free(work);
    CHECK(values[0] == 1.0f && values[1] == -2.5f);
    CHECK(values[2] == ddp_f16_to_f32(ddp_f32_to_f16(3.0e-3f)) && values[2] != 3.0e-3f);
    CHECK(values[3] == ddp_f16_to_f32(ddp_f32_to_f16(1.0f / 3.0f)));
    CHECK(isinf(values[4]));
    /* bf16 keeps f32's range. */
    float big = 70000.0f;
    ddp_comm_bucket_t bb = {1, &big, 1, DDP_F32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_OK(ddp_hook_bf16(bf16, group, &bb, &work));
    CHECK_OK(ddp_work_wait(work));
    ddp_work_free(work);
    CHECK(big == ddp_bf16_to_f32(ddp_f32_to_bf16(70000.0f)));
    /* An empty bucket and an already-half bucket. */
    ddp_comm_bucket_t be = {2, NULL, 0, DDP_F32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_OK(ddp_hook_fp16(fp16, group, &be, &work));
    CHECK_OK(ddp_work_wait(work));
    ddp_work_free(work);
    uint16_t h[3] = {ddp_f32_to_f16(1.5f), ddp_f32_to_f16(-4.0f), 0};
    ddp_comm_bucket_t bh = {4, h, 3, DDP_F16, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
    CHECK_OK(ddp_hook_fp16(fp16, group, &bh, &work));
    CHECK_OK(ddp_work_wait(work));
    ddp_work_free(work);
    CHECK(ddp_f16_to_f32(h[0]) == 1.5f && ddp_f16_to_f32(h[1]) == -4.0f);

    ddp_hook_stats_t st;
    CHECK_OK(ddp_half_hook_stats(fp16, &st));
    CHECK(st.buckets == 3 && st.numel == 8);
    CHECK(st.bytes_before == 5 * 4 + 0 + 3 * 2);
    CHECK(st.bytes_after == 5 * 2 + 0 + 3 * 2);

    /* The bulk conversions (vectorised) round exactly as the scalar library functions: ties,
     * subnormals, overflow, infinities, signed zeros; an odd count leaves a scalar tail. */
    enum { NCONV = 1003 };
    float *in = malloc(NCONV * sizeof(float)), *out = malloc(NCONV * sizeof(float));
    CHECK(in && out);
    unsigned long long seed = 11;
    for (size_t i = 0; i < NCONV; i++) {
        double r = ddp_test_random(&seed);
        switch (i % 8) {
        case 0: in[i] = (float)(r * 1e-6); break;           /* f16 subnormal range */
        case 1: in[i] = (float)(r * 70000.0); break;        /* overflows f16 sometimes */
        case 2: in[i] = 1.0f + (float)(i % 64) * 0x1.0p-11f; break; /* f16 ties */
        case 3: in[i] = (float)(r * 1e30); break;           /* bf16 range only */
        case 4: in[i] = (i & 1) ? -0.0f : 0.0f; break;
        case 5: in[i] = (i & 16) ? INFINITY : -INFINITY; break;
        case 6: in[i] = 1.0f + (float)(i % 256) * 0x1.0p-8f + 0x1.0p-9f; break; /* bf16 ties */
        default: in[i] = (float)r; break;
        }
    }
    for (int w = 0; w < 2; w++) {
        ddp_half_hook_state_t *hs = w == 0 ? fp16 : bf16;
        memcpy(out, in, NCONV * sizeof(float));
        ddp_comm_bucket_t bc = {9, out, NCONV, DDP_F32, 0, NULL, NULL, NULL, NULL, 0, 1, 0};
        CHECK_OK(w == 0 ? ddp_hook_fp16(hs, group, &bc, &work) : ddp_hook_bf16(hs, group, &bc,
                                                                                &work));
        CHECK_OK(ddp_work_wait(work));
        ddp_work_free(work);
        for (size_t i = 0; i < NCONV; i++) {
            float want = w == 0 ? ddp_f16_to_f32(ddp_f32_to_f16(in[i]))
                                : ddp_bf16_to_f32(ddp_f32_to_bf16(in[i]));
            CHECK_MSG(memcmp(&want, &out[i], sizeof want) == 0,
                      "%s element %zu: %.9g became %.9g, the scalar conversion gives %.9g",
                      w == 0 ? "fp16" : "bf16", i, in[i], out[i], want);
        }
    }
    free(in);
    free(out);
    ddp_half_hook_state_destroy(fp16);
    ddp_half_hook_state_destroy(bf16);
    ddp_half_hook_state_destroy(NULL);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "args") == 0) return ddp_test_run_group(1, 60, NULL,
                                                                             run_args, NULL);
    if (argc != 4) {
        fprintf(stderr, "usage: test_hooks_half fp16|bf16 f32|f64 WORLD | args\n");
        return 2;
    }
    half_case_t hc;
    hc.wire = strcmp(argv[1], "fp16") == 0 ? DDP_F16 : DDP_BF16;
    hc.dtype = strcmp(argv[2], "f32") == 0 ? DDP_F32 : DDP_F64;
    int world = atoi(argv[3]);
    return ddp_test_run_group(world, 100, NULL, run_reducer, &hc);
}
