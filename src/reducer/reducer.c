/* The Reducer: c10d's gradient bucketing and overlapped averaging, driven by the caller's
 * backward pass through ddp_reducer_grad_ready.
 *
 * Life of an iteration. prepare resets the marks (and rebuilds the buckets once, after the first
 * synchronised iteration, in the order rank 0 saw gradients arrive). Each grad_ready marks one
 * parameter; when the last parameter of a bucket is marked, the bucket is divided by the world size
 * and handed to the comm hook, but only in bucket order: a bucket that is ready early waits for
 * the ones before it, and launching resumes as soon as they are ready, so every rank issues the
 * same collectives in the same order. finalize marks whatever was not marked (zeros, or an error
 * without find_unused_parameters), launches the rest, waits, and then every rank allreduces one
 * small status vector: per-parameter "used" flags (for find_unused) and per-rank error codes.
 * That last step is what makes a usage error on one rank (a parameter never marked, one marked
 * twice) fail every rank together instead of leaving the others waiting in a collective.
 *
 * Gradients live in the bucket memory itself (a view into a buffer from ddp_group_alloc_buffer,
 * which the shm transport reduces without a copy); with user_grads they are copied in at
 * grad_ready and out at finalize. Sparse parameters get a bucket of their own, reduced on the
 * progress thread by allgathering row counts, indices and rows. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "reducer/reducer_internal.h"

#define COMM_LANE 2 /* trace lane ("tid") of bucket reductions */

/* What DDP_BUCKET_LAYOUT_DEFAULT stands for. A build may override it (-D) so that a program which
 * leaves the field at its default, such as the trainer, can be measured with either rule. */
#ifndef DDP__DEFAULT_BUCKET_LAYOUT
#define DDP__DEFAULT_BUCKET_LAYOUT DDP_BUCKET_LAYOUT_LAST_FIRST
#endif
#define ERROR_TWICE 1LL
#define ERROR_UNMARKED 2LL
#define ERROR_ROWS_TWICE 3LL

typedef struct rparam {
    char *name;
    size_t registered; /* index as registered (the first of any duplicates) */
    void *data;
    size_t numel;
    ddp_dtype_t dtype;
    size_t rows;
    int sparse;
    void *user_grad;
    size_t bucket, slot, offset; /* where its gradient lives */
    /* sparse gradient: pending rows (accumulated since zero_grad) and the averaged result */
    int64_t *pending_index;
    unsigned char *pending_values;
    size_t pending_rows, pending_cap;
    int64_t *result_index;
    unsigned char *result_values;
    size_t result_rows;
    int contribute; /* sparse: rows take part in this reduction */
    /* row readiness (dense): a byte per row at row_marks + row_base, rows_marked of them set */
    size_t row_base, rows_marked;
} rparam_t;

/* A fixed slice of a dense bucket, reduced on its own as soon as all its elements are marked. */
typedef struct piece {
    struct bucket *bucket;
    size_t index;
    size_t begin, numel; /* element range within the bucket */
    size_t pending;      /* elements not yet marked this iteration */
    ddp_work_t *work;
    double launch_us;
    _Atomic uint64_t done_bits;
    _Atomic int done_set;
} piece_t;

typedef struct bucket {
    struct ddp_reducer *owner;
    size_t index;
    size_t nparams;
    size_t *params;     /* kept parameter indices */
    size_t *registered; /* the same, as registered indices (what users see) */
    size_t *offsets, *numels, *rows;
    ddp_dtype_t dtype;
    size_t numel;
    int sparse;
    void *data; /* from ddp_group_alloc_buffer; NULL when empty or sparse */
    size_t pending; /* parameters not yet marked this iteration */
    int launched;
    ddp_work_t *work;
    double ready_us, launch_us;
    _Atomic uint64_t done_bits; /* done time (double bits) written by the completion callback */
    _Atomic int done_set;
    char trace_name[40];
    ddp_comm_bucket_t view;
    /* Piece-wise launch (default hook and piece_bytes > 0): npieces > 0. */
    piece_t *pieces;
    size_t npieces, next_piece;
} bucket_t;

struct ddp_reducer {
    ddp_group_t *group;
    int rank, world;
    ddp_reducer_config_t config;
    size_t nregistered;
    size_t *kept_of; /* registered index -> kept index */
    size_t nparams;
    rparam_t *params;
    size_t nbuffers;
    ddp__tensor_ref_t *buffers;
    bucket_t *buckets;
    size_t nbuckets;
    size_t next_launch;

    unsigned char *marked;          /* this iteration */
    unsigned char *row_marks;       /* per row of every dense parameter, this iteration;
                                     * allocated by the first grad_ready_rows */
    size_t total_rows;
    size_t launches;                /* reductions started this iteration */
    unsigned char *used_since_sync; /* marked in any iteration since the last synchronised one */
    int active, iter_sync, sync_enabled;
    uint64_t iteration; /* synchronised iterations completed */
    int64_t local_error; /* ERROR_TWICE << 32 | (param + 1) for this iteration, 0 if none */
    char local_error_text[DDP_ERROR_TEXT_MAX];
    double first_ready_us;

    int rebuilt, rebuild_due, recording;
    size_t *arrival;
    size_t narrival;

    unsigned char *saved; /* slots of locally unused parameters, restored if globally unused */
    int64_t *status_vector;
    _Atomic int callbacks_pending;

    int have_stats;
    ddp_reducer_stats_t stats;
    ddp_bucket_stats_t *bucket_stats;
};

/* ---- small helpers ---------------------------------------------------------------------- */

static int is_float(ddp_dtype_t d)
{
    return d == DDP_F32 || d == DDP_F64 || d == DDP_F16 || d == DDP_BF16;
}

static double load(ddp_dtype_t d, const void *p, size_t i)
{
    switch (d) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0;
    }
}

static void store(ddp_dtype_t d, void *p, size_t i, double v)
{
    switch (d) {
    case DDP_F32: ((float *)p)[i] = (float)v; break;
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)p)[i] = ddp_f32_to_bf16((float)v); break;
    default: break;
    }
}

/* x /= world, f16/bf16 through f32 (what c10d's div_ does on half tensors). */
static void prescale(void *data, size_t n, ddp_dtype_t dtype, int world)
{
    if (world == 1 || n == 0) return;
    if (dtype == DDP_F32) {
        float *x = data, w = (float)world;
        for (size_t i = 0; i < n; i++) x[i] /= w;
    } else if (dtype == DDP_F64) {
        double *x = data, w = (double)world;
        for (size_t i = 0; i < n; i++) x[i] /= w;
    } else {
        float w = (float)world;
        for (size_t i = 0; i < n; i++) store(dtype, data, i, (float)load(dtype, data, i) / w);
    }
}

static unsigned char *slot_of(ddp_reducer_t *r, const rparam_t *p)
{
    bucket_t *b = &r->buckets[p->bucket];
    if (!b->data) return NULL; /* an empty bucket (only empty parameters) has no memory */
    return (unsigned char *)b->data + p->offset * ddp_dtype_size(p->dtype);
}

static size_t param_bytes(const rparam_t *p) { return p->numel * ddp_dtype_size(p->dtype); }

static size_t row_bytes(const rparam_t *p)
{
    return p->rows ? p->numel / p->rows * ddp_dtype_size(p->dtype) : 0;
}

/* Rows of the matrix view for row readiness: a vector is numel rows of one element. */
static size_t ready_rows(const rparam_t *p) { return p->rows ? p->rows : p->numel; }

static size_t row_numel(const rparam_t *p)
{
    size_t n = ready_rows(p);
    return n ? p->numel / n : 0;
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000L};
    nanosleep(&ts, NULL);
}

/* Completion callbacks run on the progress thread; before bucket memory or descriptors are
 * freed or statistics read, wait for every one of them (bounded by the group's timeout). */
static void wait_callbacks(ddp_reducer_t *r)
{
    double deadline = ddp__now_us() + (double)ddp_group_timeout_ms(r->group) * 1000.0;
    while (atomic_load(&r->callbacks_pending) > 0 && ddp__now_us() < deadline) sleep_us(20);
}

static void on_bucket_done(void *arg, ddp_status_t status)
{
    (void)status;
    bucket_t *b = arg;
    double t = ddp__now_us();
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    atomic_store(&b->done_bits, bits);
    atomic_store(&b->done_set, 1);
    if (b->owner->config.trace)
        ddp_trace_span(b->owner->config.trace, b->trace_name, "comm", COMM_LANE, b->launch_us, t);
    atomic_fetch_sub(&b->owner->callbacks_pending, 1);
}

static void on_piece_done(void *arg, ddp_status_t status)
{
    (void)status;
    piece_t *q = arg;
    bucket_t *b = q->bucket;
    double t = ddp__now_us();
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    atomic_store(&q->done_bits, bits);
    atomic_store(&q->done_set, 1);
    if (b->owner->config.trace) {
        char name[64];
        snprintf(name, sizeof name, "%s piece %zu/%zu", b->trace_name, q->index, b->npieces);
        ddp_trace_span(b->owner->config.trace, name, "comm", COMM_LANE, q->launch_us, t);
    }
    atomic_fetch_sub(&b->owner->callbacks_pending, 1);
}

static double piece_done_time(piece_t *q)
{
    if (!atomic_load(&q->done_set)) return ddp__now_us();
    uint64_t bits = atomic_load(&q->done_bits);
    double t;
    memcpy(&t, &bits, sizeof t);
    return t;
}

static double done_time(bucket_t *b)
{
    if (b->npieces) {
        double t = 0;
        for (size_t i = 0; i < b->npieces; i++) {
            double d = piece_done_time(&b->pieces[i]);
            if (d > t) t = d;
        }
        return t;
    }
    if (!atomic_load(&b->done_set)) return ddp__now_us();
    uint64_t bits = atomic_load(&b->done_bits);
    double t;
    memcpy(&t, &bits, sizeof t);
    return t;
}

/* ---- buckets ------------------------------------------------------------------------------ */

static void free_bucket_arrays(bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(buckets[i].params);
        free(buckets[i].registered);
        free(buckets[i].offsets);
        free(buckets[i].numels);
        free(buckets[i].rows);
        free(buckets[i].pieces);
    }
    free(buckets);
}

/* Frees bucket memory collectively (every rank frees the same buffers in the same order). */
static void free_bucket_memory(ddp_reducer_t *r, bucket_t *buckets, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (buckets[i].data) ddp_group_free_buffer(r->group, buckets[i].data);
        buckets[i].data = NULL;
    }
}

/* Builds buckets from an assignment (kept indices) and allocates their memory collectively. */
static ddp_status_t make_buckets(ddp_reducer_t *r, const ddp_bucket_assignment_t *a,
                                 bucket_t **out)
{
    bucket_t *buckets = ddp__calloc(a->nbuckets ? a->nbuckets : 1, sizeof(bucket_t), "buckets");
    if (!buckets) return DDP_ERR_NO_MEMORY;
    ddp_status_t status = DDP_OK;
    for (size_t b = 0; b < a->nbuckets; b++) {
        bucket_t *k = &buckets[b];
        size_t n = a->starts[b + 1] - a->starts[b];
        k->owner = r;
        k->index = b;
        k->nparams = n;
        k->params = ddp__malloc(n * sizeof(size_t), "buckets");
        k->registered = ddp__malloc(n * sizeof(size_t), "buckets");
        k->offsets = ddp__malloc(n * sizeof(size_t), "buckets");
        k->numels = ddp__malloc(n * sizeof(size_t), "buckets");
        k->rows = ddp__malloc(n * sizeof(size_t), "buckets");
        if (!k->params || !k->registered || !k->offsets || !k->numels || !k->rows) {
            status = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        const rparam_t *first = &r->params[a->indices[a->starts[b]]];
        k->dtype = first->dtype;
        k->sparse = first->sparse;
        size_t offset = 0;
        for (size_t j = 0; j < n; j++) {
            const rparam_t *p = &r->params[a->indices[a->starts[b] + j]];
            k->params[j] = a->indices[a->starts[b] + j];
            k->registered[j] = p->registered;
            k->offsets[j] = offset;
            k->numels[j] = p->numel;
            k->rows[j] = p->rows;
            offset += p->numel;
        }
        k->numel = k->sparse ? 0 : offset;
        snprintf(k->trace_name, sizeof k->trace_name, "bucket %zu", b);
        /* Pieces depend only on the layout, so every rank cuts the bucket the same way. A hook
         * gets whole buckets (PowerSGD needs whole matrices). */
        size_t esize = ddp_dtype_size(k->dtype);
        if (!k->sparse && k->numel > 0 && r->config.piece_bytes > 0 && !r->config.comm_hook) {
            size_t step = r->config.piece_bytes / esize ? r->config.piece_bytes / esize : 1;
            k->npieces = (k->numel + step - 1) / step;
            k->pieces = ddp__calloc(k->npieces, sizeof(piece_t), "buckets");
            if (!k->pieces) {
                status = DDP_ERR_NO_MEMORY;
                goto fail;
            }
            for (size_t i = 0; i < k->npieces; i++) {
                piece_t *q = &k->pieces[i];
                q->index = i;
                q->begin = i * step;
                q->numel = k->numel - q->begin < step ? k->numel - q->begin : step;
            }
        }
    }
    /* Allocation is collective: same sizes in the same order on every rank (the model was
     * verified identical, and the assignment is deterministic). */
    for (size_t b = 0; b < a->nbuckets; b++) {
        bucket_t *k = &buckets[b];
        if (k->numel == 0) continue;
        status = ddp_group_alloc_buffer(r->group, k->numel * ddp_dtype_size(k->dtype), &k->data);
        if (status != DDP_OK) {
            ddp__error_context(status, "allocating memory of gradient bucket %zu (%zu bytes)", b,
                               k->numel * ddp_dtype_size(k->dtype));
            free_bucket_memory(r, buckets, b);
            goto fail;
        }
        /* A bucket's result is read by the optimizer after the rest of backward, not at once. */
        ddp__group_advise_cold_results(r->group, k->data);
    }
    /* The bucket array does not move from here on: pieces may point at their bucket. */
    for (size_t b = 0; b < a->nbuckets; b++)
        for (size_t i = 0; i < buckets[b].npieces; i++) buckets[b].pieces[i].bucket = &buckets[b];
    *out = buckets;
    return DDP_OK;
fail:
    free_bucket_arrays(buckets, a->nbuckets);
    return status;
}

static void place_params(ddp_reducer_t *r)
{
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        for (size_t j = 0; j < k->nparams; j++) {
            rparam_t *p = &r->params[k->params[j]];
            p->bucket = b;
            p->slot = j;
            p->offset = k->offsets[j];
        }
    }
}

/* Assignment over kept parameters: `order` NULL means the initial one of config.bucket_layout
 * (visited in reverse registration order, or for c10d's rule in registration order; either way
 * the list is then reversed); otherwise arrival order, sorted by arrival position. */
static ddp_status_t assign(ddp_reducer_t *r, const size_t *order, ddp_bucket_assignment_t *out)
{
    ddp_param_t *desc = ddp__calloc(r->nparams ? r->nparams : 1, sizeof(ddp_param_t), "buckets");
    size_t *reverse = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof(size_t), "buckets");
    if (!desc || !reverse) {
        free(desc);
        free(reverse);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < r->nparams; i++) {
        desc[i].name = r->params[i].name;
        desc[i].numel = r->params[i].numel;
        desc[i].dtype = r->params[i].dtype;
        desc[i].rows = r->params[i].rows;
        desc[i].sparse = r->params[i].sparse;
        reverse[i] = r->nparams - 1 - i;
    }
    size_t limits[2] = {r->config.first_bucket_bytes, r->config.bucket_cap_bytes};
    ddp_status_t status;
    if (order) {
        status = ddp__bucket_assignment(desc, r->nparams, limits, 2, order,
                                        DDP__SORT_BY_POSITION, out);
    } else {
        const size_t *visit = r->config.bucket_layout == DDP_BUCKET_LAYOUT_C10D ? NULL : reverse;
        status = ddp__bucket_assignment(desc, r->nparams, limits, 2, visit, DDP__SORT_BY_INDEX,
                                        out);
        if (status == DDP_OK) {
            /* Reverse the bucket list so that the last layers (ready first) are bucket 0. */
            ddp_bucket_assignment_t rev;
            size_t nb = out->nbuckets;
            rev.nbuckets = nb;
            rev.starts = ddp__malloc((nb + 1) * sizeof(size_t), "buckets");
            rev.indices = ddp__malloc((r->nparams ? r->nparams : 1) * sizeof(size_t), "buckets");
            if (!rev.starts || !rev.indices) {
                ddp__bucket_assignment_free(&rev);
                ddp__bucket_assignment_free(out);
                status = DDP_ERR_NO_MEMORY;
            } else {
                size_t n = 0;
                for (size_t b = 0; b < nb; b++) {
                    size_t src = nb - 1 - b;
                    size_t len = out->starts[src + 1] - out->starts[src];
                    rev.starts[b] = n;
                    memcpy(rev.indices + n, out->indices + out->starts[src], len * sizeof(size_t));
                    n += len;
                }
                rev.starts[nb] = n;
                ddp__bucket_assignment_free(out);
                *out = rev;
            }
        }
    }
    free(desc);
    free(reverse);
    return status;
}

/* ---- model verification ----------------------------------------------------------------- */

#define SIG_NAME 48
typedef struct signature {
    char name[SIG_NAME]; /* truncated; the hash covers the whole name */
    uint64_t name_hash;
    uint64_t numel;
    uint64_t rows; /* matrix view rows (0: a vector): c10d compares sizes, not only numel */
    uint32_t dtype;
    uint32_t sparse;
} signature_t;

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void describe(const signature_t *s, char *out, size_t cap)
{
    char shape[64];
    if (s->rows)
        snprintf(shape, sizeof shape, "shape %llu x %llu", (unsigned long long)s->rows,
                 (unsigned long long)(s->numel / s->rows));
    else
        snprintf(shape, sizeof shape, "shape %llu", (unsigned long long)s->numel);
    snprintf(out, cap, "'%.*s' (%s, %llu elements, %s, %s)", SIG_NAME, s->name,
             ddp_dtype_name((ddp_dtype_t)s->dtype), (unsigned long long)s->numel, shape,
             s->sparse ? "sparse" : "dense");
}

static int same_signature(const signature_t *a, const signature_t *b)
{
    return a->name_hash == b->name_hash && a->numel == b->numel && a->rows == b->rows &&
           a->dtype == b->dtype && a->sparse == b->sparse &&
           memcmp(a->name, b->name, SIG_NAME) == 0;
}

/* Collective. Every rank states whether it could build its reducer and how many parameters and
 * buffers it has; then every rank's per-parameter signatures are gathered and compared with rank
 * 0's on every rank, so all ranks report the same first difference. */
#define HEADER_FIELDS 5

static ddp_status_t verify_model(ddp_group_t *group, ddp_status_t local, const rparam_t *params,
                                 size_t nparams, size_t nbuffers, size_t piece_bytes,
                                 int bucket_layout)
{
    int world = ddp_group_size(group), rank = ddp_group_rank(group);
    char local_text[DDP_ERROR_TEXT_MAX];
    snprintf(local_text, sizeof local_text, "%s", ddp_last_error());
    int64_t header[HEADER_FIELDS] = {local, (int64_t)nparams, (int64_t)nbuffers,
                                     (int64_t)piece_bytes, bucket_layout};
    int64_t *headers = ddp__malloc((size_t)world * sizeof header, "model verification");
    if (!headers) return DDP_ERR_NO_MEMORY;
    ddp_status_t status = ddp_group_allgather(group, header, headers, HEADER_FIELDS, DDP_I64);
    if (status != DDP_OK) {
        free(headers);
        return ddp__error_context(status, "verifying the model across ranks");
    }
    size_t maxn = 0;
    if (local != DDP_OK) {
        free(headers);
        ddp__set_error_text(local_text);
        return local;
    }
    for (int q = 0; q < world; q++) {
        if (headers[HEADER_FIELDS * q] != DDP_OK) {
            ddp_status_t s = (ddp_status_t)headers[HEADER_FIELDS * q];
            free(headers);
            if (q == rank) {
                ddp__set_error_text(local_text);
                return s;
            }
            return ddp__error(DDP_ERR_REMOTE,
                              "rank %d failed to create its reducer (%s); see that rank's error",
                              q, ddp_status_string(s));
        }
        if ((size_t)headers[HEADER_FIELDS * q + 1] > maxn) maxn = (size_t)headers[HEADER_FIELDS * q + 1];
    }
    for (int q = 1; q < world; q++) {
        if (headers[HEADER_FIELDS * q + 3] != headers[3]) {
            long long a = headers[3], b = headers[HEADER_FIELDS * q + 3];
            free(headers);
            return ddp__error(DDP_ERR_MISMATCH,
                              "reducer config mismatch: rank 0 has piece_bytes %lld but rank %d "
                              "has %lld (pieces must be the same on every rank)",
                              a, q, b);
        }
        if (headers[HEADER_FIELDS * q + 4] != headers[4]) {
            long long a = headers[4], b = headers[HEADER_FIELDS * q + 4];
            free(headers);
            return ddp__error(DDP_ERR_MISMATCH,
                              "reducer config mismatch: rank 0 has bucket_layout %lld but rank %d "
                              "has %lld (the bucket layout must be the same on every rank)",
                              a, q, b);
        }
        if (headers[HEADER_FIELDS * q + 2] != headers[2]) {
            long long a = headers[2], b = headers[HEADER_FIELDS * q + 2];
            free(headers);
            return ddp__error(DDP_ERR_MISMATCH,
                              "model mismatch: rank 0 registers %lld buffers but rank %d "
                              "registers %lld",
                              a, q, b);
        }
    }

    size_t rec = sizeof(signature_t);
    unsigned char *mine = ddp__calloc(maxn ? maxn : 1, rec, "model verification");
    unsigned char *all = ddp__calloc((size_t)world * (maxn ? maxn : 1), rec, "model verification");
    if (!mine || !all) {
        free(mine);
        free(all);
        free(headers);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < nparams; i++) {
        signature_t s;
        memset(&s, 0, sizeof s);
        memcpy(s.name, params[i].name, strnlen(params[i].name, SIG_NAME));
        s.name_hash = hash_name(params[i].name);
        s.numel = params[i].numel;
        s.rows = params[i].rows;
        s.dtype = (uint32_t)params[i].dtype;
        s.sparse = (uint32_t)params[i].sparse;
        memcpy(mine + i * rec, &s, rec);
    }
    status = ddp_group_allgather(group, mine, all, maxn * rec, DDP_U8);
    if (status != DDP_OK) {
        ddp__error_context(status, "verifying the model across ranks");
        goto done;
    }
    for (size_t i = 0; i < maxn && status == DDP_OK; i++) {
        size_t n0 = (size_t)headers[1];
        for (int q = 1; q < world; q++) {
            size_t nq = (size_t)headers[HEADER_FIELDS * q + 1];
            if (i >= n0 && i >= nq) continue;
            signature_t a, b;
            memcpy(&a, all + i * rec, rec);
            memcpy(&b, all + ((size_t)q * maxn + i) * rec, rec);
            char da[200], db[200];
            describe(&a, da, sizeof da);
            describe(&b, db, sizeof db);
            if (i >= n0 || i >= nq) {
                status = ddp__error(
                    DDP_ERR_MISMATCH,
                    "model mismatch at parameter %zu: rank 0 registers %zu parameters, rank %d "
                    "registers %zu (rank %d has %s there)",
                    i, n0, q, nq, i >= n0 ? q : 0, i >= n0 ? db : da);
                break;
            }
            if (!same_signature(&a, &b)) {
                status = ddp__error(DDP_ERR_MISMATCH,
                                    "model mismatch at parameter %zu: rank 0 has %s but rank %d "
                                    "has %s",
                                    i, da, q, db);
                break;
            }
        }
    }
done:
    free(mine);
    free(all);
    free(headers);
    return status;
}

/* ---- create / destroy --------------------------------------------------------------------- */

static ddp_status_t check_inputs(const ddp_param_t *params, size_t nparams,
                                 const ddp_buffer_t *buffers, size_t nbuffers,
                                 const ddp_reducer_config_t *c)
{
    if (nparams == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "nparams is 0: a reducer needs at least one parameter");
    if (!params) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL");
    /* A count no array can have: reject it before reading params[nparams - 1]. */
    if (nparams > PTRDIFF_MAX / sizeof(ddp_param_t))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nparams %zu is too large", nparams);
    if (nbuffers > PTRDIFF_MAX / sizeof(ddp_buffer_t))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nbuffers %zu is too large", nbuffers);
    if (nbuffers > 0 && !buffers)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffers is NULL but nbuffers is %zu",
                          nbuffers);
    if (c->bucket_cap_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->bucket_cap_bytes is 0");
    if (c->first_bucket_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->first_bucket_bytes is 0");
    if (c->broadcast_bucket_bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "config->broadcast_bucket_bytes is 0");
    if (c->bucket_layout != DDP_BUCKET_LAYOUT_DEFAULT &&
        c->bucket_layout != DDP_BUCKET_LAYOUT_LAST_FIRST && c->bucket_layout != DDP_BUCKET_LAYOUT_C10D)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "config->bucket_layout is %d (expected DDP_BUCKET_LAYOUT_DEFAULT, "
                          "_LAST_FIRST or _C10D)",
                          c->bucket_layout);
    size_t total_bytes = 0;
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        if (!p->name || !p->name[0])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params[%zu].name is %s", i,
                              p->name ? "empty" : "NULL");
        if (!is_float(p->dtype))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): dtype %s is not a floating type "
                              "(f32, f64, f16, bf16)",
                              p->name, i, ddp_dtype_name(p->dtype));
        if (p->numel > 0 && !p->data)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s' (params[%zu]): data is NULL",
                              p->name, i);
        /* Bucket offsets and byte sizes are computed in size_t: keep every product exact. */
        if (p->numel > PTRDIFF_MAX / ddp_dtype_size(p->dtype) ||
            p->numel * ddp_dtype_size(p->dtype) > PTRDIFF_MAX - total_bytes)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): numel %zu of %s is too large (the "
                              "model's bytes overflow)",
                              p->name, i, p->numel, ddp_dtype_name(p->dtype));
        total_bytes += p->numel * ddp_dtype_size(p->dtype);
        if (p->rows > 0 && p->numel % p->rows != 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): numel %zu is not a multiple of rows "
                              "%zu",
                              p->name, i, p->numel, p->rows);
        if (p->sparse && p->rows == 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]) is sparse but has rows = 0 (a sparse "
                              "parameter is a table of rows)",
                              p->name, i);
        if (c->user_grads && !p->sparse && p->numel > 0 && !p->grad)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): grad is NULL but config->user_grads "
                              "is set",
                              p->name, i);
    }
    for (size_t i = 0; i < nbuffers; i++) {
        const ddp_buffer_t *b = &buffers[i];
        if (!b->name || !b->name[0])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffers[%zu].name is %s", i,
                              b->name ? "empty" : "NULL");
        if ((unsigned)b->dtype >= DDP_DTYPE_COUNT)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffer '%s' (buffers[%zu]): invalid dtype",
                              b->name, i);
        if (b->numel > 0 && !b->data)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "buffer '%s' (buffers[%zu]): data is NULL",
                              b->name, i);
        if (b->numel > PTRDIFF_MAX / ddp_dtype_size(b->dtype))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "buffer '%s' (buffers[%zu]): numel %zu is too large", b->name, i,
                              b->numel);
    }
    return DDP_OK;
}

/* Merges duplicates (same data pointer) and checks that names are unique. */
static ddp_status_t dedup(ddp_reducer_t *r, const ddp_param_t *params, size_t nparams)
{
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        size_t kept = (size_t)-1;
        for (size_t k = 0; k < r->nparams; k++) {
            const rparam_t *q = &r->params[k];
            if (p->data && p->data == q->data) {
                if (p->numel != q->numel || p->dtype != q->dtype || p->sparse != q->sparse)
                    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                      "parameter '%s' (params[%zu]) shares its data with '%s' "
                                      "(params[%zu]) but differs in numel, dtype or sparsity "
                                      "(%zu %s vs %zu %s)",
                                      p->name, i, q->name, q->registered, p->numel,
                                      ddp_dtype_name(p->dtype), q->numel, ddp_dtype_name(q->dtype));
                kept = k;
                break;
            }
            if (strcmp(p->name, q->name) == 0)
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "parameter name '%s' is registered twice (params[%zu] and "
                                  "params[%zu]) with different data: names must be unique",
                                  p->name, q->registered, i);
        }
        if (kept != (size_t)-1) {
            r->kept_of[i] = kept;
            continue;
        }
        rparam_t *q = &r->params[r->nparams];
        q->name = ddp__strdup(p->name, "parameter name");
        if (!q->name) return DDP_ERR_NO_MEMORY;
        q->registered = i;
        q->data = p->data;
        q->numel = p->numel;
        q->dtype = p->dtype;
        q->rows = p->rows;
        q->sparse = p->sparse;
        q->user_grad = p->grad;
        r->kept_of[i] = r->nparams++;
    }
    return DDP_OK;
}

/* Waits for reductions in flight and frees everything; may leave a failed wait's text (create's
 * failure path restores its own). */
static void destroy_reducer(ddp_reducer_t *r)
{
    if (!r) return;
    for (size_t b = 0; b < r->nbuckets; b++) {
        if (r->buckets[b].work) {
            ddp_work_wait(r->buckets[b].work);
            ddp_work_free(r->buckets[b].work);
            r->buckets[b].work = NULL;
        }
        for (size_t i = 0; i < r->buckets[b].npieces; i++) {
            piece_t *q = &r->buckets[b].pieces[i];
            if (!q->work) continue;
            ddp_work_wait(q->work);
            ddp_work_free(q->work);
            q->work = NULL;
        }
    }
    wait_callbacks(r);
    if (r->buckets) {
        free_bucket_memory(r, r->buckets, r->nbuckets);
        free_bucket_arrays(r->buckets, r->nbuckets);
    }
    for (size_t i = 0; i < r->nparams; i++) {
        free(r->params[i].name);
        free(r->params[i].pending_index);
        free(r->params[i].pending_values);
        free(r->params[i].result_index);
        free(r->params[i].result_values);
    }
    free(r->params);
    free(r->kept_of);
    free(r->buffers);
    free(r->marked);
    free(r->row_marks);
    free(r->used_since_sync);
    free(r->arrival);
    free(r->saved);
    free(r->status_vector);
    free(r->bucket_stats);
    free(r);
}

void ddp_reducer_destroy(ddp_reducer_t *r)
{
    destroy_reducer(r);
    ddp__clear_error(); /* status.h: a failed wait for a reduction in flight leaves no text */
}

ddp_status_t ddp_reducer_create(ddp_group_t *group, const ddp_param_t *params, size_t nparams,
                                const ddp_buffer_t *buffers, size_t nbuffers,
                                const ddp_reducer_config_t *config, ddp_reducer_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group is NULL");
    ddp_reducer_config_t defaults = DDP_REDUCER_CONFIG_INIT;
    const ddp_reducer_config_t *c = config ? config : &defaults;
    int verify = c->sync_at_create;

    /* Local checks first; with sync_at_create a failure is still taken to the model
     * verification so that every rank fails together instead of waiting for this one. */
    ddp_status_t status = DDP_OK;
    ddp_reducer_t *r = NULL;
    if (!out) status = ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (status == DDP_OK) status = check_inputs(params, nparams, buffers, nbuffers, c);
    if (status == DDP_OK) {
        r = ddp__calloc(1, sizeof *r, "reducer");
        if (!r) status = DDP_ERR_NO_MEMORY;
    }
    if (status == DDP_OK) {
        r->group = group;
        r->rank = ddp_group_rank(group);
        r->world = ddp_group_size(group);
        r->config = *c;
        if (r->config.bucket_layout == DDP_BUCKET_LAYOUT_DEFAULT)
            r->config.bucket_layout = DDP__DEFAULT_BUCKET_LAYOUT;
        r->sync_enabled = 1;
        r->nregistered = nparams;
        r->kept_of = ddp__malloc(nparams * sizeof(size_t), "reducer");
        r->params = ddp__calloc(nparams, sizeof(rparam_t), "reducer");
        r->buffers = ddp__calloc(nbuffers ? nbuffers : 1, sizeof(ddp__tensor_ref_t), "reducer");
        if (!r->kept_of || !r->params || !r->buffers) status = DDP_ERR_NO_MEMORY;
    }
    if (status == DDP_OK) status = dedup(r, params, nparams);
    if (status == DDP_OK) {
        r->nbuffers = nbuffers;
        for (size_t i = 0; i < nbuffers; i++) {
            r->buffers[i].data = buffers[i].data;
            r->buffers[i].numel = buffers[i].numel;
            r->buffers[i].dtype = buffers[i].dtype;
        }
        size_t n = r->nparams;
        r->marked = ddp__calloc(n, 1, "reducer");
        r->used_since_sync = ddp__calloc(n, 1, "reducer");
        r->arrival = ddp__malloc(n * sizeof(size_t), "reducer");
        r->status_vector = ddp__malloc((n + (size_t)r->world) * sizeof(int64_t), "reducer");
        for (size_t i = 0; i < n; i++) {
            r->params[i].row_base = r->total_rows;
            if (!r->params[i].sparse) r->total_rows += ready_rows(&r->params[i]);
        }
        if (!r->marked || !r->used_since_sync || !r->arrival || !r->status_vector)
            status = DDP_ERR_NO_MEMORY;
    }

    if (verify) {
        ddp_status_t v = verify_model(group, status, r ? r->params : NULL, r ? r->nparams : 0,
                                      r ? r->nbuffers : 0, c->piece_bytes,
                                      r ? r->config.bucket_layout : c->bucket_layout);
        if (status == DDP_OK) status = v;
    }
    if (status != DDP_OK) goto fail;

    if (verify) {
        /* Broadcast parameters and buffers from rank 0, coalesced. */
        size_t nt = r->nparams + r->nbuffers;
        ddp__tensor_ref_t *t = ddp__malloc((nt ? nt : 1) * sizeof *t, "reducer");
        if (!t) {
            status = DDP_ERR_NO_MEMORY;
            goto fail;
        }
        for (size_t i = 0; i < r->nparams; i++) {
            t[i].data = r->params[i].data;
            t[i].numel = r->params[i].numel;
            t[i].dtype = r->params[i].dtype;
        }
        memcpy(t + r->nparams, r->buffers, r->nbuffers * sizeof *t);
        status = ddp__broadcast_coalesced(group, t, nt, c->broadcast_bucket_bytes);
        free(t);
        if (status != DDP_OK) goto fail;
    }

    ddp_bucket_assignment_t a;
    status = assign(r, NULL, &a);
    if (status != DDP_OK) goto fail;
    status = make_buckets(r, &a, &r->buckets);
    if (status == DDP_OK) r->nbuckets = a.nbuckets;
    ddp__bucket_assignment_free(&a);
    if (status != DDP_OK) goto fail;
    place_params(r);

    size_t saved_bytes = 0;
    for (size_t i = 0; i < r->nparams; i++) saved_bytes += param_bytes(&r->params[i]);
    if (c->find_unused_parameters && !c->user_grads) {
        r->saved = ddp__malloc(saved_bytes ? saved_bytes : 1, "reducer");
        if (!r->saved) {
            status = DDP_ERR_NO_MEMORY;
            goto fail;
        }
    }
    r->bucket_stats = ddp__calloc(r->nbuckets ? r->nbuckets : 1, sizeof(ddp_bucket_stats_t),
                                  "reducer");
    if (!r->bucket_stats) {
        status = DDP_ERR_NO_MEMORY;
        goto fail;
    }
    if (c->trace) ddp_trace_name_lane(c->trace, COMM_LANE, "comm");
    r->recording = c->rebuild_buckets && !c->find_unused_parameters;
    DDP_LOG(DDP_LOG_INFO, "reducer: rank %d, %zu parameters (%zu registered), %zu buckets", r->rank,
            r->nparams, nparams, r->nbuckets);
    *out = r;
    return DDP_OK;

fail:
    if (r) {
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        destroy_reducer(r);
        ddp__set_error_text(text);
    }
    return status;
}

/* ---- queries ------------------------------------------------------------------------------ */

static ddp_status_t lookup(ddp_reducer_t *r, size_t index, const char *what, rparam_t **p,
                           size_t *kept)
{
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: reducer is NULL", what);
    if (index >= r->nregistered)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: index %zu is out of range (%zu parameters registered)", what, index,
                          r->nregistered);
    *kept = r->kept_of[index];
    *p = &r->params[*kept];
    return DDP_OK;
}

ddp_status_t ddp_reducer_grad(ddp_reducer_t *r, size_t index, void **grad)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup(r, index, "ddp_reducer_grad", &p, &k);
    if (s != DDP_OK) return s;
    if (!grad) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_grad: grad is NULL");
    if (p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s' is sparse: its gradient is given as rows with "
                          "ddp_reducer_sparse_grad and read with ddp_reducer_sparse_result",
                          p->name);
    *grad = r->config.user_grads ? p->user_grad : (void *)slot_of(r, p);
    return DDP_OK;
}

size_t ddp_reducer_bucket_count(const ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    return r ? r->nbuckets : 0;
}

ddp_status_t ddp_reducer_bucket_params(const ddp_reducer_t *r, size_t bucket,
                                       const size_t **params, size_t *nparams)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!params) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL");
    if (!nparams) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nparams is NULL");
    if (bucket >= r->nbuckets)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "bucket %zu is out of range (%zu buckets)",
                          bucket, r->nbuckets);
    *params = r->buckets[bucket].registered;
    *nparams = r->buckets[bucket].nparams;
    return DDP_OK;
}

ddp_status_t ddp_reducer_stats(const ddp_reducer_t *r, ddp_reducer_stats_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (!r->have_stats)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "no synchronised iteration has been finalized yet: no statistics");
    *out = r->stats;
    return DDP_OK;
}

ddp_status_t ddp_reducer_set_sync(ddp_reducer_t *r, int enabled)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    r->sync_enabled = enabled ? 1 : 0;
    return DDP_OK;
}

static int in_flight(const ddp_reducer_t *r)
{
    return r->active && r->iter_sync && r->launches > 0;
}

ddp_status_t ddp_reducer_zero_grad(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (in_flight(r))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_zero_grad during backward: bucket reductions are in flight "
                          "(call it after ddp_reducer_finalize)");
    for (size_t b = 0; b < r->nbuckets; b++)
        if (r->buckets[b].data)
            memset(r->buckets[b].data, 0, r->buckets[b].numel * ddp_dtype_size(r->buckets[b].dtype));
    for (size_t i = 0; i < r->nparams; i++) {
        rparam_t *p = &r->params[i];
        if (r->config.user_grads && p->user_grad) memset(p->user_grad, 0, param_bytes(p));
        p->pending_rows = 0;
    }
    return DDP_OK;
}

/* ---- rebuild -------------------------------------------------------------------------------- */

/* Collective, at prepare: rank 0's arrival order of the first synchronised iteration is
 * broadcast, buckets are reassigned in that order, and gradients are moved to the new slots. */
static ddp_status_t rebuild(ddp_reducer_t *r)
{
    size_t n = r->nparams;
    int64_t *order64 = ddp__malloc(n * sizeof(int64_t), "rebuild");
    size_t *order = ddp__malloc(n * sizeof(size_t), "rebuild");
    unsigned char *seen = ddp__calloc(n, 1, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!order64 || !order || !seen) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t i = 0; i < n; i++) order64[i] = r->rank == 0 ? (int64_t)r->arrival[i] : 0;
    status = ddp_group_broadcast(r->group, order64, n, DDP_I64, 0);
    if (status != DDP_OK) {
        ddp__error_context(status, "rebuilding buckets (broadcast of rank 0's gradient order)");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        if (order64[i] < 0 || (size_t)order64[i] >= n || seen[order64[i]]) {
            status = ddp__error(DDP_ERR_PROTOCOL,
                                "rebuilding buckets: rank 0's gradient order is not a permutation "
                                "(entry %zu)",
                                i);
            goto done;
        }
        seen[order64[i]] = 1;
        order[i] = (size_t)order64[i];
    }
    ddp_bucket_assignment_t a;
    status = assign(r, order, &a);
    if (status != DDP_OK) goto done;
    int same = a.nbuckets == r->nbuckets;
    for (size_t b = 0; same && b < a.nbuckets; b++) {
        size_t len = a.starts[b + 1] - a.starts[b];
        same = len == r->buckets[b].nparams &&
               memcmp(a.indices + a.starts[b], r->buckets[b].params, len * sizeof(size_t)) == 0;
    }
    if (!same) {
        bucket_t *fresh = NULL;
        status = make_buckets(r, &a, &fresh);
        if (status == DDP_OK) {
            for (size_t b = 0; b < a.nbuckets; b++) {
                for (size_t j = 0; j < fresh[b].nparams; j++) {
                    rparam_t *p = &r->params[fresh[b].params[j]];
                    if (p->sparse || p->numel == 0) continue;
                    memcpy((unsigned char *)fresh[b].data +
                               fresh[b].offsets[j] * ddp_dtype_size(p->dtype),
                           slot_of(r, p), param_bytes(p));
                }
            }
            wait_callbacks(r);
            free_bucket_memory(r, r->buckets, r->nbuckets);
            free_bucket_arrays(r->buckets, r->nbuckets);
            r->buckets = fresh;
            r->nbuckets = a.nbuckets;
            place_params(r);
            ddp_bucket_stats_t *bs =
                ddp__calloc(r->nbuckets ? r->nbuckets : 1, sizeof *bs, "reducer");
            if (!bs) {
                status = DDP_ERR_NO_MEMORY;
            } else {
                free(r->bucket_stats);
                r->bucket_stats = bs;
                r->have_stats = 0;
            }
        }
    }
    ddp__bucket_assignment_free(&a);
    DDP_LOG(DDP_LOG_INFO, "reducer: rank %d rebuilt buckets in arrival order (%zu buckets%s)",
            r->rank, r->nbuckets, same ? ", unchanged" : "");
done:
    free(order64);
    free(order);
    free(seen);
    return status;
}

/* ---- iteration ---------------------------------------------------------------------------- */

ddp_status_t ddp_reducer_prepare(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    if (r->active && r->iter_sync)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "ddp_reducer_prepare: the previous synchronised iteration (after %llu "
                          "completed) was not finalized; call ddp_reducer_finalize after backward "
                          "(it waits for the bucket reductions every rank has started)",
                          (unsigned long long)r->iteration);
    r->active = 0;
    ddp_status_t status;
    if (r->rebuild_due) {
        r->rebuild_due = 0;
        r->rebuilt = 1;
        status = rebuild(r);
        if (status != DDP_OK) return status;
    }
    if (r->config.broadcast_buffers && r->nbuffers > 0) {
        status = ddp__broadcast_coalesced(r->group, r->buffers, r->nbuffers,
                                          r->config.broadcast_bucket_bytes);
        if (status != DDP_OK) return status;
    }
    memset(r->marked, 0, r->nparams);
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        k->pending = k->nparams;
        k->launched = 0;
        k->ready_us = k->launch_us = 0;
        atomic_store(&k->done_set, 0);
        k->next_piece = 0;
        for (size_t i = 0; i < k->npieces; i++) {
            piece_t *q = &k->pieces[i];
            q->pending = q->numel;
            q->launch_us = 0;
            atomic_store(&q->done_set, 0);
        }
    }
    r->launches = 0;
    for (size_t i = 0; i < r->nparams; i++) {
        rparam_t *p = &r->params[i];
        free(p->result_index);
        free(p->result_values);
        p->result_index = NULL;
        p->result_values = NULL;
        p->result_rows = 0;
        if (p->rows_marked) memset(r->row_marks + p->row_base, 0, ready_rows(p));
        p->rows_marked = 0;
    }
    r->next_launch = 0;
    r->local_error = 0;
    r->local_error_text[0] = '\0';
    r->first_ready_us = 0;
    r->narrival = 0;
    r->iter_sync = r->sync_enabled;
    r->active = 1;
    return DDP_OK;
}

static ddp_status_t default_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                                 ddp_work_t **work)
{
    (void)state;
    return ddp_group_allreduce_async(group, bucket->data, bucket->data, bucket->numel,
                                     bucket->dtype, DDP_AVG, work);
}

/* Sparse reduction on the progress thread: gather row counts, then indices and rows padded to
 * the largest count, then merge rows with equal indices (summed in rank order, identically on
 * every rank) and divide by the world size. */
static ddp_status_t sparse_task(ddp_group_t *group, void *arg)
{
    bucket_t *b = arg;
    ddp_reducer_t *r = b->owner;
    rparam_t *p = &r->params[b->params[0]];
    int world = ddp_group_size(group);
    size_t rb = row_bytes(p), width = p->numel / p->rows;
    int64_t mine = p->contribute ? (int64_t)p->pending_rows : 0;
    int64_t *counts = ddp__malloc((size_t)world * sizeof(int64_t), "sparse reduction");
    if (!counts) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp_group_allgather(group, &mine, counts, 1, DDP_I64);
    if (s != DDP_OK) {
        free(counts);
        return s;
    }
    size_t maxrows = 0, total = 0;
    for (int q = 0; q < world; q++) {
        if ((size_t)counts[q] > maxrows) maxrows = (size_t)counts[q];
        total += (size_t)counts[q];
    }
    size_t slots = maxrows ? maxrows : 1;
    int64_t *idx_send = ddp__calloc(slots, sizeof(int64_t), "sparse reduction");
    int64_t *idx_all = ddp__calloc(slots * (size_t)world, sizeof(int64_t), "sparse reduction");
    unsigned char *val_send = ddp__calloc(slots, rb ? rb : 1, "sparse reduction");
    unsigned char *val_all = ddp__calloc(slots * (size_t)world, rb ? rb : 1, "sparse reduction");
    size_t *perm = ddp__malloc((total ? total : 1) * sizeof(size_t), "sparse reduction");
    int64_t *out_idx = ddp__malloc((total ? total : 1) * sizeof(int64_t), "sparse reduction");
    unsigned char *out_val = ddp__calloc(total ? total : 1, rb ? rb : 1, "sparse reduction");
    double *acc = ddp__calloc(width ? width : 1, sizeof(double), "sparse reduction");
    if (!idx_send || !idx_all || !val_send || !val_all || !perm || !out_idx || !out_val || !acc) {
        s = DDP_ERR_NO_MEMORY;
        goto done;
    }
    if (mine) {
        memcpy(idx_send, p->pending_index, (size_t)mine * sizeof(int64_t));
        memcpy(val_send, p->pending_values, (size_t)mine * rb);
    }
    s = ddp_group_allgather(group, idx_send, idx_all, maxrows, DDP_I64);
    if (s == DDP_OK)
        s = ddp_group_allgather(group, val_send, val_all, maxrows * width, p->dtype);
    if (s != DDP_OK) goto done;

    /* Sort the gathered rows by index; ties keep rank order, then local order (insertion sort
     * on a list that is usually short; a stable merge keeps results identical on all ranks). */
    size_t n = 0;
    for (int q = 0; q < world; q++)
        for (size_t j = 0; j < (size_t)counts[q]; j++) perm[n++] = (size_t)q * maxrows + j;
    for (size_t i = 1; i < n; i++) {
        size_t v = perm[i], j = i;
        while (j > 0 && idx_all[perm[j - 1]] > idx_all[v]) {
            perm[j] = perm[j - 1];
            j--;
        }
        perm[j] = v;
    }
    size_t nout = 0;
    for (size_t i = 0; i < n;) {
        int64_t row = idx_all[perm[i]];
        memset(acc, 0, width * sizeof(double));
        for (; i < n && idx_all[perm[i]] == row; i++)
            for (size_t e = 0; e < width; e++) acc[e] += load(p->dtype, val_all + perm[i] * rb, e);
        out_idx[nout] = row;
        for (size_t e = 0; e < width; e++)
            store(p->dtype, out_val + nout * rb, e, acc[e] / (double)world);
        nout++;
    }
    p->result_index = out_idx;
    p->result_values = out_val;
    p->result_rows = nout;
    out_idx = NULL;
    out_val = NULL;
done:
    free(counts);
    free(idx_send);
    free(idx_all);
    free(val_send);
    free(val_all);
    free(perm);
    free(out_idx);
    free(out_val);
    free(acc);
    return s;
}

static ddp_status_t launch(ddp_reducer_t *r, bucket_t *b)
{
    b->launched = 1;
    b->launch_us = ddp__now_us();
    r->launches++;
    ddp_work_t *work = NULL;
    ddp_status_t s;
    if (b->sparse) {
        s = ddp_group_submit(r->group, sparse_task, b, &work);
    } else {
        /* A hook gets the bucket prescaled (c10d's div, then it sums) unless it averages
         * itself. The default hook averages inside the allreduce: the same result without a
         * pass over the bucket on the caller's (backward's) thread — the transports divide
         * once after summing, shm inside its reduction loop. */
        int prescaled = r->config.comm_hook && !r->config.comm_hook_averages;
        if (prescaled) prescale(b->data, b->numel, b->dtype, r->world);
        ddp_comm_bucket_t *v = &b->view;
        v->index = b->index;
        v->data = b->data;
        v->numel = b->numel;
        v->dtype = b->dtype;
        v->nparams = b->nparams;
        v->params = b->registered;
        v->offsets = b->offsets;
        v->numels = b->numels;
        v->rows = b->rows;
        v->iteration = r->iteration;
        v->prescaled = prescaled;
        ddp_comm_hook_fn hook = r->config.comm_hook ? r->config.comm_hook : default_hook;
        s = hook(r->config.comm_hook_state, r->group, v, &work);
        if (s == DDP_OK && !work)
            s = ddp__error(DDP_ERR_INVALID_USAGE, "the comm hook returned DDP_OK but no work");
    }
    if (s != DDP_OK) {
        ddp_work_free(work);
        return ddp__error_context(s, "launching the reduction of bucket %zu (iteration %llu)",
                                  b->index, (unsigned long long)r->iteration);
    }
    b->work = work;
    atomic_fetch_add(&r->callbacks_pending, 1);
    if (ddp_work_on_complete(work, on_bucket_done, b) != DDP_OK)
        atomic_fetch_sub(&r->callbacks_pending, 1); /* done time is then taken at the wait */
    return DDP_OK;
}

/* One piece: the default hook's allreduce on a sub-range of the bucket memory. */
static ddp_status_t launch_piece(ddp_reducer_t *r, bucket_t *b, piece_t *q)
{
    q->launch_us = ddp__now_us();
    if (q->index == 0) {
        b->launched = 1;
        b->launch_us = q->launch_us;
    }
    r->launches++;
    size_t esize = ddp_dtype_size(b->dtype);
    unsigned char *data = (unsigned char *)b->data + q->begin * esize;
    ddp_work_t *work = NULL;
    ddp_status_t s =
        ddp_group_allreduce_async(r->group, data, data, q->numel, b->dtype, DDP_AVG, &work);
    if (s != DDP_OK) {
        ddp_work_free(work);
        return ddp__error_context(s,
                                  "launching the reduction of bucket %zu piece %zu of %zu "
                                  "(iteration %llu)",
                                  b->index, q->index, b->npieces, (unsigned long long)r->iteration);
    }
    q->work = work;
    atomic_fetch_add(&r->callbacks_pending, 1);
    if (ddp_work_on_complete(work, on_piece_done, q) != DDP_OK)
        atomic_fetch_sub(&r->callbacks_pending, 1);
    return DDP_OK;
}

/* Launches complete buckets, or complete pieces of them, strictly in order: bucket b's pieces in
 * order, and nothing of bucket b + 1 before every piece of bucket b. */
static ddp_status_t launch_in_order(ddp_reducer_t *r)
{
    while (r->next_launch < r->nbuckets) {
        bucket_t *b = &r->buckets[r->next_launch];
        if (b->npieces) {
            while (b->next_piece < b->npieces && b->pieces[b->next_piece].pending == 0) {
                ddp_status_t s = launch_piece(r, b, &b->pieces[b->next_piece++]);
                if (s != DDP_OK) return s;
            }
            if (b->next_piece < b->npieces) break;
            r->next_launch++;
        } else {
            if (b->pending != 0) break;
            r->next_launch++;
            ddp_status_t s = launch(r, b);
            if (s != DDP_OK) return s;
        }
    }
    return DDP_OK;
}

static ddp_status_t check_active(ddp_reducer_t *r, const char *what)
{
    if (!r->active)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s outside an iteration: call ddp_reducer_prepare first", what);
    return DDP_OK;
}

/* Elements [begin, end) of bucket b are final: count them off the pieces they overlap. */
static void count_off(bucket_t *b, size_t begin, size_t end)
{
    if (!b->npieces || begin >= end) return;
    size_t step = b->pieces[0].numel;
    for (size_t i = begin / step; i < b->npieces && b->pieces[i].begin < end; i++) {
        piece_t *q = &b->pieces[i];
        size_t lo = begin > q->begin ? begin : q->begin;
        size_t hi = end < q->begin + q->numel ? end : q->begin + q->numel;
        if (hi > lo) q->pending -= hi - lo;
    }
}

/* Rows [lo, hi) of parameter p became final in a synchronised iteration: take them from the
 * user's gradient and count their elements off the pieces. */
static void rows_final(ddp_reducer_t *r, rparam_t *p, size_t lo, size_t hi)
{
    if (p->sparse || p->numel == 0 || hi <= lo) return;
    size_t w = row_numel(p), esize = ddp_dtype_size(p->dtype);
    if (r->config.user_grads)
        memcpy(slot_of(r, p) + lo * w * esize, (unsigned char *)p->user_grad + lo * w * esize,
               (hi - lo) * w * esize);
    count_off(&r->buckets[p->bucket], p->offset + lo * w, p->offset + hi * w);
}

/* Calls fn for each maximal run of rows of p not marked in this iteration. */
static void each_unmarked_run(ddp_reducer_t *r, rparam_t *p,
                              void (*fn)(ddp_reducer_t *, rparam_t *, size_t, size_t))
{
    size_t n = ready_rows(p);
    if (p->rows_marked == 0) {
        fn(r, p, 0, n);
        return;
    }
    const unsigned char *m = r->row_marks + p->row_base;
    for (size_t i = 0; i < n;) {
        if (m[i]) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !m[j]) j++;
        fn(r, p, i, j);
        i = j;
    }
}

/* Records a usage error that finalize will report on every rank. */
static void note_local_error(ddp_reducer_t *r, int64_t kind, size_t k)
{
    if (r->iter_sync && !r->local_error) {
        r->local_error = (kind << 32) | (int64_t)(k + 1);
        snprintf(r->local_error_text, sizeof r->local_error_text, "%s", ddp_last_error());
    }
}

/* Parameter k is complete (all rows final): bucket bookkeeping and launches. */
static ddp_status_t complete(ddp_reducer_t *r, size_t k, double now)
{
    rparam_t *p = &r->params[k];
    r->marked[k] = 1;
    if (r->recording && r->narrival < r->nparams) r->arrival[r->narrival++] = k;
    bucket_t *b = &r->buckets[p->bucket];
    if (p->sparse) p->contribute = 1;
    if (--b->pending == 0) b->ready_us = now;
    return launch_in_order(r);
}

static ddp_status_t mark_ready(ddp_reducer_t *r, size_t k)
{
    rparam_t *p = &r->params[k];
    if (r->marked[k]) {
        ddp_status_t s = ddp__error(
            DDP_ERR_INVALID_USAGE,
            "parameter '%s' (index %zu) was marked ready twice in one iteration (after %llu "
            "synchronised iterations). Its gradient was reported more than once, which happens "
            "when a module is reused in the forward pass, with shared weights (layers tied to "
            "one tensor: register it once, duplicates of one data pointer are merged, and report "
            "it once), or when a parameter takes part in several backward passes of one "
            "iteration. With find_unused_parameters a parameter must also not produce a gradient "
            "after finalize treated it as unused.",
            p->name, p->registered, (unsigned long long)r->iteration);
        note_local_error(r, ERROR_TWICE, k);
        return s;
    }
    r->used_since_sync[k] = 1;
    if (!r->iter_sync) {
        r->marked[k] = 1;
        return DDP_OK;
    }
    double now = ddp__now_us();
    if (r->first_ready_us == 0) r->first_ready_us = now;
    /* The rows not marked yet (all of them unless grad_ready_rows was used) become final. */
    each_unmarked_run(r, p, rows_final);
    return complete(r, k, now);
}

/* lookup() for the dense-gradient calls: a sparse parameter is a usage error naming it. */
static ddp_status_t lookup_dense(ddp_reducer_t *r, size_t index, const char *what, rparam_t **p,
                                 size_t *k)
{
    ddp_status_t s = lookup(r, index, what, p, k);
    if (s != DDP_OK) return s;
    if ((*p)->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s: parameter '%s' (index %zu) is sparse: report its gradient with "
                          "ddp_reducer_sparse_grad",
                          what, (*p)->name, index);
    return DDP_OK;
}

ddp_status_t ddp_reducer_grad_ready(ddp_reducer_t *r, size_t index)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup_dense(r, index, "ddp_reducer_grad_ready", &p, &k);
    if (s != DDP_OK) return s;
    if ((s = check_active(r, "ddp_reducer_grad_ready")) != DDP_OK) return s;
    return mark_ready(r, k);
}

ddp_status_t ddp_reducer_grad_ready_rows(ddp_reducer_t *r, size_t index, size_t row_begin,
                                         size_t row_end)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup_dense(r, index, "ddp_reducer_grad_ready_rows", &p, &k);
    if (s != DDP_OK) return s;
    size_t nrows = ready_rows(p);
    if (row_begin >= row_end)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp_reducer_grad_ready_rows: parameter '%s' (index %zu): the row range "
                          "[%zu, %zu) is empty",
                          p->name, index, row_begin, row_end);
    if (row_end > nrows)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp_reducer_grad_ready_rows: parameter '%s' (index %zu): rows [%zu, "
                          "%zu) are out of range (it has %zu rows%s)",
                          p->name, index, row_begin, row_end, nrows,
                          p->rows ? "" : ": a vector has one row per element");
    if ((s = check_active(r, "ddp_reducer_grad_ready_rows")) != DDP_OK) return s;
    if (!r->row_marks) {
        /* A byte per row of every dense parameter (a vector has one per element): only
         * callers that report rows pay for it. */
        r->row_marks = ddp__calloc(r->total_rows ? r->total_rows : 1, 1, "row readiness");
        if (!r->row_marks)
            return ddp__error(DDP_ERR_NO_MEMORY,
                              "parameter '%s': no memory for the row marks (%zu bytes)", p->name,
                              r->total_rows);
    }
    unsigned char *m = r->row_marks + p->row_base;
    size_t twice = (size_t)-1;
    if (r->marked[k]) {
        twice = row_begin;
    } else {
        for (size_t i = row_begin; i < row_end && twice == (size_t)-1; i++)
            if (m[i]) twice = i;
    }
    if (twice != (size_t)-1) {
        s = ddp__error(DDP_ERR_INVALID_USAGE,
                       "parameter '%s' (index %zu): rows [%zu, %zu) were marked ready, but row "
                       "%zu was already marked in this iteration (after %llu synchronised "
                       "iterations)%s: each row of a gradient is reported once per iteration",
                       p->name, p->registered, row_begin, row_end, twice,
                       (unsigned long long)r->iteration,
                       r->marked[k] ? "; the whole parameter was already complete" : "");
        note_local_error(r, ERROR_ROWS_TWICE, k);
        return s;
    }
    memset(m + row_begin, 1, row_end - row_begin);
    p->rows_marked += row_end - row_begin;
    r->used_since_sync[k] = 1;
    if (!r->iter_sync) {
        if (p->rows_marked == nrows) r->marked[k] = 1;
        return DDP_OK;
    }
    double now = ddp__now_us();
    if (r->first_ready_us == 0) r->first_ready_us = now;
    rows_final(r, p, row_begin, row_end);
    if (p->rows_marked == nrows) return complete(r, k, now);
    return launch_in_order(r);
}

ddp_status_t ddp_reducer_sparse_grad(ddp_reducer_t *r, size_t index, const int64_t *indices,
                                     const void *values, size_t nrows)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup(r, index, "ddp_reducer_sparse_grad", &p, &k);
    if (s != DDP_OK) return s;
    if (!p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s' (index %zu) is dense: use ddp_reducer_grad and "
                          "ddp_reducer_grad_ready",
                          p->name, index);
    if (nrows > 0 && !indices)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': indices is NULL", p->name);
    /* More rows than memory can hold: reject before reading indices[nrows - 1]. */
    if (nrows > PTRDIFF_MAX / 2 / (row_bytes(p) > sizeof(int64_t) ? row_bytes(p) : sizeof(int64_t)))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': nrows %zu is too large",
                          p->name, nrows);
    if (nrows > 0 && !values)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "parameter '%s': values is NULL", p->name);
    for (size_t i = 0; i < nrows; i++)
        if (indices[i] < 0 || (uint64_t)indices[i] >= p->rows)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s': indices[%zu] = %lld is outside its %zu rows",
                              p->name, i, (long long)indices[i], p->rows);
    if ((s = check_active(r, "ddp_reducer_sparse_grad")) != DDP_OK) return s;
    if (r->marked[k]) return mark_ready(r, k); /* the twice error */
    size_t rb = row_bytes(p);
    if (p->pending_rows + nrows > p->pending_cap) {
        size_t cap = (p->pending_rows + nrows) * 2;
        int64_t *ni = realloc(p->pending_index, cap * sizeof(int64_t));
        if (ni) p->pending_index = ni;
        unsigned char *nv = realloc(p->pending_values, cap * (rb ? rb : 1));
        if (nv) p->pending_values = nv;
        if (!ni || !nv) return ddp__error(DDP_ERR_NO_MEMORY, "sparse gradient of '%s'", p->name);
        p->pending_cap = cap;
    }
    if (nrows) {
        memcpy(p->pending_index + p->pending_rows, indices, nrows * sizeof(int64_t));
        memcpy(p->pending_values + p->pending_rows * rb, values, nrows * rb);
    }
    p->pending_rows += nrows;
    return mark_ready(r, k);
}

ddp_status_t ddp_reducer_sparse_result(ddp_reducer_t *r, size_t index, const int64_t **indices,
                                       const void **values, size_t *nrows)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    rparam_t *p = NULL;
    size_t k = 0;
    ddp_status_t s = lookup(r, index, "ddp_reducer_sparse_result", &p, &k);
    if (s != DDP_OK) return s;
    if (!indices || !values || !nrows)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_sparse_result: %s is NULL",
                          !indices ? "indices" : !values ? "values" : "nrows");
    if (!p->sparse)
        return ddp__error(DDP_ERR_INVALID_USAGE, "parameter '%s' (index %zu) is dense", p->name,
                          index);
    if (r->active || !p->result_index)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "parameter '%s': no sparse result (it exists after a synchronised "
                          "ddp_reducer_finalize, until the next ddp_reducer_prepare)",
                          p->name);
    *indices = p->result_index;
    *values = p->result_values;
    *nrows = p->result_rows;
    return DDP_OK;
}

/* Text for an error code another rank reported in the status vector. */
static void describe_remote_error(ddp_reducer_t *r, int q, int64_t code, char *out, size_t cap)
{
    int64_t kind = code >> 32;
    size_t k = (size_t)(code & 0xffffffff) - 1;
    const char *name = k < r->nparams ? r->params[k].name : "?";
    size_t reg = k < r->nparams ? r->params[k].registered : 0;
    if (kind == ERROR_ROWS_TWICE)
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) had rows marked ready twice in one "
                 "iteration (overlapping ddp_reducer_grad_ready_rows ranges)",
                 q, name, reg);
    else if (kind == ERROR_TWICE)
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) was marked ready twice in one iteration "
                 "(a reused module or shared weights?)",
                 q, name, reg);
    else
        snprintf(out, cap,
                 "rank %d: parameter '%s' (index %zu) was not marked ready in this iteration; "
                 "if some parameters legitimately get no gradient, enable "
                 "find_unused_parameters",
                 q, name, reg);
}

ddp_status_t ddp_reducer_finalize(ddp_reducer_t *r)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reducer is NULL");
    ddp_status_t s = check_active(r, "ddp_reducer_finalize");
    if (s != DDP_OK) return s;
    if (!r->iter_sync) {
        r->active = 0; /* no_sync: gradients stay local and accumulate */
        return DDP_OK;
    }
    double enter = ddp__now_us();
    int find_unused = r->config.find_unused_parameters;
    size_t esize;

    /* Parameters never marked: zeros (or their accumulated no_sync gradient) with
     * find_unused_parameters, an error otherwise. Either way their buckets are launched so that
     * every rank issues the same collectives. */
    char names[512];
    size_t nunmarked = 0, nl = 0;
    names[0] = '\0';
    size_t saved_off = 0;
    for (size_t k = 0; k < r->nparams; k++) {
        rparam_t *p = &r->params[k];
        esize = param_bytes(p);
        if (r->marked[k]) continue;
        if (!find_unused) {
            if (nunmarked == 0 && !r->local_error)
                r->local_error = (ERROR_UNMARKED << 32) | (int64_t)(k + 1);
            if (nunmarked < 8 && nl + 1 < sizeof names) {
                int w = snprintf(names + nl, sizeof names - nl, "%s'%s'", nunmarked ? ", " : "",
                                 p->name);
                nl = w < 0 ? nl : nl + (size_t)w < sizeof names ? nl + (size_t)w : sizeof names;
            }
            nunmarked++;
        }
        if (p->sparse) {
            p->contribute = r->used_since_sync[k];
        } else if (p->numel > 0) {
            if (r->used_since_sync[k]) {
                /* Rows marked with grad_ready_rows were copied in already (and may be in a
                 * piece in flight): take only the others. */
                each_unmarked_run(r, p, rows_final);
            } else {
                if (r->saved) memcpy(r->saved + saved_off, slot_of(r, p), esize);
                memset(slot_of(r, p), 0, esize);
                count_off(&r->buckets[p->bucket], p->offset, p->offset + p->numel);
            }
        }
        if (!r->used_since_sync[k]) saved_off += esize;
        bucket_t *b = &r->buckets[p->bucket];
        if (--b->pending == 0) b->ready_us = ddp__now_us();
    }
    if (nunmarked > 0 && r->local_error >> 32 == ERROR_UNMARKED) {
        ddp__error(DDP_ERR_INVALID_USAGE,
                   "%zu parameter(s) were not marked ready in this iteration (after %llu "
                   "synchronised iterations): %s%s. Every parameter must get its gradient "
                   "reported with ddp_reducer_grad_ready before ddp_reducer_finalize; if some "
                   "parameters legitimately get no gradient in some iterations, enable "
                   "find_unused_parameters in the reducer config",
                   nunmarked, (unsigned long long)r->iteration, names,
                   nunmarked > 8 ? ", ..." : "");
        snprintf(r->local_error_text, sizeof r->local_error_text, "%s", ddp_last_error());
    }
    double backward_end = enter;
    ddp_status_t first = launch_in_order(r);
    char first_text[DDP_ERROR_TEXT_MAX];
    first_text[0] = '\0';
    if (first != DDP_OK) snprintf(first_text, sizeof first_text, "%s", ddp_last_error());

    /* Every rank learns of every rank's usage error and of which parameters were used. The
     * vector is known now, so it is queued right behind the last bucket instead of after the
     * waits (one round trip less on the exposed path). */
    size_t nu = find_unused ? r->nparams : 0;
    int64_t *v = r->status_vector;
    for (size_t k = 0; k < nu; k++) v[k] = r->used_since_sync[k];
    for (int q = 0; q < r->world; q++) v[nu + (size_t)q] = q == r->rank ? r->local_error : 0;
    ddp_work_t *status_work = NULL;
    if (first == DDP_OK) {
        s = ddp_group_allreduce_async(r->group, v, v, nu + (size_t)r->world, DDP_I64, DDP_MAX,
                                      &status_work);
        if (s != DDP_OK) {
            first = ddp__error_context(s, "exchanging the status of iteration %llu",
                                       (unsigned long long)r->iteration);
            snprintf(first_text, sizeof first_text, "%s", ddp_last_error());
        }
    }

    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        for (size_t i = 0; i <= k->npieces; i++) {
            ddp_work_t **work = i < k->npieces ? &k->pieces[i].work : &k->work;
            if (!*work) continue;
            ddp_status_t w = ddp_work_wait(*work);
            if (w != DDP_OK && first == DDP_OK) {
                if (i < k->npieces)
                    first = ddp__error_context(w,
                                               "reduction of gradient bucket %zu piece %zu of "
                                               "%zu (iteration %llu)",
                                               b, i, k->npieces, (unsigned long long)r->iteration);
                else
                    first = ddp__error_context(w,
                                               "reduction of gradient bucket %zu (iteration %llu)",
                                               b, (unsigned long long)r->iteration);
                snprintf(first_text, sizeof first_text, "%s", ddp_last_error());
            }
            ddp_work_free(*work);
            *work = NULL;
        }
    }
    if (status_work) {
        s = ddp_work_wait(status_work);
        ddp_work_free(status_work);
        if (s != DDP_OK && first == DDP_OK) {
            first = ddp__error_context(s, "exchanging the status of iteration %llu",
                                       (unsigned long long)r->iteration);
            snprintf(first_text, sizeof first_text, "%s", ddp_last_error());
        }
    }
    wait_callbacks(r);
    if (first != DDP_OK) {
        r->active = 0;
        ddp__set_error_text(first_text);
        return first;
    }
    if (v[nu + (size_t)r->rank]) {
        r->active = 0;
        ddp__set_error_text(r->local_error_text);
        return DDP_ERR_INVALID_USAGE;
    }
    for (int q = 0; q < r->world; q++) {
        int64_t code = v[nu + (size_t)q];
        if (!code) continue;
        r->active = 0;
        char text[600];
        describe_remote_error(r, q, code, text, sizeof text);
        return ddp__error(DDP_ERR_INVALID_USAGE, "%s", text);
    }

    /* Globally unused parameters keep their gradient; copy results out in user_grads mode. */
    saved_off = 0;
    for (size_t k = 0; k < r->nparams; k++) {
        rparam_t *p = &r->params[k];
        esize = param_bytes(p);
        int globally_unused = find_unused && v[k] == 0;
        int saved_here = !r->marked[k] && !r->used_since_sync[k];
        if (p->sparse) {
            if (!globally_unused) {
                /* The averaged rows become the gradient that later iterations accumulate on. */
                if (p->result_rows > p->pending_cap) {
                    size_t rb = row_bytes(p);
                    int64_t *ni = realloc(p->pending_index, p->result_rows * sizeof(int64_t));
                    if (ni) p->pending_index = ni;
                    unsigned char *nv = realloc(p->pending_values, p->result_rows * (rb ? rb : 1));
                    if (nv) p->pending_values = nv;
                    if (!ni || !nv) {
                        r->active = 0;
                        return ddp__error(DDP_ERR_NO_MEMORY, "sparse gradient of '%s'", p->name);
                    }
                    p->pending_cap = p->result_rows;
                }
                memcpy(p->pending_index, p->result_index, p->result_rows * sizeof(int64_t));
                memcpy(p->pending_values, p->result_values, p->result_rows * row_bytes(p));
                p->pending_rows = p->result_rows;
            }
        } else if (p->numel > 0) {
            if (globally_unused) {
                if (saved_here && r->saved) memcpy(slot_of(r, p), r->saved + saved_off, esize);
            } else if (r->config.user_grads) {
                memcpy(p->user_grad, slot_of(r, p), esize);
            }
        }
        if (saved_here) saved_off += esize;
        p->contribute = 0;
    }

    /* Statistics. */
    double exit_us = ddp__now_us();
    double t0 = r->first_ready_us ? r->first_ready_us : enter;
    ddp_reducer_stats_t *st = &r->stats;
    st->iteration = r->iteration;
    st->backward_us = backward_end - t0;
    st->exposed_us = exit_us - enter;
    st->comm_us = 0;
    st->bytes = 0;
    st->nbuckets = r->nbuckets;
    st->npieces = 0;
    st->busy_us = 0;
    /* Reductions are issued in order (buckets, and pieces within them), so their launch times
     * are sorted and the union of their intervals is one sweep. */
    double busy_start = 0, busy_end = -1e300;
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        for (size_t i = 0; i < (k->npieces ? k->npieces : 1); i++) {
            double l = k->npieces ? k->pieces[i].launch_us : k->launch_us;
            double d = k->npieces ? piece_done_time(&k->pieces[i]) : done_time(k);
            st->npieces++;
            if (k->npieces) st->comm_us += d - l;
            if (l > busy_end) {
                if (busy_end > busy_start) st->busy_us += busy_end - busy_start;
                busy_start = l;
                busy_end = d;
            } else if (d > busy_end) {
                busy_end = d;
            }
        }
    }
    if (busy_end > busy_start) st->busy_us += busy_end - busy_start;
    for (size_t b = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        ddp_bucket_stats_t *bs = &r->bucket_stats[b];
        double done = done_time(k);
        if (k->sparse) {
            const rparam_t *p = &r->params[k->params[0]];
            bs->bytes = p->pending_rows * (row_bytes(p) + sizeof(int64_t));
        } else {
            bs->bytes = k->numel * ddp_dtype_size(k->dtype);
        }
        bs->ready_us = k->ready_us - t0;
        bs->launch_us = k->launch_us - t0;
        bs->done_us = done - t0;
        if (!k->npieces) st->comm_us += done - k->launch_us;
        st->bytes += bs->bytes;
    }
    st->buckets = r->bucket_stats;
    r->have_stats = 1;

    memset(r->used_since_sync, 0, r->nparams);
    if (r->recording) {
        r->recording = 0;
        r->rebuild_due = !r->rebuilt && r->narrival == r->nparams;
    }
    r->iteration++;
    r->active = 0;
    return DDP_OK;
}
