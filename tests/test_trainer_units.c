/* The trainer's parts on their own (no communication): the MLP's backward against central finite
 * differences in float64 arithmetic on the model's own forward, gradient accumulation (beta = 1)
 * and the layer order the Reducer relies on, the optimisers against hand-computed updates, the
 * sampler, the IDX reader's errors on broken files, and checkpoint round trip and corruption. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "harness.h"
#include "trainer.h"

static char tmpdir[256];

/* ---- model -------------------------------------------------------------------------------- */

static double loss_of(fm_mlp_t *m, const float *x, const uint8_t *y, size_t n)
{
    fm_mlp_forward(m, x, n);
    double total = 0;
    for (size_t i = 0; i < n; i++) {
        const float *z = m->logits + i * FM_CLASSES;
        double mx = z[0], s = 0;
        for (int c = 1; c < FM_CLASSES; c++) mx = z[c] > mx ? z[c] : mx;
        for (int c = 0; c < FM_CLASSES; c++) s += exp(z[c] - mx);
        total += log(s) + mx - z[y[i]];
    }
    return total / (double)n;
}

static int order[8], norder;
static int record_layer(void *ctx, int layer)
{
    (void)ctx;
    order[norder++] = layer;
    return 0;
}

static void test_backward_matches_finite_differences(void)
{
    const size_t hidden = 7, n = 5; /* odd sizes */
    fm_mlp_t m;
    CHECK(fm_mlp_create(hidden, n, 42, &m) == 0);
    CHECK(m.numel[0] == hidden * FM_PIXELS && m.numel[2] == hidden * hidden &&
          m.numel[4] == FM_CLASSES * hidden && m.numel[5] == FM_CLASSES);
    float *x = malloc(n * FM_PIXELS * sizeof(float));
    uint8_t y[5] = {0, 3, 9, 3, 7};
    uint64_t s = 7;
    for (size_t i = 0; i < n * FM_PIXELS; i++)
        x[i] = (float)((double)(fm_splitmix64(&s) >> 11) * 0x1.0p-53 * 2 - 1);
    float *grads[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) grads[k] = calloc(m.numel[k], sizeof(float));
    fm_mlp_forward(&m, x, n);
    double loss = 0;
    norder = 0;
    CHECK(fm_mlp_backward(&m, x, y, n, 1.0f / (float)n, grads, &loss, record_layer, NULL) == 0);
    /* last layer first, so the Reducer can start on it while the others are computed */
    CHECK(norder == 3 && order[0] == 2 && order[1] == 1 && order[2] == 0);
    CHECK(fabs(loss - loss_of(&m, x, y, n)) < 1e-5);

    /* a sample of coordinates of every parameter, against (L(p+h) - L(p-h)) / 2h */
    int checked = 0;
    for (int k = 0; k < FM_NPARAMS; k++) {
        for (size_t j = 0; j < m.numel[k]; j += m.numel[k] / 7 + 1) {
            float *p = &m.params[k][j], keep = *p;
            const float h = 1e-3f;
            *p = keep + h;
            double up = loss_of(&m, x, y, n);
            *p = keep - h;
            double down = loss_of(&m, x, y, n);
            *p = keep;
            double numeric = (up - down) / (2.0 * h);
            CHECK_MSG(fabs(numeric - grads[k][j]) < 2e-3 + 2e-2 * fabs(numeric),
                      "param %s[%zu]: backward %g, finite difference %g", fm_param_names[k], j,
                      grads[k][j], numeric);
            checked++;
        }
    }
    CHECK(checked > 30);

    /* accumulation: a second backward adds the same gradient again (beta = 1) */
    float before = grads[4][3];
    fm_mlp_forward(&m, x, n);
    CHECK(fm_mlp_backward(&m, x, y, n, 1.0f / (float)n, grads, &loss, NULL, NULL) == 0);
    CHECK(fabsf(grads[4][3] - 2.0f * before) <= 1e-6f * fabsf(before) + 1e-9f);

    /* one sample: the mean over one is that sample's loss */
    fm_mlp_forward(&m, x, 1);
    CHECK(fm_mlp_backward(&m, x, y, 1, 1.0f, grads, &loss, NULL, NULL) == 0);
    CHECK(fabs(loss - loss_of(&m, x, y, 1)) < 1e-5);

    /* a callback's non-zero value stops backward (a Reducer error) */
    CHECK(fm_mlp_backward(&m, x, y, n, 1.0f, grads, &loss, NULL, NULL) == 0);

    /* the same seed gives the same model; another seed another */
    fm_mlp_t a, b;
    CHECK(fm_mlp_create(hidden, 1, 42, &a) == 0 && fm_mlp_create(hidden, 1, 43, &b) == 0);
    fm_mlp_t c;
    CHECK(fm_mlp_create(hidden, 3, 42, &c) == 0);
    CHECK(fm_mlp_checksum(&a, NULL) == fm_mlp_checksum(&c, NULL));
    CHECK(fm_mlp_checksum(&a, NULL) != fm_mlp_checksum(&b, NULL));
    /* torch.nn.Linear's initialisation bound: 1/sqrt(fan_in) */
    for (size_t i = 0; i < a.numel[0]; i++) CHECK(fabsf(a.params[0][i]) <= 1.0f / 28.0f);
    fm_mlp_destroy(&a);
    fm_mlp_destroy(&b);
    fm_mlp_destroy(&c);
    for (int k = 0; k < FM_NPARAMS; k++) free(grads[k]);
    free(x);
    fm_mlp_destroy(&m);
}

static int stop_at_two(void *ctx, int layer)
{
    (void)ctx;
    return layer == 2 ? 17 : 0;
}

static void test_backward_stops_on_callback_error(void)
{
    fm_mlp_t m;
    CHECK(fm_mlp_create(3, 2, 1, &m) == 0);
    float x[2 * FM_PIXELS] = {0};
    uint8_t y[2] = {1, 2};
    float *grads[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) grads[k] = calloc(m.numel[k], sizeof(float));
    fm_mlp_forward(&m, x, 2);
    double loss;
    CHECK(fm_mlp_backward(&m, x, y, 2, 0.5f, grads, &loss, stop_at_two, NULL) == 17);
    for (size_t i = 0; i < m.numel[0]; i++) CHECK(grads[0][i] == 0.0f); /* fc1 never reached */
    for (int k = 0; k < FM_NPARAMS; k++) free(grads[k]);
    fm_mlp_destroy(&m);
}

/* Row-block weight gradients (--grad-blocks) must be the same bits as one GEMM, and every row
 * of every weight must be reported exactly once, before its layer's done callback. */
typedef struct rows_seen {
    unsigned char *seen[3];
    size_t rows[3];
    int layer_done[3];
    size_t calls;
} rows_seen_t;

static int record_rows(void *ctx, int layer, size_t r0, size_t r1)
{
    rows_seen_t *s = ctx;
    CHECK(layer >= 0 && layer < 3 && !s->layer_done[layer] && r0 < r1 && r1 <= s->rows[layer]);
    for (size_t r = r0; r < r1; r++) {
        CHECK(!s->seen[layer][r]);
        s->seen[layer][r] = 1;
    }
    s->calls++;
    return 0;
}

static int record_done(void *ctx, int layer)
{
    rows_seen_t *s = ctx;
    for (size_t r = 0; r < s->rows[layer]; r++) CHECK(s->seen[layer][r]);
    s->layer_done[layer] = 1;
    return 0;
}

static void test_backward_blocks_bitwise(void)
{
    const size_t hidden = 301, n = 67; /* prime-ish sizes, large enough for BLAS blocking */
    fm_mlp_t m;
    CHECK(fm_mlp_create(hidden, n, 7, &m) == 0);
    float *x = malloc(n * FM_PIXELS * sizeof(float));
    uint8_t *y = malloc(n);
    uint64_t s = 3;
    for (size_t i = 0; i < n * FM_PIXELS; i++)
        x[i] = (float)((double)(fm_splitmix64(&s) >> 11) * 0x1.0p-53);
    for (size_t i = 0; i < n; i++) y[i] = (uint8_t)(fm_splitmix64(&s) % FM_CLASSES);
    float *want[FM_NPARAMS], *got[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) {
        want[k] = calloc(m.numel[k], sizeof(float));
        got[k] = calloc(m.numel[k], sizeof(float));
        /* accumulate onto a non-zero gradient, as with --accumulate */
        for (size_t i = 0; i < m.numel[k]; i++) want[k][i] = got[k][i] = (float)(i % 5) * 0.01f;
    }
    double loss_want = 0, loss_got = 0;
    fm_mlp_forward(&m, x, n);
    CHECK(fm_mlp_backward(&m, x, y, n, 1.0f / (float)n, want, &loss_want, NULL, NULL) == 0);
    const size_t blocks[] = {1, 2, 3, 4, 5, 7, 8, 16, 1000};
    for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
        rows_seen_t seen;
        memset(&seen, 0, sizeof seen);
        for (int l = 0; l < 3; l++) {
            seen.rows[l] = m.rows[2 * l];
            seen.seen[l] = calloc(seen.rows[l], 1);
        }
        for (int k = 0; k < FM_NPARAMS; k++)
            for (size_t i = 0; i < m.numel[k]; i++) got[k][i] = (float)(i % 5) * 0.01f;
        fm_mlp_forward(&m, x, n);
        CHECK(fm_mlp_backward_blocks(&m, x, y, n, 1.0f / (float)n, got, 1, &loss_got, blocks[b],
                                     record_rows, record_done, &seen) == 0);
        CHECK(loss_got == loss_want);
        for (int k = 0; k < FM_NPARAMS; k++)
            CHECK_MSG(memcmp(want[k], got[k], m.numel[k] * sizeof(float)) == 0,
                      "%zu blocks: %s differs from one GEMM", blocks[b], fm_param_names[k]);
        size_t expect = 0;
        for (int l = 0; l < 3; l++) {
            CHECK(seen.layer_done[l]);
            size_t tiles = seen.rows[l] < FM_GRAD_TILES ? seen.rows[l] : FM_GRAD_TILES;
            expect += blocks[b] < tiles ? blocks[b] : tiles;
            free(seen.seen[l]);
        }
        CHECK_MSG(seen.calls == expect, "%zu blocks: %zu calls, expected %zu", blocks[b],
                  seen.calls, expect);
    }
    /* accumulate 0 (the trainer's first micro-step, which no longer clears the gradients):
     * whatever the buffers held - NaN here - the result is what accumulating onto zeros gives,
     * for every block count */
    for (size_t b = 0; b < 3; b++) {
        for (int k = 0; k < FM_NPARAMS; k++) {
            memset(want[k], 0, m.numel[k] * sizeof(float));
            for (size_t i = 0; i < m.numel[k]; i++) got[k][i] = NAN;
        }
        fm_mlp_forward(&m, x, n);
        CHECK(fm_mlp_backward(&m, x, y, n, 1.0f / (float)n, want, &loss_want, NULL, NULL) == 0);
        fm_mlp_forward(&m, x, n);
        CHECK(fm_mlp_backward_blocks(&m, x, y, n, 1.0f / (float)n, got, 0, &loss_got, blocks[b],
                                     NULL, NULL, NULL) == 0);
        for (int k = 0; k < FM_NPARAMS; k++) {
            size_t bad = 0;
            for (size_t i = 0; i < m.numel[k]; i++) bad += !(got[k][i] == want[k][i]);
            CHECK_MSG(bad == 0, "overwrite, %zu blocks: %zu elements of %s differ from "
                      "accumulating onto zeros", blocks[b], bad, fm_param_names[k]);
        }
    }
    for (int k = 0; k < FM_NPARAMS; k++) {
        free(want[k]);
        free(got[k]);
    }
    free(x);
    free(y);
    fm_mlp_destroy(&m);
}

/* ---- optimisers ---------------------------------------------------------------------------- */

static void test_optimisers(void)
{
    size_t numel[FM_NPARAMS] = {1, 1, 1, 1, 1, 2};
    float pv[FM_NPARAMS][2] = {{1}, {1}, {1}, {1}, {1}, {1, -2}};
    float gv[FM_NPARAMS][2] = {{0.5f}, {0.5f}, {0.5f}, {0.5f}, {0.5f}, {0.5f, 0.25f}};
    float *p[FM_NPARAMS], *g[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) {
        p[k] = pv[k];
        g[k] = gv[k];
    }
    fm_optim_t sgd = {.kind = FM_OPTIM_SGD, .lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
    CHECK(fm_optim_create(&sgd, numel) == 0);
    fm_optim_step(&sgd, p, g);
    /* d = 0.5 + 0.01 * 1 = 0.51; buf = d; p = 1 - 0.051 */
    CHECK(fabsf(pv[0][0] - (1.0f - 0.051f)) < 1e-6f);
    fm_optim_step(&sgd, p, g);
    /* d = 0.5 + 0.01 * 0.949 = 0.50949; buf = 0.9 * 0.51 + 0.50949 = 0.96849 */
    CHECK(fabsf(pv[0][0] - (0.949f - 0.096849f)) < 1e-6f);
    CHECK(sgd.steps == 2);
    fm_optim_destroy(&sgd);

    pv[5][0] = 1;
    pv[5][1] = -2;
    fm_optim_t adam = {
        .kind = FM_OPTIM_ADAM, .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    CHECK(fm_optim_create(&adam, numel) == 0);
    fm_optim_step(&adam, p, g);
    /* the first Adam step moves every coordinate by lr * sign(g) (bias-corrected m/sqrt(v)) */
    CHECK(fabsf(pv[5][0] - 0.99f) < 1e-6f && fabsf(pv[5][1] - (-2.01f)) < 1e-6f);
    fm_optim_step(&adam, p, g);
    CHECK(fabsf(pv[5][0] - 0.98f) < 1e-5f);
    fm_optim_destroy(&adam);
}

/* ---- sampler ------------------------------------------------------------------------------- */

static void test_permutation(void)
{
    const size_t sizes[] = {0, 1, 2, 7, 97, 60000};
    for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
        size_t n = sizes[t];
        uint32_t *a = malloc((n + 1) * 4), *b = malloc((n + 1) * 4);
        unsigned char *seen = calloc(n + 1, 1);
        fm_permutation(5, 3, n, a);
        fm_permutation(5, 3, n, b);
        CHECK(n == 0 || memcmp(a, b, n * 4) == 0); /* same (seed, epoch) on every rank */
        for (size_t i = 0; i < n; i++) {
            CHECK(a[i] < n && !seen[a[i]]);
            seen[a[i]] = 1;
        }
        if (n >= 97) {
            fm_permutation(5, 4, n, b);
            CHECK(memcmp(a, b, n * 4) != 0); /* another epoch, another order */
            fm_permutation(6, 3, n, b);
            CHECK(memcmp(a, b, n * 4) != 0);
        }
        free(a);
        free(b);
        free(seen);
    }
}

/* ---- IDX reader ------------------------------------------------------------------------------ */

static void put_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* Writes <dir>/<split>-images/labels files of n samples, with an optional defect. */
enum {
    OK_FILES,
    BAD_IMAGE_MAGIC,
    BAD_LABEL_MAGIC,
    WRONG_ROWS,
    TRUNCATED,
    COUNT_MISMATCH,
    BAD_LABEL,
    NOT_GZIP
};
static void write_idx(const char *dir, const char *split, uint32_t n, int defect)
{
    char path[512];
    unsigned char hdr[16];
    snprintf(path, sizeof path, "%s/%s-images-idx3-ubyte.gz", dir, split);
    if (defect == NOT_GZIP) {
        FILE *f = fopen(path, "wb");
        CHECK(f);
        /* a gzip magic with garbage after it: zlib reports a data error */
        const unsigned char junk[] = {0x1f, 0x8b, 8,    0,    0,    0,    0,    0,    0,
                                      3,    0xff, 0xff, 0xff, 0xff, 0x12, 0x34, 0x56, 0x78,
                                      0x9a, 0xbc, 0xde, 0xf0, 1,    2,    3,    4};
        fwrite(junk, 1, sizeof junk, f);
        fclose(f);
    } else {
        gzFile g = gzopen(path, "wb");
        CHECK(g);
        put_be32(hdr, defect == BAD_IMAGE_MAGIC ? 0x801 : 0x803);
        put_be32(hdr + 4, n);
        put_be32(hdr + 8, defect == WRONG_ROWS ? 27 : 28);
        put_be32(hdr + 12, 28);
        gzwrite(g, hdr, 16);
        size_t bytes = (size_t)n * FM_PIXELS - (defect == TRUNCATED ? 100 : 0);
        unsigned char *px = malloc(bytes + 1);
        for (size_t i = 0; i < bytes; i++) px[i] = (unsigned char)(i * 31 % 256);
        gzwrite(g, px, (unsigned)bytes);
        free(px);
        gzclose(g);
    }
    snprintf(path, sizeof path, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    gzFile g = gzopen(path, "wb");
    CHECK(g);
    put_be32(hdr, defect == BAD_LABEL_MAGIC ? 0x803 : 0x801);
    put_be32(hdr + 4, defect == COUNT_MISMATCH ? n + 1 : n);
    gzwrite(g, hdr, 8);
    for (uint32_t i = 0; i < n + (defect == COUNT_MISMATCH); i++) {
        unsigned char l = defect == BAD_LABEL && i == 2 ? 12 : (unsigned char)(i % 10);
        gzwrite(g, &l, 1);
    }
    gzclose(g);
}

static void expect_load_error(int defect, const char *needle1, const char *needle2)
{
    char dir[300], err[8192];
    snprintf(dir, sizeof dir, "%s/d%d", tmpdir, defect);
    CHECK(mkdir(dir, 0755) == 0);
    write_idx(dir, "train", 5, defect);
    fm_dataset_t d;
    CHECK(fm_dataset_load(dir, "train", 0, &d, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, needle1) && strstr(err, needle2), "defect %d: '%s' lacks '%s'/'%s'",
              defect, err, needle1, needle2);
    CHECK_MSG(strstr(err, "apt-get install dataset-fashion-mnist"), "no install hint: %s", err);
    CHECK(d.images == NULL && d.labels == NULL && d.count == 0);
}

static void test_idx_reader(void)
{
    char dir[300], err[8192];
    fm_dataset_t d;
    snprintf(dir, sizeof dir, "%s/good", tmpdir);
    CHECK(mkdir(dir, 0755) == 0);
    write_idx(dir, "train", 13, OK_FILES);
    CHECK_MSG(fm_dataset_load(dir, "train", 0, &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.count == 13 && d.labels[12] == 2);
    /* normalised: pixel 0 -> (0 - mean) / std, pixel 255 -> (1 - mean) / std */
    CHECK(fabsf(d.images[0] - (0.0f - 0.2860f) / 0.3530f) < 1e-5f);
    size_t j = 0;
    while ((j * 31) % 256 != 255) j++;
    CHECK(fabsf(d.images[j] - (1.0f - 0.2860f) / 0.3530f) < 1e-5f);
    fm_dataset_free(&d);
    CHECK_MSG(fm_dataset_load(dir, "train", 4, &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.count == 4); /* --subset */
    fm_dataset_free(&d);
    CHECK_MSG(fm_dataset_load(dir, "train", 100, &d, err, sizeof err) == 0, "%s", err);
    CHECK(d.count == 13);
    fm_dataset_free(&d);

    /* missing */
    CHECK(fm_dataset_load(dir, "t10k", 0, &d, err, sizeof err) == -1);
    CHECK(strstr(err, "t10k-images-idx3-ubyte.gz") && strstr(err, "No such file"));
    CHECK(strstr(err, "apt-get install dataset-fashion-mnist"));

    expect_load_error(BAD_IMAGE_MAGIC, "train-images-idx3-ubyte.gz", "bad magic 0x00000801");
    expect_load_error(BAD_LABEL_MAGIC, "train-labels-idx1-ubyte.gz", "bad magic 0x00000803");
    expect_load_error(WRONG_ROWS, "train-images-idx3-ubyte.gz", "27x28, expected 28x28");
    expect_load_error(TRUNCATED, "train-images-idx3-ubyte.gz", "truncated");
    expect_load_error(COUNT_MISMATCH, "6 labels", "5 images");
    expect_load_error(BAD_LABEL, "label 2 is 12", "train-labels");
    expect_load_error(NOT_GZIP, "train-images-idx3-ubyte.gz", "corrupt");

    /* synthetic data is deterministic and labelled 0..9 */
    fm_dataset_t a, b;
    CHECK(fm_dataset_synthetic(31, 9, &a) == 0 && fm_dataset_synthetic(31, 9, &b) == 0);
    CHECK(memcmp(a.images, b.images, 31 * FM_PIXELS * 4) == 0 &&
          memcmp(a.labels, b.labels, 31) == 0);
    for (size_t i = 0; i < 31; i++) CHECK(a.labels[i] < 10);
    fm_dataset_free(&a);
    fm_dataset_free(&b);
}

/* ---- checkpoints ---------------------------------------------------------------------------- */

static void test_checkpoint(void)
{
    char path[300], err[8192];
    snprintf(path, sizeof path, "%s/ck.bin", tmpdir);
    fm_hyper_t h = {.hidden = 5,
                    .batch = 8,
                    .accumulate = 1,
                    .subset = 0,
                    .seed = 3,
                    .optim = FM_OPTIM_ADAM,
                    .lr = 1e-3,
                    .beta1 = 0.9,
                    .beta2 = 0.999,
                    .eps = 1e-8};
    fm_mlp_t m, m2;
    CHECK(fm_mlp_create(5, 1, 3, &m) == 0 && fm_mlp_create(5, 1, 99, &m2) == 0);
    fm_optim_t o = {.kind = FM_OPTIM_ADAM}, o2 = {.kind = FM_OPTIM_ADAM};
    CHECK(fm_optim_create(&o, m.numel) == 0 && fm_optim_create(&o2, m.numel) == 0);
    for (int k = 0; k < FM_NPARAMS; k++)
        for (size_t i = 0; i < m.numel[k]; i++) {
            o.state1[k][i] = (float)i * 0.5f;
            o.state2[k][i] = (float)k;
        }
    o.steps = 77;
    fm_progress_t p = {.epoch = 2,
                       .step_in_epoch = 9,
                       .global_step = 40,
                       .loss_sum = 3.25,
                       .loss_count = 9,
                       .last_epoch_loss = 0.5};
    CHECK_MSG(fm_checkpoint_save(path, &h, &p, &m, &o, NULL, err, sizeof err) == 0, "%s", err);
    fm_progress_t q;
    CHECK_MSG(fm_checkpoint_load(path, &h, &q, &m2, &o2, NULL, err, sizeof err) == 0, "%s", err);
    CHECK(q.epoch == 2 && q.step_in_epoch == 9 && q.global_step == 40 && q.loss_sum == 3.25 &&
          q.loss_count == 9 && q.last_epoch_loss == 0.5 && o2.steps == 77);
    CHECK(fm_mlp_checksum(&m, NULL) == fm_mlp_checksum(&m2, NULL));
    for (int k = 0; k < FM_NPARAMS; k++) {
        CHECK(memcmp(o.state1[k], o2.state1[k], m.numel[k] * 4) == 0);
        CHECK(memcmp(o.state2[k], o2.state2[k], m.numel[k] * 4) == 0);
    }
    /* no temporary file is left next to it */
    char tmp[400];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0);

    /* another hidden size, another learning rate: named */
    fm_hyper_t other = h;
    other.hidden = 6;
    CHECK(fm_checkpoint_load(path, &other, &q, &m2, &o2, NULL, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "--hidden 5") && strstr(err, "--hidden 6"), "%s", err);
    other = h;
    other.lr = 2e-3;
    CHECK(fm_checkpoint_load(path, &other, &q, &m2, &o2, NULL, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "--lr"), "%s", err);

    /* truncated at several points, one flipped byte, a foreign file, a missing file */
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc((size_t)len);
    CHECK(fread(data, 1, (size_t)len, f) == (size_t)len);
    fclose(f);
    char bad[400];
    snprintf(bad, sizeof bad, "%s/bad.bin", tmpdir);
    const long cuts[] = {0, 7, 20, 100, len / 2, len - 1};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        f = fopen(bad, "wb");
        fwrite(data, 1, (size_t)cuts[c], f);
        fclose(f);
        CHECK(fm_checkpoint_load(bad, &h, &q, &m2, &o2, NULL, err, sizeof err) == -1);
        CHECK_MSG(strstr(err, "truncated") || strstr(err, "not a fashion-mnist checkpoint"),
                  "cut at %ld: %s", cuts[c], err);
    }
    data[len - 40] ^= 0x10;
    f = fopen(bad, "wb");
    fwrite(data, 1, (size_t)len, f);
    fclose(f);
    CHECK(fm_checkpoint_load(bad, &h, &q, &m2, &o2, NULL, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "corrupt") && strstr(err, "checksum"), "%s", err);
    snprintf(bad, sizeof bad, "%s/missing.bin", tmpdir);
    CHECK(fm_checkpoint_load(bad, &h, &q, &m2, &o2, NULL, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "missing.bin") && strstr(err, "No such file"), "%s", err);
    /* an SGD run cannot take an Adam checkpoint */
    other = h;
    other.optim = FM_OPTIM_SGD;
    CHECK(fm_checkpoint_load(path, &other, &q, &m2, &o2, NULL, err, sizeof err) == -1);
    CHECK_MSG(strstr(err, "--optim"), "%s", err);
    free(data);
    fm_optim_destroy(&o);
    fm_optim_destroy(&o2);
    fm_mlp_destroy(&m);
    fm_mlp_destroy(&m2);
}

int main(void)
{
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(tmpdir, sizeof tmpdir, "%s/test_trainer_units.XXXXXX", base);
    CHECK(mkdtemp(tmpdir) != NULL);
    test_backward_matches_finite_differences();
    test_backward_stops_on_callback_error();
    test_backward_blocks_bitwise();
    test_optimisers();
    test_permutation();
    test_idx_reader();
    test_checkpoint();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    printf("test_trainer_units: ok\n");
    return 0;
}
