/* ReduceScatterBucketer (fairscale's): small reduce-scatters are packed into one bucket per
 * (group, dtype, op) and issued as one reduce-scatter when the next input does not fit or on
 * flush; large inputs go out on their own. Reductions run asynchronously on the group's progress
 * thread; their callbacks run later on the caller's thread, in issue order.
 *
 * A bucket's memory is world_size rows of `capacity` elements (row r gathers block r of every
 * input) plus a `capacity`-element output. Rows are filled at stride `capacity`; at flush they are
 * slid together in place (row r to r * used), which turns the first `used` columns into the
 * world_size contiguous blocks reduce-scatter wants without a second buffer. The filled memory
 * then travels with its reduction as a "flight"; the bucket takes a spare flight (or allocates)
 * to go on filling, and a finished flight returns to its bucket's spares. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "ddp/shard.h"

typedef struct rs_entry {
    ddp_rs_callback_fn fn;
    void *arg;
    size_t offset; /* elements into the output */
    size_t count;
} rs_entry_t;

typedef struct rs_bucket rs_bucket_t;

typedef struct rs_flight {
    struct rs_flight *next;
    rs_bucket_t *bucket; /* NULL: a direct input */
    unsigned char *send; /* bucket: world * capacity elements; direct: input or a copy */
    unsigned char *recv; /* capacity elements */
    unsigned char *copy; /* direct: owned buffer for copied blocks (copy_cap bytes), or NULL */
    size_t copy_cap;
    size_t recv_cap;     /* direct: bytes of recv */
    size_t capacity;     /* elements per rank */
    size_t used;         /* elements per rank filled */
    size_t bytes;        /* memory accounted to this flight */
    size_t esize;        /* bytes per element */
    rs_entry_t *entries;
    size_t nentries, entries_cap;
    ddp_work_t *work; /* NULL until issued, and for a flight with nothing to reduce */
} rs_flight_t;

struct rs_bucket {
    rs_bucket_t *next;
    ddp_group_t *group;
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    int world;
    size_t capacity;     /* elements per rank */
    rs_flight_t *filling; /* NULL after teardown or while every flight is out */
    rs_flight_t *spares;
    int torn_down;
};

struct ddp_rs_bucketer {
    size_t cap_bytes;
    rs_bucket_t *buckets;
    rs_flight_t *head, *tail; /* issued reductions, oldest first */
    rs_flight_t *direct_spares; /* finished direct flights, their buffers kept for reuse */
    int torn_down;
    size_t memory;
    uint64_t flushes, direct;
    ddp_status_t failure; /* first failure of a reduction not yet reported by flush */
    char failure_text[DDP_ERROR_TEXT_MAX];
};

static void flight_free(ddp_rs_bucketer_t *b, rs_flight_t *f)
{
    if (!f) return;
    if (f->work) ddp_work_free(f->work);
    if (f->bucket) {
        free(f->send); /* send and recv are one allocation */
    } else {
        free(f->copy);
        free(f->recv);
    }
    b->memory -= f->bytes;
    free(f->entries);
    free(f);
}

static rs_flight_t *flight_new_bucket(ddp_rs_bucketer_t *b, rs_bucket_t *k)
{
    rs_flight_t *f = ddp__calloc(1, sizeof *f, "reduce-scatter bucket");
    if (!f) return NULL;
    size_t es = ddp_dtype_size(k->dtype);
    size_t bytes = ((size_t)k->world + 1) * k->capacity * es;
    f->send = ddp__malloc(bytes ? bytes : 1, "reduce-scatter bucket memory");
    if (!f->send) {
        free(f);
        return NULL;
    }
    f->recv = f->send + (size_t)k->world * k->capacity * es;
    f->bucket = k;
    f->esize = es;
    f->capacity = k->capacity;
    f->bytes = bytes;
    b->memory += bytes;
    return f;
}

static ddp_status_t add_entry(rs_flight_t *f, ddp_rs_callback_fn fn, void *arg, size_t offset,
                              size_t count)
{
    if (f->nentries == f->entries_cap) {
        size_t cap = f->entries_cap ? 2 * f->entries_cap : 8;
        rs_entry_t *grown = realloc(f->entries, cap * sizeof *grown);
        if (!grown)
            return ddp__error(DDP_ERR_NO_MEMORY, "reduce-scatter bucketer: out of memory for "
                              "%zu callbacks", cap);
        f->entries = grown;
        f->entries_cap = cap;
    }
    f->entries[f->nentries++] = (rs_entry_t){fn, arg, offset, count};
    return DDP_OK;
}

static void push_flight(ddp_rs_bucketer_t *b, rs_flight_t *f)
{
    f->next = NULL;
    if (b->tail)
        b->tail->next = f;
    else
        b->head = f;
    b->tail = f;
}

static void record_failure(ddp_rs_bucketer_t *b, ddp_status_t s)
{
    if (b->failure != DDP_OK) return;
    b->failure = s;
    snprintf(b->failure_text, sizeof b->failure_text, "%s", ddp_last_error());
}

/* A completed flight: callbacks (when it succeeded), then back to its bucket's spares. */
static void retire(ddp_rs_bucketer_t *b, rs_flight_t *f, ddp_status_t status)
{
    if (status == DDP_OK) {
        for (size_t i = 0; i < f->nentries; i++) {
            rs_entry_t *e = &f->entries[i];
            if (e->fn) e->fn(e->arg, f->recv + e->offset * f->esize, e->count);
        }
    }
    if (f->work) {
        ddp_work_free(f->work);
        f->work = NULL;
    }
    rs_bucket_t *k = f->bucket;
    f->used = 0;
    f->nentries = 0;
    if (k && !k->torn_down) {
        f->next = k->spares;
        k->spares = f;
    } else if (!k && !b->torn_down) {
        /* Direct buffers are large and the same sizes come back every step: reusing them saves
         * the page faults of fresh memory (the first touch of a new 64 MiB buffer costs more than
         * its reduce-scatter). At most a few are kept. */
        size_t kept = 0;
        for (rs_flight_t *d = b->direct_spares; d; d = d->next) kept++;
        if (kept >= 4) {
            flight_free(b, f);
        } else {
            f->next = b->direct_spares;
            b->direct_spares = f;
        }
    } else {
        flight_free(b, f);
    }
}

/* Retires finished flights at the head of the queue; with `wait`, all of them. */
static void progress(ddp_rs_bucketer_t *b, int wait)
{
    while (b->head) {
        rs_flight_t *f = b->head;
        ddp_status_t s = DDP_OK;
        if (f->work) {
            if (!wait) {
                int done = 0;
                (void)ddp_work_test(f->work, &done);
                if (!done) return; /* a failed test is reported by the wait of a later flush */
            }
            s = ddp_work_wait(f->work);
            if (s != DDP_OK) {
                ddp__error_context(s, "reduce-scatter bucketer: reduction of %zu elements per "
                                   "rank failed", f->used);
                record_failure(b, s);
            }
        }
        b->head = f->next;
        if (!b->head) b->tail = NULL;
        retire(b, f, s);
    }
}

/* Issues the bucket's filling flight (if it holds anything) and detaches it from the bucket. */
static ddp_status_t issue_bucket(ddp_rs_bucketer_t *b, rs_bucket_t *k)
{
    rs_flight_t *f = k->filling;
    if (!f || f->nentries == 0) return DDP_OK;
    k->filling = NULL;
    if (f->used > 0) {
        size_t es = ddp_dtype_size(k->dtype);
        /* Slide rows together: row r (at r * capacity) to r * used. Destinations never pass the
         * next row's source, so walking upward with memmove is safe. */
        for (int r = 1; r < k->world; r++)
            memmove(f->send + (size_t)r * f->used * es, f->send + (size_t)r * f->capacity * es,
                    f->used * es);
        void *recv = f->recv;
        ddp_status_t s = ddp_group_reduce_scatter_async(k->group, f->send, recv, f->used,
                                                        k->dtype, k->op, &f->work);
        if (s != DDP_OK) {
            ddp__error_context(s, "reduce-scatter bucketer: issuing a bucket of %zu elements per "
                               "rank (%s, %s)", f->used, ddp_dtype_name(k->dtype),
                               ddp_reduce_op_name(k->op));
            f->nentries = 0;
            retire(b, f, s);
            return s;
        }
        b->flushes++;
    }
    push_flight(b, f);
    return DDP_OK;
}

static rs_bucket_t *find_bucket(ddp_rs_bucketer_t *b, ddp_group_t *g, ddp_dtype_t dt,
                                ddp_reduce_op_t op)
{
    for (rs_bucket_t *k = b->buckets; k; k = k->next)
        if (k->group == g && k->dtype == dt && k->op == op) return k;
    return NULL;
}

static ddp_status_t check_common(ddp_rs_bucketer_t *b, ddp_group_t *group, size_t count,
                                 ddp_dtype_t dtype, ddp_reduce_op_t op, const char *who)
{
    if (!b) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: bucketer is NULL", who);
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: group is NULL", who);
    if (ddp_dtype_size(dtype) == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a valid dtype", who,
                          (int)dtype);
    if ((int)op < 0 || op >= DDP_OP_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a valid reduce op", who,
                          (int)op);
    size_t world = (size_t)ddp_group_size(group);
    size_t es = ddp_dtype_size(dtype);
    if (count > 0 && (count > SIZE_MAX / world / es))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: count %zu times world size %zu "
                          "overflows", who, count, world);
    return DDP_OK;
}

/* Grows an owned buffer to at least `bytes`, keeping the memory count right. */
static int grow(ddp_rs_bucketer_t *b, rs_flight_t *f, unsigned char **buf, size_t *cap,
                size_t bytes, const char *what)
{
    if (*cap >= bytes && *buf) return 1;
    unsigned char *fresh = ddp__malloc(bytes ? bytes : 1, what);
    if (!fresh) return 0;
    free(*buf);
    b->memory -= *cap;
    f->bytes -= *cap;
    *buf = fresh;
    *cap = bytes;
    b->memory += bytes;
    f->bytes += bytes;
    return 1;
}

static ddp_status_t issue_direct(ddp_rs_bucketer_t *b, ddp_group_t *group, const void *input,
                                 const void *const *blocks, size_t count, ddp_dtype_t dtype,
                                 ddp_reduce_op_t op, ddp_rs_callback_fn fn, void *arg)
{
    size_t world = (size_t)ddp_group_size(group);
    size_t es = ddp_dtype_size(dtype);
    /* The smallest spare whose buffers are large enough (so steady same-sized inputs always
     * find their own), else the largest spare (grown), else a new one. */
    rs_flight_t *f = NULL, **link = NULL, **largest = NULL;
    for (rs_flight_t **l = &b->direct_spares; *l; l = &(*l)->next) {
        size_t have = (*l)->recv_cap + (*l)->copy_cap;
        if ((*l)->recv_cap >= count * es && (!blocks || (*l)->copy_cap >= world * count * es) &&
            (!link || have < (*link)->recv_cap + (*link)->copy_cap))
            link = l;
        if (!largest || have > (*largest)->recv_cap + (*largest)->copy_cap) largest = l;
    }
    if (!link) link = largest;
    if (link) {
        f = *link;
        *link = f->next;
        f->next = NULL;
    } else {
        f = ddp__calloc(1, sizeof *f, "reduce-scatter bucketer");
        if (!f) return DDP_ERR_NO_MEMORY;
    }
    f->capacity = f->used = count;
    f->esize = es;
    ddp_status_t s = DDP_OK;
    if (!grow(b, f, &f->recv, &f->recv_cap, count * es, "reduce-scatter output") ||
        (blocks && !grow(b, f, &f->copy, &f->copy_cap, world * count * es,
                         "reduce-scatter input copy")))
        s = DDP_ERR_NO_MEMORY;
    if (s == DDP_OK) {
        if (blocks) {
            for (size_t r = 0; r < world; r++)
                memcpy(f->copy + r * count * es, blocks[r], count * es);
            f->send = f->copy;
        } else {
            f->send = (unsigned char *)(uintptr_t)input;
        }
        s = add_entry(f, fn, arg, 0, count);
    }
    if (s == DDP_OK)
        s = ddp_group_reduce_scatter_async(group, f->send, f->recv, count, dtype, op, &f->work);
    if (s != DDP_OK) {
        ddp__error_context(s, "reduce-scatter bucketer: direct input of %zu elements per rank",
                           count);
        flight_free(b, f);
        return s;
    }
    b->direct++;
    push_flight(b, f);
    return DDP_OK;
}

static ddp_status_t submit(ddp_rs_bucketer_t *b, ddp_group_t *group, const void *input,
                           const void *const *blocks, size_t count, ddp_dtype_t dtype,
                           ddp_reduce_op_t op, ddp_rs_callback_fn fn, void *arg, const char *who)
{
    ddp_status_t s = check_common(b, group, count, dtype, op, who);
    if (s != DDP_OK) return s;
    int world = ddp_group_size(group);
    if (count > 0) {
        if (blocks) {
            for (int r = 0; r < world; r++)
                if (!blocks[r])
                    return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blocks[%d] is NULL", who,
                                      r);
        } else if (!input) {
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: input is NULL with count %zu", who,
                              count);
        }
    }
    size_t es = ddp_dtype_size(dtype);
    size_t capacity = b->cap_bytes / es / (size_t)world;

    progress(b, 0); /* run what has finished, recycle its memory */
    b->torn_down = 0;

    if (count > capacity) return issue_direct(b, group, input, blocks, count, dtype, op, fn, arg);

    rs_bucket_t *k = find_bucket(b, group, dtype, op);
    if (!k) {
        k = ddp__calloc(1, sizeof *k, "reduce-scatter bucket");
        if (!k) return DDP_ERR_NO_MEMORY;
        k->group = group;
        k->dtype = dtype;
        k->op = op;
        k->world = world;
        k->capacity = capacity;
        k->next = b->buckets;
        b->buckets = k;
    }
    k->torn_down = 0;
    if (k->filling && count > k->filling->capacity - k->filling->used) {
        s = issue_bucket(b, k);
        if (s != DDP_OK) return s;
    }
    if (!k->filling) {
        if (k->spares) {
            k->filling = k->spares;
            k->spares = k->filling->next;
            k->filling->next = NULL;
        } else {
            k->filling = flight_new_bucket(b, k);
            if (!k->filling) return DDP_ERR_NO_MEMORY;
        }
    }
    rs_flight_t *f = k->filling;
    size_t offset = f->used;
    s = add_entry(f, fn, arg, offset, count);
    if (s != DDP_OK) return s;
    for (int r = 0; r < world; r++) {
        const unsigned char *src =
            blocks ? blocks[r] : (const unsigned char *)input + (size_t)r * count * es;
        if (count) memcpy(f->send + ((size_t)r * f->capacity + offset) * es, src, count * es);
    }
    f->used += count;
    return DDP_OK;
}

ddp_status_t ddp_rs_bucketer_reduce_scatter_async(ddp_rs_bucketer_t *bucketer, ddp_group_t *group,
                                                  const void *input, size_t count,
                                                  ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                  ddp_rs_callback_fn callback, void *arg)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    return submit(bucketer, group, input, NULL, count, dtype, op, callback, arg,
                  "reduce-scatter bucketer");
}

ddp_status_t ddp_rs_bucketer_reduce_scatter_blocks_async(
    ddp_rs_bucketer_t *bucketer, ddp_group_t *group, const void *const *blocks, size_t count,
    ddp_dtype_t dtype, ddp_reduce_op_t op, ddp_rs_callback_fn callback, void *arg)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!blocks)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer (blocks): blocks is "
                          "NULL");
    return submit(bucketer, group, NULL, blocks, count, dtype, op, callback, arg,
                  "reduce-scatter bucketer (blocks)");
}

ddp_status_t ddp_rs_bucketer_create(size_t bucket_cap_bytes, ddp_rs_bucketer_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer: out is NULL");
    ddp_rs_bucketer_t *b = ddp__calloc(1, sizeof *b, "reduce-scatter bucketer");
    if (!b) return DDP_ERR_NO_MEMORY;
    b->cap_bytes = bucket_cap_bytes;
    *out = b;
    return DDP_OK;
}

ddp_status_t ddp_rs_bucketer_flush(ddp_rs_bucketer_t *b)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!b) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer flush: "
                              "bucketer is NULL");
    ddp_status_t first = DDP_OK;
    char text[DDP_ERROR_TEXT_MAX] = "";
    for (rs_bucket_t *k = b->buckets; k; k = k->next) {
        ddp_status_t s = issue_bucket(b, k);
        if (s != DDP_OK && first == DDP_OK) {
            first = s;
            snprintf(text, sizeof text, "%s", ddp_last_error());
        }
    }
    progress(b, 1);
    if (b->failure != DDP_OK && first == DDP_OK) {
        first = b->failure;
        snprintf(text, sizeof text, "%s", b->failure_text);
    }
    b->failure = DDP_OK;
    if (first != DDP_OK) return ddp__error(first, "%s", text);
    return DDP_OK;
}

ddp_status_t ddp_rs_bucketer_teardown(ddp_rs_bucketer_t *b)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!b) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer teardown: "
                              "bucketer is NULL");
    progress(b, 0);
    for (rs_bucket_t *k = b->buckets; k; k = k->next)
        if (k->filling && k->filling->nentries > 0)
            return ddp__error(DDP_ERR_INVALID_USAGE,
                              "reduce-scatter bucketer teardown: the %s/%s bucket of a group "
                              "of %d ranks holds %zu unflushed inputs (%zu elements per rank); "
                              "call ddp_rs_bucketer_flush first",
                              ddp_dtype_name(k->dtype), ddp_reduce_op_name(k->op), k->world,
                              k->filling->nentries, k->filling->used);
    if (b->head) {
        size_t n = 0;
        for (rs_flight_t *f = b->head; f; f = f->next) n++;
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "reduce-scatter bucketer teardown: %zu reductions are still in "
                          "flight; call ddp_rs_bucketer_flush first", n);
    }
    for (rs_bucket_t *k = b->buckets; k; k = k->next) {
        flight_free(b, k->filling);
        k->filling = NULL;
        while (k->spares) {
            rs_flight_t *f = k->spares;
            k->spares = f->next;
            flight_free(b, f);
        }
        k->torn_down = 1;
    }
    while (b->direct_spares) {
        rs_flight_t *f = b->direct_spares;
        b->direct_spares = f->next;
        flight_free(b, f);
    }
    b->torn_down = 1;
    return DDP_OK;
}

ddp_status_t ddp_rs_bucketer_setup(ddp_rs_bucketer_t *b)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!b) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer setup: "
                              "bucketer is NULL");
    b->torn_down = 0;
    for (rs_bucket_t *k = b->buckets; k; k = k->next) {
        k->torn_down = 0;
        if (!k->filling) {
            if (k->spares) {
                k->filling = k->spares;
                k->spares = k->filling->next;
                k->filling->next = NULL;
            } else {
                k->filling = flight_new_bucket(b, k);
                if (!k->filling) return DDP_ERR_NO_MEMORY;
            }
        }
    }
    return DDP_OK;
}

size_t ddp_rs_bucketer_memory_bytes(const ddp_rs_bucketer_t *b)
{
    return b ? b->memory : 0;
}

ddp_status_t ddp_rs_bucketer_counts(const ddp_rs_bucketer_t *b, uint64_t *bucket_flushes,
                                    uint64_t *direct)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!b) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "reduce-scatter bucketer counts: "
                              "bucketer is NULL");
    if (bucket_flushes) *bucket_flushes = b->flushes;
    if (direct) *direct = b->direct;
    return DDP_OK;
}

void ddp_rs_bucketer_destroy(ddp_rs_bucketer_t *b)
{
    if (!b) return;
    /* The errors of this last flush are dropped (shard.h): leave the caller's error text as it
     * was, e.g. the failure a cleanup path is about to report. */
    char saved[DDP_ERROR_TEXT_MAX];
    snprintf(saved, sizeof saved, "%s", ddp_last_error());
    for (rs_bucket_t *k = b->buckets; k; k = k->next) (void)issue_bucket(b, k);
    progress(b, 1);
    ddp__set_error_text(saved);
    while (b->buckets) {
        rs_bucket_t *k = b->buckets;
        b->buckets = k->next;
        k->torn_down = 1;
        flight_free(b, k->filling);
        while (k->spares) {
            rs_flight_t *f = k->spares;
            k->spares = f->next;
            flight_free(b, f);
        }
        free(k);
    }
    while (b->direct_spares) {
        rs_flight_t *f = b->direct_spares;
        b->direct_spares = f->next;
        flight_free(b, f);
    }
    free(b);
}
