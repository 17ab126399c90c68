/* Fashion-MNIST reader (IDX files inside gzip, read with zlib), a synthetic stand-in for
 * benchmarks, and the DistributedSampler's per-epoch permutation.
 * IDX: big-endian u32 magic (0x803 images, 0x801 labels), u32 count, for images u32 rows and
 * u32 cols, then the bytes. Every check says which file and what was expected. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "trainer.h"

/* Statistics of the Fashion-MNIST training pixels (scaled to [0, 1]). */
#define FM_MEAN 0.2860f
#define FM_STD 0.3530f

#define INSTALL_HINT                                                                              \
    "install the data with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or pass "    \
    "--data DIR holding the four *-ubyte.gz files"

static int read_exact(gzFile f, void *buf, size_t bytes, const char *path, const char *what,
                      char *err, size_t errlen)
{
    size_t done = 0;
    while (done < bytes) {
        size_t want = bytes - done;
        if (want > (1u << 30)) want = 1u << 30;
        int got = gzread(f, (char *)buf + done, (unsigned)want);
        if (got < 0) {
            int code = 0;
            const char *msg = gzerror(f, &code);
            snprintf(err, errlen, "%s: corrupt gzip data while reading %s (%s); %s", path, what,
                     msg ? msg : "unknown zlib error", INSTALL_HINT);
            return -1;
        }
        if (got == 0) {
            snprintf(err, errlen,
                     "%s: truncated: expected %zu bytes of %s, the file ends after %zu; %s", path,
                     bytes, what, done, INSTALL_HINT);
            return -1;
        }
        done += (size_t)got;
    }
    return 0;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static gzFile open_gz(const char *path, char *err, size_t errlen)
{
    gzFile f = gzopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s; %s", path,
                 errno ? strerror(errno) : "out of memory", INSTALL_HINT);
        return NULL;
    }
    gzbuffer(f, 1 << 18);
    return f;
}

int fm_dataset_load(const char *dir, const char *split, size_t limit, fm_dataset_t *out,
                    char *err, size_t errlen)
{
    char ipath[4096], lpath[4096];
    snprintf(ipath, sizeof ipath, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(lpath, sizeof lpath, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    memset(out, 0, sizeof *out);
    unsigned char *pixels = NULL;
    gzFile fi = NULL, fl = NULL;
    unsigned char hdr[16];

    fi = open_gz(ipath, err, errlen);
    if (!fi) goto fail;
    if (read_exact(fi, hdr, 16, ipath, "IDX header", err, errlen)) goto fail;
    if (be32(hdr) != 0x803) {
        snprintf(err, errlen,
                 "%s: bad magic 0x%08x (expected 0x00000803, an IDX file of u8 images); %s",
                 ipath, be32(hdr), INSTALL_HINT);
        goto fail;
    }
    uint32_t icount = be32(hdr + 4), rows = be32(hdr + 8), cols = be32(hdr + 12);
    if (rows != 28 || cols != 28) {
        snprintf(err, errlen, "%s: images are %ux%u, expected 28x28; %s", ipath, rows, cols,
                 INSTALL_HINT);
        goto fail;
    }
    if (icount == 0) {
        snprintf(err, errlen, "%s: holds 0 images; %s", ipath, INSTALL_HINT);
        goto fail;
    }

    fl = open_gz(lpath, err, errlen);
    if (!fl) goto fail;
    if (read_exact(fl, hdr, 8, lpath, "IDX header", err, errlen)) goto fail;
    if (be32(hdr) != 0x801) {
        snprintf(err, errlen,
                 "%s: bad magic 0x%08x (expected 0x00000801, an IDX file of u8 labels); %s",
                 lpath, be32(hdr), INSTALL_HINT);
        goto fail;
    }
    uint32_t lcount = be32(hdr + 4);
    if (lcount != icount) {
        snprintf(err, errlen, "%s holds %u labels but %s holds %u images; %s", lpath, lcount,
                 ipath, icount, INSTALL_HINT);
        goto fail;
    }

    size_t n = icount;
    if (limit && limit < n) n = limit;
    out->count = n;
    out->labels = malloc(n);
    out->images = malloc(n * FM_PIXELS * sizeof(float));
    pixels = malloc(n * FM_PIXELS);
    if (!out->labels || !out->images || !pixels) {
        snprintf(err, errlen, "out of memory for %zu samples of %s", n, split);
        goto fail;
    }
    char what[64];
    snprintf(what, sizeof what, "pixels (%zu images)", n);
    if (read_exact(fi, pixels, n * FM_PIXELS, ipath, what, err, errlen)) goto fail;
    snprintf(what, sizeof what, "labels (%zu)", n);
    if (read_exact(fl, out->labels, n, lpath, what, err, errlen)) goto fail;
    for (size_t i = 0; i < n; i++) {
        if (out->labels[i] >= FM_CLASSES) {
            snprintf(err, errlen, "%s: label %zu is %u, expected 0..9 (corrupt file); %s", lpath,
                     i, out->labels[i], INSTALL_HINT);
            goto fail;
        }
    }
    for (size_t i = 0; i < n * FM_PIXELS; i++)
        out->images[i] = ((float)pixels[i] / 255.0f - FM_MEAN) / FM_STD;
    free(pixels);
    gzclose(fi);
    gzclose(fl);
    return 0;

fail:
    free(pixels);
    if (fi) gzclose(fi);
    if (fl) gzclose(fl);
    fm_dataset_free(out);
    return -1;
}

uint64_t fm_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int fm_dataset_synthetic(size_t count, uint64_t seed, fm_dataset_t *out)
{
    memset(out, 0, sizeof *out);
    out->count = count;
    out->labels = malloc(count ? count : 1);
    out->images = malloc((count ? count : 1) * FM_PIXELS * sizeof(float));
    if (!out->labels || !out->images) {
        fm_dataset_free(out);
        return -1;
    }
    uint64_t s = seed ^ 0x5eedda7aULL;
    for (size_t i = 0; i < count; i++) {
        float *x = out->images + i * FM_PIXELS;
        for (size_t j = 0; j < FM_PIXELS; j++)
            x[j] = (float)((double)(fm_splitmix64(&s) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
        /* The label is the region of the image with the largest sum: learnable, not trivial. */
        int best = 0;
        float best_sum = -1e30f;
        for (int c = 0; c < FM_CLASSES; c++) {
            float sum = 0;
            for (size_t j = (size_t)c * 78; j < (size_t)(c + 1) * 78; j++) sum += x[j];
            if (sum > best_sum) {
                best_sum = sum;
                best = c;
            }
        }
        out->labels[i] = (uint8_t)best;
    }
    return 0;
}

void fm_dataset_free(fm_dataset_t *d)
{
    free(d->images);
    free(d->labels);
    d->images = NULL;
    d->labels = NULL;
    d->count = 0;
}

void fm_permutation(uint64_t seed, uint64_t epoch, size_t n, uint32_t *perm)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + epoch * 0xd1b54a32d192ed03ULL + 1;
    for (size_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
    /* Fisher-Yates from the end; the bound's modulo bias is below 2^-40 for n < 2^24. */
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(fm_splitmix64(&s) % i);
        uint32_t t = perm[i - 1];
        perm[i - 1] = perm[j];
        perm[j] = t;
    }
}
