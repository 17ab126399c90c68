/* switch-probe: the cost of handing one CPU from one process to another, the floor of a small
 * collective when ranks outnumber cores. With 4 ranks on 2 cores every core must run both of
 * its ranks once per collective, so each collective costs each core at least one process switch:
 * this program measures that switch, and bench/compare_collectives.sh prints it beside the
 * 4-rank latency.
 *
 * Two processes pinned to one CPU take turns through a counter in shared memory: each bumps its
 * counter, then calls sched_yield until the other has caught up, so every turn is one switch.
 * Prints the median over --rounds rounds of the time per turn, in microseconds (--json: one
 * JSON object).
 *
 * --across: the two processes are pinned to the first two allowed CPUs and spin instead of
 * yielding, and the second answers only after seeing the first's turn: every turn is one round
 * trip of a cache line between two cores, the floor of a collective whose every rank (a
 * broadcast's root included) returns only once it knows the others arrived.
 *
 * --across --bytes N: each turn the first process also writes N bytes into shared memory before
 * its turn and the second copies them out before answering: the hand-off of N freshly written
 * bytes from one core's cache to another's, the floor of a collective that copies through a
 * stage (docs/shm-transport.md, "One-shot"). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

typedef struct shared {
    _Atomic long turn[2][16]; /* one cache line each */
} shared_t;

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* --bytes: the shared area player 0 writes (from its private source) and player 1 reads (into
 * its private copy) each turn. */
static char *area, *source, *copy;
static size_t area_bytes;

/* Takes `turns` turns as player `me` (across: spinning, player 1 answering player 0); returns
 * the time per turn in microseconds. */
static double play(shared_t *sh, int me, long first, long turns, int across)
{
    double t0 = now_us();
    for (long t = first; t < first + turns; t++) {
        if (!across) {
            atomic_store(&sh->turn[me][0], t);
            while (atomic_load(&sh->turn[1 - me][0]) < t) sched_yield();
        } else if (me == 0) {
            if (area_bytes) {
                source[0] = (char)t;
                memcpy(area, source, area_bytes);
            }
            atomic_store(&sh->turn[0][0], t);
            while (atomic_load(&sh->turn[1][0]) < t) relax();
        } else {
            while (atomic_load(&sh->turn[0][0]) < t) relax();
            if (area_bytes) memcpy(copy, area, area_bytes);
            atomic_store(&sh->turn[1][0], t);
        }
    }
    return (now_us() - t0) / (double)turns;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void usage(FILE *out)
{
    fprintf(out, "usage: switch-probe [-n TURNS] [--rounds R] [--across [--bytes N]] [--json]\n"
                 "  the time one CPU takes to switch between two processes (sched_yield\n"
                 "  ping-pong of two processes pinned to the first allowed CPU); --across:\n"
                 "  a cache line's round trip between the first two allowed CPUs (spinning);\n"
                 "  --bytes N: each turn also hands N freshly written bytes from the first\n"
                 "  CPU's cache to the second (memcpy in, memcpy out)\n");
}

int main(int argc, char **argv)
{
    long turns = 20000, rounds = 5;
    int json = 0, across = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--across")) across = 1;
        else if (!strcmp(argv[i], "--bytes") && i + 1 < argc) {
            char *end = NULL;
            errno = 0;
            long v = strtol(argv[i + 1], &end, 10);
            if (errno || !end || *end || v < 1 || v > (1L << 30)) {
                fprintf(stderr, "switch-probe: --bytes wants 1 to 1073741824, not '%s'\n",
                        argv[i + 1]);
                return 2;
            }
            area_bytes = (size_t)v;
            i++;
        }
        else if ((!strcmp(argv[i], "-n") || !strcmp(argv[i], "--rounds")) && i + 1 < argc) {
            char *end = NULL;
            errno = 0;
            long v = strtol(argv[i + 1], &end, 10);
            if (errno || !end || *end || v < 1 || v > 100000000) {
                fprintf(stderr, "switch-probe: %s wants a count from 1 to 100000000, not '%s'\n",
                        argv[i], argv[i + 1]);
                return 2;
            }
            if (argv[i][1] == 'n') turns = v;
            else rounds = v;
            i++;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "switch-probe: unknown argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (rounds > 99) rounds = 99;
    if (area_bytes && !across) {
        fprintf(stderr, "switch-probe: --bytes goes with --across\n");
        return 2;
    }

    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
        perror("switch-probe: sched_getaffinity");
        return 1;
    }
    int cpu = 0, cpu2 = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed)) cpu++;
    cpu2 = cpu + 1;
    while (cpu2 < CPU_SETSIZE && !CPU_ISSET(cpu2, &allowed)) cpu2++;
    if (across && cpu2 >= CPU_SETSIZE) {
        fprintf(stderr, "switch-probe: --across needs two allowed CPUs, this process has one\n");
        return 1;
    }
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) {
        perror("switch-probe: sched_setaffinity");
        return 1;
    }
    shared_t *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("switch-probe: mmap");
        return 1;
    }
    memset(sh, 0, sizeof *sh);
    if (area_bytes) {
        area = mmap(NULL, area_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        source = malloc(area_bytes);
        copy = malloc(area_bytes);
        if (area == MAP_FAILED || !source || !copy) {
            perror("switch-probe: --bytes buffers");
            return 1;
        }
        memset(area, 0, area_bytes);
        memset(source, 1, area_bytes);
        memset(copy, 2, area_bytes);
    }
    pid_t child = fork();
    if (child < 0) {
        perror("switch-probe: fork");
        return 1;
    }
    /* Both play the same sequence of rounds (the affinity is inherited); the parent times. */
    int me = child == 0 ? 1 : 0;
    if (across && me == 1) {
        CPU_ZERO(&one);
        CPU_SET(cpu2, &one);
        if (sched_setaffinity(0, sizeof one, &one) != 0) {
            perror("switch-probe: sched_setaffinity");
            _exit(1);
        }
    }
    double per[99];
    long next = 1;
    play(sh, me, next, turns / 10 + 1, across); /* warm-up */
    next += turns / 10 + 1;
    for (long r = 0; r < rounds; r++) {
        per[r] = play(sh, me, next, turns, across);
        next += turns;
    }
    if (child == 0) _exit(0);
    int status = 0;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "switch-probe: the second process failed\n");
        return 1;
    }
    qsort(per, (size_t)rounds, sizeof per[0], cmp_double);
    double median = rounds % 2 ? per[rounds / 2] : (per[rounds / 2 - 1] + per[rounds / 2]) / 2;
    if (json && across)
        printf("{\"probe\":\"round_trip\",\"cpus\":[%d,%d],\"bytes\":%zu,\"turns\":%ld,"
               "\"rounds\":%ld,\"round_trip_us\":%.3f,\"min_us\":%.3f,\"max_us\":%.3f}\n",
               cpu, cpu2, area_bytes, turns, rounds, median, per[0], per[rounds - 1]);
    else if (across && area_bytes)
        printf("hand-off of %zu bytes from cpu %d to cpu %d, with the round trip: %.3f us, %.2f GB/s "
               "(median of %ld rounds of %ld turns; %.3f-%.3f)\n",
               area_bytes, cpu, cpu2, median, (double)area_bytes / median / 1e3, rounds, turns,
               per[0], per[rounds - 1]);
    else if (across)
        printf("cache-line round trip between cpus %d and %d: %.3f us (median of %ld rounds of %ld "
               "turns; %.3f-%.3f)\n",
               cpu, cpu2, median, rounds, turns, per[0], per[rounds - 1]);
    else if (json)
        printf("{\"probe\":\"switch\",\"cpu\":%d,\"turns\":%ld,\"rounds\":%ld,\"switch_us\":%.3f,"
               "\"min_us\":%.3f,\"max_us\":%.3f}\n",
               cpu, turns, rounds, median, per[0], per[rounds - 1]);
    else
        printf("process switch on cpu %d: %.2f us (median of %ld rounds of %ld turns; %.2f-%.2f)\n",
               cpu, median, rounds, turns, per[0], per[rounds - 1]);
    return 0;
}
