/* The TCP transport alone (its ops table called directly, no group) on loopback, in `world`
 * forked processes: every collective x dtype x size (0, 1, 7, 4099, 1 MiB + 3) x in place or
 * not, checked against a float64 reference, and bitwise identical on every rank (each rank
 * publishes hashes of its outputs; rank 0 compares them). Allreduce also runs with the ring
 * forced on small sizes with tiny chunks (many pipelined frames) and with recursive doubling
 * forced on a large size, so both algorithms see odd, prime and non-divisible sizes.
 * Usage: test_tcp_transport WORLD PART (a: f32 f64; b: f16 bf16; d: i32 i64 u8; c: forced
 * algorithms), split so that each ctest entry stays short on a busy machine. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "harness.h"
#include "test_tcp_common.h"
#include "transport/tcp/tcp.h"

#define MAX_HASHES 4096

typedef struct ctx {
    int rank, world;
    void *state;
    uint64_t seq;
    uint64_t hashes[MAX_HASHES];
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
    return ddp__transport_tcp.run(x->state, &c);
}

/* Large outputs are checked on a sample (both ends and every 61st element, which crosses every
 * segment and chunk boundary pattern); the hashes still compare every byte across ranks. */
static int sampled(size_t i, size_t count)
{
    return count < 8192 || i < 64 || i + 64 >= count || i % 61 == 0;
}

static void record_hash(ctx_t *x, const void *buf, size_t bytes)
{
    CHECK(x->nhashes < MAX_HASHES);
    x->hashes[x->nhashes++] = tcp_test_hash(buf, bytes);
}

static void check_value(ddp_dtype_t dt, double got, double want, const char *what, size_t i,
                        size_t count, int rank)
{
    double tol = tcp_test_tolerance(dt);
    CHECK_MSG(fabs(got - want) <= tol, "rank %d %s %s count %zu: element %zu is %.9g, "
              "reference %.9g", rank, what, ddp_dtype_name(dt), count, i, got, want);
}

static void test_allreduce(ctx_t *x, ddp_dtype_t dt, ddp_reduce_op_t op, size_t count,
                           int in_place, unsigned salt)
{
    size_t es = ddp_dtype_size(dt);
    char *send = malloc(count * es + 1), *recv = malloc(count * es + 1);
    CHECK(send && recv);
    for (size_t i = 0; i < count; i++) ddp_test_put(dt, send, i, tcp_test_value(dt, x->rank, i, salt));
    if (in_place) memcpy(recv, send, count * es);
    CHECK_OK(run(x, DDP__ALLREDUCE, in_place ? recv : send, recv, count, dt, op, 0));
    for (size_t i = 0; i < count; i++)
        if (sampled(i, count))
        check_value(dt, ddp_test_get(dt, recv, i), tcp_test_reference(dt, op, x->world, i, salt),
                    ddp_reduce_op_name(op), i, count, x->rank);
    if (!in_place)
        for (size_t i = 0; i < count; i++)
            CHECK_MSG(!sampled(i, count) || ddp_test_get(dt, send, i) == tcp_test_value(dt, x->rank, i, salt),
                      "allreduce modified its input at %zu", i);
    record_hash(x, recv, count * es);
    free(send);
    free(recv);
}

static void test_broadcast(ctx_t *x, ddp_dtype_t dt, size_t count, int root, unsigned salt)
{
    size_t es = ddp_dtype_size(dt);
    char *buf = malloc(count * es + 1);
    CHECK(buf);
    for (size_t i = 0; i < count; i++) ddp_test_put(dt, buf, i, tcp_test_value(dt, x->rank, i, salt));
    CHECK_OK(run(x, DDP__BROADCAST, buf, buf, count, dt, 0, root));
    for (size_t i = 0; i < count; i++)
        CHECK_MSG(!sampled(i, count) || ddp_test_get(dt, buf, i) == tcp_test_value(dt, root, i, salt),
                  "rank %d broadcast from %d %s count %zu: element %zu wrong", x->rank, root,
                  ddp_dtype_name(dt), count, i);
    record_hash(x, buf, count * es);
    free(buf);
}

static void test_reduce_scatter(ctx_t *x, ddp_dtype_t dt, ddp_reduce_op_t op, size_t count,
                                int in_place, unsigned salt)
{
    size_t es = ddp_dtype_size(dt), total = count * (size_t)x->world;
    char *send = malloc(total * es + 1), *own = malloc(count * es + 1);
    CHECK(send && own);
    for (size_t i = 0; i < total; i++) ddp_test_put(dt, send, i, tcp_test_value(dt, x->rank, i, salt));
    char *recv = in_place ? send + count * (size_t)x->rank * es : own;
    CHECK_OK(run(x, DDP__REDUCE_SCATTER, send, recv, count, dt, op, 0));
    size_t base = count * (size_t)x->rank;
    for (size_t i = 0; i < count; i++)
        if (sampled(i, count))
        check_value(dt, ddp_test_get(dt, recv, i),
                    tcp_test_reference(dt, op, x->world, base + i, salt), "reduce_scatter", i,
                    count, x->rank);
    free(send);
    free(own);
}

static void test_allgather(ctx_t *x, ddp_dtype_t dt, size_t count, int in_place, unsigned salt)
{
    size_t es = ddp_dtype_size(dt), total = count * (size_t)x->world;
    char *recv = malloc(total * es + 1), *mine = malloc(count * es + 1);
    CHECK(recv && mine);
    memset(recv, 0xAB, total * es);
    char *send = in_place ? recv + count * (size_t)x->rank * es : mine;
    for (size_t i = 0; i < count; i++) ddp_test_put(dt, send, i, tcp_test_value(dt, x->rank, i, salt));
    CHECK_OK(run(x, DDP__ALLGATHER, send, recv, count, dt, 0, 0));
    for (int r = 0; r < x->world; r++)
        for (size_t i = 0; i < count; i++)
            CHECK_MSG(!sampled(i, count) || ddp_test_get(dt, recv, (size_t)r * count + i) == tcp_test_value(dt, r, i, salt),
                      "rank %d allgather %s count %zu: block %d element %zu wrong", x->rank,
                      ddp_dtype_name(dt), count, r, i);
    record_hash(x, recv, total * es);
    free(recv);
    free(mine);
}

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    const char *part = arg;
    static ctx_t x; /* large: not on the stack */
    memset(&x, 0, sizeof x);
    x.rank = rank;
    x.world = world;
    CHECK_OK(ddp__transport_tcp.create(store, "tcp-test", rank, world, 20000, &x.state));

    static const size_t sizes[] = {0, 1, 7, 4099, (1u << 20) + 3};
    static const ddp_dtype_t dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16,
                                         DDP_I32, DDP_I64, DDP_U8};
    unsigned salt = 1;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        ddp_dtype_t dt = dtypes[d];
        /* part "a": f32 f64; "b": f16 bf16; "d": i32 i64 u8; "c": forced algorithms. */
        if (strcmp(part, d < 2 ? "a" : d < 4 ? "b" : "d") != 0) continue;
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            size_t count = sizes[s];
            int large = count > 5000;
            for (int in_place = 0; in_place < 2; in_place++) {
                for (int op = 0; op < DDP_OP_COUNT; op++) {
                    /* The large size keeps the run short on a busy machine: sum both ways, avg
                     * in place, min and max out of place (products of a million values would
                     * over/underflow the reference anyway). */
                    if (large && (op == DDP_PROD || (op == DDP_AVG && !in_place) ||
                                  ((op == DDP_MIN || op == DDP_MAX) && in_place)))
                        continue;
                    test_allreduce(&x, dt, (ddp_reduce_op_t)op, count, in_place, salt++);
                }
                if (!large || in_place) test_broadcast(&x, dt, count, (int)(salt % (unsigned)world), salt);
                salt++;
                if (!large || !in_place)
                    test_reduce_scatter(&x, dt, large ? DDP_SUM : (ddp_reduce_op_t)(salt % 4),
                                        count, in_place, salt);
                salt++;
                if (!large || in_place) test_allgather(&x, dt, count, in_place, salt);
                salt++;
            }
        }
    }

    /* The ring on small sizes, with 64-byte chunks: many frames, segments of 0 and 1 element. */
    if (strcmp(part, "c") != 0) goto done;
    ddp__tcp_set_small_threshold(0);
    ddp__tcp_set_chunk_bytes(64);
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
        for (size_t s = 1; s < 4; s++)
            for (int op = 0; op < DDP_OP_COUNT; op++)
                test_allreduce(&x, dtypes[d], (ddp_reduce_op_t)op, sizes[s], (int)(s & 1), salt++);
    test_broadcast(&x, DDP_F64, 4099, world - 1, salt++);
    /* Recursive doubling on a large size. */
    ddp__tcp_set_small_threshold(SIZE_MAX);
    ddp__tcp_set_chunk_bytes(512 * 1024);
    test_allreduce(&x, DDP_F32, DDP_SUM, sizes[4], 0, salt++);
    test_allreduce(&x, DDP_BF16, DDP_AVG, sizes[4], 1, salt++);
    ddp__tcp_set_small_threshold(64 * 1024);

done:
    CHECK_OK(run(&x, DDP__BARRIER, NULL, NULL, 0, DDP_F32, 0, 0));

    /* Bitwise identity: every rank's output hashes must equal rank 0's. */
    char key[64];
    snprintf(key, sizeof key, "hashes/%d", rank);
    CHECK_OK(ddp_store_set(store, key, x.hashes, sizeof(uint64_t) * (size_t)x.nhashes));
    if (rank == 0) {
        for (int r = 1; r < world; r++) {
            void *v = NULL;
            size_t len = 0;
            snprintf(key, sizeof key, "hashes/%d", r);
            CHECK_OK(ddp_store_get(store, key, &v, &len));
            CHECK(len == sizeof(uint64_t) * (size_t)x.nhashes);
            for (int h = 0; h < x.nhashes; h++)
                CHECK_MSG(((uint64_t *)v)[h] == x.hashes[h], "output %d differs between rank 0 "
                          "and rank %d", h, r);
            ddp_free(v);
        }
        printf("world %d part %s: %d outputs bitwise identical on every rank, %llu collectives\n", world,
               part, x.nhashes, (unsigned long long)x.seq);
    }
    ddp__transport_tcp.destroy(x.state);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    const char *part = argc > 2 ? argv[2] : "a";
    if (strcmp(part, "a") && strcmp(part, "b") && strcmp(part, "c") && strcmp(part, "d")) {
        fprintf(stderr, "usage: test_tcp_transport WORLD a|b|c|d\n");
        return 2;
    }
    setenv("DDP_STORE_TOKEN", "test-token-tcp", 1);
    return ddp_test_run_ranks(world, 240, rank_main, (void *)part);
}
