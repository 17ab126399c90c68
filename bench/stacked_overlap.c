/* build/stacked-overlap: how much of a trainer laid out like llm.c's train_gpt2.c overlaps its
 * gradient averaging with backward. One parameter block, one gradient block (malloc'd, or from
 * ddp_group_alloc_buffer), each kind of weight of all L layers stacked in one (L, ...) tensor;
 * a simulated backward from the last layer down that spends --layer-us per layer (busy loop, or
 * sleep with --sleep) on its four matrices and reports each layer's rows of every stacked tensor
 * with ddp_reducer_grad_ready_rows, as the port of llm.c does.
 *
 * Per synchronised iteration after the rebuild it reports, from ddp_reducer_stats: the share of
 * the gradient bytes whose reduction was launched before layer 0's rows were reported (counted
 * in grad_ready calls, not time), the share launched before finalize, backward, exposed
 * communication (finalize's wait) and the time reductions were in flight; medians over the
 * iterations, and the smallest exposed time over the ranks. Run it under the launcher:
 *
 *     build/ddprun -n 2 build/stacked-overlap [--layers 12] [--channels 384] [--vocab 8192]
 *         [--layer-us 2000] [--sleep] [--piece-kib 4096] [--first-kib 1024] [--cap-kib 25600]
 *         [--block malloc|register|group] [--iters 10] [--warmup 3]
 *
 * --block: calloc'd (default), calloc'd and given to ddp_group_register_memory, or from
 * ddp_group_alloc_buffer.
 *
 * bench/stacked_ab.sh runs it against a build of the old launch order, interleaved. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"

#define NP 16
enum { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW,
       FCPROJB, LNFW, LNFB };
static const char *pname[NP] = {"wte",  "wpe",      "ln1w",     "ln1b", "qkvw", "qkvb",
                                "attprojw", "attprojb", "ln2w", "ln2b", "fcw",  "fcb",
                                "fcprojw",  "fcprojb",  "lnfw", "lnfb"};
static const int backward_order[12] = {FCPROJW, FCPROJB, FCW,  FCB,  LN2W, LN2B,
                                       ATTPROJW, ATTPROJB, QKVW, QKVB, LN1W, LN1B};

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void compute(double us, int sleep_instead)
{
    if (us <= 0) return;
    if (sleep_instead) {
        usleep((useconds_t)us);
        return;
    }
    double end = now_us() + us;
    volatile double x = 1.0;
    while (now_us() < end)
        for (int i = 0; i < 200; i++) x = x * 1.0000001 + 1e-9;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#define CHECK(expr)                                                                               \
    do {                                                                                          \
        ddp_status_t s_ = (expr);                                                                 \
        if (s_ != DDP_OK) {                                                                       \
            fprintf(stderr, "%s failed: %s\n", #expr, ddp_last_error());                          \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)

int main(int argc, char **argv)
{
    size_t L = 12, C = 384, V = 8192, T = 256, piece_kib = 4096, first_kib = 1024, cap_kib = 25600;
    double layer_us = 2000;
    int sleep_instead = 0, group_block = 0, register_block = 0, iters = 10, warmup = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--sleep")) sleep_instead = 1;
        else if (v && !strcmp(a, "--layers")) L = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--channels")) C = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--vocab")) V = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--layer-us")) layer_us = atof(argv[++i]);
        else if (v && !strcmp(a, "--piece-kib")) piece_kib = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--first-kib")) first_kib = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--cap-kib")) cap_kib = strtoul(argv[++i], NULL, 10);
        else if (v && !strcmp(a, "--iters")) iters = atoi(argv[++i]);
        else if (v && !strcmp(a, "--warmup")) warmup = atoi(argv[++i]);
        else if (v && !strcmp(a, "--block")) {
            group_block = !strcmp(argv[++i], "group");
            register_block = !strcmp(argv[i], "register");
        }
        else {
            fprintf(stderr, "stacked-overlap: unknown option %s (see the comment at the top of "
                            "bench/stacked_overlap.c)\n", a);
            return 2;
        }
    }
    if (L < 2 || C == 0 || iters < 1 || warmup < 1) return 2;
    size_t numel[NP] = {V * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
                        L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
    size_t rows[NP] = {V, T, L, L, L * 3 * C, L, L * C, L, L, L, L * 4 * C, L, L * C, L, 0, 0};
    size_t off[NP + 1];
    off[0] = 0;
    for (int i = 0; i < NP; i++) off[i + 1] = off[i] + numel[i];
    size_t total = off[NP], bytes = total * sizeof(float);

    ddp_group_t *group = NULL;
    CHECK(ddp_group_create_from_env(NULL, &group));
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    float *params = calloc(total, sizeof(float)), *block = NULL;
    if (group_block) CHECK(ddp_group_alloc_buffer(group, bytes, (void **)&block));
    else block = calloc(total, sizeof(float));
    if (!params || !block) return 1;
    if (register_block) CHECK(ddp_group_register_memory(group, block, bytes));
    ddp_param_t p[NP];
    for (int i = 0; i < NP; i++)
        p[i] = (ddp_param_t){pname[i], params + off[i], numel[i], DDP_F32, rows[i], 0,
                             block + off[i]};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.grad_memory = DDP_GRAD_MEMORY_USER_BLOCK;
    c.grad_block = block;
    c.grad_block_bytes = bytes;
    c.piece_bytes = piece_kib << 10;
    c.first_bucket_bytes = first_kib << 10;
    c.bucket_cap_bytes = cap_kib << 10;
    ddp_reducer_t *r = NULL;
    CHECK(ddp_reducer_create(group, p, NP, NULL, 0, &c, &r));
    const size_t before_layer0 = 2 + 12 * (L - 1);
    /* A layer's compute is spent on its four matrices in proportion to their sizes. */
    const size_t layer_matrix = 3 * C * C + C * C + 4 * C * C + 4 * C * C;

    int n = iters;
    double *early = calloc((size_t)n, sizeof(double));
    double *in_backward = calloc((size_t)n, sizeof(double));
    double *backward = calloc((size_t)n, sizeof(double));
    double *exposed = calloc((size_t)n, sizeof(double));
    double *exposed_min = calloc((size_t)n, sizeof(double));
    double *busy = calloc((size_t)n, sizeof(double));
    if (!early || !in_backward || !backward || !exposed || !exposed_min || !busy) return 1;
    size_t wrong = 0, nbuckets = 0, npieces = 0;
    for (int it = 0; it < warmup + iters; it++) {
        float v = 0.001f * (float)(rank + 1) + 0.0001f * (float)it;
        CHECK(ddp_reducer_prepare(r));
        for (int i = LNFB; i >= LNFW; i--) {
            for (size_t e = 0; e < numel[i]; e++) block[off[i] + e] = v;
            CHECK(ddp_reducer_grad_ready(r, (size_t)i));
        }
        for (size_t l = L; l-- > 0;) {
            for (int j = 0; j < 12; j++) {
                int i = backward_order[j];
                size_t per = numel[i] / L, lo = off[i] + per * l;
                if (numel[i] / L >= C * C)
                    compute(layer_us * (double)per / (double)layer_matrix, sleep_instead);
                for (size_t e = 0; e < per; e++) block[lo + e] = v;
                size_t rpl = rows[i] / L;
                CHECK(ddp_reducer_grad_ready_rows(r, (size_t)i, rpl * l, rpl * (l + 1)));
            }
        }
        for (int i = WPE; i >= WTE; i--) {
            for (size_t e = 0; e < numel[i]; e++) block[off[i] + e] = v;
            CHECK(ddp_reducer_grad_ready(r, (size_t)i));
        }
        CHECK(ddp_reducer_finalize(r));
        double want = 0;
        for (int q = 0; q < world; q++) want += 0.001f * (float)(q + 1) + 0.0001f * (float)it;
        want /= world;
        for (int i = 0; i < NP; i++)
            if (fabs(block[off[i] + numel[i] / 2] - want) > 1e-6) wrong++;
        ddp_reducer_stats_t st;
        CHECK(ddp_reducer_stats(r, &st));
        double ex = st.exposed_us;
        CHECK(ddp_group_allreduce(group, &ex, &ex, 1, DDP_F64, DDP_MIN));
        if (it < warmup) continue;
        size_t e0 = 0;
        for (size_t k = 0; k < st.npieces; k++)
            if (st.reductions[k].ready_calls <= before_layer0) e0 += st.reductions[k].bytes;
        int k = it - warmup;
        early[k] = 100.0 * (double)e0 / (double)st.bytes;
        in_backward[k] = 100.0 * (double)st.bytes_launched_in_backward / (double)st.bytes;
        backward[k] = st.backward_us / 1e3;
        exposed[k] = st.exposed_us / 1e3;
        exposed_min[k] = ex / 1e3;
        busy[k] = st.busy_us / 1e3;
        nbuckets = st.nbuckets;
        npieces = st.npieces;
        CHECK(ddp_reducer_zero_grad(r));
    }
    if (rank == 0) {
        printf("# stacked-overlap: %d ranks, L %zu C %zu V %zu, %.1f MiB of f32 gradients, "
               "%s block, pieces %zu KiB, first bucket %zu KiB, cap %zu KiB, %.0f us/layer %s\n",
               world, L, C, V, (double)bytes / (1 << 20),
               group_block ? "group" : register_block ? "registered malloc" : "malloc",
               piece_kib, first_kib, cap_kib, layer_us, sleep_instead ? "sleep" : "busy");
        printf("buckets %zu reductions %zu launched_before_layer0 %.1f%% launched_before_finalize "
               "%.1f%% backward %.2f ms exposed %.2f ms exposed_min %.2f ms comm_busy %.2f ms "
               "wrong %zu\n",
               nbuckets, npieces, median(early, n), median(in_backward, n), median(backward, n),
               median(exposed, n), median(exposed_min, n), median(busy, n), wrong);
    }
    ddp_reducer_destroy(r);
    if (register_block) CHECK(ddp_group_unregister_memory(group, block));
    if (group_block) ddp_group_free_buffer(group, block);
    else free(block);
    free(params);
    free(early);
    free(in_backward);
    free(backward);
    free(exposed);
    free(exposed_min);
    free(busy);
    ddp_group_destroy(group);
    return wrong ? 1 : 0;
}
