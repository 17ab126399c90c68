/* build/optim-bandwidth: the optimizer step of the Fashion-MNIST MLP (784-1024-1024-10, 1.86 M
 * parameters) alone, on one process and on P processes at once (each pinned to its own CPU,
 * starting every timing together through a barrier in shared memory), to show what the memory
 * bus allows when every rank streams its optimizer state. Cases, per step:
 *
 *   stream       the bound: reads p, g, m, v and writes p, m, v (28 bytes per element, Adam's
 *                traffic) with one multiply-add per array, no division or square root
 *   trainer      the trainer's own float Adam loop (examples/fashion-mnist/optim.c)
 *   libddp       libddp's vectorised Adam (ddp_optim_step; double arithmetic, float storage)
 *   libddp-half  the same on the 1.06 M elements the larger ZeRO-1 shard holds at world 2
 *                (fc2.weight, fc2.bias, fc3.weight, fc3.bias)
 *   libddp-share the same on process q's chunk q of P of every parameter (P = --procs; one
 *                process alone: chunk 0): what ZeRO-1 in chunks, the trainer's default, gives
 *                each of P ranks to step, without its exchange
 *
 *   build/optim-bandwidth [--procs P] [--reps R] [--steps S] [--hidden H]
 *
 * Prints per case and process count the step time (ms, min / median / max over R repetitions of
 * S steps, each repetition's slowest process) and the traffic it implies (28 bytes per element
 * per step / time), then the same from the processes' CPU time (a process descheduled by other
 * work on a shared machine does not count it; one stalled on memory does). Repetitions alternate
 * one process and all of them. Last, the optimizer phase's bound at P ranks: libddp on the whole
 * model, one process, against libddp-share on P processes at once (each its 1/P): how much
 * faster P ranks can step at best, before any exchange, with the memory bus shared. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "trainer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* This process's CPU time: a step descheduled by other work on a shared machine does not count,
 * a step stalled on memory does. */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { CASE_STREAM, CASE_TRAINER, CASE_LIBDDP, CASE_LIBDDP_HALF, CASE_LIBDDP_SHARE, NCASES };
static const char *const case_names[NCASES] = {"stream", "trainer", "libddp", "libddp-half",
                                               "libddp-share"};

/* Where chunk q of P of a parameter of n elements starts and how long it is: ZeRO's cut
 * (ceil(n / P) elements per chunk, the last ones shorter or empty). */
static size_t share_start(size_t n, int q, int parts)
{
    size_t chunk = (n + (size_t)parts - 1) / (size_t)parts, lo = (size_t)q * chunk;
    return lo < n ? lo : n;
}

static size_t share_numel(size_t n, int q, int parts)
{
    size_t lo = share_start(n, q, parts), chunk = (n + (size_t)parts - 1) / (size_t)parts;
    return n - lo < chunk ? n - lo : chunk;
}

#define MAX_PROCS 8
#define MAX_REPS 64

typedef struct shared {
    pthread_barrier_t barrier;
    double ms[NCASES][MAX_REPS][MAX_PROCS];     /* wall time per step */
    double cpu_ms[NCASES][MAX_REPS][MAX_PROCS]; /* CPU time per step */
} shared_t;

static float *floats(size_t n, float value)
{
    float *p = aligned_alloc(64, ((n ? n : 1) * sizeof(float) + 63) & ~(size_t)63);
    if (!p) {
        fprintf(stderr, "optim-bandwidth: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) p[i] = value * (float)(1 + i % 7);
    return p;
}

/* The bound: the same bytes as Adam (4 arrays read, 3 written), the least arithmetic. */
static void stream_step(float *restrict p, const float *restrict g, float *restrict m,
                        float *restrict v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float gi = g[i];
        m[i] = 0.9f * m[i] + gi;
        v[i] = 0.999f * v[i] + gi;
        p[i] -= 1e-3f * gi;
    }
}

/* One repetition r of every case in process `proc`. */
static void run_process(int proc, int parts, int r, int steps, size_t hidden, shared_t *sh)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(proc % CPU_SETSIZE, &set);
    (void)sched_setaffinity(0, sizeof set, &set); /* best effort: fewer CPUs than processes */
    size_t numel[FM_NPARAMS] = {hidden * FM_PIXELS, hidden,     hidden * hidden,
                                hidden,             FM_CLASSES * hidden, FM_CLASSES};
    size_t total = 0, half = numel[2] + numel[3] + numel[4] + numel[5];
    float *params[FM_NPARAMS], *grads[FM_NPARAMS];
    ddp_param_t dp[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) {
        total += numel[k];
        params[k] = floats(numel[k], 1e-2f);
        grads[k] = floats(numel[k], 1e-3f);
        dp[k] = (ddp_param_t){.name = NULL, .data = params[k], .numel = numel[k],
                              .dtype = DDP_F32};
    }
    float *sp = floats(total, 1e-2f), *sg = floats(total, 1e-3f), *sm = floats(total, 0),
          *sv = floats(total, 0);
    fm_optim_t opt;
    memset(&opt, 0, sizeof opt);
    opt.kind = FM_OPTIM_ADAM;
    opt.lr = 1e-3;
    opt.beta1 = 0.9;
    opt.beta2 = 0.999;
    opt.eps = 1e-8;
    if (fm_optim_create(&opt, numel)) {
        fprintf(stderr, "optim-bandwidth: out of memory\n");
        exit(1);
    }
    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    oc.kind = DDP_OPTIM_ADAM;
    oc.lr = 1e-3;
    ddp_param_t share[FM_NPARAMS];
    float *share_grads[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) {
        size_t lo = share_start(numel[k], proc, parts);
        share[k] = dp[k];
        share[k].data = params[k] + lo;
        share[k].numel = share_numel(numel[k], proc, parts);
        share_grads[k] = grads[k] + lo;
    }
    ddp_optim_t *lib = NULL, *lib_half = NULL, *lib_share = NULL;
    if (ddp_optim_create(dp, FM_NPARAMS, &oc, &lib) != DDP_OK ||
        ddp_optim_create(dp + 2, 4, &oc, &lib_half) != DDP_OK ||
        ddp_optim_create(share, FM_NPARAMS, &oc, &lib_share) != DDP_OK) {
        fprintf(stderr, "optim-bandwidth: ddp_optim_create: %s\n", ddp_last_error());
        exit(1);
    }
    (void)half;
    {
        for (int c = 0; c < NCASES; c++) {
            /* one untimed step, so every case starts with its arrays touched */
            for (int s = -1; s < steps; s++) {
                if (s == 0) pthread_barrier_wait(&sh->barrier);
                if (s == 0) {
                    sh->ms[c][r][proc] = now();
                    sh->cpu_ms[c][r][proc] = cpu_now();
                }
                switch (c) {
                case CASE_STREAM: stream_step(sp, sg, sm, sv, total); break;
                case CASE_TRAINER: fm_optim_step(&opt, params, grads); break;
                case CASE_LIBDDP: (void)ddp_optim_step(lib, (void *const *)grads); break;
                case CASE_LIBDDP_HALF:
                    (void)ddp_optim_step(lib_half, (void *const *)(grads + 2));
                    break;
                default: (void)ddp_optim_step(lib_share, (void *const *)share_grads); break;
                }
            }
            sh->ms[c][r][proc] = (now() - sh->ms[c][r][proc]) * 1e3 / steps;
            sh->cpu_ms[c][r][proc] = (cpu_now() - sh->cpu_ms[c][r][proc]) * 1e3 / steps;
        }
    }
    ddp_optim_destroy(lib);
    ddp_optim_destroy(lib_half);
    ddp_optim_destroy(lib_share);
    fm_optim_destroy(&opt);
    for (int k = 0; k < FM_NPARAMS; k++) {
        free(params[k]);
        free(grads[k]);
    }
    free(sp);
    free(sg);
    free(sm);
    free(sv);
}

int main(int argc, char **argv)
{
    int procs = 2, reps = 7, steps = 20;
    size_t hidden = 1024;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--procs"))
            procs = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps"))
            reps = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--steps"))
            steps = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--hidden"))
            hidden = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: optim-bandwidth [--procs 1..%d] [--reps 1..%d] [--steps N] "
                            "[--hidden H]\n", MAX_PROCS, MAX_REPS);
            return 2;
        }
    }
    if (procs < 1 || procs > MAX_PROCS || reps < 1 || reps > MAX_REPS || steps < 1 || !hidden) {
        fprintf(stderr, "optim-bandwidth: bad arguments (see the usage line)\n");
        return 2;
    }
    size_t total = hidden * FM_PIXELS + hidden * hidden + hidden * FM_CLASSES + 2 * hidden +
                   FM_CLASSES;
    size_t half = hidden * hidden + hidden * FM_CLASSES + hidden + FM_CLASSES;
    size_t numel[FM_NPARAMS] = {hidden * FM_PIXELS, hidden,     hidden * hidden,
                                hidden,             FM_CLASSES * hidden, FM_CLASSES};
    size_t share = 0; /* process 0's chunks, the largest share */
    for (int k = 0; k < FM_NPARAMS; k++) share += share_numel(numel[k], 0, procs);
    double med_of[NCASES][2], cmed_of[NCASES][2];
    printf("# optim-bandwidth: MLP 784-%zu-%zu-10 (%zu parameters; the larger ZeRO-1 shard at "
           "world 2: %zu), %d rep(s) of %d steps\n", hidden, hidden, total, half, reps, steps);
    printf("%-12s %6s %12s %12s %12s %10s %12s %10s\n", "case", "procs", "ms/step min", "median",
           "max", "GB/s/proc", "cpu ms med", "GB/s cpu");
    /* Repetitions interleave one process and all of them, so a drifting machine hits both. */
    int counts[2] = {1, procs};
    shared_t *sh[2];
    for (int k = 0; k < 2; k++) {
        sh[k] = mmap(NULL, sizeof *sh[k], PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
                     0);
        if (sh[k] == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        pthread_barrierattr_t ba;
        pthread_barrierattr_init(&ba);
        pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
        pthread_barrier_init(&sh[k]->barrier, &ba, (unsigned)counts[k]);
    }
    for (int r = 0; r < reps; r++) {
        for (int k = 0; k < 2; k++) {
            if (k == 1 && procs == 1) continue;
            pid_t pids[MAX_PROCS];
            for (int q = 0; q < counts[k]; q++) {
                pids[q] = fork();
                if (pids[q] < 0) {
                    perror("fork");
                    return 1;
                }
                if (pids[q] == 0) {
                    run_process(q, procs, r, steps, hidden, sh[k]);
                    _exit(0);
                }
            }
            int bad = 0;
            for (int q = 0; q < counts[k]; q++) {
                int status;
                if (waitpid(pids[q], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status))
                    bad = 1;
            }
            if (bad) {
                fprintf(stderr, "optim-bandwidth: a process failed\n");
                return 1;
            }
        }
    }
    for (int c = 0; c < NCASES; c++) {
        for (int k = 0; k < 2; k++) {
            int p = counts[k];
            if (k == 1 && procs == 1) continue;
            double v[MAX_REPS], cpu[MAX_REPS];
            for (int r = 0; r < reps; r++) { /* the slowest process of each repetition */
                v[r] = cpu[r] = 0;
                for (int q = 0; q < p; q++) {
                    if (sh[k]->ms[c][r][q] > v[r]) v[r] = sh[k]->ms[c][r][q];
                    if (sh[k]->cpu_ms[c][r][q] > cpu[r]) cpu[r] = sh[k]->cpu_ms[c][r][q];
                }
            }
            qsort(v, (size_t)reps, sizeof v[0], cmp);
            qsort(cpu, (size_t)reps, sizeof cpu[0], cmp);
            double med = reps % 2 ? v[reps / 2] : 0.5 * (v[reps / 2 - 1] + v[reps / 2]);
            double cmed = reps % 2 ? cpu[reps / 2] : 0.5 * (cpu[reps / 2 - 1] + cpu[reps / 2]);
            size_t n = c == CASE_LIBDDP_HALF ? half : c == CASE_LIBDDP_SHARE ? share : total;
            med_of[c][k] = med;
            cmed_of[c][k] = cmed;
            printf("%-12s %6d %12.3f %12.3f %12.3f %10.1f %12.3f %10.1f\n", case_names[c], p,
                   v[0], med, v[reps - 1], 28.0 * (double)n / (med * 1e-3) / 1e9, cmed,
                   28.0 * (double)n / (cmed * 1e-3) / 1e9);
        }
    }
    if (procs > 1)
        printf("# the optimizer phase's bound at %d ranks: the whole update on 1 process %.3f ms, "
               "each process's 1/%d share on %d at once %.3f ms: at most %.2fx faster (by CPU "
               "time %.3f / %.3f ms: %.2fx), before any exchange\n",
               procs, med_of[CASE_LIBDDP][0], procs, procs, med_of[CASE_LIBDDP_SHARE][1],
               med_of[CASE_LIBDDP][0] / med_of[CASE_LIBDDP_SHARE][1], cmed_of[CASE_LIBDDP][0],
               cmed_of[CASE_LIBDDP_SHARE][1], cmed_of[CASE_LIBDDP][0] / cmed_of[CASE_LIBDDP_SHARE][1]);
    return 0;
}
