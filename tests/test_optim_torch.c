/* The optimizers against PyTorch: tests/optim_torch_reference.py runs torch.optim's SGD
 * (momentum, dampening, Nesterov), Adam (L2, amsgrad) and AdamW with two parameter groups, a
 * learning-rate schedule (LambdaLR's rule: each group's initial lr times a factor),
 * clip_grad_norm_, and bf16 parameters with f32 master weights; this program replays the same
 * inputs through ddp_optim (plain) or ddp_zero (stage 1 or 2 at world 1-3) and requires every
 * parameter after every step within f32 rounding of torch's, and the clipping norm too.
 *
 *   test_optim_torch plain PYTHON SCRIPT
 *   test_optim_torch zero STAGE WORLD PYTHON SCRIPT
 *
 * Without torch the script exits 2 and this test fails, saying what to install. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/shard.h"
#include "harness.h"

/* Relative error allowed: a few f32 roundings apart (torch rounds every tensor op to f32, we
 * round each stored value once from double). Relative to the largest magnitude the element had
 * so far: a parameter that moved towards 0 carries the absolute rounding errors of its larger
 * past (p - lr*d cancels), which are then large against its value. Floor: an element near 0 has no meaningful
 * relative error; 1e-3 is far below the parameters' scale (about 1). */
#define REL_TOL 1e-6
#define ABS_FLOOR 1e-3

typedef struct tcase {
    char name[33];
    int32_t kind, nesterov, amsgrad, dtype;
    double lr, momentum, dampening, beta1, beta2, eps, wd, max_norm;
    uint32_t ngroups;
    ddp_optim_group_t groups[8];
    uint32_t nparams;
    uint32_t numel[8], group[8];
    uint32_t nsteps;
    double factor[16];
    float *init[8];
    float *grad[16][8];
    float *expect[16][8];
    double norm[16];
} tcase_t;

static tcase_t cases[16];
static uint32_t ncases;

static void read_exact(FILE *f, void *p, size_t n)
{
    CHECK_MSG(fread(p, 1, n, f) == n, "reference file is truncated");
}

static float *read_floats(FILE *f, size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    CHECK(p);
    read_exact(f, p, n * sizeof *p);
    return p;
}

static void load_reference(const char *python, const char *script)
{
    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[4096], cmd[8192];
    snprintf(path, sizeof path, "%s/optim_reference.bin", dir);
    /* No torch is a missing package, not a failure: skipped (exit 77) with the reason. `make
     * test` installs torch where it can (tools/test_setup.sh), so CI never takes this path. */
    snprintf(cmd, sizeof cmd, "'%s' -c 'import torch' 2>/dev/null", python);
    int probe = system(cmd);
    if (probe == -1 || !WIFEXITED(probe) || WEXITSTATUS(probe) != 0) {
        printf("skipped: %s cannot import torch, which computes this test's reference (install "
               "it: python3 -m pip install torch==2.13.0, or Debian's python3-torch; CMake: "
               "-DDDP_TORCH_PYTHON=<python with torch>)\n",
               python);
        exit(77);
    }
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s'", python, script, path);
    int rc = system(cmd);
    CHECK_MSG(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0,
              "the PyTorch reference (%s) failed with status %d: PyTorch is needed for this "
              "test (Debian: apt-get install python3-torch; CMake: -DDDP_TORCH_PYTHON=<python "
              "with torch>)",
              cmd, rc);
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f, "cannot open %s", path);
    read_exact(f, &ncases, 4);
    CHECK(ncases <= 16);
    for (uint32_t c = 0; c < ncases; c++) {
        tcase_t *t = &cases[c];
        read_exact(f, t->name, 32);
        read_exact(f, &t->kind, 16);
        double d[8];
        read_exact(f, d, sizeof d);
        t->lr = d[0], t->momentum = d[1], t->dampening = d[2], t->beta1 = d[3];
        t->beta2 = d[4], t->eps = d[5], t->wd = d[6], t->max_norm = d[7];
        read_exact(f, &t->ngroups, 4);
        CHECK(t->ngroups <= 8);
        for (uint32_t g = 0; g < t->ngroups; g++) read_exact(f, &t->groups[g], 16);
        read_exact(f, &t->nparams, 4);
        CHECK(t->nparams <= 8);
        for (uint32_t i = 0; i < t->nparams; i++) {
            read_exact(f, &t->numel[i], 4);
            read_exact(f, &t->group[i], 4);
        }
        read_exact(f, &t->nsteps, 4);
        CHECK(t->nsteps <= 16);
        read_exact(f, t->factor, 8 * (size_t)t->nsteps);
        for (uint32_t i = 0; i < t->nparams; i++) t->init[i] = read_floats(f, t->numel[i]);
        for (uint32_t s = 0; s < t->nsteps; s++) {
            for (uint32_t i = 0; i < t->nparams; i++) t->grad[s][i] = read_floats(f, t->numel[i]);
            for (uint32_t i = 0; i < t->nparams; i++)
                t->expect[s][i] = read_floats(f, t->numel[i]);
            read_exact(f, &t->norm[s], 8);
        }
    }
    char extra;
    CHECK_MSG(fread(&extra, 1, 1, f) == 0, "reference file is longer than its cases");
    fclose(f);
    remove(path);
    rmdir(dir);
}

static ddp_optim_config_t config_of(const tcase_t *t)
{
    ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
    c.kind = (ddp_optim_kind_t)t->kind;
    c.lr = t->lr;
    c.momentum = t->momentum;
    c.dampening = t->dampening;
    c.nesterov = t->nesterov;
    c.beta1 = t->beta1;
    c.beta2 = t->beta2;
    c.eps = t->eps;
    c.weight_decay = t->wd;
    c.amsgrad = t->amsgrad;
    c.max_grad_norm = t->max_norm;
    c.ngroups = t->ngroups;
    c.groups = t->groups;
    c.param_groups = t->group;
    return c;
}

/* The case's parameters and one step's gradients in its dtype (bf16 values are exact). */
typedef struct state {
    void *data[8];
    void *grad[8];
    ddp_param_t params[8];
} state_t;

static int is_half(const tcase_t *t) { return t->dtype == DDP_BF16 || t->dtype == DDP_F16; }

static uint16_t to_half(const tcase_t *t, float x)
{
    return t->dtype == DDP_BF16 ? ddp_f32_to_bf16(x) : ddp_f32_to_f16(x);
}

static float from_half(const tcase_t *t, uint16_t h)
{
    return t->dtype == DDP_BF16 ? ddp_bf16_to_f32(h) : ddp_f16_to_f32(h);
}

static void state_init(state_t *st, const tcase_t *t)
{
    ddp_dtype_t dt = (ddp_dtype_t)t->dtype;
    size_t es = ddp_dtype_size(dt);
    for (uint32_t i = 0; i < t->nparams; i++) {
        st->data[i] = malloc(t->numel[i] * es);
        st->grad[i] = malloc(t->numel[i] * es);
        CHECK(st->data[i] && st->grad[i]);
        for (uint32_t k = 0; k < t->numel[i]; k++) {
            if (is_half(t)) {
                uint16_t b = to_half(t, t->init[i][k]);
                CHECK(from_half(t, b) == t->init[i][k]);
                ((uint16_t *)st->data[i])[k] = b;
            } else {
                ((float *)st->data[i])[k] = t->init[i][k];
            }
        }
        st->params[i] = (ddp_param_t){"p", st->data[i], t->numel[i], dt, 0, 0, NULL};
    }
}

static void state_grads(state_t *st, const tcase_t *t, uint32_t s)
{
    for (uint32_t i = 0; i < t->nparams; i++)
        for (uint32_t k = 0; k < t->numel[i]; k++) {
            float g = t->grad[s][i][k];
            if (is_half(t)) {
                uint16_t b = to_half(t, g);
                CHECK(from_half(t, b) == g);
                ((uint16_t *)st->grad[i])[k] = b;
            } else {
                ((float *)st->grad[i])[k] = g;
            }
        }
}

static void state_free(state_t *st, const tcase_t *t)
{
    for (uint32_t i = 0; i < t->nparams; i++) {
        free(st->data[i]);
        free(st->grad[i]);
    }
}

/* Largest relative error of this step (f32), or failure (f16/bf16: our value must be the
 * rounding of a number within REL_TOL of torch's f32 master). */
static double compare(const state_t *st, const tcase_t *t, uint32_t s, int rank)
{
    double worst = 0;
    for (uint32_t i = 0; i < t->nparams; i++)
        for (uint32_t k = 0; k < t->numel[i]; k++) {
            double want = t->expect[s][i][k];
            if (is_half(t)) {
                uint16_t got = ((const uint16_t *)st->data[i])[k];
                uint16_t lo = to_half(t, (float)(want * (1 - REL_TOL)));
                uint16_t hi = to_half(t, (float)(want * (1 + REL_TOL)));
                CHECK_MSG(got == lo || got == hi,
                          "%s rank %d step %u param %u[%u]: %s %g, torch's master %.9g "
                          "rounds to %g",
                          t->name, rank, s, i, k, ddp_dtype_name((ddp_dtype_t)t->dtype),
                          from_half(t, got), want, from_half(t, to_half(t, (float)want)));
                continue;
            }
            double got = ((const float *)st->data[i])[k];
            double den = fabs(t->init[i][k]);
            for (uint32_t j = 0; j <= s; j++)
                if (fabs(t->expect[j][i][k]) > den) den = fabs(t->expect[j][i][k]);
            if (den < ABS_FLOOR) den = ABS_FLOOR;
            double rel = fabs(got - want) / den;
            CHECK_MSG(rel <= REL_TOL, "%s rank %d step %u param %u[%u]: %.9g, torch %.9g (rel %.3g)",
                      t->name, rank, s, i, k, got, want, rel);
            if (rel > worst) worst = rel;
        }
    return worst;
}

static void check_norm(const tcase_t *t, uint32_t s, double norm, int rank)
{
    if (isnan(t->norm[s])) return;
    double rel = fabs(norm - t->norm[s]) / t->norm[s];
    CHECK_MSG(rel <= REL_TOL, "%s rank %d step %u: gradient norm %.9g, torch's %.9g (rel %.3g)",
              t->name, rank, s, norm, t->norm[s], rel);
}

static int run_plain(void)
{
    for (uint32_t c = 0; c < ncases; c++) {
        const tcase_t *t = &cases[c];
        state_t st;
        state_init(&st, t);
        ddp_optim_config_t oc = config_of(t);
        ddp_optim_t *o = NULL;
        CHECK_OK(ddp_optim_create(st.params, t->nparams, &oc, &o));
        double worst = 0;
        for (uint32_t s = 0; s < t->nsteps; s++) {
            CHECK_OK(ddp_optim_scale_lr(o, t->factor[s]));
            double lr1;
            CHECK_OK(ddp_optim_get_lr(o, 1, &lr1));
            CHECK(lr1 == t->groups[1].lr * t->factor[s]);
            state_grads(&st, t, s);
            CHECK_OK(ddp_optim_step(o, st.grad));
            double norm;
            CHECK_OK(ddp_optim_grad_norm(o, &norm));
            check_norm(t, s, norm, 0);
            double w = compare(&st, t, s, 0);
            if (w > worst) worst = w;
        }
        printf("plain %-24s %u steps: max rel err %.3g\n", t->name, t->nsteps, worst);
        ddp_optim_destroy(o);
        state_free(&st, t);
    }
    return 0;
}

static int zero_stage;

static int zero_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(g);
    for (uint32_t c = 0; c < ncases; c++) {
        const tcase_t *t = &cases[c];
        state_t st;
        state_init(&st, t);
        ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
        zc.stage = zero_stage;
        zc.optim = config_of(t);
        zc.bucket_cap_bytes = 64; /* small: biases share a bucket, the rest go direct */
        ddp_zero_t *z = NULL;
        CHECK_OK(ddp_zero_create(g, st.params, t->nparams, &zc, &z));
        double worst = 0;
        for (uint32_t s = 0; s < t->nsteps; s++) {
            CHECK_OK(ddp_zero_scale_lr(z, t->factor[s]));
            /* Stage 1: the averaged gradient, as after the Reducer. Stage 2: every rank's local
             * gradient is the same, so their average is it (exactly for bf16; within an f32
             * rounding otherwise). */
            state_grads(&st, t, s);
            CHECK_OK(ddp_zero_step(z, st.grad));
            double norm;
            CHECK_OK(ddp_zero_grad_norm(z, &norm));
            check_norm(t, s, norm, rank);
            double w = compare(&st, t, s, rank);
            if (w > worst) worst = w;
        }
        if (rank == 0)
            printf("zero-%d %-24s %u steps: max rel err %.3g\n", zero_stage, t->name, t->nsteps,
                   worst);
        ddp_zero_destroy(z);
        state_free(&st, t);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "plain")) {
        load_reference(argv[2], argv[3]);
        return run_plain();
    }
    if (argc == 6 && !strcmp(argv[1], "zero")) {
        zero_stage = atoi(argv[2]);
        int world = atoi(argv[3]);
        load_reference(argv[4], argv[5]);
        fflush(stdout);
        return ddp_test_run_group(world, 120, NULL, zero_main, NULL);
    }
    fprintf(stderr, "usage: %s plain PYTHON SCRIPT | zero STAGE WORLD PYTHON SCRIPT\n", argv[0]);
    return 2;
}
