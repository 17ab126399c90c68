/* Row readiness (ddp_reducer_grad_ready_rows) and piece-wise bucket launch, over real rank
 * processes. The reference is the same reducer configuration driven with whole-tensor
 * grad_ready: pieces depend only on the bucket layout, so the collectives are the same and the
 * averaged gradients must be bitwise equal, whatever row blocks each rank marks.
 *
 * usage: test_reducer_rows CASE WORLD [f32|f64]
 *   equal    random row blocks per rank (in random order, sometimes finished by grad_ready),
 *            tiny pieces straddling parameters, rebuild in a different order, user_grads too
 *   errors   every usage error on every rank, naming the parameter
 *   unused   find_unused_parameters with rows (partly marked, unused, globally unused)
 *   nosync   no_sync iterations marked in rows accumulate, then one synchronised average
 *   hook     a user hook gets whole buckets even when marked in rows
 *   piece0   piece_bytes 0: whole buckets, rows still work
 *   early    a bucket of one big matrix marked in 4 blocks starts reducing before the last one */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define NP 8
/* Sizes include 0, 1, odd, prime and a larger one; rows 0 means a vector. */
static const char *pname[NP] = {"l1.w", "l1.b", "empty", "l2.w", "l2.b", "one", "big.w", "big.b"};
static const size_t prow[NP] = {7, 0, 0, 5, 0, 0, 97, 0};
static const size_t pnumel[NP] = {7 * 13, 7, 0, 5 * 7, 5, 1, 97 * 101, 97};

typedef struct model {
    ddp_param_t p[NP];
    void *data[NP];
    void *grad[NP];
    ddp_dtype_t dtype;
} model_t;

static void model_make(model_t *m, ddp_dtype_t dtype, int user_grads)
{
    memset(m, 0, sizeof *m);
    m->dtype = dtype;
    for (size_t i = 0; i < NP; i++) {
        m->data[i] = calloc(pnumel[i] + 1, 8);
        m->grad[i] = calloc(pnumel[i] + 1, 8);
        m->p[i].name = pname[i];
        m->p[i].data = m->data[i];
        m->p[i].numel = pnumel[i];
        m->p[i].dtype = dtype;
        m->p[i].rows = prow[i];
        m->p[i].grad = user_grads ? m->grad[i] : NULL;
    }
}

static void model_free(model_t *m)
{
    for (size_t i = 0; i < NP; i++) {
        free(m->data[i]);
        free(m->grad[i]);
    }
}

static size_t nrows(size_t i) { return prow[i] ? prow[i] : pnumel[i]; }
static size_t width(size_t i) { return nrows(i) ? pnumel[i] / nrows(i) : 0; }

/* A gradient value with a full mantissa, so a different summation would show. */
static double gval(size_t i, int rank, int step, size_t e)
{
    return sin(0.37 * (double)e + 1.3 * (double)i + 0.71 * rank + 2.1 * step) / 3.0;
}

static void *grad_of(ddp_reducer_t *r, size_t i)
{
    void *g = NULL;
    CHECK_OK(ddp_reducer_grad(r, i, &g));
    return g;
}

/* Adds this rank's step-s gradient of rows [r0, r1) of parameter i (accumulating, as a
 * backward does across no_sync iterations). */
static void write_rows(ddp_reducer_t *r, ddp_dtype_t d, size_t i, int rank, int s, size_t r0,
                       size_t r1)
{
    if (!pnumel[i]) return;
    void *g = grad_of(r, i);
    for (size_t e = r0 * width(i); e < r1 * width(i); e++) {
        if (d == DDP_F32) ((float *)g)[e] += (float)gval(i, rank, s, e);
        else ((double *)g)[e] += gval(i, rank, s, e);
    }
}

static double get(ddp_dtype_t d, const void *p, size_t e)
{
    return d == DDP_F32 ? ((const float *)p)[e] : ((const double *)p)[e];
}

/* One backward of reducer r at step s. whole: write and grad_ready each parameter in `order`.
 * Otherwise: each parameter in `order` is cut into random blocks that are written and marked
 * in a random order; sometimes the last block is reported with grad_ready instead. */
static void backward(ddp_reducer_t *r, ddp_dtype_t d, const size_t *order, int rank, int s,
                     int whole, unsigned long long *rng)
{
    for (size_t j = 0; j < NP; j++) {
        size_t i = order[j], n = nrows(i);
        if (whole || n == 0) {
            write_rows(r, d, i, rank, s, 0, n);
            CHECK_OK(ddp_reducer_grad_ready(r, i));
            continue;
        }
        size_t cuts[16], nb = 0, at = 0;
        while (at < n && nb < 15) {
            size_t len = 1 + (size_t)((ddp_test_random(rng) + 1.0) * 0.5 * (double)(n / 3 + 1));
            if (len > n - at) len = n - at;
            cuts[nb++] = at;
            at += len;
        }
        cuts[nb] = n;
        size_t perm[16];
        for (size_t b = 0; b < nb; b++) perm[b] = b;
        for (size_t b = nb; b > 1; b--) {
            size_t k = (size_t)((ddp_test_random(rng) + 1.0) * 0.5 * (double)b) % b;
            size_t t = perm[b - 1];
            perm[b - 1] = perm[k];
            perm[k] = t;
        }
        int finish_whole = ddp_test_random(rng) > 0.3;
        for (size_t b = 0; b < nb; b++) {
            size_t blk = perm[b];
            write_rows(r, d, i, rank, s, cuts[blk], cuts[blk + 1]);
            if (b + 1 == nb && finish_whole && nb > 1)
                CHECK_OK(ddp_reducer_grad_ready(r, i)); /* marks the remaining rows */
            else
                CHECK_OK(ddp_reducer_grad_ready_rows(r, i, cuts[blk], cuts[blk + 1]));
        }
    }
}

static ddp_reducer_config_t small_config(ddp_dtype_t d)
{
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 64;
    c.bucket_cap_bytes = 4096;
    /* 3 elements: pieces straddle parameter and row boundaries everywhere. */
    c.piece_bytes = 3 * ddp_dtype_size(d);
    return c;
}

static ddp_dtype_t dtype_arg = DDP_F32;

/* Two identical models and their Reducers (a: marked in row blocks, b: whole tensors). */
static int make_pair(ddp_group_t *group, ddp_dtype_t d, int user, model_t *ma, model_t *mb,
                     ddp_reducer_t **ra, ddp_reducer_t **rb)
{
    model_make(ma, d, user);
    model_make(mb, d, user);
    ddp_reducer_config_t c = small_config(d);
    c.user_grads = user;
    CHECK_OK(ddp_reducer_create(group, ma->p, NP, NULL, 0, &c, ra));
    CHECK_OK(ddp_reducer_create(group, mb->p, NP, NULL, 0, &c, rb));
    return 0;
}

/* ---- equal: rows vs whole tensors, bitwise ------------------------------------------------ */
static int case_equal(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    ddp_dtype_t d = dtype_arg;
    for (int user = 0; user < 2; user++) {
        model_t ma, mb;
        ddp_reducer_t *ra = NULL, *rb = NULL;
        if (make_pair(group, d, user, &ma, &mb, &ra, &rb)) return 1;
        size_t nb0 = ddp_reducer_bucket_count(rb);
        unsigned long long rng = 0x9e3779b97f4a7c15ULL * (unsigned long long)(rank + 1) + 77u;
        /* Step 0 in forward order (the rebuild then changes the layout), later steps in
         * reverse order; rank 0's order is the one the rebuild follows. */
        size_t fwd[NP], rev[NP];
        for (size_t i = 0; i < NP; i++) {
            fwd[i] = i;
            rev[i] = NP - 1 - i;
        }
        for (int s = 0; s < 4; s++) {
            const size_t *order = s == 0 ? fwd : rev;
            CHECK_OK(ddp_reducer_prepare(ra));
            backward(ra, d, order, rank, s, 1, &rng);
            CHECK_OK(ddp_reducer_finalize(ra));
            CHECK_OK(ddp_reducer_prepare(rb));
            backward(rb, d, order, rank, s, 0, &rng);
            CHECK_OK(ddp_reducer_finalize(rb));
            ddp_reducer_stats_t st;
            CHECK_OK(ddp_reducer_stats(rb, &st));
            CHECK_MSG(st.npieces > st.nbuckets, "step %d: %zu reductions for %zu buckets", s,
                      st.npieces, st.nbuckets);
            for (size_t i = 0; i < NP; i++) {
                const void *ga = user ? ma.grad[i] : grad_of(ra, i);
                const void *gb = user ? mb.grad[i] : grad_of(rb, i);
                CHECK_MSG(memcmp(ga, gb, pnumel[i] * ddp_dtype_size(d)) == 0,
                          "user_grads %d step %d: %s differs between whole and row marking", user,
                          s, pname[i]);
                for (size_t e = 0; e < pnumel[i]; e++) {
                    double want = 0;
                    for (int q = 0; q < world; q++) want += gval(i, q, s, e);
                    want /= world;
                    double x = get(d, gb, e);
                    CHECK_MSG(fabs(x - want) <= 1e-5, "step %d: %s[%zu] = %.9g, expected %.9g", s,
                              pname[i], e, x, want);
                }
            }
            CHECK_OK(ddp_reducer_zero_grad(ra));
            CHECK_OK(ddp_reducer_zero_grad(rb));
        }
        /* The rebuild followed forward order: the layout changed, and pieces with it. */
        size_t nb1 = ddp_reducer_bucket_count(rb);
        const size_t *ps = NULL;
        size_t np = 0;
        CHECK_OK(ddp_reducer_bucket_params(rb, 0, &ps, &np));
        CHECK_MSG(nb1 > 0 && np > 0 && ps[0] == 0,
                  "after the rebuild bucket 0 starts with parameter %zu (buckets %zu -> %zu)",
                  np ? ps[0] : (size_t)-1, nb0, nb1);
        ddp_reducer_destroy(ra);
        ddp_reducer_destroy(rb);
        model_free(&ma);
        model_free(&mb);
    }
    return 0;
}

/* ---- errors --------------------------------------------------------------------------------- */

/* Marks every parameter whole except those already complete or listed in skip (a bitmask). */
static void mark_rest(ddp_reducer_t *r, unsigned skip)
{
    for (size_t i = NP; i-- > 0;)
        if (!(skip & (1u << i))) CHECK_OK(ddp_reducer_grad_ready(r, i));
}

/* finalize must fail on every rank naming the parameter; other ranks name the culprit rank. */
static void expect_finalize_fails(ddp_reducer_t *r, int rank, int culprit, const char *name)
{
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS(name);
    if (rank != culprit) {
        char who[32];
        snprintf(who, sizeof who, "rank %d", culprit);
        CHECK_ERROR_MENTIONS(who);
    }
}

static int case_errors(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group), last = world - 1;
    ddp_dtype_t d = dtype_arg;
    model_t m;
    model_make(&m, d, 0);
    /* A sparse table as a ninth parameter. */
    ddp_param_t params[NP + 1];
    memcpy(params, m.p, sizeof m.p);
    float table[12] = {0};
    memset(&params[NP], 0, sizeof params[NP]);
    params[NP].name = "table";
    params[NP].data = table;
    params[NP].numel = 12;
    params[NP].dtype = DDP_F32;
    params[NP].rows = 4;
    params[NP].sparse = 1;
    ddp_reducer_config_t c = small_config(d);
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, params, NP + 1, NULL, 0, &c, &r));
    int64_t none = 0;

    /* Outside an iteration, bad reducer or index. */
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 0, 0, 1), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("ddp_reducer_prepare");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(NULL, 0, 0, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("reducer");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, NP + 1, 0, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out of range");

    /* Phase A: argument errors on every rank change nothing; the iteration then succeeds. */
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 0, 3, 3), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("'l1.w'");
    CHECK_ERROR_MENTIONS("empty");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 0, 4, 2), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("'l1.w'");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 0, 6, 8), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("'l1.w'");
    CHECK_ERROR_MENTIONS("7 rows");
    /* A vector has one row per element: l1.b has 7 rows. */
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 1, 0, 8), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("'l1.b'");
    CHECK_ERROR_MENTIONS("one row per element");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 2, 0, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("'empty'");
    CHECK_ERROR_MENTIONS("0 rows");
    CHECK_STATUS(ddp_reducer_grad_ready_rows(r, NP, 0, 1), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("'table'");
    CHECK_ERROR_MENTIONS("sparse");
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 0, 0, 7)); /* all rows at once = grad_ready */
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 1, 6, 7));
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 1, 0, 6));
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 0x3u);
    CHECK_OK(ddp_reducer_finalize(r));

    /* Phase B: overlapping ranges on the last rank fail every rank at finalize. */
    CHECK_OK(ddp_reducer_prepare(r));
    if (rank == last) {
        CHECK_OK(ddp_reducer_grad_ready_rows(r, 6, 0, 40));
        CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 6, 39, 50), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("'big.w'");
        CHECK_ERROR_MENTIONS("row 39");
        CHECK_OK(ddp_reducer_grad_ready_rows(r, 6, 40, 97));
    } else {
        CHECK_OK(ddp_reducer_grad_ready(r, 6));
    }
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 1u << 6);
    expect_finalize_fails(r, rank, last, "'big.w'");

    /* Phase C: rows of a parameter already complete (by grad_ready). */
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_OK(ddp_reducer_grad_ready(r, 3));
    if (rank == last) {
        CHECK_STATUS(ddp_reducer_grad_ready_rows(r, 3, 4, 5), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("'l2.w'");
        CHECK_ERROR_MENTIONS("already complete");
    }
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 1u << 3);
    expect_finalize_fails(r, rank, last, "'l2.w'");

    /* Phase D: grad_ready after all rows were marked is marking twice. */
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 4, 0, 2));
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 4, 2, 5));
    if (rank == last) {
        CHECK_STATUS(ddp_reducer_grad_ready(r, 4), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("'l2.b'");
        CHECK_ERROR_MENTIONS("twice");
    }
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 1u << 4);
    expect_finalize_fails(r, rank, last, "'l2.b'");

    /* Phase E: a partly marked parameter at finalize (no find_unused) is an unmarked one. */
    CHECK_OK(ddp_reducer_prepare(r));
    if (rank == last) CHECK_OK(ddp_reducer_grad_ready_rows(r, 6, 10, 20));
    else CHECK_OK(ddp_reducer_grad_ready(r, 6));
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 1u << 6);
    expect_finalize_fails(r, rank, last, "'big.w'");

    /* And the reducer is still usable. */
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_OK(ddp_reducer_grad_ready_rows(r, 6, 10, 20));
    CHECK_OK(ddp_reducer_sparse_grad(r, NP, &none, table, 1));
    mark_rest(r, 0);
    CHECK_OK(ddp_reducer_finalize(r));
    ddp_reducer_destroy(r);

    /* piece_bytes must agree across ranks. */
    if (world > 1) {
        ddp_reducer_config_t c2 = small_config(d);
        if (rank == last) c2.piece_bytes += 8;
        CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c2, &r), DDP_ERR_MISMATCH);
        CHECK_ERROR_MENTIONS("piece_bytes");
    }
    model_free(&m);
    return 0;
}

/* ---- find_unused + rows ---------------------------------------------------------------------- */
static int case_unused(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    ddp_dtype_t d = dtype_arg;
    for (int user = 0; user < 2; user++) {
        model_t m;
        model_make(&m, d, user);
        ddp_reducer_config_t c = small_config(d);
        c.find_unused_parameters = 1;
        c.user_grads = user;
        ddp_reducer_t *r = NULL;
        CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
        /* big.w: rank 0 marks its first half of rows only (the rest stays as written: zero),
         * other ranks mark it whole. l2.w: only the last rank uses it, in two blocks. l1.w:
         * nobody uses it, so it keeps a sentinel gradient. */
        void *sent = user ? m.grad[0] : grad_of(r, 0);
        for (size_t e = 0; e < pnumel[0]; e++) {
            if (d == DDP_F32) ((float *)sent)[e] = 7.0f + (float)e;
            else ((double *)sent)[e] = 7.0 + (double)e;
        }
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = NP; i-- > 0;) {
            void *g = user ? m.grad[i] : grad_of(r, i);
            if (i == 0) continue;
            if (i == 3 && rank != world - 1) continue;
            if (i == 6 && rank == 0) {
                for (size_t e = 0; e < 48 * width(6); e++)
                    if (d == DDP_F32) ((float *)g)[e] = (float)gval(6, rank, 0, e);
                    else ((double *)g)[e] = gval(6, rank, 0, e);
                CHECK_OK(ddp_reducer_grad_ready_rows(r, 6, 0, 48));
                continue;
            }
            for (size_t e = 0; e < pnumel[i]; e++)
                if (d == DDP_F32) ((float *)g)[e] = (float)gval(i, rank, 0, e);
                else ((double *)g)[e] = gval(i, rank, 0, e);
            if (nrows(i) >= 2) {
                CHECK_OK(ddp_reducer_grad_ready_rows(r, i, 1, nrows(i)));
                CHECK_OK(ddp_reducer_grad_ready_rows(r, i, 0, 1));
            } else {
                CHECK_OK(ddp_reducer_grad_ready(r, i));
            }
        }
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t i = 0; i < NP; i++) {
            const void *g = user ? m.grad[i] : grad_of(r, i);
            for (size_t e = 0; e < pnumel[i]; e++) {
                double want = 0;
                if (i == 0) {
                    want = 7.0 + (double)e;
                } else {
                    for (int q = 0; q < world; q++) {
                        if (i == 3 && q != world - 1) continue;
                        if (i == 6 && q == 0 && e >= 48 * width(6)) continue;
                        want += gval(i, q, 0, e);
                    }
                    want /= world;
                }
                double x = get(d, g, e);
                CHECK_MSG(fabs(x - want) <= 1e-5, "user %d: %s[%zu] = %.9g, expected %.9g", user,
                          pname[i], e, x, want);
            }
        }
        ddp_reducer_destroy(r);
        model_free(&m);
    }
    return 0;
}

/* ---- no_sync + rows -------------------------------------------------------------------------- */
static int case_nosync(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    ddp_dtype_t d = dtype_arg;
    for (int user = 0; user < 2; user++) {
        model_t ma, mb;
        ddp_reducer_t *ra = NULL, *rb = NULL;
        if (make_pair(group, d, user, &ma, &mb, &ra, &rb)) return 1;
        unsigned long long rng = 12345u + (unsigned long long)rank * 977u;
        size_t rev[NP];
        for (size_t i = 0; i < NP; i++) rev[i] = NP - 1 - i;
        /* Two accumulating iterations, then a synchronised one; user_grads accumulate in
         * param.grad, which write_rows reaches through ddp_reducer_grad. */
        for (int s = 0; s < 3; s++) {
            CHECK_OK(ddp_reducer_set_sync(ra, s == 2));
            CHECK_OK(ddp_reducer_set_sync(rb, s == 2));
            CHECK_OK(ddp_reducer_prepare(ra));
            backward(ra, d, rev, rank, s, 1, &rng);
            CHECK_OK(ddp_reducer_finalize(ra));
            CHECK_OK(ddp_reducer_prepare(rb));
            backward(rb, d, rev, rank, s, 0, &rng);
            if (s == 0) {
                /* Overlap is caught in no_sync iterations too. */
                CHECK_STATUS(ddp_reducer_grad_ready_rows(rb, 6, 0, 1), DDP_ERR_INVALID_USAGE);
                CHECK_ERROR_MENTIONS("'big.w'");
            }
            CHECK_OK(ddp_reducer_finalize(rb));
        }
        for (size_t i = 0; i < NP; i++) {
            const void *ga = user ? ma.grad[i] : grad_of(ra, i);
            const void *gb = user ? mb.grad[i] : grad_of(rb, i);
            CHECK_MSG(memcmp(ga, gb, pnumel[i] * ddp_dtype_size(d)) == 0,
                      "user_grads %d: %s differs between whole and row marking", user, pname[i]);
            for (size_t e = 0; e < pnumel[i]; e++) {
                double want = 0;
                for (int q = 0; q < world; q++)
                    for (int s = 0; s < 3; s++) want += gval(i, q, s, e);
                want /= world;
                CHECK_MSG(fabs(get(d, gb, e) - want) <= 1e-4, "%s[%zu] = %.9g, expected %.9g",
                          pname[i], e, get(d, gb, e), want);
            }
        }
        ddp_reducer_destroy(ra);
        ddp_reducer_destroy(rb);
        model_free(&ma);
        model_free(&mb);
    }
    return 0;
}

/* ---- a user hook gets whole buckets ---------------------------------------------------------- */
typedef struct hook_state {
    size_t calls, elements;
} hook_state_t;

static ddp_status_t counting_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *b,
                                  ddp_work_t **work)
{
    hook_state_t *h = state;
    h->calls++;
    h->elements += b->numel;
    size_t sum = 0;
    for (size_t j = 0; j < b->nparams; j++) sum += b->numels[j];
    if (sum != b->numel) return DDP_ERR_INVALID_USAGE; /* not a whole bucket */
    return ddp_group_allreduce_async(group, b->data, b->data, b->numel, b->dtype, DDP_SUM, work);
}

static int run_whole_buckets(ddp_group_t *group, int use_hook)
{
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    ddp_dtype_t d = dtype_arg;
    model_t ma, mb;
    model_make(&ma, d, 0);
    model_make(&mb, d, 0);
    hook_state_t ha = {0, 0}, hb = {0, 0};
    ddp_reducer_config_t c = small_config(d);
    if (!use_hook) c.piece_bytes = 0;
    ddp_reducer_t *ra = NULL, *rb = NULL;
    if (use_hook) {
        c.comm_hook = counting_hook;
        c.comm_hook_state = &ha;
    }
    CHECK_OK(ddp_reducer_create(group, ma.p, NP, NULL, 0, &c, &ra));
    if (use_hook) c.comm_hook_state = &hb;
    CHECK_OK(ddp_reducer_create(group, mb.p, NP, NULL, 0, &c, &rb));
    unsigned long long rng = 99u + (unsigned long long)rank;
    size_t rev[NP], total = 0;
    for (size_t i = 0; i < NP; i++) {
        rev[i] = NP - 1 - i;
        total += pnumel[i];
    }
    for (int s = 0; s < 2; s++) {
        CHECK_OK(ddp_reducer_prepare(ra));
        backward(ra, d, rev, rank, s, 1, &rng);
        CHECK_OK(ddp_reducer_finalize(ra));
        CHECK_OK(ddp_reducer_prepare(rb));
        backward(rb, d, rev, rank, s, 0, &rng);
        CHECK_OK(ddp_reducer_finalize(rb));
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(rb, &st));
        CHECK_MSG(st.npieces == st.nbuckets, "%zu reductions for %zu buckets", st.npieces,
                  st.nbuckets);
        for (size_t i = 0; i < NP; i++) {
            CHECK_MSG(memcmp(grad_of(ra, i), grad_of(rb, i), pnumel[i] * ddp_dtype_size(d)) == 0,
                      "step %d: %s differs between whole and row marking", s, pname[i]);
            for (size_t e = 0; e < pnumel[i]; e++) {
                double want = 0;
                for (int q = 0; q < world; q++) want += gval(i, q, s, e);
                want /= world;
                double x = get(d, grad_of(rb, i), e);
                CHECK_MSG(fabs(x - want) <= 1e-5, "%s[%zu] = %.9g, expected %.9g", pname[i], e, x,
                          want);
            }
        }
        CHECK_OK(ddp_reducer_zero_grad(ra));
        CHECK_OK(ddp_reducer_zero_grad(rb));
    }
    if (use_hook) {
        CHECK_MSG(hb.calls == ha.calls && hb.elements == 2 * total,
                  "hook: %zu calls (whole marking %zu), %zu elements (want %zu)", hb.calls,
                  ha.calls, hb.elements, 2 * total);
    }
    ddp_reducer_destroy(ra);
    ddp_reducer_destroy(rb);
    model_free(&ma);
    model_free(&mb);
    return 0;
}

static int case_hook(ddp_group_t *group, void *arg)
{
    (void)arg;
    return run_whole_buckets(group, 1);
}

static int case_piece0(ddp_group_t *group, void *arg)
{
    (void)arg;
    return run_whole_buckets(group, 0);
}

/* ---- launches happen before the last block --------------------------------------------------- */
static int case_early(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    ddp_dtype_t d = dtype_arg;
    const size_t rows = 256, cols = 129; /* one matrix in one bucket */
    void *w = calloc(rows * cols, 8);
    ddp_param_t p = {"w", w, rows * cols, d, rows, 0, NULL};
    for (int pieces_on = 1; pieces_on >= 0; pieces_on--) {
        ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
        c.piece_bytes = pieces_on ? rows * cols * ddp_dtype_size(d) / 16 : 0;
        char path[600];
        snprintf(path, sizeof path, "%s/trace-%d.json", ddp_test_tmpdir(), rank);
        ddp_trace_t *trace = NULL;
        CHECK_OK(ddp_trace_open(path, rank, &trace));
        c.trace = trace;
        ddp_reducer_t *r = NULL;
        CHECK_OK(ddp_reducer_create(group, &p, 1, NULL, 0, &c, &r));
        CHECK_OK(ddp_reducer_prepare(r));
        void *g = grad_of(r, 0);
        for (size_t b = 0; b < 4; b++) {
            size_t r0 = rows * b / 4, r1 = rows * (b + 1) / 4;
            for (size_t e = r0 * cols; e < r1 * cols; e++) {
                if (d == DDP_F32) ((float *)g)[e] = (float)gval(0, rank, 0, e);
                else ((double *)g)[e] = gval(0, rank, 0, e);
            }
            if (b == 3) {
                /* Before the last block is marked: with pieces, reductions are in flight
                 * (zero_grad refuses); without, nothing has started. */
                ddp_status_t zs = ddp_reducer_zero_grad(r);
                if (pieces_on) {
                    CHECK_STATUS(zs, DDP_ERR_INVALID_USAGE);
                    CHECK_ERROR_MENTIONS("in flight");
                } else {
                    CHECK_OK(zs);
                    /* zero_grad zeroed everything written: write it again. */
                    for (size_t e = 0; e < r1 * cols; e++) {
                        if (d == DDP_F32) ((float *)g)[e] = (float)gval(0, rank, 0, e);
                        else ((double *)g)[e] = gval(0, rank, 0, e);
                    }
                }
            }
            CHECK_OK(ddp_reducer_grad_ready_rows(r, 0, r0, r1));
        }
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t e = 0; e < rows * cols; e++) {
            double want = 0;
            for (int q = 0; q < world; q++) want += gval(0, q, 0, e);
            want /= world;
            CHECK_MSG(fabs(get(d, g, e) - want) <= 1e-5, "w[%zu] = %.9g, expected %.9g", e,
                      get(d, g, e), want);
        }
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(r, &st));
        CHECK(st.nbuckets == 1);
        if (pieces_on) {
            CHECK_MSG(st.npieces == 16, "%zu pieces", st.npieces);
            /* The first piece was handed over when the first block was marked, the bucket was
             * ready only with the last block. */
            CHECK_MSG(st.buckets[0].launch_us < st.buckets[0].ready_us,
                      "launch %.1f us is not before ready %.1f us", st.buckets[0].launch_us,
                      st.buckets[0].ready_us);
        } else {
            CHECK_MSG(st.npieces == 1, "%zu reductions", st.npieces);
            CHECK(st.buckets[0].launch_us >= st.buckets[0].ready_us);
        }
        ddp_reducer_destroy(r);
        CHECK_OK(ddp_trace_close(trace));
        /* The trace has one span per piece. */
        FILE *f = fopen(path, "r");
        CHECK(f != NULL);
        char *text = calloc(1, 1 << 20);
        size_t len = fread(text, 1, (1 << 20) - 1, f);
        fclose(f);
        text[len] = '\0';
        size_t spans = 0;
        for (const char *t = text; (t = strstr(t, "\"bucket 0")) != NULL; t++) spans++;
        CHECK_MSG(spans == (pieces_on ? 16u : 1u), "%zu bucket spans in the trace", spans);
        if (pieces_on) CHECK(strstr(text, "bucket 0 piece 15/16") != NULL);
        free(text);
    }
    free(w);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_reducer_rows CASE WORLD [f32|f64]\n");
        return 2;
    }
    const char *which = argv[1];
    int world = atoi(argv[2]);
    if (argc > 3 && !strcmp(argv[3], "f64")) dtype_arg = DDP_F64;
    static const struct {
        const char *name;
        ddp_test_group_fn fn;
    } cases[] = {{"equal", case_equal},   {"errors", case_errors}, {"unused", case_unused},
                 {"nosync", case_nosync}, {"hook", case_hook},     {"piece0", case_piece0},
                 {"early", case_early}};
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 20000;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(cases[i].name, which) != 0) continue;
        int rc = ddp_test_run_group(world, 240, &options, cases[i].fn, NULL);
        printf("test_reducer_rows %s world=%d %s: %s\n", which, world,
               dtype_arg == DDP_F64 ? "f64" : "f32", rc ? "FAILED" : "ok");
        return rc;
    }
    fprintf(stderr, "unknown case %s\n", which);
    return 2;
}
