/* The optimizer update kernels (SGD, Adam, AdamW) on one run of elements, shared by the plain
 * optimizer and ZeRO. They are written so that GCC vectorises them without changing a bit: one
 * loop per combination of options, no aliasing the compiler must assume, no FMA contraction. */
#include <math.h>
#include <stdint.h>

#include "core/half.h"
#include "core/internal.h"
#include "shard/shard_internal.h"

/* This file is built with -ffp-contract=off (a fused multiply-add rounds once where the
 * reference rounds twice) and -fno-math-errno (otherwise sqrt() keeps a scalar call to set errno
 * on a negative input, which stops vectorisation; the value computed is the same IEEE sqrt).
 * See CMakeLists.txt. Never -ffast-math: it reorders the arithmetic. */
#if defined(__FAST_MATH__)
#error "optim_kernels.c must not be built with -ffast-math: the updates must stay bitwise exact"
#endif

/* AVX2 machines get a clone doing 4 doubles per instruction (the "avx2" target enables no FMA,
 * and -ffp-contract=off would forbid it anyway); others the baseline SSE2 loops. Not under a
 * sanitizer: the ifunc resolver runs while the loader relocates, before the sanitizer's runtime
 * is set up (examples/gpt/model.c found a TSan build crashing there). */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define OPTIM_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define OPTIM_SANITIZED 1
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) &&                     \
    !defined(OPTIM_SANITIZED)
#if __has_attribute(target_clones)
#define OPTIM_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef OPTIM_CLONES
#define OPTIM_CLONES
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- the arithmetic -------------------------------------------------------------------------
 * Every element is computed in double and each stored value rounded once to the working type S,
 * at the points where torch stores a tensor (the momentum buffer, the moments, AdamW's decayed
 * parameter), so the result depends only on the inputs, never on how the elements were split
 * into runs, and stays within the working type's rounding of torch's f32 arithmetic.
 *
 * The bodies take their options as int arguments that are compile-time constants at every call
 * (the dispatchers below branch once per run, not per element), so each inlined copy is a
 * straight loop the vectoriser accepts. m, v, vmax and the gradient never alias the parameter or
 * the output; p and out are either the same array (in place) or disjoint, and each case gets its
 * own copy so the compiler needs no run-time overlap check that would send p == out to the scalar
 * loop. Operation order is the reference's exactly: (1 - b2) * d * d is ((1 - b2) * d) * d. */
#define DEFINE_BODIES(suffix, S)                                                                  \
    ALWAYS_INLINE void sgd_body_##suffix(const S *p, S *out, const S *restrict g,                 \
                                         S *restrict m, size_t n, double gs, double wd,           \
                                         double lr, double mu, double damp, int scale,            \
                                         int momentum, int first, int nesterov)                   \
    {                                                                                             \
        for (size_t i = 0; i < n; i++) {                                                          \
            double gi = (double)g[i];                                                             \
            if (scale) gi = (double)(S)(gi * gs);                                                 \
            double d = gi + wd * (double)p[i];                                                    \
            if (momentum) {                                                                       \
                S b = (S)(first ? d : mu * (double)m[i] + damp * d);                              \
                m[i] = b;                                                                         \
                d = nesterov ? d + mu * (double)b : (double)b;                                    \
            }                                                                                     \
            out[i] = (S)((double)p[i] - lr * d);                                                  \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    ALWAYS_INLINE void adam_body_##suffix(const S *p, S *out, const S *restrict g,                \
                                          S *restrict m, S *restrict v, S *restrict vmax,         \
                                          size_t n, double gs, double wd, double decay,           \
                                          double b1, double b2, double step, double c2,           \
                                          double eps, int scale, int decoupled, int amsgrad)      \
    {                                                                                             \
        const double a1 = 1.0 - b1, a2 = 1.0 - b2;                                                \
        for (size_t i = 0; i < n; i++) {                                                          \
            double gi = (double)g[i];                                                             \
            if (scale) gi = (double)(S)(gi * gs);                                                 \
            double pi = (double)p[i], d;                                                          \
            if (decoupled) {                                                                      \
                pi = (double)(S)(pi * decay);                                                     \
                d = gi;                                                                           \
            } else {                                                                              \
                d = gi + wd * pi;                                                                 \
            }                                                                                     \
            S mi = (S)(b1 * (double)m[i] + a1 * d);                                               \
            S vs = (S)(b2 * (double)v[i] + a2 * d * d);                                           \
            m[i] = mi;                                                                            \
            v[i] = vs;                                                                            \
            double vi = (double)vs;                                                               \
            if (amsgrad) {                                                                        \
                /* A store either way (of the old value when it stays), so no branch. */         \
                S vm = vmax[i];                                                                   \
                vm = (vi > (double)vm || vi != vi) ? vs : vm;                                     \
                vmax[i] = vm;                                                                     \
                vi = (double)vm;                                                                  \
            }                                                                                     \
            double denom = sqrt(vi) / c2 + eps;                                                   \
            out[i] = (S)(pi - step * (double)mi / denom);                                         \
        }                                                                                         \
    }

DEFINE_BODIES(f32, float)
DEFINE_BODIES(f64, double)

/* One straight loop per option combination, in place or not: the constants make each call a
 * specialised copy. */
#define SGD_CASE(suffix, sc, mo, fi, ne)                                                          \
    do {                                                                                          \
        if (inplace)                                                                              \
            sgd_body_##suffix(out, out, g, m, n, gs, wd, lr, mu, damp, sc, mo, fi, ne);           \
        else                                                                                      \
            sgd_body_##suffix(p, out, g, m, n, gs, wd, lr, mu, damp, sc, mo, fi, ne);             \
    } while (0)

#define ADAM_CASE(suffix, sc, de, am)                                                             \
    do {                                                                                          \
        if (inplace)                                                                              \
            adam_body_##suffix(out, out, g, m, v, vmax, n, gs, wd, decay, b1, b2, step, c2, eps,  \
                               sc, de, am);                                                       \
        else                                                                                      \
            adam_body_##suffix(p, out, g, m, v, vmax, n, gs, wd, decay, b1, b2, step, c2, eps,    \
                               sc, de, am);                                                       \
    } while (0)

#define DEFINE_UPDATE(suffix, S)                                                                  \
    OPTIM_CLONES static void sgd_##suffix(const S *p, S *out, const S *restrict g,                \
                                          S *restrict m, size_t n, double gs, double wd,          \
                                          double lr, double mu, double damp, int scale,           \
                                          int first, int nesterov)                                \
    {                                                                                             \
        const int inplace = p == out;                                                             \
        if (!m) {                                                                                 \
            if (scale) SGD_CASE(suffix, 1, 0, 0, 0);                                              \
            else SGD_CASE(suffix, 0, 0, 0, 0);                                                    \
            return;                                                                               \
        }                                                                                         \
        switch (scale * 4 + first * 2 + nesterov) {                                               \
        case 0: SGD_CASE(suffix, 0, 1, 0, 0); break;                                              \
        case 1: SGD_CASE(suffix, 0, 1, 0, 1); break;                                              \
        case 2: SGD_CASE(suffix, 0, 1, 1, 0); break;                                              \
        case 3: SGD_CASE(suffix, 0, 1, 1, 1); break;                                              \
        case 4: SGD_CASE(suffix, 1, 1, 0, 0); break;                                              \
        case 5: SGD_CASE(suffix, 1, 1, 0, 1); break;                                              \
        case 6: SGD_CASE(suffix, 1, 1, 1, 0); break;                                              \
        default: SGD_CASE(suffix, 1, 1, 1, 1); break;                                             \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    OPTIM_CLONES static void adam_##suffix(const S *p, S *out, const S *restrict g,               \
                                           S *restrict m, S *restrict v, S *restrict vmax,        \
                                           size_t n, double gs, double wd, double decay,          \
                                           double b1, double b2, double step, double c2,          \
                                           double eps, int scale, int decoupled)                  \
    {                                                                                             \
        const int inplace = p == out;                                                             \
        switch (scale * 4 + decoupled * 2 + (vmax != NULL)) {                                     \
        case 0: ADAM_CASE(suffix, 0, 0, 0); break;                                                \
        case 1: ADAM_CASE(suffix, 0, 0, 1); break;                                                \
        case 2: ADAM_CASE(suffix, 0, 1, 0); break;                                                \
        case 3: ADAM_CASE(suffix, 0, 1, 1); break;                                                \
        case 4: ADAM_CASE(suffix, 1, 0, 0); break;                                                \
        case 5: ADAM_CASE(suffix, 1, 0, 1); break;                                                \
        case 6: ADAM_CASE(suffix, 1, 1, 0); break;                                                \
        default: ADAM_CASE(suffix, 1, 1, 1); break;                                               \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static void update_##suffix(const ddp_optim_config_t *c, uint64_t t, const S *p, S *out,      \
                                const S *g, double gscale, S *m, S *v, S *vmax, size_t n)         \
    {                                                                                             \
        const int scale = gscale != 1.0;                                                          \
        const double gs = (double)(S)gscale, lr = c->lr, wd = c->weight_decay;                    \
        if (c->kind == DDP_OPTIM_SGD) {                                                           \
            sgd_##suffix(p, out, g, m, n, gs, wd, lr, c->momentum, 1.0 - c->dampening, scale,     \
                         t == 1, c->nesterov != 0);                                               \
            return;                                                                               \
        }                                                                                         \
        const double b1 = c->beta1, b2 = c->beta2;                                                \
        const double step = lr / (1.0 - pow(b1, (double)t));                                     \
        const double c2 = sqrt(1.0 - pow(b2, (double)t));                                        \
        adam_##suffix(p, out, g, m, v, vmax, n, gs, wd, 1.0 - lr * wd, b1, b2, step, c2, c->eps,  \
                      scale, c->kind == DDP_OPTIM_ADAMW);                                         \
    }

DEFINE_UPDATE(f32, float)
DEFINE_UPDATE(f64, double)

/* Half-precision gradients are widened to f32 a block at a time (exactly: every f16 and bf16 is
 * an f32), then take the f32 kernel; a block on the stack stays in L1 beside the state. */
#define HALF_BLOCK 1024

void ddp__optim_run_update_to(ddp__optim_run_t *run, const ddp_optim_config_t *config,
                              ddp_dtype_t dtype, const void *param, void *out, const void *grad,
                              double grad_scale)
{
    ++run->steps;
    ddp__optim_run_update_range(run, config, dtype, param, out, grad, grad_scale, 0, run->count);
}

void ddp__optim_run_update_range(const ddp__optim_run_t *run, const ddp_optim_config_t *config,
                                 ddp_dtype_t dtype, const void *param, void *out,
                                 const void *grad, double grad_scale, size_t first, size_t n)
{
    uint64_t t = run->steps;
    if (n == 0) return;
    float *m32 = run->m ? (float *)run->m + first : NULL;
    float *v32 = run->v ? (float *)run->v + first : NULL;
    float *x32 = run->vmax ? (float *)run->vmax + first : NULL;
    switch (dtype) {
    case DDP_F32:
        update_f32(config, t, param, out, grad, grad_scale, m32, v32, x32, n);
        break;
    case DDP_F64: {
        double *m = run->m ? (double *)run->m + first : NULL;
        double *v = run->v ? (double *)run->v + first : NULL;
        double *x = run->vmax ? (double *)run->vmax + first : NULL;
        update_f64(config, t, param, out, grad, grad_scale, m, v, x, n);
        break;
    }
    case DDP_BF16:
    case DDP_F16: {
        /* The master copy is the parameter; the model gets it rounded to nearest even. */
        const uint16_t *g = grad;
        float block[HALF_BLOCK];
        float *master = run->master + first;
        for (size_t i = 0; i < n; i += HALF_BLOCK) {
            size_t k = n - i < HALF_BLOCK ? n - i : HALF_BLOCK;
            ddp__half_to_f32(dtype, g + i, block, k);
            update_f32(config, t, master + i, master + i, block, grad_scale,
                       m32 ? m32 + i : NULL, v32 ? v32 + i : NULL, x32 ? x32 + i : NULL, k);
        }
        ddp__f32_to_half(dtype, master, out, n);
        break;
    }
    default:
        break; /* refused at create */
    }
}
