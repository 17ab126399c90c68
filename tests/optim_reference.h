/* A plain scalar copy of the optimizer update loop as it was before vectorisation (libddp's
 * src/shard/optim.c until the kernels moved to optim_kernels.c), kept verbatim: the reference
 * tests/test_optim_kernels.c compares the kernels' bits against and bench/optim_kernels.c times
 * them against. Per element in double, branches per element. */
#ifndef DDP_TEST_OPTIM_REFERENCE_H
#define DDP_TEST_OPTIM_REFERENCE_H

#include <math.h>
#include <stdint.h>

#include "ddp/ddp.h"
#include "shard/shard_internal.h"

#define LOAD_PLAIN(g, i) ((double)(g)[i])
#define LOAD_BF16(g, i) ((double)ddp_bf16_to_f32((g)[i]))
#define LOAD_F16(g, i) ((double)ddp_f16_to_f32((g)[i]))

#define DEFINE_REFERENCE(suffix, S, G, LOAD)                                                      \
    static void ref_##suffix(const ddp_optim_config_t *c, uint64_t t, const S *p, S *out,         \
                             const G *g, double gscale, S *m, S *v, S *vmax, size_t n)            \
    {                                                                                             \
        const int scale = gscale != 1.0;                                                          \
        const double gs = (double)(S)gscale, lr = c->lr, wd = c->weight_decay;                    \
        if (c->kind == DDP_OPTIM_SGD) {                                                           \
            const double mu = c->momentum, damp = 1.0 - c->dampening;                             \
            for (size_t i = 0; i < n; i++) {                                                      \
                double gi = LOAD(g, i);                                                           \
                if (scale) gi = (double)(S)(gi * gs);                                             \
                double d = gi + wd * (double)p[i];                                                \
                if (m) {                                                                          \
                    double b = t == 1 ? d : mu * (double)m[i] + damp * d;                         \
                    m[i] = (S)b;                                                                  \
                    b = (double)m[i];                                                             \
                    d = c->nesterov ? d + mu * b : b;                                             \
                }                                                                                 \
                out[i] = (S)((double)p[i] - lr * d);                                              \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        const double b1 = c->beta1, b2 = c->beta2, eps = c->eps;                                  \
        const double step = lr / (1.0 - pow(b1, (double)t));                                     \
        const double c2 = sqrt(1.0 - pow(b2, (double)t));                                        \
        const int decoupled = c->kind == DDP_OPTIM_ADAMW;                                         \
        const double decay = 1.0 - lr * wd;                                                       \
        for (size_t i = 0; i < n; i++) {                                                          \
            double gi = LOAD(g, i);                                                               \
            if (scale) gi = (double)(S)(gi * gs);                                                 \
            double pi = (double)p[i], d;                                                          \
            if (decoupled) {                                                                      \
                pi = (double)(S)(pi * decay);                                                     \
                d = gi;                                                                           \
            } else {                                                                              \
                d = gi + wd * pi;                                                                 \
            }                                                                                     \
            m[i] = (S)(b1 * (double)m[i] + (1.0 - b1) * d);                                       \
            v[i] = (S)(b2 * (double)v[i] + (1.0 - b2) * d * d);                                   \
            double vi = (double)v[i];                                                             \
            if (vmax) {                                                                           \
                if (vi > (double)vmax[i] || vi != vi) vmax[i] = v[i];                             \
                vi = (double)vmax[i];                                                             \
            }                                                                                     \
            double denom = sqrt(vi) / c2 + eps;                                                   \
            out[i] = (S)(pi - step * (double)m[i] / denom);                                       \
        }                                                                                         \
    }

DEFINE_REFERENCE(f32, float, float, LOAD_PLAIN)
DEFINE_REFERENCE(f64, double, double, LOAD_PLAIN)
DEFINE_REFERENCE(bf16, float, uint16_t, LOAD_BF16)
DEFINE_REFERENCE(f16, float, uint16_t, LOAD_F16)

/* The reference's ddp__optim_run_update_to. */
static void ref_update(ddp__optim_run_t *run, const ddp_optim_config_t *c, ddp_dtype_t dtype,
                       const void *param, void *out, const void *grad, double gscale)
{
    uint64_t t = ++run->steps;
    size_t n = run->count;
    if (n == 0) return;
    switch (dtype) {
    case DDP_F32: ref_f32(c, t, param, out, grad, gscale, run->m, run->v, run->vmax, n); break;
    case DDP_F64: ref_f64(c, t, param, out, grad, gscale, run->m, run->v, run->vmax, n); break;
    default: {
        if (dtype == DDP_BF16)
            ref_bf16(c, t, run->master, run->master, grad, gscale, run->m, run->v, run->vmax, n);
        else
            ref_f16(c, t, run->master, run->master, grad, gscale, run->m, run->v, run->vmax, n);
        uint16_t *h = out;
        for (size_t i = 0; i < n; i++)
            h[i] = dtype == DDP_BF16 ? ddp_f32_to_bf16(run->master[i])
                                     : ddp_f32_to_f16(run->master[i]);
    }
    }
}

#endif
