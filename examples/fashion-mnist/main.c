/* fashion-mnist: data-parallel training of an MLP on Fashion-MNIST with libddp.
 *
 * Every rank holds the whole model. Each epoch, every rank draws the same permutation from
 * (seed, epoch) and takes its contiguous share of each global batch (DistributedSampler), so N
 * ranks with global batch B see exactly the samples one rank with batch B sees. Backward reports
 * each layer's gradients to the Reducer as soon as they are written (last layer first), which
 * starts their allreduce while the earlier layers are still being differentiated; after finalize
 * every rank holds the same averaged gradient and takes the same optimizer step.
 *
 * Run it alone (a 1-rank group) or under the launcher: build/ddprun -n 2 build/fashion-mnist. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "ddp/ddp.h"
#ifdef FM_HAVE_POWERSGD
#include "ddp/powersgd.h"
#endif
#include "openblas_kernels.h"
#include "trainer.h"

#ifdef FM_HAVE_OPENBLAS_THREADS
void openblas_set_num_threads(int num_threads);
#endif

#define DEFAULT_DATA_DIR "/usr/share/datasets/fashion-mnist"
#define EVAL_CHUNK 500

enum { FM_HOOK_ALLREDUCE = 0, FM_HOOK_FP16, FM_HOOK_BF16, FM_HOOK_POWERSGD };
static const char *const fm_hook_names[] = {"allreduce", "fp16", "bf16", "powersgd"};

typedef struct options {
    const char *data_dir;
    size_t hidden, batch, epochs, max_steps, subset, synthetic, accumulate, log_every;
    size_t drop_last; /* --drop-last 0|1: 0 trains on the remainder too (uneven inputs) */
    size_t trace_steps, warmup;
    uint64_t seed;
    int optim; /* FM_OPTIM_* */
    int legacy;
    double lr, momentum, weight_decay, beta1, beta2, eps, bucket_mb;
    size_t grad_blocks; /* row blocks per weight gradient, each reported when computed */
    double piece_mb;    /* the Reducer's piece size; < 0: 1 MiB with grad_blocks > 1, else 0 */
    const char *checkpoint, *resume, *trace;
    int hook; /* FM_HOOK_* */
    int psgd_rank;
    size_t psgd_start;
    int json, print_checksum, print_losses, no_eval, bench_nosync;
    int zero, zero_overlap; /* --zero 0|1|2, --zero-overlap: the ZeRO optimizer (ddp/shard.h) */
    int zero_fused;         /* --zero-fused: ZeRO-2 with its fused step (config.fused) */
    int zero_auto;          /* no --zero given: resolve_zero_default decides once the world is known */
    int zero_whole;         /* --zero-partition params: ZeRO-1 by whole parameters (else chunks) */
    size_t save_every;      /* --save-every K: a checkpoint every K optimizer steps (0: off) */
    int resume_auto;        /* --resume auto: the --checkpoint file when it exists */
    const char *metrics;    /* --metrics FILE: one CSV row per optimizer step (rank 0) */
    int lr_schedule;        /* FM_SCHEDULE_* */
    size_t warmup_steps;
    double clip_grad;       /* > 0: the global gradient norm is clipped to it */
    int param_bf16;         /* --param-dtype bf16: the optimizer updates bf16 parameters */
    /* --bench-optim-share R/N (timing only, one rank): the optimizer steps only chunk R of N of
     * every parameter, the share ZeRO-1 in chunks gives rank R of N, without any exchange.
     * share_count 0: off. */
    size_t share_index, share_count;
} options_t;

/* What --metrics records of a step until its global loss is known (flush_losses). */
typedef struct step_metrics {
    double lr, step_ms, exposed_ms;
} step_metrics_t;

/* Where a step's time goes (--json's "phase_ms"): the trainer's own clock around each part.
 * data: gathering this rank's samples; forward; backward (the Reducer's grad_ready calls
 * included); finalize: ddp_reducer_finalize (the wait for the buckets' allreduces, the legacy
 * allreduce); optimizer: the update and, under ZeRO, the parameter exchange. "other" in the
 * report is the step minus these. */
enum { PH_DATA, PH_FORWARD, PH_BACKWARD, PH_FINALIZE, PH_OPTIMIZER, PH_COUNT };
static const char *const fm_phase_names[PH_COUNT] = {"data", "forward", "backward", "finalize",
                                                     "optimizer"};

enum { FM_SCHEDULE_CONSTANT = 0, FM_SCHEDULE_COSINE = 1, FM_SCHEDULE_LINEAR = 2 };
static const char *const fm_schedule_names[] = {"constant", "cosine", "linear"};
static const char *const fm_optim_names[] = {"sgd", "adam", "adamw"};

typedef struct trainer {
    options_t o;
    int rank, world;
    ddp_group_t *group;
    ddp_store_t *local_store; /* the in-memory store of a run without a launcher */
    ddp_reducer_t *reducer;
    ddp_legacy_t *legacy;
    ddp_zero_t *zero; /* --zero: replaces fm_optim_step (opt then holds no state) */
    int zero_sync;    /* stage 2: this micro-step hands its gradients to ZeRO */
    ddp_trace_t *trace;
    ddp_half_hook_state_t *half_hook; /* --hook fp16|bf16 */
    void *powersgd;                   /* --hook powersgd: a ddp_powersgd_state_t */
    fm_mlp_t model;
    fm_optim_t opt;
    /* libddp's optimizer when not ZeRO; with bf16 parameters the optimizer
     * updates half_params (bf16 copies of the model's values, which the model then takes) from
     * half_grads (the gradients rounded to bf16). */
    ddp_optim_t *lib_opt;
    size_t share_offset[FM_NPARAMS]; /* --bench-optim-share: where the stepped chunk starts */
    uint16_t *half_params[FM_NPARAMS], *half_grads[FM_NPARAMS];
    fm_extra_t resume_extra; /* --resume: optimizer and hook state, loaded once they exist */
    const char *resumed_from; /* the checkpoint this run continued from, or NULL */
    float *grads[FM_NPARAMS];     /* where this iteration's gradients are */
    float *own_grads[FM_NPARAMS]; /* legacy and ZeRO-2: our gradient buffers */
    fm_dataset_t train, test;
    size_t local_batch;
    /* backward callback state */
    ddp_status_t status;
    int tracing;
    double mark_us;
    /* loss bookkeeping: local step losses not yet averaged over ranks */
    double *pending;
    size_t npending, pending_first_step;
    step_metrics_t *pending_metrics; /* --metrics: beside pending, one per step */
    FILE *metrics;                   /* --metrics on rank 0 */
    uint64_t kill_at_step;           /* tests only: FM_TEST_KILL_AT_STEP (0: never) */
    fm_progress_t progress;
    /* the epoch's shape and the step's input buffers */
    size_t per_step;        /* samples per optimizer step: batch x accumulate */
    size_t steps_per_epoch; /* whole optimizer steps in one pass over the training set */
    float *xbuf;
    uint8_t *ybuf;
    uint32_t *perm;
    /* --drop-last 0: the parameters before the step a rank joins in, and whether it did */
    float *join_params[FM_NPARAMS];
    int joined;
    int64_t seen[3]; /* this epoch's samples on this rank: count, sum and sum of squares of indices */
    double phase_us[PH_COUNT]; /* this step's time per phase (micro-steps summed) */
} trainer_t;

/* Timing of a run, over the steps after the warm-up. Per-step samples are kept for medians,
 * which a busy machine's stalls do not drag. */
typedef struct run_stats {
    double timed_us, exposed_us;
    size_t timed_steps, run_steps;
    size_t sample_cap;
    double *step_samples, *exposed_samples;
    size_t nosync_cap, nosync_steps; /* --bench-nosync: the steps without communication */
    double *nosync_samples;
    double *phase_samples[PH_COUNT + 1]; /* per synchronised timed step; [PH_COUNT]: other */
    double cpu_us; /* the process's CPU time (every thread) over the synchronised timed steps */
    int stopped; /* --max-steps reached */
} run_stats_t;

static const char *prog = "fashion-mnist";

/* This process's CPU time, every thread's (the Reducer's progress thread too), in microseconds:
 * on a shared machine a step's wall time also holds the time other programs had the CPU, its
 * CPU time does not. */
static double cpu_time_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: %s [options]\n"
        "Trains an MLP 784-h-h-10 on Fashion-MNIST, data-parallel over the ranks started by\n"
        "ddprun (build/ddprun -n 2 %s ...) or as one process without a launcher.\n"
        "\n"
        "data and model:\n"
        "  --data DIR          directory with {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz\n"
        "                      (default " DEFAULT_DATA_DIR ")\n"
        "  --subset N          use only the first N training samples (quick tests)\n"
        "  --synthetic N       N random samples instead of the files (benchmarks; no eval)\n"
        "  --hidden N          hidden width (default 1024)\n"
        "  --seed N            initialisation and shuffling seed (default 1)\n"
        "training:\n"
        "  --epochs N          epochs (default 3)\n"
        "  --max-steps N       stop after N optimizer steps in total (0: no limit)\n"
        "  --batch N           GLOBAL batch per micro-step, split evenly over ranks (default 128)\n"
        "  --drop-last 0|1     1 (default): an epoch is the whole global batches only; 0: the\n"
        "                      last, partial batch too, each rank its share of it; a rank\n"
        "                      with none joins (ddp_reducer_join) and the average is over\n"
        "                      the real samples\n"
        "  --accumulate K      K micro-steps per optimizer step; the first K-1 skip\n"
        "                      communication (no_sync), so the effective batch is K*batch\n"
        "  --optim sgd|adam|adamw   optimiser (default adam), libddp's (ddp/shard.h); adamw\n"
        "                      has decoupled weight decay on the weights only (biases: none)\n"
        "  --lr F              (peak) learning rate (default 1e-3 for adam/adamw, 0.05 for sgd)\n"
        "  --lr-schedule constant|cosine|linear   learning rate per step after the warmup:\n"
        "                      constant, cosine decay to 0, or linear decay to 0 at the end of\n"
        "                      --epochs (Hugging Face's schedules; default constant)\n"
        "  --warmup-steps N    linear warmup from 0 over the first N steps (default 0)\n"
        "  --clip-grad NORM    clip the global gradient norm to NORM (clip_grad_norm_; 0: off)\n"
        "  --param-dtype f32|bf16   bf16: the optimizer keeps f32 master weights and the model\n"
        "                      computes with their bf16 rounding (default f32)\n"
        "  --momentum F        SGD momentum (default 0.9)\n"
        "  --wd F              weight decay (default 0; sgd/adam: added to the gradient)\n"
        "  --beta1 F --beta2 F --eps F   Adam (defaults 0.9, 0.999, 1e-8)\n"
        "  --sync reducer|legacy   bucketed Reducer overlapping backward (default) or one\n"
        "                      flat-buffer allreduce after backward\n"
        "  --bucket-mb F       Reducer bucket cap in MiB (default 25)\n"
        "  --grad-blocks K     compute each weight gradient in K row blocks and hand each to\n"
        "                      the Reducer as it is done (ddp_reducer_grad_ready_rows), so a\n"
        "                      large layer's reduction starts during its own backward;\n"
        "                      same bits for every K in 1..8 (default 1: on this 2-core\n"
        "                      machine the pieces cost more than they hide)\n"
        "  --piece-mb F        Reducer piece size in MiB: a bucket is reduced in pieces as\n"
        "                      their rows are ready (0: whole buckets; default 1 with\n"
        "                      --grad-blocks > 1, else 0)\n"
        "  --hook allreduce|fp16|bf16|powersgd[:rank=R,start=S]   the Reducer's comm hook:\n"
        "                      plain (default), buckets in half precision, or PowerSGD of\n"
        "                      rank R (default 1) from step S (default 10)\n"
        "  --zero 0|1|2        ZeRO optimizer: its state sharded over the ranks; 0: every rank\n"
        "                      updates every parameter, 1: each rank updates its parameters\n"
        "                      after the Reducer, 2: no Reducer, gradients reduce-scattered\n"
        "                      (1 and 2 not with --sync legacy, --hook other than allreduce,\n"
        "                      --bench-nosync, --drop-last 0). Default: 1 on several ranks\n"
        "                      when none of those is given (the same bits as 0), else 0\n"
        "  --zero-partition chunks|params   how ZeRO-1 shares the parameters: every parameter\n"
        "                      cut in one chunk per rank, allgathered after the update\n"
        "                      (default: balanced), or whole parameters, largest first,\n"
        "                      each broadcast from its owner (PyTorch's)\n"
        "  --zero-overlap      ZeRO 1 with each bucket's update computed on its owner as soon\n"
        "                      as its allreduce ends (implies --zero 1; not with --clip-grad,\n"
        "                      --param-dtype bf16 or --resume: resume it with --zero 1)\n"
        "  --zero-fused        ZeRO 2 with its fused step: each parameter averaged, stepped\n"
        "                      piece by piece on its owner and written into every rank's\n"
        "                      copy in one collective (implies --zero 2; not --clip-grad)\n"
        "checkpoints:\n"
        "  --checkpoint FILE   rank 0 saves here after each epoch and when --max-steps stops;\n"
        "                      ZeRO's sharded optimizer state is gathered into it, and with\n"
        "                      --hook powersgd every rank's PowerSGD state (residual, Q)\n"
        "  --resume FILE       continue from FILE; the result equals an uninterrupted run\n"
        "                      (with ZeRO at any stage; PowerSGD on the same world size)\n"
        "  --resume auto       continue from the --checkpoint file if it exists, else start\n"
        "                      fresh (for ddprun --max-restarts: a restarted job goes on)\n"
        "  --save-every K      also save every K optimizer steps (needs --checkpoint)\n"
        "output:\n"
        "  --json              print one final JSON line with the results\n"
        "  --metrics FILE      rank 0 writes one CSV row per optimizer step: step, epoch,\n"
        "                      loss (global), lr, samples/s, step ms, exposed comm ms\n"
        "                      (rows come in groups of --log-every steps; a resumed run\n"
        "                      keeps the rows up to its checkpoint and appends)\n"
        "  --log-every N       log line every N steps when stdout is not a terminal\n"
        "  --print-losses      print every step's global loss (\"loss step=S value=L\")\n"
        "  --print-checksum    each rank prints a checksum of its parameters at the end\n"
        "  --trace FILE        Chrome trace of the first --trace-steps steps (default 5);\n"
        "                      with several ranks FILE gets .rankR inserted before .json\n"
        "  --warmup N          steps left out of the timing (default 3)\n"
        "  --no-eval           skip the test-set evaluation\n"
        "  --bench-nosync      timing only: every other step skips communication (no_sync),\n"
        "                      so the JSON's nosync_step_ms_median is the local step measured\n"
        "                      in the same run (parameters then differ across ranks)\n"
        "  --bench-optim-share R/N   timing only, one rank: the optimizer steps chunk R of N\n"
        "                      of every parameter (what ZeRO-1 in chunks gives rank R of N)\n"
        "                      and leaves the rest; N such processes at batch B/N at once are\n"
        "                      N ranks' work without communication (bench/demo_scaling.sh)\n"
        "  --help              this text\n"
        "exit status: 0 success, 1 runtime error, 2 bad option\n",
        prog, prog);
}

static void die_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see --help)\n");
    exit(2);
}

static size_t parse_size(const char *opt, const char *v, size_t min)
{
    char *end = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || x < min)
        die_usage("%s: '%s' is not an integer >= %zu", opt, v, min);
    return (size_t)x;
}

static double parse_double(const char *opt, const char *v, double min, double max)
{
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= min && x <= max))
        die_usage("%s: '%s' is not a number in [%g, %g]", opt, v, min, max);
    return x;
}


/* --hook allreduce|fp16|bf16|powersgd[:rank=R,start=S] */
static void parse_hook(options_t *o, const char *val)
{
    o->psgd_rank = 1;
    o->psgd_start = 10;
    if (!strcmp(val, "allreduce")) {
        o->hook = FM_HOOK_ALLREDUCE;
    } else if (!strcmp(val, "fp16")) {
        o->hook = FM_HOOK_FP16;
    } else if (!strcmp(val, "bf16")) {
        o->hook = FM_HOOK_BF16;
    } else if (!strncmp(val, "powersgd", 8) && (val[8] == '\0' || val[8] == ':')) {
        o->hook = FM_HOOK_POWERSGD;
        for (const char *p = val[8] ? val + 9 : val + 8; *p;) {
            const char *end = strchr(p, ',');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            char item[64], *eq;
            if (len == 0 || len >= sizeof item) die_usage("--hook: bad item in '%s'", val);
            memcpy(item, p, len);
            item[len] = '\0';
            if (!(eq = strchr(item, '='))) die_usage("--hook: '%s' is not key=value", item);
            *eq = '\0';
            if (!strcmp(item, "rank"))
                o->psgd_rank = (int)parse_size("--hook powersgd rank", eq + 1, 1);
            else if (!strcmp(item, "start"))
                o->psgd_start = parse_size("--hook powersgd start", eq + 1, 0);
            else
                die_usage("--hook: unknown PowerSGD setting '%s' (rank, start)", item);
            p = end ? end + 1 : p + len;
        }
        if (o->psgd_rank > 4096) die_usage("--hook: rank %d is larger than 4096", o->psgd_rank);
#ifndef FM_HAVE_POWERSGD
        die_usage("--hook powersgd: this build has no libddp_powersgd (it needs CBLAS)");
#endif
    } else {
        die_usage("--hook: '%s' is not allreduce, fp16, bf16 or powersgd[:rank=R,start=S]", val);
    }
}
static void parse_options(int argc, char **argv, options_t *o)
{
    memset(o, 0, sizeof *o);
    o->data_dir = DEFAULT_DATA_DIR;
    o->hidden = 1024;
    o->batch = 128;
    o->epochs = 3;
    o->accumulate = 1;
    o->drop_last = 1;
    o->seed = 1;
    o->optim = FM_OPTIM_ADAM;
    o->lr = -1;
    o->momentum = 0.9;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->bucket_mb = 25;
    o->grad_blocks = 1;
    o->piece_mb = -1;
    o->zero_auto = 1;
    o->trace_steps = 5;
    o->warmup = 3;
    for (int i = 1; i < argc; i++) {
        char name[64];
        const char *arg = argv[i], *val = NULL;
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (strncmp(arg, "--", 2) != 0) die_usage("unexpected argument '%s'", arg);
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        if (len >= sizeof name) die_usage("unknown option '%s'", arg);
        memcpy(name, arg, len);
        name[len] = '\0';
        /* flags */
        int *flag = !strcmp(name, "--json")             ? &o->json
                    : !strcmp(name, "--print-checksum") ? &o->print_checksum
                    : !strcmp(name, "--print-losses")   ? &o->print_losses
                    : !strcmp(name, "--no-eval")        ? &o->no_eval
                    : !strcmp(name, "--bench-nosync")   ? &o->bench_nosync
                    : !strcmp(name, "--zero-overlap")   ? &o->zero_overlap
                    : !strcmp(name, "--zero-fused")     ? &o->zero_fused
                                                        : NULL;
        if (flag) {
            if (eq) die_usage("%s takes no value", name);
            *flag = 1;
            continue;
        }
        static const char *const valued[] = {
            "--data",   "--hidden",      "--batch",      "--epochs",     "--max-steps",
            "--subset", "--synthetic",   "--accumulate", "--seed",       "--optim",
            "--lr",     "--momentum",    "--wd",         "--beta1",      "--beta2",
            "--eps",    "--sync",        "--bucket-mb",  "--checkpoint", "--resume",
            "--trace",  "--trace-steps", "--log-every",  "--warmup",     "--hook",
            "--zero",   "--grad-blocks", "--piece-mb",   "--lr-schedule", "--warmup-steps",
            "--clip-grad", "--param-dtype", "--save-every", "--metrics", "--drop-last",
            "--zero-partition", "--bench-optim-share"};
        int known = 0;
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            known |= !strcmp(name, valued[k]);
        if (!known) die_usage("unknown option '%s'", name);
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            die_usage("%s needs a value", name);

        if (!strcmp(name, "--data"))
            o->data_dir = val;
        else if (!strcmp(name, "--hidden"))
            o->hidden = parse_size(name, val, 1);
        else if (!strcmp(name, "--batch"))
            o->batch = parse_size(name, val, 1);
        else if (!strcmp(name, "--epochs"))
            o->epochs = parse_size(name, val, 1);
        else if (!strcmp(name, "--max-steps"))
            o->max_steps = parse_size(name, val, 0);
        else if (!strcmp(name, "--subset"))
            o->subset = parse_size(name, val, 1);
        else if (!strcmp(name, "--synthetic"))
            o->synthetic = parse_size(name, val, 1);
        else if (!strcmp(name, "--drop-last")) {
            o->drop_last = parse_size(name, val, 0);
            if (o->drop_last > 1) die_usage("--drop-last takes 0 or 1, not %zu", o->drop_last);
        } else if (!strcmp(name, "--accumulate"))
            o->accumulate = parse_size(name, val, 1);
        else if (!strcmp(name, "--seed"))
            o->seed = parse_size(name, val, 0);
        else if (!strcmp(name, "--log-every"))
            o->log_every = parse_size(name, val, 1);
        else if (!strcmp(name, "--trace-steps"))
            o->trace_steps = parse_size(name, val, 1);
        else if (!strcmp(name, "--warmup"))
            o->warmup = parse_size(name, val, 0);
        else if (!strcmp(name, "--lr"))
            o->lr = parse_double(name, val, 0, 1e3);
        else if (!strcmp(name, "--momentum"))
            o->momentum = parse_double(name, val, 0, 1);
        else if (!strcmp(name, "--wd"))
            o->weight_decay = parse_double(name, val, 0, 1e3);
        else if (!strcmp(name, "--beta1"))
            o->beta1 = parse_double(name, val, 0, 0.999999);
        else if (!strcmp(name, "--beta2"))
            o->beta2 = parse_double(name, val, 0, 0.999999999);
        else if (!strcmp(name, "--eps"))
            o->eps = parse_double(name, val, 0, 1);
        else if (!strcmp(name, "--grad-blocks"))
            o->grad_blocks = parse_size(name, val, 1);
        else if (!strcmp(name, "--piece-mb"))
            o->piece_mb = parse_double(name, val, 0, 4096);
        else if (!strcmp(name, "--bucket-mb"))
            o->bucket_mb = parse_double(name, val, 0.001, 4096);
        else if (!strcmp(name, "--checkpoint"))
            o->checkpoint = val;
        else if (!strcmp(name, "--resume"))
            o->resume = val, o->resume_auto = !strcmp(val, "auto");
        else if (!strcmp(name, "--save-every"))
            o->save_every = parse_size(name, val, 1);
        else if (!strcmp(name, "--metrics"))
            o->metrics = val;
        else if (!strcmp(name, "--trace"))
            o->trace = val;
        else if (!strcmp(name, "--warmup-steps"))
            o->warmup_steps = parse_size(name, val, 0);
        else if (!strcmp(name, "--clip-grad"))
            o->clip_grad = parse_double(name, val, 0, 1e9);
        else if (!strcmp(name, "--lr-schedule")) {
            int found = 0;
            for (int k = 0; k < 3; k++)
                if (!strcmp(val, fm_schedule_names[k])) {
                    o->lr_schedule = k;
                    found = 1;
                }
            if (!found) die_usage("--lr-schedule: '%s' is not constant, cosine or linear", val);
        } else if (!strcmp(name, "--param-dtype")) {
            if (!strcmp(val, "f32"))
                o->param_bf16 = 0;
            else if (!strcmp(val, "bf16"))
                o->param_bf16 = 1;
            else
                die_usage("--param-dtype: '%s' is neither f32 nor bf16", val);
        } else if (!strcmp(name, "--optim")) {
            if (!strcmp(val, "sgd"))
                o->optim = FM_OPTIM_SGD;
            else if (!strcmp(val, "adam"))
                o->optim = FM_OPTIM_ADAM;
            else if (!strcmp(val, "adamw"))
                o->optim = FM_OPTIM_ADAMW;
            else
                die_usage("--optim: '%s' is not sgd, adam or adamw", val);
        } else if (!strcmp(name, "--hook")) {
            parse_hook(o, val);
        } else if (!strcmp(name, "--zero")) {
            if (strcmp(val, "0") && strcmp(val, "1") && strcmp(val, "2"))
                die_usage("--zero: '%s' is not 0, 1 or 2", val);
            o->zero = val[0] - '0';
            o->zero_auto = 0;
        } else if (!strcmp(name, "--zero-partition")) {
            if (!strcmp(val, "chunks"))
                o->zero_whole = 0;
            else if (!strcmp(val, "params"))
                o->zero_whole = 1;
            else
                die_usage("--zero-partition: '%s' is neither chunks nor params", val);
        } else if (!strcmp(name, "--bench-optim-share")) {
            char *end = NULL;
            errno = 0;
            unsigned long long r = strtoull(val, &end, 10), n = 0;
            int ok = !errno && end != val && *end == '/' && val[0] != '-';
            if (ok) {
                const char *nv = end + 1;
                n = strtoull(nv, &end, 10);
                ok = !errno && end != nv && !*end && nv[0] != '-' && n >= 1 && n <= 4096 && r < n;
            }
            if (!ok)
                die_usage("--bench-optim-share: '%s' is not R/N with 0 <= R < N <= 4096", val);
            o->share_index = (size_t)r;
            o->share_count = (size_t)n;
        } else if (!strcmp(name, "--sync")) {
            if (!strcmp(val, "reducer"))
                o->legacy = 0;
            else if (!strcmp(val, "legacy"))
                o->legacy = 1;
            else
                die_usage("--sync: '%s' is neither reducer nor legacy", val);
        }
        if (val && !*val) die_usage("%s: empty value", name);
    }
    if (o->lr < 0) o->lr = o->optim == FM_OPTIM_SGD ? 0.05 : 1e-3;
    if (o->save_every && !o->checkpoint) die_usage("--save-every needs --checkpoint FILE");
    if (o->resume_auto && !o->checkpoint)
        die_usage("--resume auto needs --checkpoint FILE (the file it continues from)");
    if (o->hidden > (1u << 16)) die_usage("--hidden: %zu is larger than 65536", o->hidden);
    if (o->batch > (1u << 20)) die_usage("--batch: %zu is larger than 1048576", o->batch);
    if (o->grad_blocks > FM_GRAD_TILES)
        die_usage("--grad-blocks: %zu is larger than %d (the row tiles of a weight gradient)",
                  o->grad_blocks, FM_GRAD_TILES);
    if (o->accumulate > 4096) die_usage("--accumulate: %zu is larger than 4096", o->accumulate);
    if (o->synthetic && o->subset) die_usage("--synthetic and --subset exclude each other");
    if (!o->drop_last) {
        /* The partial last batch goes through the Reducer's join (uneven inputs): one
         * synchronised micro-step, the Reducer's own averaging, the trainer's parameters. */
        const char *what = o->accumulate > 1              ? "--accumulate > 1"
                           : o->zero                      ? "--zero"
                           : o->legacy                    ? "--sync legacy"
                           : o->hook == FM_HOOK_POWERSGD  ? "--hook powersgd"
                           : o->bench_nosync              ? "--bench-nosync"
                           : o->param_bf16                ? "--param-dtype bf16"
                                                          : NULL;
        if (what) die_usage("--drop-last 0 cannot be combined with %s", what);
    }
    if (o->share_count) {
        /* A share of the update is a timing device: it needs the whole gradient and state of
         * its chunk and nothing else, so no ZeRO, no global norm, no bf16 copies, no
         * checkpoint of a state that covers part of the model. */
        const char *what = o->zero && !o->zero_auto ? "--zero"
                           : o->zero_overlap      ? "--zero-overlap"
                           : o->clip_grad > 0     ? "--clip-grad"
                           : o->param_bf16        ? "--param-dtype bf16"
                           : o->checkpoint        ? "--checkpoint"
                           : o->resume            ? "--resume"
                                                  : NULL;
        if (what) die_usage("--bench-optim-share cannot be combined with %s", what);
    }
    if (o->legacy && o->hook != FM_HOOK_ALLREDUCE)
        die_usage("--hook %s needs --sync reducer", fm_hook_names[o->hook]);
    /* ZeRO steps after the Reducer (or reduce-scatters itself), so neither the legacy allreduce,
     * a compressing hook nor unsynchronised steps fit. Its sharded state is gathered into the
     * checkpoint (consolidated), so checkpoints work at any stage. */
    if (o->zero_overlap && !o->zero_auto && o->zero != 1)
        die_usage("--zero-overlap is ZeRO-1's overlap mode: it cannot be combined with --zero %d",
                  o->zero);
    if (o->zero_overlap) o->zero = 1, o->zero_auto = 0;
    if (o->zero_fused) {
        /* Each chunk is stepped as soon as it is averaged: no global norm first. */
        const char *what = !o->zero_auto && o->zero != 2 ? "--zero other than 2"
                           : o->zero_overlap             ? "--zero-overlap"
                           : o->clip_grad > 0            ? "--clip-grad"
                                                         : NULL;
        if (what) die_usage("--zero-fused (ZeRO-2's fused step) cannot be combined with %s", what);
        o->zero = 2, o->zero_auto = 0;
    }
    if (o->zero_overlap) {
        /* The hook updates each bucket before the last gradient exists (no global norm), the
         * Reducer's buckets must hold the optimizer's dtype, and the partition is learned in the
         * first step, too late to load a state into. */
        const char *what = o->clip_grad > 0 ? "--clip-grad"
                           : o->param_bf16  ? "--param-dtype bf16"
                           : o->resume      ? "--resume (resume its checkpoint with --zero 1)"
                                            : NULL;
        if (what) die_usage("--zero-overlap cannot be combined with %s", what);
    }
    if (o->zero) {
        char hook[64];
        snprintf(hook, sizeof hook, "--hook %s (only allreduce)", fm_hook_names[o->hook]);
        const char *what = o->legacy                    ? "--sync legacy"
                           : o->bench_nosync            ? "--bench-nosync"
                           : o->hook != FM_HOOK_ALLREDUCE ? hook
                                                        : NULL;
        if (what)
            die_usage("--zero%s cannot be combined with %s (the optimizer state is sharded over "
                      "the ranks and ZeRO does its own communication)",
                      o->zero_overlap ? "-overlap" : "", what);
    }
}

/* ---- errors: print with the rank and exit 1 ------------------------------------------------ */

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

/* ---- process group ------------------------------------------------------------------------- */

static void setup_group(trainer_t *t)
{
    ddp_group_options_t gopt = DDP_GROUP_OPTIONS_INIT;
    ddp_status_t st = ddp_group_create_from_env(&gopt, &t->group);
    if (st == DDP_ERR_NOT_FOUND) {
        /* No launcher: one process, a 1-rank group over an in-memory store. */
        check(ddp_store_hash_create(&t->local_store), "creating the in-memory store");
        check(ddp_group_create(t->local_store, 0, 1, &gopt, &t->group), "creating a 1-rank group");
    } else {
        check(st, "creating the process group from the launcher's environment");
    }
    t->rank = ddp_group_rank(t->group);
    t->world = ddp_group_size(t->group);
    g_rank = t->rank;
}

/* --zero's default, once the world size is known: ZeRO-1 on several ranks - each rank steps
 * only its share of the parameters (half the optimizer's memory traffic per rank at 2) and the
 * result is bitwise the unsharded step's - unless an option asks for what ZeRO refuses; then,
 * and on one rank, the unsharded optimizer. */
static void resolve_zero_default(trainer_t *t)
{
    options_t *o = &t->o;
    if (!o->zero_auto) return;
    o->zero_auto = 0;
    o->zero = t->world > 1 && !o->legacy && o->hook == FM_HOOK_ALLREDUCE && !o->bench_nosync &&
                      o->drop_last
                  ? 1
                  : 0;
}

/* The learning rate's multiplier for optimizer step `step` (0-based), over --epochs. */
static double lr_factor(const trainer_t *t, uint64_t step)
{
    const options_t *o = &t->o;
    uint64_t total = (uint64_t)o->epochs * t->steps_per_epoch;
    switch (o->lr_schedule) {
    case FM_SCHEDULE_COSINE:
        return ddp_lr_warmup_cosine(step, o->warmup_steps, total, 1.0, 0.0);
    case FM_SCHEDULE_LINEAR:
        return ddp_lr_warmup_linear(step, o->warmup_steps, total, 1.0);
    default:
        return ddp_lr_warmup_constant(step, o->warmup_steps, 1.0);
    }
}

/* libddp's optimizer configuration; AdamW leaves the biases (group 1) undecayed. */
static const ddp_optim_group_t *adamw_groups(const options_t *o, ddp_optim_group_t g[2])
{
    g[0] = (ddp_optim_group_t){o->lr, o->weight_decay};
    g[1] = (ddp_optim_group_t){o->lr, 0.0};
    return g;
}

static const uint32_t fm_param_groups[FM_NPARAMS] = {0, 1, 0, 1, 0, 1}; /* W b W b W b */

static ddp_optim_config_t library_config(const options_t *o, ddp_optim_group_t groups[2])
{
    ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
    c.kind = o->optim == FM_OPTIM_ADAMW ? DDP_OPTIM_ADAMW
             : o->optim == FM_OPTIM_ADAM ? DDP_OPTIM_ADAM
                                         : DDP_OPTIM_SGD;
    c.lr = o->lr;
    c.momentum = o->optim == FM_OPTIM_SGD ? o->momentum : 0;
    c.beta1 = o->beta1;
    c.beta2 = o->beta2;
    c.eps = o->eps;
    c.weight_decay = o->weight_decay;
    c.max_grad_norm = o->clip_grad;
    if (o->optim == FM_OPTIM_ADAMW) {
        c.ngroups = 2;
        c.groups = adamw_groups(o, groups);
        c.param_groups = fm_param_groups;
    }
    return c;
}

static void to_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = ddp_f32_to_bf16(src[i]);
}

static void from_bf16(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = ddp_bf16_to_f32(src[i]);
}

/* ---- backward hook: hand finished gradients to the Reducer --------------------------------- */

static int on_layer_done(void *ctx, int layer)
{
    trainer_t *t = ctx;
    if (t->tracing) {
        static const char *const names[3] = {"backward: fc1 grads", "backward: fc2 grads",
                                             "backward: fc3 grads"};
        double now = ddp_time_us();
        ddp_trace_span(t->trace, names[layer], "compute", 0, t->mark_us, now);
        t->mark_us = now;
    }
    if (t->zero && t->o.zero == 2) { /* start the reduce-scatter of this layer's gradients */
        if (!t->zero_sync) return 0;
        for (int k = 1; k >= 0; k--) {
            size_t p = (size_t)(2 * layer + 1 - k);
            const void *g = t->grads[p];
            if (t->o.param_bf16) { /* ZeRO holds bf16 parameters: bf16 gradients */
                to_bf16(t->half_grads[p], t->grads[p], t->model.numel[p]);
                g = t->half_grads[p];
            }
            ddp_status_t st = ddp_zero_grad_ready(t->zero, p, g);
            if (st != DDP_OK) {
                t->status = st;
                return 1;
            }
        }
        return 0;
    }
    if (!t->reducer) return 0;
    /* weight first, then bias: W3, b3, W2, b2, W1, b1; row blocks already marked the weight */
    for (int k = t->o.grad_blocks > 1 ? 0 : 1; k >= 0; k--) {
        ddp_status_t st = ddp_reducer_grad_ready(t->reducer, (size_t)(2 * layer + 1 - k));
        if (st != DDP_OK) {
            t->status = st;
            return 1;
        }
    }
    return 0;
}

/* Rows [r0, r1) of layer `layer`'s weight gradient are computed: with the Reducer, their
 * pieces of the bucket can start reducing now (ZeRO-2 and legacy take whole tensors). */
static int on_rows_done(void *ctx, int layer, size_t r0, size_t r1)
{
    trainer_t *t = ctx;
    if (!t->reducer || t->o.grad_blocks <= 1) return 0;
    ddp_status_t st = ddp_reducer_grad_ready_rows(t->reducer, (size_t)(2 * layer), r0, r1);
    if (st != DDP_OK) {
        t->status = st;
        return 1;
    }
    return 0;
}

static void write_metrics_row(trainer_t *t, size_t step, double loss, size_t i);

/* ---- losses: local per-step values, averaged over ranks in one allreduce ------------------- */

static void flush_losses(trainer_t *t)
{
    if (t->world > 1)
        check(ddp_group_allreduce(t->group, t->pending, t->pending, t->npending, DDP_F64, DDP_SUM),
              "averaging step losses over ranks");
    for (size_t i = 0; i < t->npending; i++) {
        double loss = t->pending[i] / t->world;
        if (t->o.print_losses && t->rank == 0)
            printf("loss step=%zu value=%.9g\n", t->pending_first_step + i + 1, loss);
        if (t->metrics) write_metrics_row(t, t->pending_first_step + i + 1, loss, i);
        t->progress.loss_sum += loss;
        t->progress.loss_count++;
    }
    if (t->metrics) fflush(t->metrics);
    t->pending_first_step += t->npending;
    t->npending = 0;
}

/* ---- evaluation: each rank counts its share of the test set, the counts are summed --------- */

static double evaluate(trainer_t *t)
{
    if (t->o.no_eval || t->o.synthetic) return -1.0;
    size_t n = t->test.count;
    size_t lo = n * (size_t)t->rank / (size_t)t->world,
           hi = n * (size_t)(t->rank + 1) / (size_t)t->world;
    int64_t counts[2] = {(int64_t)fm_mlp_count_correct(&t->model, t->test.images + lo * FM_PIXELS,
                                                       t->test.labels + lo, hi - lo),
                         (int64_t)(hi - lo)};
    if (t->world > 1)
        check(ddp_group_allreduce(t->group, counts, counts, 2, DDP_I64, DDP_SUM),
              "summing test-set counts");
    return counts[1] ? (double)counts[0] / (double)counts[1] : 0.0;
}

/* ---- progress display (rank 0) -------------------------------------------------------------- */

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

static void show_progress(trainer_t *t, int tty, size_t epoch, size_t step, size_t steps,
                          double local_loss, double samples_per_sec, int final)
{
    static double last_draw = 0;
    double now = ddp_time_us();
    char eta[32];
    size_t left = steps - step;
    if (t->o.max_steps && t->o.max_steps - t->progress.global_step < left)
        left = t->o.max_steps - t->progress.global_step;
    format_eta(samples_per_sec > 0
                   ? (double)left * (double)(t->o.batch * t->o.accumulate) / samples_per_sec
                   : -1,
               eta, sizeof eta);
    if (tty && final) { /* the epoch's summary line takes the bar's place */
        printf("\r%*s\r", 110, "");
        fflush(stdout);
        return;
    }
    if (tty) {
        if (now - last_draw < 100e3) return;
        last_draw = now;
        char bar[31];
        size_t fill = steps ? step * 30 / steps : 0;
        for (size_t i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
        bar[30] = '\0';
        printf("\repoch %zu/%zu [%s] step %zu/%zu loss %.4f %.0f samples/s ETA %s ", epoch + 1,
               t->o.epochs, bar, step, steps, local_loss, samples_per_sec, eta);
        fflush(stdout);
    } else if (!final) {
        printf("epoch %zu/%zu step %zu/%zu loss %.4f (rank 0) %.0f samples/s ETA %s\n", epoch + 1,
               t->o.epochs, step, steps, local_loss, samples_per_sec, eta);
        fflush(stdout);
    }
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n values (sorts them); 0 for none. */
static double median(double *v, size_t n)
{
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- checkpoint --------------------------------------------------------------------------- */

static fm_hyper_t hyper_of(const options_t *o)
{
    fm_hyper_t h = {o->hidden,
                    o->batch,
                    o->accumulate,
                    o->synthetic ? o->synthetic : o->subset,
                    o->seed,
                    (uint64_t)o->optim,
                    (uint64_t)o->hook,
                    o->lr,
                    o->optim == FM_OPTIM_SGD ? o->momentum : 0,
                    o->weight_decay,
                    o->optim != FM_OPTIM_SGD ? o->beta1 : 0,
                    o->optim != FM_OPTIM_SGD ? o->beta2 : 0,
                    o->optim != FM_OPTIM_SGD ? o->eps : 0,
                    1, /* library_optim: libddp's optimizer, always (see build_model) */
                    (uint64_t)o->lr_schedule,
                    o->warmup_steps,
                    0,
                    o->clip_grad,
                    (uint64_t)o->param_bf16};
    return h;
}

/* A checkpoint's settings: the schedule's length counts only when it decays. */
static fm_hyper_t trainer_hyper(const trainer_t *t)
{
    fm_hyper_t h = hyper_of(&t->o);
    if (t->o.lr_schedule != FM_SCHEDULE_CONSTANT)
        h.schedule_steps = (uint64_t)t->o.epochs * t->steps_per_epoch;
    return h;
}

/* Every rank's blob of `bytes` to rank 0 (an allgather of the blobs padded to the largest, the
 * group having no gather): on rank 0, out[r] and out_bytes[r] for every rank. */
static void gather_blobs(trainer_t *t, const void *blob, size_t bytes, void **out,
                         size_t *out_bytes)
{
    int64_t mine = (int64_t)bytes, *sizes = calloc((size_t)t->world, sizeof *sizes);
    if (!sizes) fail("out of memory");
    check(ddp_group_allgather(t->group, &mine, sizes, 1, DDP_I64), "gathering state sizes");
    size_t max = 1;
    for (int r = 0; r < t->world; r++)
        if ((size_t)sizes[r] > max) max = (size_t)sizes[r];
    unsigned char *padded = calloc(1, max), *all = calloc((size_t)t->world, max);
    if (!padded || !all) fail("out of memory gathering %zu bytes of state per rank", max);
    memcpy(padded, blob, bytes);
    check(ddp_group_allgather(t->group, padded, all, max, DDP_U8), "gathering states");
    for (int r = 0; r < t->world && t->rank == 0; r++) {
        out[r] = malloc((size_t)sizes[r] ? (size_t)sizes[r] : 1);
        if (!out[r]) fail("out of memory");
        memcpy(out[r], all + (size_t)r * max, (size_t)sizes[r]);
        out_bytes[r] = (size_t)sizes[r];
    }
    free(padded);
    free(all);
    free(sizes);
}

/* Collective when the state is spread over the ranks (ZeRO's shards, PowerSGD's residuals):
 * every rank calls it; rank 0 writes. */
static void save_checkpoint(trainer_t *t)
{
    if (!t->o.checkpoint) return;
    char err[8192];
    fm_hyper_t h = trainer_hyper(t);
    fm_extra_t ex;
    memset(&ex, 0, sizeof ex);
    if (t->zero) {
        check(ddp_zero_consolidated_state_size(t->zero, &ex.optim_state_bytes),
              "sizing the optimizer state");
        if (t->rank == 0 && !(ex.optim_state = malloc(ex.optim_state_bytes)))
            fail("out of memory for the optimizer state");
        check(ddp_zero_state_consolidate(t->zero, 0, ex.optim_state,
                                         t->rank == 0 ? ex.optim_state_bytes : 0),
              "gathering the ZeRO optimizer state");
    } else if (t->lib_opt && t->rank == 0) {
        check(ddp_optim_state_size(t->lib_opt, &ex.optim_state_bytes),
              "sizing the optimizer state");
        if (!(ex.optim_state = malloc(ex.optim_state_bytes)))
            fail("out of memory for the optimizer state");
        check(ddp_optim_state_save(t->lib_opt, ex.optim_state, ex.optim_state_bytes),
              "saving the optimizer state");
    }
#ifdef FM_HAVE_POWERSGD
    if (t->powersgd) {
        size_t bytes;
        check(ddp_powersgd_state_size(t->powersgd, &bytes), "sizing the PowerSGD state");
        void *mine = malloc(bytes);
        if (!mine) fail("out of memory for the PowerSGD state");
        check(ddp_powersgd_state_save(t->powersgd, mine, bytes), "saving the PowerSGD state");
        ex.hook_ranks = (uint64_t)t->world;
        ex.hook_state = calloc((size_t)t->world, sizeof *ex.hook_state);
        ex.hook_state_bytes = calloc((size_t)t->world, sizeof *ex.hook_state_bytes);
        if (!ex.hook_state || !ex.hook_state_bytes) fail("out of memory");
        gather_blobs(t, mine, bytes, ex.hook_state, ex.hook_state_bytes);
        free(mine);
    }
#endif
    if (t->rank == 0 && fm_checkpoint_save(t->o.checkpoint, &h, &t->progress, &t->model, &t->opt,
                                           &ex, err, sizeof err))
        fail("%s", err);
    fm_extra_free(&ex);
}

/* --resume: the optimizer and hook states, into the objects created after the checkpoint was
 * read. Every rank read the same file: ZeRO takes its part of the consolidated state, PowerSGD
 * this rank's own state. */
static void load_resumed_state(trainer_t *t)
{
    fm_extra_t *ex = &t->resume_extra;
    if (!t->resumed_from) return;
    if (t->zero)
        check(ddp_zero_state_load(t->zero, ex->optim_state, ex->optim_state_bytes),
              "loading the ZeRO optimizer state from the checkpoint");
    else if (t->lib_opt)
        check(ddp_optim_state_load(t->lib_opt, ex->optim_state, ex->optim_state_bytes),
              "loading the optimizer state from the checkpoint");
#ifdef FM_HAVE_POWERSGD
    if (t->powersgd) {
        if (ex->hook_ranks != (uint64_t)t->world)
            fail("checkpoint %s holds PowerSGD state of %llu ranks, this run has %d (each rank's "
                 "residual is its own: resume on the same number of ranks)",
                 t->resumed_from, (unsigned long long)ex->hook_ranks, t->world);
        check(ddp_powersgd_state_load(t->powersgd, ex->hook_state[t->rank],
                                      ex->hook_state_bytes[t->rank]),
              "loading the PowerSGD state from the checkpoint");
    }
#endif
    fm_extra_free(ex);
}

static void trace_path(const trainer_t *t, char *out, size_t len)
{
    if (t->world == 1) {
        snprintf(out, len, "%s", t->o.trace);
        return;
    }
    const char *dot = strrchr(t->o.trace, '.');
    const char *slash = strrchr(t->o.trace, '/');
    if (dot && (!slash || dot > slash))
        snprintf(out, len, "%.*s.rank%d%s", (int)(dot - t->o.trace), t->o.trace, t->rank, dot);
    else
        snprintf(out, len, "%s.rank%d", t->o.trace, t->rank);
}

/* ---- jobs: --save-every, --resume auto, --metrics, and the kill the restart test uses ------ */

/* The file a run resumes from: --resume FILE, or with --resume auto the --checkpoint file when it
 * exists (NULL: start fresh). A checkpoint is replaced only by rename, so the file there is the
 * last complete save; one that fails to load is an error naming it, never silently a fresh start
 * that would throw the job's progress away. Every rank decides alone and they agree: a restarted
 * job starts only after every worker of the last attempt is gone. */
static const char *resume_source(const trainer_t *t)
{
    const options_t *o = &t->o;
    if (!o->resume_auto) return o->resume;
    if (access(o->checkpoint, F_OK) == 0) return o->checkpoint;
    if (errno != ENOENT) fail("--resume auto: cannot look at %s: %s", o->checkpoint, strerror(errno));
    return NULL;
}

/* One line on rank 0 saying what --resume auto did, with ddprun's attempt number. */
static void report_resume(const trainer_t *t, const char *from)
{
    if (t->rank != 0) return;
    const char *attempt = getenv("DDP_RESTART_COUNT");
    if (from)
        printf("resume auto: continuing from %s at step %llu (epoch %llu, restart %s)\n", from,
               (unsigned long long)t->progress.global_step,
               (unsigned long long)t->progress.epoch + 1, attempt ? attempt : "-");
    else
        printf("resume auto: no checkpoint at %s, starting fresh (restart %s)\n",
               t->o.checkpoint, attempt ? attempt : "-");
    fflush(stdout);
}

/* Tests only: FM_TEST_KILL_AT_STEP=N makes rank FM_TEST_KILL_RANK (default 1) SIGKILL itself
 * after optimizer step N, on the first attempt only (DDP_RESTART_COUNT unset or 0), so the
 * restarted job runs through. A real crash, at a step the test chooses. */
static void arm_test_kill(trainer_t *t)
{
    const char *at = getenv("FM_TEST_KILL_AT_STEP");
    const char *rank = getenv("FM_TEST_KILL_RANK");
    const char *attempt = getenv("DDP_RESTART_COUNT");
    if (!at || !*at || (attempt && strcmp(attempt, "0") != 0)) return;
    if ((rank ? atoi(rank) : 1) != t->rank) return;
    t->kill_at_step = strtoull(at, NULL, 10);
}

/* After optimizer step s of the epoch: the --save-every checkpoint (not at an epoch's last step,
 * where the epoch's own save follows), --metrics rows every log_every steps, the test kill.
 * The losses are averaged first (a collective every rank reaches at the same step), so the
 * checkpoint holds the epoch's loss so far. */
static void after_step(trainer_t *t, size_t s, size_t log_every)
{
    const options_t *o = &t->o;
    int last_of_epoch = s + 1 == t->steps_per_epoch;
    int save = o->save_every && t->progress.global_step % o->save_every == 0 && !last_of_epoch;
    if (save || (o->metrics && !last_of_epoch && (s + 1) % log_every == 0)) flush_losses(t);
    if (save) save_checkpoint(t);
    if (t->kill_at_step && t->progress.global_step == t->kill_at_step) {
        fprintf(stderr, "rank %d: FM_TEST_KILL_AT_STEP=%llu: killing myself\n", t->rank,
                (unsigned long long)t->kill_at_step);
        fflush(NULL);
        raise(SIGKILL);
    }
}

/* --metrics on rank 0: a fresh file with its header, or after a resume the rows up to the
 * checkpoint's step kept (a restarted job's rows after it would be repeated) and appended to. */
static void open_metrics(trainer_t *t)
{
    const options_t *o = &t->o;
    arm_test_kill(t);
    if (!o->metrics) return;
    t->pending_metrics = calloc(t->steps_per_epoch, sizeof *t->pending_metrics);
    if (!t->pending_metrics) fail("out of memory");
    if (t->rank != 0) return;
    static const char header[] = "step,epoch,loss,lr,samples_per_sec,step_ms,exposed_comm_ms\n";
    char *kept = NULL;
    size_t kept_len = 0;
    FILE *old = t->progress.global_step ? fopen(o->metrics, "r") : NULL;
    if (old) {
        FILE *mem = open_memstream(&kept, &kept_len);
        char line[1024];
        while (mem && fgets(line, sizeof line, old)) {
            unsigned long long step;
            if (sscanf(line, "%llu,", &step) == 1 && step <= t->progress.global_step)
                fputs(line, mem);
        }
        fclose(old);
        if (!mem) fail("out of memory");
        fclose(mem);
    }
    t->metrics = fopen(o->metrics, "w");
    if (!t->metrics) fail("--metrics %s: %s", o->metrics, strerror(errno));
    fputs(header, t->metrics);
    if (kept) fwrite(kept, 1, kept_len, t->metrics);
    free(kept);
    fflush(t->metrics);
}

/* One CSV row: step i of the pending ones, its global loss now known. samples/s is this step's
 * global samples over rank 0's step time. */
static void write_metrics_row(trainer_t *t, size_t step, double loss, size_t i)
{
    const step_metrics_t *m = &t->pending_metrics[i];
    fprintf(t->metrics, "%zu,%.4f,%.6f,%.6g,%.1f,%.3f,%.3f\n", step,
            (double)step / (double)t->steps_per_epoch, loss, m->lr,
            m->step_ms > 0 ? (double)t->per_step / (m->step_ms / 1000.0) : 0.0, m->step_ms,
            m->exposed_ms);
}

/* ---- main --------------------------------------------------------------------------------- */

/* ---- the steps of a run: data, model, data parallelism, training, report --------------- */

/* Loads the training (and test) data and sizes an epoch. */
static void load_data(trainer_t *t)
{
    const options_t *o = &t->o;
    char err[8192];
    if (o->synthetic) {
        if (fm_dataset_synthetic(o->synthetic, 1234, &t->train)) fail("out of memory");
    } else {
        if (fm_dataset_load(o->data_dir, "train", o->subset, &t->train, err, sizeof err))
            fail("%s", err);
        if (o->subset && t->train.count < o->subset)
            fail("--subset %zu: the training set has only %zu samples", o->subset, t->train.count);
        if (!o->no_eval && fm_dataset_load(o->data_dir, "t10k", 0, &t->test, err, sizeof err))
            fail("%s", err);
    }
    t->per_step = o->batch * o->accumulate;
    t->steps_per_epoch = t->train.count / t->per_step;
    /* --drop-last 0: one more, partial step for the remainder */
    if (!o->drop_last && t->train.count % t->per_step) t->steps_per_epoch++;
    if (t->steps_per_epoch == 0)
        fail("%zu training samples are fewer than one optimizer step needs (--batch %zu x "
             "--accumulate %zu)",
             t->train.count, o->batch, o->accumulate);
}

/* The model and the optimizer, then the checkpoint (every rank reads it), then the trace. */
static void build_model(trainer_t *t)
{
    const options_t *o = &t->o;
    size_t max_batch = t->local_batch > EVAL_CHUNK ? t->local_batch : EVAL_CHUNK;
    if (fm_mlp_create(o->hidden, max_batch, o->seed, &t->model))
        fail("out of memory for the model");
    t->opt.kind = o->optim;
    t->opt.lr = o->lr;
    t->opt.momentum = o->momentum;
    t->opt.weight_decay = o->weight_decay;
    t->opt.beta1 = o->beta1;
    t->opt.beta2 = o->beta2;
    t->opt.eps = o->eps;
    /* The optimizer is always libddp's (ddp/shard.h), created in setup_data_parallel: its
     * vectorised kernels take about half the time of optim.c's float loop, which the trainer ran
     * for sgd and adam before, and ZeRO-1 - the default on several ranks - computes exactly what
     * it computes, so 1 rank and N ranks take the same step. t->opt only carries the step's
     * learning rate (for --metrics) and the checkpoint's step field. The checkpoint's
     * library_optim field stays 1, so a checkpoint of that older trainer is refused by name
     * rather than misread. */
    t->progress.last_epoch_loss = NAN;
    const char *from = resume_source(t);
    if (from) {
        char err[8192];
        fm_hyper_t h = trainer_hyper(t);
        if (fm_checkpoint_load(from, &h, &t->progress, &t->model, &t->opt, &t->resume_extra,
                               err, sizeof err))
            fail("%s", err);
    }
    t->resumed_from = from;
    if (o->resume_auto) report_resume(t, from);
    if (o->param_bf16) { /* the model computes with the bf16 values the optimizer updates */
        for (int k = 0; k < FM_NPARAMS; k++) {
            size_t n = t->model.numel[k] ? t->model.numel[k] : 1;
            t->half_params[k] = malloc(n * sizeof(uint16_t));
            t->half_grads[k] = malloc(n * sizeof(uint16_t));
            if (!t->half_params[k] || !t->half_grads[k]) fail("out of memory for bf16 copies");
            to_bf16(t->half_params[k], t->model.params[k], t->model.numel[k]);
            from_bf16(t->model.params[k], t->half_params[k], t->model.numel[k]);
        }
    }
    t->pending_first_step = t->progress.global_step;
    if (o->trace) {
        char path[4096];
        trace_path(t, path, sizeof path);
        check(ddp_trace_open(path, t->rank, &t->trace), "opening the trace file");
        ddp_trace_name_lane(t->trace, 0, "trainer (compute)");
    }
}

/* Gradient buffers of our own (legacy, ZeRO-2), and rank 0's initial parameters broadcast,
 * which the Reducer otherwise does at creation. */
static void own_gradients(trainer_t *t, ddp_param_t *params)
{
    for (int k = 0; k < FM_NPARAMS; k++) {
        t->own_grads[k] = calloc(t->model.numel[k] ? t->model.numel[k] : 1, sizeof(float));
        if (!t->own_grads[k]) fail("out of memory for gradients");
        if (params) params[k].grad = t->own_grads[k];
        t->grads[k] = t->own_grads[k];
        if (t->world > 1)
            check(ddp_group_broadcast(t->group, t->model.params[k], t->model.numel[k], DDP_F32, 0),
                  "broadcasting the initial parameters");
    }
}

/* The Reducer's configuration: bucket and piece sizes, the trace, the comm hook. */
static ddp_reducer_config_t reducer_config(trainer_t *t)
{
    const options_t *o = &t->o;
    ddp_reducer_config_t cfg = DDP_REDUCER_CONFIG_INIT;
    cfg.join = !t->o.drop_last; /* uneven inputs: the partial last batch */
    cfg.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
    double piece_mb = o->piece_mb >= 0 ? o->piece_mb : o->grad_blocks > 1 ? 1 : 0;
    cfg.piece_bytes = (size_t)(piece_mb * 1048576.0);
    cfg.trace = t->trace;
    if (o->zero_overlap) { /* ZeRO's hook needs a fixed bucket layout */
        cfg.comm_hook = ddp_zero_hook;
        cfg.comm_hook_state = t->zero;
        cfg.comm_hook_averages = 1; /* averaged in the allreduce: no prescale pass */
        cfg.rebuild_buckets = 0;
    }
    if (o->hook == FM_HOOK_FP16 || o->hook == FM_HOOK_BF16) {
        check(ddp_half_hook_state_create(o->hook == FM_HOOK_FP16 ? DDP_F16 : DDP_BF16,
                                         &t->half_hook),
              "creating the half-precision hook");
        cfg.comm_hook = o->hook == FM_HOOK_FP16 ? ddp_hook_fp16 : ddp_hook_bf16;
        cfg.comm_hook_state = t->half_hook;
    }
#ifdef FM_HAVE_POWERSGD
    if (o->hook == FM_HOOK_POWERSGD) {
        ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
        pc.matrix_approximation_rank = o->psgd_rank;
        pc.start_powersgd_iter = o->psgd_start;
        pc.random_seed = o->seed;
        ddp_powersgd_state_t *ps = NULL;
        check(ddp_powersgd_state_create(&pc, &ps), "creating the PowerSGD hook");
        t->powersgd = ps;
        cfg.comm_hook = ddp_powersgd_hook;
        cfg.comm_hook_state = ps;
    }
#endif
    return cfg;
}

/* Data parallelism: the Reducer (verifies the model, broadcasts rank 0's values), the legacy
 * flat allreduce, or ZeRO (with the Reducer for stage 1, alone for stage 2). */
static void setup_data_parallel(trainer_t *t)
{
    const options_t *o = &t->o;
    ddp_param_t params[FM_NPARAMS];
    for (int k = 0; k < FM_NPARAMS; k++) {
        params[k] = (ddp_param_t){fm_param_names[k],
                                  t->model.params[k],
                                  t->model.numel[k],
                                  DDP_F32,
                                  t->model.rows[k],
                                  0,
                                  NULL};
    }
    /* The optimizer's view of the parameters: the model's, or their bf16 copies. */
    ddp_param_t optim_params[FM_NPARAMS];
    memcpy(optim_params, params, sizeof optim_params);
    if (o->param_bf16)
        for (int k = 0; k < FM_NPARAMS; k++) {
            optim_params[k].data = t->half_params[k];
            optim_params[k].dtype = DDP_BF16;
        }
    if (o->share_count) /* --bench-optim-share: chunk R of N of every parameter, as ZeRO cuts */
        for (int k = 0; k < FM_NPARAMS; k++) {
            size_t n = optim_params[k].numel;
            size_t chunk = (n + o->share_count - 1) / o->share_count;
            size_t lo = o->share_index * chunk < n ? o->share_index * chunk : n;
            size_t hi = n - lo < chunk ? n : lo + chunk;
            t->share_offset[k] = lo;
            optim_params[k].data = (float *)optim_params[k].data + lo;
            optim_params[k].numel = hi - lo;
        }
    ddp_optim_group_t groups[2];
    if (o->zero) {
        ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
        zc.stage = o->zero;
        zc.overlap = o->zero_overlap;
        zc.fused = o->zero_fused;
        /* ZeRO-1 in chunks: each rank steps half of every parameter at 2 ranks (whole
         * parameters leave 56 % of this model on the rank holding fc2.weight) and the exchange
         * is one allgather per parameter, both ranks copying at once. */
        zc.partition = o->zero == 1 && !o->zero_overlap && !o->zero_whole
                           ? DDP_ZERO_PARTITION_CHUNKS
                           : DDP_ZERO_PARTITION_PARAMS;
        zc.bucket_cap_bytes = (size_t)(o->bucket_mb * 1048576.0);
        zc.optim = library_config(o, groups);
        check(ddp_zero_create(t->group, optim_params, FM_NPARAMS, &zc, &t->zero),
              "creating the ZeRO optimizer");
    } else {
        ddp_optim_config_t oc = library_config(o, groups);
        check(ddp_optim_create(optim_params, FM_NPARAMS, &oc, &t->lib_opt),
              "creating the optimizer");
    }
    if (o->zero == 2) {
        own_gradients(t, NULL); /* no Reducer */
    } else if (o->legacy) {
        own_gradients(t, params);
        check(ddp_legacy_create(t->group, params, FM_NPARAMS, 0, &t->legacy),
              "creating the legacy allreduce");
    } else {
        ddp_reducer_config_t cfg = reducer_config(t);
        check(ddp_reducer_create(t->group, params, FM_NPARAMS, NULL, 0, &cfg, &t->reducer),
              "creating the Reducer");
    }
    load_resumed_state(t);
    t->xbuf = malloc(t->local_batch * FM_PIXELS * sizeof(float));
    t->ybuf = malloc(t->local_batch);
    t->perm = malloc(t->train.count * sizeof(uint32_t));
    for (int k = 0; k < FM_NPARAMS && !o->drop_last; k++)
        if (!(t->join_params[k] = malloc(t->model.numel[k] * sizeof(float)))) fail("out of memory");
    t->pending = calloc(t->steps_per_epoch, sizeof(double));
    if (!t->xbuf || !t->ybuf || !t->perm || !t->pending) fail("out of memory");
    open_metrics(t);
}

static void print_banner(const trainer_t *t)
{
    const options_t *o = &t->o;
    if (t->rank != 0) return;
    printf("fashion-mnist: %d rank%s (%s), %zu train samples, hidden %zu, global batch %zu "
           "(%zu per rank)%s, %s lr %g, sync %s\n",
           t->world, t->world == 1 ? "" : "s", ddp_group_transport(t->group), t->train.count,
           o->hidden, o->batch, t->local_batch, o->accumulate > 1 ? " x accumulate" : "",
           fm_optim_names[o->optim], o->lr,
           o->zero_fused      ? "zero-2 fused (reduce_scatter_apply)"
           : o->zero == 2     ? "zero-2 (reduce-scatter)"
           : o->zero_overlap ? "reducer + zero-1 overlap"
           : o->zero         ? "reducer + zero-1"
           : o->legacy       ? "legacy"
                             : "reducer");
    fflush(stdout);
}

/* --drop-last 0: this rank's samples in step s (*n), the ranks with any (*active) and the
 * step's samples over all ranks (*total); a whole step leaves the defaults (local_batch, world,
 * batch). The partial last step takes the remainder in the same layout as a whole one: rank r
 * the samples from r x local_batch on, so the ranks past the remainder have none. */
static void step_share(const trainer_t *t, size_t s, size_t *n, size_t *active, size_t *total)
{
    size_t begin = s * t->o.batch;
    if (t->o.drop_last || begin + t->o.batch <= t->train.count) return;
    size_t rem = t->train.count - begin, lo = (size_t)t->rank * t->local_batch;
    *n = rem > lo ? (rem - lo < t->local_batch ? rem - lo : t->local_batch) : 0;
    *active = (rem + t->local_batch - 1) / t->local_batch;
    *total = rem;
}

/* One micro-step k of optimizer step s: this rank's share of the batch, forward, backward (the
 * callbacks hand gradients to the Reducer as they are done), finalize. Returns the loss and adds
 * the step's exposed communication (the finalize wait) to *exposed. */
static double micro_step(trainer_t *t, size_t s, size_t k, int sync, double *exposed)
{
    const options_t *o = &t->o;
    float scale = 1.0f / (float)(t->local_batch * o->accumulate);
    size_t base = (s * o->accumulate + k) * o->batch + (size_t)t->rank * t->local_batch;
    size_t n = t->local_batch, active = (size_t)t->world, total = o->batch;
    step_share(t, s, &n, &active, &total);
    if (total < o->batch) {
        /* The partial last batch: the Reducer averages over the `active` ranks with data, so
         * scaling each rank's sum by active / total makes that average the mean over the
         * total samples, as one process would take it. */
        scale = (float)((double)active / (double)total);
    }
    double td = ddp_time_us();
    for (size_t i = 0; i < n; i++) {
        uint32_t idx = t->perm[base + i];
        t->seen[0]++;
        t->seen[1] += idx;
        t->seen[2] += (int64_t)idx * idx;
        memcpy(t->xbuf + i * FM_PIXELS, t->train.images + (size_t)idx * FM_PIXELS,
               FM_PIXELS * sizeof(float));
        t->ybuf[i] = t->train.labels[idx];
    }
    if (t->reducer) {
        check(ddp_reducer_set_sync(t->reducer, sync), "ddp_reducer_set_sync");
        check(ddp_reducer_prepare(t->reducer), "ddp_reducer_prepare");
        for (int p = 0; p < FM_NPARAMS; p++)
            check(ddp_reducer_grad(t->reducer, (size_t)p, (void **)&t->grads[p]),
                  "ddp_reducer_grad");
    } else if (t->legacy) {
        check(ddp_legacy_set_sync(t->legacy, sync), "ddp_legacy_set_sync");
    }
    t->zero_sync = sync;
    double t0 = ddp_time_us();
    t->phase_us[PH_DATA] += t0 - td;
    fm_mlp_forward(&t->model, t->xbuf, n);
    double t1 = ddp_time_us();
    t->phase_us[PH_FORWARD] += t1 - t0;
    if (t->tracing) ddp_trace_span(t->trace, "forward", "compute", 0, t0, t1);
    t->mark_us = t1;
    double loss = 0;
    /* The first micro-step of an optimizer step overwrites the gradients (optimizer_step does
     * not clear them); later ones (--accumulate) add to them. */
    if (fm_mlp_backward_blocks(&t->model, t->xbuf, t->ybuf, n, scale, t->grads, k > 0, &loss,
                               o->grad_blocks, on_rows_done, on_layer_done, t))
        check(t->status, "ddp_reducer_grad_ready");
    double t2 = ddp_time_us();
    t->phase_us[PH_BACKWARD] += t2 - t1;
    if (t->reducer) {
        check(ddp_reducer_finalize(t->reducer), "ddp_reducer_finalize");
        if (sync) {
            ddp_reducer_stats_t stats;
            if (ddp_reducer_stats(t->reducer, &stats) == DDP_OK) *exposed = stats.exposed_us;
        }
    } else if (sync && t->legacy) {
        check(ddp_legacy_allreduce(t->legacy, NULL), "ddp_legacy_allreduce");
        *exposed = ddp_time_us() - t2;
    }
    double t3 = ddp_time_us();
    t->phase_us[PH_FINALIZE] += t3 - t2;
    if (t->tracing)
        ddp_trace_span(t->trace, sync ? "finalize (wait for buckets)" : "finalize (no_sync)",
                       "compute", 0, t2, t3);
    /* flush_losses divides the sum over ranks by the world size: weight this rank's mean by its
     * share of the partial batch so that the result is the mean over its samples. */
    if (total < o->batch) loss *= (double)n * (double)t->world / (double)total;
    return loss;
}

/* This step's learning rate, before its backward: with --zero-overlap the hook updates each
 * bucket during backward. */
static void set_step_lr(trainer_t *t)
{
    double factor = lr_factor(t, t->progress.global_step);
    if (t->zero)
        check(ddp_zero_scale_lr(t->zero, factor), "ddp_zero_scale_lr");
    else
        check(ddp_optim_scale_lr(t->lib_opt, factor), "ddp_optim_scale_lr");
    t->opt.lr = t->o.lr * factor; /* for --metrics; factor 1 without a schedule: the plain --lr */
}

/* The optimizer step (or ZeRO's), then the gradients zeroed for the next step. */
static void optimizer_step(trainer_t *t)
{
    const options_t *o = &t->o;
    double t3 = ddp_time_us();
    void *const *grads = (void *const *)t->grads;
    if (o->param_bf16 && !(t->zero && o->zero == 2)) { /* ZeRO-2 converted them in backward */
        for (int k = 0; k < FM_NPARAMS; k++)
            to_bf16(t->half_grads[k], t->grads[k], t->model.numel[k]);
        grads = (void *const *)t->half_grads;
    }
    if (t->zero) { /* stage 2 and overlap: every gradient is with ZeRO already */
        check(ddp_zero_step(t->zero, o->zero == 1 && !o->zero_overlap ? grads : NULL),
              "ddp_zero_step");
    } else if (o->share_count) { /* --bench-optim-share: this process's chunks only */
        void *share[FM_NPARAMS];
        for (int k = 0; k < FM_NPARAMS; k++) share[k] = t->grads[k] + t->share_offset[k];
        check(ddp_optim_step(t->lib_opt, share), "ddp_optim_step");
    } else {
        check(ddp_optim_step(t->lib_opt, grads), "ddp_optim_step");
    }
    if (o->param_bf16)
        for (int k = 0; k < FM_NPARAMS; k++)
            from_bf16(t->model.params[k], t->half_params[k], t->model.numel[k]);
    double t4 = ddp_time_us();
    t->phase_us[PH_OPTIMIZER] += t4 - t3;
    /* The gradients are not cleared for the next step (ddp_reducer_zero_grad, a memset of the
     * whole gradient streamed through memory on every rank): its first backward overwrites
     * them, and a rank that joins (--drop-last 0) gets buckets the Reducer's join clears. */
    if (t->tracing) ddp_trace_span(t->trace, "optimizer step", "compute", 0, t3, t4);
}

/* Grows an array of samples to hold at least n + 1. */
static double *grow_samples(double *v, size_t n, size_t *cap)
{
    if (n < *cap) return v;
    *cap = *cap ? 2 * *cap : 1024;
    v = realloc(v, *cap * sizeof(double));
    if (!v) fail("out of memory");
    return v;
}

/* Records a step's time after the warm-up: synchronised steps and --bench-nosync's steps apart. */
static void record_step(trainer_t *t, run_stats_t *st, int skip_comm, double step_us,
                        double exposed, double cpu_us)
{
    if (st->run_steps <= t->o.warmup) return;
    if (skip_comm) {
        size_t cap = st->nosync_cap;
        st->nosync_samples = grow_samples(st->nosync_samples, st->nosync_steps, &cap);
        st->nosync_cap = cap;
        st->nosync_samples[st->nosync_steps++] = step_us;
        return;
    }
    /* every per-step array has sample_cap entries: grow them all from the same old capacity */
    size_t cap = st->sample_cap;
    st->step_samples = grow_samples(st->step_samples, st->timed_steps, &cap);
    cap = st->sample_cap;
    st->exposed_samples = grow_samples(st->exposed_samples, st->timed_steps, &cap);
    double accounted = 0;
    for (int k = 0; k <= PH_COUNT; k++) {
        cap = st->sample_cap;
        st->phase_samples[k] = grow_samples(st->phase_samples[k], st->timed_steps, &cap);
        double v = k < PH_COUNT ? t->phase_us[k] : step_us - accounted;
        accounted += v;
        st->phase_samples[k][st->timed_steps] = v;
    }
    st->sample_cap = cap;
    st->step_samples[st->timed_steps] = step_us;
    st->exposed_samples[st->timed_steps] = exposed;
    st->cpu_us += cpu_us;
    st->timed_us += step_us;
    st->exposed_us += exposed;
    st->timed_steps++;
}

/* Runs the epochs from where the checkpoint left off; returns the last test accuracy (< 0 when
 * none was measured). Stops early at --max-steps. */
static double train(trainer_t *t, run_stats_t *st)
{
    const options_t *o = &t->o;
    const int tty = t->rank == 0 && isatty(STDOUT_FILENO);
    size_t log_every =
        o->log_every ? o->log_every : (t->steps_per_epoch >= 10 ? t->steps_per_epoch / 10 : 1);
    double accuracy = -1.0;
    for (size_t epoch = t->progress.epoch; epoch < o->epochs && !st->stopped; epoch++) {
        fm_permutation(o->seed, epoch, t->train.count, t->perm);
        double epoch_start = ddp_time_us(), epoch_exposed = 0, local_loss_sum = 0;
        size_t epoch_steps = 0;
        for (size_t s = t->progress.step_in_epoch; s < t->steps_per_epoch; s++) {
            if (o->max_steps && t->progress.global_step >= o->max_steps) {
                st->stopped = 1;
                break;
            }
            double step_start = ddp_time_us(), cpu_start = cpu_time_us();
            double step_loss = 0, step_exposed = 0;
            memset(t->phase_us, 0, sizeof t->phase_us);
            t->tracing = t->trace && st->run_steps >= 1 && st->run_steps <= o->trace_steps;
            const int skip_comm = o->bench_nosync && st->run_steps % 2 == 1;
            set_step_lr(t);
            size_t mine = t->local_batch, active, total;
            step_share(t, s, &mine, &active, &total);
            if (mine == 0) {
                /* No samples left for this rank: join. The join returns once every rank has
                 * joined, with the model broadcast from the last joiner (already stepped) and
                 * this step's average in the gradients; the same step from the parameters
                 * before it keeps the optimizer state that of the others. */
                for (int k = 0; k < FM_NPARAMS; k++)
                    memcpy(t->join_params[k], t->model.params[k],
                           t->model.numel[k] * sizeof(float));
                check(ddp_reducer_join(t->reducer), "ddp_reducer_join");
                for (int k = 0; k < FM_NPARAMS; k++)
                    memcpy(t->model.params[k], t->join_params[k],
                           t->model.numel[k] * sizeof(float));
                for (int p = 0; p < FM_NPARAMS; p++)
                    check(ddp_reducer_grad(t->reducer, (size_t)p, (void **)&t->grads[p]),
                          "ddp_reducer_grad");
                t->joined = 1;
            } else {
                for (size_t k = 0; k < o->accumulate; k++) {
                    int sync = !skip_comm && k + 1 == o->accumulate;
                    step_loss += micro_step(t, s, k, sync, &step_exposed) / (double)o->accumulate;
                }
            }
            optimizer_step(t);
            double step_end = ddp_time_us();

            t->pending[t->npending++] = step_loss;
            t->progress.global_step++;
            t->progress.step_in_epoch = s + 1;
            st->run_steps++;
            epoch_steps++;
            local_loss_sum += step_loss;
            epoch_exposed += step_exposed;
            record_step(t, st, skip_comm, step_end - step_start, step_exposed,
                        cpu_time_us() - cpu_start);
            if (t->pending_metrics)
                t->pending_metrics[t->npending - 1] =
                    (step_metrics_t){t->opt.lr, (step_end - step_start) / 1000.0,
                                     step_exposed / 1000.0};
            after_step(t, s, log_every);
            if (t->rank == 0 && (tty || (s + 1) % log_every == 0)) {
                double sps = st->timed_steps ? (double)(st->timed_steps * t->per_step) /
                                                   (st->timed_us * 1e-6)
                                             : 0;
                show_progress(t, tty, epoch, s + 1, t->steps_per_epoch,
                              local_loss_sum / (double)epoch_steps, sps, 0);
            }
        }
        /* --drop-last 0: every rank that still had data in the last step joins now, so the
         * ranks that ran out take part in the reductions until all are done. */
        if (!o->drop_last && t->reducer && !st->stopped && !t->joined)
            check(ddp_reducer_join(t->reducer), "ddp_reducer_join");
        t->joined = 0;
        if (!o->drop_last && !st->stopped) {
            /* Which samples the epoch used, over all ranks: a test checks each was used once
             * (count N, index sums those of 0..N-1). */
            if (t->world > 1)
                check(ddp_group_allreduce(t->group, t->seen, t->seen, 3, DDP_I64, DDP_SUM),
                      "summing the epoch's sample counts");
            if (t->rank == 0)
                printf("samples epoch=%zu count=%lld index_sum=%lld index_sq_sum=%lld\n",
                       epoch + 1, (long long)t->seen[0], (long long)t->seen[1],
                       (long long)t->seen[2]);
        }
        memset(t->seen, 0, sizeof t->seen);
        if (tty) show_progress(t, tty, epoch, 0, t->steps_per_epoch, 0, 0, 1);
        double train_us = ddp_time_us() - epoch_start;
        flush_losses(t);
        if (st->stopped) break;
        /* the epoch is complete */
        double epoch_loss =
            t->progress.loss_count ? t->progress.loss_sum / (double)t->progress.loss_count : NAN;
        accuracy = evaluate(t);
        if (t->rank == 0) {
            printf("epoch %zu/%zu: train loss %.4f", epoch + 1, o->epochs, epoch_loss);
            if (accuracy >= 0) printf(", test accuracy %.2f%%", accuracy * 100.0);
            printf(", %.0f samples/s, exposed comm %.3f ms/step\n",
                   epoch_steps ? (double)(epoch_steps * t->per_step) / (train_us * 1e-6) : 0.0,
                   epoch_steps ? epoch_exposed / (double)epoch_steps / 1000.0 : 0.0);
            fflush(stdout);
        }
        t->progress.epoch = epoch + 1;
        t->progress.step_in_epoch = 0;
        t->progress.last_epoch_loss = epoch_loss;
        t->progress.loss_sum = 0;
        t->progress.loss_count = 0;
        save_checkpoint(t);
    }
    return accuracy;
}

/* After the loop: a run stopped inside an epoch reports and saves that partial epoch; a run
 * resumed from the last epoch's checkpoint still evaluates. Returns the final loss. */
static double finish(trainer_t *t, run_stats_t *st, double *accuracy)
{
    const options_t *o = &t->o;
    if (o->max_steps && t->progress.global_step >= o->max_steps) st->stopped = 1;
    double final_loss = t->progress.last_epoch_loss;
    if (st->stopped && t->progress.step_in_epoch > 0 &&
        t->progress.step_in_epoch < t->steps_per_epoch) {
        if (t->progress.loss_count)
            final_loss = t->progress.loss_sum / (double)t->progress.loss_count;
        *accuracy = evaluate(t);
        save_checkpoint(t);
        if (t->rank == 0) {
            printf("stopped after %llu steps (--max-steps): train loss %.4f",
                   (unsigned long long)t->progress.global_step, final_loss);
            if (*accuracy >= 0) printf(", test accuracy %.2f%%", *accuracy * 100.0);
            printf("\n");
        }
    } else if (*accuracy < 0 && !o->no_eval && !o->synthetic) {
        *accuracy = evaluate(t);
    }
    if (o->print_checksum) {
        double sum = 0;
        uint64_t h = fm_mlp_checksum(&t->model, &sum);
        printf("checksum rank=%d fnv=%016llx sum=%.17g\n", t->rank, (unsigned long long)h, sum);
    }
    return final_loss;
}

/* Optimizer state held per rank: ZeRO's shard (largest over ranks, sum), or the whole state. */
static void optimizer_state_bytes(trainer_t *t, double state_bytes[2])
{
    const options_t *o = &t->o;
    state_bytes[0] = state_bytes[1] = 0;
    if (t->zero) {
        state_bytes[0] = state_bytes[1] = (double)ddp_zero_state_bytes(t->zero);
        if (t->world > 1) {
            check(ddp_group_allreduce(t->group, &state_bytes[0], &state_bytes[0], 1, DDP_F64,
                                      DDP_MAX),
                  "taking the largest optimizer state over ranks");
            check(ddp_group_allreduce(t->group, &state_bytes[1], &state_bytes[1], 1, DDP_F64,
                                      DDP_SUM),
                  "summing the optimizer state over ranks");
        }
        if (t->rank == 0)
            printf("zero-%d: optimizer state %.1f KiB on the largest rank, %.1f KiB over all %d "
                   "(unsharded: all of it on every rank)\n",
                   o->zero, state_bytes[0] / 1024.0, state_bytes[1] / 1024.0, t->world);
    } else {
        state_bytes[0] = (double)ddp_optim_state_bytes(t->lib_opt);
        state_bytes[1] = state_bytes[0] * t->world;
    }
}

/* Bytes each synchronised step put on the wire through the hook, against plain allreduce. */
static ddp_hook_stats_t hook_wire(trainer_t *t, size_t run_steps)
{
    ddp_hook_stats_t wire = {0, 0, 0, 0};
    double compression = 0;
    if (t->half_hook) check(ddp_half_hook_stats(t->half_hook, &wire), "hook statistics");
#ifdef FM_HAVE_POWERSGD
    if (t->powersgd) {
        ddp_powersgd_stats_t ps;
        check(ddp_powersgd_stats(t->powersgd, &ps), "PowerSGD statistics");
        wire = ps.wire;
        compression = ps.compression_rate;
    }
#endif
    if (t->rank == 0 && wire.buckets) {
        double steps = (double)(run_steps ? run_steps : 1);
        printf("hook %s: %.1f KiB per step on the wire (%.1f KiB uncompressed)",
               fm_hook_names[t->o.hook], (double)wire.bytes_after / 1024.0 / steps,
               (double)wire.bytes_before / 1024.0 / steps);
        if (compression > 0) printf(", PowerSGD compression rate %.2f", compression);
        printf("\n");
    }
    return wire;
}

/* The report: exposed communication (each step's smallest finalize wait over the ranks),
 * --bench-nosync's comparison, and the JSON line or the final accuracy. */
static void report(trainer_t *t, run_stats_t *st, double accuracy, double final_loss)
{
    const options_t *o = &t->o;
    double state_bytes[2];
    optimizer_state_bytes(t, state_bytes);
    ddp_hook_stats_t wire = hook_wire(t, st->run_steps);
    /* The rank that finishes backward last waits in finalize only for the communication backward
     * could not hide; an earlier rank's wait also holds the others' remaining backward (skew).
     * So a step's exposed communication is the smallest wait over the ranks; rank 0's own wait
     * is reported beside it. */
    double rank0_wait_median = 0;
    if (st->timed_steps) {
        double *own = malloc(st->timed_steps * sizeof(double));
        if (!own) fail("out of memory");
        memcpy(own, st->exposed_samples, st->timed_steps * sizeof(double));
        rank0_wait_median = median(own, st->timed_steps);
        free(own);
        if (t->world > 1)
            check(ddp_group_allreduce(t->group, st->exposed_samples, st->exposed_samples,
                                      st->timed_steps, DDP_F64, DDP_MIN),
                  "taking each step's smallest finalize wait over ranks");
        st->exposed_us = 0;
        for (size_t i = 0; i < st->timed_steps; i++) st->exposed_us += st->exposed_samples[i];
    }
    /* --bench-nosync: every rank's median synchronised and no_sync step. The cores of a shared
     * machine need not run at one speed; a faster rank gets ahead during no_sync steps and waits
     * for the slower one in the next synchronised step, which rank 0's own difference would
     * count as communication. The slowest rank (largest no_sync step) never waits in a no_sync
     * step, so its difference is the communication alone. */
    /* CPU time per synchronised step, this rank's and the largest over the ranks */
    double cpu_ms[2] = {st->timed_steps ? st->cpu_us / (double)st->timed_steps / 1000.0 : 0, 0};
    cpu_ms[1] = cpu_ms[0];
    if (t->world > 1)
        check(ddp_group_allreduce(t->group, &cpu_ms[1], &cpu_ms[1], 1, DDP_F64, DDP_MAX),
              "taking the largest CPU time per step over ranks");
    double *rank_medians = NULL; /* [2 * world]: rank r's step median, then its no_sync median */
    double nosync_exposed_ms = 0;
    if (st->nosync_steps) {
        rank_medians = calloc(2 * (size_t)t->world, sizeof(double));
        if (!rank_medians) fail("out of memory");
        double mine[2] = {median(st->step_samples, st->timed_steps) / 1000.0,
                          median(st->nosync_samples, st->nosync_steps) / 1000.0};
        check(ddp_group_allgather(t->group, mine, rank_medians, 2, DDP_F64),
              "gathering every rank's step medians");
        int slowest = 0;
        for (int q = 1; q < t->world; q++)
            if (rank_medians[2 * q + 1] > rank_medians[2 * slowest + 1]) slowest = q;
        nosync_exposed_ms = rank_medians[2 * slowest] - rank_medians[2 * slowest + 1];
    }
    if (t->rank == 0) {
        double step_ms = st->timed_steps ? st->timed_us / (double)st->timed_steps / 1000.0 : 0;
        double sps = st->timed_us > 0
                         ? (double)(st->timed_steps * t->per_step) / (st->timed_us * 1e-6)
                         : 0;
        if (o->json) {
            printf("{\"test_accuracy\":");
            if (accuracy >= 0)
                printf("%.4f", accuracy);
            else
                printf("null");
            printf(",\"samples_per_sec\":%.1f,\"step_ms\":%.4f,\"exposed_comm_ms\":%.4f,"
                   "\"world_size\":%d,\"epochs\":%zu,\"steps\":%llu,\"timed_steps\":%zu,"
                   "\"final_loss\":",
                   sps, step_ms,
                   st->timed_steps ? st->exposed_us / (double)st->timed_steps / 1000.0 : 0.0,
                   t->world, o->epochs, (unsigned long long)t->progress.global_step,
                   st->timed_steps);
            if (isfinite(final_loss))
                printf("%.6f", final_loss);
            else
                printf("null");
            printf(",\"step_ms_median\":%.4f,\"exposed_comm_ms_median\":%.4f,"
                   "\"rank0_wait_ms_median\":%.4f",
                   median(st->step_samples, st->timed_steps) / 1000.0,
                   median(st->exposed_samples, st->timed_steps) / 1000.0,
                   rank0_wait_median / 1000.0);
            if (st->nosync_steps) {
                printf(",\"nosync_step_ms_median\":%.4f,\"nosync_exposed_ms\":%.4f",
                       median(st->nosync_samples, st->nosync_steps) / 1000.0, nosync_exposed_ms);
                for (int k = 0; k < 2; k++) {
                    printf(k ? ",\"rank_nosync_step_ms_median\":[" : ",\"rank_step_ms_median\":[");
                    for (int q = 0; q < t->world; q++)
                        printf("%s%.4f", q ? "," : "", rank_medians[2 * q + k]);
                    printf("]");
                }
            }
            printf(",\"cpu_ms_per_step\":%.4f,\"cpu_ms_per_step_max\":%.4f", cpu_ms[0],
                   cpu_ms[1]);
            printf(",\"phase_ms\":{");
            for (int k = 0; k <= PH_COUNT; k++)
                printf("%s\"%s\":%.4f", k ? "," : "", k < PH_COUNT ? fm_phase_names[k] : "other",
                       median(st->phase_samples[k], st->timed_steps) / 1000.0);
            printf("}");
            printf(",\"hidden\":%zu,\"batch\":%zu,\"accumulate\":%zu,\"optim\":\"%s\","
                   "\"sync\":\"%s\",\"transport\":\"%s\",\"hook\":\"%s\",\"wire_bytes\":%llu,"
                   "\"uncompressed_bytes\":%llu,\"zero\":%d,\"zero_overlap\":%d,"
                   "\"optimizer_state_bytes\":%.0f}\n",
                   o->hidden, o->batch, o->accumulate, fm_optim_names[o->optim],
                   o->legacy ? "legacy" : "reducer", ddp_group_transport(t->group),
                   fm_hook_names[o->hook], (unsigned long long)wire.bytes_after,
                   (unsigned long long)wire.bytes_before, o->zero, o->zero_overlap,
                   state_bytes[0]);
        } else if (accuracy >= 0) {
            printf("final test accuracy: %.2f%%\n", accuracy * 100.0);
        }
        fflush(stdout);
    }
    free(rank_medians);
}

static void teardown(trainer_t *t, run_stats_t *st)
{
    ddp_reducer_destroy(t->reducer);
    ddp_half_hook_state_destroy(t->half_hook);
#ifdef FM_HAVE_POWERSGD
    ddp_powersgd_state_destroy(t->powersgd);
#endif
    ddp_legacy_destroy(t->legacy);
    ddp_zero_destroy(t->zero); /* after the Reducer, whose hook may use it */
    ddp_optim_destroy(t->lib_opt);
    for (int k = 0; k < FM_NPARAMS; k++) {
        free(t->half_params[k]);
        free(t->half_grads[k]);
    }
    fm_extra_free(&t->resume_extra);
    if (t->trace) check(ddp_trace_close(t->trace), "closing the trace");
    ddp_group_destroy(t->group);
    ddp_store_destroy(t->local_store);
    for (int p = 0; p < FM_NPARAMS; p++) free(t->own_grads[p]);
    free(t->xbuf);
    free(t->ybuf);
    free(t->perm);
    for (int k = 0; k < FM_NPARAMS; k++) free(t->join_params[k]);
    free(t->pending);
    free(t->pending_metrics);
    if (t->metrics && fclose(t->metrics) != 0) fail("--metrics %s: %s", t->o.metrics, strerror(errno));
    free(st->step_samples);
    free(st->exposed_samples);
    free(st->nosync_samples);
    for (int k = 0; k <= PH_COUNT; k++) free(st->phase_samples[k]);
    fm_mlp_destroy(&t->model);
    fm_dataset_free(&t->train);
    fm_dataset_free(&t->test);
}

int main(int argc, char **argv)
{
    example_openblas_kernels(argv);
    trainer_t tr;
    memset(&tr, 0, sizeof tr);
    trainer_t *t = &tr;
    parse_options(argc, argv, &t->o);
    if (getenv("RANK")) g_rank = atoi(getenv("RANK")); /* for errors before the group exists */
#ifdef FM_HAVE_OPENBLAS_THREADS
    openblas_set_num_threads(1); /* one core per rank: the ranks are the parallelism */
#endif
    setup_group(t);
    resolve_zero_default(t);
    if (t->o.share_count && t->world > 1)
        fail("--bench-optim-share R/N runs one rank (it is one of N independent processes), "
             "not %d", t->world);
    if (t->o.batch % (size_t)t->world)
        fail("--batch %zu is not divisible by the world size %d: the global batch is split "
             "evenly over ranks",
             t->o.batch, t->world);
    t->local_batch = t->o.batch / (size_t)t->world;

    load_data(t);
    build_model(t);
    setup_data_parallel(t);
    print_banner(t);

    run_stats_t st;
    memset(&st, 0, sizeof st);
    double accuracy = train(t, &st);
    double final_loss = finish(t, &st, &accuracy);
    report(t, &st, accuracy, final_loss);
    teardown(t, &st);
    return 0;
}
