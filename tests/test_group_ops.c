/* Every collective x every dtype x sizes 0, 1, 4, 7, 4099, 1 Mi + 3, in place and out of place,
 * against a float64 reference computed here; every rank must end with the very same bytes
 * (checked by allgathering a hash of each result).
 * Usage: test_group_ops <world> <family> [dtypes]   family: allreduce | broadcast |
 * reduce_scatter | allgather | all; dtypes: comma-separated names (default: all) */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"

/* 4 elements: the largest that rides in the first phase's line for f64 allgathers, broadcasts
 * and allreduces and 2-rank f32 reduce_scatters (32 bytes: MAILBOX_DATA in shm_internal.h); 7:
 * just past it for some. */
static const size_t sizes[] = {0, 1, 4, 7, 4099, (1u << 20) + 3};
#define NSIZES (sizeof sizes / sizeof sizes[0])

static const char *family = "all";
static const char *dtype_filter = NULL; /* comma-separated dtype names, NULL: all */

static int wanted(int dt)
{
    if (!dtype_filter) return 1;
    char list[128];
    snprintf(list, sizeof list, ",%s,", dtype_filter);
    char name[16];
    snprintf(name, sizeof name, ",%s,", ddp_dtype_name((ddp_dtype_t)dt));
    return strstr(list, name) != NULL;
}

/* Small integers so that sums and products are exact in every dtype (f16 and bf16 included). */
static double input_value(int rank, size_t i, ddp_dtype_t dt, ddp_reduce_op_t op)
{
    if (op == DDP_PROD) {
        static const int prod_signed[3] = {-1, 1, 2};
        int v = (int)((i * 5 + (size_t)rank * 3) % 3);
        return dt == DDP_U8 ? (double)(v + 1) : (double)prod_signed[v];
    }
    int v = (int)((i * 7 + (size_t)rank * 13) % 17);
    return dt == DDP_U8 ? (double)v : (double)(v - 8);
}

static int is_float(ddp_dtype_t dt) { return dt == DDP_F32 || dt == DDP_F64 || dt == DDP_F16 || dt == DDP_BF16; }

/* Reference for element i: op over ranks of input_value, in float64. */
static double reference(int world, size_t i, ddp_dtype_t dt, ddp_reduce_op_t op)
{
    double acc = input_value(0, i, dt, op);
    for (int r = 1; r < world; r++) {
        acc = ddp_test_fold(op, acc, input_value(r, i, dt, op));
    }
    if (op == DDP_AVG) acc = is_float(dt) ? acc / world : trunc(acc / world);
    return acc;
}

/* input_value has period 17 (sums) or 3 (products) in i, so the reference has period 51. */
#define PERIOD 51
static void reference_table(int world, ddp_dtype_t dt, ddp_reduce_op_t op, double *table)
{
    for (size_t i = 0; i < PERIOD; i++) table[i] = reference(world, i, dt, op);
}

static int close_enough(double got, double want, ddp_dtype_t dt, ddp_reduce_op_t op)
{
    if (op != DDP_AVG || !is_float(dt)) return got == want;
    double tol = (dt == DDP_F16 || dt == DDP_BF16) ? 1e-2 : 1e-6;
    return fabs(got - want) <= tol * (fabs(want) > 1 ? fabs(want) : 1);
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

/* Every rank must hold the same bytes: allgather the hashes and compare. */
static void check_same_everywhere(ddp_group_t *g, const void *buf, size_t bytes, const char *what)
{
    int world = ddp_group_size(g);
    int64_t mine = (int64_t)hash_bytes(buf, bytes);
    int64_t all[8];
    CHECK_OK(ddp_group_allgather(g, &mine, all, 1, DDP_I64));
    for (int r = 0; r < world; r++)
        CHECK_MSG(all[r] == mine, "%s: rank %d's result differs from rank %d's", what, r,
                  ddp_group_rank(g));
}

static void test_allreduce(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        if (!wanted(dt)) continue;
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (int op = 0; op < DDP_OP_COUNT; op++) {
            for (size_t si = 0; si < NSIZES; si++) {
                size_t n = sizes[si];
                for (int in_place = 0; in_place < 2; in_place++) {
                    char *send = malloc(n * es + 1), *recv = malloc(n * es + 1);
                    CHECK(send && recv);
                    for (size_t i = 0; i < n; i++) ddp_test_put((ddp_dtype_t)dt, send, i, input_value(rank, i, (ddp_dtype_t)dt, (ddp_reduce_op_t)op));
                    memset(recv, 0x5a, n * es);
                    char *out = in_place ? send : recv;
                    CHECK_OK(ddp_group_allreduce(g, send, out, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op));
                    double table[PERIOD];
                    reference_table(world, (ddp_dtype_t)dt, (ddp_reduce_op_t)op, table);
                    for (size_t i = 0; i < n; i++) {
                        double want = table[i % PERIOD];
                        double got = ddp_test_get((ddp_dtype_t)dt, out, i);
                        CHECK_MSG(close_enough(got, want, (ddp_dtype_t)dt, (ddp_reduce_op_t)op),
                                  "allreduce %s %s n=%zu in_place=%d world=%d: element %zu is %g, want %g",
                                  ddp_dtype_name((ddp_dtype_t)dt), ddp_reduce_op_name((ddp_reduce_op_t)op), n, in_place, world, i, got, want);
                    }
                    if (!in_place) {
                        for (size_t i = 0; i < n; i++)
                            CHECK_MSG(ddp_test_get((ddp_dtype_t)dt, send, i) == input_value(rank, i, (ddp_dtype_t)dt, (ddp_reduce_op_t)op),
                                      "allreduce modified send at %zu", i);
                    }
                    check_same_everywhere(g, out, n * es, "allreduce");
                    free(send);
                    free(recv);
                }
            }
        }
    }
}

static void test_broadcast(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        if (!wanted(dt)) continue;
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (int root = 0; root < world; root++) {
            for (size_t si = 0; si < NSIZES; si++) {
                size_t n = sizes[si];
                char *buf = malloc(n * es + 1);
                CHECK(buf);
                for (size_t i = 0; i < n; i++) ddp_test_put((ddp_dtype_t)dt, buf, i, input_value(rank, i, (ddp_dtype_t)dt, DDP_SUM));
                CHECK_OK(ddp_group_broadcast(g, buf, n, (ddp_dtype_t)dt, root));
                for (size_t i = 0; i < n; i++)
                    CHECK_MSG(ddp_test_get((ddp_dtype_t)dt, buf, i) == input_value(root, i, (ddp_dtype_t)dt, DDP_SUM),
                              "broadcast %s root %d n=%zu: element %zu wrong", ddp_dtype_name((ddp_dtype_t)dt), root, n, i);
                check_same_everywhere(g, buf, n * es, "broadcast");
                free(buf);
            }
        }
    }
}

static void test_reduce_scatter(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        if (!wanted(dt)) continue;
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (int op = 0; op < DDP_OP_COUNT; op++) {
            for (size_t si = 0; si < NSIZES; si++) {
                size_t n = sizes[si];
                if (n > 5000 && op != DDP_SUM && op != DDP_AVG) continue; /* keep it quick */
                for (int in_place = 0; in_place < 2; in_place++) {
                    size_t total = n * (size_t)world;
                    char *send = malloc(total * es + 1), *recv = malloc(n * es + 1);
                    CHECK(send && recv);
                    /* Element i of the whole array, rank r's contribution: input_value(r, i). */
                    for (size_t i = 0; i < total; i++) ddp_test_put((ddp_dtype_t)dt, send, i, input_value(rank, i, (ddp_dtype_t)dt, (ddp_reduce_op_t)op));
                    char *out = in_place ? send + (size_t)rank * n * es : recv;
                    CHECK_OK(ddp_group_reduce_scatter(g, send, out, n, (ddp_dtype_t)dt, (ddp_reduce_op_t)op));
                    double table[PERIOD];
                    reference_table(world, (ddp_dtype_t)dt, (ddp_reduce_op_t)op, table);
                    for (size_t i = 0; i < n; i++) {
                        double want = table[((size_t)rank * n + i) % PERIOD];
                        double got = ddp_test_get((ddp_dtype_t)dt, out, i);
                        CHECK_MSG(close_enough(got, want, (ddp_dtype_t)dt, (ddp_reduce_op_t)op),
                                  "reduce_scatter %s %s n=%zu in_place=%d world=%d: element %zu is %g, want %g",
                                  ddp_dtype_name((ddp_dtype_t)dt), ddp_reduce_op_name((ddp_reduce_op_t)op), n, in_place, world, i, got, want);
                    }
                    free(send);
                    free(recv);
                }
            }
        }
    }
}

static void test_allgather(ddp_group_t *g)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    for (int dt = 0; dt < DDP_DTYPE_COUNT; dt++) {
        if (!wanted(dt)) continue;
        size_t es = ddp_dtype_size((ddp_dtype_t)dt);
        for (size_t si = 0; si < NSIZES; si++) {
            size_t n = sizes[si];
            for (int in_place = 0; in_place < 2; in_place++) {
                char *send = malloc(n * es + 1), *recv = malloc(n * (size_t)world * es + 1);
                CHECK(send && recv);
                memset(recv, 0x33, n * (size_t)world * es);
                char *src = in_place ? recv + (size_t)rank * n * es : send;
                for (size_t i = 0; i < n; i++) ddp_test_put((ddp_dtype_t)dt, src, i, input_value(rank, i, (ddp_dtype_t)dt, DDP_SUM));
                CHECK_OK(ddp_group_allgather(g, src, recv, n, (ddp_dtype_t)dt));
                for (int r = 0; r < world; r++)
                    for (size_t i = 0; i < n; i++)
                        CHECK_MSG(ddp_test_get((ddp_dtype_t)dt, recv, (size_t)r * n + i) == input_value(r, i, (ddp_dtype_t)dt, DDP_SUM),
                                  "allgather %s n=%zu in_place=%d: block %d element %zu wrong", ddp_dtype_name((ddp_dtype_t)dt), n, in_place, r, i);
                check_same_everywhere(g, recv, n * (size_t)world * es, "allgather");
                free(send);
                free(recv);
            }
        }
    }
}

static int body(ddp_group_t *g, void *arg)
{
    (void)arg;
    int all = strcmp(family, "all") == 0;
    if (all || !strcmp(family, "allreduce")) test_allreduce(g);
    if (all || !strcmp(family, "broadcast")) test_broadcast(g);
    if (all || !strcmp(family, "reduce_scatter")) test_reduce_scatter(g);
    if (all || !strcmp(family, "allgather")) test_allgather(g);
    for (int i = 0; i < 3; i++) CHECK_OK(ddp_group_barrier(g));
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    if (argc > 2) family = argv[2];
    if (argc > 3) dtype_filter = argv[3];
    ddp_group_options_t opts = DDP_GROUP_OPTIONS_INIT;
    opts.timeout_ms = 60000;
    int rc = ddp_test_run_group(world, 110, &opts, body, NULL);
    if (rc == 0) printf("test_group_ops world=%d %s %s: ok\n", world, family, dtype_filter ? dtype_filter : "all dtypes");
    return rc;
}
