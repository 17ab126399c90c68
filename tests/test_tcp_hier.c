/* The hierarchical transport on one machine playing several hosts: rank r pretends to run on host
 * LAYOUT[r] (e.g. "ABAB": ranks 0 and 2 on A, 1 and 3 on B), shared memory inside each pretend
 * host and TCP among the leaders. Every collective x dtype x size against the float64 reference,
 * bitwise identical on every rank; then a mismatch raised by a non-leader rank of the last host
 * must be DDP_ERR_MISMATCH on every rank, naming it.
 * Usage: test_tcp_hier LAYOUT [a|b] (a: floating dtypes, b: integer dtypes) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "harness.h"
#include "test_tcp_common.h"
#include "transport/hier/hier.h"

static const char *layout;
static const char *part;

typedef struct ctx {
    int rank, world;
    void *state;
    uint64_t seq;
    uint64_t hashes[1024];
    int nhashes;
} ctx_t;

static ddp_status_t run(ctx_t *x, ddp__collective_kind_t kind, const void *send, void *recv,
                        size_t count, ddp_dtype_t dt, ddp_reduce_op_t op, int root)
{
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.seq = ++x->seq;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dt;
    c.op = op;
    c.root = root;
    c.deadline_ns = ddp__now_ns() + 60LL * 1000000000LL;
    return ddp__transport_hierarchical.run(x->state, &c);
}

static void hash(ctx_t *x, const void *buf, size_t bytes)
{
    CHECK(x->nhashes < 1024);
    x->hashes[x->nhashes++] = tcp_test_hash(buf, bytes);
}

static void close_enough(ddp_dtype_t dt, double got, double want, const char *what, size_t i)
{
    CHECK_MSG(fabs(got - want) <= tcp_test_tolerance(dt), "%s %s: element %zu is %.9g, "
              "reference %.9g", what, ddp_dtype_name(dt), i, got, want);
}

static void one_size(ctx_t *x, ddp_dtype_t dt, size_t count, unsigned *salt)
{
    size_t es = ddp_dtype_size(dt), total = count * (size_t)x->world;
    char *a = malloc(total * es + 8), *b = malloc(total * es + 8);
    CHECK(a && b);
    for (int op = 0; op < DDP_OP_COUNT; op++) {
        if (count > 5000 && op == DDP_PROD) continue;
        unsigned s = (*salt)++;
        int in_place = (int)(s & 1);
        for (size_t i = 0; i < count; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, x->rank, i, s));
        if (in_place) memcpy(b, a, count * es);
        CHECK_OK(run(x, DDP__ALLREDUCE, in_place ? b : a, b, count, dt, (ddp_reduce_op_t)op, 0));
        for (size_t i = 0; i < count; i++)
            close_enough(dt, ddp_test_get(dt, b, i),
                         tcp_test_reference(dt, (ddp_reduce_op_t)op, x->world, i, s), "allreduce", i);
        hash(x, b, count * es);
    }
    /* broadcast from every root (the large size: the first and the last rank only) */
    for (int root = 0; root < x->world; root++) {
        if (count > 5000 && root != 0 && root != x->world - 1) continue;
        unsigned s = (*salt)++;
        for (size_t i = 0; i < count; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, x->rank, i, s));
        CHECK_OK(run(x, DDP__BROADCAST, a, a, count, dt, 0, root));
        for (size_t i = 0; i < count; i++)
            CHECK_MSG(ddp_test_get(dt, a, i) == tcp_test_value(dt, root, i, s), "broadcast from "
                      "%d element %zu", root, i);
        hash(x, a, count * es);
    }
    /* allgather (in place) */
    unsigned s = (*salt)++;
    char *mine = a + count * (size_t)x->rank * es;
    for (size_t i = 0; i < count; i++) ddp_test_put(dt, mine, i, tcp_test_value(dt, x->rank, i, s));
    CHECK_OK(run(x, DDP__ALLGATHER, mine, a, count, dt, 0, 0));
    for (int r = 0; r < x->world; r++)
        for (size_t i = 0; i < count; i++)
            CHECK_MSG(ddp_test_get(dt, a, (size_t)r * count + i) == tcp_test_value(dt, r, i, s),
                      "allgather block %d element %zu", r, i);
    hash(x, a, total * es);
    /* reduce_scatter (not in place) */
    s = (*salt)++;
    for (size_t i = 0; i < total; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, x->rank, i, s));
    CHECK_OK(run(x, DDP__REDUCE_SCATTER, a, b, count, dt, DDP_SUM, 0));
    for (size_t i = 0; i < count; i++)
        close_enough(dt, ddp_test_get(dt, b, i),
                     tcp_test_reference(dt, DDP_SUM, x->world, count * (size_t)x->rank + i, s),
                     "reduce_scatter", i);
    free(a);
    free(b);
}

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    char host[32];
    snprintf(host, sizeof host, "pretend-host-%c", layout[rank]);
    ddp__hier_set_host_identity(host);
    static ctx_t x;
    x.rank = rank;
    x.world = world;
    CHECK_OK(ddp__transport_hierarchical.create(store, "hier-test", rank, world, 30000, &x.state));

    static const size_t sizes[] = {0, 1, 7, 4099, 300007};
    static const ddp_dtype_t dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16,
                                         DDP_I32, DDP_I64, DDP_U8};
    unsigned salt = 1;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        /* part "a": the floating types; "b": the integers (each ctest entry stays short). */
        if (strcmp(part, d < 4 ? "a" : "b") != 0) continue;
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
            one_size(&x, dtypes[d], sizes[k], &salt);
    }
    CHECK_OK(run(&x, DDP__BARRIER, NULL, NULL, 0, DDP_F32, 0, 0));

    char key[64];
    snprintf(key, sizeof key, "hashes/%d", rank);
    CHECK_OK(ddp_store_set(store, key, x.hashes, sizeof(uint64_t) * (size_t)x.nhashes));
    for (int r = 0; r < world; r++) {
        void *v = NULL;
        size_t len = 0;
        snprintf(key, sizeof key, "hashes/%d", r);
        CHECK_OK(ddp_store_get(store, key, &v, &len));
        CHECK(len == sizeof(uint64_t) * (size_t)x.nhashes);
        for (int h = 0; h < x.nhashes; h++)
            CHECK_MSG(((uint64_t *)v)[h] == x.hashes[h], "output %d differs between rank %d and "
                      "rank %d", h, rank, r);
        ddp_free(v);
    }

    /* The last rank (a non-leader when its host has several ranks) asks for another count. */
    float buf[64] = {0};
    ddp_status_t s = run(&x, DDP__ALLREDUCE, buf, buf, rank == world - 1 ? 63 : 64, DDP_F32,
                         DDP_SUM, 0);
    CHECK_STATUS(s, DDP_ERR_MISMATCH);
    char who[32];
    snprintf(who, sizeof who, "rank %d called", world - 1);
    CHECK_ERROR_MENTIONS(who);
    CHECK_ERROR_MENTIONS("count 63");
    CHECK_STATUS(run(&x, DDP__BARRIER, NULL, NULL, 0, DDP_F32, 0, 0), DDP_ERR_ABORTED);
    if (rank == 0) printf("layout %s part %s: %d outputs identical on every rank; mismatch seen by all\n",
                          layout, part, x.nhashes);
    ddp__transport_hierarchical.destroy(x.state);
    return 0;
}

int main(int argc, char **argv)
{
    layout = argc > 1 ? argv[1] : "ABAB";
    part = argc > 2 ? argv[2] : "a";
    int world = (int)strlen(layout);
    setenv("DDP_STORE_TOKEN", "hier-test-token", 1);
    return ddp_test_run_ranks(world, 200, rank_main, NULL);
}
