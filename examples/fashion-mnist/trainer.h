/* The Fashion-MNIST trainer's parts: the dataset reader, the MLP (forward/backward through CBLAS),
 * the optimisers and the checkpoint format. main.c wires them to a libddp process group and
 * Reducer. Every function here is local to one process; nothing here communicates. */
#ifndef FM_TRAINER_H
#define FM_TRAINER_H

#include <stddef.h>
#include <stdint.h>

#define FM_PIXELS 784
#define FM_CLASSES 10
#define FM_NPARAMS 6 /* W1 b1 W2 b2 W3 b3, registered in this order */

/* ---- data (data.c) ---------------------------------------------------------------------- */

typedef struct fm_dataset {
    size_t count;
    float *images;   /* count * FM_PIXELS, normalised: (x / 255 - mean) / std */
    uint8_t *labels; /* count, 0..9 */
} fm_dataset_t;

/* Reads <dir>/<split>-images-idx3-ubyte.gz and <dir>/<split>-labels-idx1-ubyte.gz (split is
 * "train" or "t10k"), keeping the first `limit` samples (0: all). On failure returns -1 with a
 * message naming the file, what is wrong and how to get the data. */
int fm_dataset_load(const char *dir, const char *split, size_t limit, fm_dataset_t *out,
                    char *err, size_t errlen);
/* Random images with labels that depend on them (a learnable task of the same shape), for
 * benchmarks that should not depend on the files. */
int fm_dataset_synthetic(size_t count, uint64_t seed, fm_dataset_t *out);
void fm_dataset_free(fm_dataset_t *d);

/* ---- random numbers and the sampler (data.c) ---------------------------------------------- */

uint64_t fm_splitmix64(uint64_t *state);
/* A permutation of 0..n-1 that depends only on (seed, epoch): identical on every rank. */
void fm_permutation(uint64_t seed, uint64_t epoch, size_t n, uint32_t *perm);

/* ---- the model (model.c) ------------------------------------------------------------------ */

typedef struct fm_mlp {
    size_t hidden;
    float *params[FM_NPARAMS];
    size_t numel[FM_NPARAMS];
    size_t rows[FM_NPARAMS]; /* matrix rows (out features) or 0 for a bias */
    /* activations and their gradients for up to max_batch samples */
    size_t max_batch;
    float *h1, *h2, *logits, *dlogits, *dh2, *dh1;
} fm_mlp_t;

extern const char *const fm_param_names[FM_NPARAMS];

/* Allocates the model for batches up to max_batch and initialises it like torch.nn.Linear
 * (uniform in +-1/sqrt(fan_in)) from `seed`. */
int fm_mlp_create(size_t hidden, size_t max_batch, uint64_t seed, fm_mlp_t *out);
void fm_mlp_destroy(fm_mlp_t *m);
/* Logits for m samples (m <= max_batch) into model->logits. */
void fm_mlp_forward(fm_mlp_t *model, const float *x, size_t m);

/* Called by backward after layer `layer` (2, 1, 0) has its weight and bias gradients written:
 * parameters 2*layer and 2*layer+1. Returns 0 to continue, non-zero to stop with that value. */
typedef int (*fm_layer_done_fn)(void *ctx, int layer);

/* After fm_mlp_forward on the same x: softmax cross-entropy mean loss over the m samples
 * (returned in *loss), and gradients of `scale` * (sum of sample losses) ACCUMULATED into
 * grads[i] (beta = 1). Layers finish last first; done(ctx, layer) is called after each.
 * Returns 0 or done's non-zero value. */
int fm_mlp_backward(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t m,
                    float scale, float *const grads[FM_NPARAMS], double *loss,
                    fm_layer_done_fn done, void *ctx);

/* Called when rows [row_begin, row_end) of layer `layer`'s weight gradient are final. */
typedef int (*fm_rows_done_fn)(void *ctx, int layer, size_t row_begin, size_t row_end);

/* Weight gradients are computed in this many row tiles (one GEMM each), always. */
#define FM_GRAD_TILES 8

/* fm_mlp_backward reporting each weight gradient in `blocks` row blocks (groups of its
 * FM_GRAD_TILES tiles): rows_done (if not NULL) is called after each block, before done(ctx,
 * layer). The GEMMs are the same for every block count, so the results are the same bits.
 * blocks is capped at the layer's tiles; 0 is taken as 1. accumulate 1 adds into grads as
 * fm_mlp_backward does; 0 overwrites them (their old contents are never read, so the caller
 * need not zero them between steps): the same values, up to the sign of a zero. */
int fm_mlp_backward_blocks(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t m,
                           float scale, float *const grads[FM_NPARAMS], int accumulate,
                           double *loss, size_t blocks, fm_rows_done_fn rows_done,
                           fm_layer_done_fn done, void *ctx);

/* Number of correct predictions among count samples, evaluated in chunks of max_batch. */
size_t fm_mlp_count_correct(fm_mlp_t *model, const float *x, const uint8_t *labels, size_t count);

/* FNV-1a over every parameter's bytes, and the plain sum of every parameter value. */
uint64_t fm_mlp_checksum(const fm_mlp_t *model, double *sum);

/* ---- optimisers (optim.c) ------------------------------------------------------------------ */

/* The optimizer kinds of --optim. The trainer steps with libddp's optimizer (ddp/shard.h) for
 * all of them; fm_optim_* below is the float SGD/Adam loop it ran before issue #31, kept as the
 * anchor build/optim-bandwidth times libddp's kernels against, and for the checkpoint format's
 * non-library optimizer state (test_trainer_units). */
enum { FM_OPTIM_SGD = 0, FM_OPTIM_ADAM = 1, FM_OPTIM_ADAMW = 2 };

typedef struct fm_optim {
    int kind;
    double lr, momentum, weight_decay, beta1, beta2, eps;
    uint64_t steps;                /* optimizer steps taken */
    float *state1[FM_NPARAMS];     /* SGD momentum buffer / Adam first moment */
    float *state2[FM_NPARAMS];     /* Adam second moment (NULL for SGD) */
    size_t numel[FM_NPARAMS];
} fm_optim_t;

int fm_optim_create(fm_optim_t *opt, const size_t numel[FM_NPARAMS]);
void fm_optim_destroy(fm_optim_t *opt);
/* One step of PyTorch's SGD (momentum, weight decay as L2, no dampening) or Adam (L2 weight
 * decay, bias correction). */
void fm_optim_step(fm_optim_t *opt, float *const params[FM_NPARAMS],
                   float *const grads[FM_NPARAMS]);

/* ---- checkpoints (checkpoint.c) ------------------------------------------------------------ */

/* What must match between the run that wrote a checkpoint and the run resuming it. */
typedef struct fm_hyper {
    uint64_t hidden, batch, accumulate, subset, seed, optim;
    uint64_t hook; /* the Reducer's comm hook (main.c's FM_HOOK_*): it changes the gradients */
    double lr, momentum, weight_decay, beta1, beta2, eps;
    uint64_t library_optim; /* 1: the optimizer state is libddp's (ddp/shard.h) blob */
    uint64_t lr_schedule, warmup_steps, schedule_steps; /* schedule_steps: its length (0: none) */
    double clip_grad;
    uint64_t param_bf16;
} fm_hyper_t;

/* What a checkpoint holds besides the model and the trainer's own optimizer state. */
typedef struct fm_extra {
    void *optim_state; /* libddp's optimizer state, consolidated (hyper.library_optim) */
    size_t optim_state_bytes;
    uint64_t hook_ranks; /* PowerSGD: one state per rank (its residual is local); 0: none */
    void **hook_state;
    size_t *hook_state_bytes;
} fm_extra_t;

/* Frees what fm_checkpoint_load allocated in extra. */
void fm_extra_free(fm_extra_t *extra);

/* Where training stands. */
typedef struct fm_progress {
    uint64_t epoch;         /* the epoch to run next (or continue) */
    uint64_t step_in_epoch; /* optimizer steps already done in that epoch */
    uint64_t global_step;   /* optimizer steps done in total */
    double loss_sum;        /* sum of global step losses so far in this epoch */
    uint64_t loss_count;
    double last_epoch_loss; /* mean global loss of the last completed epoch (NaN: none yet) */
} fm_progress_t;

/* Writes atomically: a temporary file next to `path`, fsync, rename, fsync of the directory.
 * The optimizer state is `opt`'s, or extra->optim_state when hyper->library_optim; extra's
 * hook states follow (extra may be NULL without them). */
int fm_checkpoint_save(const char *path, const fm_hyper_t *hyper, const fm_progress_t *progress,
                       const fm_mlp_t *model, const fm_optim_t *opt, const fm_extra_t *extra,
                       char *err, size_t errlen);
/* Verifies magic, version, size and checksum, compares hyperparameters with `hyper` (a mismatch
 * names the field and both values), then fills progress, parameters and optimizer state: `opt`'s,
 * or a copy of the library state in extra (hyper->library_optim), with the hook states (each
 * allocated: fm_extra_free). extra may be NULL when neither can be present. */
int fm_checkpoint_load(const char *path, const fm_hyper_t *hyper, fm_progress_t *progress,
                       fm_mlp_t *model, fm_optim_t *opt, fm_extra_t *extra, char *err,
                       size_t errlen);

#endif
