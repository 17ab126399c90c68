/* Reducer behaviours over real rank processes, each checked against values computed the simple
 * way: unused parameters (find_unused_parameters), no_sync accumulation, the one-time rebuild in
 * rank 0's arrival order, sparse gradients, user_grads, comm hooks, statistics and traces,
 * half-precision buckets, duplicate parameters, buffer broadcast, and the two initial bucket
 * layouts (config.bucket_layout).
 *
 * usage: test_reducer_features CASE WORLD */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

/* Gradient element e of parameter i on rank r at step s: multiples of 1/8, exact in f16. */
static double gval(size_t i, int r, int s, size_t e)
{
    return (double)(r + 1) * 0.5 + (double)i * 0.25 + (double)(e % 13) * 0.125 - (double)s;
}

static double get(ddp_dtype_t d, const void *p, size_t i)
{
    switch (d) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}
static void put(ddp_dtype_t d, void *p, size_t i, double v)
{
    switch (d) {
    case DDP_F32: ((float *)p)[i] = (float)v; break;
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16((float)v); break;
    default: ((uint16_t *)p)[i] = ddp_f32_to_bf16((float)v); break;
    }
}

#define MAXP 8
typedef struct model {
    size_t n;
    ddp_param_t p[MAXP];
    void *data[MAXP];
    void *grad[MAXP];
} model_t;

static const char *pname[MAXP] = {"embed", "l1.w", "l1.b", "l2.w", "l2.b", "l3.w", "l3.b", "x"};

/* Sizes include 0, 1, odd, prime and a larger one. */
static void model_make(model_t *m, size_t n, const size_t *numel, ddp_dtype_t dtype,
                       int user_grads)
{
    memset(m, 0, sizeof *m);
    m->n = n;
    for (size_t i = 0; i < n; i++) {
        m->data[i] = calloc(numel[i] + 1, 8);
        m->grad[i] = calloc(numel[i] + 1, 8);
        m->p[i].name = pname[i];
        m->p[i].data = m->data[i];
        m->p[i].numel = numel[i];
        m->p[i].dtype = dtype;
        m->p[i].grad = user_grads ? m->grad[i] : NULL;
    }
}

static void model_free(model_t *m)
{
    for (size_t i = 0; i < m->n; i++) {
        free(m->data[i]);
        free(m->grad[i]);
    }
}

static void *grad_of(ddp_reducer_t *r, size_t i)
{
    void *g = NULL;
    CHECK_OK(ddp_reducer_grad(r, i, &g));
    return g;
}

/* Adds this rank's gradient of step s into parameter i's gradient and marks it ready. */
static void produce(ddp_reducer_t *r, const model_t *m, size_t i, int rank, int s)
{
    void *g = grad_of(r, i);
    for (size_t e = 0; e < m->p[i].numel; e++)
        put(m->p[i].dtype, g, e, get(m->p[i].dtype, g, e) + gval(i, rank, s, e));
    CHECK_OK(ddp_reducer_grad_ready(r, i));
}

static double mean_over_ranks(size_t i, int world, int s, size_t e)
{
    double sum = 0;
    for (int q = 0; q < world; q++) sum += gval(i, q, s, e);
    return sum / world;
}

static void expect_grad(ddp_reducer_t *r, const model_t *m, size_t i, double (*want)(size_t,
                        size_t, void *), void *ctx, double tol, const char *what)
{
    void *g = grad_of(r, i);
    for (size_t e = 0; e < m->p[i].numel; e++) {
        double x = get(m->p[i].dtype, g, e), w = want(i, e, ctx);
        CHECK_MSG(fabs(x - w) <= tol * (1.0 + fabs(w)), "%s: %s[%zu] = %.17g, expected %.17g",
                  what, m->p[i].name, e, x, w);
    }
}

typedef struct step_ctx {
    int world, step;
} step_ctx_t;
static double want_mean(size_t i, size_t e, void *c)
{
    step_ctx_t *s = c;
    return mean_over_ranks(i, s->world, s->step, e);
}

/* ---- unused parameters ---------------------------------------------------------------------- */
typedef struct unused_ctx {
    int world;
} unused_ctx_t;
static double want_unused_b(size_t i, size_t e, void *c)
{
    unused_ctx_t *u = c; /* rank 0 does not use it: zeros from rank 0 */
    double sum = 0;
    for (int q = 1; q < u->world; q++) sum += gval(i, q, 0, e);
    return sum / u->world;
}
static double want_sentinel(size_t i, size_t e, void *c)
{
    (void)i;
    (void)c;
    return 7.0 + (double)e;
}

static int case_unused(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[5] = {5, 1, 257, 0, 31};
    for (int user = 0; user < 2; user++) {
        model_t m;
        model_make(&m, 5, numel, DDP_F32, user);
        ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
        c.find_unused_parameters = 1;
        c.user_grads = user;
        c.first_bucket_bytes = 8;
        c.bucket_cap_bytes = 64;
        ddp_reducer_t *r = NULL;
        CHECK_OK(ddp_reducer_create(group, m.p, 5, NULL, 0, &c, &r));
        /* Step 0: param 1 unused on rank 0 only; param 2 unused everywhere (its gradient holds
         * a sentinel that must survive); the others used. */
        CHECK_OK(ddp_reducer_prepare(r));
        void *g2 = grad_of(r, 2);
        for (size_t e = 0; e < numel[2]; e++) put(DDP_F32, g2, e, want_sentinel(2, e, NULL));
        produce(r, &m, 4, rank, 0);
        if (rank != 0) produce(r, &m, 1, rank, 0);
        produce(r, &m, 3, rank, 0);
        produce(r, &m, 0, rank, 0);
        CHECK_OK(ddp_reducer_finalize(r));
        step_ctx_t sc = {world, 0};
        unused_ctx_t uc = {world};
        expect_grad(r, &m, 0, want_mean, &sc, 1e-6, "used");
        expect_grad(r, &m, 4, want_mean, &sc, 1e-6, "used");
        expect_grad(r, &m, 1, want_unused_b, &uc, 1e-6, "unused on rank 0");
        expect_grad(r, &m, 2, want_sentinel, NULL, 0, "unused everywhere");
        /* Step 1: everything used again (no rebuild with find_unused_parameters, as c10d:
         * the layout stays the initial one, reverse registration order). */
        CHECK_OK(ddp_reducer_zero_grad(r));
        CHECK_OK(ddp_reducer_prepare(r));
        const size_t *ps;
        size_t np;
        CHECK_OK(ddp_reducer_bucket_params(r, 0, &ps, &np));
        CHECK(np >= 1 && ps[0] == 4);
        for (size_t i = 5; i-- > 0;) produce(r, &m, i, rank, 1);
        CHECK_OK(ddp_reducer_finalize(r));
        sc.step = 1;
        for (size_t i = 0; i < 5; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "used again");
        ddp_reducer_destroy(r);
        model_free(&m);
    }
    return 0;
}

/* ---- no_sync ------------------------------------------------------------------------------ */
typedef struct acc_ctx {
    int world, rank, steps, local;
} acc_ctx_t;
static double want_acc(size_t i, size_t e, void *c)
{
    acc_ctx_t *a = c;
    double sum = 0;
    for (int s = 0; s < a->steps; s++) {
        if (a->local) sum += gval(i, a->rank, s, e);
        else sum += mean_over_ranks(i, a->world, s, e);
    }
    return sum;
}

static int case_nosync(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[4] = {3, 101, 1, 64};
    for (int user = 0; user < 2; user++) {
        model_t m;
        model_make(&m, 4, numel, DDP_F64, user);
        ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
        c.user_grads = user;
        c.first_bucket_bytes = 16;
        c.bucket_cap_bytes = 256;
        ddp_reducer_t *r = NULL;
        CHECK_OK(ddp_reducer_create(group, m.p, 4, NULL, 0, &c, &r));
        CHECK_OK(ddp_reducer_set_sync(r, 0));
        for (int s = 0; s < 2; s++) {
            CHECK_OK(ddp_reducer_prepare(r));
            for (size_t i = 4; i-- > 0;) produce(r, &m, i, rank, s);
            CHECK_OK(ddp_reducer_finalize(r));
        }
        /* Still local sums: no communication happened. */
        acc_ctx_t a = {world, rank, 2, 1};
        for (size_t i = 0; i < 4; i++) expect_grad(r, &m, i, want_acc, &a, 1e-12, "no_sync");
        CHECK_STATUS(ddp_reducer_stats(r, &(ddp_reducer_stats_t){0}), DDP_ERR_INVALID_USAGE);
        CHECK_OK(ddp_reducer_set_sync(r, 1));
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = 4; i-- > 0;) produce(r, &m, i, rank, 2);
        CHECK_OK(ddp_reducer_finalize(r));
        /* = the large-batch gradient: average over ranks of the three micro-steps' sum. */
        acc_ctx_t b = {world, rank, 3, 0};
        for (size_t i = 0; i < 4; i++) expect_grad(r, &m, i, want_acc, &b, 1e-12, "synced");
        ddp_reducer_destroy(r);
        model_free(&m);
    }
    return 0;
}

/* ---- rebuild ------------------------------------------------------------------------------- */
static int case_rebuild(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[6] = {4, 4, 4, 4, 4, 4}; /* 16 bytes each (f32) */
    model_t m;
    model_make(&m, 6, numel, DDP_F32, 0);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 16;
    c.bucket_cap_bytes = 32;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 6, NULL, 0, &c, &r));
    /* Initial: reverse registration order, first bucket 16 bytes, then 32: {5} {4,3} {2,1} {0}. */
    static const size_t initial[4][2] = {{5, 9}, {4, 3}, {2, 1}, {0, 9}};
    CHECK(ddp_reducer_bucket_count(r) == 4);
    for (size_t b = 0; b < 4; b++) {
        const size_t *ps;
        size_t np;
        CHECK_OK(ddp_reducer_bucket_params(r, b, &ps, &np));
        CHECK(np == (initial[b][1] == 9 ? 1u : 2u));
        for (size_t j = 0; j < np; j++) CHECK(ps[j] == initial[b][j]);
    }
    /* Rank 0's arrival order (others use a different one: rank 0 decides). */
    static const size_t order0[6] = {2, 0, 5, 1, 4, 3};
    static const size_t orderN[6] = {5, 4, 3, 2, 1, 0};
    const size_t *order = rank == 0 ? order0 : orderN;
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_zero_grad(r));
        CHECK_OK(ddp_reducer_prepare(r));
        for (int k = 0; k < 6; k++) produce(r, &m, order[k], rank, s);
        CHECK_OK(ddp_reducer_finalize(r));
        step_ctx_t sc = {world, s};
        for (size_t i = 0; i < 6; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "rebuild");
        if (s == 0) {
            /* Gradients survive the rebuild in the next prepare; pointers may move. */
            CHECK_OK(ddp_reducer_prepare(r));
            for (size_t i = 0; i < 6; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "moved");
            static const size_t rebuilt[4][2] = {{2, 9}, {0, 5}, {1, 4}, {3, 9}};
            CHECK(ddp_reducer_bucket_count(r) == 4);
            for (size_t b = 0; b < 4; b++) {
                const size_t *ps;
                size_t np;
                CHECK_OK(ddp_reducer_bucket_params(r, b, &ps, &np));
                CHECK_MSG(np == (rebuilt[b][1] == 9 ? 1u : 2u), "bucket %zu has %zu", b, np);
                for (size_t j = 0; j < np; j++) CHECK(ps[j] == rebuilt[b][j]);
            }
            for (int k = 0; k < 6; k++) produce(r, &m, order[k], rank, 99);
            CHECK_OK(ddp_reducer_finalize(r));
        }
    }
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* ---- sparse ---------------------------------------------------------------------------------- */
static int case_sparse(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    enum { ROWS = 11, WIDTH = 3 };
    for (int dt = 0; dt < 2; dt++) {
        ddp_dtype_t dtype = dt ? DDP_F64 : DDP_F32;
        size_t numel[3] = {ROWS * WIDTH, 7, 0};
        model_t m;
        model_make(&m, 3, numel, dtype, 0);
        m.p[0].sparse = 1;
        m.p[0].rows = ROWS;
        ddp_reducer_t *r = NULL;
        ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
        CHECK_OK(ddp_reducer_create(group, m.p, 3, NULL, 0, &c, &r));
        CHECK(ddp_reducer_bucket_count(r) == 2);
        for (int s = 0; s < 2; s++) {
            CHECK_OK(ddp_reducer_zero_grad(r));
            CHECK_OK(ddp_reducer_prepare(r));
            produce(r, &m, 2, rank, s);
            produce(r, &m, 1, rank, s);
            /* Rank q sends q+s+1 rows (rank 0 none in step 1), with duplicates. */
            size_t nrows = (size_t)((rank + s + 1) % 4);
            int64_t idx[8];
            double vals[8 * WIDTH];
            unsigned char raw[8 * WIDTH * 8];
            for (size_t j = 0; j < nrows; j++) {
                idx[j] = (int64_t)((rank * 3 + j * 5 + (size_t)s) % ROWS);
                if (j == 2) idx[j] = idx[0];
                for (size_t e = 0; e < WIDTH; e++) {
                    vals[j * WIDTH + e] = (double)(rank + 1) + 0.25 * (double)j + 0.5 * (double)e;
                    put(dtype, raw, j * WIDTH + e, vals[j * WIDTH + e]);
                }
            }
            CHECK_OK(ddp_reducer_sparse_grad(r, 0, idx, raw, nrows));
            CHECK_OK(ddp_reducer_finalize(r));
            /* Dense reference: every rank's rows summed, divided by world. */
            double dense[ROWS * WIDTH] = {0};
            int touched[ROWS] = {0};
            for (int q = 0; q < world; q++) {
                size_t nq = (size_t)((q + s + 1) % 4);
                for (size_t j = 0; j < nq; j++) {
                    int64_t row = (int64_t)((q * 3 + j * 5 + (size_t)s) % ROWS);
                    if (j == 2) row = (int64_t)((q * 3 + (size_t)s) % ROWS);
                    touched[row] = 1;
                    for (size_t e = 0; e < WIDTH; e++)
                        dense[row * WIDTH + e] += (double)(q + 1) + 0.25 * (double)j + 0.5 * (double)e;
                }
            }
            const int64_t *ri;
            const void *rv;
            size_t rn;
            CHECK_OK(ddp_reducer_sparse_result(r, 0, &ri, &rv, &rn));
            size_t want_rows = 0;
            for (size_t row = 0; row < ROWS; row++) want_rows += (size_t)touched[row];
            CHECK_MSG(rn == want_rows, "step %d: %zu result rows, expected %zu", s, rn, want_rows);
            for (size_t j = 0; j < rn; j++) {
                CHECK(ri[j] >= 0 && ri[j] < ROWS && touched[ri[j]]);
                if (j > 0) CHECK(ri[j] > ri[j - 1]);
                for (size_t e = 0; e < WIDTH; e++) {
                    double want = dense[ri[j] * WIDTH + e] / world;
                    CHECK(fabs(get(dtype, rv, j * WIDTH + e) - want) <= 1e-6 * (1 + fabs(want)));
                }
            }
            step_ctx_t sc = {world, s};
            expect_grad(r, &m, 1, want_mean, &sc, 1e-6, "dense next to sparse");
        }
        void *g;
        CHECK_STATUS(ddp_reducer_grad(r, 0, &g), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("embed");
        CHECK_STATUS(ddp_reducer_grad_ready(r, 0), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("embed");
        ddp_reducer_destroy(r);
        model_free(&m);
    }
    return 0;
}

/* ---- user_grads -------------------------------------------------------------------------------- */
static int case_usergrads(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[5] = {2, 3, 5, 7, 1000};
    model_t m;
    model_make(&m, 5, numel, DDP_F32, 1);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.user_grads = 1;
    c.first_bucket_bytes = 12;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 5, NULL, 0, &c, &r));
    for (size_t i = 0; i < 5; i++) CHECK(grad_of(r, i) == m.grad[i]);
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_zero_grad(r));
        for (size_t i = 0; i < 5; i++)
            for (size_t e = 0; e < numel[i]; e++) CHECK(((float *)m.grad[i])[e] == 0.0f);
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = 5; i-- > 0;) produce(r, &m, i, rank, s);
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t i = 0; i < 5; i++)
            for (size_t e = 0; e < numel[i]; e++) {
                double want = mean_over_ranks(i, world, s, e);
                CHECK(fabs(((float *)m.grad[i])[e] - want) <= 1e-6 * (1 + fabs(want)));
            }
    }
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* ---- comm hook, stats and trace ---------------------------------------------------------------- */
typedef struct hook_state {
    ddp_reducer_t *reducer;
    int world, rank, step;
    int averages; /* config.comm_hook_averages */
    size_t calls;
    size_t next_index;
    const model_t *m;
} hook_state_t;

static ddp_status_t counting_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *b,
                                  ddp_work_t **work)
{
    hook_state_t *h = state;
    CHECK(b->index == h->next_index); /* strictly in bucket order */
    h->next_index++;
    h->calls++;
    CHECK(b->iteration == (uint64_t)h->step);
    const size_t *ps;
    size_t np;
    CHECK_OK(ddp_reducer_bucket_params(h->reducer, b->index, &ps, &np));
    CHECK(np == b->nparams);
    size_t off = 0;
    for (size_t j = 0; j < np; j++) {
        CHECK(b->params[j] == ps[j]);
        CHECK(b->offsets[j] == off);
        CHECK(b->numels[j] == h->m->p[ps[j]].numel);
        CHECK(b->rows[j] == h->m->p[ps[j]].rows);
        /* Already divided by the world size, unless the hook said it averages itself. */
        CHECK(b->prescaled == !h->averages);
        for (size_t e = 0; e < b->numels[j]; e++) {
            double want = gval(ps[j], h->rank, h->step, e) / (h->averages ? 1 : h->world);
            CHECK(fabs(get(b->dtype, b->data, off + e) - want) <= 1e-6 * (1 + fabs(want)));
        }
        off += b->numels[j];
    }
    CHECK(b->numel == off);
    return ddp_group_allreduce_async(group, b->data, b->data, b->numel, b->dtype,
                                     h->averages ? DDP_AVG : DDP_SUM, work);
}

static int hook_run(ddp_group_t *group, int averages)
{
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[6] = {17, 1, 0, 100, 3, 29};
    model_t m;
    model_make(&m, 6, numel, DDP_F32, 0);
    m.p[0].rows = 17;
    m.p[3].rows = 10;
    hook_state_t h = {0};
    h.world = world;
    h.rank = rank;
    h.m = &m;
    h.averages = averages;
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 8;
    c.bucket_cap_bytes = 128;
    c.comm_hook_averages = averages;
    c.comm_hook = counting_hook;
    c.comm_hook_state = &h;
    char path[700];
    snprintf(path, sizeof path, "%s/trace-%d-%d.json", ddp_test_tmpdir(), rank, averages);
    ddp_trace_t *trace = NULL;
    CHECK_OK(ddp_trace_open(path, rank, &trace));
    c.trace = trace;
    c.rebuild_buckets = 0;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 6, NULL, 0, &c, &r));
    h.reducer = r;
    size_t nb = ddp_reducer_bucket_count(r);
    CHECK(nb >= 3);
    for (int s = 0; s < 2; s++) {
        h.step = s;
        h.next_index = 0;
        CHECK_OK(ddp_reducer_zero_grad(r));
        CHECK_OK(ddp_reducer_prepare(r));
        /* Step 0 in backward order; step 1 in registration order, so the last bucket is ready
         * first and must wait: the hook checks that launches still come in bucket order. */
        for (size_t k = 0; k < 6; k++) {
            produce(r, &m, s == 0 ? 5 - k : k, rank, s);
            if (s == 1 && k < 5) CHECK(h.calls == nb * (size_t)s); /* bucket 0 not ready yet */
            usleep(200);
        }
        CHECK_OK(ddp_reducer_finalize(r));
        CHECK(h.calls == nb * (size_t)(s + 1));
        step_ctx_t sc = {world, s};
        for (size_t i = 0; i < 6; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "hook");
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(r, &st));
        CHECK(st.iteration == (uint64_t)s);
        CHECK(st.nbuckets == nb && st.buckets);
        size_t bytes = 0;
        for (size_t i = 0; i < 6; i++) bytes += numel[i] * 4;
        CHECK(st.bytes == bytes);
        CHECK(st.backward_us > 0 && st.exposed_us >= 0 && st.comm_us >= 0);
        size_t sum = 0;
        for (size_t b = 0; b < nb; b++) {
            const ddp_bucket_stats_t *bs = &st.buckets[b];
            sum += bs->bytes;
            CHECK(bs->ready_us >= 0 && bs->launch_us >= bs->ready_us && bs->done_us >= bs->launch_us);
            if (b > 0) CHECK(bs->launch_us >= st.buckets[b - 1].launch_us);
        }
        CHECK(sum == bytes);
    }
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_trace_close(trace));
    FILE *f = fopen(path, "r");
    CHECK(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    CHECK_MSG(strstr(text, "bucket 0") && strstr(text, "comm"), "trace lacks bucket spans: %s",
              text);
    model_free(&m);
    return 0;
}

/* The hook contract both ways: prescaled buckets that the hook sums, and (comm_hook_averages)
 * unscaled buckets that the hook averages. */
static int case_hook(ddp_group_t *group, void *arg)
{
    (void)arg;
    if (hook_run(group, 0)) return 1;
    return hook_run(group, 1);
}

/* ---- f16 / bf16 buckets and mixed dtypes ------------------------------------------------------ */
static int case_half(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[4] = {9, 4, 13, 1};
    model_t m;
    model_make(&m, 4, numel, DDP_F16, 0);
    m.p[1].dtype = DDP_BF16;
    m.p[2].dtype = DDP_F32;
    m.p[3].dtype = DDP_F64;
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 4, NULL, 0, &c, &r));
    CHECK(ddp_reducer_bucket_count(r) == 4); /* one per dtype */
    CHECK_OK(ddp_reducer_prepare(r));
    for (size_t i = 4; i-- > 0;) produce(r, &m, i, rank, 0);
    CHECK_OK(ddp_reducer_finalize(r));
    step_ctx_t sc = {world, 0};
    expect_grad(r, &m, 0, want_mean, &sc, 2e-3, "f16");
    expect_grad(r, &m, 1, want_mean, &sc, 1e-2, "bf16");
    expect_grad(r, &m, 2, want_mean, &sc, 1e-6, "f32");
    expect_grad(r, &m, 3, want_mean, &sc, 1e-12, "f64");
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* ---- duplicates, initial broadcast and buffers -------------------------------------------------- */
static int case_dup_buffers(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[4] = {6, 5, 6, 3};
    model_t m;
    model_make(&m, 4, numel, DDP_F32, 0);
    m.p[2].data = m.p[0].data; /* tied weights registered twice */
    m.p[2].name = "tied";
    for (size_t i = 0; i < 4; i++)
        for (size_t e = 0; e < numel[i] && i != 2; e++)
            put(DDP_F32, m.p[i].data, e, rank * 100 + i * 10 + e);
    /* Buffers: one large (broadcast alone with a tiny coalescing bucket), small ones coalesced,
     * an integer one, an empty one. */
    double running[40];
    int64_t count[1] = {rank + 5};
    float small[3];
    for (int e = 0; e < 40; e++) running[e] = rank * 1000 + e;
    for (int e = 0; e < 3; e++) small[e] = (float)(rank * 10 + e);
    ddp_buffer_t buffers[4] = {{"bn.running_mean", running, 40, DDP_F64},
                               {"bn.num_batches", count, 1, DDP_I64},
                               {"small", small, 3, DDP_F32},
                               {"empty", NULL, 0, DDP_F32}};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.broadcast_bucket_bytes = 64;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 4, buffers, 4, &c, &r));
    /* Rank 0's values everywhere. */
    for (size_t i = 0; i < 4; i++)
        for (size_t e = 0; e < numel[i]; e++)
            CHECK(get(DDP_F32, m.p[i].data, e) == (double)((i == 2 ? 0 : i) * 10 + e));
    for (int e = 0; e < 40; e++) CHECK(running[e] == e);
    CHECK(count[0] == 5 && small[2] == 2.0f);
    CHECK(grad_of(r, 2) == grad_of(r, 0));
    /* Buffers change locally, prepare broadcasts rank 0's again. */
    running[3] = rank + 0.5;
    count[0] = 50 + rank;
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK(running[3] == 0.5 && count[0] == 50);
    produce(r, &m, 3, rank, 0);
    produce(r, &m, 1, rank, 0);
    produce(r, &m, 0, rank, 0);
    /* The duplicate maps to the kept parameter: reporting it again is "twice". */
    CHECK_STATUS(ddp_reducer_grad_ready(r, 2), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("embed");
    (void)world;
    ddp_reducer_finalize(r); /* fails on every rank (the twice error); covered in the errors test */
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* ---- large sizes, and no sync at create ----------------------------------------------------- */
static int case_large(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[3] = {(size_t)3 << 20, 1000003, 2};
    model_t m;
    model_make(&m, 3, numel, DDP_F32, 0);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.bucket_cap_bytes = (size_t)4 << 20;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 3, NULL, 0, &c, &r));
    for (int s = 0; s < 2; s++) {
        CHECK_OK(ddp_reducer_zero_grad(r));
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = 3; i-- > 0;) produce(r, &m, i, rank, s);
        CHECK_OK(ddp_reducer_finalize(r));
        step_ctx_t sc = {world, s};
        for (size_t i = 0; i < 3; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "large");
    }
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

static int case_noinit(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[2] = {5, 3};
    model_t m;
    model_make(&m, 2, numel, DDP_F64, 0);
    for (size_t e = 0; e < 5; e++) put(DDP_F64, m.p[0].data, e, rank + 0.5);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.sync_at_create = 0;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 2, NULL, 0, &c, &r));
    for (size_t e = 0; e < 5; e++) CHECK(get(DDP_F64, m.p[0].data, e) == rank + 0.5);
    CHECK_OK(ddp_reducer_prepare(r));
    produce(r, &m, 1, rank, 0);
    produce(r, &m, 0, rank, 0);
    CHECK_OK(ddp_reducer_finalize(r));
    step_ctx_t sc = {world, 0};
    for (size_t i = 0; i < 2; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-12, "noinit");
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* A bucket holding only empty parameters still takes part (a count-0 collective). */
static int case_empty(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t numel[3] = {0, 0, 4};
    model_t m;
    model_make(&m, 3, numel, DDP_F32, 0);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 1;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, 3, NULL, 0, &c, &r));
    CHECK(ddp_reducer_bucket_count(r) == 2);
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_zero_grad(r));
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = 3; i-- > 0;) produce(r, &m, i, rank, s);
        CHECK_OK(ddp_reducer_finalize(r));
        step_ctx_t sc = {world, s};
        expect_grad(r, &m, 2, want_mean, &sc, 1e-6, "empty");
    }
    ddp_reducer_destroy(r);
    model_free(&m);
    return 0;
}

/* ---- initial bucket layout ------------------------------------------------------------------- */
static void expect_layout(ddp_reducer_t *r, size_t nbuckets, const size_t *starts,
                          const size_t *params, const char *what)
{
    CHECK_MSG(ddp_reducer_bucket_count(r) == nbuckets, "%s: %zu buckets, expected %zu", what,
              ddp_reducer_bucket_count(r), nbuckets);
    for (size_t b = 0; b < nbuckets; b++) {
        const size_t *ps;
        size_t np;
        CHECK_OK(ddp_reducer_bucket_params(r, b, &ps, &np));
        CHECK_MSG(np == starts[b + 1] - starts[b], "%s: bucket %zu has %zu parameters", what, b,
                  np);
        for (size_t j = 0; j < np; j++)
            CHECK_MSG(ps[j] == params[starts[b] + j], "%s: bucket %zu[%zu] = %zu, expected %zu",
                      what, b, j, ps[j], params[starts[b] + j]);
    }
}

static int case_layout(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    /* Three layers registered weight then bias: 16 and 4 bytes (f32). Limits 16 then 32 bytes. */
    size_t numel[6] = {4, 1, 4, 1, 4, 1};
    model_t m;
    model_make(&m, 6, numel, DDP_F32, 0);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 16;
    c.bucket_cap_bytes = 32;
    c.rebuild_buckets = 0; /* the initial layout stays */
    /* last-first: visited 5 4 | 3 2 1 0, list reversed: the small bucket {5, 4} (the last layer)
     * is reduced first. c10d: visited 0 | 1 2 3 4 | 5, list reversed: the small bucket {0} (the
     * first weight) is reduced last and the previous layer's bias opens the middle bucket. */
    static const size_t last_first_starts[3] = {0, 2, 6}, last_first[6] = {5, 4, 3, 2, 1, 0};
    static const size_t c10d_starts[4] = {0, 1, 5, 6}, c10d[6] = {5, 1, 2, 3, 4, 0};
    static const int layouts[3] = {DDP_BUCKET_LAYOUT_DEFAULT, DDP_BUCKET_LAYOUT_LAST_FIRST,
                                   DDP_BUCKET_LAYOUT_C10D};
    for (int k = 0; k < 3; k++) {
        c.bucket_layout = layouts[k];
        ddp_reducer_t *r = NULL;
        CHECK_OK(ddp_reducer_create(group, m.p, 6, NULL, 0, &c, &r));
        if (layouts[k] == DDP_BUCKET_LAYOUT_C10D)
            expect_layout(r, 3, c10d_starts, c10d, "c10d");
        else
            expect_layout(r, 2, last_first_starts, last_first, "last-first");
        /* Either way every gradient is the average, step after step (marked last layer first). */
        for (int s = 0; s < 3; s++) {
            CHECK_OK(ddp_reducer_zero_grad(r));
            CHECK_OK(ddp_reducer_prepare(r));
            for (size_t i = 6; i-- > 0;) produce(r, &m, i, rank, s);
            CHECK_OK(ddp_reducer_finalize(r));
            step_ctx_t sc = {world, s};
            for (size_t i = 0; i < 6; i++) expect_grad(r, &m, i, want_mean, &sc, 1e-6, "layout");
        }
        ddp_reducer_destroy(r);
    }
    /* A value outside the enum, and (with peers) ranks that disagree: every rank fails. */
    c.bucket_layout = 7;
    ddp_reducer_t *r = NULL;
    CHECK_STATUS(ddp_reducer_create(group, m.p, 6, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bucket_layout");
    if (world > 1) {
        c.bucket_layout = rank == world - 1 ? DDP_BUCKET_LAYOUT_C10D : DDP_BUCKET_LAYOUT_DEFAULT;
        CHECK_STATUS(ddp_reducer_create(group, m.p, 6, NULL, 0, &c, &r), DDP_ERR_MISMATCH);
        CHECK_ERROR_MENTIONS("bucket_layout");
        CHECK(r == NULL);
    }
    model_free(&m);
    return 0;
}

int main(int argc, char **argv)
{
    const char *which = argc > 1 ? argv[1] : "unused";
    int world = argc > 2 ? atoi(argv[2]) : 2;
    static const struct {
        const char *name;
        ddp_test_group_fn fn;
    } cases[] = {{"unused", case_unused},     {"nosync", case_nosync}, {"rebuild", case_rebuild},
                 {"sparse", case_sparse},     {"usergrads", case_usergrads},
                 {"hook", case_hook},         {"half", case_half},
                 {"dup_buffers", case_dup_buffers}, {"large", case_large},
                 {"noinit", case_noinit}, {"empty", case_empty},
                 {"layout", case_layout}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(cases[i].name, which) != 0) continue;
        int rc = ddp_test_run_group(world, 60, NULL, cases[i].fn, NULL);
        printf("test_reducer_features %s world=%d: %s\n", which, world, rc ? "FAILED" : "ok");
        return rc;
    }
    fprintf(stderr, "unknown case %s\n", which);
    return 2;
}
