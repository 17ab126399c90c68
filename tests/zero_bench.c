/* zero-bench: optimizer memory per rank and step time of plain data parallelism against ZeRO
 * (stage 1, stage 2, stage 1 with the overlap hook) on the trainer's MLP shape
 * (784 -> hidden -> hidden -> 10). Backward is simulated: each parameter's gradient is written
 * with `work` extra multiply-adds per element (a stand-in for the GEMM that produces it), last
 * layer first, so communication and the overlapped optimizer step have something to hide behind.
 * Ranks are processes over a file store and the default transport (shared memory).
 *
 * usage: zero-bench [--world N] [--hidden H] [--iters I] [--optim sgd|adam] [--work K]
 *                   [--modes plain,zero1,zero2,zero2r,overlap]
 * (zero2r: stage 2 with each gradient handed over by ddp_zero_grad_ready during backward)
 * Prints one row per mode: state bytes on each rank, median and mean step time (ms, slowest
 * rank), and the step time ratio against plain measured in the same run. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "harness.h"

#define NP 6

typedef struct opts {
    int world, hidden, iters, work;
    ddp_optim_kind_t optim;
    char modes[128];
} opts_t;

static volatile float sink;

static void fake_grad(float *g, size_t n, int step, int rank, int param, int work)
{
    uint32_t base = (uint32_t)(step * 131 + rank * 17 + param * 7);
    float acc = 0.0f;
    for (size_t e = 0; e < n; e++) {
        float v = (float)(((uint32_t)e * 2654435761u + base) & 1023u) * 1e-6f - 5e-4f;
        for (int k = 0; k < work; k++) acc = acc * 0.999f + v;
        g[e] = v;
    }
    sink = acc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct ready_ctx {
    ddp_reducer_t *reducer;
} ready_ctx_t;

static int run_mode(ddp_group_t *g, const opts_t *o, const char *mode, double *plain_median)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t in = 784, h = (size_t)o->hidden, out = 10;
    size_t numel[NP] = {h * in, h, h * h, h, out * h, out};
    size_t rows[NP] = {h, 0, h, 0, out, 0};
    static const char *names[NP] = {"W1", "b1", "W2", "b2", "W3", "b3"};
    ddp_param_t params[NP];
    float *data[NP], *local[NP];
    for (int i = 0; i < NP; i++) {
        data[i] = calloc(numel[i], sizeof(float));
        local[i] = NULL;
        for (size_t e = 0; e < numel[i]; e++) data[i][e] = (float)((e % 97) * 1e-3);
        params[i] = (ddp_param_t){names[i], data[i], numel[i], DDP_F32, rows[i], 0, NULL};
    }
    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    oc.kind = o->optim;
    oc.lr = o->optim == DDP_OPTIM_ADAM ? 1e-3 : 0.01;
    oc.momentum = 0.9;

    int is_plain = strcmp(mode, "plain") == 0, overlap = strcmp(mode, "overlap") == 0;
    int ready2 = strcmp(mode, "zero2r") == 0; /* stage 2 with ddp_zero_grad_ready */
    int stage2 = strcmp(mode, "zero2") == 0 || ready2;
    ddp_optim_t *plain = NULL;
    ddp_zero_t *zero = NULL;
    ddp_reducer_t *reducer = NULL;
    if (is_plain) {
        CHECK_OK(ddp_optim_create(params, NP, &oc, &plain));
    } else {
        ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
        zc.stage = stage2 ? 2 : 1;
        zc.overlap = overlap;
        zc.optim = oc;
        CHECK_OK(ddp_zero_create(g, params, NP, &zc, &zero));
    }
    if (!stage2) {
        ddp_reducer_config_t rc = DDP_REDUCER_CONFIG_INIT;
        rc.rebuild_buckets = 0;
        if (overlap) {
            rc.comm_hook = ddp_zero_hook;
            rc.comm_hook_state = zero;
        }
        CHECK_OK(ddp_reducer_create(g, params, NP, NULL, 0, &rc, &reducer));
    } else {
        for (int i = 0; i < NP; i++) local[i] = calloc(numel[i], sizeof(float));
    }

    double *times = calloc((size_t)o->iters, sizeof(double));
    int warmup = 2;
    for (int it = 0; it < o->iters + warmup; it++) {
        CHECK_OK(ddp_group_barrier(g));
        double t0 = ddp__now_us();
        void *grads[NP];
        if (reducer) {
            CHECK_OK(ddp_reducer_prepare(reducer));
            for (int i = 0; i < NP; i++) CHECK_OK(ddp_reducer_grad(reducer, (size_t)i, &grads[i]));
            for (int i = NP - 1; i >= 0; i--) {
                fake_grad(grads[i], numel[i], it, rank, i, o->work);
                CHECK_OK(ddp_reducer_grad_ready(reducer, (size_t)i));
            }
            CHECK_OK(ddp_reducer_finalize(reducer));
            if (plain)
                CHECK_OK(ddp_optim_step(plain, grads));
            else
                CHECK_OK(ddp_zero_step(zero, overlap ? NULL : grads));
        } else {
            for (int i = NP - 1; i >= 0; i--) {
                fake_grad(local[i], numel[i], it, rank, i, o->work);
                grads[i] = local[i];
                if (ready2) CHECK_OK(ddp_zero_grad_ready(zero, (size_t)i, local[i]));
            }
            CHECK_OK(ddp_zero_step(zero, ready2 ? NULL : grads));
        }
        double dt = (ddp__now_us() - t0) / 1000.0;
        CHECK_OK(ddp_group_allreduce(g, &dt, &dt, 1, DDP_F64, DDP_MAX));
        if (it >= warmup) times[it - warmup] = dt;
    }
    qsort(times, (size_t)o->iters, sizeof(double), cmp_double);
    double median = times[o->iters / 2], mean = 0.0;
    for (int i = 0; i < o->iters; i++) mean += times[i];
    mean /= o->iters;
    int64_t bytes = (int64_t)(plain ? ddp_optim_state_bytes(plain) : ddp_zero_state_bytes(zero));
    int64_t all[64];
    CHECK_OK(ddp_group_allgather(g, &bytes, all, 1, DDP_I64));
    if (is_plain) *plain_median = median;
    if (rank == 0) {
        char per_rank[256] = "";
        size_t len = 0;
        for (int r = 0; r < world && len < sizeof per_rank - 16; r++)
            len += (size_t)snprintf(per_rank + len, sizeof per_rank - len, "%s%.1f", r ? "/" : "",
                                    (double)all[r] / (1 << 20));
        char ratio[32] = "-";
        if (*plain_median > 0) snprintf(ratio, sizeof ratio, "%.2f", median / *plain_median);
        printf("| %-7s | %5d | %-22s | %9.1f | %9.1f | %8s |\n", mode, world, per_rank, median,
               mean, ratio);
        fflush(stdout);
    }
    free(times);
    ddp_reducer_destroy(reducer);
    ddp_zero_destroy(zero);
    ddp_optim_destroy(plain);
    for (int i = 0; i < NP; i++) {
        free(data[i]);
        free(local[i]);
    }
    return 0;
}

static int rank_main(ddp_group_t *g, void *arg)
{
    const opts_t *o = arg;
    char modes[128];
    snprintf(modes, sizeof modes, "%s", o->modes);
    double plain_median = 0.0;
    for (char *m = strtok(modes, ","); m; m = strtok(NULL, ",")) run_mode(g, o, m, &plain_median);
    return 0;
}

int main(int argc, char **argv)
{
    opts_t o = {2, 4096, 10, 4, DDP_OPTIM_ADAM, "plain,zero1,zero2,zero2r,overlap"};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--world") == 0) o.world = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--hidden") == 0) o.hidden = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--iters") == 0) o.iters = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--work") == 0) o.work = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--optim") == 0)
            o.optim = strcmp(argv[i + 1], "sgd") == 0 ? DDP_OPTIM_SGD : DDP_OPTIM_ADAM;
        else if (strcmp(argv[i], "--modes") == 0)
            snprintf(o.modes, sizeof o.modes, "%s", argv[i + 1]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (o.world < 1 || o.world > 64 || o.hidden < 1 || o.iters < 1 || o.work < 0) {
        fprintf(stderr, "bad options\n");
        return 2;
    }
    printf("# zero-bench: MLP 784-%d-%d-10 f32, %s, world %d, %d iterations (median of the "
           "slowest rank), backward work %d\n",
           o.hidden, o.hidden, o.optim == DDP_OPTIM_ADAM ? "adam" : "sgd+momentum", o.world,
           o.iters, o.work);
    printf("| mode    | world | state MiB per rank     | median ms | mean ms   | vs plain |\n");
    printf("|---------|-------|------------------------|-----------|-----------|----------|\n");
    return ddp_test_run_group(o.world, 1800, NULL, rank_main, &o);
}
