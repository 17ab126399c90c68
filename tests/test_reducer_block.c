/* Gradient block modes (config.grad_memory): a program that computes its gradient pointers once
 * from its own block, over real rank processes. The pointers never change (not even across the
 * bucket rebuild, which this test forces to change the buckets), the gradients are reduced in
 * the block, the results equal a float64 reference computed in one process and are bitwise
 * identical on every rank.
 *
 * usage: test_reducer_block CASE WORLD [f32|f64]
 *   user     the caller's malloc'd block, laid out in forward order with a gap; whole tensors
 *   shm      the same layout in a block from ddp_group_alloc_buffer (the shm in-place path)
 *   alloc    DDP_GRAD_MEMORY_BLOCK: libddp's block, pointers fetched once after create
 *   rows     the caller's block, row ranges marked in random order (tiny pieces), no_sync too
 *   late     a matrix marked highest rows first: after the rebuild its pieces start reducing
 *            before its lowest rows are marked
 *   unused   find_unused_parameters: a parameter nobody uses keeps its gradient in the block
 *   hook     fp16 and (when built) PowerSGD hooks: block mode bitwise equal to bucket mode
 *   errors   bad inputs: overlapping, outside, too small, misaligned, NULL, sparse with grad,
 *            user_grads with a block, offsets that differ across ranks
 *   stale    bucket mode: a write through a pointer fetched before the rebuild fails finalize on
 *            every rank, naming the parameter */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#ifdef TEST_WITH_POWERSGD
#include "ddp/powersgd.h"
#endif

#define NP 9
/* Registration (forward) order. Sizes include 0, 1, odd, prime and a larger one; rows 0 is a
 * vector; "emb" is sparse (not in the block). */
static const char *pname[NP] = {"emb",  "l1.w", "l1.b",  "empty", "l2.w",
                                "l2.b", "one",  "big.w", "big.b"};
static const size_t prow[NP] = {11, 7, 0, 0, 5, 0, 0, 97, 0};
static const size_t pnumel[NP] = {11 * 3, 7 * 13, 7, 0, 5 * 7, 5, 1, 97 * 101, 97};
#define SPARSE 0
#define GAP_AFTER 5 /* a gap after l2.b: the block need not be packed */
#define GAP_BYTES 24

static ddp_dtype_t dtype_arg = DDP_F32;

static size_t esz(void) { return ddp_dtype_size(dtype_arg); }
static size_t nrows(size_t i) { return prow[i] ? prow[i] : pnumel[i]; }
static size_t width(size_t i) { return nrows(i) ? pnumel[i] / nrows(i) : 0; }

static double gval(size_t i, int rank, int step, size_t e)
{
    return sin(0.37 * (double)e + 1.3 * (double)i + 0.71 * rank + 2.1 * step) / 3.0;
}

static double get(const void *p, size_t e)
{
    return dtype_arg == DDP_F32 ? ((const float *)p)[e] : ((const double *)p)[e];
}

static void add(void *p, size_t e, double v)
{
    if (dtype_arg == DDP_F32) ((float *)p)[e] += (float)v;
    else ((double *)p)[e] += v;
}

typedef struct model {
    ddp_param_t p[NP];
    void *data[NP];
    unsigned char *block; /* the caller's block (user modes) */
    size_t block_bytes;
    size_t offset[NP];  /* byte offset of each dense gradient in the block */
    void *grad[NP];     /* computed once */
    int from_group;     /* block from ddp_group_alloc_buffer */
} model_t;

/* Lays the dense gradients out in forward order (llm.c's grads_memory), with a gap after l2.b. */
static size_t layout(size_t *offset)
{
    size_t off = 0;
    for (size_t i = 0; i < NP; i++) {
        offset[i] = off;
        if (i == SPARSE) continue;
        off += pnumel[i] * esz();
        if (i == GAP_AFTER) off += GAP_BYTES;
    }
    return off;
}

static void model_make(model_t *m, ddp_group_t *group, int mode)
{
    memset(m, 0, sizeof *m);
    m->block_bytes = layout(m->offset);
    if (mode == DDP_GRAD_MEMORY_USER_BLOCK) {
        if (group) {
            CHECK_OK(ddp_group_alloc_buffer(group, m->block_bytes, (void **)&m->block));
            m->from_group = 1;
        } else {
            m->block = malloc(m->block_bytes);
            CHECK(m->block);
        }
        memset(m->block, 0, m->block_bytes);
        memset(m->block + m->offset[GAP_AFTER] + pnumel[GAP_AFTER] * esz(), 0xAB, GAP_BYTES);
    }
    for (size_t i = 0; i < NP; i++) {
        m->data[i] = calloc(pnumel[i] + 1, 8);
        m->p[i].name = pname[i];
        m->p[i].data = m->data[i];
        m->p[i].numel = pnumel[i];
        m->p[i].dtype = dtype_arg;
        m->p[i].rows = prow[i];
        m->p[i].sparse = i == SPARSE;
        if (mode == DDP_GRAD_MEMORY_USER_BLOCK && i != SPARSE && pnumel[i] > 0)
            m->p[i].grad = m->grad[i] = m->block + m->offset[i];
    }
}

static void model_free(model_t *m, ddp_group_t *group)
{
    for (size_t i = 0; i < NP; i++) free(m->data[i]);
    if (m->from_group) ddp_group_free_buffer(group, m->block);
    else free(m->block);
}

static ddp_reducer_config_t block_config(const model_t *m, int mode)
{
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 64; /* several buckets, so that the rebuild can change them */
    c.bucket_cap_bytes = 256;
    c.grad_memory = mode;
    if (mode == DDP_GRAD_MEMORY_USER_BLOCK) {
        c.grad_block = m->block;
        c.grad_block_bytes = m->block_bytes;
    }
    return c;
}

static void check_gap(const model_t *m)
{
    if (!m->block) return;
    const unsigned char *gap = m->block + m->offset[GAP_AFTER] + pnumel[GAP_AFTER] * esz();
    for (size_t b = 0; b < GAP_BYTES; b++) CHECK_MSG(gap[b] == 0xAB, "gap byte %zu written", b);
}

/* The pointers computed once are what the reducer reports, now too. */
static void check_pointers(ddp_reducer_t *r, const model_t *m)
{
    for (size_t i = 0; i < NP; i++) {
        if (i == SPARSE || pnumel[i] == 0) continue;
        void *g = NULL;
        CHECK_OK(ddp_reducer_grad(r, i, &g));
        CHECK_MSG(g == m->grad[i], "%s: ddp_reducer_grad gives %p, the pointer computed once is %p",
                  pname[i], g, m->grad[i]);
    }
}

/* Every rank holds the same bytes in every gradient. */
static void check_bitwise_across_ranks(ddp_group_t *group, const model_t *m, const char *what)
{
    int world = ddp_group_size(group);
    for (size_t i = 0; i < NP; i++) {
        size_t bytes = pnumel[i] * esz();
        if (i == SPARSE || bytes == 0) continue;
        unsigned char *all = malloc(bytes * (size_t)world);
        CHECK(all);
        CHECK_OK(ddp_group_allgather(group, m->grad[i], all, bytes, DDP_U8));
        for (int q = 1; q < world; q++)
            CHECK_MSG(memcmp(all, all + (size_t)q * bytes, bytes) == 0,
                      "%s: %s differs between rank 0 and rank %d", what, pname[i], q);
        free(all);
    }
}

/* A bucket layout as a list of parameter lists, to see that the rebuild changed it. */
static size_t layout_signature(ddp_reducer_t *r, size_t *sig)
{
    size_t n = 0, nb = ddp_reducer_bucket_count(r);
    for (size_t b = 0; b < nb; b++) {
        const size_t *ps;
        size_t np;
        CHECK_OK(ddp_reducer_bucket_params(r, b, &ps, &np));
        sig[n++] = 1000 + np;
        for (size_t j = 0; j < np; j++) sig[n++] = ps[j];
    }
    return n;
}

/* Marks parameter i: whole, or in random row blocks in a random order. */
static void mark(ddp_reducer_t *r, const model_t *m, size_t i, int rank, int s, int rows,
                 unsigned long long *rng)
{
    if (i == SPARSE) {
        int64_t idx[2] = {rank % 11, 10};
        double vals[6];
        float valsf[6];
        for (size_t e = 0; e < 6; e++) {
            vals[e] = gval(i, rank, s, e);
            valsf[e] = (float)vals[e];
        }
        CHECK_OK(ddp_reducer_sparse_grad(r, i, idx,
                                         dtype_arg == DDP_F32 ? (void *)valsf : (void *)vals, 2));
        return;
    }
    size_t n = nrows(i);
    if (!rows || n < 2) {
        for (size_t e = 0; e < pnumel[i]; e++) add(m->grad[i], e, gval(i, rank, s, e));
        CHECK_OK(ddp_reducer_grad_ready(r, i));
        return;
    }
    size_t cuts[9], nb = 0, at = 0;
    while (at < n && nb < 8) {
        size_t len = 1 + (size_t)((ddp_test_random(rng) + 1.0) * 0.5 * (double)(n / 3 + 1));
        if (len > n - at) len = n - at;
        cuts[nb++] = at;
        at += len;
    }
    cuts[nb] = n;
    size_t perm[8];
    for (size_t b = 0; b < nb; b++) perm[b] = b;
    for (size_t b = nb; b > 1; b--) {
        size_t k = (size_t)((ddp_test_random(rng) + 1.0) * 0.5 * (double)b) % b;
        size_t t = perm[b - 1];
        perm[b - 1] = perm[k];
        perm[k] = t;
    }
    for (size_t b = 0; b < nb; b++) {
        size_t blk = perm[b], w = width(i);
        for (size_t e = cuts[blk] * w; e < cuts[blk + 1] * w; e++)
            add(m->grad[i], e, gval(i, rank, s, e));
        CHECK_OK(ddp_reducer_grad_ready_rows(r, i, cuts[blk], cuts[blk + 1]));
    }
}

/* ---- user, shm, alloc, rows: several iterations through the rebuild ----------------------- */
typedef struct run_args {
    int mode, from_group, rows;
} run_args_t;

static int case_run(ddp_group_t *group, void *arg)
{
    const run_args_t *a = arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    model_t m;
    model_make(&m, a->from_group ? group : NULL, a->mode);
    ddp_reducer_config_t c = block_config(&m, a->mode);
    if (a->rows) c.piece_bytes = 3 * esz(); /* pieces straddle rows and parameters */
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    void *block = NULL;
    size_t block_bytes = 0;
    CHECK_OK(ddp_reducer_grad_block(r, &block, &block_bytes));
    if (a->mode == DDP_GRAD_MEMORY_BLOCK) {
        /* libddp's block: the pointers, fetched once, all lie in it. */
        for (size_t i = 0; i < NP; i++) {
            if (i == SPARSE || pnumel[i] == 0) continue;
            CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
            unsigned char *g = m.grad[i];
            CHECK(g >= (unsigned char *)block &&
                  g + pnumel[i] * esz() <= (unsigned char *)block + block_bytes);
        }
    } else {
        CHECK(block == m.block && block_bytes == m.block_bytes);
    }
    size_t before[64], after[64];
    size_t nbefore = layout_signature(r, before);
    unsigned long long rng = 0x9e3779b97f4a7c15ULL * (unsigned long long)(rank + 1) + 5u;
    /* Step 0 in forward order (registration), so that the rebuild changes the buckets; later
     * steps backwards, step 2 without synchronisation (accumulates into step 3). */
    double *ref[NP];
    for (size_t i = 0; i < NP; i++) ref[i] = calloc(pnumel[i] + 1, sizeof(double));
    for (int s = 0; s < 5; s++) {
        int sync = s != 2;
        CHECK_OK(ddp_reducer_set_sync(r, sync));
        CHECK_OK(ddp_reducer_prepare(r));
        check_pointers(r, &m);
        for (size_t j = 0; j < NP; j++) {
            size_t i = s == 0 ? j : NP - 1 - j;
            mark(r, &m, i, rank, s, a->rows, &rng);
        }
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t i = 0; i < NP; i++)
            for (size_t e = 0; e < pnumel[i]; e++) {
                double sum = 0;
                for (int q = 0; q < world; q++) sum += gval(i, q, s, e);
                ref[i][e] += sum / world;
            }
        if (!sync) continue;
        for (size_t i = 0; i < NP; i++) {
            if (i == SPARSE || pnumel[i] == 0) continue;
            double tol = dtype_arg == DDP_F32 ? 2e-6 : 1e-14;
            for (size_t e = 0; e < pnumel[i]; e++)
                CHECK_MSG(fabs(get(m.grad[i], e) - ref[i][e]) <= tol,
                          "step %d: %s[%zu] = %.17g, expected %.17g", s, pname[i], e,
                          get(m.grad[i], e), ref[i][e]);
        }
        /* The sparse parameter (not in the block) is averaged as in every mode: row 10 holds
         * every rank's second row. */
        const int64_t *idx;
        const void *vals;
        size_t nr;
        CHECK_OK(ddp_reducer_sparse_result(r, SPARSE, &idx, &vals, &nr));
        CHECK(nr >= 1 && idx[nr - 1] == 10);
        if (s != 3) { /* step 3 also holds step 2's rows (accumulated) */
            double want = 0;
            for (int q = 0; q < world; q++) want += gval(SPARSE, q, s, 3) / world;
            double got = dtype_arg == DDP_F32 ? ((const float *)vals)[(nr - 1) * 3]
                                              : ((const double *)vals)[(nr - 1) * 3];
            CHECK_MSG(fabs(got - want) <= 1e-6, "step %d: sparse row 10 = %g, expected %g", s,
                      got, want);
        }
        check_bitwise_across_ranks(group, &m, "after finalize");
        check_gap(&m);
        CHECK_OK(ddp_reducer_zero_grad(r));
        for (size_t i = 0; i < NP; i++) memset(ref[i], 0, (pnumel[i] + 1) * sizeof(double));
        if (s == 0) {
            /* The rebuild happens at the next prepare. */
        } else if (s == 1) {
            size_t nafter = layout_signature(r, after);
            CHECK_MSG(nafter != nbefore || memcmp(before, after, nafter * sizeof(size_t)) != 0,
                      "the rebuild did not change the buckets: the test would not show a move");
        }
    }
    check_pointers(r, &m);
    for (size_t i = 0; i < NP; i++) free(ref[i]);
    ddp_reducer_destroy(r);
    model_free(&m, group);
    return 0;
}

/* ---- late: the highest rows of a matrix first ---------------------------------------------- */
static int case_late(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    model_t m;
    model_make(&m, NULL, DDP_GRAD_MEMORY_USER_BLOCK);
    ddp_reducer_config_t c = block_config(&m, DDP_GRAD_MEMORY_USER_BLOCK);
    c.piece_bytes = 4096;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    const size_t big = 7, n = prow[big], w = width(big);
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t j = 0; j < NP; j++) {
            size_t i = NP - 1 - j;
            if (i != big) {
                mark(r, &m, i, rank, s, 0, NULL);
                continue;
            }
            /* Four row blocks, highest first, with a pause after the first. */
            for (int b = 3; b >= 0; b--) {
                size_t r0 = n * (size_t)b / 4, r1 = n * (size_t)(b + 1) / 4;
                for (size_t e = r0 * w; e < r1 * w; e++) add(m.grad[big], e, gval(big, rank, s, e));
                CHECK_OK(ddp_reducer_grad_ready_rows(r, big, r0, r1));
                if (b == 3) usleep(40000);
            }
        }
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t e = 0; e < pnumel[big]; e++) {
            double want = 0;
            for (int q = 0; q < world; q++) want += gval(big, q, s, e);
            want /= world;
            CHECK_MSG(fabs(get(m.grad[big], e) - want) <= 2e-6, "step %d: big.w[%zu]", s, e);
        }
        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(r, &st));
        size_t b = 0;
        for (size_t k = 0; k < ddp_reducer_bucket_count(r); k++) {
            const size_t *ps;
            size_t np;
            CHECK_OK(ddp_reducer_bucket_params(r, k, &ps, &np));
            for (size_t j = 0; j < np; j++)
                if (ps[j] == big) b = k;
        }
        double lead = st.buckets[b].ready_us - st.buckets[b].launch_us;
        if (s == 0) {
            /* Before the rebuild pieces go in ascending order: the first one is complete only
             * when the lowest rows are marked, at the end. */
            CHECK_MSG(lead < 20000, "step 0: bucket %zu launched %.0f us before it was ready", b,
                      lead);
        } else {
            /* After the rebuild the top rows' pieces go first, during the pause. */
            CHECK_MSG(lead > 20000,
                      "step %d: bucket %zu launched only %.0f us before it was complete (the "
                      "highest rows were marked 40 ms earlier)",
                      s, b, lead);
        }
        CHECK_OK(ddp_reducer_zero_grad(r));
    }
    ddp_reducer_destroy(r);
    model_free(&m, group);
    return 0;
}

/* ---- unused: find_unused_parameters keeps an unused gradient in the block ----------------- */
static int case_unused(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    model_t m;
    model_make(&m, NULL, DDP_GRAD_MEMORY_USER_BLOCK);
    ddp_reducer_config_t c = block_config(&m, DDP_GRAD_MEMORY_USER_BLOCK);
    c.find_unused_parameters = 1;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    const size_t nobody = 4, only0 = 2; /* l2.w used by no rank, l1.b by rank 0 only */
    for (size_t e = 0; e < pnumel[nobody]; e++) add(m.grad[nobody], e, 100.0 + (double)e);
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t j = 0; j < NP; j++) {
            size_t i = NP - 1 - j;
            if (i == nobody || (i == only0 && rank != 0)) continue;
            mark(r, &m, i, rank, s, 0, NULL);
        }
        CHECK_OK(ddp_reducer_finalize(r));
        for (size_t e = 0; e < pnumel[nobody]; e++)
            CHECK_MSG(get(m.grad[nobody], e) == 100.0 + (double)e, "step %d: unused l2.w[%zu] "
                      "changed to %g", s, e, get(m.grad[nobody], e));
        for (size_t e = 0; e < pnumel[only0]; e++) {
            double want = gval(only0, 0, s, e) / world;
            CHECK_MSG(fabs(get(m.grad[only0], e) - want) <= 1e-6, "step %d: l1.b[%zu]", s, e);
        }
        check_bitwise_across_ranks(group, &m, "unused");
        /* Zero every gradient but the unused one, which the caller keeps. */
        for (size_t i = 0; i < NP; i++)
            if (i != SPARSE && i != nobody && m.grad[i]) memset(m.grad[i], 0, pnumel[i] * esz());
    }
    ddp_reducer_destroy(r);
    model_free(&m, group);
    return 0;
}

/* ---- hook: block mode and bucket mode give the same bits through a hook ------------------- */
static int run_hooked(ddp_group_t *group, int mode, ddp_comm_hook_fn hook, void *state,
                      void **out)
{
    int rank = ddp_group_rank(group);
    model_t m;
    model_make(&m, NULL, mode == DDP_GRAD_MEMORY_BLOCK ? 0 : mode);
    ddp_reducer_config_t c = block_config(&m, mode);
    c.comm_hook = hook;
    c.comm_hook_state = state;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    for (size_t i = 0; i < NP; i++)
        if (i != SPARSE && pnumel[i]) CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
    for (int s = 0; s < 4; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        if (mode == DDP_GRAD_MEMORY_BUCKETS) /* bucket mode: pointers move at the rebuild */
            for (size_t i = 0; i < NP; i++)
                if (i != SPARSE && pnumel[i]) CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
        for (size_t j = 0; j < NP; j++) mark(r, &m, NP - 1 - j, rank, s, 0, NULL);
        CHECK_OK(ddp_reducer_finalize(r));
        if (s < 3) CHECK_OK(ddp_reducer_zero_grad(r));
    }
    check_bitwise_across_ranks(group, &m, "hook");
    size_t total = 0;
    for (size_t i = 0; i < NP; i++) total += i == SPARSE ? 0 : pnumel[i] * esz();
    unsigned char *copy = malloc(total + 1), *at = copy;
    for (size_t i = 0; i < NP; i++) {
        if (i == SPARSE || !pnumel[i]) continue;
        memcpy(at, m.grad[i], pnumel[i] * esz());
        at += pnumel[i] * esz();
    }
    *out = copy;
    ddp_reducer_destroy(r);
    model_free(&m, group);
    return 0;
}

static int case_hook(ddp_group_t *group, void *arg)
{
    (void)arg;
    size_t total = 0;
    for (size_t i = 0; i < NP; i++) total += i == SPARSE ? 0 : pnumel[i] * esz();
    for (int h = 0; h < 2; h++) {
        void *a = NULL, *b = NULL;
        if (h == 0) {
            ddp_half_hook_state_t *s1, *s2;
            CHECK_OK(ddp_half_hook_state_create(DDP_F16, &s1));
            CHECK_OK(ddp_half_hook_state_create(DDP_F16, &s2));
            run_hooked(group, DDP_GRAD_MEMORY_BUCKETS, ddp_hook_fp16, s1, &a);
            run_hooked(group, DDP_GRAD_MEMORY_BLOCK, ddp_hook_fp16, s2, &b);
            ddp_half_hook_state_destroy(s1);
            ddp_half_hook_state_destroy(s2);
        } else {
#ifdef TEST_WITH_POWERSGD
            ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
            pc.start_powersgd_iter = 1;
            pc.min_compression_rate = 1.0;
            ddp_powersgd_state_t *s1, *s2;
            CHECK_OK(ddp_powersgd_state_create(&pc, &s1));
            CHECK_OK(ddp_powersgd_state_create(&pc, &s2));
            run_hooked(group, DDP_GRAD_MEMORY_BUCKETS, ddp_powersgd_hook, s1, &a);
            run_hooked(group, DDP_GRAD_MEMORY_BLOCK, ddp_powersgd_hook, s2, &b);
            ddp_powersgd_state_destroy(s1);
            ddp_powersgd_state_destroy(s2);
#else
            continue;
#endif
        }
        CHECK_MSG(memcmp(a, b, total) == 0, "%s hook: the block mode's gradients differ from the "
                  "bucket mode's", h ? "PowerSGD" : "fp16");
        free(a);
        free(b);
    }
    return 0;
}

/* ---- errors --------------------------------------------------------------------------------- */
static int case_errors(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    model_t m;
    model_make(&m, NULL, DDP_GRAD_MEMORY_USER_BLOCK);
    ddp_reducer_config_t c = block_config(&m, DDP_GRAD_MEMORY_USER_BLOCK);
    ddp_reducer_t *r = NULL;
    const size_t e = esz();
    struct {
        const char *what, *names;
        size_t param;
        int kind;
    } bad[] = {
        {"overlap", "l2.b", 5, 0},       {"outside", "l1.w", 1, 1},  {"too small", "big.b", 8, 2},
        {"misaligned", "one", 6, 3},     {"null", "l2.w", 4, 4},     {"sparse", "emb", 0, 5},
        {"user_grads", "user_grads", 0, 6}, {"no block", "grad_block", 0, 7},
    };
    for (size_t t = 0; t < sizeof bad / sizeof bad[0]; t++) {
        ddp_param_t p[NP];
        memcpy(p, m.p, sizeof p);
        ddp_reducer_config_t cc = c;
        switch (bad[t].kind) {
        case 0: p[5].grad = m.block + m.offset[4] + e; break; /* inside l2.w */
        case 1: p[1].grad = m.block + m.block_bytes; break;
        case 2: cc.grad_block_bytes = m.block_bytes - e; break;
        case 3: p[6].grad = m.block + m.offset[6] + 1; break;
        case 4: p[4].grad = NULL; break;
        case 5: p[0].grad = m.block; break;
        case 6: cc.user_grads = 1; break;
        case 7: cc.grad_block = NULL; break;
        }
        /* Only rank 0 is wrong: it names the parameter, the others hear of rank 0's failure. */
        ddp_status_t want = rank == 0 ? DDP_ERR_INVALID_ARGUMENT : DDP_OK;
        const ddp_param_t *use = rank == 0 ? p : m.p;
        const ddp_reducer_config_t *ucfg = rank == 0 ? &cc : &c;
        ddp_status_t s = ddp_reducer_create(group, use, NP, NULL, 0, ucfg, &r);
        if (rank == 0) {
            CHECK_MSG(s == want, "%s: %s (%s)", bad[t].what, ddp_status_string(s),
                      ddp_last_error());
            CHECK_ERROR_MENTIONS(bad[t].names);
        } else {
            CHECK_MSG(s == DDP_ERR_REMOTE, "%s: rank %d got %s (%s)", bad[t].what, rank,
                      ddp_status_string(s), ddp_last_error());
        }
    }
    /* The same layout everywhere but one rank's offsets differ: a mismatch on every rank naming
     * the parameter. */
    if (world > 1) {
        model_t m2;
        model_make(&m2, NULL, DDP_GRAD_MEMORY_USER_BLOCK);
        ddp_param_t p[NP];
        memcpy(p, m2.p, sizeof p);
        ddp_reducer_config_t c2 = block_config(&m2, DDP_GRAD_MEMORY_USER_BLOCK);
        if (rank == world - 1) /* "one" moves into the gap: a valid layout, but not rank 0's */
            p[6].grad = m2.block + m2.offset[GAP_AFTER] + pnumel[GAP_AFTER] * e;
        ddp_status_t s = ddp_reducer_create(group, p, NP, NULL, 0, &c2, &r);
        CHECK_MSG(s == DDP_ERR_MISMATCH, "offsets: %s (%s)", ddp_status_string(s),
                  ddp_last_error());
        CHECK_ERROR_MENTIONS("'one'");
        CHECK_ERROR_MENTIONS("of the block");
        model_free(&m2, group);
    }
    /* grad_block outside the block modes. */
    CHECK_STATUS(ddp_reducer_grad_block(NULL, NULL, NULL), DDP_ERR_INVALID_ARGUMENT);
    model_free(&m, group);
    return 0;
}

/* ---- stale: bucket mode catches a pointer kept across the rebuild -------------------------- */
static int case_stale(ddp_group_t *group, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(group);
    model_t m;
    model_make(&m, NULL, DDP_GRAD_MEMORY_BUCKETS);
    ddp_reducer_config_t c = block_config(&m, DDP_GRAD_MEMORY_BUCKETS);
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    CHECK_STATUS(ddp_reducer_grad_block(r, (void **)&m.block, &m.block_bytes),
                 DDP_ERR_INVALID_USAGE);
    m.block = NULL;
    /* Pointers fetched once, as a program written for the block modes would. */
    for (size_t i = 0; i < NP; i++)
        if (i != SPARSE && pnumel[i]) CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
    /* Step 0 forward (the rebuild moves gradients); at step 1 rank 0 writes through its stale
     * pointers, the other ranks fetch fresh ones. */
    for (int s = 0; s < 2; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        if (s == 1 && rank != 0)
            for (size_t i = 0; i < NP; i++)
                if (i != SPARSE && pnumel[i]) CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
        for (size_t j = 0; j < NP; j++) mark(r, &m, s == 0 ? j : NP - 1 - j, rank, s, 0, NULL);
        ddp_status_t st = ddp_reducer_finalize(r);
        if (s == 0) {
            CHECK_OK(st);
            CHECK_OK(ddp_reducer_zero_grad(r));
            continue;
        }
        CHECK_MSG(st == DDP_ERR_INVALID_USAGE, "rank %d: finalize after stale writes gave %s (%s)",
                  rank, ddp_status_string(st), ddp_last_error());
        if (rank == 0) {
            CHECK_ERROR_MENTIONS("before the bucket rebuild");
        } else {
            CHECK_ERROR_MENTIONS("rank 0");
            CHECK_ERROR_MENTIONS("stale");
        }
    }
    /* A fresh reducer whose program fetches pointers after each prepare never sees the error. */
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    for (int s = 0; s < 3; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        for (size_t i = 0; i < NP; i++)
            if (i != SPARSE && pnumel[i]) CHECK_OK(ddp_reducer_grad(r, i, &m.grad[i]));
        for (size_t j = 0; j < NP; j++) mark(r, &m, s == 0 ? j : NP - 1 - j, rank, s, 0, NULL);
        CHECK_OK(ddp_reducer_finalize(r));
        CHECK_OK(ddp_reducer_zero_grad(r));
    }
    ddp_reducer_destroy(r);
    model_free(&m, group);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_reducer_block CASE WORLD [f32|f64]\n");
        return 2;
    }
    const char *which = argv[1];
    int world = atoi(argv[2]);
    if (argc > 3 && !strcmp(argv[3], "f64")) dtype_arg = DDP_F64;
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = 20000;
    static run_args_t user = {DDP_GRAD_MEMORY_USER_BLOCK, 0, 0};
    static run_args_t shm = {DDP_GRAD_MEMORY_USER_BLOCK, 1, 0};
    static run_args_t alloc = {DDP_GRAD_MEMORY_BLOCK, 0, 0};
    static run_args_t rows = {DDP_GRAD_MEMORY_USER_BLOCK, 0, 1};
    static const struct {
        const char *name;
        ddp_test_group_fn fn;
        void *arg;
    } cases[] = {{"user", case_run, &user},     {"shm", case_run, &shm},
                 {"alloc", case_run, &alloc},   {"rows", case_run, &rows},
                 {"late", case_late, NULL},     {"unused", case_unused, NULL},
                 {"hook", case_hook, NULL},     {"errors", case_errors, NULL},
                 {"stale", case_stale, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(cases[i].name, which) != 0) continue;
        int rc = ddp_test_run_group(world, 80, &options, cases[i].fn, cases[i].arg);
        printf("test_reducer_block %s world=%d %s: %s\n", which, world,
               dtype_arg == DDP_F64 ? "f64" : "f32", rc ? "FAILED" : "ok");
        return rc;
    }
    fprintf(stderr, "unknown case %s\n", which);
    return 2;
}
