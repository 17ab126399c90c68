/* Bucket assignment (c10d's compute_bucket_assignment_by_size) on known size lists: one dtype,
 * mixed dtypes with their own limit progressions, sparse tensors alone, exact limit boundaries,
 * tensors larger than every limit, empty tensors, a visiting order, and a large random property
 * check. No group is needed. */
#include <string.h>

#include "harness.h"
#include "reducer/reducer_internal.h"

#define MAXP 64

static ddp_param_t P(size_t numel, ddp_dtype_t dtype, int sparse)
{
    ddp_param_t p;
    memset(&p, 0, sizeof p);
    p.name = "p";
    p.numel = numel;
    p.dtype = dtype;
    p.sparse = sparse;
    p.rows = sparse ? 1 : 0;
    return p;
}

/* Checks the assignment against `want`: buckets separated by -1, terminated by -2. */
static void expect(const ddp_bucket_assignment_t *a, const int *want, int line)
{
    size_t b = 0, k = 0;
    size_t start = 0;
    for (const int *w = want;; w++) {
        if (*w == -1 || *w == -2) {
            CHECK_MSG(b < a->nbuckets, "line %d: too few buckets (%zu)", line, a->nbuckets);
            CHECK_MSG(a->starts[b] == start && a->starts[b + 1] == k,
                      "line %d: bucket %zu spans [%zu,%zu), expected [%zu,%zu)", line, b,
                      a->starts[b], a->starts[b + 1], start, k);
            b++;
            start = k;
            if (*w == -2) break;
            continue;
        }
        CHECK_MSG(a->indices[k] == (size_t)*w, "line %d: entry %zu is %zu, expected %d", line, k,
                  a->indices[k], *w);
        k++;
    }
    CHECK_MSG(a->nbuckets == b, "line %d: %zu buckets, expected %zu", line, a->nbuckets, b);
}

static void test_one_dtype(void)
{
    /* bytes 8 8 12 20 4 40 4; limits 16 then 40 */
    ddp_param_t p[7] = {P(2, DDP_F32, 0), P(2, DDP_F32, 0), P(3, DDP_F32, 0), P(5, DDP_F32, 0),
                        P(1, DDP_F32, 0), P(10, DDP_F32, 0), P(1, DDP_F32, 0)};
    size_t limits[2] = {16, 40};
    ddp_bucket_assignment_t a;
    CHECK_OK(ddp_compute_bucket_assignment(p, 7, limits, 2, NULL, &a));
    int want[] = {0, 1, -1, 2, 3, 4, 5, -1, 6, -2};
    expect(&a, want, __LINE__);
    ddp_bucket_assignment_free(&a);
    CHECK(a.starts == NULL && a.indices == NULL && a.nbuckets == 0);

    /* The Reducer's way: reverse order. Buckets keep visiting order inside and are sorted by
     * their smallest index. */
    size_t order[7] = {6, 5, 4, 3, 2, 1, 0};
    CHECK_OK(ddp_compute_bucket_assignment(p, 7, limits, 2, order, &a));
    int want_rev[] = {0, -1, 4, 3, 2, 1, -1, 6, 5, -2};
    expect(&a, want_rev, __LINE__);
    ddp_bucket_assignment_free(&a);

    /* Sorting by visiting position instead (rebuild): the first-visited bucket comes first. */
    CHECK_OK(ddp__bucket_assignment(p, 7, limits, 2, order, DDP__SORT_BY_POSITION, &a));
    int want_pos[] = {6, 5, -1, 4, 3, 2, 1, -1, 0, -2};
    expect(&a, want_pos, __LINE__);
    ddp_bucket_assignment_free(&a);

    /* One limit repeats for every bucket. */
    CHECK_OK(ddp_compute_bucket_assignment(p, 7, limits, 1, NULL, &a));
    int want_one[] = {0, 1, -1, 2, 3, -1, 4, 5, -1, 6, -2};
    expect(&a, want_one, __LINE__);
    ddp_bucket_assignment_free(&a);
}

static void test_mixed_dtypes(void)
{
    /* a f32 16B, b f64 8B, c f32 4B, d f64 16B, e f32 40B, f f64 24B, g bf16 2B, h f16 6B */
    ddp_param_t p[8] = {P(4, DDP_F32, 0), P(1, DDP_F64, 0), P(1, DDP_F32, 0),
                        P(2, DDP_F64, 0), P(10, DDP_F32, 0), P(3, DDP_F64, 0),
                        P(1, DDP_BF16, 0), P(3, DDP_F16, 0)};
    size_t limits[2] = {16, 40};
    ddp_bucket_assignment_t a;
    CHECK_OK(ddp_compute_bucket_assignment(p, 8, limits, 2, NULL, &a));
    /* a closes f32's first bucket at 16; b+d close f64's at 24; c+e close f32's second at 44;
     * f, g, h are left open and closed at the end, one bucket per dtype. */
    int want[] = {0, -1, 1, 3, -1, 2, 4, -1, 5, -1, 6, -1, 7, -2};
    expect(&a, want, __LINE__);
    ddp_bucket_assignment_free(&a);
}

static void test_sparse(void)
{
    ddp_param_t p[5] = {P(2, DDP_F32, 0), P(100, DDP_F32, 1), P(2, DDP_F32, 0),
                        P(1, DDP_F32, 1), P(5, DDP_F32, 0)};
    size_t limits[1] = {16};
    ddp_bucket_assignment_t a;
    CHECK_OK(ddp_compute_bucket_assignment(p, 5, limits, 1, NULL, &a));
    /* Sparse tensors never join the dense accumulator: 0 and 2 together reach 16 bytes. */
    int want[] = {0, 2, -1, 1, -1, 3, -1, 4, -2};
    expect(&a, want, __LINE__);
    ddp_bucket_assignment_free(&a);
}

static void test_boundaries(void)
{
    size_t limits[2] = {12, 20};
    ddp_bucket_assignment_t a;
    /* Exactly the limit closes (>=); one element less does not. */
    ddp_param_t exact[3] = {P(3, DDP_F32, 0), P(5, DDP_F32, 0), P(1, DDP_F32, 0)};
    CHECK_OK(ddp_compute_bucket_assignment(exact, 3, limits, 2, NULL, &a));
    int want_exact[] = {0, -1, 1, -1, 2, -2};
    expect(&a, want_exact, __LINE__);
    ddp_bucket_assignment_free(&a);

    ddp_param_t below[3] = {P(2, DDP_F32, 0), P(4, DDP_F32, 0), P(1, DDP_F32, 0)};
    CHECK_OK(ddp_compute_bucket_assignment(below, 3, limits, 2, NULL, &a));
    int want_below[] = {0, 1, -1, 2, -2};
    expect(&a, want_below, __LINE__);
    ddp_bucket_assignment_free(&a);

    /* A huge tensor closes the open bucket it joins (c10d does not split or isolate it); the
     * empty tensor joins whatever bucket is open. */
    ddp_param_t huge[5] = {P(1, DDP_F32, 0), P(0, DDP_F32, 0), P((size_t)1 << 28, DDP_F32, 0),
                           P(0, DDP_F32, 0), P((size_t)1 << 30, DDP_F64, 0)};
    CHECK_OK(ddp_compute_bucket_assignment(huge, 5, limits, 2, NULL, &a));
    int want_huge[] = {0, 1, 2, -1, 3, -1, 4, -2};
    expect(&a, want_huge, __LINE__);
    ddp_bucket_assignment_free(&a);

    /* Only empty tensors: one bucket at the end. Zero limit: every tensor closes a bucket. */
    ddp_param_t empty[3] = {P(0, DDP_F32, 0), P(0, DDP_F32, 0), P(0, DDP_F32, 0)};
    CHECK_OK(ddp_compute_bucket_assignment(empty, 3, limits, 2, NULL, &a));
    int want_empty[] = {0, 1, 2, -2};
    expect(&a, want_empty, __LINE__);
    ddp_bucket_assignment_free(&a);
    size_t zero = 0;
    CHECK_OK(ddp_compute_bucket_assignment(empty, 3, &zero, 1, NULL, &a));
    int want_zero[] = {0, -1, 1, -1, 2, -2};
    expect(&a, want_zero, __LINE__);
    ddp_bucket_assignment_free(&a);

    /* No tensors, a single tensor. */
    CHECK_OK(ddp_compute_bucket_assignment(NULL, 0, limits, 2, NULL, &a));
    CHECK(a.nbuckets == 0 && a.starts && a.starts[0] == 0);
    ddp_bucket_assignment_free(&a);
    ddp_param_t one = P(7, DDP_F16, 0);
    CHECK_OK(ddp_compute_bucket_assignment(&one, 1, limits, 2, NULL, &a));
    int want_one[] = {0, -2};
    expect(&a, want_one, __LINE__);
    ddp_bucket_assignment_free(&a);
}

static void test_errors(void)
{
    ddp_param_t p[3] = {P(1, DDP_F32, 0), P(1, DDP_F32, 0), P(1, DDP_F32, 0)};
    size_t limits[1] = {4};
    ddp_bucket_assignment_t a = {0};
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, limits, 1, NULL, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
    CHECK_STATUS(ddp_compute_bucket_assignment(NULL, 3, limits, 1, NULL, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("params");
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, NULL, 1, NULL, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("limits");
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, limits, 0, NULL, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("limits");
    size_t dup[3] = {0, 1, 1};
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, limits, 1, dup, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("order[2]");
    size_t range[3] = {0, 3, 1};
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, limits, 1, range, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("order[1]");
    p[1].dtype = (ddp_dtype_t)99;
    CHECK_STATUS(ddp_compute_bucket_assignment(p, 3, limits, 1, NULL, &a),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("params[1]");
    CHECK(a.starts == NULL && a.nbuckets == 0); /* untouched on failure */
    ddp_bucket_assignment_free(NULL);
}

/* Large random lists: every index exactly once; one dtype per dense bucket; sparse alone; every
 * bucket closed early reached its limit and was below it before its last tensor; sorted. */
static void test_random(void)
{
    enum { N = 20011 };
    static ddp_param_t p[N];
    static size_t order[N];
    static unsigned char seen[N];
    unsigned long long seed = 42;
    const ddp_dtype_t dtypes[4] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16};
    for (size_t i = 0; i < N; i++) {
        double r = ddp_test_random(&seed);
        size_t numel = (size_t)((r + 1.0) * 5000.0);
        if (i % 97 == 0) numel = (size_t)1 << 20;
        p[i] = P(numel, dtypes[i % 7 % 4], i % 1009 == 5);
        order[i] = N - 1 - i;
    }
    size_t limits[3] = {1 << 16, 1 << 18, 1 << 20};
    for (int use_order = 0; use_order < 2; use_order++) {
        ddp_bucket_assignment_t a;
        CHECK_OK(ddp_compute_bucket_assignment(p, N, limits, 3, use_order ? order : NULL, &a));
        memset(seen, 0, sizeof seen);
        size_t last_min = 0;
        for (size_t b = 0; b < a.nbuckets; b++) {
            size_t s = a.starts[b], e = a.starts[b + 1];
            CHECK(e > s);
            size_t min = (size_t)-1, bytes = 0;
            for (size_t k = s; k < e; k++) {
                size_t i = a.indices[k];
                CHECK(i < N && !seen[i]);
                seen[i] = 1;
                if (i < min) min = i;
                CHECK(p[i].dtype == p[a.indices[s]].dtype);
                if (p[i].sparse) CHECK(e - s == 1);
                if (k + 1 < e)
                    CHECK(bytes + p[i].numel * ddp_dtype_size(p[i].dtype) < limits[2]);
                bytes += p[i].numel * ddp_dtype_size(p[i].dtype);
            }
            if (b > 0) CHECK(min > last_min);
            last_min = min;
        }
        for (size_t i = 0; i < N; i++) CHECK(seen[i]);
        ddp_bucket_assignment_free(&a);
    }
}

int main(void)
{
    test_one_dtype();
    test_mixed_dtypes();
    test_sparse();
    test_boundaries();
    test_errors();
    test_random();
    printf("test_bucket_assignment: ok\n");
    return 0;
}
