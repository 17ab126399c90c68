/* The MLP 784-h-h-10 with ReLU and softmax cross-entropy. Every matrix product goes through
 * cblas_sgemm (row-major): forward computes X W^T + b per layer; backward walks the layers from
 * the last and, after each one, hands its finished gradients to a callback so the caller can start
 * reducing them while the earlier layers are still being differentiated. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "trainer.h"

const char *const fm_param_names[FM_NPARAMS] = {"fc1.weight", "fc1.bias", "fc2.weight",
                                                "fc2.bias",   "fc3.weight", "fc3.bias"};

static float *alloc_floats(size_t n)
{
    size_t bytes = (n * sizeof(float) + 63) & ~(size_t)63;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p) memset(p, 0, bytes ? bytes : 64);
    return p;
}

int fm_mlp_create(size_t hidden, size_t max_batch, uint64_t seed, fm_mlp_t *out)
{
    memset(out, 0, sizeof *out);
    out->hidden = hidden;
    out->max_batch = max_batch;
    const size_t in[3] = {FM_PIXELS, hidden, hidden};
    const size_t outf[3] = {hidden, hidden, FM_CLASSES};
    uint64_t s = seed;
    for (int l = 0; l < 3; l++) {
        out->numel[2 * l] = outf[l] * in[l];
        out->rows[2 * l] = outf[l];
        out->numel[2 * l + 1] = outf[l];
        out->rows[2 * l + 1] = 0;
        float bound = 1.0f / sqrtf((float)in[l]);
        for (int k = 0; k < 2; k++) {
            size_t n = out->numel[2 * l + k];
            float *p = out->params[2 * l + k] = alloc_floats(n);
            if (!p) goto fail;
            for (size_t i = 0; i < n; i++) {
                double u = (double)(fm_splitmix64(&s) >> 11) * 0x1.0p-53; /* [0, 1) */
                p[i] = (float)(u * 2.0 - 1.0) * bound;
            }
        }
    }
    out->h1 = alloc_floats(max_batch * hidden);
    out->h2 = alloc_floats(max_batch * hidden);
    out->dh1 = alloc_floats(max_batch * hidden);
    out->dh2 = alloc_floats(max_batch * hidden);
    out->logits = alloc_floats(max_batch * FM_CLASSES);
    out->dlogits = alloc_floats(max_batch * FM_CLASSES);
    if (!out->h1 || !out->h2 || !out->dh1 || !out->dh2 || !out->logits || !out->dlogits)
        goto fail;
    return 0;
fail:
    fm_mlp_destroy(out);
    return -1;
}

void fm_mlp_destroy(fm_mlp_t *m)
{
    for (int i = 0; i < FM_NPARAMS; i++) free(m->params[i]);
    free(m->h1);
    free(m->h2);
    free(m->dh1);
    free(m->dh2);
    free(m->logits);
    free(m->dlogits);
    memset(m, 0, sizeof *m);
}

/* out[m x nout] = act(x[m x nin] W^T + b), W is nout x nin. */
static void linear(const float *x, size_t m, size_t nin, const float *w, const float *b,
                   size_t nout, float *out, int relu)
{
    for (size_t i = 0; i < m; i++) memcpy(out + i * nout, b, nout * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nout, (int)nin, 1.0f, x,
                (int)nin, w, (int)nin, 1.0f, out, (int)nout);
    if (relu) {
        for (size_t i = 0; i < m * nout; i++) out[i] = out[i] > 0.0f ? out[i] : 0.0f;
    }
}

void fm_mlp_forward(fm_mlp_t *model, const float *x, size_t m)
{
    size_t h = model->hidden;
    float *const *p = model->params;
    linear(x, m, FM_PIXELS, p[0], p[1], h, model->h1, 1);
    linear(model->h1, m, h, p[2], p[3], h, model->h2, 1);
    linear(model->h2, m, h, p[4], p[5], FM_CLASSES, model->logits, 0);
}

typedef struct block_ctx {
    float beta; /* 1: add into the gradients; 0: overwrite them */
    size_t blocks;
    fm_rows_done_fn rows_done;
    void *ctx;
} block_ctx_t;

/* gw[nout x nin] += dy^T x and gb[nout] += column sums of dy, for dy [m x nout], x [m x nin]
 * (with bc->beta 0: = instead of +=, so the caller need not clear them first: the GEMM clears
 * each tile right before it writes it, in cache, where a separate memset would stream the
 * whole gradient through memory once more).
 *
 * The weight gradient is always computed in FM_GRAD_TILES row tiles, one GEMM each (rows
 * [r0, r1) of gw are dy[:, r0:r1]^T x), whatever the number of blocks: OpenBLAS picks its
 * kernels by shape, so one GEMM and several on row slices do not give the same bits, while the
 * same tiles always do. Blocks are groups of consecutive tiles, reported through rows_done as
 * each finishes (so their reduction can start while the next block is computed); the results
 * are therefore bitwise the same for every block count. */
static int linear_grads(const float *dy, const float *x, size_t m, size_t nin, size_t nout,
                        float *gw, float *gb, int layer, const block_ctx_t *bc)
{
    size_t tiles = nout < FM_GRAD_TILES ? nout : FM_GRAD_TILES;
    size_t blocks = bc->blocks == 0 ? 1 : bc->blocks > tiles ? tiles : bc->blocks;
    for (size_t b = 0; b < blocks; b++) {
        size_t t0 = tiles * b / blocks, t1 = tiles * (b + 1) / blocks;
        for (size_t t = t0; t < t1; t++) {
            size_t r0 = nout * t / tiles, r1 = nout * (t + 1) / tiles;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(r1 - r0), (int)nin, (int)m,
                        1.0f, dy + r0, (int)nout, x, (int)nin, bc->beta, gw + r0 * nin,
                        (int)nin);
        }
        int rc;
        size_t r0 = nout * t0 / tiles, r1 = nout * t1 / tiles;
        if (bc->rows_done && (rc = bc->rows_done(bc->ctx, layer, r0, r1)) != 0) return rc;
    }
    if (bc->beta == 0.0f) memset(gb, 0, nout * sizeof(float));
    for (size_t i = 0; i < m; i++) {
        const float *row = dy + i * nout;
        for (size_t j = 0; j < nout; j++) gb[j] += row[j];
    }
    return 0;
}

/* dx[m x nin] = (dy[m x nout] W) masked where the layer's ReLU output `act` was zero. */
static void input_grads(const float *dy, const float *w, size_t m, size_t nin, size_t nout,
                        const float *act, float *dx)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)nin, (int)nout, 1.0f, dy,
                (int)nout, w, (int)nin, 0.0f, dx, (int)nin);
    for (size_t i = 0; i < m * nin; i++)
        if (act[i] <= 0.0f) dx[i] = 0.0f;
}

int fm_mlp_backward(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t m,
                    float scale, float *const grads[FM_NPARAMS], double *loss,
                    fm_layer_done_fn done, void *ctx)
{
    return fm_mlp_backward_blocks(model, x, labels, m, scale, grads, 1, loss, 1, NULL, done, ctx);
}

int fm_mlp_backward_blocks(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t m,
                           float scale, float *const grads[FM_NPARAMS], int accumulate,
                           double *loss, size_t blocks, fm_rows_done_fn rows_done,
                           fm_layer_done_fn done, void *ctx)
{
    const block_ctx_t bc = {accumulate ? 1.0f : 0.0f, blocks, rows_done, ctx};
    size_t h = model->hidden;
    float *const *p = model->params;
    /* Softmax cross-entropy: d(loss_i)/d(logit) = softmax - onehot. */
    double total = 0.0;
    for (size_t i = 0; i < m; i++) {
        const float *z = model->logits + i * FM_CLASSES;
        float *dz = model->dlogits + i * FM_CLASSES;
        float zmax = z[0];
        for (int c = 1; c < FM_CLASSES; c++) zmax = z[c] > zmax ? z[c] : zmax;
        double sum = 0.0;
        for (int c = 0; c < FM_CLASSES; c++) sum += exp((double)(z[c] - zmax));
        double logsum = log(sum) + (double)zmax;
        total += logsum - (double)z[labels[i]];
        for (int c = 0; c < FM_CLASSES; c++) {
            double prob = exp((double)z[c] - logsum);
            dz[c] = (float)((prob - (c == labels[i] ? 1.0 : 0.0)) * scale);
        }
    }
    *loss = m ? total / (double)m : 0.0;
    int rc;
    /* Each layer's parameter gradients first, then the callback (their reduction can start),
     * then the gradient of the layer's input, which overlaps with that reduction. */
    if ((rc = linear_grads(model->dlogits, model->h2, m, h, FM_CLASSES, grads[4], grads[5], 2,
                           &bc)) != 0)
        return rc;
    if (done && (rc = done(ctx, 2)) != 0) return rc;
    input_grads(model->dlogits, p[4], m, h, FM_CLASSES, model->h2, model->dh2);
    if ((rc = linear_grads(model->dh2, model->h1, m, h, h, grads[2], grads[3], 1, &bc)) != 0)
        return rc;
    if (done && (rc = done(ctx, 1)) != 0) return rc;
    input_grads(model->dh2, p[2], m, h, h, model->h1, model->dh1);
    if ((rc = linear_grads(model->dh1, x, m, FM_PIXELS, h, grads[0], grads[1], 0, &bc)) != 0)
        return rc;
    if (done && (rc = done(ctx, 0)) != 0) return rc;
    return 0;
}

size_t fm_mlp_count_correct(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t count)
{
    size_t correct = 0;
    for (size_t start = 0; start < count; start += model->max_batch) {
        size_t m = count - start < model->max_batch ? count - start : model->max_batch;
        fm_mlp_forward(model, x + start * FM_PIXELS, m);
        for (size_t i = 0; i < m; i++) {
            const float *z = model->logits + i * FM_CLASSES;
            int best = 0;
            for (int c = 1; c < FM_CLASSES; c++)
                if (z[c] > z[best]) best = c;
            correct += best == labels[start + i];
        }
    }
    return correct;
}

uint64_t fm_mlp_checksum(const fm_mlp_t *model, double *sum)
{
    uint64_t hash = 0xcbf29ce484222325ULL;
    double total = 0.0;
    for (int k = 0; k < FM_NPARAMS; k++) {
        const unsigned char *bytes = (const unsigned char *)model->params[k];
        for (size_t i = 0; i < model->numel[k] * sizeof(float); i++) {
            hash ^= bytes[i];
            hash *= 0x100000001b3ULL;
        }
        for (size_t i = 0; i < model->numel[k]; i++) total += model->params[k][i];
    }
    if (sum) *sum = total;
    return hash;
}
