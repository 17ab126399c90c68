/* build/optim-kernels-bench: nanoseconds per element of the optimizer update kernels
 * (src/shard/optim_kernels.c) against the scalar loop they replaced (tests/optim_reference.h,
 * the anchor), interleaved in one invocation: each repetition times the reference and the
 * kernel back to back on the same state, so a change of machine speed hits both alike.
 *
 *   build/optim-kernels-bench [ELEMENTS] [REPS] [STEPS]
 *
 * Prints per case the reference's and the kernel's ns/element (min / median / max over REPS) and
 * the per-repetition ratio reference / kernel (min / median / max). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "optim_reference.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    const char *name;
    ddp_optim_config_t config;
    ddp_dtype_t dtype;
    double grad_scale;
} bench_case_t;

int main(int argc, char **argv)
{
    size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 830000;
    int reps = argc > 2 ? atoi(argv[2]) : 7, steps = argc > 3 ? atoi(argv[3]) : 20;
    if (n == 0 || reps < 1 || reps > 1000 || steps < 1) {
        fprintf(stderr, "usage: optim-kernels-bench [ELEMENTS > 0] [REPS 1..1000] [STEPS > 0]\n");
        return 2;
    }
    const ddp_optim_config_t adamw = {.kind = DDP_OPTIM_ADAMW, .lr = 1e-3, .beta1 = 0.9,
                                      .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    ddp_optim_config_t adam_ams = adamw, sgd = {.kind = DDP_OPTIM_SGD, .lr = 0.1,
                                                .momentum = 0.9, .nesterov = 1};
    adam_ams.kind = DDP_OPTIM_ADAM;
    adam_ams.amsgrad = 1;
    const bench_case_t cases[] = {
        {"adamw f32 (clipped)", adamw, DDP_F32, 0.5},
        {"adamw f32", adamw, DDP_F32, 1.0},
        {"adam+amsgrad f32", adam_ams, DDP_F32, 1.0},
        {"sgd nesterov f32", sgd, DDP_F32, 1.0},
        {"adamw f64", adamw, DDP_F64, 1.0},
        {"adamw bf16", adamw, DDP_BF16, 0.5},
        {"adamw f16", adamw, DDP_F16, 0.5},
    };
    printf("elements %zu, reps %d, %d steps per timing\n", n, reps, steps);
    printf("%-22s %-26s %-26s %s\n", "case", "reference ns/el min/med/max",
           "kernel ns/el min/med/max", "ratio ref/kernel min/med/max");
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const bench_case_t *bc = &cases[c];
        size_t es = ddp_dtype_size(bc->dtype);
        unsigned char *param = malloc(n * es), *grad = malloc(n * es);
        if (!param || !grad) return 1;
        for (size_t i = 0; i < n; i++) {
            double x = ((double)(i % 1000) - 500.0) * 1e-3, gx = ((double)(i % 377) - 188.0) * 1e-4;
            switch (bc->dtype) {
            case DDP_F32: ((float *)param)[i] = (float)x; ((float *)grad)[i] = (float)gx; break;
            case DDP_F64: ((double *)param)[i] = x; ((double *)grad)[i] = gx; break;
            case DDP_BF16:
                ((uint16_t *)param)[i] = ddp_f32_to_bf16((float)x);
                ((uint16_t *)grad)[i] = ddp_f32_to_bf16((float)gx);
                break;
            default:
                ((uint16_t *)param)[i] = ddp_f32_to_f16((float)x);
                ((uint16_t *)grad)[i] = ddp_f32_to_f16((float)gx);
                break;
            }
        }
        ddp__optim_run_t run = {.count = n};
        if (ddp__optim_run_alloc(&run, &bc->config, bc->dtype, param) != DDP_OK) return 1;
        double *ref_ns = malloc(sizeof(double) * (size_t)reps);
        double *new_ns = malloc(sizeof(double) * (size_t)reps);
        double *ratio = malloc(sizeof(double) * (size_t)reps);
        if (!ref_ns || !new_ns || !ratio) return 1;
        /* One untimed step of each to fault the pages in. */
        ref_update(&run, &bc->config, bc->dtype, param, param, grad, bc->grad_scale);
        ddp__optim_run_update_to(&run, &bc->config, bc->dtype, param, param, grad,
                                 bc->grad_scale);
        for (int r = 0; r < reps; r++) {
            /* Alternate which goes first, so neither always follows the other's cache state. */
            for (int k = 0; k < 2; k++) {
                int use_ref = (k == 0) == (r % 2 == 0);
                double t0 = now();
                for (int s = 0; s < steps; s++) {
                    if (use_ref)
                        ref_update(&run, &bc->config, bc->dtype, param, param, grad,
                                   bc->grad_scale);
                    else
                        ddp__optim_run_update_to(&run, &bc->config, bc->dtype, param, param,
                                                 grad, bc->grad_scale);
                }
                double ns = (now() - t0) * 1e9 / ((double)steps * (double)n);
                if (use_ref) ref_ns[r] = ns;
                else new_ns[r] = ns;
            }
            ratio[r] = ref_ns[r] / new_ns[r];
        }
        qsort(ref_ns, (size_t)reps, sizeof *ref_ns, cmp);
        qsort(new_ns, (size_t)reps, sizeof *new_ns, cmp);
        qsort(ratio, (size_t)reps, sizeof *ratio, cmp);
        int mid = reps / 2;
        printf("%-22s %6.2f %6.2f %6.2f       %6.2f %6.2f %6.2f       %5.2f %5.2f %5.2f\n",
               bc->name, ref_ns[0], ref_ns[mid], ref_ns[reps - 1], new_ns[0], new_ns[mid],
               new_ns[reps - 1], ratio[0], ratio[mid], ratio[reps - 1]);
        fflush(stdout);
        ddp__optim_run_free(&run);
        free(param);
        free(grad);
        free(ref_ns);
        free(new_ns);
        free(ratio);
    }
    /* The gradient norm's sum of squares (clipping), unchanged: a serial sum in double, whose
     * order is part of its bits; timed for scale beside the update. */
    float *g = malloc(n * sizeof *g);
    double *ns = malloc(sizeof(double) * (size_t)reps), sink = 0.0;
    if (!g || !ns) return 1;
    for (size_t i = 0; i < n; i++) g[i] = (float)(((double)(i % 377) - 188.0) * 1e-4);
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        for (int s = 0; s < steps; s++) sink += ddp__optim_grad_sumsq(DDP_F32, g, n);
        ns[r] = (now() - t0) * 1e9 / ((double)steps * (double)n);
    }
    qsort(ns, (size_t)reps, sizeof *ns, cmp);
    printf("%-22s %6.2f %6.2f %6.2f   (unchanged; sum %g)\n", "grad sumsq f32", ns[0],
           ns[reps / 2], ns[reps - 1], sink);
    free(g);
    free(ns);
    return 0;
}
