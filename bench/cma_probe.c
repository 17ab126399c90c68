/* cma-probe: the parts a 2-rank single-copy allreduce (src/transport/shm/shm_cma.c) is made of,
 * timed alone, to show which one limits it and how far the memcpy anchor is from a fair bound.
 * Two processes (fork), each with its own buffers on transparent huge pages (as the transport
 * collapses reused buffers). For each size S, interleaved, median over --rounds rounds:
 *   memcpy          rank 0 copies S bytes, rank 1 idle (memcpy-probe's anchor, hot buffers)
 *   memcpy-cold     the same after evicting both buffers from the caches (64 MiB of other writes)
 *   memcpy x2       both ranks copy S bytes at the same time (what two cores get together);
 *                   below 4 MiB each rank copies the same buffer 4 MiB / S times in the timed
 *                   region (at most 2^19), so a small size times the copy, not the barrier
 *   readv           rank 0 reads S bytes of rank 1's buffer with one process_vm_readv
 *   readv x2        both read S bytes of each other at the same time
 *   readv x2 128K   the same in 128 KiB calls (the piece size of the single-copy reduction)
 *   allreduce bytes both ranks move what a single-copy allreduce moves, without waiting for each
 *                   other: read S/2 of the peer in 128 KiB pieces and add it to S/2 of their own
 *                   into the output, then read the peer's other S/2 into the output
 *   reduce part     only the first half of that (the reads in pieces and the additions)
 *   gather part     only the second (one process_vm_readv of S/2 into the output)
 *   ... 512K, 32K   the same with pieces of 512 KiB or 32 KiB instead of 128 KiB
 *   reduce streamed both ranks move what the registered ("mapped") allreduce moves, with its
 *                   kernel (ddp__reduce_multi_stream, every destination non-temporal): in a
 *                   shared memfd (4 KiB pages, as registered memory) holding both ranks' sends
 *                   and recvs, each sums its half of the two sends into that half of both recvs
 *   memfd copy x2   "memcpy x2" between buffers of that memfd instead of huge pages
 * GB/s = S / time, as ddp-bench's algbw (so "allreduce bytes" compares with its algbw directly).
 * Usage: cma-probe [-b SIZE] [-e SIZE] [-f N] [--rounds N] */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/reduce.h"

#define HUGE ((size_t)2 << 20)
#define PIECE ((size_t)128 << 10)
#define EVICT ((size_t)64 << 20)

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int parse_size(const char *t, size_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(t, &end, 10), scale = 1;
    if (errno || end == t || *t == '-') return -1;
    if (*end == 'K' || *end == 'k') scale = 1ULL << 10, end++;
    else if (*end == 'M' || *end == 'm') scale = 1ULL << 20, end++;
    else if (*end == 'G' || *end == 'g') scale = 1ULL << 30, end++;
    if (*end || v == 0 || v > ULLONG_MAX / scale) return -1;
    *out = (size_t)(v * scale);
    return 0;
}

/* Shared between the two processes: a generation barrier and each rank's pid. */
typedef struct {
    _Atomic unsigned arrived;
    _Atomic unsigned generation;
    int pid[2];
    double us[2];
} shared_t;

static shared_t *sh;

static void barrier(void)
{
    unsigned g = atomic_load(&sh->generation);
    if (atomic_fetch_add(&sh->arrived, 1) == 1) {
        atomic_store(&sh->arrived, 0);
        atomic_fetch_add(&sh->generation, 1);
    } else {
        while (atomic_load(&sh->generation) == g) __builtin_ia32_pause();
    }
}

static char *huge_alloc(size_t bytes)
{
    size_t n = (bytes + HUGE - 1) & ~(HUGE - 1);
    void *p = NULL;
    if (posix_memalign(&p, HUGE, n)) return NULL;
    (void)madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

static int readv_all(int pid, void *local, const void *remote, size_t bytes, size_t piece)
{
    for (size_t o = 0; o < bytes; o += piece) {
        size_t k = bytes - o < piece ? bytes - o : piece;
        struct iovec l = {(char *)local + o, k}, r = {(char *)remote + o, k};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got != (ssize_t)k) return -1;
    }
    return 0;
}

/* dst[i] = a[i] + b[i], f32 (the compiler vectorises it; the library's kernel is the same
 * arithmetic with AVX2). */
static void add_f32(float *restrict dst, const float *restrict a, const float *restrict b,
                    size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
}

enum {
    MEMCPY,
    MEMCPY_COLD,
    MEMCPY2,
    READV,
    READV2,
    READV2_PIECES,
    ALLREDUCE,
    REDUCE_PART,
    GATHER_PART,
    ALLREDUCE_512K,
    REDUCE_PART_512K,
    REDUCE_PART_32K,
    REDUCE_STREAMED,
    MEMCPY2_MEMFD,
    TESTS
};
static const char *const names[TESTS] = {
    "memcpy",          "memcpy-cold",      "memcpy x2",       "readv",
    "readv x2",        "readv x2 128K",    "allreduce bytes", "  reduce part",
    "  gather part",   "allreduce 512K",   "  reduce 512K",   "  reduce 32K",
    "reduce streamed", "memfd copy x2"};

/* The shared memfd of "reduce streamed": rank 0's send, rank 1's send, rank 0's recv, rank 1's
 * recv, each the largest size long. */
static char *shared_bufs[4];

/* How many copies one timed "memcpy x2" run makes: enough for 4 MiB, at most 2^19. */
static size_t x2_reps(size_t bytes)
{
    const size_t enough = (size_t)4 << 20;
    if (bytes >= enough) return 1;
    size_t reps = (enough + bytes - 1) / (bytes ? bytes : 1);
    return reps < ((size_t)1 << 19) ? reps : (size_t)1 << 19;
}

/* One timed run of test t on rank r; returns microseconds (rank 0's, or the slower rank's when
 * both work). */
static double run(int t, int r, char *src, char *dst, char *evict, char *scratch, size_t bytes)
{
    int peer = sh->pid[1 - r];
    if (t == MEMCPY_COLD) memset(evict, r + t, EVICT);
    barrier();
    double t0 = now_us();
    int rc = 0;
    switch (t) {
    case MEMCPY:
    case MEMCPY_COLD:
        if (r == 0) memcpy(dst, src, bytes);
        break;
    case MEMCPY2:
        for (size_t i = 0; i < x2_reps(bytes); i++) {
            memcpy(dst, src, bytes);
            __asm__ __volatile__("" : : "r"(dst) : "memory");
        }
        break;
    case READV:
        if (r == 0) rc = readv_all(peer, dst, src, bytes, bytes);
        break;
    case READV2: rc = readv_all(peer, dst, src, bytes, bytes); break;
    case READV2_PIECES: rc = readv_all(peer, dst, src, bytes, PIECE); break;
    case ALLREDUCE:
    case REDUCE_PART:
    case GATHER_PART:
    case ALLREDUCE_512K:
    case REDUCE_PART_512K:
    case REDUCE_PART_32K: {
        size_t half = bytes / 2, mine = (size_t)r * half, other = (size_t)(1 - r) * half;
        size_t piece = t == ALLREDUCE_512K || t == REDUCE_PART_512K ? 4 * PIECE
                       : t == REDUCE_PART_32K                       ? PIECE / 4
                                                                    : PIECE;
        for (size_t o = 0; o < half && rc == 0 && t != GATHER_PART; o += piece) {
            size_t k = half - o < piece ? half - o : piece;
            rc = readv_all(peer, scratch, src + mine + o, k, k);
            add_f32((float *)(dst + mine + o), (const float *)(src + mine + o),
                    (const float *)scratch, k / sizeof(float));
        }
        /* The peer's result half: without waiting for it (its values do not matter here). */
        int gather = t != REDUCE_PART && t != REDUCE_PART_512K && t != REDUCE_PART_32K;
        if (rc == 0 && gather) rc = readv_all(peer, dst + other, dst + other, half, half);
        break;
    }
    case REDUCE_STREAMED: {
        size_t half = bytes / 2 / sizeof(float) * sizeof(float), mine = (size_t)r * half;
        size_t count = (r ? bytes / sizeof(float) * sizeof(float) - half : half) / sizeof(float);
        const void *srcs[2] = {shared_bufs[0] + mine, shared_bufs[1] + mine};
        void *dsts[2] = {shared_bufs[2 + r] + mine, shared_bufs[3 - r] + mine};
        ddp__reduce_multi_stream(dsts, 2, 3u, srcs, 2, count, DDP_F32, DDP_SUM);
        break;
    }
    case MEMCPY2_MEMFD: memcpy(shared_bufs[2 + r], shared_bufs[r], bytes); break;
    }
    __asm__ __volatile__("" : : "r"(dst) : "memory");
    sh->us[r] = now_us() - t0;
    if (rc) fprintf(stderr, "cma-probe: process_vm_readv: %s\n", strerror(errno));
    barrier();
    double us = sh->us[0];
    if (t >= MEMCPY2 && t != READV)
        us = sh->us[0] > sh->us[1] ? sh->us[0] : sh->us[1];
    if (t == MEMCPY2) us /= (double)x2_reps(bytes);
    barrier();
    return rc ? -1.0 : us;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    size_t lo = (size_t)32 << 20, hi = (size_t)128 << 20;
    long factor = 4, rounds = 7;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-b") && v && !parse_size(v, &lo)) i++;
        else if (!strcmp(a, "-e") && v && !parse_size(v, &hi)) i++;
        else if (!strcmp(a, "-f") && v && (factor = atol(v)) > 1) i++;
        else if (!strcmp(a, "--rounds") && v && (rounds = atol(v)) > 0 && rounds <= 101) i++;
        else {
            fprintf(stderr, "usage: cma-probe [-b SIZE] [-e SIZE] [-f N] [--rounds N]\n");
            return 2;
        }
    }
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return 1;
    memset(sh, 0, sizeof *sh);
    sh->pid[0] = getpid();
    int fd = memfd_create("cma-probe", MFD_CLOEXEC);
    char *area = fd < 0 || ftruncate(fd, (off_t)(4 * hi)) != 0
                     ? MAP_FAILED
                     : mmap(NULL, 4 * hi, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (area == MAP_FAILED) {
        fprintf(stderr, "cma-probe: cannot make a shared memfd of %zu bytes: %s\n", 4 * hi,
                strerror(errno));
        return 1;
    }
    memset(area, 0, 4 * hi);
    for (int b = 0; b < 4; b++) shared_bufs[b] = area + (size_t)b * hi;
    /* Yama's ptrace_scope 1 lets only ancestors read a process: the child reads the parent. */
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    pid_t child = fork();
    if (child < 0) return 1;
    int r = child == 0;
    if (r) sh->pid[1] = getpid();
    barrier();
    char *src = huge_alloc(hi), *dst = huge_alloc(hi), *evict = huge_alloc(EVICT),
         *scratch = huge_alloc(4 * PIECE);
    if (!src || !dst || !evict || !scratch) {
        fprintf(stderr, "cma-probe: out of memory\n");
        return 1;
    }
    if (r == 0) printf("%-16s %12s %10s %10s %10s\n", "test", "bytes", "GB/s", "min", "max");
    for (size_t bytes = lo; bytes <= hi; bytes *= (size_t)factor) {
        double us[TESTS][101];
        for (int t = 0; t < TESTS; t++) run(t, r, src, dst, evict, scratch, bytes); /* warm up */
        for (long k = 0; k < rounds; k++)
            for (int t = 0; t < TESTS; t++) us[t][k] = run(t, r, src, dst, evict, scratch, bytes);
        if (r == 0)
            for (int t = 0; t < TESTS; t++) {
                qsort(us[t], (size_t)rounds, sizeof(double), cmp);
                printf("%-16s %12zu %10.2f %10.2f %10.2f\n", names[t], bytes,
                       (double)bytes / us[t][rounds / 2] / 1e3,
                       (double)bytes / us[t][rounds - 1] / 1e3,
                       (double)bytes / us[t][0] / 1e3);
            }
        if (bytes > hi / (size_t)factor) break;
    }
    if (child > 0) waitpid(child, NULL, 0);
    return 0;
}
