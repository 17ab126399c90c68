/* The GPT trainer's parts: a GPT-2-style decoder (forward and backward by hand, matrix products
 * through CBLAS) and the byte-level fortunes dataset. main.c wires them to a libddp process group,
 * Reducer and optimizer. Nothing here communicates. */
#ifndef GPT_H
#define GPT_H

#include <stddef.h>
#include <stdint.h>

#define GPT_VOCAB 256 /* byte-level: every byte is a token (docs/gpt.md says why) */
#define GPT_LAYER_TENSORS 12

typedef struct gpt_config {
    size_t layers, heads, channels, context; /* channels % heads == 0 */
} gpt_config_t;

/* Tensor kinds, in the order they are laid out: wte, wpe, then per layer the 12 block tensors,
 * then the final layer norm. Layer-major so that one layer's gradients are adjacent in the
 * gradient block and backward finishes them together. */
enum {
    GPT_LN1W, GPT_LN1B, GPT_QKVW, GPT_QKVB, GPT_ATTPROJW, GPT_ATTPROJB,
    GPT_LN2W, GPT_LN2B, GPT_FCW, GPT_FCB, GPT_FCPROJW, GPT_FCPROJB
};

typedef struct gpt_tensor {
    char name[32];
    size_t offset; /* elements into the parameter (and gradient) block */
    size_t numel;
    size_t rows; /* matrix rows, 0 for a vector */
} gpt_tensor_t;

/* Phases of forward and backward timed when gpt_t.profile is set (--profile): where a step's
 * compute goes, for the comparison with PyTorch (docs/gpt.md). */
enum {
    GPT_PHASE_MATMUL_FWD, GPT_PHASE_MATMUL_BWD, GPT_PHASE_ATTN_FWD, GPT_PHASE_ATTN_BWD,
    GPT_PHASE_LAYERNORM, GPT_PHASE_GELU, GPT_PHASE_SOFTMAX_LOSS, GPT_PHASE_ELEMENTWISE,
    GPT_NPHASES
};
extern const char *const gpt_phase_names[GPT_NPHASES];

/* Events of gpt_t.layer_hook: before block l's forward, after it, and before its backward. */
enum { GPT_HOOK_FORWARD, GPT_HOOK_FORWARD_DONE, GPT_HOOK_BACKWARD };
typedef int (*gpt_layer_hook_fn)(void *ctx, size_t layer, int event);

typedef struct gpt {
    gpt_config_t cfg;
    size_t ntensors; /* 2 + 12 * layers + 2 */
    gpt_tensor_t *tensors;
    size_t nparams; /* elements in total */
    float *params;  /* one block, tensors at their offsets (NULL when sharded: see param_at) */
    /* Where each tensor's values are read from: into params by default. A sharded trainer
     * (--zero 3) points them at gathered units from layer_hook before a block is computed, and
     * grad_at at the units' gradient buffers (gpt_backward with grads NULL). */
    float **param_at, **grad_at;
    gpt_layer_hook_fn layer_hook; /* NULL: none; non-zero return stops (forward returns NaN) */
    void *hook_ctx;
    int hook_rc; /* what the hook returned when it stopped forward */
    /* activations for up to max_batch sequences of cfg.context tokens */
    size_t max_batch;
    float *acts;
    size_t acts_numel;
    float *dacts; /* scratch for backward */
    size_t dacts_numel;
    /* set by forward */
    size_t B, T;
    const int *targets;
    int profile;                    /* accumulate phase_seconds (a clock read per kernel call) */
    double phase_seconds[GPT_NPHASES];
} gpt_t;

/* Tensor index of kind k in layer l; of wte, wpe, lnf w/b. */
#define GPT_WTE 0
#define GPT_WPE 1
#define GPT_T(l, k) (2 + (size_t)(l) * GPT_LAYER_TENSORS + (size_t)(k))
#define GPT_LNFW(m) ((m)->ntensors - 2)
#define GPT_LNFB(m) ((m)->ntensors - 1)

/* Allocates the model (parameters initialised as GPT-2: N(0, 0.02), residual projections
 * N(0, 0.02/sqrt(2L)), biases 0, layer norms 1/0) for batches of up to max_batch sequences.
 * Returns -1 with a message in err on a bad configuration or no memory. */
int gpt_create(const gpt_config_t *cfg, size_t max_batch, uint64_t seed, gpt_t *out, char *err,
               size_t errlen);
void gpt_destroy(gpt_t *m);

/* Forward over B sequences of T tokens (T <= context, B <= max_batch). With targets (B*T), the
 * mean cross-entropy is returned; without, NaN. Logits of the last forward: gpt_logits. */
double gpt_forward(gpt_t *m, const int *tokens, const int *targets, size_t B, size_t T);
const float *gpt_logits(const gpt_t *m);

/* Called when every gradient of tensors [first, first + count) is final (a layer's 12, the
 * final layer norm's 2, then wpe and wte). Non-zero stops backward with that value. */
typedef int (*gpt_ready_fn)(void *ctx, size_t first, size_t count);

/* Called when rows [row_begin, row_end) of matrix tensor `tensor`'s gradient are final. */
typedef int (*gpt_rows_fn)(void *ctx, size_t tensor, size_t row_begin, size_t row_end);

/* Each block matrix's weight gradient is computed in this many row tiles (one GEMM each),
 * whether or not they are reported, so reporting them changes no bit. */
#define GPT_GRAD_TILES 4

/* After gpt_forward with targets: gradients of `scale` * (mean loss) ACCUMULATED into grads (a
 * block laid out as the parameters; NULL: into m->grad_at[i] for tensor i). Reports finished tensors through ready (may be NULL),
 * highest layer first, and, when rows is not NULL, each row tile of a block's four matrices as
 * it is computed (before that layer's ready). Returns 0 or the callbacks' non-zero value. */
int gpt_backward(gpt_t *m, const int *tokens, float scale, float *grads, gpt_ready_fn ready,
                 gpt_rows_fn rows, void *ctx);

/* Samples n bytes after `prompt` (temperature 1, top-k off) with the given random state. */
void gpt_generate(gpt_t *m, const char *prompt, size_t n, uint64_t *rng, char *out);

uint64_t gpt_splitmix64(uint64_t *state);

/* ---- data (data.c) --------------------------------------------------------------------------- */

typedef struct gpt_text {
    uint8_t *bytes;
    size_t len;
} gpt_text_t;

/* Reads every fortune file of `dir` (not the .dat indexes nor the .u8 links), sorted by name,
 * concatenated. The last val_fraction of the text is the validation split. Returns -1 with a
 * message naming the directory and the Debian package when the data is missing. */
int gpt_text_load(const char *dir, double val_fraction, gpt_text_t *train, gpt_text_t *val,
                  char *err, size_t errlen);
void gpt_text_free(gpt_text_t *t);

/* A permutation of 0..n-1 that depends only on (seed, epoch). */
void gpt_permutation(uint64_t seed, uint64_t epoch, size_t n, uint32_t *perm);

/* ---- checkpoints (checkpoint.c) ---------------------------------------------------------------
 * One file: a header (magic, the hyperparameters a resumed run must share, the steps done), the
 * parameters, libddp's optimizer state consolidated to whole parameters (the plain optimizer's
 * format, which ZeRO also loads at any world size), and an FNV-1a checksum of all of it. */

#define GPT_CKPT_MAGIC "GPTCKPT1"
enum { GPT_CK_LAYERS, GPT_CK_HEADS, GPT_CK_CHANNELS, GPT_CK_CONTEXT, GPT_CK_BATCH,
       GPT_CK_ACCUMULATE, GPT_CK_STEPS, GPT_CK_WARMUP, GPT_CK_SEED, GPT_CK_BF16, GPT_CK_NU };
enum { GPT_CK_LR, GPT_CK_MIN_LR, GPT_CK_WD, GPT_CK_CLIP, GPT_CK_VAL, GPT_CK_ND };

typedef struct gpt_ckpt_header {
    char magic[8];
    uint64_t u[GPT_CK_NU];
    double d[GPT_CK_ND];
    uint64_t steps_done, nparams, state_bytes;
} gpt_ckpt_header_t;

/* Writes h, nparams floats of params, h->state_bytes of state and the checksum to a temporary
 * file, fsyncs it and renames it over path. Returns 0, or -1 with a message in err. */
int gpt_checkpoint_write(const char *path, const gpt_ckpt_header_t *h, const float *params,
                         const void *state, char *err, size_t errlen);

/* Reads a checkpoint written for want (every hyperparameter in u and d must match, and nparams;
 * steps_done must be at most max_steps; the file must be exactly as long as its header says)
 * into params (want->nparams floats) and a malloc'd copy of the optimizer state (*state,
 * *state_bytes: the caller frees it), and *steps_done. Returns 0, or -1 with a message in err
 * naming the file and what is wrong; then params may have been overwritten. It allocates at most
 * the file's size. */
int gpt_checkpoint_read(const char *path, const gpt_ckpt_header_t *want, uint64_t max_steps,
                        float *params, void **state, size_t *state_bytes, uint64_t *steps_done,
                        char *err, size_t errlen);

#endif
