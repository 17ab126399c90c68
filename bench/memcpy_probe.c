/* memcpy-probe: single-core memcpy bandwidth per size, the memory-speed bound the shared-memory
 * collectives are measured against (a 2-rank allreduce must at least read the peer's data and
 * write the result, so a large allreduce cannot beat a few memcpys of the same size).
 * Same sweep options and timing as ddp-bench: median over --rounds rounds of >= -n copies lasting
 * >= --min-ms each. GB/s = bytes copied / time (1 GB = 1e9 bytes), as ddp-bench's algbw. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    if (!*text || *text == '-') return -1;
    unsigned long long v = strtoull(text, &end, 10), scale = 1;
    if (errno || end == text) return -1;
    if (*end == 'k' || *end == 'K') scale = 1ULL << 10, end++;
    else if (*end == 'm' || *end == 'M') scale = 1ULL << 20, end++;
    else if (*end == 'g' || *end == 'G') scale = 1ULL << 30, end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end || v > ULLONG_MAX / scale) return -1;
    *out = (size_t)(v * scale);
    return 0;
}

static int parse_long(const char *text, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* Copies `iters` times; the empty asm makes the compiler assume dst is read, so no copy is
 * dropped. Returns microseconds per copy. */
static double time_copies(char *dst, const char *src, size_t bytes, long iters)
{
    double start = now_us();
    for (long k = 0; k < iters; k++) {
        memcpy(dst, src, bytes);
        __asm__ __volatile__("" : : "r"(dst) : "memory");
    }
    return (now_us() - start) / (double)iters;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    size_t min_bytes = 8, max_bytes = 256u << 20, factor = 4;
    long iters = 10, rounds = 5, json = 0;
    double min_ms = 10.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: memcpy-probe [-b SIZE] [-e SIZE] [-f N] [-n N] [--rounds N] "
                   "[--min-ms MS] [--json]\n"
                   "  sizes from -b (default 8) to -e (default 256M) times -f (default 4);\n"
                   "  K/M/G suffixes. Prints bytes, time per copy (us) and GB/s.\n");
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "memcpy-probe: option %s needs a value (or is unknown)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        long f = 0;
        int bad;
        if (!strcmp(a, "-b")) bad = parse_size(v, &min_bytes);
        else if (!strcmp(a, "-e")) bad = parse_size(v, &max_bytes);
        else if (!strcmp(a, "-f")) bad = parse_long(v, 2, 1 << 20, &f), factor = (size_t)f;
        else if (!strcmp(a, "-n")) bad = parse_long(v, 1, 100000000, &iters);
        else if (!strcmp(a, "--rounds")) bad = parse_long(v, 1, 1000, &rounds);
        else if (!strcmp(a, "--min-ms")) {
            char *end = NULL;
            min_ms = strtod(v, &end);
            bad = end == v || *end || !(min_ms >= 0);
        } else {
            fprintf(stderr, "memcpy-probe: unknown option '%s'\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "memcpy-probe: %s: bad value '%s'\n", a, v);
            return 2;
        }
    }
    if (min_bytes > max_bytes || min_bytes == 0) {
        fprintf(stderr, "memcpy-probe: -b must be >= 1 and <= -e\n");
        return 2;
    }
    size_t cap = (max_bytes + 4095) / 4096 * 4096;
    char *src = aligned_alloc(4096, cap), *dst = aligned_alloc(4096, cap);
    if (!src || !dst) {
        fprintf(stderr, "memcpy-probe: out of memory for two %zu-byte buffers\n", cap);
        return 1;
    }
    memset(src, 1, cap); /* fault every page in before timing */
    memset(dst, 2, cap);
    if (!json)
        printf("# memcpy-probe: one core, median of %ld rounds of >= %ld copies and >= %g ms\n"
               "# %12s %12s %12s\n",
               rounds, iters, min_ms, "size", "time(us)", "GB/s");
    for (size_t bytes = min_bytes;;) {
        time_copies(dst, src, bytes, 1);
        double per = time_copies(dst, src, bytes, iters);
        long n = iters;
        if (per * (double)n < min_ms * 1000.0) {
            double want = min_ms * 1000.0 / (per > 0.001 ? per : 0.001);
            n = want > 1e8 ? 100000000L : (long)ceil(want);
        }
        double times[1000];
        for (long r = 0; r < rounds; r++) times[r] = time_copies(dst, src, bytes, n);
        qsort(times, (size_t)rounds, sizeof times[0], compare_doubles);
        double t = rounds % 2 ? times[rounds / 2] : 0.5 * (times[rounds / 2 - 1] + times[rounds / 2]);
        double gbps = (double)bytes / t / 1e3;
        if (json)
            printf("{\"op\":\"memcpy\",\"bytes\":%zu,\"time_us\":%.4f,\"gbps\":%.6g,"
                   "\"iters\":%ld,\"rounds\":%ld,\"time_us_min\":%.4f,\"time_us_max\":%.4f}\n",
                   bytes, t, gbps, n, rounds, times[0], times[rounds - 1]);
        else
            printf("  %12zu %12.3f %12.2f\n", bytes, t, gbps);
        fflush(stdout);
        if (bytes > max_bytes / factor) break;
        bytes *= factor;
    }
    free(src);
    free(dst);
    return 0;
}
