/* The optimizer kernels (src/shard/optim_kernels.c) against a plain scalar copy of the loop they
 * replaced, bit for bit: every option combination (SGD with and without momentum, dampening and
 * Nesterov; Adam, AdamW, amsgrad; weight decay; gradient scaling), f32/f64/bf16/f16, in place and
 * not, odd sizes and ones past the half-precision block, over several steps, on random inputs
 * with zeros, signed zeros, subnormals and NaN gradients among them. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "shard/shard_internal.h"

#include "optim_reference.h"

/* ---- inputs -------------------------------------------------------------------------------- */
static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static double uniform(void) { return (double)(next() >> 11) / 9007199254740992.0; }

/* Mostly normal-ish values of spread magnitude, with the odd special one. */
static double value(double scale, int allow_nan)
{
    uint64_t r = next() % 1000;
    if (r == 0) return 0.0;
    if (r == 1) return -0.0;
    if (r == 2) return 1e-40; /* an f32 subnormal */
    if (r == 3 && allow_nan) return NAN;
    double x = (uniform() * 2.0 - 1.0) * scale * pow(10.0, (double)(next() % 5) - 2.0);
    return x;
}

static void fill(ddp_dtype_t dt, void *dst, size_t n, double scale, int allow_nan)
{
    for (size_t i = 0; i < n; i++) {
        double x = value(scale, allow_nan);
        switch (dt) {
        case DDP_F32: ((float *)dst)[i] = (float)x; break;
        case DDP_F64: ((double *)dst)[i] = x; break;
        case DDP_BF16: ((uint16_t *)dst)[i] = ddp_f32_to_bf16((float)x); break;
        default: ((uint16_t *)dst)[i] = ddp_f32_to_f16((float)x); break;
        }
    }
}

static void check_same(const char *what, const void *a, const void *b, size_t bytes,
                       const char *ctx)
{
    if (bytes == 0 || memcmp(a, b, bytes) == 0) return;
    size_t i = 0;
    while (((const unsigned char *)a)[i] == ((const unsigned char *)b)[i]) i++;
    CHECK_MSG(0, "%s differs from the reference at byte %zu of %zu (%s)", what, i, bytes, ctx);
}

/* One configuration: `steps` updates of a run of n elements by the kernel and by the reference
 * from the same start, comparing parameters, outputs and every state array after each step. */
static void run_case(const ddp_optim_config_t *c, ddp_dtype_t dt, size_t n, int inplace,
                     double gscale, int steps, const char *ctx)
{
    size_t es = ddp_dtype_size(dt), ss = dt == DDP_F64 ? 8 : 4, nb = n ? n : 1;
    unsigned char *param = calloc(nb, es), *param_ref = calloc(nb, es);
    unsigned char *out = calloc(nb, es), *out_ref = calloc(nb, es);
    unsigned char *grad = calloc(nb, es);
    CHECK(param && param_ref && out && out_ref && grad);
    fill(dt, param, n, 1.0, 0);
    memcpy(param_ref, param, n * es);
    ddp__optim_run_t run = {.count = n}, ref = {.count = n};
    CHECK_OK(ddp__optim_run_alloc(&run, c, dt, param));
    CHECK_OK(ddp__optim_run_alloc(&ref, c, dt, param_ref));
    for (int s = 0; s < steps; s++) {
        /* NaN gradients only where NaN can be told apart (amsgrad's vi != vi branch), else
         * they would only compare NaN payloads the two paths produce the same way. */
        fill(dt, grad, n, 0.1, c->amsgrad);
        void *o = inplace ? (void *)param : (void *)out, *oref = inplace ? param_ref : out_ref;
        ddp__optim_run_update_to(&run, c, dt, param, o, grad, gscale);
        ref_update(&ref, c, dt, param_ref, oref, grad, gscale);
        char where[200];
        snprintf(where, sizeof where, "%s, step %d", ctx, s + 1);
        check_same("output", o, oref, n * es, where);
        check_same("param", param, param_ref, n * es, where);
        check_same("m", run.m, ref.m, run.m ? n * ss : 0, where);
        check_same("v", run.v, ref.v, run.v ? n * ss : 0, where);
        check_same("vmax", run.vmax, ref.vmax, run.vmax ? n * ss : 0, where);
        check_same("master", run.master, ref.master, run.master ? n * 4 : 0, where);
        CHECK(run.steps == ref.steps);
        /* The next step reads what this one wrote, as a trainer's would. */
        if (!inplace) {
            memcpy(param, out, n * es);
            memcpy(param_ref, out_ref, n * es);
        }
    }
    ddp__optim_run_free(&run);
    ddp__optim_run_free(&ref);
    free(param);
    free(param_ref);
    free(out);
    free(out_ref);
    free(grad);
}

int main(void)
{
    const ddp_dtype_t dtypes[] = {DDP_F32, DDP_F64, DDP_BF16, DDP_F16};
    const size_t sizes[] = {0, 1, 3, 17, 1023, 1025, 2503};
    /* SGD: momentum 0 / 0.9, dampening 0 / 0.3, Nesterov; Adam and AdamW with amsgrad; decay
     * 0 and not. Each with and without a gradient scale (clipping's coefficient). */
    ddp_optim_config_t configs[32];
    int nc = 0;
    for (int wd = 0; wd < 2; wd++) {
        double decay = wd ? 0.05 : 0.0;
        configs[nc++] = (ddp_optim_config_t){.kind = DDP_OPTIM_SGD, .lr = 0.1,
                                             .weight_decay = decay};
        configs[nc++] = (ddp_optim_config_t){.kind = DDP_OPTIM_SGD, .lr = 0.1, .momentum = 0.9,
                                             .weight_decay = decay};
        configs[nc++] = (ddp_optim_config_t){.kind = DDP_OPTIM_SGD, .lr = 0.1, .momentum = 0.9,
                                             .dampening = 0.3, .weight_decay = decay};
        configs[nc++] = (ddp_optim_config_t){.kind = DDP_OPTIM_SGD, .lr = 0.1, .momentum = 0.9,
                                             .nesterov = 1, .weight_decay = decay};
        for (int k = DDP_OPTIM_ADAM; k <= DDP_OPTIM_ADAMW; k++)
            for (int ams = 0; ams < 2; ams++)
                configs[nc++] = (ddp_optim_config_t){.kind = (ddp_optim_kind_t)k, .lr = 1e-3,
                                                     .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                                     .amsgrad = ams, .weight_decay = decay};
    }
    const double scales[] = {1.0, 0.3712345678};
    int cases = 0;
    for (int ci = 0; ci < nc; ci++) {
        CHECK_OK(ddp__optim_check_config(&configs[ci], "test"));
        for (size_t di = 0; di < sizeof dtypes / sizeof *dtypes; di++)
            for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
                for (int sc = 0; sc < 2; sc++)
                    for (int inplace = 0; inplace < 2; inplace++) {
                        char ctx[160];
                        snprintf(ctx, sizeof ctx,
                                 "config %d (kind %d, momentum %g, dampening %g, nesterov %d, "
                                 "amsgrad %d, wd %g), %s, n %zu, scale %g, %s",
                                 ci, (int)configs[ci].kind, configs[ci].momentum,
                                 configs[ci].dampening, configs[ci].nesterov, configs[ci].amsgrad,
                                 configs[ci].weight_decay, ddp_dtype_name(dtypes[di]), sizes[si],
                                 scales[sc], inplace ? "in place" : "to another array");
                        run_case(&configs[ci], dtypes[di], sizes[si], inplace, scales[sc], 4,
                                 ctx);
                        cases++;
                    }
    }
    printf("test_optim_kernels: %d cases bitwise equal to the reference\n", cases);
    return 0;
}
