/* build/gpt: a GPT-2-style byte-level language model trained data-parallel on the fortunes
 * quotations. Each rank takes its share of every global batch (DistributedSampler semantics: the
 * global batch is the same whatever the world size); backward hands each layer's gradients to the
 * Reducer as soon as they are final (highest layer first), in one stable gradient block; AdamW
 * (decay on the matrices only), warmup + cosine and global-norm clipping, or ZeRO-1/2, or ZeRO-3
 * (FSDP: each block a unit of ddp/fsdp.h, gathered just before its forward and backward).
 *
 *     build/ddprun -n 2 build/gpt --steps 300      (docs/gpt.md has every option) */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <ddp/ddp.h>

#ifdef GPT_HAVE_OPENBLAS_THREADS
void openblas_set_num_threads(int);
#endif

#include "gpt.h"
#include "openblas_kernels.h"

static const char *prog = "gpt";
static int g_rank = 0;

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: rank %d: error: ", prog, g_rank);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void check(ddp_status_t st, const char *what)
{
    if (st != DDP_OK) fail("%s: %s: %s", what, ddp_status_string(st), ddp_last_error());
}

typedef struct options {
    gpt_config_t model;
    size_t batch, accumulate, steps, warmup, eval_every, eval_batches, samples, sample_len;
    double lr, min_lr_ratio, weight_decay, clip, val_fraction, bucket_mb;
    int zero, print_losses, bf16;
    double mem_budget_mb; /* > 0: refuse to run when a rank's model state would exceed it */
    int bench_nosync; /* every other timed step without communication (no_sync) */
    size_t bench_warmup; /* steps left out of the medians */
    int json, profile, no_progress;
    size_t grad_blocks; /* 1: whole tensors to the Reducer; GPT_GRAD_TILES: row tiles too */
    double piece_kb;    /* the Reducer's piece size; < 0: 64 KiB with row tiles, else off */
    uint64_t seed;
    const char *data, *metrics;
    const char *checkpoint, *resume; /* resume: a file, or "auto" (the checkpoint if it exists) */
    size_t save_every, stop_at;
    const char *trace; /* Chrome trace per rank: FILE.rank<r> */
} options_t;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: %s [options]   (run under ddprun for several ranks)\n"
            "  --layers N        transformer blocks (4)\n"
            "  --heads N         attention heads (4)\n"
            "  --channels N      embedding width, a multiple of heads (128)\n"
            "  --context N       tokens (bytes) per sequence (64)\n"
            "  --batch N         GLOBAL sequences per micro-step, divisible by the world size (16)\n"
            "  --accumulate K    micro-steps per optimizer step (1)\n"
            "  --steps N         optimizer steps (600)\n"
            "  --lr X            peak learning rate (2e-3), warmup then cosine to lr*min-lr-ratio\n"
            "  --warmup N        warmup steps (20)\n"
            "  --min-lr-ratio X  final lr / peak lr (0.1)\n"
            "  --weight-decay X  AdamW decay of the 2-D weights, embeddings included (0.1)\n"
            "  --clip X          global gradient norm clipping, 0 off (1.0)\n"
            "  --zero 0|1|2|3    1: ZeRO-1, the optimizer state sharded over ranks; 2: and the\n"
            "                    gradients (reduce-scattered as backward finishes each layer, no\n"
            "                    Reducer); 3: and the parameters (FSDP: each block gathered just\n"
            "                    before its forward and backward, the next one prefetched) (0)\n"
            "  --mem-budget MIB  refuse to run (or stop) when a rank's model state - parameters,\n"
            "                    gradients, optimizer state, gathered units - exceeds MIB (off)\n"
            "  --param-dtype T   f32, or bf16: bf16 parameters (and gradients into the optimizer)\n"
            "                    with f32 master weights in the optimizer (f32)\n"
            "  --grad-blocks N   1: each layer's gradients reported whole; 4: each block matrix's\n"
            "                    row tiles reported as computed (same bits) (1)\n"
            "  --piece-kb X      Reducer pieces in KiB, 0 off (64 with --grad-blocks 4, else 0)\n"
            "  --bucket-mb X     Reducer bucket cap in MiB (1)\n"
            "  --eval-every N    validation every N steps and at the end, 0: only at the end (200)\n"
            "  --eval-batches N  validation batches (8)\n"
            "  --samples N       generated samples printed at the end (3)\n"
            "  --sample-len N    bytes per sample (160)\n"
            "  --seed N          init, data order and sampling (1)\n"
            "  --data DIR        the fortunes directory (/usr/share/games/fortunes)\n"
            "  --metrics FILE    CSV: step,loss,val_loss,lr,grad_norm,ms\n"
            "  --checkpoint FILE saved every --save-every steps and at the end (model, AdamW\n"
            "                    state consolidated over ranks, step)\n"
            "  --save-every N    0: only at the end (0)\n"
            "  --resume FILE|auto  continue from FILE; auto: from --checkpoint when it exists\n"
            "  --stop-at N       stop after step N as if interrupted (for tests)\n"
            "  --trace FILE      Chrome trace per rank (FILE.rank<r>): compute spans of the first\n"
            "                    3 steps; the Reducer's bucket spans of every step (short runs)\n"
            "  --print-losses    print every step's global loss (%%.9g) and a parameter checksum\n"
            "  --no-progress     no progress bar (it is drawn only when stdout is a terminal, on\n"
            "                    rank 0, and never mixed into redirected output)\n"
            "  --json            print one final JSON line (rank 0): tokens/s, median step ms,\n"
            "                    exposed communication, peak RSS of every rank, phase times\n"
            "  --bench-nosync    timing only: after --bench-warmup steps, every other step runs\n"
            "                    without communication (no_sync, the loss not averaged either):\n"
            "                    exposed communication = synchronised - no_sync median step on\n"
            "                    the slowest rank (the method bench/ uses for PyTorch DDP)\n"
            "  --bench-warmup N  steps left out of the medians (5)\n"
            "  --profile         time each phase of forward/backward (matmuls, attention,\n"
            "                    layernorm, gelu, softmax+loss, elementwise) and the optimizer\n",
            prog);
}

static size_t parse_size(const char *name, const char *v, size_t min)
{
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (!*v || *end || v[0] == '-' || x < min)
        fail("%s: '%s' is not an integer >= %zu", name, v, min);
    return (size_t)x;
}

static double parse_double(const char *name, const char *v, double min)
{
    char *end;
    double x = strtod(v, &end);
    if (!*v || *end || !(x >= min)) fail("%s: '%s' is not a number >= %g", name, v, min);
    return x;
}

static void parse(int argc, char **argv, options_t *o)
{
    *o = (options_t){.model = {.layers = 4, .heads = 4, .channels = 128, .context = 64},
                     .batch = 16, .accumulate = 1, .steps = 600, .warmup = 20,
                     .eval_every = 200, .eval_batches = 8, .samples = 3, .sample_len = 160,
                     .lr = 2e-3, .min_lr_ratio = 0.1, .weight_decay = 0.1, .clip = 1.0,
                     .val_fraction = 0.05, .bucket_mb = 1.0, .seed = 1, .grad_blocks = 1,
                     .piece_kb = -1, .bench_warmup = 5,
                     .data = "/usr/share/games/fortunes"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        }
        int *flag = !strcmp(a, "--print-losses")  ? &o->print_losses
                    : !strcmp(a, "--no-progress") ? &o->no_progress
                    : !strcmp(a, "--json")        ? &o->json
                    : !strcmp(a, "--bench-nosync") ? &o->bench_nosync
                    : !strcmp(a, "--profile")     ? &o->profile
                                                  : NULL;
        if (flag) {
            *flag = 1;
            continue;
        }
        if (i + 1 >= argc) fail("%s needs a value (--help lists the options)", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--layers")) o->model.layers = parse_size(a, v, 1);
        else if (!strcmp(a, "--heads")) o->model.heads = parse_size(a, v, 1);
        else if (!strcmp(a, "--channels")) o->model.channels = parse_size(a, v, 1);
        else if (!strcmp(a, "--context")) o->model.context = parse_size(a, v, 1);
        else if (!strcmp(a, "--batch")) o->batch = parse_size(a, v, 1);
        else if (!strcmp(a, "--accumulate")) o->accumulate = parse_size(a, v, 1);
        else if (!strcmp(a, "--steps")) o->steps = parse_size(a, v, 1);
        else if (!strcmp(a, "--warmup")) o->warmup = parse_size(a, v, 0);
        else if (!strcmp(a, "--eval-every")) o->eval_every = parse_size(a, v, 0);
        else if (!strcmp(a, "--eval-batches")) o->eval_batches = parse_size(a, v, 1);
        else if (!strcmp(a, "--samples")) o->samples = parse_size(a, v, 0);
        else if (!strcmp(a, "--sample-len")) o->sample_len = parse_size(a, v, 1);
        else if (!strcmp(a, "--seed")) o->seed = parse_size(a, v, 0);
        else if (!strcmp(a, "--zero")) o->zero = (int)parse_size(a, v, 0);
        else if (!strcmp(a, "--lr")) o->lr = parse_double(a, v, 0);
        else if (!strcmp(a, "--min-lr-ratio")) o->min_lr_ratio = parse_double(a, v, 0);
        else if (!strcmp(a, "--weight-decay")) o->weight_decay = parse_double(a, v, 0);
        else if (!strcmp(a, "--clip")) o->clip = parse_double(a, v, 0);
        else if (!strcmp(a, "--bucket-mb")) o->bucket_mb = parse_double(a, v, 0.001);
        else if (!strcmp(a, "--mem-budget")) o->mem_budget_mb = parse_double(a, v, 0.001);
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--metrics")) o->metrics = v;
        else if (!strcmp(a, "--checkpoint")) o->checkpoint = v;
        else if (!strcmp(a, "--trace")) o->trace = v;
        else if (!strcmp(a, "--grad-blocks")) o->grad_blocks = parse_size(a, v, 1);
        else if (!strcmp(a, "--piece-kb")) o->piece_kb = parse_double(a, v, 0);
        else if (!strcmp(a, "--param-dtype")) {
            if (strcmp(v, "f32") && strcmp(v, "bf16"))
                fail("--param-dtype: '%s' is not f32 or bf16", v);
            o->bf16 = !strcmp(v, "bf16");
        }
        else if (!strcmp(a, "--resume")) o->resume = v;
        else if (!strcmp(a, "--save-every")) o->save_every = parse_size(a, v, 0);
        else if (!strcmp(a, "--stop-at")) o->stop_at = parse_size(a, v, 1);
        else if (!strcmp(a, "--bench-warmup")) o->bench_warmup = parse_size(a, v, 0);
        else fail("unknown option %s (--help lists the options)", a);
    }
    if (o->resume && !strcmp(o->resume, "auto") && !o->checkpoint)
        fail("--resume auto needs --checkpoint FILE (the file it continues from)");
    if (o->save_every && !o->checkpoint) fail("--save-every needs --checkpoint FILE");
    if (o->grad_blocks != 1 && o->grad_blocks != GPT_GRAD_TILES)
        fail("--grad-blocks: %zu is not 1 or %d (the row tiles backward computes)",
             o->grad_blocks, GPT_GRAD_TILES);
    if (o->zero > 3) fail("--zero: %d is not 0, 1, 2 or 3", o->zero);
    /* ZeRO's step communicates (the updated shards are gathered), so its no_sync step would
     * still wait for the other ranks and the difference would not be the Reducer's exposure */
    if (o->bench_nosync && o->zero)
        fail("--bench-nosync: not with --zero %d (ZeRO's optimizer step communicates too)",
             o->zero);
    if (o->zero >= 2 && o->grad_blocks > 1)
        fail("--grad-blocks %zu hands row tiles to the Reducer; --zero %d has no Reducer",
             o->grad_blocks, o->zero);
    /* The model computes in f32 from the gathered units; bf16 units would need a widened copy
     * of each gathered unit (not done: docs/gpt.md) */
    if (o->zero == 3 && o->bf16)
        fail("--param-dtype bf16: not with --zero 3 (use --zero 1 or 2)");
    if (o->bench_nosync && (o->checkpoint || o->resume))
        fail("--bench-nosync: no_sync steps leave the ranks' parameters apart: not with "
             "--checkpoint or --resume");
    if (o->min_lr_ratio > 1) fail("--min-lr-ratio: %g is above 1", o->min_lr_ratio);
    if (o->model.channels % o->model.heads)
        fail("--channels %zu is not a multiple of --heads %zu", o->model.channels,
             o->model.heads);
}

typedef struct trainer {
    options_t o;
    ddp_store_t *local_store;
    ddp_group_t *group;
    int rank, world;
    size_t local_batch;
    gpt_text_t train, val;
    gpt_t model;
    float *grads; /* the gradient block (transport memory), laid out as the parameters */
    ddp_reducer_t *reducer;
    ddp_optim_t *optim;
    ddp_zero_t *zero;
    ddp_fsdp_t *fsdp;    /* --zero 3 */
    int training;        /* --zero 3: forward keeps the last block gathered for backward */
    int sync_now;        /* --zero 2: this micro-step's gradients go to the reduce-scatter */
    size_t block_bytes;  /* the gradient block (not under --zero 3) */
    ddp_status_t status; /* a failure inside a backward callback */
    ddp_trace_t *trace;
    int tracing;    /* this step's compute spans are recorded */
    double mark_us; /* end of the last traced span */
    int *tok, *tgt;
    size_t nwindows;
    uint32_t *perm;
    uint64_t perm_epoch; /* the epoch perm holds; UINT64_MAX: none yet */
    uint16_t *half_params, *half_grads; /* --param-dtype bf16: what the optimizer updates */
} trainer_t;

/* The four matrices of a block: the tensors backward reports in row tiles. */
static int is_block_matrix(const gpt_t *m, size_t i)
{
    if (i < 2 || i >= 2 + GPT_LAYER_TENSORS * m->cfg.layers) return 0;
    size_t k = (i - 2) % GPT_LAYER_TENSORS;
    return k == GPT_QKVW || k == GPT_ATTPROJW || k == GPT_FCW || k == GPT_FCPROJW;
}

/* backward's row callback: rows [r0, r1) of a block matrix's gradient are final. */
static int on_rows(void *ctx, size_t tensor, size_t r0, size_t r1)
{
    trainer_t *t = ctx;
    ddp_status_t st = ddp_reducer_grad_ready_rows(t->reducer, tensor, r0, r1);
    if (st != DDP_OK) {
        t->status = st;
        return 1;
    }
    return 0;
}

/* backward's callback: tensors [first, first + count) are final; hand them to the Reducer,
 * last-registered first (the order the LAST_FIRST bucket layout expects). */
static int on_ready(void *ctx, size_t first, size_t count)
{
    trainer_t *t = ctx;
    if (t->tracing) {
        char name[64];
        if (count == GPT_LAYER_TENSORS)
            snprintf(name, sizeof name, "backward: layer %zu", (first - 2) / GPT_LAYER_TENSORS);
        else
            snprintf(name, sizeof name, "backward: %s", first == GPT_WTE ? "embeddings" : "lm head + lnf");
        double now = ddp_time_us();
        ddp_trace_span(t->trace, name, "compute", 0, t->mark_us, now);
        t->mark_us = now;
    }
    if (t->fsdp) { /* --zero 3: a block's unit is done; the root unit after the embeddings */
        ddp_status_t st = DDP_OK;
        size_t unit = count == GPT_LAYER_TENSORS ? 1 + (first - 2) / GPT_LAYER_TENSORS : 0;
        if (count == GPT_LAYER_TENSORS || first == GPT_WTE) {
            st = ddp_fsdp_grad_ready(t->fsdp, unit);
            if (st == DDP_OK) st = ddp_fsdp_release(t->fsdp, unit);
        }
        t->status = st;
        return st != DDP_OK;
    }
    if (t->o.zero == 2) { /* local gradients to the reduce-scatter, on the last micro-step */
        if (!t->sync_now) return 0;
        for (size_t i = first + count; i-- > first;) {
            const gpt_tensor_t *ten = &t->model.tensors[i];
            const void *g = t->grads + ten->offset;
            if (t->o.bf16) {
                for (size_t e = 0; e < ten->numel; e++)
                    t->half_grads[ten->offset + e] = ddp_f32_to_bf16(t->grads[ten->offset + e]);
                g = t->half_grads + ten->offset;
            }
            ddp_status_t st = ddp_zero_grad_ready(t->zero, i, g);
            if (st != DDP_OK) {
                t->status = st;
                return 1;
            }
        }
        return 0;
    }
    for (size_t i = first + count; i-- > first;) {
        if (t->o.grad_blocks > 1 && is_block_matrix(&t->model, i)) continue; /* rows did it */
        ddp_status_t st = ddp_reducer_grad_ready(t->reducer, i);
        if (st != DDP_OK) {
            t->status = st;
            return 1;
        }
    }
    return 0;
}

/* ---- --zero 3 ----------------------------------------------------------------------------------
 * Units: 0 is the root (wte, wpe and the final layer norm: the tied embedding is read by the first
 * and the last computation of forward and of backward, so it stays gathered for a whole
 * micro-step, as FSDP's root module does); 1 + l is block l. */
static size_t unit_of_tensor(const gpt_t *m, size_t i)
{
    if (i < 2 || i >= 2 + GPT_LAYER_TENSORS * m->cfg.layers) return 0;
    return 1 + (i - 2) / GPT_LAYER_TENSORS;
}

/* Points the model at tensors [first, first + count)'s gathered values (and gradient buffers). */
static ddp_status_t point_at(trainer_t *t, size_t first, size_t count, int grads)
{
    gpt_t *m = &t->model;
    for (size_t i = first; i < first + count; i++) {
        ddp_status_t st = ddp_fsdp_param(t->fsdp, i, (void **)&m->param_at[i]);
        if (st == DDP_OK && grads) st = ddp_fsdp_grad(t->fsdp, i, (void **)&m->grad_at[i]);
        if (st != DDP_OK) return st;
    }
    return DDP_OK;
}

/* The root unit's tensors: wte, wpe, lnf.weight, lnf.bias. */
static ddp_status_t point_at_root(trainer_t *t, int grads)
{
    ddp_status_t st = point_at(t, GPT_WTE, 2, grads);
    return st == DDP_OK ? point_at(t, GPT_LNFW(&t->model), 2, grads) : st;
}

/* Before a forward: the root gathered (and block 0's unit prefetched). */
static void zero3_begin(trainer_t *t)
{
    check(ddp_fsdp_gather(t->fsdp, 0), "gathering the root unit");
    check(ddp_fsdp_prefetch(t->fsdp, 1), "prefetching block 0");
    check(point_at_root(t, 0), "the root unit's parameters");
}

/* The model's layer hook: block l's unit gathered before its forward (the next one's allgather
 * started, to run while this block computes) and released after, except the last block in
 * training, whose backward comes next; gathered again before its backward (the block below
 * prefetched), pointed at its gradient buffers. on_ready hands the gradients over. */
static int zero3_hook(void *ctx, size_t l, int event)
{
    trainer_t *t = ctx;
    size_t L = t->model.cfg.layers, unit = 1 + l;
    ddp_status_t st = DDP_OK;
    if (event == GPT_HOOK_FORWARD) {
        st = ddp_fsdp_gather(t->fsdp, unit);
        if (st == DDP_OK && l + 1 < L) st = ddp_fsdp_prefetch(t->fsdp, unit + 1);
        if (st == DDP_OK) st = point_at(t, GPT_T(l, 0), GPT_LAYER_TENSORS, 0);
    } else if (event == GPT_HOOK_FORWARD_DONE) {
        if (!t->training || l + 1 < L) st = ddp_fsdp_release(t->fsdp, unit);
    } else {
        st = ddp_fsdp_gather(t->fsdp, unit);
        if (st == DDP_OK && l > 0) st = ddp_fsdp_prefetch(t->fsdp, unit - 1);
        if (st == DDP_OK) st = point_at(t, GPT_T(l, 0), GPT_LAYER_TENSORS, 1);
    }
    t->status = st;
    return st != DDP_OK;
}

/* Fills tok/tgt with this rank's sequences for micro-batch `micro` of the run (epochs wrap). */
static void load_batch(trainer_t *t, uint64_t micro)
{
    const options_t *o = &t->o;
    size_t T = o->model.context, per_epoch = t->nwindows / o->batch;
    uint64_t epoch = micro / per_epoch, in_epoch = micro % per_epoch;
    if (epoch != t->perm_epoch) {
        gpt_permutation(o->seed, epoch, t->nwindows, t->perm);
        t->perm_epoch = epoch;
    }
    size_t base = in_epoch * o->batch + (size_t)t->rank * t->local_batch;
    for (size_t b = 0; b < t->local_batch; b++) {
        const uint8_t *w = t->train.bytes + (size_t)t->perm[base + b] * T;
        for (size_t i = 0; i < T; i++) {
            t->tok[b * T + i] = w[i];
            t->tgt[b * T + i] = w[i + 1];
        }
    }
}

/* Mean validation loss over the first eval_batches * batch windows of the validation text,
 * split over ranks like training. */
static double evaluate(trainer_t *t)
{
    const options_t *o = &t->o;
    size_t T = o->model.context, nval = (t->val.len - 1) / T;
    size_t batches = o->eval_batches;
    if (batches * o->batch > nval) batches = nval / o->batch;
    double sum = 0;
    int profile = t->model.profile;
    t->model.profile = 0; /* the phase times are those of training steps */
    t->training = 0;      /* every block released after its forward */
    for (size_t k = 0; k < batches; k++) {
        for (size_t b = 0; b < t->local_batch; b++) {
            const uint8_t *w =
                t->val.bytes + (k * o->batch + (size_t)t->rank * t->local_batch + b) * T;
            for (size_t i = 0; i < T; i++) {
                t->tok[b * T + i] = w[i];
                t->tgt[b * T + i] = w[i + 1];
            }
        }
        if (t->fsdp) zero3_begin(t);
        sum += gpt_forward(&t->model, t->tok, t->tgt, t->local_batch, T);
        if (t->fsdp) {
            check(t->model.hook_rc ? t->status : DDP_OK, "gathering a block (validation)");
            check(ddp_fsdp_release(t->fsdp, 0), "releasing the root unit");
        }
    }
    t->model.profile = profile;
    t->training = 1;
    check(ddp_group_allreduce(t->group, &sum, &sum, 1, DDP_F64, DDP_SUM), "allreduce val loss");
    return batches ? sum / (double)(batches * (size_t)t->world) : NAN;
}

/* Cross-entropy of the validation text under the training text's byte frequencies (add-one):
 * the loss a model that ignores context cannot beat. */
static double unigram_baseline(const trainer_t *t)
{
    double count[GPT_VOCAB];
    for (int v = 0; v < GPT_VOCAB; v++) count[v] = 1;
    for (size_t i = 0; i < t->train.len; i++) count[t->train.bytes[i]] += 1;
    double total = (double)t->train.len + GPT_VOCAB, h = 0;
    for (size_t i = 0; i < t->val.len; i++) h -= log(count[t->val.bytes[i]] / total);
    return h / (double)t->val.len;
}

static uint64_t params_fnv(const gpt_t *m)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *p = (const unsigned char *)m->params;
    for (size_t i = 0; i < m->nparams * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* ---- checkpoints ------------------------------------------------------------------------------
 * The file's format and its reader are in checkpoint.c (gpt.h). Rank 0 writes it atomically
 * (temporary file, fsync, rename); every rank reads it to resume. */

static gpt_ckpt_header_t ckpt_header(const options_t *o)
{
    gpt_ckpt_header_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, GPT_CKPT_MAGIC, 8);
    uint64_t u[GPT_CK_NU] = {o->model.layers, o->model.heads, o->model.channels,
                             o->model.context, o->batch, o->accumulate, o->steps, o->warmup,
                             o->seed, (uint64_t)o->bf16};
    double d[GPT_CK_ND] = {o->lr, o->min_lr_ratio, o->weight_decay, o->clip, o->val_fraction};
    memcpy(h.u, u, sizeof u);
    memcpy(h.d, d, sizeof d);
    return h;
}

/* Pointers to each tensor of a parameter block laid out as the model's (ntensors entries). */
static void **tensor_pointers(const gpt_t *m, float *block)
{
    void **p = calloc(m->ntensors, sizeof *p);
    if (!p) fail("out of memory");
    for (size_t i = 0; i < m->ntensors; i++) p[i] = block ? block + m->tensors[i].offset : NULL;
    return p;
}

/* Collective (ZeRO consolidates its shards on rank 0; --zero 3 its parameters too). */
static void save_checkpoint(trainer_t *t, uint64_t steps_done)
{
    const options_t *o = &t->o;
    size_t bytes = 0;
    void *state = NULL;
    const float *values = t->model.params;
    float *full = NULL; /* --zero 3: the parameters consolidated on rank 0 */
    if (t->fsdp) {
        check(ddp_fsdp_consolidated_optim_size(t->fsdp, &bytes), "ddp_fsdp_consolidated_optim_size");
        if (t->rank == 0 && (!(state = malloc(bytes)) ||
                             !(full = malloc(t->model.nparams * sizeof(float)))))
            fail("out of memory saving %s", o->checkpoint);
        void **ptrs = tensor_pointers(&t->model, full);
        check(ddp_fsdp_consolidate(t->fsdp, 0, t->rank == 0 ? ptrs : NULL, state,
                                   t->rank == 0 ? bytes : 0),
              "ddp_fsdp_consolidate");
        free(ptrs);
        values = full;
    } else if (t->zero) {
        check(ddp_zero_consolidated_state_size(t->zero, &bytes), "ddp_zero_consolidated_state_size");
        if (t->rank == 0 && !(state = malloc(bytes))) fail("out of memory saving %s", o->checkpoint);
        check(ddp_zero_state_consolidate(t->zero, 0, state, t->rank == 0 ? bytes : 0),
              "ddp_zero_state_consolidate");
    } else if (t->rank == 0) {
        check(ddp_optim_state_size(t->optim, &bytes), "ddp_optim_state_size");
        if (!(state = malloc(bytes))) fail("out of memory saving %s", o->checkpoint);
        check(ddp_optim_state_save(t->optim, state, bytes), "ddp_optim_state_save");
    }
    if (t->rank != 0) return;
    gpt_ckpt_header_t h = ckpt_header(o);
    h.steps_done = steps_done;
    h.nparams = t->model.nparams;
    h.state_bytes = bytes;
    char err[8192];
    if (gpt_checkpoint_write(o->checkpoint, &h, values, state, err, sizeof err) != 0)
        fail("%s", err);
    free(state);
    free(full);
}

/* Every rank: the parameters and optimizer state from `path`; returns the steps done. */
static uint64_t load_checkpoint(trainer_t *t, const char *path)
{
    const options_t *o = &t->o;
    gpt_ckpt_header_t want = ckpt_header(o);
    want.nparams = t->model.nparams;
    void *state = NULL;
    size_t bytes = 0;
    uint64_t steps_done = 0;
    char err[8192];
    /* --zero 3: a temporary whole copy, of which each rank keeps its shards */
    float *values = t->fsdp ? malloc(t->model.nparams * sizeof(float)) : t->model.params;
    if (!values) fail("out of memory reading %s", path);
    if (gpt_checkpoint_read(path, &want, o->steps, values, &state, &bytes, &steps_done, err,
                            sizeof err) != 0)
        fail("--resume: %s", err);
    if (t->fsdp) {
        void **ptrs = tensor_pointers(&t->model, values);
        check(ddp_fsdp_load_consolidated(t->fsdp, (const void *const *)ptrs, state, bytes),
              "ddp_fsdp_load_consolidated");
        free(ptrs);
        free(values);
    } else if (t->zero)
        check(ddp_zero_state_load(t->zero, state, bytes), "ddp_zero_state_load");
    else
        check(ddp_optim_state_load(t->optim, state, bytes), "ddp_optim_state_load");
    free(state);
    return steps_done;
}

/* ---- progress bar and timing summary (rank 0) ---------------------------------------------- */

static void format_eta(double seconds, char *out, size_t len)
{
    if (!(seconds >= 0) || seconds > 1e7) {
        snprintf(out, len, "--:--");
        return;
    }
    long s = (long)(seconds + 0.5);
    if (s >= 3600)
        snprintf(out, len, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else
        snprintf(out, len, "%ld:%02ld", s / 60, s % 60);
}

#define BAR_WIDTH 30
#define BAR_LINE 100 /* characters a bar line can take, cleared before other output */

/* One terminal line redrawn in place: step, loss, tokens/s and ETA over this run so far. At
 * most 10 redraws a second (a redraw per step would cost a write per step); the last step
 * always draws. Only ever called when stdout is a terminal. */
static void draw_progress(size_t step, size_t steps, size_t done, size_t left, double loss,
                          double elapsed_s, double tokens_per_step, int force)
{
    static double last_draw = -1;
    double now = ddp_time_us();
    if (!force && last_draw >= 0 && now - last_draw < 100e3) return;
    last_draw = now;
    char bar[BAR_WIDTH + 1], eta[32];
    size_t fill = steps ? step * BAR_WIDTH / steps : 0;
    for (size_t i = 0; i < BAR_WIDTH; i++) bar[i] = i < fill ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    double per_step = done ? elapsed_s / (double)done : 0;
    format_eta(done ? per_step * (double)left : -1, eta, sizeof eta);
    printf("\r[%s] step %zu/%zu  loss %.4f  %.0f tokens/s  ETA %s ", bar, step, steps, loss,
           per_step > 0 ? tokens_per_step / per_step : 0.0, eta);
    fflush(stdout);
}

/* Erases the bar so that a log line starts at column 0 on a clean line. */
static void clear_progress(void)
{
    printf("\r%*s\r", BAR_LINE, "");
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n values (sorts them in place); 0 for none. The median, not the mean: a busy
 * machine's stalls do not drag it (bench/pytorch_ddp.py reports the same for PyTorch). */
static double median(double *v, size_t n)
{
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Peak resident set of this process in MiB (Linux reports ru_maxrss in KiB). */
static double peak_rss_mib(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_maxrss / 1024.0;
}

/* ---- memory per rank -------------------------------------------------------------------------
 * The model state this rank holds, in bytes: parameters, gradients, optimizer state, and (ZeRO-3)
 * the most full parameters gathered at once. Without ZeRO-3 every rank holds the whole parameter
 * block and the whole gradient block (ZeRO-2 keeps the local gradient block too: backward
 * computes whole tensors; its averaged gradient exists only as this rank's shard). Activations
 * are not model state: they scale with the local batch (reported apart). */
enum { MEM_PARAMS, MEM_GRADS, MEM_OPTIM, MEM_GATHERED, MEM_GRADS_FULL, MEM_TOTAL, MEM_N };
static const char *const mem_names[MEM_N] = {"params", "grads", "optimizer", "gathered_peak",
                                             "unit_grads_peak", "total"};

static void memory_ledger(const trainer_t *t, double bytes[MEM_N])
{
    const gpt_t *m = &t->model;
    double n = (double)m->nparams;
    memset(bytes, 0, MEM_N * sizeof *bytes);
    if (t->fsdp) {
        ddp_fsdp_memory_t fm;
        check(ddp_fsdp_memory(t->fsdp, &fm), "ddp_fsdp_memory");
        bytes[MEM_PARAMS] = (double)fm.param_shard_bytes;
        bytes[MEM_GRADS] = (double)fm.grad_shard_bytes;
        bytes[MEM_OPTIM] = (double)fm.optim_state_bytes;
        bytes[MEM_GATHERED] = (double)fm.gathered_peak_bytes;
        bytes[MEM_GRADS_FULL] = (double)fm.grad_full_peak_bytes; /* units in backward */
        /* What the buffer cache holds may exceed the two peaks when unit sizes differ. */
        double held = (double)(fm.cached_bytes + fm.gathered_bytes + fm.grad_full_bytes);
        double peaks = (double)(fm.gathered_peak_bytes + fm.grad_full_peak_bytes);
        bytes[MEM_TOTAL] = bytes[MEM_PARAMS] + bytes[MEM_GRADS] + bytes[MEM_OPTIM] +
                           (held > peaks ? held : peaks);
        return;
    }
    bytes[MEM_PARAMS] = n * (t->o.bf16 ? 6 : 4); /* the f32 block, and the bf16 copies */
    bytes[MEM_GRADS] = n * (t->o.bf16 ? 6 : 4);
    if (t->zero) {
        bytes[MEM_OPTIM] = (double)ddp_zero_state_bytes(t->zero);
        if (t->o.zero == 2) /* the shard of the averaged gradient */
            bytes[MEM_GRADS] += (double)ddp_zero_owned_numel(t->zero) * (t->o.bf16 ? 2 : 4);
    } else {
        bytes[MEM_OPTIM] = (double)ddp_optim_state_bytes(t->optim);
    }
    bytes[MEM_TOTAL] = bytes[MEM_PARAMS] + bytes[MEM_GRADS] + bytes[MEM_OPTIM];
}

/* --mem-budget: stops with the breakdown when this rank's model state is above the budget. */
static void check_budget(const trainer_t *t, const char *when)
{
    if (!(t->o.mem_budget_mb > 0)) return;
    double b[MEM_N];
    memory_ledger(t, b);
    const double mib = 1048576.0;
    if (b[MEM_TOTAL] > t->o.mem_budget_mb * mib)
        fail("--mem-budget %g MiB: %s this rank holds %.3f MiB of model state (parameters %.3f, "
             "gradients %.3f, optimizer state %.3f, gathered parameters %.3f, unit gradients %.3f) "
             "with --zero %d on %d rank%s; shard more (--zero 3, more ranks) or raise the budget",
             t->o.mem_budget_mb, when, b[MEM_TOTAL] / mib, b[MEM_PARAMS] / mib,
             b[MEM_GRADS] / mib, b[MEM_OPTIM] / mib, b[MEM_GATHERED] / mib,
             b[MEM_GRADS_FULL] / mib, t->o.zero, t->world,
             t->world == 1 ? "" : "s");
}

/* The file to resume from, or NULL to start fresh. */
static const char *resume_path(const options_t *o)
{
    if (!o->resume) return NULL;
    if (strcmp(o->resume, "auto") != 0) return o->resume;
    FILE *f = fopen(o->checkpoint, "rb");
    if (!f) {
        if (errno == ENOENT) return NULL;
        fail("--resume auto: cannot open %s: %s", o->checkpoint, strerror(errno));
    }
    fclose(f);
    return o->checkpoint;
}

int main(int argc, char **argv)
{
    example_openblas_kernels(argv);
    trainer_t tr = {0}, *t = &tr;
    parse(argc, argv, &t->o);
    const options_t *o = &t->o;
#ifdef GPT_HAVE_OPENBLAS_THREADS
    if (!getenv("OPENBLAS_NUM_THREADS")) openblas_set_num_threads(1); /* one core per rank */
#endif
    ddp_group_options_t gopt = DDP_GROUP_OPTIONS_INIT;
    ddp_status_t st = ddp_group_create_from_env(&gopt, &t->group);
    if (st == DDP_ERR_NOT_FOUND) { /* no launcher: one process */
        check(ddp_store_hash_create(&t->local_store), "creating the in-memory store");
        check(ddp_group_create(t->local_store, 0, 1, &gopt, &t->group), "creating a 1-rank group");
    } else {
        check(st, "creating the process group from the launcher's environment");
    }
    t->rank = ddp_group_rank(t->group);
    t->world = ddp_group_size(t->group);
    g_rank = t->rank;
    if (o->batch % (size_t)t->world)
        fail("--batch %zu is not divisible by the world size %d (the global batch is split "
             "evenly over ranks)", o->batch, t->world);
    t->local_batch = o->batch / (size_t)t->world;

    char err[512];
    if (gpt_text_load(o->data, o->val_fraction, &t->train, &t->val, err, sizeof err))
        fail("%s", err);
    size_t T = o->model.context;
    t->nwindows = (t->train.len - 1) / T;
    if (t->nwindows < o->batch || t->val.len < T + 1)
        fail("the text (%zu bytes) is too short for --batch %zu of --context %zu", t->train.len,
             o->batch, T);
    if (gpt_create(&o->model, t->local_batch, o->seed, &t->model, err, sizeof err))
        fail("%s", err);
    gpt_t *m = &t->model;
    t->tok = malloc(t->local_batch * T * sizeof(int));
    t->tgt = malloc(t->local_batch * T * sizeof(int));
    t->perm = malloc(t->nwindows * sizeof(uint32_t));
    if (!t->tok || !t->tgt || !t->perm) fail("out of memory");

    /* One gradient block in the transport's memory, laid out as the parameters: the Reducer
     * reduces buckets of it in place, the optimizer reads it, addresses never change. */
    size_t block_bytes = m->nparams * sizeof(float);
    t->block_bytes = block_bytes;
    /* --zero 3 has none: each unit's gradient lives in the FSDP object while its backward runs */
    if (o->zero < 3) {
        check(ddp_group_alloc_buffer(t->group, block_bytes, (void **)&t->grads),
              "allocating the gradient block");
        memset(t->grads, 0, block_bytes);
    }
    ddp_param_t *params = calloc(m->ntensors, sizeof *params);
    void **grad_ptrs = calloc(m->ntensors, sizeof *grad_ptrs);
    uint32_t *groups_of = calloc(m->ntensors, sizeof *groups_of);
    if (!params || !grad_ptrs || !groups_of) fail("out of memory");
    for (size_t i = 0; i < m->ntensors; i++) {
        const gpt_tensor_t *ten = &m->tensors[i];
        params[i] = (ddp_param_t){ten->name, m->params + ten->offset, ten->numel, DDP_F32,
                                  ten->rows, 0, t->grads ? t->grads + ten->offset : NULL};
        grad_ptrs[i] = t->grads ? t->grads + ten->offset : NULL;
        /* nanoGPT's rule: decay every 2-D tensor (matmul weights and the tied embedding),
         * never biases or layer norms */
        groups_of[i] = ten->rows ? 0 : 1;
    }
    ddp_reducer_config_t rc = DDP_REDUCER_CONFIG_INIT;
    rc.grad_memory = DDP_GRAD_MEMORY_USER_BLOCK;
    rc.grad_block = t->grads;
    rc.grad_block_bytes = block_bytes;
    rc.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
    rc.bucket_layout = DDP_BUCKET_LAYOUT_LAST_FIRST;
    double piece_kb = o->piece_kb >= 0 ? o->piece_kb : o->grad_blocks > 1 ? 64 : 0;
    rc.piece_bytes = (size_t)(piece_kb * 1024.0);
    if (o->trace) {
        char path[4096];
        snprintf(path, sizeof path, "%s.rank%d", o->trace, t->rank);
        check(ddp_trace_open(path, t->rank, &t->trace), "opening the trace file");
        ddp_trace_name_lane(t->trace, 0, "trainer (compute)");
        rc.trace = t->trace;
    }
    /* ZeRO-2 and -3 reduce-scatter the gradients themselves: no Reducer */
    if (o->zero < 2)
        check(ddp_reducer_create(t->group, params, m->ntensors, NULL, 0, &rc, &t->reducer),
              "creating the Reducer");
    /* bf16: the optimizer updates bf16 copies (keeping f32 masters); the model computes with
     * their values widened to f32, so every rank and step sees bf16-rounded weights. */
    ddp_param_t *optim_params = params;
    void **optim_grads = grad_ptrs;
    if (o->bf16) {
        t->half_params = malloc(m->nparams * sizeof(uint16_t));
        t->half_grads = malloc(m->nparams * sizeof(uint16_t));
        optim_params = calloc(m->ntensors, sizeof *optim_params);
        optim_grads = calloc(m->ntensors, sizeof *optim_grads);
        if (!t->half_params || !t->half_grads || !optim_params || !optim_grads) fail("out of memory");
        for (size_t i = 0; i < m->nparams; i++) {
            t->half_params[i] = ddp_f32_to_bf16(m->params[i]);
            m->params[i] = ddp_bf16_to_f32(t->half_params[i]);
        }
        for (size_t i = 0; i < m->ntensors; i++) {
            optim_params[i] = params[i];
            optim_params[i].data = t->half_params + m->tensors[i].offset;
            optim_params[i].dtype = DDP_BF16;
            optim_grads[i] = t->half_grads + m->tensors[i].offset;
        }
    }
    ddp_optim_group_t groups[2] = {{o->lr, o->weight_decay}, {o->lr, 0.0}};
    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    oc.kind = DDP_OPTIM_ADAMW;
    oc.lr = o->lr;
    oc.beta1 = 0.9;
    oc.beta2 = 0.95; /* GPT-2 / nanoGPT */
    oc.eps = 1e-8;
    oc.weight_decay = o->weight_decay;
    oc.max_grad_norm = o->clip;
    oc.ngroups = 2;
    oc.groups = groups;
    oc.param_groups = groups_of;
    t->training = 1;
    if (o->zero == 3) {
        uint32_t *units = calloc(m->ntensors, sizeof *units);
        if (!units) fail("out of memory");
        for (size_t i = 0; i < m->ntensors; i++) units[i] = (uint32_t)unit_of_tensor(m, i);
        ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
        fc.optim = oc;
        fc.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
        check(ddp_fsdp_create(t->group, params, m->ntensors, units, 1 + o->model.layers, &fc,
                              &t->fsdp),
              "creating the FSDP (ZeRO-3) model");
        free(units);
        /* The whole initial copy goes: from here on this rank holds its shards, and one or two
         * gathered units at a time (model.param_at points into them). */
        free(m->params);
        m->params = NULL;
        m->layer_hook = zero3_hook;
        m->hook_ctx = t;
    } else if (o->zero) {
        ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
        zc.stage = o->zero;
        zc.optim = oc;
        zc.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
        check(ddp_zero_create(t->group, optim_params, m->ntensors, &zc, &t->zero),
              o->zero == 1 ? "creating the ZeRO-1 optimizer" : "creating the ZeRO-2 optimizer");
    } else {
        check(ddp_optim_create(optim_params, m->ntensors, &oc, &t->optim), "creating the optimizer");
    }

    FILE *metrics = NULL;
    if (o->metrics && t->rank == 0) {
        metrics = fopen(o->metrics, "w");
        if (!metrics) fail("--metrics: cannot create %s", o->metrics);
        fprintf(metrics, "step,loss,val_loss,lr,grad_norm,ms\n");
    }
    if (t->rank == 0) {
        printf("gpt: %d rank%s (%s), %zu layers, %zu heads, %zu channels, context %zu: %.2fM "
               "parameters in %zu tensors\n",
               t->world, t->world == 1 ? "" : "s", ddp_group_transport(t->group),
               o->model.layers, o->model.heads, o->model.channels, T, m->nparams / 1e6,
               m->ntensors);
        printf("gpt: fortunes %zu train / %zu validation bytes; global batch %zu x %zu tokens "
               "(%zu per rank)%s; AdamW lr %g, warmup %zu, cosine over %zu steps, clip %g%s\n",
               t->train.len, t->val.len, o->batch, T, t->local_batch,
               o->accumulate > 1 ? " x accumulate" : "", o->lr, o->warmup, o->steps, o->clip,
               o->zero == 3 ? ", ZeRO-3 (FSDP: parameters, gradients and optimizer state sharded)"
               : o->zero == 2 ? ", ZeRO-2 (gradients and optimizer state sharded)"
               : o->zero ? ", ZeRO-1" : "");
        if (o->bf16) printf("gpt: bf16 parameters, f32 master weights in the optimizer\n");
        printf("gpt: unigram baseline (validation bytes under training byte frequencies): "
               "%.4f nats/byte; uniform: %.4f\n",
               unigram_baseline(t), log((double)GPT_VOCAB));
        fflush(stdout);
    }

    check_budget(t, "before training:");
    t->perm_epoch = UINT64_MAX;
    /* Tests only: GPT_TEST_KILL_AT_STEP=N makes rank 1 SIGKILL itself after optimizer step N
     * (after that step's checkpoint, if any), on ddprun's first attempt only, so a restarted job
     * runs through: a real crash at a step the test chooses. */
    size_t kill_at = 0;
    const char *kill_env = getenv("GPT_TEST_KILL_AT_STEP"), *attempt = getenv("DDP_RESTART_COUNT");
    if (kill_env && t->rank == 1 && (!attempt || !strcmp(attempt, "0")))
        kill_at = (size_t)strtoull(kill_env, NULL, 10);
    size_t first_step = 0;
    const char *from = resume_path(o);
    if (from) {
        first_step = (size_t)load_checkpoint(t, from);
        if (o->bf16) /* the saved values are bf16 values: exact */
            for (size_t i = 0; i < m->nparams; i++) t->half_params[i] = ddp_f32_to_bf16(m->params[i]);
        if (t->rank == 0)
            printf("gpt: resumed from %s after step %zu (restart %s)\n", from, first_step,
                   attempt ? attempt : "0");
    } else if (o->resume && t->rank == 0) {
        printf("gpt: resume auto: no checkpoint at %s, starting fresh (restart %s)\n",
               o->checkpoint, attempt ? attempt : "0");
    }
    double t_start = ddp_time_us(), loss = NAN, val_loss = NAN, exposed_sum = 0;
    uint64_t micro = (uint64_t)first_step * o->accumulate;
    size_t end_step = o->stop_at && o->stop_at < o->steps ? o->stop_at : o->steps;
    size_t run_steps = end_step > first_step ? end_step - first_step : 0, synced_steps = 0;
    /* per timed step (after --bench-warmup): step ms, synchronised and no_sync apart, and the
     * finalize wait of the synchronised ones */
    double *sync_ms = calloc(run_steps + 1, sizeof(double));
    double *nosync_ms = calloc(run_steps + 1, sizeof(double));
    double *wait_ms = calloc(run_steps + 1, sizeof(double));
    if (!sync_ms || !nosync_ms || !wait_ms) fail("out of memory");
    size_t nsync = 0, nnosync = 0;
    double optim_seconds = 0; /* --profile: the optimizer steps of the timed steps */
    const int tty = t->rank == 0 && !o->no_progress && isatty(STDOUT_FILENO);
    const double tokens_per_step = (double)o->accumulate * (double)o->batch * (double)T;
    m->profile = o->profile;
    for (size_t step = first_step; step < end_step; step++) {
        size_t run_step = step - first_step;
        if (run_step == o->bench_warmup) { /* the profile covers the timed steps only */
            memset(m->phase_seconds, 0, sizeof m->phase_seconds);
            optim_seconds = 0;
        }
        /* --bench-nosync: odd timed steps skip every collective of the step (gradients and
         * the loss), as PyTorch's model.no_sync() does, so that the synchronised - no_sync
         * difference is the communication backward left exposed */
        const int skip_comm = o->bench_nosync && run_step >= o->bench_warmup &&
                              (run_step - o->bench_warmup) % 2 == 1;
        double s0 = ddp_time_us(), step_wait_us = 0;
        double factor = ddp_lr_warmup_cosine(step, o->warmup, o->steps, 1.0, o->min_lr_ratio);
        if (t->fsdp)
            check(ddp_fsdp_scale_lr(t->fsdp, factor), "ddp_fsdp_scale_lr");
        else if (t->zero)
            check(ddp_zero_scale_lr(t->zero, factor), "ddp_zero_scale_lr");
        else
            check(ddp_optim_scale_lr(t->optim, factor), "ddp_optim_scale_lr");
        double local = 0;
        t->tracing = t->trace && step - first_step < 3;
        for (size_t k = 0; k < o->accumulate; k++, micro++) {
            load_batch(t, micro);
            t->sync_now = !skip_comm && k + 1 == o->accumulate;
            if (t->reducer) {
                check(ddp_reducer_set_sync(t->reducer, t->sync_now), "ddp_reducer_set_sync");
                check(ddp_reducer_prepare(t->reducer), "ddp_reducer_prepare");
            }
            /* --zero 3 reduce-scatters every micro-step's gradients into the shards (no no_sync:
             * that would keep every unit's whole gradient until the last micro-step) */
            if (t->fsdp) zero3_begin(t);
            double f0 = ddp_time_us();
            local += gpt_forward(m, t->tok, t->tgt, t->local_batch, T);
            if (t->fsdp) {
                check(m->hook_rc ? t->status : DDP_OK, "gathering a block for its forward");
                check(point_at_root(t, 1), "the root unit's gradients");
            }
            t->mark_us = ddp_time_us();
            if (t->tracing) ddp_trace_span(t->trace, "forward", "compute", 0, f0, t->mark_us);
            if (gpt_backward(m, t->tok, 1.0f / (float)o->accumulate, t->fsdp ? NULL : t->grads,
                             on_ready, o->grad_blocks > 1 ? on_rows : NULL, t))
                check(t->status, t->fsdp   ? "FSDP during backward"
                                 : t->zero && o->zero == 2 ? "ddp_zero_grad_ready"
                                                          : "ddp_reducer_grad_ready");
            double w0 = ddp_time_us();
            if (t->reducer) check(ddp_reducer_finalize(t->reducer), "ddp_reducer_finalize");
            if (t->tracing) ddp_trace_span(t->trace, "finalize (wait)", "compute", 0, w0, ddp_time_us());
        }
        ddp_reducer_stats_t rs;
        if (!skip_comm && t->reducer && ddp_reducer_stats(t->reducer, &rs) == DDP_OK) {
            exposed_sum += rs.exposed_us;
            step_wait_us = rs.exposed_us;
        }
        synced_steps += !skip_comm;
        double o0 = ddp_time_us();
        local /= (double)o->accumulate;
        if (skip_comm) { /* this rank's own loss: nothing leaves the process */
            loss = local;
        } else {
            check(ddp_group_allreduce(t->group, &local, &local, 1, DDP_F64, DDP_SUM),
                  "allreduce loss");
            loss = local / t->world;
        }
        double norm = NAN;
        if (o->bf16 && o->zero < 2) /* ZeRO-2 converted each tensor as it was handed over */
            for (size_t i = 0; i < m->nparams; i++) t->half_grads[i] = ddp_f32_to_bf16(t->grads[i]);
        double os0 = ddp_time_us();
        if (t->fsdp) {
            check(ddp_fsdp_step(t->fsdp), "ddp_fsdp_step");
            if (o->clip > 0) ddp_fsdp_grad_norm(t->fsdp, &norm);
        } else if (t->zero) {
            check(ddp_zero_step(t->zero, o->zero == 2 ? NULL : optim_grads), "ddp_zero_step");
            if (o->clip > 0) ddp_zero_grad_norm(t->zero, &norm);
        } else {
            check(ddp_optim_step(t->optim, optim_grads), "ddp_optim_step");
            if (o->clip > 0) ddp_optim_grad_norm(t->optim, &norm);
        }
        optim_seconds += (ddp_time_us() - os0) * 1e-6;
        if (o->bf16)
            for (size_t i = 0; i < m->nparams; i++) m->params[i] = ddp_bf16_to_f32(t->half_params[i]);
        if (t->reducer) check(ddp_reducer_zero_grad(t->reducer), "ddp_reducer_zero_grad");
        else if (t->grads) memset(t->grads, 0, t->block_bytes); /* ZeRO-2's local block */
        check_budget(t, "after a step");
        if (t->tracing) ddp_trace_span(t->trace, "optimizer step", "compute", 0, o0, ddp_time_us());
        double ms = (ddp_time_us() - s0) / 1000.0;
        if (run_step >= o->bench_warmup) {
            if (skip_comm) {
                nosync_ms[nnosync++] = ms;
            } else {
                sync_ms[nsync] = ms;
                wait_ms[nsync++] = step_wait_us / 1000.0;
            }
        }
        int last = step + 1 == end_step;
        if (o->checkpoint && (step + 1 == end_step || (o->save_every && (step + 1) % o->save_every == 0)))
            save_checkpoint(t, step + 1);
        if (kill_at && step + 1 == kill_at) raise(SIGKILL);
        val_loss = NAN;
        if (last || (o->eval_every && (step + 1) % o->eval_every == 0)) val_loss = evaluate(t);
        if (t->rank == 0) {
            int log_line = !isnan(val_loss) || step % 20 == 0 || last;
            if (tty && (o->print_losses || log_line)) clear_progress();
            if (o->print_losses) printf("step %zu loss %.9g\n", step, loss);
            if (log_line) {
                printf("step %5zu/%zu  loss %.4f%s", step + 1, o->steps, loss,
                       isnan(val_loss) ? "" : "  val ");
                if (!isnan(val_loss)) printf("%.4f", val_loss);
                printf("  lr %.2e  norm %.3f  %.0f ms\n", o->lr * factor, norm, ms);
                fflush(stdout);
            }
            if (metrics) { /* val_loss empty on steps without validation */
                fprintf(metrics, "%zu,%.6f,", step + 1, loss);
                if (!isnan(val_loss)) fprintf(metrics, "%.6f", val_loss);
                fprintf(metrics, ",%.6g,%.6f,%.2f\n", o->lr * factor, norm, ms);
            }
            if (tty)
                draw_progress(step + 1, o->steps, run_step + 1, end_step - step - 1, loss,
                              (ddp_time_us() - t_start) / 1e6, tokens_per_step, last);
        }
    }
    double secs = (ddp_time_us() - t_start) / 1e6;
    if (tty) {
        clear_progress();
        fflush(stdout);
    }
    /* Medians per rank, gathered: rank r's synchronised step, no_sync step, finalize wait and
     * peak RSS. A faster rank gets ahead in no_sync steps and waits for the slower one in the
     * next synchronised step, which its own difference would count as communication; the
     * slowest rank (largest no_sync median) never waits in a no_sync step, so its difference
     * is the communication alone (as bench/pytorch_ddp.py takes it for PyTorch). */
    double mine[4] = {median(sync_ms, nsync), median(nosync_ms, nnosync),
                      median(wait_ms, nsync), peak_rss_mib()};
    double *every = calloc(4 * (size_t)t->world, sizeof(double));
    if (!every) fail("out of memory");
    check(ddp_group_allgather(t->group, mine, every, 4, DDP_F64),
          "gathering every rank's step medians and peak RSS");
    int slowest = 0;
    for (int q = 1; q < t->world; q++)
        if (every[4 * q + 1] > every[4 * slowest + 1]) slowest = q;
    double nosync_exposed_ms = nnosync ? every[4 * slowest] - every[4 * slowest + 1] : 0;
    double step_ms = 0, wait_min = 0; /* step: the slowest rank's median; wait: the smallest */
    for (int q = 0; q < t->world; q++) {
        if (every[4 * q] > step_ms) step_ms = every[4 * q];
        if (q == 0 || every[4 * q + 2] < wait_min) wait_min = every[4 * q + 2];
    }
    if (metrics) fclose(metrics);
    /* Memory per rank, before anything below gathers the whole model. */
    double mem[MEM_N], *mem_all = calloc(MEM_N * (size_t)t->world, sizeof(double));
    if (!mem_all) fail("out of memory");
    memory_ledger(t, mem);
    check(ddp_group_allgather(t->group, mem, mem_all, MEM_N, DDP_F64),
          "gathering every rank's memory");
    const double acts_mib = (double)(m->acts_numel + m->dacts_numel) * 4.0 / 1048576.0;
    if (t->fsdp) { /* the checksum and the samples need the whole model: gathered once, at the end */
        m->params = malloc(m->nparams * sizeof(float));
        if (!m->params) fail("out of memory gathering the model");
        void **ptrs = tensor_pointers(m, m->params);
        for (size_t u = 0; u <= o->model.layers; u++) {
            check(ddp_fsdp_gather(t->fsdp, u), "gathering the model");
            for (size_t i = 0; i < m->ntensors; i++) {
                if (unit_of_tensor(m, i) != u) continue;
                void *src;
                check(ddp_fsdp_param(t->fsdp, i, &src), "ddp_fsdp_param");
                memcpy(ptrs[i], src, m->tensors[i].numel * sizeof(float));
            }
            check(ddp_fsdp_release(t->fsdp, u), "releasing the model");
        }
        free(ptrs);
        for (size_t i = 0; i < m->ntensors; i++) m->param_at[i] = m->params + m->tensors[i].offset;
        m->layer_hook = NULL;
    }
    if (o->print_losses) { /* every rank: the test compares them */
        printf("rank %d params fnv %016llx\n", t->rank, (unsigned long long)params_fnv(m));
        fflush(stdout);
    }
    if (t->rank == 0) {
        double tokens = (double)(end_step - first_step) * (double)o->accumulate * (double)o->batch * (double)T;
        char exposed[64] = "not measured (no Reducer)";
        if (t->reducer)
            snprintf(exposed, sizeof exposed, "%.2f ms/step on rank 0",
                     synced_steps ? exposed_sum / 1000.0 / (double)synced_steps : 0.0);
        printf("gpt: %zu steps in %.1f s: %.0f tokens/s (%d rank%s), exposed communication %s; "
               "final loss %.4f, validation %.4f\n",
               end_step - first_step, secs, tokens / secs, t->world, t->world == 1 ? "" : "s",
               exposed, loss, val_loss);
        printf("gpt: median step %.2f ms over %zu steps after %zu (slowest rank): %.0f tokens/s; "
               "peak RSS",
               step_ms, nsync, o->bench_warmup, step_ms > 0 ? tokens_per_step * 1000.0 / step_ms : 0.0);
        for (int q = 0; q < t->world; q++) printf("%s %.1f", q ? "," : "", every[4 * q + 3]);
        printf(" MiB (rank 0%s)\n", t->world > 1 ? ", 1, ..." : "");
        for (int q = 0; q < t->world; q++) {
            const double *b = mem_all + MEM_N * q;
            printf("gpt: memory rank %d (--zero %d): parameters %.3f MiB, gradients %.3f, "
                   "optimizer state %.3f, gathered peak %.3f, unit gradients peak %.3f; model "
                   "state %.3f MiB (the whole model is %.3f MiB of f32 parameters); activations "
                   "%.3f\n",
                   q, o->zero, b[MEM_PARAMS] / 1048576.0, b[MEM_GRADS] / 1048576.0,
                   b[MEM_OPTIM] / 1048576.0, b[MEM_GATHERED] / 1048576.0,
                   b[MEM_GRADS_FULL] / 1048576.0,
                   b[MEM_TOTAL] / 1048576.0, (double)m->nparams * 4.0 / 1048576.0, acts_mib);
        }
        if (nnosync)
            printf("gpt: --bench-nosync: synchronised %.2f ms, no_sync %.2f ms on the slowest "
                   "rank (%d): exposed communication %.2f ms/step\n",
                   every[4 * slowest], every[4 * slowest + 1], slowest, nosync_exposed_ms);
        double timed = run_steps > o->bench_warmup ? (double)(run_steps - o->bench_warmup)
                                                   : (double)run_steps;
        if (o->profile && timed > 0) {
            double total = optim_seconds;
            for (int p = 0; p < GPT_NPHASES; p++) total += m->phase_seconds[p];
            printf("gpt: profile (rank 0, ms per step over %.0f steps):", timed);
            for (int p = 0; p < GPT_NPHASES; p++)
                printf(" %s %.2f,", gpt_phase_names[p], m->phase_seconds[p] * 1000.0 / timed);
            printf(" adamw %.2f; total %.2f\n", optim_seconds * 1000.0 / timed,
                   total * 1000.0 / timed);
        }
        if (o->json) {
            printf("{\"impl\":\"libddp-gpt\",\"world_size\":%d,\"transport\":\"%s\","
                   "\"layers\":%zu,\"heads\":%zu,\"channels\":%zu,\"context\":%zu,"
                   "\"global_batch\":%zu,\"accumulate\":%zu,\"steps\":%zu,\"timed_steps\":%zu,"
                   "\"tokens_per_sec\":%.1f,\"wall_tokens_per_sec\":%.1f,\"step_ms_median\":%.3f,"
                   "\"exposed_wait_ms_median\":%.3f",
                   t->world, ddp_group_transport(t->group), o->model.layers, o->model.heads,
                   o->model.channels, T, o->batch, o->accumulate, run_steps, nsync,
                   step_ms > 0 ? tokens_per_step * 1000.0 / step_ms : 0.0, tokens / secs,
                   step_ms, wait_min);
            if (nnosync)
                printf(",\"nosync_step_ms_median\":%.3f,\"nosync_exposed_ms\":%.3f,"
                       "\"slowest_rank\":%d",
                       every[4 * slowest + 1], nosync_exposed_ms, slowest);
            printf(",\"peak_rss_mib\":[");
            for (int q = 0; q < t->world; q++) printf("%s%.1f", q ? "," : "", every[4 * q + 3]);
            printf("],\"zero\":%d,\"memory_mib\":[", o->zero);
            for (int q = 0; q < t->world; q++) {
                printf("%s{", q ? "," : "");
                for (int k = 0; k < MEM_N; k++)
                    printf("%s\"%s\":%.3f", k ? "," : "", mem_names[k],
                           mem_all[MEM_N * q + k] / 1048576.0);
                printf("}");
            }
            printf("],\"activations_mib\":%.3f", acts_mib);
            if (o->profile && timed > 0) {
                printf(",\"profile_ms_per_step\":{");
                for (int p = 0; p < GPT_NPHASES; p++)
                    printf("\"%s\":%.3f,", gpt_phase_names[p], m->phase_seconds[p] * 1000.0 / timed);
                printf("\"adamw\":%.3f}", optim_seconds * 1000.0 / timed);
            }
            if (isfinite(loss))
                printf(",\"final_loss\":%.6f}\n", loss);
            else
                printf(",\"final_loss\":null}\n");
        }
        uint64_t rng = o->seed ^ 0x5A17ull;
        static const char *const prompts[] = {"The ", "A man ", "Love is "};
        char *out = malloc(o->sample_len + 1);
        for (size_t s = 0; s < o->samples && out; s++) {
            const char *p = prompts[s % 3];
            gpt_generate(m, p, o->sample_len, &rng, out);
            printf("--- sample %zu ---\n%s%s\n", s + 1, p, out);
        }
        free(out);
        fflush(stdout);
    }
    ddp_reducer_destroy(t->reducer);
    if (t->trace) check(ddp_trace_close(t->trace), "closing the trace");
    ddp_optim_destroy(t->optim);
    ddp_zero_destroy(t->zero);
    ddp_fsdp_destroy(t->fsdp);
    free(mem_all);
    if (t->grads) check(ddp_group_free_buffer(t->group, t->grads), "freeing the gradient block");
    ddp_group_destroy(t->group);
    if (t->local_store) ddp_store_destroy(t->local_store);
    free(params);
    free(grad_ptrs);
    free(groups_of);
    if (optim_params != params) free(optim_params);
    if (optim_grads != grad_ptrs) free(optim_grads);
    free(t->half_params);
    free(t->half_grads);
    free(t->tok);
    free(t->tgt);
    free(t->perm);
    free(sync_ms);
    free(nosync_ms);
    free(wait_ms);
    free(every);
    gpt_destroy(m);
    gpt_text_free(&t->train);
    gpt_text_free(&t->val);
    return 0;
}
