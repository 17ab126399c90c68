/* PowerSGD communication hook (libddp_powersgd). The hook call, on the thread that drives the
 * reducer, plans the bucket (which tensors are compressed, where their P and Q live), draws the
 * seed for Q when needed and counts statistics; one task on the group's progress thread then
 * does the numeric work with its three allreduces (uncompressed tensors, P's, Q's), so backward
 * goes on meanwhile. Uses only libddp's public API, so it links against libddp like a user's
 * library would. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "ddp/powersgd.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

#ifdef DDP_POWERSGD_OPENBLAS_THREADS
void openblas_set_num_threads(int num_threads);
#endif

typedef struct psgd_matrix {
    size_t offset; /* element offset of the matrix in the bucket */
    size_t n, m, r;
    size_t p_offset, q_offset;
} psgd_matrix_t;

typedef struct psgd_span {
    size_t offset, numel;
} psgd_span_t;

/* Everything about one bucket index: its layout (to notice the reducer's rebuild), the plan,
 * and the memory kept across iterations (Q for warm start, the residual for error feedback). The
 * hook writes it before submitting the task; the task owns it until the work completes; the
 * reducer finalizes before the same bucket comes back, which orders the two. */
typedef struct psgd_slot {
    size_t index;
    ddp_dtype_t dtype;
    size_t numel;
    size_t nparams;
    size_t *layout; /* nparams x (offset, numel, rows) */

    size_t ncomp, nplain;
    psgd_matrix_t *comp;
    psgd_span_t *plain_spans;
    size_t p_numel, q_numel, plain_numel;
    size_t tensor_numel; /* sum of the tensors' elements (PyTorch's numel before compression) */
    void *p, *q, *plain, *error; /* error: the residual, and the input while a task runs */
    int have_q, have_error;

    /* Per call. */
    void *data;
    int randomize;
    uint64_t seed;
    int use_error_feedback, warm_start;
    double epsilon;
} psgd_slot_t;

struct ddp_powersgd_state {
    ddp_powersgd_config_t config;
    uint64_t rng; /* draws the per-use seeds of Q, identically on every rank */
    psgd_slot_t **slots;
    size_t nslots;
    ddp_powersgd_stats_t stats;
};

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define REAL float
#define FN(x) x##_f32
#define GEMM cblas_sgemm
#include "powersgd_kernels.inc"
#undef REAL
#undef FN
#undef GEMM

#define REAL double
#define FN(x) x##_f64
#define GEMM cblas_dgemm
#include "powersgd_kernels.inc"
#undef REAL
#undef FN
#undef GEMM

/* status.h: a success leaves no stale error text. libddp's internal ddp__clear_error is not
 * exported to this library; ddp_hook_error with DDP_OK and an empty message clears it. */
static void clear_error(void) { (void)ddp_hook_error(DDP_OK, "%s", ""); }

int ddp_powersgd_should_compress(size_t n, size_t m, int rank, double min_compression_rate)
{
    if (n == 0 || m == 0 || rank < 1) return 0;
    size_t r = (size_t)rank;
    if (r > n) r = n;
    if (r > m) r = m;
    double compressed = (double)(n + m) * (double)r;
    double uncompressed = (double)n * (double)m;
    return compressed * min_compression_rate < uncompressed;
}

void ddp_powersgd_config_init(ddp_powersgd_config_t *config)
{
    clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (!config) return;
    ddp_powersgd_config_t defaults = DDP_POWERSGD_CONFIG_INIT;
    *config = defaults;
}

ddp_status_t ddp_powersgd_state_create(const ddp_powersgd_config_t *config,
                                       ddp_powersgd_state_t **out)
{
    clear_error();
    if (!out) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state: out is NULL");
    if (!config)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: config is NULL (start from "
                              "DDP_POWERSGD_CONFIG_INIT)");
    if (config->matrix_approximation_rank < 1)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: matrix_approximation_rank is %d, must be >= 1",
                              config->matrix_approximation_rank);
    if (!(config->min_compression_rate >= 0) || isinf(config->min_compression_rate))
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: min_compression_rate is %g, must be finite and "
                              ">= 0",
                              config->min_compression_rate);
    if (!(config->orthogonalization_epsilon >= 0) || isinf(config->orthogonalization_epsilon))
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: orthogonalization_epsilon is %g, must be finite "
                              "and >= 0",
                              config->orthogonalization_epsilon);
    if (config->use_error_feedback != 0 && config->use_error_feedback != 1)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: use_error_feedback is %d, must be 0 or 1",
                              config->use_error_feedback);
    if (config->warm_start != 0 && config->warm_start != 1)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                              "PowerSGD state: warm_start is %d, must be 0 or 1",
                              config->warm_start);
    ddp_powersgd_state_t *s = calloc(1, sizeof *s);
    if (!s) return ddp_hook_error(DDP_ERR_NO_MEMORY, "PowerSGD state: out of memory");
    s->config = *config;
    s->rng = config->random_seed;
#ifdef DDP_POWERSGD_OPENBLAS_THREADS
    openblas_set_num_threads(1);
#endif
    *out = s;
    return DDP_OK;
}

static void slot_release(psgd_slot_t *s)
{
    free(s->layout);
    free(s->comp);
    free(s->plain_spans);
    free(s->p);
    free(s->q);
    free(s->plain);
    free(s->error);
    memset(s, 0, sizeof *s);
}

void ddp_powersgd_state_destroy(ddp_powersgd_state_t *state)
{
    if (!state) return;
    for (size_t i = 0; i < state->nslots; i++) {
        if (state->slots[i]) slot_release(state->slots[i]);
        free(state->slots[i]);
    }
    free(state->slots);
    free(state);
}

ddp_status_t ddp_powersgd_stats(const ddp_powersgd_state_t *state, ddp_powersgd_stats_t *out)
{
    clear_error();
    if (!state) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD stats: state is NULL");
    if (!out) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD stats: out is NULL");
    *out = state->stats;
    out->compression_rate = state->stats.numel_after
                                ? (double)state->stats.numel_before /
                                      (double)state->stats.numel_after
                                : 0.0;
    return DDP_OK;
}

/* The bucket's parameters as (offset, numel, rows) triples; a bucket without parameter
 * information is one vector. */
static size_t bucket_layout(const ddp_comm_bucket_t *b, size_t *out)
{
    if (b->nparams == 0 || !b->offsets || !b->numels) {
        if (out) {
            out[0] = 0;
            out[1] = b->numel;
            out[2] = 0;
        }
        return 1;
    }
    if (out)
        for (size_t i = 0; i < b->nparams; i++) {
            out[3 * i] = b->offsets[i];
            out[3 * i + 1] = b->numels[i];
            out[3 * i + 2] = b->rows ? b->rows[i] : 0;
        }
    return b->nparams;
}

/* Decides which tensors are compressed and allocates the slot's memory. */
static ddp_status_t slot_plan(psgd_slot_t *s, const ddp_powersgd_config_t *cfg,
                              const ddp_comm_bucket_t *b)
{
    size_t np = bucket_layout(b, NULL);
    size_t esize = ddp_dtype_size(b->dtype);
    s->index = b->index;
    s->dtype = b->dtype;
    s->numel = b->numel;
    s->nparams = np;
    s->layout = malloc(np * 3 * sizeof(size_t));
    s->comp = calloc(np, sizeof *s->comp);
    s->plain_spans = calloc(np, sizeof *s->plain_spans);
    if (!s->layout || !s->comp || !s->plain_spans) goto no_memory;
    bucket_layout(b, s->layout);
    for (size_t i = 0; i < np; i++) {
        size_t offset = s->layout[3 * i], numel = s->layout[3 * i + 1], n = s->layout[3 * i + 2];
        if (offset > b->numel || numel > b->numel - offset)
            return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                                  "PowerSGD hook: bucket %zu parameter %zu spans elements "
                                  "[%zu, %zu) beyond the bucket's %zu",
                                  b->index, i, offset, offset + numel, b->numel);
        size_t m = n > 1 ? numel / n : 0;
        s->tensor_numel += numel;
        /* CBLAS takes int dimensions: a larger matrix goes uncompressed. */
        if (n > 1 && numel % n == 0 && n <= INT_MAX && m <= INT_MAX &&
            ddp_powersgd_should_compress(n, m, cfg->matrix_approximation_rank,
                                         cfg->min_compression_rate)) {
            size_t r = (size_t)cfg->matrix_approximation_rank;
            if (r > n) r = n;
            if (r > m) r = m;
            psgd_matrix_t *mx = &s->comp[s->ncomp++];
            mx->offset = offset;
            mx->n = n;
            mx->m = m;
            mx->r = r;
            mx->p_offset = s->p_numel;
            mx->q_offset = s->q_numel;
            s->p_numel += n * r;
            s->q_numel += m * r;
        } else if (numel > 0) {
            s->plain_spans[s->nplain].offset = offset;
            s->plain_spans[s->nplain].numel = numel;
            s->nplain++;
            s->plain_numel += numel;
        }
    }
    s->p = calloc(s->p_numel ? s->p_numel : 1, esize);
    s->q = calloc(s->q_numel ? s->q_numel : 1, esize);
    s->plain = calloc(s->plain_numel ? s->plain_numel : 1, esize);
    s->error = calloc(s->numel ? s->numel : 1, esize);
    if (!s->p || !s->q || !s->plain || !s->error) goto no_memory;
    return DDP_OK;
no_memory:
    return ddp_hook_error(DDP_ERR_NO_MEMORY,
                          "PowerSGD hook: out of memory planning bucket %zu (%zu elements)",
                          b->index, b->numel);
}

/* Same layout as last time? Then Q and the residual carry over. */
static int slot_matches(const psgd_slot_t *s, const ddp_comm_bucket_t *b)
{
    if (!s->layout || s->dtype != b->dtype || s->numel != b->numel) return 0;
    size_t np = bucket_layout(b, NULL);
    if (np != s->nparams) return 0;
    size_t tmp[3];
    for (size_t i = 0; i < np; i++) {
        if (b->nparams == 0 || !b->offsets || !b->numels) {
            bucket_layout(b, tmp);
        } else {
            tmp[0] = b->offsets[i];
            tmp[1] = b->numels[i];
            tmp[2] = b->rows ? b->rows[i] : 0;
        }
        if (memcmp(tmp, s->layout + 3 * i, sizeof tmp) != 0) return 0;
    }
    return 1;
}

static ddp_status_t slot_for(ddp_powersgd_state_t *st, const ddp_comm_bucket_t *b,
                             psgd_slot_t **out)
{
    if (b->index >= st->nslots) {
        size_t n = b->index + 1;
        psgd_slot_t **grown = realloc(st->slots, n * sizeof *grown);
        if (!grown)
            return ddp_hook_error(DDP_ERR_NO_MEMORY, "PowerSGD hook: out of memory for bucket "
                                  "%zu", b->index);
        for (size_t i = st->nslots; i < n; i++) grown[i] = NULL;
        st->slots = grown;
        st->nslots = n;
    }
    psgd_slot_t *s = st->slots[b->index];
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s)
            return ddp_hook_error(DDP_ERR_NO_MEMORY, "PowerSGD hook: out of memory for bucket "
                                  "%zu", b->index);
        st->slots[b->index] = s;
    }
    if (!slot_matches(s, b)) {
        /* First use, or the reducer rebuilt its buckets: start over (fresh Q, no residual). */
        slot_release(s);
        ddp_status_t r = slot_plan(s, &st->config, b);
        if (r != DDP_OK) {
            slot_release(s);
            return r;
        }
    }
    *out = s;
    return DDP_OK;
}

static ddp_status_t powersgd_task(ddp_group_t *group, void *arg)
{
    psgd_slot_t *s = arg;
    ddp_status_t r = s->dtype == DDP_F32 ? run_f32(group, s) : run_f64(group, s);
    if (r != DDP_OK) {
        /* Half-done: the residual buffer holds the input. Start clean if the bucket comes back
         * (after a failure the group is broken anyway). */
        s->have_error = 0;
        s->have_q = 0;
    }
    return r;
}

ddp_status_t ddp_powersgd_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                               ddp_work_t **work)
{
    clear_error();
    ddp_powersgd_state_t *st = state;
    if (!st)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: state is NULL (create "
                              "it with ddp_powersgd_state_create)");
    if (!group) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: group is NULL");
    if (!bucket) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: bucket is NULL");
    if (!work) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: work is NULL");
    if (bucket->numel > 0 && !bucket->data)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: bucket %zu has %zu "
                              "elements but no data", bucket->index, bucket->numel);
    size_t esize = ddp_dtype_size(bucket->dtype);
    if (esize == 0)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: bucket %zu has dtype "
                              "%d, which is not a ddp_dtype_t", bucket->index,
                              (int)bucket->dtype);
    if (bucket->numel > SIZE_MAX / esize)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: bucket %zu: numel %zu "
                              "of %s overflows a byte count", bucket->index, bucket->numel,
                              ddp_dtype_name(bucket->dtype));
    if (bucket->nparams > 0 && bucket->offsets && bucket->numels && bucket->rows) {
        /* The Reducer guarantees this; a hand-made bucket may not. */
        for (size_t i = 0; i < bucket->nparams; i++)
            if (bucket->rows[i] > 1 && bucket->numels[i] % bucket->rows[i] != 0)
                return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD hook: bucket %zu "
                                      "parameter %zu: rows %zu does not divide its %zu "
                                      "elements", bucket->index, i, bucket->rows[i],
                                      bucket->numels[i]);
    }
    if (bucket->dtype == DDP_I32 || bucket->dtype == DDP_I64 || bucket->dtype == DDP_U8)
        return ddp_hook_error(DDP_ERR_UNSUPPORTED, "PowerSGD hook: bucket %zu has dtype %s; "
                              "only floating-point gradients can be reduced", bucket->index,
                              ddp_dtype_name(bucket->dtype));
    size_t bytes = bucket->numel * esize;

    /* Vanilla allreduce before start_powersgd_iter, and for half-precision buckets. */
    if (bucket->iteration < st->config.start_powersgd_iter || bucket->dtype == DDP_F16 ||
        bucket->dtype == DDP_BF16) {
        ddp_status_t r = ddp_group_allreduce_async(group, bucket->data, bucket->data,
                                                   bucket->numel, bucket->dtype, DDP_SUM, work);
        if (r != DDP_OK) return r;
        st->stats.plain_buckets++;
        st->stats.wire.buckets++;
        st->stats.wire.numel += bucket->numel;
        st->stats.wire.bytes_before += bytes;
        st->stats.wire.bytes_after += bytes;
        return DDP_OK;
    }

    psgd_slot_t *s = NULL;
    ddp_status_t r = slot_for(st, bucket, &s);
    if (r != DDP_OK) return r;
    s->data = bucket->data;
    s->use_error_feedback = st->config.use_error_feedback;
    s->warm_start = st->config.warm_start;
    s->epsilon = st->config.orthogonalization_epsilon;
    s->randomize = !s->have_q;
    uint64_t rng = st->rng;
    if (s->randomize) s->seed = splitmix64(&rng);
    r = ddp_group_submit(group, powersgd_task, s, work);
    if (r != DDP_OK) return r;
    st->rng = rng; /* only a submitted bucket consumes a seed, so ranks stay in step */

    size_t after = s->p_numel + s->q_numel + s->plain_numel;
    st->stats.numel_before += s->tensor_numel;
    st->stats.numel_after += after;
    st->stats.compressed_tensors += s->ncomp;
    st->stats.uncompressed_tensors += s->nparams - s->ncomp;
    st->stats.powersgd_buckets++;
    st->stats.wire.buckets++;
    st->stats.wire.numel += bucket->numel;
    st->stats.wire.bytes_before += bytes;
    st->stats.wire.bytes_after += after * esize;
    return DDP_OK;
}
