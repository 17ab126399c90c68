/* A GPT-2-style decoder, forward and backward written out by hand (in the spirit of llm.c's CPU
 * trainer): embeddings, blocks of layer norm, causal self-attention, residual, layer norm, GELU
 * MLP, residual, then a final layer norm and the LM head tied to the token embedding. Matrix
 * products go through cblas_sgemm; attention, norms and GELU are plain loops. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "gpt.h"

/* Pointers into the activation block for the current B, T (laid out for max_batch x context). */
typedef struct layer_acts {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *res2, *ln2, *ln2_mean, *ln2_rstd,
        *fch, *fch_gelu, *res3;
} layer_acts_t;

static size_t layer_acts_numel(size_t N, size_t C, size_t NH, size_t B, size_t T)
{
    return N * C * 5 + N * 4 + N * 3 * C + B * NH * T * T + N * 4 * C * 2;
}

static layer_acts_t layer_acts(const gpt_t *m, size_t l)
{
    size_t B = m->max_batch, T = m->cfg.context, C = m->cfg.channels, NH = m->cfg.heads;
    size_t N = B * T;
    float *p = m->acts + N * C + l * layer_acts_numel(N, C, NH, B, T);
    layer_acts_t a;
    a.ln1 = p, p += N * C;
    a.ln1_mean = p, p += N;
    a.ln1_rstd = p, p += N;
    a.qkv = p, p += N * 3 * C;
    a.att = p, p += B * NH * T * T;
    a.atty = p, p += N * C;
    a.res2 = p, p += N * C;
    a.ln2 = p, p += N * C;
    a.ln2_mean = p, p += N;
    a.ln2_rstd = p, p += N;
    a.fch = p, p += N * 4 * C;
    a.fch_gelu = p, p += N * 4 * C;
    a.res3 = p;
    return a;
}

/* encoded (N*C) | layers | lnf (N*C), lnf_mean, lnf_rstd (N each) | logits (N*V) */
static float *encoded(const gpt_t *m) { return m->acts; }
static float *lnf_out(const gpt_t *m)
{
    size_t N = m->max_batch * m->cfg.context, C = m->cfg.channels;
    return m->acts + N * C +
           m->cfg.layers * layer_acts_numel(N, C, m->cfg.heads, m->max_batch, m->cfg.context);
}
static float *lnf_mean(const gpt_t *m) { return lnf_out(m) + m->max_batch * m->cfg.context * m->cfg.channels; }
static float *lnf_rstd(const gpt_t *m) { return lnf_mean(m) + m->max_batch * m->cfg.context; }
static float *logits_buf(const gpt_t *m) { return lnf_rstd(m) + m->max_batch * m->cfg.context; }

const float *gpt_logits(const gpt_t *m) { return logits_buf(m); }

uint64_t gpt_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return ((gpt_splitmix64(s) >> 11) + 0.5) * 0x1.0p-53; }

static float normal(uint64_t *s, float stddev)
{
    double u1 = uniform01(s), u2 = uniform01(s);
    return (float)(stddev * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

int gpt_create(const gpt_config_t *cfg, size_t max_batch, uint64_t seed, gpt_t *out, char *err,
               size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (cfg->layers == 0 || cfg->heads == 0 || cfg->channels == 0 || cfg->context == 0 ||
        max_batch == 0) {
        snprintf(err, errlen, "layers, heads, channels, context and batch must be > 0");
        return -1;
    }
    if (cfg->channels % cfg->heads != 0) {
        snprintf(err, errlen, "channels (%zu) must be a multiple of heads (%zu)", cfg->channels,
                 cfg->heads);
        return -1;
    }
    out->cfg = *cfg;
    out->max_batch = max_batch;
    size_t L = cfg->layers, C = cfg->channels, T = cfg->context, V = GPT_VOCAB;
    out->ntensors = 2 + GPT_LAYER_TENSORS * L + 2;
    out->tensors = calloc(out->ntensors, sizeof *out->tensors);
    if (!out->tensors) goto oom;
    static const char *const kind_names[GPT_LAYER_TENSORS] = {
        "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
        "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.fc.weight", "mlp.fc.bias",
        "mlp.proj.weight", "mlp.proj.bias"};
    const size_t kind_numel[GPT_LAYER_TENSORS] = {C, C, 3 * C * C, 3 * C, C * C, C,
                                                  C, C, 4 * C * C, 4 * C, C * 4 * C, C};
    const size_t kind_rows[GPT_LAYER_TENSORS] = {0, 0, 3 * C, 0, C, 0, 0, 0, 4 * C, 0, C, 0};
    size_t off = 0;
    gpt_tensor_t *t = out->tensors;
#define ADD(idx, nm, n, r)                                                                        \
    do {                                                                                          \
        snprintf(t[idx].name, sizeof t[idx].name, "%s", nm);                                      \
        t[idx].offset = off, t[idx].numel = (n), t[idx].rows = (r);                               \
        off += (n);                                                                               \
    } while (0)
    ADD(GPT_WTE, "wte", V * C, V);
    ADD(GPT_WPE, "wpe", T * C, T);
    for (size_t l = 0; l < L; l++)
        for (int k = 0; k < GPT_LAYER_TENSORS; k++) {
            char nm[32];
            snprintf(nm, sizeof nm, "h%zu.%s", l, kind_names[k]);
            ADD(GPT_T(l, k), nm, kind_numel[k], kind_rows[k]);
        }
    ADD(GPT_LNFW(out), "lnf.weight", C, 0);
    ADD(GPT_LNFB(out), "lnf.bias", C, 0);
#undef ADD
    out->nparams = off;
    out->params = malloc(off * sizeof(float));
    out->param_at = calloc(out->ntensors, sizeof *out->param_at);
    out->grad_at = calloc(out->ntensors, sizeof *out->grad_at);
    size_t N = max_batch * T;
    out->acts_numel = N * C + L * layer_acts_numel(N, C, cfg->heads, max_batch, T) + N * C +
                      2 * N + N * V;
    out->acts = malloc(out->acts_numel * sizeof(float));
    /* backward scratch: dresidual, dln (N*C each), dqkv (3C), datty (C), dfch (4C), dfch_gelu
     * (4C), datt (B*NH*T*T), dlogits (N*V) */
    out->dacts_numel = N * C * 4 + N * 3 * C + N * 8 * C + max_batch * cfg->heads * T * T + N * V;
    out->dacts = malloc(out->dacts_numel * sizeof(float));
    if (!out->params || !out->acts || !out->dacts || !out->param_at || !out->grad_at) goto oom;
    for (size_t i = 0; i < out->ntensors; i++) out->param_at[i] = out->params + t[i].offset;

    uint64_t s = seed;
    float resid_std = 0.02f / sqrtf(2.0f * (float)L);
    for (size_t i = 0; i < out->ntensors; i++) {
        float *p = out->params + t[i].offset;
        int k = i >= 2 && i < 2 + GPT_LAYER_TENSORS * L ? (int)((i - 2) % GPT_LAYER_TENSORS) : -1;
        int is_norm_w = k == GPT_LN1W || k == GPT_LN2W || i == GPT_LNFW(out);
        if (is_norm_w) {
            for (size_t j = 0; j < t[i].numel; j++) p[j] = 1.0f;
        } else if (t[i].rows == 0) {
            memset(p, 0, t[i].numel * sizeof(float));
        } else {
            float sd = k == GPT_ATTPROJW || k == GPT_FCPROJW ? resid_std : 0.02f;
            for (size_t j = 0; j < t[i].numel; j++) p[j] = normal(&s, sd);
        }
    }
    return 0;
oom:
    snprintf(err, errlen, "out of memory for the model (%zu layers, %zu channels, batch %zu)",
             L, C, max_batch);
    gpt_destroy(out);
    return -1;
}

void gpt_destroy(gpt_t *m)
{
    free(m->tensors);
    free(m->params);
    free(m->param_at);
    free(m->grad_at);
    free(m->acts);
    free(m->dacts);
    memset(m, 0, sizeof *m);
}

const char *const gpt_phase_names[GPT_NPHASES] = {
    "matmul forward", "matmul backward", "attention forward", "attention backward",
    "layernorm", "gelu", "softmax + loss", "embeddings, residuals"};

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs the statement (variadic: it may hold commas), adding its time to phase when the model is profiled (one clock read each side;
 * off, it costs a branch). */
#define TIMED(m, phase, ...)                                                                      \
    do {                                                                                          \
        double t0_ = (m)->profile ? seconds_now() : 0;                                            \
        __VA_ARGS__;                                                                              \
        if ((m)->profile) (m)->phase_seconds[phase] += seconds_now() - t0_;                       \
    } while (0)

/* ---- kernels ---------------------------------------------------------------------------------- */

/* Row reductions in LANES independent partial sums, combined at the end: a single running sum
 * is a chain of dependent adds (latency-bound, and the compiler may not reorder it into
 * vectors), lanes run at vector speed. In float: rows here are C (or 256) values, whose sum in 8
 * lanes is within about 1e-7 relative of the exact one. Layer norm and the loss took 2x and 5x
 * PyTorch's time with double running sums (docs/gpt.md). */
#define LANES 8

static inline float sum_lanes(const float *x, size_t n)
{
    float acc[LANES] = {0};
    size_t full = n - n % LANES;
    for (size_t i = 0; i < full; i += LANES)
        for (size_t k = 0; k < LANES; k++) acc[k] += x[i + k];
    float s = 0;
    for (size_t i = full; i < n; i++) s += x[i];
    for (size_t k = 0; k < LANES; k++) s += acc[k];
    return s;
}

static inline float max_lanes(const float *x, size_t n)
{
    float acc[LANES];
    for (size_t k = 0; k < LANES; k++) acc[k] = x[0];
    size_t full = n - n % LANES;
    for (size_t i = 0; i < full; i += LANES)
        for (size_t k = 0; k < LANES; k++) acc[k] = x[i + k] > acc[k] ? x[i + k] : acc[k];
    float m = x[0];
    for (size_t i = full; i < n; i++) m = x[i] > m ? x[i] : m;
    for (size_t k = 0; k < LANES; k++) m = acc[k] > m ? acc[k] : m;
    return m;
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *w, const float *b, size_t N, size_t C)
{
    for (size_t i = 0; i < N; i++) {
        const float *x = inp + i * C;
        float m = sum_lanes(x, C) / (float)C;
        float acc[LANES] = {0}, v = 0;
        size_t full = C - C % LANES, c;
        for (c = 0; c < full; c += LANES)
            for (size_t k = 0; k < LANES; k++) {
                float d = x[c + k] - m;
                acc[k] += d * d;
            }
        for (c = full; c < C; c++) v += (x[c] - m) * (x[c] - m);
        for (size_t k = 0; k < LANES; k++) v += acc[k];
        v /= (float)C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        float *o = out + i * C;
        for (c = 0; c < C; c++) o[c] = ((x[c] - m) * s) * w[c] + b[c];
        mean[i] = m;
        rstd[i] = s;
    }
}

/* dinp += d(layernorm)/dinp . dout; dw, db accumulated. */
static void layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                               const float *inp, const float *w, const float *mean,
                               const float *rstd, size_t N, size_t C)
{
    for (size_t i = 0; i < N; i++) {
        const float *x = inp + i * C, *g = dout + i * C;
        float mu = mean[i], rs = rstd[i];
        float acc1[LANES] = {0}, acc2[LANES] = {0}, dnorm_mean = 0, dnorm_norm_mean = 0;
        size_t full = C - C % LANES, c;
        for (c = 0; c < full; c += LANES)
            for (size_t k = 0; k < LANES; k++) {
                float norm = (x[c + k] - mu) * rs, dnorm = w[c + k] * g[c + k];
                acc1[k] += dnorm;
                acc2[k] += dnorm * norm;
            }
        for (c = full; c < C; c++) {
            float norm = (x[c] - mu) * rs, dnorm = w[c] * g[c];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        for (size_t k = 0; k < LANES; k++) {
            dnorm_mean += acc1[k];
            dnorm_norm_mean += acc2[k];
        }
        dnorm_mean /= (float)C;
        dnorm_norm_mean /= (float)C;
        float *dx = dinp + i * C;
        for (c = 0; c < C; c++) {
            float norm = (x[c] - mu) * rs;
            float dnorm = w[c] * g[c];
            db[c] += g[c];
            dw[c] += norm * g[c];
            dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
        }
    }
}

/* out[N, OC] = inp[N, IC] . w[OC, IC]^T + bias */
static void matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                           size_t N, size_t IC, size_t OC)
{
    if (bias)
        for (size_t i = 0; i < N; i++) memcpy(out + i * OC, bias, OC * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)OC, (int)IC, 1.0f, inp,
                (int)IC, w, (int)IC, bias ? 1.0f : 0.0f, out, (int)OC);
}

/* dinp[N, IC] += dout . w (dinp may be NULL); dw[OC, IC] += dout^T . inp; dbias += sum rows. */
static void matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, size_t N, size_t IC, size_t OC)
{
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, (int)IC, (int)OC, 1.0f,
                    dout, (int)OC, w, (int)IC, 1.0f, dinp, (int)IC);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)OC, (int)IC, (int)N, 1.0f, dout,
                (int)OC, inp, (int)IC, 1.0f, dw, (int)IC);
    if (dbias)
        for (size_t i = 0; i < N; i++)
            for (size_t o = 0; o < OC; o++) dbias[o] += dout[i * OC + o];
}

/* e^x in a form the compiler vectorises (no call, no branch; libm's tanhf/expf are calls, one
 * element at a time, and GELU's tanh was 40% of a step at the default size: --profile). Used by
 * GELU and the attention softmax. x is
 * clamped to [-87, 87]; x = n ln2 + r with |r| <= ln2/2 (Cody-Waite: ln2 in two parts, so n ln2
 * is exact), e^r by Cephes' expf polynomial (relative error about 1e-7), 2^n built in the
 * exponent bits. */
static inline float exp_vec(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 87.0f ? 87.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* n in [-126, 126]: a normal 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* tanh(u) = 1 - 2 / (e^{2u} + 1): absolute error about 1e-7 (relative error grows near 0,
 * where GELU multiplies it by v and adds 1, so GELU's own error stays at float rounding). */
static inline float tanh_vec(float u)
{
    return 1.0f - 2.0f / (exp_vec(2.0f * u) + 1.0f);
}

/* Causal multi-head attention over qkv (N x 3C: q | k | v, heads side by side in each). att
 * keeps the softmax (B, NH, T, T) for backward, zero above the diagonal. Per sequence and head,
 * the two products (q k^T and att v) are GEMMs on strided views of qkv: the full T x T scores
 * cost twice the causal half's arithmetic, but one BLAS call runs it at several times the speed
 * of the scalar loops this replaced (attention was 12% of a step at the default size). */
static void attention_forward(float *out, float *att, const float *qkv, size_t B, size_t T,
                              size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < NH; h++) {
            const float *q = qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            float *a = att + (b * NH + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)T, (int)hs, scale,
                        q, (int)C3, k, (int)C3, 0.0f, a, (int)T);
            for (size_t t = 0; t < T; t++) {
                float *row = a + t * T;
                float maxv = -INFINITY;
                for (size_t t2 = 0; t2 <= t; t2++)
                    if (row[t2] > maxv) maxv = row[t2];
                float sum = 0;
                for (size_t t2 = 0; t2 <= t; t2++) sum += (row[t2] = exp_vec(row[t2] - maxv));
                float inv = 1.0f / sum;
                for (size_t t2 = 0; t2 < T; t2++) row[t2] = t2 <= t ? row[t2] * inv : 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)hs, (int)T, 1.0f,
                        a, (int)T, v, (int)C3, 0.0f, out + b * T * C + h * hs, (int)C);
        }
}

/* dqkv (zeroed by the caller) from dout; datt is scratch of T*T floats. With P the softmax and
 * dP = dout v^T: dv = P^T dout, dS = P * (dP - rowsum(P * dP)) * scale, dq = dS k, dk = dS^T q
 * (P is zero above the diagonal, so dS is too and the causal mask needs no other care). */
static void attention_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                               const float *att, size_t B, size_t T, size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    for (size_t b = 0; b < B; b++)
        for (size_t h = 0; h < NH; h++) {
            const float *q = qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            float *dq = dqkv + b * T * C3 + h * hs, *dk = dq + C, *dv = dq + 2 * C;
            const float *a = att + (b * NH + h) * T * T, *g = dout + b * T * C + h * hs;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)T, (int)hs, 1.0f,
                        g, (int)C, v, (int)C3, 0.0f, datt, (int)T);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)T, (int)hs, (int)T, 1.0f,
                        a, (int)T, g, (int)C, 1.0f, dv, (int)C3);
            for (size_t t = 0; t < T; t++) {
                const float *p = a + t * T;
                float *d = datt + t * T, dsum = 0;
                for (size_t t2 = 0; t2 <= t; t2++) dsum += p[t2] * d[t2];
                for (size_t t2 = 0; t2 < T; t2++)
                    d[t2] = t2 <= t ? p[t2] * (d[t2] - dsum) * scale : 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)hs, (int)T, 1.0f,
                        datt, (int)T, k, (int)C3, 1.0f, dq, (int)C3);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)T, (int)hs, (int)T, 1.0f,
                        datt, (int)T, q, (int)C3, 1.0f, dk, (int)C3);
        }
}

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

/* GELU's loops are the model's largest work outside BLAS; on x86-64 they are compiled twice,
 * for AVX2 and for the baseline, and the loader picks the one the CPU runs (GCC's function
 * multiversioning: an ifunc). Elementwise and without FMA contraction, so both give the same
 * bits. Not under a sanitizer: the ifunc resolver runs while the loader relocates, before the
 * sanitizer's runtime is set up, and a TSan build crashed there (tried). */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define GPT_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define GPT_SANITIZED 1
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && !defined(GPT_SANITIZED)
#if __has_attribute(target_clones)
#define GPT_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef GPT_VECTOR_CLONES
#define GPT_VECTOR_CLONES
#endif

GPT_VECTOR_CLONES
static void gelu_forward(float *out, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        out[i] = 0.5f * v * (1.0f + tanh_vec(GELU_K * (v + 0.044715f * v * v * v)));
    }
}

GPT_VECTOR_CLONES
static void gelu_backward(float *dx, const float *x, const float *dout, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        float u = GELU_K * (v + 0.044715f * v * v * v);
        float th = tanh_vec(u);
        float sech2 = 1.0f - th * th;
        float d = 0.5f * (1.0f + th) + 0.5f * v * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * v * v);
        dx[i] = d * dout[i];
    }
}

/* ---- the model --------------------------------------------------------------------------------- */

#define P(m, i) ((m)->param_at[i])

double gpt_forward(gpt_t *m, const int *tokens, const int *targets, size_t B, size_t T)
{
    size_t C = m->cfg.channels, NH = m->cfg.heads, L = m->cfg.layers, V = GPT_VOCAB;
    size_t N = B * T;
    m->B = B, m->T = T, m->targets = targets;
    /* activations are laid out for (max_batch, context); a smaller B, T uses their starts */
    float *x = encoded(m);
    const float *wte = P(m, GPT_WTE), *wpe = P(m, GPT_WPE);
    TIMED(m, GPT_PHASE_ELEMENTWISE,
          for (size_t b = 0; b < B; b++)
              for (size_t t = 0; t < T; t++) {
                  float *o = x + (b * T + t) * C;
                  const float *te = wte + (size_t)tokens[b * T + t] * C, *pe = wpe + t * C;
                  for (size_t c = 0; c < C; c++) o[c] = te[c] + pe[c];
              });
    const float *res = x;
    for (size_t l = 0; l < L; l++) {
        if (m->layer_hook && (m->hook_rc = m->layer_hook(m->hook_ctx, l, GPT_HOOK_FORWARD)))
            return NAN;
        layer_acts_t a = layer_acts(m, l);
        TIMED(m, GPT_PHASE_LAYERNORM,
              layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, res, P(m, GPT_T(l, GPT_LN1W)),
                                P(m, GPT_T(l, GPT_LN1B)), N, C));
        TIMED(m, GPT_PHASE_MATMUL_FWD,
              matmul_forward(a.qkv, a.ln1, P(m, GPT_T(l, GPT_QKVW)), P(m, GPT_T(l, GPT_QKVB)),
                             N, C, 3 * C));
        TIMED(m, GPT_PHASE_ATTN_FWD, attention_forward(a.atty, a.att, a.qkv, B, T, C, NH));
        TIMED(m, GPT_PHASE_MATMUL_FWD,
              matmul_forward(a.res2, a.atty, P(m, GPT_T(l, GPT_ATTPROJW)),
                             P(m, GPT_T(l, GPT_ATTPROJB)), N, C, C));
        TIMED(m, GPT_PHASE_ELEMENTWISE, for (size_t i = 0; i < N * C; i++) a.res2[i] += res[i]);
        TIMED(m, GPT_PHASE_LAYERNORM,
              layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, P(m, GPT_T(l, GPT_LN2W)),
                                P(m, GPT_T(l, GPT_LN2B)), N, C));
        TIMED(m, GPT_PHASE_MATMUL_FWD,
              matmul_forward(a.fch, a.ln2, P(m, GPT_T(l, GPT_FCW)), P(m, GPT_T(l, GPT_FCB)), N,
                             C, 4 * C));
        TIMED(m, GPT_PHASE_GELU, gelu_forward(a.fch_gelu, a.fch, N * 4 * C));
        TIMED(m, GPT_PHASE_MATMUL_FWD,
              matmul_forward(a.res3, a.fch_gelu, P(m, GPT_T(l, GPT_FCPROJW)),
                             P(m, GPT_T(l, GPT_FCPROJB)), N, 4 * C, C));
        TIMED(m, GPT_PHASE_ELEMENTWISE,
              for (size_t i = 0; i < N * C; i++) a.res3[i] += a.res2[i]);
        res = a.res3;
        if (m->layer_hook && (m->hook_rc = m->layer_hook(m->hook_ctx, l, GPT_HOOK_FORWARD_DONE)))
            return NAN;
    }
    TIMED(m, GPT_PHASE_LAYERNORM,
          layernorm_forward(lnf_out(m), lnf_mean(m), lnf_rstd(m), res, P(m, GPT_LNFW(m)),
                            P(m, GPT_LNFB(m)), N, C));
    float *logits = logits_buf(m);
    TIMED(m, GPT_PHASE_MATMUL_FWD, matmul_forward(logits, lnf_out(m), wte, NULL, N, C, V));
    if (!targets) return NAN;
    double t_loss = m->profile ? seconds_now() : 0;
    double loss = 0; /* the sum over N rows in double; each row's log-sum-exp in float */
    for (size_t i = 0; i < N; i++) {
        const float *z = logits + i * V;
        float maxv = max_lanes(z, V), acc[LANES] = {0}, sum = 0;
        size_t full = V - V % LANES;
        for (size_t v = 0; v < full; v += LANES)
            for (size_t k = 0; k < LANES; k++) acc[k] += exp_vec(z[v + k] - maxv);
        for (size_t v = full; v < V; v++) sum += exp_vec(z[v] - maxv);
        for (size_t k = 0; k < LANES; k++) sum += acc[k];
        loss += log((double)sum) + maxv - z[targets[i]];
    }
    if (m->profile) m->phase_seconds[GPT_PHASE_SOFTMAX_LOSS] += seconds_now() - t_loss;
    return loss / (double)N;
}

/* matmul_backward for a block matrix: dW in GPT_GRAD_TILES row tiles, each reported through
 * rows when given. dW rows [r0, r1) = dout[:, r0:r1]^T . inp. */
static int matmul_backward_tiled(float *dinp, float *dw, float *dbias, const float *dout,
                                 const float *inp, const float *w, size_t N, size_t IC,
                                 size_t OC, size_t tensor, gpt_rows_fn rows, void *ctx)
{
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, (int)IC, (int)OC, 1.0f,
                    dout, (int)OC, w, (int)IC, 1.0f, dinp, (int)IC);
    if (dbias)
        for (size_t i = 0; i < N; i++)
            for (size_t o = 0; o < OC; o++) dbias[o] += dout[i * OC + o];
    /* highest rows first: the order the Reducer's pieces are learned in does not matter, but
     * finishing a tile early is the point */
    for (size_t k = GPT_GRAD_TILES; k-- > 0;) {
        size_t r0 = OC * k / GPT_GRAD_TILES, r1 = OC * (k + 1) / GPT_GRAD_TILES;
        if (r1 == r0) continue;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(r1 - r0), (int)IC, (int)N,
                    1.0f, dout + r0, (int)OC, inp, (int)IC, 1.0f, dw + r0 * IC, (int)IC);
        int rc;
        if (rows && (rc = rows(ctx, tensor, r0, r1))) return rc;
    }
    return 0;
}

int gpt_backward(gpt_t *m, const int *tokens, float scale, float *grads, gpt_ready_fn ready,
                 gpt_rows_fn rows, void *ctx)
{
    size_t C = m->cfg.channels, NH = m->cfg.heads, L = m->cfg.layers, V = GPT_VOCAB;
    size_t B = m->B, T = m->T, N = B * T;
#define G(i) (grads ? grads + m->tensors[i].offset : m->grad_at[i])
    float *dres = m->dacts, *dln = dres + N * C, *dqkv = dln + N * C, *datty = dqkv + N * 3 * C,
          *dfch = datty + N * C, *dfch_gelu = dfch + N * 4 * C, *datt = dfch_gelu + N * 4 * C,
          *dlogits = datt + m->max_batch * NH * m->cfg.context * m->cfg.context;
    /* softmax cross-entropy: dlogits = (p - onehot) * scale / N */
    const float *logits = logits_buf(m);
    float coef = scale / (float)N;
    double t_loss = m->profile ? seconds_now() : 0;
    for (size_t i = 0; i < N; i++) {
        const float *z = logits + i * V;
        float *dz = dlogits + i * V;
        float maxv = max_lanes(z, V);
        for (size_t v = 0; v < V; v++) dz[v] = exp_vec(z[v] - maxv);
        float f = coef / sum_lanes(dz, V);
        for (size_t v = 0; v < V; v++) dz[v] *= f;
        dz[m->targets[i]] -= coef;
    }
    if (m->profile) m->phase_seconds[GPT_PHASE_SOFTMAX_LOSS] += seconds_now() - t_loss;
    memset(dln, 0, N * C * sizeof(float));
    TIMED(m, GPT_PHASE_MATMUL_BWD,
          matmul_backward(dln, G(GPT_WTE), NULL, dlogits, lnf_out(m), P(m, GPT_WTE), N, C, V));
    const float *res_last = L ? layer_acts(m, L - 1).res3 : encoded(m);
    memset(dres, 0, N * C * sizeof(float));
    TIMED(m, GPT_PHASE_LAYERNORM,
          layernorm_backward(dres, G(GPT_LNFW(m)), G(GPT_LNFB(m)), dln, res_last,
                             P(m, GPT_LNFW(m)), lnf_mean(m), lnf_rstd(m), N, C));
    int rc;
    if (ready && (rc = ready(ctx, GPT_LNFW(m), 2))) return rc;
    for (size_t l = L; l-- > 0;) {
        if (m->layer_hook && (rc = m->layer_hook(m->hook_ctx, l, GPT_HOOK_BACKWARD))) return rc;
        layer_acts_t a = layer_acts(m, l);
        const float *res_in = l ? layer_acts(m, l - 1).res3 : encoded(m);
        /* MLP: res3 = res2 + proj(gelu(fc(ln2(res2)))) */
        memset(dfch_gelu, 0, N * 4 * C * sizeof(float));
        TIMED(m, GPT_PHASE_MATMUL_BWD,
              rc = matmul_backward_tiled(dfch_gelu, G(GPT_T(l, GPT_FCPROJW)),
                                         G(GPT_T(l, GPT_FCPROJB)), dres, a.fch_gelu,
                                         P(m, GPT_T(l, GPT_FCPROJW)), N, 4 * C, C,
                                         GPT_T(l, GPT_FCPROJW), rows, ctx));
        if (rc) return rc;
        TIMED(m, GPT_PHASE_GELU, gelu_backward(dfch, a.fch, dfch_gelu, N * 4 * C));
        memset(dln, 0, N * C * sizeof(float));
        TIMED(m, GPT_PHASE_MATMUL_BWD,
              rc = matmul_backward_tiled(dln, G(GPT_T(l, GPT_FCW)), G(GPT_T(l, GPT_FCB)), dfch,
                                         a.ln2, P(m, GPT_T(l, GPT_FCW)), N, C, 4 * C,
                                         GPT_T(l, GPT_FCW), rows, ctx));
        if (rc) return rc;
        TIMED(m, GPT_PHASE_LAYERNORM,
              layernorm_backward(dres, G(GPT_T(l, GPT_LN2W)), G(GPT_T(l, GPT_LN2B)), dln, a.res2,
                                 P(m, GPT_T(l, GPT_LN2W)), a.ln2_mean, a.ln2_rstd, N, C));
        /* attention: res2 = res + proj(attn(qkv(ln1(res)))) */
        memset(datty, 0, N * C * sizeof(float));
        TIMED(m, GPT_PHASE_MATMUL_BWD,
              rc = matmul_backward_tiled(datty, G(GPT_T(l, GPT_ATTPROJW)),
                                         G(GPT_T(l, GPT_ATTPROJB)), dres, a.atty,
                                         P(m, GPT_T(l, GPT_ATTPROJW)), N, C, C,
                                         GPT_T(l, GPT_ATTPROJW), rows, ctx));
        if (rc) return rc;
        memset(dqkv, 0, N * 3 * C * sizeof(float));
        TIMED(m, GPT_PHASE_ATTN_BWD,
              attention_backward(dqkv, datt, datty, a.qkv, a.att, B, T, C, NH));
        memset(dln, 0, N * C * sizeof(float));
        TIMED(m, GPT_PHASE_MATMUL_BWD,
              rc = matmul_backward_tiled(dln, G(GPT_T(l, GPT_QKVW)), G(GPT_T(l, GPT_QKVB)), dqkv,
                                         a.ln1, P(m, GPT_T(l, GPT_QKVW)), N, C, 3 * C,
                                         GPT_T(l, GPT_QKVW), rows, ctx));
        if (rc) return rc;
        TIMED(m, GPT_PHASE_LAYERNORM,
              layernorm_backward(dres, G(GPT_T(l, GPT_LN1W)), G(GPT_T(l, GPT_LN1B)), dln, res_in,
                                 P(m, GPT_T(l, GPT_LN1W)), a.ln1_mean, a.ln1_rstd, N, C));
        if (ready && (rc = ready(ctx, GPT_T(l, 0), GPT_LAYER_TENSORS))) return rc;
    }
    /* embeddings: dres is the gradient of every token's (wte[token] + wpe[t]) */
    float *dwte = G(GPT_WTE), *dwpe = G(GPT_WPE);
    TIMED(m, GPT_PHASE_ELEMENTWISE,
          for (size_t b = 0; b < B; b++)
              for (size_t t = 0; t < T; t++) {
                  const float *g = dres + (b * T + t) * C;
                  float *te = dwte + (size_t)tokens[b * T + t] * C, *pe = dwpe + t * C;
                  for (size_t c = 0; c < C; c++) {
                      te[c] += g[c];
                      pe[c] += g[c];
                  }
              });
    if (ready && (rc = ready(ctx, GPT_WTE, 2))) return rc;
#undef G
    return 0;
}

void gpt_generate(gpt_t *m, const char *prompt, size_t n, uint64_t *rng, char *out)
{
    size_t T = m->cfg.context, len = strlen(prompt);
    size_t total = len + n;
    int *tok = malloc(total * sizeof(int));
    if (!tok) {
        out[0] = 0;
        return;
    }
    for (size_t i = 0; i < len; i++) tok[i] = (unsigned char)prompt[i];
    for (size_t i = len; i < total; i++) {
        size_t start = i > T ? i - T : 0, len_ctx = i - start;
        if (len_ctx == 0) { /* no prompt: start from a newline */
            tok[i] = '\n';
            continue;
        }
        gpt_forward(m, tok + start, NULL, 1, len_ctx);
        const float *z = gpt_logits(m) + (len_ctx - 1) * GPT_VOCAB;
        float maxv = z[0];
        for (size_t v = 1; v < GPT_VOCAB; v++)
            if (z[v] > maxv) maxv = z[v];
        double sum = 0;
        for (size_t v = 0; v < GPT_VOCAB; v++) sum += exp((double)(z[v] - maxv));
        double r = uniform01(rng) * sum, acc = 0;
        int pick = GPT_VOCAB - 1;
        for (size_t v = 0; v < GPT_VOCAB; v++) {
            acc += exp((double)(z[v] - maxv));
            if (acc >= r) {
                pick = (int)v;
                break;
            }
        }
        tok[i] = pick;
    }
    for (size_t i = 0; i < n; i++) {
        int c = tok[len + i];
        out[i] = (c >= 32 && c < 127) || c == '\n' ? (char)c : '?';
    }
    out[n] = 0;
    free(tok);
}
