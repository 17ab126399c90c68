/* Reducer errors: each one on every rank, with the parameter's name in the text, and never a
 * hang: model mismatch at create (numel, name, count, dtype, sparsity, a shape with the same
 * numel), a local create failure, grad_ready twice, finalize with unmarked parameters, prepare
 * without finalize, a comm hook that makes ranks disagree on a bucket, and bad arguments. Also
 * the other side: no call that succeeds leaves an earlier failure's text behind.
 *
 * usage: test_reducer_errors CASE WORLD */
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define NP 5
static const char *names[NP] = {"l1.w", "l1.b", "l2.w", "l2.b", "head"};
static const size_t sizes[NP] = {12, 3, 7, 1, 29};

typedef struct model {
    ddp_param_t p[NP + 1];
    float data[NP + 1][32];
} model_t;

static void model_make(model_t *m)
{
    memset(m, 0, sizeof *m);
    for (int i = 0; i < NP + 1; i++) {
        m->p[i].name = i < NP ? names[i] : "extra";
        m->p[i].data = m->data[i];
        m->p[i].numel = i < NP ? sizes[i] : 4;
        m->p[i].dtype = DDP_F32;
    }
}

static int last(ddp_group_t *g) { return ddp_group_rank(g) == ddp_group_size(g) - 1; }

static void mark_all(ddp_reducer_t *r, int skip)
{
    for (int i = NP; i-- > 0;)
        if (i != skip) CHECK_OK(ddp_reducer_grad_ready(r, (size_t)i));
}

/* The model with tiny buckets (16 B first, 32 B after), so that it has several. */
static ddp_reducer_t *small_reducer(ddp_group_t *group, model_t *m)
{
    model_make(m);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 16;
    c.bucket_cap_bytes = 32;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m->p, NP, NULL, 0, &c, &r));
    return r;
}

static int case_mismatch(ddp_group_t *group, void *arg)
{
    (void)arg;
    CHECK(ddp_group_size(group) >= 2);
    ddp_reducer_t *r = NULL;
    for (int variant = 0; variant < 6; variant++) {
        model_t m;
        model_make(&m);
        size_t n = NP;
        const char *mention1 = "l2.w", *mention2 = "l2.w";
        if (last(group)) {
            switch (variant) {
            case 0: m.p[2].numel = 8; break;
            case 1: m.p[2].name = "l2.weight"; mention2 = "l2.weight"; break;
            case 2: n = NP + 1; mention1 = "extra"; mention2 = "registers 6"; break;
            case 3: m.p[2].dtype = DDP_F64; mention2 = "f64"; break;
            case 4: m.p[2].sparse = 1; m.p[2].rows = 7; mention2 = "sparse"; break;
            /* Same numel, another shape: rank 0's bytes would land in the wrong layout. */
            case 5: m.p[0].rows = 2; mention1 = "shape 4 x 3"; mention2 = "shape 2 x 6"; break;
            }
        } else if (variant == 1) {
            mention2 = "l2.weight";
        } else if (variant == 2) {
            mention1 = "extra";
            mention2 = "registers 6";
        } else if (variant == 3) {
            mention2 = "f64";
        } else if (variant == 4) {
            mention2 = "sparse";
        } else if (variant == 5) {
            mention1 = "shape 4 x 3";
            mention2 = "shape 2 x 6";
        }
        if (variant == 5 && !last(group)) m.p[0].rows = 4;
        CHECK_STATUS(ddp_reducer_create(group, m.p, n, NULL, 0, NULL, &r), DDP_ERR_MISMATCH);
        CHECK_ERROR_MENTIONS(mention1);
        CHECK_ERROR_MENTIONS(mention2);
        CHECK_ERROR_MENTIONS("rank 0");
        if (variant == 5) CHECK_ERROR_MENTIONS("'l1.w'");
        CHECK(r == NULL);
    }
    /* The group is still healthy: a matching model now works. */
    model_t m;
    model_make(&m);
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, NULL, &r));
    ddp_reducer_destroy(r);
    return 0;
}

static int case_local_create(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    model_make(&m);
    if (last(group)) m.p[1].name = NULL;
    ddp_reducer_t *r = NULL;
    if (last(group)) {
        CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, NULL, &r),
                     DDP_ERR_INVALID_ARGUMENT);
        CHECK_ERROR_MENTIONS("params[1].name");
    } else {
        CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, NULL, &r), DDP_ERR_REMOTE);
        char want[32];
        snprintf(want, sizeof want, "rank %d", ddp_group_size(group) - 1);
        CHECK_ERROR_MENTIONS(want);
    }
    /* Duplicate with different numel: every rank, INVALID_ARGUMENT naming both. */
    model_make(&m);
    m.p[3].data = m.p[0].data;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, NULL, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l2.b");
    CHECK_ERROR_MENTIONS("l1.w");
    return 0;
}

static int case_twice(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    ddp_reducer_t *r = small_reducer(group, &m);
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    if (ddp_group_rank(group) == 0) {
        CHECK_STATUS(ddp_reducer_grad_ready(r, 1), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("l1.b");
        CHECK_ERROR_MENTIONS("shared weights");
        /* A stacked tensor reported once per layer: the error names the call that fits. */
        CHECK_ERROR_MENTIONS("ddp_reducer_grad_ready_rows(reducer, 1, row_begin, row_end)");
    }
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("l1.b");
    CHECK_ERROR_MENTIONS("twice");
    CHECK_ERROR_MENTIONS("ddp_reducer_grad_ready_rows");
    /* The reducer goes on working. */
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_OK(ddp_reducer_finalize(r));
    ddp_reducer_destroy(r);
    return 0;
}

static int case_unmarked(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    ddp_reducer_t *r = small_reducer(group, &m);
    for (int round = 0; round < 2; round++) {
        CHECK_OK(ddp_reducer_prepare(r));
        mark_all(r, last(group) ? 3 : -1);
        CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("l2.b");
        CHECK_ERROR_MENTIONS("find_unused");
    }
    /* Every rank unmarked: all names listed. */
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_OK(ddp_reducer_grad_ready(r, 4));
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("'l1.w', 'l1.b', 'l2.w', 'l2.b'");
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_OK(ddp_reducer_finalize(r));
    ddp_reducer_destroy(r);
    return 0;
}

static int case_prepare_twice(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    model_make(&m);
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, NULL, &r));
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_STATUS(ddp_reducer_prepare(r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("finalize");
    CHECK_STATUS(ddp_reducer_zero_grad(r), DDP_ERR_INVALID_USAGE);
    CHECK_OK(ddp_reducer_finalize(r));
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("prepare");
    /* A no_sync iteration need not be finalized. */
    CHECK_OK(ddp_reducer_set_sync(r, 0));
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_OK(ddp_reducer_set_sync(r, 1));
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_OK(ddp_reducer_finalize(r));
    ddp_reducer_destroy(r);
    return 0;
}

static ddp_status_t short_hook(void *state, ddp_group_t *group, const ddp_comm_bucket_t *b,
                               ddp_work_t **work)
{
    (void)state;
    size_t n = b->numel - (last(group) && b->index == 1 ? 1 : 0);
    return ddp_group_allreduce_async(group, b->data, b->data, n, b->dtype, DDP_SUM, work);
}

static int case_hook_mismatch(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    model_make(&m);
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 16;
    c.bucket_cap_bytes = 32;
    c.comm_hook = short_hook;
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    CHECK_OK(ddp_reducer_prepare(r));
    for (int i = NP; i-- > 0;) {
        ddp_status_t s = ddp_reducer_grad_ready(r, (size_t)i);
        CHECK(s == DDP_OK || s == DDP_ERR_ABORTED || s == DDP_ERR_MISMATCH);
    }
    ddp_status_t s = ddp_reducer_finalize(r);
    CHECK_MSG(s == DDP_ERR_MISMATCH || s == DDP_ERR_ABORTED, "finalize returned %s: %s",
              ddp_status_string(s), ddp_last_error());
    ddp_reducer_destroy(r);
    return 0;
}

static int case_args(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    model_make(&m);
    ddp_reducer_t *r = NULL;
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    CHECK_STATUS(ddp_reducer_create(NULL, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    /* The rest are collective: every rank makes the same mistake and gets the same error. */
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
    CHECK_STATUS(ddp_reducer_create(group, m.p, 0, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("nparams");
    CHECK_STATUS(ddp_reducer_create(group, NULL, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("params");
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 2, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("buffers");
    m.p[2].dtype = DDP_I32;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l2.w");
    m.p[2].dtype = DDP_F32;
    m.p[2].rows = 2;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l2.w");
    CHECK_ERROR_MENTIONS("rows");
    m.p[2].rows = 0;
    m.p[4].sparse = 1;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("head");
    m.p[4].sparse = 0;
    m.p[1].data = NULL;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l1.b");
    m.p[1].data = m.data[1];
    m.p[3].name = "l1.w";
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l1.w");
    m.p[3].name = "l2.b";
    c.user_grads = 1;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("grad");
    c.user_grads = 0;
    c.bucket_cap_bytes = 0;
    CHECK_STATUS(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bucket_cap_bytes");
    c.bucket_cap_bytes = 64;
    CHECK(r == NULL);

    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    void *g = NULL;
    CHECK_STATUS(ddp_reducer_grad(r, NP, &g), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("index 5");
    CHECK_STATUS(ddp_reducer_grad(r, 0, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_grad(NULL, 0, &g), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_grad_ready(r, 0), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("prepare");
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE);
    CHECK_STATUS(ddp_reducer_grad_ready(r, 99), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_grad_ready(NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    int64_t idx = 0;
    float val = 0;
    CHECK_STATUS(ddp_reducer_sparse_grad(r, 0, &idx, &val, 1), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("l1.w");
    const int64_t *ri;
    const void *rv;
    size_t rn;
    CHECK_STATUS(ddp_reducer_sparse_result(r, 0, &ri, &rv, &rn), DDP_ERR_INVALID_USAGE);
    CHECK_STATUS(ddp_reducer_sparse_result(r, 0, NULL, &rv, &rn), DDP_ERR_INVALID_ARGUMENT);
    const size_t *ps;
    size_t np;
    CHECK_STATUS(ddp_reducer_bucket_params(r, 1000, &ps, &np), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bucket 1000");
    CHECK_STATUS(ddp_reducer_bucket_params(NULL, 0, &ps, &np), DDP_ERR_INVALID_ARGUMENT);
    ddp_reducer_stats_t st;
    CHECK_STATUS(ddp_reducer_stats(r, &st), DDP_ERR_INVALID_USAGE);
    CHECK_STATUS(ddp_reducer_stats(r, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_prepare(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_set_sync(NULL, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_reducer_zero_grad(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK(ddp_reducer_bucket_count(NULL) == 0);
    ddp_reducer_destroy(r);
    ddp_reducer_destroy(NULL);

    /* A sparse parameter: bad rows. */
    model_make(&m);
    m.p[4].sparse = 1;
    m.p[4].rows = 29;
    CHECK_OK(ddp_reducer_create(group, m.p, NP, NULL, 0, &c, &r));
    CHECK_OK(ddp_reducer_prepare(r));
    int64_t bad[2] = {3, 29};
    float vals[2] = {1, 2};
    CHECK_STATUS(ddp_reducer_sparse_grad(r, 4, bad, vals, 2), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("head");
    CHECK_ERROR_MENTIONS("indices[1]");
    CHECK_STATUS(ddp_reducer_sparse_grad(r, 4, NULL, vals, 2), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_reducer_sparse_grad(r, 4, bad, vals, 1));
    CHECK_STATUS(ddp_reducer_sparse_grad(r, 4, bad, vals, 1), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("head");
    mark_all(r, 4);
    CHECK_STATUS(ddp_reducer_finalize(r), DDP_ERR_INVALID_USAGE); /* the twice error */
    ddp_reducer_destroy(r);

    /* Legacy mode arguments. */
    ddp_legacy_t *l = NULL;
    CHECK_STATUS(ddp_legacy_create(NULL, m.p, NP, 0, &l), DDP_ERR_INVALID_ARGUMENT);
    model_make(&m);
    CHECK_STATUS(ddp_legacy_create(group, m.p, NP, 0, &l), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("l1.w"); /* no grad */
    CHECK_STATUS(ddp_legacy_create(group, m.p, 0, 0, &l), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_legacy_allreduce(NULL, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_legacy_set_sync(NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    return 0;
}

/* status.h: after a call succeeds, ddp_last_error() is empty. Each call below runs right after a
 * failure left text behind (issue 12: set_sync, zero_grad and prepare kept the old text). */
static void leave_stale_text(void)
{
    void *g = NULL;
    CHECK_STATUS(ddp_reducer_grad(NULL, 0, &g), DDP_ERR_INVALID_ARGUMENT);
    CHECK(ddp_last_error()[0] != '\0');
}

#define CHECK_OK_CLEARS(expr)                                                                     \
    do {                                                                                          \
        leave_stale_text();                                                                       \
        CHECK_OK(expr);                                                                           \
        CHECK_MSG(ddp_last_error()[0] == '\0', "%s succeeded but left the error text '%s'",     \
                  #expr, ddp_last_error());                                                       \
    } while (0)

/* The same for calls that return no status (a query, a destroy). */
#define CHECK_CLEARS(stmt)                                                                        \
    do {                                                                                          \
        leave_stale_text();                                                                       \
        stmt;                                                                                     \
        CHECK_MSG(ddp_last_error()[0] == '\0', "%s left the error text '%s'", #stmt,            \
                  ddp_last_error());                                                              \
    } while (0)

static int case_stale_text(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    model_make(&m);
    m.p[2].rows = 7;
    m.p[4].sparse = 1;
    m.p[4].rows = 29;
    float buffer_data[4] = {0};
    ddp_buffer_t buffer = {"running_mean", buffer_data, 4, DDP_F32};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.first_bucket_bytes = 16;
    c.bucket_cap_bytes = 32;
    c.broadcast_buffers = 0; /* prepare then makes no group call that would clear the text */
    ddp_reducer_t *r = NULL;
    for (int sync_at_create = 0; sync_at_create < 2; sync_at_create++) {
        c.sync_at_create = sync_at_create;
        CHECK_OK_CLEARS(ddp_reducer_create(group, m.p, NP, &buffer, 1, &c, &r));
        if (!sync_at_create) CHECK_CLEARS(ddp_reducer_destroy(r));
    }
    void *g = NULL;
    int64_t rows[1] = {3};
    float values[1] = {1};
    /* Two synchronised iterations (the second prepare rebuilds the buckets), then a no_sync
     * one. */
    for (int iteration = 0; iteration < 3; iteration++) {
        int sync = iteration < 2;
        CHECK_OK_CLEARS(ddp_reducer_set_sync(r, sync));
        CHECK_OK_CLEARS(ddp_reducer_zero_grad(r));
        CHECK_OK_CLEARS(ddp_reducer_prepare(r));
        CHECK_OK_CLEARS(ddp_reducer_grad(r, 0, &g));
        CHECK_OK_CLEARS(ddp_reducer_sparse_grad(r, 4, rows, values, 1));
        CHECK_OK_CLEARS(ddp_reducer_grad_ready(r, 3));
        CHECK_OK_CLEARS(ddp_reducer_grad_ready_rows(r, 2, 0, 3));
        CHECK_OK_CLEARS(ddp_reducer_grad_ready_rows(r, 2, 3, 7));
        CHECK_OK_CLEARS(ddp_reducer_grad_ready(r, 1));
        CHECK_OK_CLEARS(ddp_reducer_grad_ready(r, 0));
        CHECK_OK_CLEARS(ddp_reducer_finalize(r));
    }
    const int64_t *ri;
    const void *rv;
    size_t rn;
    CHECK_OK(ddp_reducer_set_sync(r, 1));
    CHECK_OK(ddp_reducer_prepare(r));
    CHECK_OK(ddp_reducer_sparse_grad(r, 4, rows, values, 1));
    for (int i = 3; i >= 0; i--) CHECK_OK(ddp_reducer_grad_ready(r, (size_t)i));
    CHECK_OK(ddp_reducer_finalize(r));
    CHECK_OK_CLEARS(ddp_reducer_sparse_result(r, 4, &ri, &rv, &rn));
    const size_t *ps;
    size_t np;
    CHECK_OK_CLEARS(ddp_reducer_bucket_params(r, 0, &ps, &np));
    ddp_reducer_stats_t st;
    CHECK_OK_CLEARS(ddp_reducer_stats(r, &st));
    size_t nb = 0;
    CHECK_CLEARS(nb = ddp_reducer_bucket_count(r));
    CHECK(nb > 0);
    CHECK_CLEARS(ddp_reducer_destroy(r));

    ddp_bucket_assignment_t a;
    size_t limits[1] = {16};
    CHECK_OK_CLEARS(ddp_compute_bucket_assignment(m.p, NP, limits, 1, NULL, &a));
    CHECK_CLEARS(ddp_bucket_assignment_free(&a));

    float grads[NP][32];
    memset(grads, 0, sizeof grads);
    model_make(&m);
    for (int i = 0; i < NP; i++) m.p[i].grad = grads[i];
    ddp_legacy_t *l = NULL;
    CHECK_OK_CLEARS(ddp_legacy_create(group, m.p, NP, 16, &l));
    CHECK_OK_CLEARS(ddp_legacy_allreduce(l, NULL));
    CHECK_OK_CLEARS(ddp_legacy_set_sync(l, 0));
    CHECK_OK_CLEARS(ddp_legacy_allreduce(l, NULL));
    CHECK_CLEARS(ddp_legacy_destroy(l));
    return 0;
}

/* A rank that dies in the middle of backward: the others' finalize fails (the group notices the
 * dead peer or times out) instead of hanging. */
static int case_peer_exit(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    ddp_reducer_t *r = small_reducer(group, &m);
    CHECK_OK(ddp_reducer_prepare(r));
    if (last(group)) {
        CHECK_OK(ddp_reducer_grad_ready(r, 4));
        fflush(stdout);
        _exit(0); /* dies without finalize or destroy */
    }
    for (int i = NP; i-- > 0;) {
        ddp_status_t s = ddp_reducer_grad_ready(r, (size_t)i);
        CHECK(s == DDP_OK || s == DDP_ERR_ABORTED || s == DDP_ERR_REMOTE || s == DDP_ERR_TIMEOUT);
    }
    ddp_status_t s = ddp_reducer_finalize(r);
    CHECK_MSG(s == DDP_ERR_REMOTE || s == DDP_ERR_TIMEOUT || s == DDP_ERR_ABORTED,
              "finalize returned %s: %s", ddp_status_string(s), ddp_last_error());
    ddp_reducer_destroy(r);
    return 0;
}

/* A rank that reaches finalize after the others gave up on it (the group's timeout is 1 s here)
 * must fail too: before, its finalize's status exchange found every peer's status waiting and
 * returned DDP_OK while every other rank's finalize of that iteration failed. */
#define LATE_FINALIZE_TIMEOUT_MS 1000
static int case_late_finalize(ddp_group_t *group, void *arg)
{
    (void)arg;
    model_t m;
    ddp_reducer_t *r = small_reducer(group, &m);
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    CHECK_OK(ddp_reducer_finalize(r)); /* one good iteration */
    CHECK_OK(ddp_reducer_prepare(r));
    mark_all(r, -1);
    if (last(group)) {
        struct timespec ts = {0, 500000000L};
        struct timespec late = {LATE_FINALIZE_TIMEOUT_MS / 1000, 0};
        nanosleep(&late, NULL);
        nanosleep(&ts, NULL);
    }
    ddp_status_t s = ddp_reducer_finalize(r);
    CHECK_MSG(s != DDP_OK, "rank %d (%s) finalized with DDP_OK although the others failed",
              ddp_group_rank(group), last(group) ? "late" : "on time");
    CHECK_MSG(s == DDP_ERR_TIMEOUT || s == DDP_ERR_REMOTE || s == DDP_ERR_ABORTED,
              "finalize returned %s: %s", ddp_status_string(s), ddp_last_error());
    ddp_reducer_destroy(r);
    return 0;
}

int main(int argc, char **argv)
{
    const char *which = argc > 1 ? argv[1] : "args";
    int world = argc > 2 ? atoi(argv[2]) : 2;
    static const struct {
        const char *name;
        ddp_test_group_fn fn;
    } cases[] = {{"mismatch", case_mismatch},
                 {"local_create", case_local_create},
                 {"twice", case_twice},
                 {"unmarked", case_unmarked},
                 {"prepare_twice", case_prepare_twice},
                 {"hook_mismatch", case_hook_mismatch},
                 {"args", case_args},
                 {"peer_exit", case_peer_exit},
                 {"stale_text", case_stale_text},
                 {"late_finalize", case_late_finalize}};
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = strcmp(which, "late_finalize") == 0 ? LATE_FINALIZE_TIMEOUT_MS : 20000;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(cases[i].name, which) != 0) continue;
        int rc = ddp_test_run_group(world, 60, &options, cases[i].fn, NULL);
        printf("test_reducer_errors %s world=%d: %s\n", which, world, rc ? "FAILED" : "ok");
        return rc;
    }
    fprintf(stderr, "unknown case %s\n", which);
    return 2;
}
