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
    size_t *param_ids; /* the Reducer's parameter index of each (NULL: not given) */

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
    /* Added to the Reducer's iteration count: a state loaded from a checkpoint continues the
     * saved run's count, while the new Reducer counts from 0 again. */
    uint64_t iteration_offset;
    uint64_t next_iteration; /* one past the largest iteration seen (offset included) */
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
    free(s->param_ids);
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
    if (b->nparams > 0 && b->params && b->offsets && b->numels) {
        s->param_ids = malloc(np * sizeof(size_t));
        if (!s->param_ids) goto no_memory;
        memcpy(s->param_ids, b->params, np * sizeof(size_t));
    }
    for (size_t i = 0; i < np; i++) {
        size_t offset = s->layout[3 * i], numel = s->layout[3 * i + 1], n = s->layout[3 * i + 2];
        if (offset > b->numel || numel > b->numel - offset)
            return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                                  "PowerSGD hook: bucket %zu parameter %zu spans elements "
                                  "[%zu, %zu) beyond the bucket's %zu",
                                  b->index, i, offset, offset + numel, b->numel);
        size_t m = n > 1 ? numel / n : 0;
        s->tensor_numel += numel;
        /* A Reducer's parameters never overlap. Overlapping ones would each get their own P, Q
         * or uncompressed span: memory growing with parameters x bucket size, not with the
         * bucket (a saved state of a few KiB could ask for gigabytes). */
        if (s->tensor_numel > b->numel)
            return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT,
                                  "PowerSGD hook: bucket %zu's parameters 0..%zu span %zu "
                                  "elements in all, more than the bucket's %zu (they overlap)",
                                  b->index, i, s->tensor_numel, b->numel);
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

/* The same parameters in another order (the Reducer's one-time rebuild, or a resumed run whose
 * new Reducer starts from its initial layout): carries Q and the residual over, parameter by
 * parameter, into `fresh` (planned for the new layout). Each matrix's arithmetic is the same
 * wherever it sits in the bucket (the allreduces are elementwise), so the run continues as if
 * nothing had moved. Returns 0 (nothing carried) when the parameters differ or are not known,
 * or when Q is redrawn every iteration (warm_start 0: its draw depends on the layout). */
static int slot_carry(const psgd_slot_t *old, psgd_slot_t *fresh, int warm_start)
{
    if (!old->layout || !old->param_ids || !fresh->param_ids || old->dtype != fresh->dtype ||
        old->numel != fresh->numel || old->nparams != fresh->nparams ||
        (old->have_q && !warm_start))
        return 0;
    size_t es = ddp_dtype_size(fresh->dtype), np = fresh->nparams;
    size_t *from = malloc(np * sizeof *from);
    if (!from) return 0;
    for (size_t j = 0; j < np; j++) {
        size_t k = 0;
        while (k < np && old->param_ids[k] != fresh->param_ids[j]) k++;
        if (k == np || old->layout[3 * k + 1] != fresh->layout[3 * j + 1] ||
            old->layout[3 * k + 2] != fresh->layout[3 * j + 2]) {
            free(from);
            return 0;
        }
        from[j] = k;
    }
    for (size_t j = 0; j < np; j++) {
        size_t k = from[j], o_off = old->layout[3 * k], n_off = fresh->layout[3 * j];
        if (old->have_error)
            memcpy((char *)fresh->error + n_off * es, (const char *)old->error + o_off * es,
                   fresh->layout[3 * j + 1] * es);
        if (!old->have_q) continue;
        /* The compression decision depends on the shape only: both plans agree. */
        for (size_t a = 0; a < fresh->ncomp; a++) {
            if (fresh->comp[a].offset != n_off) continue;
            for (size_t c = 0; c < old->ncomp; c++)
                if (old->comp[c].offset == o_off)
                    memcpy((char *)fresh->q + fresh->comp[a].q_offset * es,
                           (const char *)old->q + old->comp[c].q_offset * es,
                           fresh->comp[a].m * fresh->comp[a].r * es);
        }
    }
    fresh->have_q = old->have_q;
    fresh->have_error = old->have_error;
    free(from);
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
        /* First use, or the reducer rebuilt its buckets: the same parameters reordered keep
         * their Q and residual; anything else starts over (fresh Q, no residual). */
        psgd_slot_t fresh;
        memset(&fresh, 0, sizeof fresh);
        ddp_status_t r = slot_plan(&fresh, &st->config, b);
        if (r != DDP_OK) {
            slot_release(&fresh);
            return r;
        }
        slot_carry(s, &fresh, st->config.warm_start);
        slot_release(s);
        *s = fresh;
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
    /* Uneven inputs (the Reducer's config.join): the joined ranks' zeros would enter the
     * low-rank factors and their error feedback, which have no notion of a smaller divisor. */
    if (bucket->contributors > 0 && bucket->contributors < ddp_group_size(group))
        return ddp_hook_error(DDP_ERR_INVALID_USAGE, "PowerSGD hook: bucket %zu: only %d of %d "
                              "ranks have data (a rank called ddp_reducer_join): PowerSGD with "
                              "uneven inputs (config.join) is not supported",
                              bucket->index, bucket->contributors, ddp_group_size(group));
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

    uint64_t iteration = bucket->iteration + st->iteration_offset;
    if (iteration + 1 > st->next_iteration) st->next_iteration = iteration + 1;
    /* Vanilla allreduce before start_powersgd_iter, and for half-precision buckets. */
    if (iteration < st->config.start_powersgd_iter || bucket->dtype == DDP_F16 ||
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

/* ---- saved state ------------------------------------------------------------------------------
 * What a resumed run needs to continue bitwise: the seed generator, the iteration count, the
 * statistics, and per bucket its layout, Q (warm start) and the local residual (error feedback).
 * P and the uncompressed buffer are recomputed every iteration. Layout (native byte order):
 *   u64 magic "DDPPSGD1" | config fields | u64 rng, next_iteration | stats | u64 nslots |
 *   per slot: u64 present; if present: u64 index, dtype, numel, nparams, have_q, have_error,
 *   have_ids, 3 x nparams u64 layout, [nparams u64 parameter indices], q (q_numel elements),
 *   error (numel elements) | u64 checksum */
#define PSGD_MAGIC 0x3144474753505044ull /* "DDPPSGD1" */

typedef struct psgd_writer {
    unsigned char *p; /* NULL: only count */
    size_t len;
} psgd_writer_t;

static void w_put(psgd_writer_t *w, const void *x, size_t n)
{
    if (w->p && n) memcpy(w->p + w->len, x, n);
    w->len += n;
}

static void w_u64(psgd_writer_t *w, uint64_t v) { w_put(w, &v, 8); }

static uint64_t psgd_fnv1a(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static void write_state(const ddp_powersgd_state_t *st, psgd_writer_t *w)
{
    const ddp_powersgd_config_t *c = &st->config;
    w_u64(w, PSGD_MAGIC);
    w_u64(w, (uint64_t)c->matrix_approximation_rank);
    w_u64(w, c->start_powersgd_iter);
    w_put(w, &c->min_compression_rate, 8);
    w_u64(w, (uint64_t)c->use_error_feedback);
    w_u64(w, (uint64_t)c->warm_start);
    w_put(w, &c->orthogonalization_epsilon, 8);
    w_u64(w, c->random_seed);
    w_u64(w, st->rng);
    w_u64(w, st->next_iteration);
    w_put(w, &st->stats, sizeof st->stats);
    w_u64(w, st->nslots);
    for (size_t i = 0; i < st->nslots; i++) {
        const psgd_slot_t *s = st->slots[i];
        int present = s && s->layout;
        w_u64(w, (uint64_t)present);
        if (!present) continue;
        size_t es = ddp_dtype_size(s->dtype);
        w_u64(w, s->index);
        w_u64(w, (uint64_t)s->dtype);
        w_u64(w, s->numel);
        w_u64(w, s->nparams);
        w_u64(w, (uint64_t)s->have_q);
        w_u64(w, (uint64_t)s->have_error);
        w_u64(w, (uint64_t)(s->param_ids != NULL));
        w_put(w, s->layout, 3 * s->nparams * sizeof(size_t));
        if (s->param_ids) w_put(w, s->param_ids, s->nparams * sizeof(size_t));
        w_put(w, s->q, s->q_numel * es);
        w_put(w, s->error, s->numel * es);
    }
}

ddp_status_t ddp_powersgd_state_size(const ddp_powersgd_state_t *state, size_t *bytes)
{
    clear_error();
    if (!state)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state size: state is NULL");
    if (!bytes)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state size: bytes is NULL");
    psgd_writer_t w = {NULL, 0};
    write_state(state, &w);
    *bytes = w.len + 8;
    return DDP_OK;
}

ddp_status_t ddp_powersgd_state_save(const ddp_powersgd_state_t *state, void *buf, size_t size)
{
    clear_error();
    if (!state)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state save: state is NULL");
    if (!buf) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state save: buf is NULL");
    psgd_writer_t w = {NULL, 0};
    write_state(state, &w);
    if (size < w.len + 8)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "PowerSGD state save: size is %zu bytes, "
                              "the state needs %zu", size, w.len + 8);
    w.p = buf;
    w.len = 0;
    write_state(state, &w);
    uint64_t sum = psgd_fnv1a(buf, w.len);
    memcpy(w.p + w.len, &sum, 8);
    return DDP_OK;
}

typedef struct psgd_reader {
    const unsigned char *p;
    size_t left;
} psgd_reader_t;

static int r_get(psgd_reader_t *r, void *out, size_t n)
{
    if (r->left < n) return -1;
    if (n) memcpy(out, r->p, n);
    r->p += n;
    r->left -= n;
    return 0;
}

static int r_u64(psgd_reader_t *r, uint64_t *v) { return r_get(r, v, 8); }

/* What the header of a saved state carries besides the config (which must match). */
typedef struct psgd_header {
    uint64_t rng, next, nslots;
    ddp_powersgd_stats_t stats;
} psgd_header_t;

/* Checks the size, magic and checksum of buf, reads its header and checks its config against c;
 * leaves r at the first slot record. */
static ddp_status_t read_header(const ddp_powersgd_config_t *c, const void *buf, size_t size,
                                psgd_reader_t *r, psgd_header_t *h, const char *who)
{
    if (size < 16)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: %zu bytes are too few", who, size);
    uint64_t magic, stored;
    memcpy(&magic, buf, 8);
    if (magic != PSGD_MAGIC)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: not a PowerSGD state (bad magic)",
                              who);
    memcpy(&stored, (const unsigned char *)buf + size - 8, 8);
    if (psgd_fnv1a(buf, size - 8) != stored)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is corrupt or truncated "
                              "(%zu bytes, checksum mismatch)", who, size);
    *r = (psgd_reader_t){(const unsigned char *)buf + 8, size - 16};
    uint64_t rank, start, efb, warm, seed;
    double rate, eps;
    if (r_u64(r, &rank) || r_u64(r, &start) || r_get(r, &rate, 8) || r_u64(r, &efb) ||
        r_u64(r, &warm) || r_get(r, &eps, 8) || r_u64(r, &seed) || r_u64(r, &h->rng) ||
        r_u64(r, &h->next) || r_get(r, &h->stats, sizeof h->stats) || r_u64(r, &h->nslots))
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: truncated header", who);
    if (rank != (uint64_t)c->matrix_approximation_rank || start != c->start_powersgd_iter ||
        rate != c->min_compression_rate || efb != (uint64_t)c->use_error_feedback ||
        warm != (uint64_t)c->warm_start || eps != c->orthogonalization_epsilon ||
        seed != c->random_seed)
        return ddp_hook_error(DDP_ERR_MISMATCH, "%s: the state was saved with rank %llu, start "
                              "%llu, min_compression_rate %g, error feedback %llu, warm start "
                              "%llu, epsilon %g, seed %llu; this state's config differs", who,
                              (unsigned long long)rank, (unsigned long long)start, rate,
                              (unsigned long long)efb, (unsigned long long)warm, eps,
                              (unsigned long long)seed);
    if (h->nslots > r->left / 8)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: %llu buckets in %zu bytes", who,
                              (unsigned long long)h->nslots, r->left);
    return DDP_OK;
}

/* Reads slot i's record: *out is NULL for a bucket the hook had not seen, else a new slot,
 * planned from the saved layout as the hook planned it, with Q and the residual filled. */
static ddp_status_t read_slot(psgd_reader_t *r, const ddp_powersgd_config_t *c, size_t i,
                              const char *who, psgd_slot_t **out)
{
    uint64_t present, index, dtype, numel, nparams, have_q, have_error, have_ids;
    *out = NULL;
    if (r_u64(r, &present)) goto truncated;
    if (!present) return DDP_OK;
    if (r_u64(r, &index) || r_u64(r, &dtype) || r_u64(r, &numel) || r_u64(r, &nparams) ||
        r_u64(r, &have_q) || r_u64(r, &have_error) || r_u64(r, &have_ids))
        goto truncated;
    size_t es = ddp_dtype_size((ddp_dtype_t)dtype);
    if (index != i || (dtype != DDP_F32 && dtype != DDP_F64) || nparams == 0 ||
        nparams > r->left / (3 * sizeof(size_t)) || numel > r->left / es)
        return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: bucket %zu's record is "
                              "invalid (index %llu, dtype %llu, %llu parameters)", who, i,
                              (unsigned long long)index, (unsigned long long)dtype,
                              (unsigned long long)nparams);
    ddp_status_t status = DDP_OK;
    size_t *layout = malloc(3 * nparams * sizeof *layout);
    size_t *ids = malloc(nparams * sizeof *ids);
    size_t *offsets = malloc(nparams * sizeof *offsets);
    size_t *numels = malloc(nparams * sizeof *numels);
    size_t *rows = malloc(nparams * sizeof *rows);
    psgd_slot_t *slot = calloc(1, sizeof *slot);
    if (!layout || !ids || !offsets || !numels || !rows || !slot) {
        status = ddp_hook_error(DDP_ERR_NO_MEMORY, "%s: out of memory", who);
        goto done;
    }
    if (r_get(r, layout, 3 * nparams * sizeof *layout) ||
        (have_ids && r_get(r, ids, nparams * sizeof *ids))) {
        status = ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated", who);
        goto done;
    }
    for (size_t j = 0; j < nparams; j++) {
        offsets[j] = layout[3 * j];
        numels[j] = layout[3 * j + 1];
        rows[j] = layout[3 * j + 2];
    }
    /* The bucket as the hook saw it: plan it the same way, then fill Q and the residual. */
    ddp_comm_bucket_t b;
    memset(&b, 0, sizeof b);
    b.index = i;
    b.dtype = (ddp_dtype_t)dtype;
    b.numel = numel;
    b.nparams = nparams;
    b.params = have_ids ? ids : NULL;
    b.offsets = offsets;
    b.numels = numels;
    b.rows = rows;
    status = slot_plan(slot, c, &b);
    if (status == DDP_OK && !slot_matches(slot, &b))
        status = ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: bucket %zu's layout does not "
                                "plan back to itself", who, i);
    if (status == DDP_OK &&
        (r_get(r, slot->q, slot->q_numel * es) || r_get(r, slot->error, numel * es)))
        status = ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated", who);
    if (status == DDP_OK) {
        slot->have_q = (int)have_q;
        slot->have_error = (int)have_error;
    }
done:
    free(layout);
    free(ids);
    free(offsets);
    free(numels);
    free(rows);
    if (status != DDP_OK && slot) {
        slot_release(slot);
        free(slot);
    }
    if (status == DDP_OK) *out = slot;
    return status;
truncated:
    return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated", who);
}

static void free_slots(psgd_slot_t **slots, size_t nslots)
{
    for (size_t i = 0; i < nslots; i++) {
        if (slots[i]) slot_release(slots[i]);
        free(slots[i]);
    }
    free(slots);
}

ddp_status_t ddp_powersgd_state_load(ddp_powersgd_state_t *state, const void *buf, size_t size)
{
    clear_error();
    const char *who = "PowerSGD state load";
    if (!state) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: state is NULL", who);
    if (!buf) return ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    psgd_reader_t r = {NULL, 0}; /* set by read_header; initialised for -Wmaybe-uninitialized */
    psgd_header_t h;
    ddp_status_t status = read_header(&state->config, buf, size, &r, &h, who);
    if (status != DDP_OK) return status;
    /* Built aside, installed only when everything read back. */
    psgd_slot_t **slots = calloc(h.nslots ? h.nslots : 1, sizeof *slots);
    if (!slots) return ddp_hook_error(DDP_ERR_NO_MEMORY, "%s: out of memory", who);
    for (size_t i = 0; i < h.nslots && status == DDP_OK; i++)
        status = read_slot(&r, &state->config, i, who, &slots[i]);
    if (status == DDP_OK && r.left != 0)
        status = ddp_hook_error(DDP_ERR_INVALID_ARGUMENT, "%s: %zu bytes left over after the "
                                "last bucket", who, r.left);
    if (status != DDP_OK) {
        free_slots(slots, h.nslots);
        return status;
    }
    free_slots(state->slots, state->nslots);
    state->slots = slots;
    state->nslots = h.nslots;
    state->rng = h.rng;
    state->stats = h.stats;
    state->next_iteration = h.next;
    state->iteration_offset = h.next;
    return DDP_OK;
}
