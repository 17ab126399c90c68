/* The GPT trainer's model on its own: backward against central finite differences of forward
 * (`fd`), and a dump of weights, tokens, loss and gradients for tests/gpt_torch_check.py, which
 * rebuilds the model in PyTorch and compares (`dump FILE`). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"

static const gpt_config_t tiny = {.layers = 2, .heads = 2, .channels = 8, .context = 6};
enum { B = 2, T = 5 };

/* Weights far from GPT-2's small init, so that every gradient is large enough for a finite
 * difference to resolve, and layer norms and biases are not at their trivial values. */
static void randomize(gpt_t *m, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < m->nparams; i++) {
        double u = ((gpt_splitmix64(&s) >> 11) * 0x1.0p-53) * 2 - 1;
        m->params[i] = (float)(0.5 * u);
    }
    for (size_t l = 0; l < m->cfg.layers; l++)
        for (int k = GPT_LN1W; k <= GPT_LN2W; k += GPT_LN2W - GPT_LN1W) {
            float *w = m->params + m->tensors[GPT_T(l, k)].offset;
            for (size_t c = 0; c < m->cfg.channels; c++) w[c] += 1.0f;
        }
}

static void make_tokens(int *tok, int *tgt, uint64_t seed)
{
    uint64_t s = seed;
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int)(gpt_splitmix64(&s) % GPT_VOCAB);
        tgt[i] = (int)(gpt_splitmix64(&s) % GPT_VOCAB);
    }
}

/* Every tensor: ||backward - fd|| / ||fd|| over up to 12 sampled elements must be <= 5e-3
 * (float32 forward: the difference quotient itself carries ~3e-4 of rounding). */
static int finite_differences(void)
{
    gpt_t m;
    char err[256];
    if (gpt_create(&tiny, B, 1, &m, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    randomize(&m, 7);
    int tok[B * T], tgt[B * T];
    make_tokens(tok, tgt, 3);
    float *grads = calloc(m.nparams, sizeof(float));
    gpt_forward(&m, tok, tgt, B, T);
    gpt_backward(&m, tok, 1.0f, grads, NULL, NULL, NULL);
    int failed = 0;
    const float h = 1e-2f;
    for (size_t i = 0; i < m.ntensors; i++) {
        const gpt_tensor_t *t = &m.tensors[i];
        double num = 0, den = 0;
        size_t step = t->numel / 12 + 1;
        /* embedding rows that no token uses have zero gradient; sample the used ones too */
        for (size_t j = (i == GPT_WTE ? (size_t)tok[0] * tiny.channels : 0); j < t->numel;
             j += step) {
            float *p = m.params + t->offset + j, keep = *p;
            *p = keep + h;
            double lp = gpt_forward(&m, tok, tgt, B, T);
            *p = keep - h;
            double lm = gpt_forward(&m, tok, tgt, B, T);
            *p = keep;
            double fd = (lp - lm) / (2 * h), g = grads[t->offset + j];
            num += (g - fd) * (g - fd);
            den += fd * fd;
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        int bad = !(rel <= 5e-3);
        printf("%-22s fd rel error %.2e%s\n", t->name, rel, bad ? "  FAIL" : "");
        failed |= bad;
    }
    free(grads);
    gpt_destroy(&m);
    return failed;
}

static int dump(const char *path)
{
    gpt_t m;
    char err[256];
    if (gpt_create(&tiny, B, 1, &m, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    randomize(&m, 11);
    int tok[B * T], tgt[B * T];
    make_tokens(tok, tgt, 5);
    float *grads = calloc(m.nparams, sizeof(float));
    double loss = gpt_forward(&m, tok, tgt, B, T);
    /* accumulate twice with scale 0.5: the sum must equal one full gradient */
    gpt_backward(&m, tok, 0.5f, grads, NULL, NULL, NULL);
    gpt_backward(&m, tok, 0.5f, grads, NULL, NULL, NULL);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 1;
    }
    int64_t hdr[6] = {(int64_t)tiny.layers, (int64_t)tiny.heads, (int64_t)tiny.channels,
                      (int64_t)tiny.context, B, T};
    fwrite(hdr, sizeof hdr, 1, f);
    int32_t t32[B * T], g32[B * T];
    for (int i = 0; i < B * T; i++) t32[i] = tok[i], g32[i] = tgt[i];
    fwrite(t32, sizeof t32, 1, f);
    fwrite(g32, sizeof g32, 1, f);
    fwrite(m.params, sizeof(float), m.nparams, f);
    fwrite(&loss, sizeof loss, 1, f);
    fwrite(grads, sizeof(float), m.nparams, f);
    int rc = fclose(f) != 0;
    printf("dumped %zu parameters in %zu tensors, loss %.6f\n", m.nparams, m.ntensors, loss);
    free(grads);
    gpt_destroy(&m);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "fd") == 0) return finite_differences();
    if (argc == 3 && strcmp(argv[1], "dump") == 0) return dump(argv[2]);
    fprintf(stderr, "usage: %s fd | dump FILE\n", argv[0]);
    return 2;
}
