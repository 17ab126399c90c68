/* `ddp-bench -o reducer`: how much of the Reducer's communication hides behind backward.
 *
 * A model is a list of layers with real parameter shapes (an MLP 784-4096-4096-10, or a
 * ResNet-50-like list of conv/bn/fc shapes, ~25.6 M parameters). Backward is simulated: layers
 * from last to first each "compute" for a configurable time (a busy loop, or a sleep that leaves
 * the core free as a GPU would), write their gradients and call grad_ready per parameter, so the
 * Reducer launches bucket allreduces while later layers are still computing. Per iteration we
 * report backward time, communication time (the union of the reductions' launch..done intervals,
 * i.e. time the wire was busy; a reduction is a bucket or, with pieces, a piece of one),
 * exposed communication (the wait in finalize) and
 * overlap = 1 - exposed / communication. The anchor is the same model reduced with no compute
 * at all (every bucket exposed), measured first in the same run. With --row-blocks K a matrix
 * parameter's layer computes in K row blocks and reports each with grad_ready_rows, so the
 * Reducer's pieces (--piece-mb) of a large matrix start reducing during its own layer. With
 * --grads the gradient memory is chosen (config.grad_memory, or user_grads), several modes
 * interleaved run by run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#ifdef DDP_BENCH_HAVE_POWERSGD
#include "ddp/powersgd.h"
#endif

typedef struct layer {
    char name[48];
    size_t numel[3]; /* weight, then bn weight / bias or bias (0: absent) */
} layer_t;

typedef struct model {
    layer_t *layers;
    size_t nlayers, cap;
    size_t total;
} model_t;

static void add_layer(model_t *m, const char *name, size_t a, size_t b, size_t c)
{
    if (m->nlayers == m->cap) {
        m->cap = m->cap ? 2 * m->cap : 64;
        m->layers = realloc(m->layers, m->cap * sizeof *m->layers);
    }
    layer_t *l = &m->layers[m->nlayers++];
    snprintf(l->name, sizeof l->name, "%s", name);
    l->numel[0] = a;
    l->numel[1] = b;
    l->numel[2] = c;
    m->total += a + b + c;
}

static void preset_mlp(model_t *m)
{
    const size_t dims[4] = {784, 4096, 4096, 10};
    for (int l = 0; l < 3; l++) {
        char name[32];
        snprintf(name, sizeof name, "fc%d", l);
        add_layer(m, name, dims[l] * dims[l + 1], dims[l + 1], 0);
    }
}

/* ResNet-50: conv1, four stages of bottleneck blocks (3, 4, 6, 3) of widths 64..512 with
 * expansion 4 and a projection in each stage's first block, then fc 2048 -> 1000. A conv and
 * its batch norm form one layer (convs have no bias; bn has weight and bias). */
static void preset_resnet50(model_t *m)
{
    add_layer(m, "conv1", 64 * 3 * 7 * 7, 64, 64);
    const int blocks[4] = {3, 4, 6, 3};
    size_t in = 64;
    for (int s = 0; s < 4; s++) {
        size_t w = (size_t)64 << s;
        for (int b = 0; b < blocks[s]; b++) {
            char name[48];
            snprintf(name, sizeof name, "layer%d.%d.conv1", s + 1, b);
            add_layer(m, name, w * in, w, w);
            snprintf(name, sizeof name, "layer%d.%d.conv2", s + 1, b);
            add_layer(m, name, w * w * 9, w, w);
            snprintf(name, sizeof name, "layer%d.%d.conv3", s + 1, b);
            add_layer(m, name, 4 * w * w, 4 * w, 4 * w);
            if (b == 0) {
                snprintf(name, sizeof name, "layer%d.%d.downsample", s + 1, b);
                add_layer(m, name, 4 * w * in, 4 * w, 4 * w);
            }
            in = 4 * w;
        }
    }
    add_layer(m, "fc", 2048 * 1000, 1000, 0);
}

/* "Computes" for us microseconds. *overshoot is how much the previous sleep overslept; it is
 * taken off this one so that overshoots do not add up (with K row blocks there are K times as
 * many sleeps, which would otherwise lengthen backward). Time spent in the Reducer between
 * computes is not absorbed: it lengthens backward as it would in a real one. */
static void compute_for(double us, int sleep_mode, double *overshoot)
{
    if (us <= 0) return;
    double now = ddp_time_us();
    us -= *overshoot;
    *overshoot = 0;
    if (us <= 0) {
        *overshoot = -us;
        return;
    }
    double end = now + us;
    if (sleep_mode) {
        double left = end - now;
        if (left > 0) {
            struct timespec ts = {(time_t)(left / 1e6), (long)(fmod(left, 1e6) * 1000.0)};
            nanosleep(&ts, NULL);
        }
        *overshoot = ddp_time_us() - end;
        return;
    }
    volatile double x = 1.0;
    while (ddp_time_us() < end)
        for (int i = 0; i < 64; i++) x = x * 1.0000001 + 1e-9;
}

typedef struct sample {
    double backward, comm, exposed, overlap, comm_sum, exposed_min;
} sample_t;

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median_of(const sample_t *s, size_t n, size_t field)
{
    double *v = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) v[i] = ((const double *)&s[i])[field];
    qsort(v, n, sizeof(double), compare_double);
    double m = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    free(v);
    return m;
}

typedef struct bench {
    ddp_group_t *group;
    ddp_reducer_t *reducer;
    model_t *model;
    size_t nparams;
    int rank;
    int row_blocks;
    int rows_descending; /* --rows-descending: row blocks reported from the last rows down */
    size_t npieces; /* reductions per iteration, from the last one's stats */
    ddp_trace_t *trace; /* --trace: compute and grad_ready spans on lane 0 (the Reducer adds its) */
} bench_t;

static int one_iteration(bench_t *b, double compute_us, int sleep_mode, sample_t *out)
{
    ddp_status_t s = ddp_reducer_prepare(b->reducer);
    size_t p = b->nparams;
    double overshoot = 0; /* the sleeps' overshoot carried over */
    for (size_t l = b->model->nlayers; s == DDP_OK && l-- > 0;) {
        const layer_t *ly = &b->model->layers[l];
        int np = (ly->numel[0] > 0) + (ly->numel[1] > 0) + (ly->numel[2] > 0);
        /* K = 1: the layer computes, then reports its parameters (last first: bias or batch
         * norm, then the weight). K > 1: the weight (a matrix of numel[1] rows) is computed in
         * K row blocks, each reported as it finishes; the layer's other parameters are
         * reported with the first block (they come straight from the output gradient). */
        size_t rows = ly->numel[1] ? ly->numel[1] : 0;
        size_t blocks = rows && ly->numel[0] ? (size_t)b->row_blocks : 1;
        if (blocks > rows && rows) blocks = rows;
        size_t width = rows ? ly->numel[0] / rows : 0;
        for (size_t j = 0; s == DDP_OK && j < blocks; j++) {
            double t0 = ddp_time_us();
            compute_for(compute_us / (double)blocks, sleep_mode, &overshoot);
            double t1 = ddp_time_us();
            if (b->trace) ddp_trace_span(b->trace, ly->name, "compute", 0, t0, t1);
            for (int k = np; s == DDP_OK && k-- > 0;) {
                if (k > 0 && j > 0) continue; /* vectors go with the first block */
                size_t index = p - (size_t)np + (size_t)k;
                float *g = NULL;
                s = ddp_reducer_grad(b->reducer, index, (void **)&g);
                if (s != DDP_OK) break;
                /* The gradient "computed" (touching its memory like a real backward). */
                size_t e0 = 0, e1 = ly->numel[k];
                size_t jb = b->rows_descending ? blocks - 1 - j : j; /* which rows */
                if (k == 0 && blocks > 1) {
                    e0 = rows * jb / blocks * width;
                    e1 = rows * (jb + 1) / blocks * width;
                }
                for (size_t e = e0; e < e1; e += 16) g[e] = (float)(e % 7) * 0.5f;
                if (k == 0 && blocks > 1)
                    s = ddp_reducer_grad_ready_rows(b->reducer, index, rows * jb / blocks,
                                                    rows * (jb + 1) / blocks);
                else
                    s = ddp_reducer_grad_ready(b->reducer, index);
            }
            if (b->trace) ddp_trace_span(b->trace, "grad_ready", "reducer", 1, t1, ddp_time_us());
        }
        p -= (size_t)np;
    }
    double f0 = ddp_time_us();
    if (s == DDP_OK) s = ddp_reducer_finalize(b->reducer);
    if (b->trace) ddp_trace_span(b->trace, "finalize", "reducer", 1, f0, ddp_time_us());
    if (s != DDP_OK) {
        fprintf(stderr, "ddp-bench: rank %d: reducer iteration: %s: %s\n", b->rank,
                ddp_status_string(s), ddp_last_error());
        return 1;
    }
    ddp_reducer_stats_t st;
    if (ddp_reducer_stats(b->reducer, &st) != DDP_OK) return 1;
    out->backward = st.backward_us;
    out->comm = st.busy_us;
    b->npieces = st.npieces;
    out->comm_sum = st.comm_us;
    out->exposed = st.exposed_us;
    out->overlap = out->comm > 0 ? 100.0 * (1.0 - st.exposed_us / out->comm) : 0;
    /* The smallest finalize wait over the ranks: a rank that ends backward early also waits for
     * the others' backward, which is skew, not communication (outside the timed region). */
    double mine = st.exposed_us, least = mine;
    if (ddp_group_allreduce(b->group, &mine, &least, 1, DDP_F64, DDP_MIN) != DDP_OK) return 1;
    out->exposed_min = least;
    return 0;
}

void ddp_bench_reducer_usage(FILE *out)
{
    fprintf(out,
            "usage: ddprun -n N ddp-bench -o reducer [--preset mlp|resnet50]\n"
            "         [--compute-us US per layer | --compute-ratio R] [--sleep] [-n iters]\n"
            "         [-w warmup] [--bucket-mb MB] [--first-bucket-mb MB] [--json]\n"
            "         [--hook allreduce|fp16|bf16|powersgd:R] [--row-blocks K]\n"
            "         [--piece-mb MB] [--layout last-first|c10d|both] [--no-rebuild]\n"
            "         [--repeat R] [--grads LIST] [--rows-descending] [--trace FILE]\n"
            "  --hook: the comm hook; powersgd:R is PowerSGD of rank R from the first step\n"
            "  --compute-ratio R: backward computes R times the communication time measured\n"
            "                     with no compute (spread evenly over the layers; default 1.5)\n"
            "  --sleep: layers sleep instead of spinning (the core stays free, as with a GPU)\n"
            "  --row-blocks K: each weight's layer computes in K row blocks, each reported\n"
            "                  with grad_ready_rows (default 1: whole tensors)\n"
            "  --rows-descending: row blocks are reported from the last rows down (as a\n"
            "                  transformer's backward finishes the top layer's rows first)\n"
            "  --piece-mb MB: the reducer's piece size (0: whole buckets; default 4 with\n"
            "                 --row-blocks > 1, else 0 as the library)\n"
            "  --layout L: the initial bucket layout (config.bucket_layout): last-first (the\n"
            "              small first bucket holds the last layers), c10d (it holds the first\n"
            "              layers and is reduced last), or both, interleaved run by run\n"
            "              (default: the library's default)\n"
            "  --no-rebuild: keep the initial layout (config.rebuild_buckets = 0)\n"
            "  --repeat R: R runs per layout and gradient mode, each with a fresh reducer,\n"
            "              interleaved with the others (A B, B A, ...); the compute time is\n"
            "              fixed by the first run\n"
            "  --grads LIST: comma-separated gradient memory modes, interleaved run by run:\n"
            "              buckets (bucket views, moved by the rebuild; the default), block\n"
            "              (DDP_GRAD_MEMORY_BLOCK, libddp's block), user-block (the caller's\n"
            "              block from ddp_group_alloc_buffer, laid out in forward order),\n"
            "              user-malloc (the same from malloc), copy (user_grads)\n"
            "  --trace FILE: Chrome trace of every iteration (FILE.rankR.json per rank)\n"
            "  -h, --help: this text\n");
}

static int usage(int rank, const char *msg, const char *arg)
{
    if (rank == 0) {
        fprintf(stderr, "ddp-bench -o reducer: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
        ddp_bench_reducer_usage(stderr);
    }
    return DDP_BENCH_EXIT_USAGE;
}

typedef struct reducer_options {
    const char *preset;
    double compute_us, ratio, bucket_mb, first_mb, piece_mb;
    int iters, warmup, sleep_mode, json, row_blocks, rebuild, repeat, rows_descending;
    const char *trace_path;
    const char *hook;
    int layouts[2]; /* DDP_BUCKET_LAYOUT_*, run in turn */
    int nlayouts;
    int grads[8]; /* GRADS_*, run in turn */
    int ngrads;
} reducer_options_t;

enum { GRADS_BUCKETS, GRADS_BLOCK, GRADS_USER_BLOCK, GRADS_USER_MALLOC, GRADS_COPY };
static const char *const grads_names[] = {"buckets", "block", "user-block", "user-malloc", "copy"};

/* Parses --grads: a comma-separated list of grads_names. Returns 0, or -1 on a bad name. */
static int parse_grads(const char *v, reducer_options_t *o)
{
    o->ngrads = 0;
    while (*v) {
        size_t len = strcspn(v, ",");
        int found = -1;
        for (int g = 0; g < 5; g++)
            if (strlen(grads_names[g]) == len && !strncmp(v, grads_names[g], len)) found = g;
        if (found < 0 || o->ngrads == 8) return -1;
        o->grads[o->ngrads++] = found;
        v += len;
        if (*v == ',') v++;
    }
    return o->ngrads > 0 ? 0 : -1;
}

static const char *layout_name(int layout)
{
    return layout == DDP_BUCKET_LAYOUT_C10D         ? "c10d"
           : layout == DDP_BUCKET_LAYOUT_LAST_FIRST ? "last-first"
                                                    : "default";
}

/* Parses the options after `-o reducer`. Returns -1 when they are good, else an exit code (0 for
 * --help). */
static int parse_reducer_options(int rank, int argc, char **argv, reducer_options_t *o)
{
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (rank == 0) ddp_bench_reducer_usage(stdout);
            return DDP_BENCH_EXIT_OK;
        }
        if (!strcmp(a, "--sleep")) {
            o->sleep_mode = 1;
            continue;
        }
        if (!strcmp(a, "--json")) {
            o->json = 1;
            continue;
        }
        if (!strcmp(a, "--rows-descending")) {
            o->rows_descending = 1;
            continue;
        }
        if (!strcmp(a, "--no-rebuild")) {
            o->rebuild = 0;
            continue;
        }
        if (!v) return usage(rank, "option needs a value", a);
        i++;
        if (!strcmp(a, "--preset")) {
            if (strcmp(v, "mlp") && strcmp(v, "resnet50")) return usage(rank, "unknown preset", v);
            o->preset = v;
        } else if (!strcmp(a, "--compute-us")) {
            o->compute_us = strtod(v, &end);
            if (*end || o->compute_us < 0) return usage(rank, "bad --compute-us", v);
        } else if (!strcmp(a, "--compute-ratio")) {
            o->ratio = strtod(v, &end);
            if (*end || o->ratio < 0) return usage(rank, "bad --compute-ratio", v);
        } else if (!strcmp(a, "-n")) {
            o->iters = (int)strtol(v, &end, 10);
            if (*end || o->iters < 1 || o->iters > 100000) return usage(rank, "bad -n", v);
        } else if (!strcmp(a, "-w")) {
            o->warmup = (int)strtol(v, &end, 10);
            if (*end || o->warmup < 0 || o->warmup > 1000) return usage(rank, "bad -w", v);
        } else if (!strcmp(a, "--bucket-mb")) {
            o->bucket_mb = strtod(v, &end);
            if (*end || o->bucket_mb <= 0) return usage(rank, "bad --bucket-mb", v);
        } else if (!strcmp(a, "--hook")) {
            if (strcmp(v, "allreduce") && strcmp(v, "fp16") && strcmp(v, "bf16") &&
                strncmp(v, "powersgd:", 9))
                return usage(rank, "unknown hook", v);
            o->hook = v;
        } else if (!strcmp(a, "--trace")) {
            o->trace_path = v;
        } else if (!strcmp(a, "--row-blocks")) {
            o->row_blocks = (int)strtol(v, &end, 10);
            if (*end || o->row_blocks < 1 || o->row_blocks > 4096)
                return usage(rank, "bad --row-blocks", v);
        } else if (!strcmp(a, "--piece-mb")) {
            o->piece_mb = strtod(v, &end);
            if (*end || o->piece_mb < 0) return usage(rank, "bad --piece-mb", v);
        } else if (!strcmp(a, "--first-bucket-mb")) {
            o->first_mb = strtod(v, &end);
            if (*end || o->first_mb <= 0) return usage(rank, "bad --first-bucket-mb", v);
        } else if (!strcmp(a, "--layout")) {
            if (!strcmp(v, "last-first")) {
                o->layouts[0] = DDP_BUCKET_LAYOUT_LAST_FIRST;
                o->nlayouts = 1;
            } else if (!strcmp(v, "c10d")) {
                o->layouts[0] = DDP_BUCKET_LAYOUT_C10D;
                o->nlayouts = 1;
            } else if (!strcmp(v, "both")) {
                o->layouts[0] = DDP_BUCKET_LAYOUT_LAST_FIRST;
                o->layouts[1] = DDP_BUCKET_LAYOUT_C10D;
                o->nlayouts = 2;
            } else {
                return usage(rank, "unknown --layout (last-first, c10d or both)", v);
            }
        } else if (!strcmp(a, "--grads")) {
            if (parse_grads(v, o))
                return usage(rank, "bad --grads (buckets, block, user-block, user-malloc, copy)",
                             v);
        } else if (!strcmp(a, "--repeat")) {
            o->repeat = (int)strtol(v, &end, 10);
            if (*end || o->repeat < 1 || o->repeat > 1000) return usage(rank, "bad --repeat", v);
        } else {
            return usage(rank, "unknown option", a);
        }
    }
    if (o->compute_us >= 0 && o->ratio >= 0)
        return usage(rank, "give --compute-us or --compute-ratio, not both", NULL);
    if (o->compute_us < 0 && o->ratio < 0) o->ratio = 1.5;
    return -1;
}

/* The gradient memory of one run and the hook's state, made by run_memory and run_hook and
 * freed by free_run. */
typedef struct run_state {
    ddp_param_t *params;
    unsigned char *block; /* the caller's block (user-block: a transport buffer) */
    float **copies;       /* user_grads: one buffer per parameter */
    int grads;
    ddp_half_hook_state_t *half;
    void *psgd;
} run_state_t;

/* Gradient memory of this run: the caller's block in forward (registration) order, as llm.c's
 * grads_memory, or one buffer per parameter for user_grads; sets config's memory fields. */
static int run_memory(ddp_group_t *group, const ddp_param_t *model_params, size_t nparams,
                      int grads, run_state_t *st, ddp_reducer_config_t *config)
{
    int rank = ddp_group_rank(group);
    ddp_param_t *params = calloc(nparams, sizeof *params);
    memcpy(params, model_params, nparams * sizeof *params);
    st->params = params;
    st->grads = grads;
    size_t block_bytes = 0;
    for (size_t i = 0; i < nparams; i++) block_bytes += params[i].numel * sizeof(float);
    if (grads == GRADS_USER_BLOCK) {
        if (ddp_group_alloc_buffer(group, block_bytes, (void **)&st->block) != DDP_OK) {
            fprintf(stderr, "ddp-bench: rank %d: ddp_group_alloc_buffer: %s\n", rank,
                    ddp_last_error());
            return DDP_BENCH_EXIT_FAILED;
        }
    } else if (grads == GRADS_USER_MALLOC) {
        st->block = calloc(1, block_bytes);
    } else if (grads == GRADS_COPY) {
        st->copies = calloc(nparams, sizeof *st->copies);
        for (size_t i = 0; i < nparams; i++) {
            st->copies[i] = calloc(params[i].numel, sizeof(float));
            params[i].grad = st->copies[i];
        }
        config->user_grads = 1;
    }
    if (st->block) {
        size_t off = 0;
        for (size_t i = 0; i < nparams; i++) {
            params[i].grad = st->block + off;
            off += params[i].numel * sizeof(float);
        }
        config->grad_memory = DDP_GRAD_MEMORY_USER_BLOCK;
        config->grad_block = st->block;
        config->grad_block_bytes = block_bytes;
    }
    if (grads == GRADS_BLOCK) config->grad_memory = DDP_GRAD_MEMORY_BLOCK;
    return DDP_BENCH_EXIT_OK;
}

/* The comm hook of --hook (fp16, bf16, powersgd:RANK) with its state, into config. */
static void run_hook(const char *hook, run_state_t *st, ddp_reducer_config_t *config)
{
    if (!strcmp(hook, "fp16") || !strcmp(hook, "bf16")) {
        ddp_half_hook_state_create(!strcmp(hook, "fp16") ? DDP_F16 : DDP_BF16, &st->half);
        config->comm_hook = !strcmp(hook, "fp16") ? ddp_hook_fp16 : ddp_hook_bf16;
        config->comm_hook_state = st->half;
    }
#ifdef DDP_BENCH_HAVE_POWERSGD
    if (!strncmp(hook, "powersgd:", 9)) {
        ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
        pc.matrix_approximation_rank = atoi(hook + 9) > 0 ? atoi(hook + 9) : 1;
        pc.start_powersgd_iter = 0;
        ddp_powersgd_state_t *ps = NULL;
        ddp_powersgd_state_create(&pc, &ps);
        st->psgd = ps;
        config->comm_hook = ddp_powersgd_hook;
        config->comm_hook_state = ps;
    }
#endif
}

static void free_run(ddp_group_t *group, run_state_t *st, size_t nparams)
{
    if (st->grads == GRADS_USER_BLOCK) ddp_group_free_buffer(group, st->block);
    else free(st->block);
    for (size_t i = 0; st->copies && i < nparams; i++) free(st->copies[i]);
    free(st->copies);
    free(st->params);
    ddp_half_hook_state_destroy(st->half);
#ifdef DDP_BENCH_HAVE_POWERSGD
    ddp_powersgd_state_destroy(st->psgd);
#endif
}

/* Rank 0's text report before the iterations: the model, the buckets, the pieces, the anchor and
 * (one run alone) the table's heading. */
static void print_run_header(const bench_t *b, const reducer_options_t *o,
                             const ddp_reducer_config_t *config, const ddp_param_t *params,
                             int layout, int grads, int run, int nruns, double piece_mb,
                             double compute_us, double comm_alone)
{
    const model_t *model = b->model;
    double compute_total = compute_us * (double)model->nlayers;
    if (nruns > 1)
        printf("# run %d of %d: layout %s, grads %s\n", run + 1, nruns, layout_name(layout),
               grads_names[grads]);
    printf("# reducer benchmark: preset %s, %zu layers, %zu parameters (%.1f MiB f32), "
           "%d ranks, transport %s\n",
           o->preset, model->nlayers, model->total, (double)model->total * 4 / 1048576.0,
           ddp_group_size(b->group), ddp_group_transport(b->group));
    printf("# buckets: %zu (first %.2g MiB, cap %.3g MiB, layout %s, rebuild %s); compute "
           "%.1f us per layer (%.2f ms per step, %s)\n",
           ddp_reducer_bucket_count(b->reducer), o->first_mb, o->bucket_mb, layout_name(layout),
           o->rebuild ? "on" : "off", compute_us, compute_total / 1000.0,
           o->sleep_mode ? "sleep" : "busy loop");
    printf("# bucket sizes in reduction order (MiB):");
    for (size_t k = 0; k < ddp_reducer_bucket_count(b->reducer); k++) {
        const size_t *ps;
        size_t np, bytes = 0;
        if (ddp_reducer_bucket_params(b->reducer, k, &ps, &np) != DDP_OK) break;
        for (size_t j = 0; j < np; j++) bytes += params[ps[j]].numel * sizeof(float);
        printf(" %.2f", (double)bytes / 1048576.0);
    }
    printf("\n# row blocks %d per weight%s; pieces of %.3g MiB%s (%zu reductions per "
           "step)\n",
           o->row_blocks, o->rows_descending ? " (last rows first)" : "", piece_mb,
           config->comm_hook ? " unused: a hook gets whole buckets" : "", b->npieces);
    printf("# anchor: communication with no compute %.2f ms (all exposed); the last bucket "
           "can only start when backward ends\n",
           comm_alone / 1000.0);
    if (nruns == 1)
        printf("%6s %12s %12s %12s %12s %10s\n", "iter", "backward_ms", "comm_ms",
               "exposed_ms", "comm_sum_ms", "overlap_%");
}

/* Rank 0's summary of the timed iterations: medians, as one JSON line or as text. */
static void print_run_summary(const bench_t *b, const reducer_options_t *o,
                              const sample_t *samples, int layout, int grads, int run,
                              double piece_mb, double compute_us, double comm_alone)
{
    const model_t *model = b->model;
    double compute_total = compute_us * (double)model->nlayers;
    size_t n = (size_t)o->iters;
    double bw = median_of(samples, n, 0), cm = median_of(samples, n, 1);
    double ex = median_of(samples, n, 2);
    double ex_min = median_of(samples, n, 5);
    double ratio_exposed = cm > 0 ? ex / cm : 0;
    if (o->json) {
        printf("{\"preset\":\"%s\",\"ranks\":%d,\"params\":%zu,\"buckets\":%zu,"
               "\"layout\":\"%s\",\"rebuild\":%d,\"run\":%d,\"grads\":\"%s\","
               "\"compute_us_per_layer\":%.1f,\"sleep\":%d,\"row_blocks\":%d,"
               "\"piece_mb\":%g,\"reductions\":%zu,\"comm_alone_ms\":%.3f,"
               "\"backward_ms\":%.3f,\"comm_ms\":%.3f,\"exposed_ms\":%.3f,"
               "\"exposed_min_ms\":%.3f,\"exposed_over_comm\":%.4f}\n",
               o->preset, ddp_group_size(b->group), model->total,
               ddp_reducer_bucket_count(b->reducer), layout_name(layout), o->rebuild, run,
               grads_names[grads], compute_us, o->sleep_mode, o->row_blocks, piece_mb,
               b->npieces, comm_alone / 1000.0, bw / 1000.0, cm / 1000.0, ex / 1000.0,
               ex_min / 1000.0, ratio_exposed);
        return;
    }
    printf("# median: backward %.3f ms, comm %.3f ms, exposed %.3f ms, overlap %.1f%%; "
           "exposed/comm %.1f%% (target <= 15%% when compute >= comm: compute %.2f ms "
           "%s comm %.2f ms)\n",
           bw / 1000.0, cm / 1000.0, ex / 1000.0, 100.0 * (1 - ratio_exposed),
           100.0 * ratio_exposed, compute_total / 1000.0, compute_total >= cm ? ">=" : "<",
           cm / 1000.0);
    printf("# smallest finalize wait over the ranks (skew removed): median %.3f ms, "
           "%.1f%% of comm\n",
           ex_min / 1000.0, cm > 0 ? 100.0 * ex_min / cm : 0.0);
}

/* Rank 0's line on the hook's traffic per step (the half hooks and PowerSGD). */
static void print_hook_stats(const reducer_options_t *o, const run_state_t *st)
{
    ddp_hook_stats_t hs = {0, 0, 0, 0};
    double steps = (double)(o->warmup + 4 + o->warmup + o->iters);
    if (st->half) ddp_half_hook_stats(st->half, &hs);
    printf("# hook %s: ", o->hook);
#ifdef DDP_BENCH_HAVE_POWERSGD
    if (st->psgd) {
        ddp_powersgd_stats_t ps;
        ddp_powersgd_stats(st->psgd, &ps);
        hs = ps.wire;
        printf("PowerSGD compression rate %.2f; ", ps.compression_rate);
    }
#endif
    printf("wire %.3f MiB per step, %.3f MiB uncompressed (x%.2f)\n",
           (double)hs.bytes_after / 1048576.0 / steps,
           (double)hs.bytes_before / 1048576.0 / steps,
           hs.bytes_after ? (double)hs.bytes_before / (double)hs.bytes_after : 0);
}

/* One run: a fresh reducer with `layout`, its anchor (communication with no compute), warm-up
 * and timed iterations, and rank 0's report. *compute_us < 0 is set from this run's anchor (every
 * rank takes rank 0's), so that later runs compute exactly as long. */
static int run_once(ddp_group_t *group, const reducer_options_t *o, model_t *model,
                    const ddp_param_t *model_params, size_t nparams, ddp_trace_t *trace,
                    int layout, int grads, int run, int nruns, double *compute_us)
{
    int rank = ddp_group_rank(group);
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    run_state_t st = {0};
    int rc = run_memory(group, model_params, nparams, grads, &st, &config);
    if (rc != DDP_BENCH_EXIT_OK) {
        free(st.params);
        return rc;
    }
    config.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
    config.first_bucket_bytes = (size_t)(o->first_mb * 1048576.0);
    double piece_mb = o->piece_mb;
    if (piece_mb < 0) piece_mb = o->row_blocks > 1 ? 4 : (double)config.piece_bytes / 1048576.0;
    config.piece_bytes = (size_t)(piece_mb * 1048576.0);
    config.rebuild_buckets = o->rebuild;
    config.bucket_layout = layout;
    config.trace = trace;
    run_hook(o->hook, &st, &config);
    bench_t b = {group, NULL, model, nparams, rank, o->row_blocks, o->rows_descending, 0, trace};
    sample_t *samples = NULL;
    ddp_status_t s;
    if (!strncmp(o->hook, "powersgd:", 9) && !st.psgd) {
        rc = usage(rank, "not built with PowerSGD", o->hook);
        goto done;
    }
    s = ddp_reducer_create(group, st.params, nparams, NULL, 0, &config, &b.reducer);
    if (s != DDP_OK) {
        fprintf(stderr, "ddp-bench: rank %d: ddp_reducer_create: %s: %s\n", rank,
                ddp_status_string(s), ddp_last_error());
        rc = DDP_BENCH_EXIT_FAILED;
        goto done;
    }

    /* Anchor: communication alone (no compute), after a warm-up that also triggers the rebuild
     * (unless --no-rebuild). */
    samples = calloc((size_t)o->iters + 3, sizeof *samples);
    for (int i = 0; i < o->warmup + 1 && rc == 0; i++) rc = one_iteration(&b, 0, 0, &samples[0]);
    sample_t alone[3];
    for (int i = 0; i < 3 && rc == 0; i++) rc = one_iteration(&b, 0, 0, &alone[i]);
    double comm_alone = rc == 0 ? median_of(alone, 3, 1) : 0;
    /* Every rank must use the same compute time: take rank 0's. */
    double agreed[1] = {comm_alone};
    if (rc == 0 && ddp_group_broadcast(group, agreed, 1, DDP_F64, 0) != DDP_OK) rc = 1;
    comm_alone = agreed[0];
    if (*compute_us < 0) *compute_us = o->ratio * comm_alone / (double)model->nlayers;
    int table = nruns == 1; /* several runs: their summaries only */

    if (rc == 0 && rank == 0 && !o->json)
        print_run_header(&b, o, &config, st.params, layout, grads, run, nruns, piece_mb,
                         *compute_us, comm_alone);
    for (int i = 0; i < o->warmup && rc == 0; i++)
        rc = one_iteration(&b, *compute_us, o->sleep_mode, &samples[0]);
    for (int i = 0; i < o->iters && rc == 0; i++) {
        rc = one_iteration(&b, *compute_us, o->sleep_mode, &samples[i]);
        if (rc == 0 && rank == 0 && !o->json && table)
            printf("%6d %12.3f %12.3f %12.3f %12.3f %10.1f\n", i, samples[i].backward / 1000.0,
                   samples[i].comm / 1000.0, samples[i].exposed / 1000.0,
                   samples[i].comm_sum / 1000.0, samples[i].overlap);
    }
    if (rc == 0 && rank == 0)
        print_run_summary(&b, o, samples, layout, grads, run, piece_mb, *compute_us, comm_alone);
    if (rc == 0 && rank == 0 && !o->json && (st.half || st.psgd)) print_hook_stats(o, &st);
done:
    free(samples);
    ddp_reducer_destroy(b.reducer);
    free_run(group, &st, nparams);
    return rc;
}

int ddp_bench_reducer(ddp_group_t *group, int argc, char **argv)
{
    int rank = ddp_group_rank(group);
    reducer_options_t o = {.preset = "mlp",
                           .compute_us = -1,
                           .ratio = -1,
                           .bucket_mb = 25,
                           .first_mb = 1,
                           .piece_mb = -1,
                           .iters = 10,
                           .warmup = 2,
                           .row_blocks = 1,
                           .rebuild = 1,
                           .repeat = 1,
                           .hook = "allreduce",
                           .layouts = {DDP_BUCKET_LAYOUT_DEFAULT, DDP_BUCKET_LAYOUT_DEFAULT},
                           .nlayouts = 1,
                           .grads = {GRADS_BUCKETS},
                           .ngrads = 1};
    int parsed = parse_reducer_options(rank, argc, argv, &o);
    if (parsed >= 0) return parsed;

    model_t model = {0};
    if (!strcmp(o.preset, "mlp")) preset_mlp(&model);
    else preset_resnet50(&model);

    /* Parameters in registration (forward) order. */
    size_t nparams = 0;
    for (size_t l = 0; l < model.nlayers; l++)
        for (int k = 0; k < 3; k++) nparams += model.layers[l].numel[k] > 0;
    ddp_param_t *params = calloc(nparams, sizeof *params);
    char (*names)[64] = calloc(nparams, 64);
    float **data = calloc(nparams, sizeof(float *));
    size_t p = 0;
    static const char *suffix[3] = {"weight", "bn_or_bias", "bn_bias"};
    for (size_t l = 0; l < model.nlayers; l++)
        for (int k = 0; k < 3; k++) {
            if (!model.layers[l].numel[k]) continue;
            snprintf(names[p], 64, "%s.%s", model.layers[l].name, suffix[k]);
            data[p] = calloc(model.layers[l].numel[k], sizeof(float));
            params[p].name = names[p];
            params[p].data = data[p];
            params[p].numel = model.layers[l].numel[k];
            params[p].dtype = DDP_F32;
            params[p].rows = k == 0 ? model.layers[l].numel[1] : 0; /* out features/channels */
            p++;
        }
    ddp_trace_t *trace = NULL;
    int rc = DDP_BENCH_EXIT_OK;
    if (o.trace_path) {
        char path[1024];
        snprintf(path, sizeof path, "%s.rank%d.json", o.trace_path, rank);
        if (ddp_trace_open(path, rank, &trace) != DDP_OK) {
            fprintf(stderr, "ddp-bench: rank %d: cannot open trace %s: %s\n", rank, path,
                    ddp_last_error());
            rc = DDP_BENCH_EXIT_FAILED;
        } else {
            ddp_trace_name_lane(trace, 0, "compute");
            ddp_trace_name_lane(trace, 1, "reducer calls");
        }
    }
    /* Runs interleave the variants (layout x gradient mode), and their order reverses from one
     * repeat to the next (A B, B A, A B, ...) so that a drift in the machine's load does not
     * favour one of them. */
    int nvariants = o.nlayouts * o.ngrads;
    int nruns = o.repeat * nvariants;
    double compute_us = o.compute_us;
    for (int run = 0; run < nruns && rc == DDP_BENCH_EXIT_OK; run++) {
        int round = run / nvariants, j = run % nvariants;
        int v = round % 2 ? nvariants - 1 - j : j;
        int layout = o.layouts[v / o.ngrads], grads = o.grads[v % o.ngrads];
        rc = run_once(group, &o, &model, params, nparams, trace, layout, grads, run, nruns,
                      &compute_us);
    }
    ddp_trace_close(trace);
    for (size_t i = 0; i < nparams; i++) free(data[i]);
    free(data);
    free(names);
    free(params);
    free(model.layers);
    return rc;
}
