/* main() for the fuzz targets outside libFuzzer (any compiler; what ctest runs): replays every
 * file of the directories and files named on the command line through the target's
 * LLVMFuzzerTestOneInput (seed corpus and regression inputs alike), then `-mutations N`
 * deterministic mutations of them (byte flips, truncations, splices, length-like fields, random
 * bytes; fixed seed, so a failure reproduces). A target that needs set-up defines
 * LLVMFuzzerInitialize, as it would for libFuzzer. Exits 1 when no input was found. With
 * FUZZ_SAVE_MUTATION=FILE each mutated input is written to FILE before it runs (the last one is
 * the one that failed). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

#define MAX_SEEDS 1024
#define FUZZ_MAX_INPUT (1u << 20)

static uint8_t *seeds[MAX_SEEDS];
static size_t lens[MAX_SEEDS];
static int nseeds;

static uint64_t next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    uint8_t *buf = malloc(FUZZ_MAX_INPUT);
    size_t n = buf ? fread(buf, 1, FUZZ_MAX_INPUT, f) : 0;
    fclose(f);
    if (!buf) return -1;
    fprintf(stderr, "replaying %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, n);
    if (nseeds < MAX_SEEDS) {
        seeds[nseeds] = buf;
        lens[nseeds++] = n;
    } else {
        free(buf);
    }
    return 0;
}

static int replay_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return 0; /* a target without regression inputs has no directory for them */
    /* Sorted, so a run replays in the same order everywhere. */
    char **names = NULL;
    size_t count = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "README") == 0) continue;
        if (count == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, cap * sizeof *names);
        }
        names[count++] = strdup(e->d_name);
    }
    closedir(d);
    for (size_t i = 1; i < count; i++)
        for (size_t j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    for (size_t i = 0; i < count; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        replay_file(path);
        free(names[i]);
    }
    free(names);
    return 0;
}

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    long mutations = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-mutations") == 0 && i + 1 < argc) {
            mutations = atol(argv[++i]);
            continue;
        }
        struct stat st;
        if (stat(argv[i], &st) != 0) continue; /* no regression inputs (yet) */
        if (S_ISDIR(st.st_mode) ? replay_dir(argv[i]) : replay_file(argv[i])) return 1;
    }
    if (nseeds == 0) {
        fprintf(stderr, "%s: no inputs found\n", argv[0]);
        return 1;
    }
    uint64_t rng = 42;
    uint8_t *work = malloc(FUZZ_MAX_INPUT + 4096);
    for (long it = 0; it < mutations; it++) {
        int a = (int)(next(&rng) % (uint64_t)nseeds);
        size_t n = lens[a];
        memcpy(work, seeds[a], n);
        int edits = 1 + (int)(next(&rng) % 4);
        for (int k = 0; k < edits; k++) {
            uint64_t r = next(&rng);
            switch (r % 5) {
            case 0: /* flip a byte */
                if (n) work[(r >> 8) % n] ^= (uint8_t)(1 + (r >> 32) % 255);
                break;
            case 1: /* truncate */
                if (n) n = (size_t)((r >> 8) % n);
                break;
            case 2: { /* append part of another seed */
                int b = (int)((r >> 8) % (uint64_t)nseeds);
                size_t take = lens[b] < 512 ? lens[b] : 512;
                if (n + take <= FUZZ_MAX_INPUT) {
                    memcpy(work + n, seeds[b], take);
                    n += take;
                }
                break;
            }
            case 3: /* a 4- or 8-byte field (either byte order) set to an interesting number */
                if (n >= 8) {
                    static const uint64_t v[] = {0, 1, 2, 3, 4, 0x7f, 0xff, 0x7fffffff,
                                                 0xffffffff, 0x100000000ull, 0x7fffffffffffffffull,
                                                 0xffffffffffffffffull, 4096, 4097, 65536};
                    size_t at = (size_t)((r >> 8) % (n - 7));
                    uint64_t x = v[(r >> 40) % (sizeof v / sizeof v[0])];
                    int wide = (r >> 50) & 1, big = (r >> 51) & 1, w = wide ? 8 : 4;
                    for (int j = 0; j < w; j++)
                        work[at + (size_t)(big ? w - 1 - j : j)] = (uint8_t)(x >> (8 * j));
                }
                break;
            default: /* insert random bytes */
                for (int j = 0; j < 8 && n < FUZZ_MAX_INPUT; j++) work[n++] = (uint8_t)next(&rng);
                break;
            }
        }
        if (getenv("FUZZ_SAVE_MUTATION")) {
            /* Keeps the input about to run, so that one that fails can be looked at. */
            FILE *f = fopen(getenv("FUZZ_SAVE_MUTATION"), "wb");
            if (f) {
                fwrite(work, 1, n, f);
                fclose(f);
            }
        }
        LLVMFuzzerTestOneInput(work, n);
    }
    printf("%s: %d inputs replayed, %ld mutated inputs: ok\n", argv[0], nseeds, mutations);
    for (int i = 0; i < nseeds; i++) free(seeds[i]);
    free(work);
    return 0;
}
