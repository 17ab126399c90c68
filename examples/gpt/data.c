/* The GPT trainer's data: the fortune files of Debian's `fortunes` package (English quotations),
 * read as bytes (the tokenizer is the identity on bytes), split into train and validation, and
 * the epoch permutation every rank computes alike. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

int gpt_text_load(const char *dir, double val_fraction, gpt_text_t *train, gpt_text_t *val,
                  char *err, size_t errlen)
{
    memset(train, 0, sizeof *train);
    memset(val, 0, sizeof *val);
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errlen,
                 "cannot open the fortunes directory %s (%s): install the Debian package "
                 "`fortunes` (apt-get install fortunes) or pass --data DIR",
                 dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t count = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        /* the quotation files themselves: not their strfile indexes (.dat), not the .u8 links
         * to the same files, not the offensive set's subdirectory */
        if (e->d_name[0] == '.' || ends_with(e->d_name, ".dat") || ends_with(e->d_name, ".u8"))
            continue;
        if (count == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(names, cap * sizeof *names);
            if (!grown) break;
            names = grown;
        }
        names[count] = strdup(e->d_name);
        if (names[count]) count++;
    }
    closedir(d);
    qsort(names, count, sizeof *names, cmp_names); /* the same text on every machine and rank */
    uint8_t *all = NULL;
    size_t len = 0;
    int rc = 0;
    for (size_t i = 0; i < count && rc == 0; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) continue; /* a subdirectory or an unreadable file: not text we can use */
        if (fseek(f, 0, SEEK_END) == 0) {
            long n = ftell(f);
            if (n > 0 && fseek(f, 0, SEEK_SET) == 0) {
                uint8_t *grown = realloc(all, len + (size_t)n);
                if (!grown) {
                    snprintf(err, errlen, "out of memory reading %s", path);
                    rc = -1;
                } else {
                    all = grown;
                    len += fread(all + len, 1, (size_t)n, f);
                }
            }
        }
        fclose(f);
    }
    for (size_t i = 0; i < count; i++) free(names[i]);
    free(names);
    if (rc) {
        free(all);
        return -1;
    }
    if (len < 4096) {
        snprintf(err, errlen,
                 "the fortunes directory %s holds only %zu bytes of text: install the Debian "
                 "package `fortunes` (apt-get install fortunes) or pass --data DIR",
                 dir, len);
        free(all);
        return -1;
    }
    size_t nval = (size_t)((double)len * val_fraction);
    train->len = len - nval;
    train->bytes = all;
    val->len = nval;
    val->bytes = malloc(nval ? nval : 1);
    if (!val->bytes) {
        snprintf(err, errlen, "out of memory");
        free(all);
        return -1;
    }
    memcpy(val->bytes, all + train->len, nval);
    return 0;
}

void gpt_text_free(gpt_text_t *t)
{
    free(t->bytes);
    memset(t, 0, sizeof *t);
}

void gpt_permutation(uint64_t seed, uint64_t epoch, size_t n, uint32_t *perm)
{
    uint64_t s = seed * 0x100000001B3ull ^ (epoch + 1) * 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
    for (size_t i = n; i > 1; i--) { /* Fisher-Yates */
        size_t j = (size_t)(gpt_splitmix64(&s) % i);
        uint32_t tmp = perm[i - 1];
        perm[i - 1] = perm[j];
        perm[j] = tmp;
    }
}
