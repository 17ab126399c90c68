/* The GPT trainer's checkpoint file (gpt.h): writing it atomically and reading it back with every
 * field checked before anything is allocated or trusted. Apart from main.c so that the reader is
 * a function returning an error (main.c turns it into a message and exit), which
 * tests/fuzz/fuzz_gpt_checkpoint.c drives with hostile files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpt.h"

static const char *const ck_unames[GPT_CK_NU] = {"layers", "heads", "channels", "context",
                                                  "batch", "accumulate", "steps", "warmup",
                                                  "seed", "param-dtype bf16"};
static const char *const ck_dnames[GPT_CK_ND] = {"lr", "min-lr-ratio", "weight-decay", "clip",
                                                  "val_fraction"};

static uint64_t fnv_bytes(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

int gpt_checkpoint_write(const char *path, const gpt_ckpt_header_t *h, const float *params,
                         const void *state, char *err, size_t errlen)
{
    uint64_t sum = 1469598103934665603ull;
    sum = fnv_bytes(sum, h, sizeof *h);
    sum = fnv_bytes(sum, params, h->nparams * sizeof(float));
    sum = fnv_bytes(sum, state, h->state_bytes);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(err, errlen, "--checkpoint: cannot create %s: %s", tmp, strerror(errno));
        return -1;
    }
    int ok = fwrite(h, sizeof *h, 1, f) == 1 &&
             fwrite(params, sizeof(float), h->nparams, f) == h->nparams &&
             fwrite(state, 1, h->state_bytes, f) == h->state_bytes &&
             fwrite(&sum, sizeof sum, 1, f) == 1 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (fclose(f) != 0 || !ok) {
        snprintf(err, errlen, "--checkpoint: writing %s failed: %s", tmp, strerror(errno));
        return -1;
    }
    if (rename(tmp, path) != 0) {
        snprintf(err, errlen, "--checkpoint: renaming %s to %s: %s", tmp, path, strerror(errno));
        return -1;
    }
    return 0;
}

int gpt_checkpoint_read(const char *path, const gpt_ckpt_header_t *want, uint64_t max_steps,
                        float *params, void **state, size_t *state_bytes, uint64_t *steps_done,
                        char *err, size_t errlen)
{
    int rc = -1;
    void *st = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    gpt_ckpt_header_t h;
    if (fread(&h, sizeof h, 1, f) != 1 || memcmp(h.magic, GPT_CKPT_MAGIC, 8) != 0) {
        snprintf(err, errlen, "%s is not a gpt checkpoint", path);
        goto out;
    }
    for (int i = 0; i < GPT_CK_NU; i++)
        if (h.u[i] != want->u[i]) {
            snprintf(err, errlen, "%s was written with %s %llu, this run has %llu", path,
                     ck_unames[i], (unsigned long long)h.u[i], (unsigned long long)want->u[i]);
            goto out;
        }
    for (int i = 0; i < GPT_CK_ND; i++)
        if (h.d[i] != want->d[i]) {
            snprintf(err, errlen, "%s was written with %s %g, this run has %g", path,
                     ck_dnames[i], h.d[i], want->d[i]);
            goto out;
        }
    if (h.nparams != want->nparams || h.steps_done > max_steps) {
        snprintf(err, errlen, "%s is corrupt (header)", path);
        goto out;
    }
    /* The optimizer state's size is believed only when the file is exactly as long as the header
     * says: a damaged or hostile size field cannot make this allocate more than the file holds. */
    struct stat sb;
    uint64_t fixed = sizeof h + h.nparams * sizeof(float) + sizeof(uint64_t);
    if (fstat(fileno(f), &sb) != 0 || sb.st_size < 0 || (uint64_t)sb.st_size < fixed ||
        h.state_bytes != (uint64_t)sb.st_size - fixed) {
        snprintf(err, errlen, "%s is %s: %lld bytes, its header describes %llu + %llu bytes of "
                 "optimizer state", path,
                 sb.st_size >= 0 && (uint64_t)sb.st_size < fixed + h.state_bytes ? "truncated"
                                                                                   : "corrupt",
                 (long long)sb.st_size, (unsigned long long)fixed,
                 (unsigned long long)h.state_bytes);
        goto out;
    }
    st = malloc(h.state_bytes ? (size_t)h.state_bytes : 1);
    if (!st) {
        snprintf(err, errlen, "out of memory reading %s", path);
        goto out;
    }
    /* h.nparams was checked: the stored floats fill the model exactly */
    uint64_t stored = 0;
    if (fread(params, sizeof(float), h.nparams, f) != h.nparams ||
        fread(st, 1, h.state_bytes, f) != h.state_bytes ||
        fread(&stored, sizeof stored, 1, f) != 1) {
        snprintf(err, errlen, "%s is truncated", path);
        goto out;
    }
    uint64_t sum = 1469598103934665603ull;
    sum = fnv_bytes(sum, &h, sizeof h);
    sum = fnv_bytes(sum, params, h.nparams * sizeof(float));
    sum = fnv_bytes(sum, st, h.state_bytes);
    if (sum != stored) {
        snprintf(err, errlen, "%s is corrupt (checksum)", path);
        goto out;
    }
    *state = st;
    *state_bytes = (size_t)h.state_bytes;
    *steps_done = h.steps_done;
    st = NULL;
    rc = 0;
out:
    free(st);
    fclose(f);
    return rc;
}
