/* Size sweeps over the group's collectives, reported the way nccl-tests does.
 *
 * For each size: warmup iterations; with -c 1 one checked run whose output is compared element
 * by element with values computed here (inputs are small integers, so sums, products, minima and
 * copies are exact in every type; only AVG of floats may round, and gets one unit in the last
 * place); then one calibration round that fixes how many iterations a timing round needs to last
 * --min-ms (the same count on every rank); then --rounds timing rounds. A round's time is each
 * rank's time per iteration, taken as the maximum over ranks (an allreduce MAX), and the size's
 * time is the median round. Buffers are allocated once at the largest size, touched before use,
 * either with malloc or (--segment 1) with ddp_group_alloc_buffer; --register 1 registers the
 * malloc'd ones (ddp_group_register_memory, whole pages) once, before the first size, and
 * unregisters them after the last, as a training loop would its gradient buffers. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static const char *const collective_names[] = {
    "allreduce", "broadcast",       "reduce_scatter",  "allgather",           "barrier",
    "reduce",    "gather",          "scatter",         "alltoall",            "allgatherv",
    "reduce_scatterv", "alltoallv", "allreduce_coalesced", "broadcast_coalesced", "sendrecv"};

const char *ddp_bench_collective_name(ddp_bench_collective_t collective)
{
    return (unsigned)collective < sizeof collective_names / sizeof collective_names[0]
               ? collective_names[collective]
               : "invalid";
}

typedef struct bench {
    ddp_group_t *group;
    const ddp_bench_options_t *o;
    int rank, world;
    size_t elem;           /* bytes per element */
    void *send, *recv;     /* send == recv when in place (recv is always the big one) */
    size_t capacity;       /* bytes in each buffer */
    int send_registered, recv_registered; /* --register 1: unregister these before free */
    /* Variable counts (per rank, elements): allgatherv/reduce_scatterv use vc/vd, alltoallv
     * sc/sd (what this rank sends) and rc/rd (what it receives). Set by plan_size. */
    size_t *vc, *vd, *sc, *sd, *rc, *rd;
    void *bufs[4];         /* coalesced: four pieces of recv */
    size_t bcounts[4];
} bench_t;

/* alltoallv: elements rank i sends rank j when the largest block is c (blocks differ by rank). */
static size_t a2av_count(const bench_t *b, size_t c, int i, int j)
{
    size_t w = (size_t)b->world;
    return c - ((size_t)((i + j) % b->world) * c) / (2 * w);
}

/* ---- elements as doubles --------------------------------------------------------------- */

static double load(const void *buf, size_t i, ddp_dtype_t t)
{
    switch (t) {
    case DDP_F32: return ((const float *)buf)[i];
    case DDP_F64: return ((const double *)buf)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_I32: return ((const int32_t *)buf)[i];
    case DDP_I64: return (double)((const int64_t *)buf)[i];
    case DDP_U8: return ((const uint8_t *)buf)[i];
    default: return NAN;
    }
}

static void store(void *buf, size_t i, ddp_dtype_t t, double v)
{
    switch (t) {
    case DDP_F32: ((float *)buf)[i] = (float)v; break;
    case DDP_F64: ((double *)buf)[i] = v; break;
    case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DDP_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

static int is_float(ddp_dtype_t t) { return t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16; }

/* Input of `rank` at global element index i: small integers, exact in every type, so that the
 * expected result is exact too. Products stay within +-2^world. u8 gets non-negative values. */
static double input_value(const bench_t *b, int rank, size_t i)
{
    if (b->o->op == DDP_PROD) {
        static const double signed_factors[] = {1, -1, 2, 1, -2, -1, 1};
        static const double unsigned_factors[] = {1, 1, 2, 1, 2, 1, 1};
        size_t k = (i * 3 + (size_t)rank) % 7;
        return b->o->dtype == DDP_U8 ? unsigned_factors[k] : signed_factors[k];
    }
    double v = (double)((i * 7 + (size_t)rank * 5) % 13);
    return b->o->dtype == DDP_U8 ? v : v - 6.0;
}

/* Value the reduction of input_value over every rank must produce at index i, rounded to the
 * type as the library rounds it (f16/bf16: computed in f32, rounded once). */
static double expected_reduction(const bench_t *b, size_t i)
{
    ddp_reduce_op_t op = b->o->op;
    double acc = input_value(b, 0, i);
    for (int r = 1; r < b->world; r++) {
        double v = input_value(b, r, i);
        if (op == DDP_SUM || op == DDP_AVG) acc += v;
        else if (op == DDP_MIN) acc = v < acc ? v : acc;
        else if (op == DDP_MAX) acc = v > acc ? v : acc;
        else acc *= v;
    }
    if (op == DDP_AVG) {
        if (is_float(b->o->dtype)) acc /= b->world;
        else acc = (double)((long long)acc / b->world); /* truncation toward zero */
    }
    unsigned char tmp[8];
    store(tmp, 0, b->o->dtype, acc);
    return load(tmp, 0, b->o->dtype);
}

static int same(const bench_t *b, double got, double want)
{
    if (got == want) return 1;
    if (b->o->op != DDP_AVG || !is_float(b->o->dtype)) return 0;
    /* AVG of floats: the library may divide or multiply by 1/n; allow one unit in the last place. */
    double ulp = b->o->dtype == DDP_F64 ? 0x1p-52 : b->o->dtype == DDP_F32 ? 0x1p-23
                 : b->o->dtype == DDP_F16 ? 0x1p-10 : 0x1p-7;
    return fabs(got - want) <= fabs(want) * ulp;
}

/* ---- one size ---------------------------------------------------------------------------- */

typedef struct size_plan {
    size_t count;      /* elements the call is given: see the transport contract's count */
    size_t total;      /* elements in the whole buffer (the SIZE column / elem) */
    const void *send;
    void *recv;
} size_plan_t;

/* Splits `bytes` into the call's arguments for this collective. */
static size_plan_t plan_size(const bench_t *b, size_t bytes)
{
    size_plan_t p = {0, 0, b->send, b->recv};
    size_t elems = bytes / b->elem;
    size_t w = (size_t)b->world;
    char *recv = b->recv;
    switch (b->o->collective) {
    case DDP_BENCH_ALLREDUCE:
    case DDP_BENCH_BROADCAST:
        p.count = p.total = elems;
        break;
    case DDP_BENCH_REDUCE_SCATTER:
        p.count = elems / w;
        p.total = p.count * w;
        /* In place: the result lands in block[rank] of the input. */
        if (b->o->inplace) {
            p.send = recv;
            p.recv = recv + (size_t)b->rank * p.count * b->elem;
        }
        break;
    case DDP_BENCH_ALLGATHER:
        p.count = elems / w;
        p.total = p.count * w;
        if (b->o->inplace) p.send = recv + (size_t)b->rank * p.count * b->elem;
        break;
    case DDP_BENCH_BARRIER:
        break;
    case DDP_BENCH_REDUCE:
    case DDP_BENCH_SENDRECV:
        p.count = p.total = elems;
        break;
    case DDP_BENCH_GATHER:
    case DDP_BENCH_SCATTER:
    case DDP_BENCH_ALLTOALL:
        p.count = elems / w;
        p.total = p.count * w;
        break;
    case DDP_BENCH_ALLGATHERV:
    case DDP_BENCH_REDUCE_SCATTERV: {
        /* Rank r's block: c - r*c/(2n) elements, so blocks differ (the padded path). */
        size_t c = elems / w, off = 0;
        for (int r = 0; r < b->world; r++) {
            b->vc[r] = c - ((size_t)r * c) / (2 * w);
            b->vd[r] = off;
            off += b->vc[r];
        }
        p.count = c;
        p.total = off;
        break;
    }
    case DDP_BENCH_ALLTOALLV: {
        size_t c = elems / w, so = 0, ro = 0;
        for (int j = 0; j < b->world; j++) {
            b->sc[j] = a2av_count(b, c, b->rank, j);
            b->sd[j] = so;
            so += b->sc[j];
            b->rc[j] = a2av_count(b, c, j, b->rank);
            b->rd[j] = ro;
            ro += b->rc[j];
        }
        p.count = c;
        p.total = so;
        break;
    }
    case DDP_BENCH_ALLREDUCE_COALESCED:
    case DDP_BENCH_BROADCAST_COALESCED: {
        bench_t *m = (bench_t *)b; /* the pieces are scratch of the plan */
        m->bcounts[0] = elems / 2;
        m->bcounts[1] = elems / 4;
        m->bcounts[2] = elems / 8;
        m->bcounts[3] = elems - elems / 2 - elems / 4 - elems / 8;
        size_t off = 0;
        for (int k = 0; k < 4; k++) {
            m->bufs[k] = recv + off * b->elem;
            off += m->bcounts[k];
        }
        p.count = p.total = elems;
        break;
    }
    }
    if (b->o->collective == DDP_BENCH_BROADCAST) p.send = p.recv;
    return p;
}

static ddp_status_t run_once(const bench_t *b, const size_plan_t *p)
{
    ddp_group_t *g = b->group;
    ddp_dtype_t t = b->o->dtype;
    switch (b->o->collective) {
    case DDP_BENCH_ALLREDUCE: return ddp_group_allreduce(g, p->send, p->recv, p->count, t, b->o->op);
    case DDP_BENCH_BROADCAST: return ddp_group_broadcast(g, p->recv, p->count, t, b->o->root);
    case DDP_BENCH_REDUCE_SCATTER:
        return ddp_group_reduce_scatter(g, p->send, p->recv, p->count, t, b->o->op);
    case DDP_BENCH_ALLGATHER: return ddp_group_allgather(g, p->send, p->recv, p->count, t);
    case DDP_BENCH_BARRIER: return ddp_group_barrier(g);
    case DDP_BENCH_REDUCE:
        return ddp_group_reduce(g, p->send, p->recv, p->count, t, b->o->op, b->o->root);
    case DDP_BENCH_GATHER: return ddp_group_gather(g, p->send, p->recv, p->count, t, b->o->root);
    case DDP_BENCH_SCATTER: return ddp_group_scatter(g, p->send, p->recv, p->count, t, b->o->root);
    case DDP_BENCH_ALLTOALL: return ddp_group_alltoall(g, p->send, p->recv, p->count, t);
    case DDP_BENCH_ALLGATHERV:
        return ddp_group_allgatherv(g, p->send, b->vc[b->rank], p->recv, b->vc, b->vd, t);
    case DDP_BENCH_REDUCE_SCATTERV:
        return ddp_group_reduce_scatterv(g, p->send, p->recv, b->vc, t, b->o->op);
    case DDP_BENCH_ALLTOALLV:
        return ddp_group_alltoallv(g, p->send, b->sc, b->sd, p->recv, b->rc, b->rd, t);
    case DDP_BENCH_ALLREDUCE_COALESCED:
        return ddp_group_allreduce_coalesced(g, b->bufs, b->bcounts, 4, t, b->o->op);
    case DDP_BENCH_BROADCAST_COALESCED:
        return ddp_group_broadcast_coalesced(g, b->bufs, b->bcounts, 4, t, b->o->root);
    case DDP_BENCH_SENDRECV: {
        /* Ranks 2k and 2k+1 exchange one message each way; a last odd rank idles. */
        int peer = b->rank ^ 1;
        if (peer >= b->world) return DDP_OK;
        ddp_status_t s;
        if (b->rank % 2 == 0) {
            s = ddp_group_send(g, p->send, p->count, t, peer, 0);
            if (s == DDP_OK) s = ddp_group_recv(g, p->recv, p->count, t, peer, 1);
        } else {
            s = ddp_group_recv(g, p->recv, p->count, t, peer, 0);
            if (s == DDP_OK) s = ddp_group_send(g, p->send, p->count, t, peer, 1);
        }
        return s;
    }
    }
    return DDP_ERR_INVALID_ARGUMENT;
}

static int report_failure(const bench_t *b, const char *what, size_t bytes, ddp_status_t s)
{
    fprintf(stderr, "ddp-bench: rank %d: %s %s at %zu bytes: %s: %s\n", b->rank, what,
            ddp_bench_collective_name(b->o->collective), bytes, ddp_status_string(s),
            ddp_last_error());
    return -1;
}

static int run_iterations(const bench_t *b, const size_plan_t *p, long iters, size_t bytes)
{
    for (long k = 0; k < iters; k++) {
        ddp_status_t s = run_once(b, p);
        if (s != DDP_OK) return report_failure(b, "running", bytes, s);
    }
    return 0;
}

/* Fills the buffers with this rank's inputs for a checked run (check = 1) or a timed run. Timed
 * in-place reductions feed their output back in, so there the input is a fixed point of the
 * reduction (0 for sums, 1 for products) to keep values finite and out of the slow denormals. */
static void fill(const bench_t *b, const size_plan_t *p, int check)
{
    ddp_dtype_t t = b->o->dtype;
    ddp_bench_collective_t c = b->o->collective;
    int reducing = c == DDP_BENCH_ALLREDUCE || c == DDP_BENCH_REDUCE_SCATTER;
    int feeds_back = (b->o->inplace && reducing) || c == DDP_BENCH_ALLREDUCE_COALESCED;
    if (!check && feeds_back && (b->o->op == DDP_SUM || b->o->op == DDP_PROD)) {
        double v = b->o->op == DDP_SUM ? 0.0 : 1.0;
        for (size_t i = 0; i < p->total; i++) store(b->recv, i, t, v);
        return;
    }
    switch (c) {
    case DDP_BENCH_ALLREDUCE:
    case DDP_BENCH_REDUCE_SCATTER:
        for (size_t i = 0; i < p->total; i++) store((void *)p->send, i, t, input_value(b, b->rank, i));
        if (p->send != b->recv) memset(b->recv, 0xff, p->total * b->elem);
        break;
    case DDP_BENCH_BROADCAST:
        for (size_t i = 0; i < p->total; i++)
            store(b->recv, i, t, b->rank == b->o->root ? input_value(b, b->rank, i) : 100.0);
        break;
    case DDP_BENCH_ALLGATHER: {
        /* Rank r contributes the elements r*count .. (r+1)*count-1 of the global pattern. */
        size_t base = (size_t)b->rank * p->count;
        memset(b->recv, 0xff, p->total * b->elem); /* before: in place, send lies inside recv */
        for (size_t j = 0; j < p->count; j++)
            store((void *)p->send, j, t, input_value(b, b->rank, base + j));
        break;
    }
    case DDP_BENCH_BARRIER:
        break;
    case DDP_BENCH_REDUCE:
    case DDP_BENCH_ALLTOALL:
    case DDP_BENCH_REDUCE_SCATTERV:
    case DDP_BENCH_ALLTOALLV:
    case DDP_BENCH_SENDRECV:
        /* This rank's whole send buffer follows the global pattern of its rank. */
        for (size_t i = 0; i < p->total; i++) store((void *)p->send, i, t, input_value(b, b->rank, i));
        memset(b->recv, 0xff, b->capacity);
        break;
    case DDP_BENCH_GATHER:
        for (size_t j = 0; j < p->count; j++)
            store((void *)p->send, j, t, input_value(b, b->rank, (size_t)b->rank * p->count + j));
        memset(b->recv, 0xff, b->capacity);
        break;
    case DDP_BENCH_SCATTER:
        for (size_t i = 0; i < p->total; i++)
            store((void *)p->send, i, t, b->rank == b->o->root ? input_value(b, b->rank, i) : 100.0);
        memset(b->recv, 0xff, b->capacity);
        break;
    case DDP_BENCH_ALLGATHERV:
        for (size_t j = 0; j < b->vc[b->rank]; j++)
            store((void *)p->send, j, t, input_value(b, b->rank, b->vd[b->rank] + j));
        memset(b->recv, 0xff, b->capacity);
        break;
    case DDP_BENCH_ALLREDUCE_COALESCED:
        for (size_t i = 0; i < p->total; i++) store(b->recv, i, t, input_value(b, b->rank, i));
        break;
    case DDP_BENCH_BROADCAST_COALESCED:
        for (size_t i = 0; i < p->total; i++)
            store(b->recv, i, t, b->rank == b->o->root ? input_value(b, b->rank, i) : 100.0);
        break;
    }
}

/* Counts this rank's wrong output elements. */
static long long count_wrong(const bench_t *b, const size_plan_t *p)
{
    ddp_dtype_t t = b->o->dtype;
    long long wrong = 0;
    switch (b->o->collective) {
    case DDP_BENCH_ALLREDUCE:
        for (size_t i = 0; i < p->count; i++)
            wrong += !same(b, load(p->recv, i, t), expected_reduction(b, i));
        break;
    case DDP_BENCH_REDUCE_SCATTER: {
        size_t base = (size_t)b->rank * p->count;
        for (size_t j = 0; j < p->count; j++)
            wrong += !same(b, load(p->recv, j, t), expected_reduction(b, base + j));
        break;
    }
    case DDP_BENCH_BROADCAST:
        for (size_t i = 0; i < p->count; i++)
            wrong += load(p->recv, i, t) != input_value(b, b->o->root, i);
        break;
    case DDP_BENCH_ALLGATHER:
        for (size_t i = 0; i < p->total; i++)
            wrong += load(p->recv, i, t) != input_value(b, (int)(i / p->count), i);
        break;
    case DDP_BENCH_BARRIER:
        break;
    case DDP_BENCH_REDUCE:
        if (b->rank == b->o->root)
            for (size_t i = 0; i < p->count; i++)
                wrong += !same(b, load(p->recv, i, t), expected_reduction(b, i));
        break;
    case DDP_BENCH_GATHER:
        if (b->rank == b->o->root)
            for (size_t i = 0; i < p->total; i++)
                wrong += load(p->recv, i, t) != input_value(b, (int)(i / p->count), i);
        break;
    case DDP_BENCH_SCATTER:
        for (size_t j = 0; j < p->count; j++)
            wrong += load(p->recv, j, t) !=
                     input_value(b, b->o->root, (size_t)b->rank * p->count + j);
        break;
    case DDP_BENCH_ALLTOALL:
        for (int i = 0; i < b->world; i++)
            for (size_t j = 0; j < p->count; j++)
                wrong += load(p->recv, (size_t)i * p->count + j, t) !=
                         input_value(b, i, (size_t)b->rank * p->count + j);
        break;
    case DDP_BENCH_ALLGATHERV:
        for (int r = 0; r < b->world; r++)
            for (size_t j = 0; j < b->vc[r]; j++)
                wrong += load(p->recv, b->vd[r] + j, t) != input_value(b, r, b->vd[r] + j);
        break;
    case DDP_BENCH_REDUCE_SCATTERV:
        for (size_t j = 0; j < b->vc[b->rank]; j++)
            wrong += !same(b, load(p->recv, j, t), expected_reduction(b, b->vd[b->rank] + j));
        break;
    case DDP_BENCH_ALLTOALLV:
        for (int j = 0; j < b->world; j++) {
            size_t at = 0; /* where rank j's block for this rank starts in j's send */
            for (int m = 0; m < b->rank; m++) at += a2av_count(b, p->count, j, m);
            for (size_t k = 0; k < b->rc[j]; k++)
                wrong += load(p->recv, b->rd[j] + k, t) != input_value(b, j, at + k);
        }
        break;
    case DDP_BENCH_ALLREDUCE_COALESCED:
        for (size_t i = 0; i < p->total; i++)
            wrong += !same(b, load(b->recv, i, t), expected_reduction(b, i));
        break;
    case DDP_BENCH_BROADCAST_COALESCED:
        for (size_t i = 0; i < p->total; i++)
            wrong += load(b->recv, i, t) != input_value(b, b->o->root, i);
        break;
    case DDP_BENCH_SENDRECV:
        if ((b->rank ^ 1) < b->world)
            for (size_t i = 0; i < p->count; i++)
                wrong += load(p->recv, i, t) != input_value(b, b->rank ^ 1, i);
        break;
    }
    return wrong;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct result {
    size_t bytes, count;
    double time_us, min_us, max_us; /* median, fastest and slowest round */
    long iters;
    long long wrong; /* -1: not checked */
    /* How the transport ran the last iteration of each timed round (ddp_group_algorithm):
     * "single-copy" or "staged:nt" when every round agreed, else "name:rounds,..." */
    char algorithm[160];
} result_t;

/* Times `iters` iterations on this rank, then takes the slowest rank's time per iteration. */
static int timed_round(const bench_t *b, const size_plan_t *p, long iters, size_t bytes,
                       double *us_per_iter, const char **algorithm)
{
    ddp_status_t s = ddp_group_barrier(b->group);
    if (s != DDP_OK) return report_failure(b, "barrier before", bytes, s);
    double start = ddp_time_us();
    if (run_iterations(b, p, iters, bytes)) return -1;
    double t = (ddp_time_us() - start) / (double)iters;
    if (algorithm) *algorithm = ddp_group_algorithm(b->group);
    s = ddp_group_allreduce(b->group, &t, &t, 1, DDP_F64, DDP_MAX);
    if (s != DDP_OK) return report_failure(b, "max of times after", bytes, s);
    *us_per_iter = t;
    return 0;
}

static int measure(const bench_t *b, size_t bytes, result_t *r)
{
    const ddp_bench_options_t *o = b->o;
    size_plan_t p = plan_size(b, bytes);
    r->count = p.total;
    r->bytes = p.total * b->elem;
    r->wrong = -1;

    fill(b, &p, 0);
    if (run_iterations(b, &p, o->warmup, bytes)) return -1;
    if (o->check) {
        fill(b, &p, 1);
        ddp_status_t s = run_once(b, &p);
        if (s != DDP_OK) return report_failure(b, "checking", bytes, s);
        if (o->corrupt && b->rank == 0 && p.total > 0 && o->collective != DDP_BENCH_BARRIER)
            store(p.recv, 0, o->dtype, load(p.recv, 0, o->dtype) + 1.0);
        long long wrong = count_wrong(b, &p);
        s = ddp_group_allreduce(b->group, &wrong, &wrong, 1, DDP_I64, DDP_SUM);
        if (s != DDP_OK) return report_failure(b, "summing wrong counts of", bytes, s);
        r->wrong = wrong;
        fill(b, &p, 0);
    }

    /* Calibration: every rank gets the same (max) time, hence the same iteration count. */
    double per_iter = 0;
    if (timed_round(b, &p, o->iters, bytes, &per_iter, NULL)) return -1;
    long iters = o->iters;
    if (per_iter * (double)iters < o->min_round_ms * 1000.0) {
        double want = o->min_round_ms * 1000.0 / (per_iter > 0.01 ? per_iter : 0.01);
        iters = want > 10000000.0 ? 10000000L : (long)ceil(want);
    }
    r->iters = iters;

    double rounds[1000];
    const char *names[8];
    int seen[8], distinct = 0;
    for (int k = 0; k < o->rounds; k++) {
        const char *alg = "none";
        if (timed_round(b, &p, iters, bytes, &rounds[k], &alg)) return -1;
        int i = 0;
        while (i < distinct && strcmp(names[i], alg) != 0) i++;
        if (i == distinct && distinct < 8) {
            names[distinct] = alg;
            seen[distinct++] = 0;
        }
        if (i < distinct) seen[i]++;
    }
    r->algorithm[0] = '\0';
    for (int i = 0; i < distinct; i++) {
        size_t used = strlen(r->algorithm);
        if (distinct == 1)
            snprintf(r->algorithm, sizeof r->algorithm, "%s", names[i]);
        else
            snprintf(r->algorithm + used, sizeof r->algorithm - used, "%s%s:%d", i ? "," : "",
                     names[i], seen[i]);
    }
    qsort(rounds, (size_t)o->rounds, sizeof rounds[0], compare_doubles);
    int n = o->rounds;
    r->time_us = n % 2 ? rounds[n / 2] : 0.5 * (rounds[n / 2 - 1] + rounds[n / 2]);
    r->min_us = rounds[0];
    r->max_us = rounds[n - 1];
    return 0;
}

/* ---- output ------------------------------------------------------------------------------ */

static double bus_factor(const bench_t *b)
{
    double n = b->world;
    switch (b->o->collective) {
    case DDP_BENCH_ALLREDUCE: return 2.0 * (n - 1) / n;
    case DDP_BENCH_REDUCE_SCATTER:
    case DDP_BENCH_ALLGATHER: return (n - 1) / n;
    default: return 1.0;
    }
}

static const char *redop_column(const bench_t *b)
{
    ddp_bench_collective_t c = b->o->collective;
    return c == DDP_BENCH_ALLREDUCE || c == DDP_BENCH_REDUCE_SCATTER || c == DDP_BENCH_REDUCE ||
                   c == DDP_BENCH_REDUCE_SCATTERV || c == DDP_BENCH_ALLREDUCE_COALESCED
               ? ddp_reduce_op_name(b->o->op)
               : "none";
}

static void print_header(const bench_t *b)
{
    const ddp_bench_options_t *o = b->o;
    printf("# ddp-bench %s: %d ranks, transport %s, %s buffers, %s\n",
           ddp_bench_collective_name(o->collective), b->world, ddp_group_transport(b->group),
           o->segment ? "segment" : o->registered ? "registered user" : "user",
           o->inplace ? "in place" : "out of place");
    printf("# time: per iteration, max over ranks, median of %d rounds of >= %d iterations and "
           ">= %g ms; warmup %d; check %s\n",
           o->rounds, o->iters, o->min_round_ms, o->warmup, o->check ? "on" : "off");
    printf("#\n");
    printf("# %12s %12s %6s %6s %12s %12s %12s %8s\n", "size", "count", "type", "redop",
           "time(us)", "algbw(GB/s)", "busbw(GB/s)", "wrong");
    fflush(stdout);
}

static void print_row(const bench_t *b, const result_t *r)
{
    double algbw = r->time_us > 0 ? (double)r->bytes / r->time_us / 1e3 : 0.0;
    double busbw = algbw * bus_factor(b);
    const ddp_bench_options_t *o = b->o;
    if (o->json) {
        char wrong[32];
        if (r->wrong < 0) snprintf(wrong, sizeof wrong, "null");
        else snprintf(wrong, sizeof wrong, "%lld", r->wrong);
        printf("{\"op\":\"%s\",\"dtype\":\"%s\",\"redop\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
               "\"time_us\":%.4f,\"algbw\":%.6g,\"busbw\":%.6g,\"wrong\":%s,\"world_size\":%d,"
               "\"inplace\":%d,\"segment\":%d,\"registered\":%d,\"transport\":\"%s\","
               "\"iters\":%ld,\"rounds\":%d,"
               "\"time_us_min\":%.4f,\"time_us_max\":%.4f,\"algorithm\":\"%s\"}\n",
               ddp_bench_collective_name(o->collective), ddp_dtype_name(o->dtype), redop_column(b),
               r->bytes, r->count, r->time_us, algbw, busbw, wrong, b->world, o->inplace,
               o->segment, o->registered, ddp_group_transport(b->group), r->iters, o->rounds,
               r->min_us,
               r->max_us, r->algorithm);
    } else {
        char wrong[32];
        if (r->wrong < 0) snprintf(wrong, sizeof wrong, "N/A");
        else snprintf(wrong, sizeof wrong, "%lld", r->wrong);
        printf("  %12zu %12zu %6s %6s %12.2f %12.2f %12.2f %8s\n", r->bytes, r->count,
               ddp_dtype_name(o->dtype), redop_column(b), r->time_us, algbw, busbw, wrong);
    }
    fflush(stdout);
}

/* ---- buffers ----------------------------------------------------------------------------- */

/* Bytes alloc_user allocates for `bytes`: whole pages, at least one. */
static size_t user_bytes(size_t bytes)
{
    size_t rounded = (bytes + 4095) / 4096 * 4096;
    return rounded ? rounded : 4096;
}

static void *alloc_user(size_t bytes)
{
    void *p = aligned_alloc(4096, user_bytes(bytes));
    if (p) memset(p, 0, user_bytes(bytes)); /* fault the pages in before timing */
    return p;
}

/* --register 1: every page of a malloc'd buffer, so that every size of the sweep lies in it. */
static int register_user(bench_t *b, void *buf)
{
    ddp_status_t s = ddp_group_register_memory(b->group, buf, user_bytes(b->capacity));
    if (s == DDP_OK) return 0;
    fprintf(stderr, "ddp-bench: rank %d: ddp_group_register_memory(%zu bytes): %s: %s\n",
            b->rank, user_bytes(b->capacity), ddp_status_string(s), ddp_last_error());
    return -1;
}

static void unregister_user(bench_t *b, void *buf)
{
    ddp_status_t s = ddp_group_unregister_memory(b->group, buf);
    if (s != DDP_OK)
        fprintf(stderr, "ddp-bench: rank %d: ddp_group_unregister_memory: %s: %s\n", b->rank,
                ddp_status_string(s), ddp_last_error());
}

static int alloc_buffers(bench_t *b)
{
    size_t bytes = b->capacity;
    if (b->o->segment) {
        ddp_status_t s = ddp_group_alloc_buffer(b->group, bytes ? bytes : 64, &b->recv);
        if (s == DDP_OK && !b->o->inplace)
            s = ddp_group_alloc_buffer(b->group, bytes ? bytes : 64, &b->send);
        if (s != DDP_OK) {
            fprintf(stderr, "ddp-bench: rank %d: ddp_group_alloc_buffer(%zu): %s: %s\n", b->rank,
                    bytes, ddp_status_string(s), ddp_last_error());
            return -1;
        }
        memset(b->recv, 0, bytes);
        if (!b->o->inplace) memset(b->send, 0, bytes);
    } else {
        b->recv = alloc_user(bytes);
        b->send = b->o->inplace ? NULL : alloc_user(bytes);
        if (!b->recv || (!b->o->inplace && !b->send)) {
            fprintf(stderr, "ddp-bench: rank %d: out of memory for two %zu-byte buffers\n",
                    b->rank, bytes);
            return -1;
        }
        if (b->o->registered) {
            b->recv_registered = register_user(b, b->recv) == 0;
            b->send_registered = !b->o->inplace && b->recv_registered &&
                                 register_user(b, b->send) == 0;
            if (!b->recv_registered || (!b->o->inplace && !b->send_registered)) {
                if (b->recv_registered) unregister_user(b, b->recv);
                free(b->recv);
                free(b->send);
                b->recv = b->send = NULL;
                b->recv_registered = 0;
                return -1;
            }
        }
    }
    if (b->o->inplace) b->send = b->recv;
    return 0;
}

static void free_buffers(bench_t *b)
{
    if (b->o->segment) {
        if (b->send && b->send != b->recv) ddp_group_free_buffer(b->group, b->send);
        if (b->recv) ddp_group_free_buffer(b->group, b->recv);
    } else {
        if (b->send_registered) unregister_user(b, b->send);
        if (b->recv_registered) unregister_user(b, b->recv);
        if (b->send != b->recv) free(b->send);
        free(b->recv);
    }
}

int ddp_bench_collectives(ddp_group_t *group, const ddp_bench_options_t *options)
{
    bench_t b = {
        .group = group,
        .o = options,
        .rank = ddp_group_rank(group),
        .world = ddp_group_size(group),
        .elem = ddp_dtype_size(options->dtype),
        .capacity = options->collective == DDP_BENCH_BARRIER ? 0 : options->max_bytes,
    };
    size_t w = (size_t)b.world;
    size_t *counts = calloc(6 * w, sizeof *counts);
    if (!counts) {
        fprintf(stderr, "ddp-bench: rank %d: out of memory for count arrays\n", b.rank);
        return DDP_BENCH_EXIT_FAILED;
    }
    b.vc = counts;
    b.vd = counts + w;
    b.sc = counts + 2 * w;
    b.sd = counts + 3 * w;
    b.rc = counts + 4 * w;
    b.rd = counts + 5 * w;
    if (alloc_buffers(&b)) {
        free(counts);
        return DDP_BENCH_EXIT_FAILED;
    }

    int rc = DDP_BENCH_EXIT_OK;
    double busbw_sum = 0;
    int rows = 0;
    if (b.rank == 0 && !options->json) print_header(&b);
    for (size_t bytes = options->min_bytes;;) {
        result_t r;
        if (options->collective == DDP_BENCH_BARRIER) bytes = 0;
        if (measure(&b, bytes, &r)) {
            rc = DDP_BENCH_EXIT_FAILED;
            break;
        }
        if (r.wrong > 0) rc = DDP_BENCH_EXIT_FAILED;
        if (b.rank == 0) print_row(&b, &r);
        busbw_sum += r.time_us > 0 ? (double)r.bytes / r.time_us / 1e3 * bus_factor(&b) : 0;
        rows++;
        /* The barrier has no size; other collectives step until the largest size. */
        if (options->collective == DDP_BENCH_BARRIER || bytes == 0) break;
        if (bytes > options->max_bytes / options->factor) break;
        bytes *= options->factor;
    }
    if (b.rank == 0 && !options->json && rc == DDP_BENCH_EXIT_OK) {
        printf("# Avg bus bandwidth    : %.3f GB/s\n", rows ? busbw_sum / rows : 0.0);
        printf("# Wrong elements       : %s\n", options->check ? "0" : "not checked");
    }
    if (b.rank == 0 && rc != DDP_BENCH_EXIT_OK && !options->json)
        printf("# FAILED: a collective failed or returned wrong elements\n");
    free_buffers(&b);
    free(counts);
    return rc;
}
