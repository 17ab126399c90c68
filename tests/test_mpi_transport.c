/* The MPI transport driven directly through its ops table (src/transport/transport.h), run under
 * mpirun with 1-4 processes: every op x dtype x size against a float64 reference with bitwise
 * identical results on every rank, in place and out of place, every broadcast root, subgroups
 * and reorderings through a file store, fingerprint mismatches, a timeout, a peer's abort, an
 * error raised inside MPI mapped to a status, and rank/world checks against MPI's own. */
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "harness.h"
#include "transport/mpi/mpi_internal.h"

static int g_rank, g_world;
static int g_no_large; /* --no-large: leave out the 1 MiB+3 size */

/* 64/65 and 128/129 straddle the transport's inline payload (512 bytes in the reduction type:
 * 64 f64/i64, 128 f32/i32/f16/bf16 or u8-min/max, 64 u8-sum widened to i64). */
static const size_t sizes[] = {0, 1, 7, 64, 65, 128, 129, 4099, (1u << 20) + 3};
enum { NSIZES = sizeof sizes / sizeof sizes[0] };

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), a pure function of (rank, index, salt). */
static double unit(int rank, size_t i, unsigned salt)
{
    uint64_t h = mix(((uint64_t)(unsigned)rank << 56) ^ ((uint64_t)salt << 40) ^ (uint64_t)i);
    return (double)(h >> 11) * 0x1.0p-52 - 1.0;
}

static int is_float(ddp_dtype_t d)
{
    return d == DDP_F32 || d == DDP_F64 || d == DDP_F16 || d == DDP_BF16;
}

/* The input of `rank` at index i, exactly representable in the dtype. */
static double fvalue(ddp_dtype_t d, ddp_reduce_op_t op, int rank, size_t i, unsigned salt)
{
    double u = unit(rank, i, salt);
    double x = op == DDP_PROD ? 1.0 + u / 8.0 : u;
    switch (d) {
    case DDP_F32: return (float)x;
    case DDP_F16: return ddp_f16_to_f32(ddp_f32_to_f16((float)x));
    case DDP_BF16: return ddp_bf16_to_f32(ddp_f32_to_bf16((float)x));
    default: return x;
    }
}

static int64_t ivalue(ddp_dtype_t d, ddp_reduce_op_t op, int rank, size_t i, unsigned salt)
{
    double u = unit(rank, i, salt);
    if (op == DDP_PROD) return d == DDP_U8 ? (int64_t)((u + 1.0) * 2.0) : (int64_t)(u * 4.0);
    switch (d) {
    case DDP_I32: return (int64_t)(u * 100000.0);
    case DDP_I64: return (int64_t)(u * 0x1.0p50);
    default: return (int64_t)((u + 1.0) * 128.0); /* u8: 0..255 */
    }
}

static void put(ddp_dtype_t d, void *buf, size_t i, double f, int64_t v)
{
    switch (d) {
    case DDP_F32: ((float *)buf)[i] = (float)f; break;
    case DDP_F64: ((double *)buf)[i] = f; break;
    case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)f); break;
    case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)f); break;
    case DDP_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case DDP_I64: ((int64_t *)buf)[i] = v; break;
    case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

static double getf(ddp_dtype_t d, const void *buf, size_t i)
{
    switch (d) {
    case DDP_F32: return ((const float *)buf)[i];
    case DDP_F64: return ((const double *)buf)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)buf)[i]);
    default: return 0;
    }
}

static int64_t geti(ddp_dtype_t d, const void *buf, size_t i)
{
    switch (d) {
    case DDP_I32: return ((const int32_t *)buf)[i];
    case DDP_I64: return ((const int64_t *)buf)[i];
    case DDP_U8: return ((const uint8_t *)buf)[i];
    default: return 0;
    }
}

/* Fills element i of buf with the input of `rank` (global index gi). */
static void fill(ddp_dtype_t d, ddp_reduce_op_t op, void *buf, size_t i, int rank, size_t gi,
                 unsigned salt)
{
    if (is_float(d)) put(d, buf, i, fvalue(d, op, rank, gi, salt), 0);
    else put(d, buf, i, 0, ivalue(d, op, rank, gi, salt));
}

static int64_t wrap(ddp_dtype_t d, int64_t v)
{
    if (d == DDP_I32) return (int32_t)(uint32_t)(uint64_t)v;
    if (d == DDP_U8) return (uint8_t)(uint64_t)v;
    return v;
}

/* Checks got[i] against the reduction over `world` ranks (ranks[] maps group rank to the salt
 * rank) of the inputs at global index gi. */
static void check_reduced(ddp_dtype_t d, ddp_reduce_op_t op, const void *got, size_t i, size_t gi,
                          int world, unsigned salt, const char *what)
{
    if (is_float(d)) {
        double acc = fvalue(d, op, 0, gi, salt), mag = fabs(acc);
        for (int r = 1; r < world; r++) {
            double x = fvalue(d, op, r, gi, salt);
            mag += fabs(x);
            switch (op) {
            case DDP_SUM:
            case DDP_AVG: acc += x; break;
            case DDP_MIN: acc = x < acc ? x : acc; break;
            case DDP_MAX: acc = x > acc ? x : acc; break;
            default: acc *= x; break;
            }
        }
        if (op == DDP_AVG) {
            acc /= world;
            mag /= world;
        }
        double eps_acc = d == DDP_F64 ? 0x1.0p-53 : 0x1.0p-24;
        double eps_out = d == DDP_F16 ? 0x1.0p-11 : d == DDP_BF16 ? 0x1.0p-8 : eps_acc;
        double tol = 0;
        if (op == DDP_SUM || op == DDP_AVG) tol = mag * (world + 2) * eps_acc + fabs(acc) * eps_out;
        if (op == DDP_PROD) tol = fabs(acc) * ((world + 2) * eps_acc + eps_out);
        if (d == DDP_F16) tol += 0x1.0p-24;
        double g = getf(d, got, i);
        CHECK_MSG(fabs(g - acc) <= tol,
                  "%s: %s %s element %zu: got %.17g, reference %.17g (tol %g)", what,
                  ddp_dtype_name(d), ddp_reduce_op_name(op), i, g, acc, tol);
    } else {
        int64_t acc = ivalue(d, op, 0, gi, salt);
        for (int r = 1; r < world; r++) {
            int64_t x = ivalue(d, op, r, gi, salt);
            switch (op) {
            case DDP_SUM:
            case DDP_AVG: acc = (int64_t)((uint64_t)acc + (uint64_t)x); break;
            case DDP_MIN: acc = x < acc ? x : acc; break;
            case DDP_MAX: acc = x > acc ? x : acc; break;
            default: acc = (int64_t)((uint64_t)acc * (uint64_t)x); break;
            }
        }
        if (op == DDP_AVG) acc /= world;
        acc = wrap(d, acc);
        int64_t g = geti(d, got, i);
        CHECK_MSG(g == acc, "%s: %s %s element %zu: got %lld, reference %lld", what,
                  ddp_dtype_name(d), ddp_reduce_op_name(op), i, (long long)g, (long long)acc);
    }
}

/* The reference is costly per element: large results are checked in full near both ends and at
 * every 3rd element in between (every byte is still compared across ranks by check_identical). */
static size_t next_checked(size_t i, size_t n)
{
    if (n < 20000 || i < 8192 || i + 8192 >= n) return i + 1;
    return i + 3;
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

/* Every member of `comm` must hold the very same bytes. */
static void check_identical(MPI_Comm comm, const void *buf, size_t bytes, const char *what)
{
    int n = 0;
    MPI_Comm_size(comm, &n);
    uint64_t mine = hash_bytes(buf, bytes);
    uint64_t all[64];
    CHECK(MPI_Allgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, comm) == MPI_SUCCESS);
    for (int r = 0; r < n; r++)
        CHECK_MSG(all[r] == all[0], "%s: results differ between ranks 0 and %d", what, r);
}

static ddp__collective_t make(ddp__collective_kind_t kind, uint64_t seq, const void *send,
                              void *recv, size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                              int root, int timeout_ms)
{
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.seq = seq;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dtype;
    c.op = op;
    c.root = root;
    c.deadline_ns = ddp__now_ns() + (int64_t)timeout_ms * 1000000;
    return c;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p);
    return p;
}

/* ---- every op x dtype x size ---------------------------------------------------------------- */

/* At 1 MiB+3 elements only SUM, plus AVG where it takes its own path (widened to f32 or i64):
 * the other ops run the same MPI call as SUM and are covered at the smaller sizes. */
static int large_case(ddp_dtype_t d, ddp_reduce_op_t op)
{
    if (op == DDP_SUM) return 1;
    return op == DDP_AVG && (d == DDP_F16 || d == DDP_BF16 || d == DDP_I32 || d == DDP_U8);
}

static void test_all_collectives(void)
{
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "all", g_rank, g_world, 30000, &t));
    uint64_t seq = 0;
    char what[128];
    for (int si = 0; si < NSIZES; si++) {
        size_t n = sizes[si];
        int large = n > 100000;
        if (large && g_no_large) continue;
        for (int di = 0; di < DDP_DTYPE_COUNT; di++) {
            ddp_dtype_t d = (ddp_dtype_t)di;
            size_t esz = ddp_dtype_size(d);
            unsigned salt = (unsigned)(si * 16 + di);
            /* allreduce: every op, out of place and in place (for the large count see
             * large_case; in place only f32 and f16 SUM), to keep the test quick. */
            for (int oi = 0; oi < DDP_OP_COUNT; oi++) {
                ddp_reduce_op_t op = (ddp_reduce_op_t)oi;
                if (large && !large_case(d, op)) continue;
                for (int in_place = 0; in_place < 2; in_place++) {
                    if (large && in_place && (op != DDP_SUM || (d != DDP_F32 && d != DDP_F16)))
                        continue;
                    void *send = xmalloc(n * esz);
                    void *recv = in_place ? send : xmalloc(n * esz);
                    for (size_t i = 0; i < n; i++) fill(d, op, send, i, g_rank, i, salt + oi);
                    if (!in_place) memset(recv, 0xa5, n * esz);
                    ddp__collective_t c =
                        make(DDP__ALLREDUCE, ++seq, send, recv, n, d, op, 0, 30000);
                    CHECK_OK(ddp__transport_mpi.run(t, &c));
                    snprintf(what, sizeof what, "allreduce n=%zu%s", n,
                             in_place ? " in place" : "");
                    for (size_t i = 0; i < n; i = next_checked(i, n))
                        check_reduced(d, op, recv, i, i, g_world, salt + oi, what);
                    check_identical(MPI_COMM_WORLD, recv, n * esz, what);
                    if (!in_place) {
                        /* The send buffer is untouched. */
                        for (size_t i = 0; i < n && i < 64; i++) {
                            char one[8];
                            fill(d, op, one, 0, g_rank, i, salt + oi);
                            CHECK(memcmp((char *)send + i * esz, one, esz) == 0);
                        }
                        free(recv);
                    }
                    free(send);
                }
            }
            /* broadcast from every root (the last one only for the large count). */
            for (int root = large ? g_world - 1 : 0; root < g_world; root++) {
                void *buf = xmalloc(n * esz);
                if (g_rank == root) {
                    for (size_t i = 0; i < n; i++) fill(d, DDP_SUM, buf, i, root, i, salt);
                } else {
                    memset(buf, 0x5a, n * esz);
                }
                ddp__collective_t c = make(DDP__BROADCAST, ++seq, buf, buf, n, d, 0, root, 30000);
                CHECK_OK(ddp__transport_mpi.run(t, &c));
                for (size_t i = 0; i < n; i++) {
                    char one[8];
                    fill(d, DDP_SUM, one, 0, root, i, salt);
                    CHECK_MSG(memcmp((char *)buf + i * esz, one, esz) == 0,
                              "broadcast %s n=%zu root %d element %zu", ddp_dtype_name(d), n,
                              root, i);
                }
                free(buf);
            }
            /* reduce_scatter: n elements per rank, every op (large_case for the large count);
             * in place for SUM. */
            for (int oi = 0; oi < DDP_OP_COUNT; oi++) {
                ddp_reduce_op_t op = (ddp_reduce_op_t)oi;
                if (large && !large_case(d, op)) continue;
                for (int in_place = 0; in_place < 2; in_place++) {
                    if (in_place && op != DDP_SUM) continue;
                    size_t total = n * (size_t)g_world;
                    void *send = xmalloc(total * esz);
                    for (size_t i = 0; i < total; i++)
                        fill(d, op, send, i, g_rank, i, salt + 8 + oi);
                    void *recv =
                        in_place ? (char *)send + (size_t)g_rank * n * esz : xmalloc(n * esz);
                    ddp__collective_t c =
                        make(DDP__REDUCE_SCATTER, ++seq, send, recv, n, d, op, 0, 30000);
                    CHECK_OK(ddp__transport_mpi.run(t, &c));
                    snprintf(what, sizeof what, "reduce_scatter n=%zu%s", n,
                             in_place ? " in place" : "");
                    for (size_t i = 0; i < n; i = next_checked(i, n))
                        check_reduced(d, op, recv, i, (size_t)g_rank * n + i, g_world,
                                      salt + 8 + oi, what);
                    if (in_place) {
                        /* The other blocks of the input are left as they were. */
                        for (int b = 0; b < g_world; b++) {
                            if (b == g_rank) continue;
                            for (size_t i = 0; i < n && i < 16; i++) {
                                char one[8];
                                fill(d, op, one, 0, g_rank, (size_t)b * n + i, salt + 8 + oi);
                                CHECK(memcmp((char *)send + ((size_t)b * n + i) * esz, one, esz) ==
                                      0);
                            }
                        }
                    } else {
                        free(recv);
                    }
                    free(send);
                }
            }
            /* allgather: out of place and in place (out of place only for the large count). */
            for (int in_place = 0; in_place < 2 - large; in_place++) {
                size_t total = n * (size_t)g_world;
                void *recv = xmalloc(total * esz);
                memset(recv, 0x33, total * esz);
                void *send = in_place ? (char *)recv + (size_t)g_rank * n * esz : xmalloc(n * esz);
                for (size_t i = 0; i < n; i++) fill(d, DDP_SUM, send, i, g_rank, i, salt + 16);
                ddp__collective_t c = make(DDP__ALLGATHER, ++seq, send, recv, n, d, 0, 0, 30000);
                CHECK_OK(ddp__transport_mpi.run(t, &c));
                for (int r = 0; r < g_world; r++) {
                    for (size_t i = 0; i < n; i++) {
                        char one[8];
                        fill(d, DDP_SUM, one, 0, r, i, salt + 16);
                        CHECK_MSG(memcmp((char *)recv + ((size_t)r * n + i) * esz, one, esz) == 0,
                                  "allgather %s n=%zu%s block %d element %zu", ddp_dtype_name(d),
                                  n, in_place ? " in place" : "", r, i);
                    }
                }
                if (!in_place) free(send);
                free(recv);
            }
        }
    }
    ddp__collective_t b = make(DDP__BARRIER, ++seq, NULL, NULL, 0, 0, 0, 0, 30000);
    CHECK_OK(ddp__transport_mpi.run(t, &b));
    ddp__transport_mpi.destroy(t);
}

/* ---- rounding of f16 and bf16 ------------------------------------------------------------- */

/* Inputs on a coarse grid (multiples of 2^-10 for f16, 2^-7 for bf16, in [-1, 1)) make the f32
 * sum of up to 4 ranks exact whatever MPI's order, so the result must be exactly that sum
 * rounded once by ddp_f32_to_f16/bf16 (round to nearest even), bit for bit: this catches
 * summing in half precision, rounding twice, or a conversion path (F16C, vectorised bf16) that
 * rounds differently from the scalar reference. 4099 elements use the vector loops and tails. */
static void test_half_rounding(void)
{
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "half", g_rank, g_world, 30000, &t));
    enum { N = 4099 };
    static uint16_t buf[N];
    uint64_t seq = 0;
    for (int half = 0; half < 2; half++) {
        ddp_dtype_t d = half ? DDP_BF16 : DDP_F16;
        double grid = half ? 0x1.0p-7 : 0x1.0p-10;
        for (size_t i = 0; i < N; i++) {
            double x = floor(unit(g_rank, i, 77) / grid) * grid;
            buf[i] = half ? ddp_f32_to_bf16((float)x) : ddp_f32_to_f16((float)x);
        }
        ddp__collective_t c = make(DDP__ALLREDUCE, ++seq, buf, buf, N, d, DDP_SUM, 0, 30000);
        CHECK_OK(ddp__transport_mpi.run(t, &c));
        for (size_t i = 0; i < N; i++) {
            double sum = 0;
            for (int r = 0; r < g_world; r++) sum += floor(unit(r, i, 77) / grid) * grid;
            uint16_t want = half ? ddp_f32_to_bf16((float)sum) : ddp_f32_to_f16((float)sum);
            CHECK_MSG(buf[i] == want, "%s sum element %zu: got 0x%04x, want 0x%04x (%.10g)",
                      ddp_dtype_name(d), i, buf[i], want, sum);
        }
    }
    ddp__transport_mpi.destroy(t);
}

/* ---- subgroups and reorderings through a store ---------------------------------------------- */

static ddp_store_t *shared_store(void)
{
    char path[600] = "";
    if (g_rank == 0) {
        const char *dir = ddp_test_tmpdir();
        CHECK(dir);
        snprintf(path, sizeof path, "%s/store", dir);
    }
    CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(path, &store));
    return store;
}

/* Members `ranks` (world ranks, in group order) form a group and allreduce-sum their world ranks
 * plus one: every member must see the same sum, and its group rank must be its position. */
static void check_subgroup(ddp_store_t *store, const char *name, const int *ranks, int n)
{
    int me = -1;
    for (int i = 0; i < n; i++)
        if (ranks[i] == g_rank) me = i;
    if (me < 0) return;
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(store, name, me, n, 30000, &t));
    int64_t v[3] = {g_rank + 1, me, 1}, want_sum = 0;
    for (int i = 0; i < n; i++) want_sum += ranks[i] + 1;
    ddp__collective_t c = make(DDP__ALLREDUCE, 1, v, v, 3, DDP_I64, DDP_SUM, 0, 30000);
    CHECK_OK(ddp__transport_mpi.run(t, &c));
    CHECK_MSG(v[0] == want_sum && v[1] == (int64_t)n * (n - 1) / 2 && v[2] == n,
              "subgroup %s: sums %lld %lld %lld", name, (long long)v[0], (long long)v[1],
              (long long)v[2]);
    /* Broadcast from group rank 0 reaches everyone: its world rank. */
    int32_t root_world = g_rank;
    c = make(DDP__BROADCAST, 2, &root_world, &root_world, 1, DDP_I32, 0, 0, 30000);
    CHECK_OK(ddp__transport_mpi.run(t, &c));
    CHECK_MSG(root_world == ranks[0], "subgroup %s: broadcast from group rank 0 gave %d, not %d",
              name, root_world, ranks[0]);
    /* Allgather orders blocks by group rank. */
    int32_t mine = g_rank, all[64];
    c = make(DDP__ALLGATHER, 3, &mine, all, 1, DDP_I32, 0, 0, 30000);
    CHECK_OK(ddp__transport_mpi.run(t, &c));
    for (int i = 0; i < n; i++) CHECK(all[i] == ranks[i]);
    ddp__transport_mpi.destroy(t);
}

static void test_subgroups(void)
{
    ddp_store_t *store = shared_store();
    int all[64], reversed[64], even[64], neven = 0;
    for (int r = 0; r < g_world; r++) {
        all[r] = r;
        reversed[r] = g_world - 1 - r;
    }
    for (int r = g_world - 1; r >= 0; r--)
        if (r % 2 == 0) even[neven++] = r; /* even ranks, descending */
    check_subgroup(store, "sub/identity", all, g_world);
    check_subgroup(store, "sub/reversed", reversed, g_world);
    check_subgroup(store, "sub/even-desc", even, neven);
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp_store_destroy(store);
}

/* Subgroups without a store: ddp__mpi_split over a parent made from MPI_COMM_WORLD. */
static void test_split_without_store(void)
{
    void *parent = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "split-parent", g_rank, g_world, 30000, &parent));
    int members[64], n = 0;
    for (int r = g_world - 1; r >= 0; r -= 2) members[n++] = r; /* every other rank, descending */
    void *sub = (void *)1;
    CHECK_OK(ddp__mpi_split(parent, members, n, "split-child", &sub));
    int me = -1;
    for (int i = 0; i < n; i++)
        if (members[i] == g_rank) me = i;
    if (me < 0) {
        CHECK(sub == NULL);
    } else {
        CHECK(sub != NULL);
        int32_t mine = g_rank, all[64];
        ddp__collective_t c = make(DDP__ALLGATHER, 1, &mine, all, 1, DDP_I32, 0, 0, 30000);
        CHECK_OK(ddp__transport_mpi.run(sub, &c));
        for (int i = 0; i < n; i++) CHECK(all[i] == members[i]);
        int64_t v = g_rank, want = 0;
        for (int i = 0; i < n; i++) want += members[i];
        c = make(DDP__ALLREDUCE, 2, &v, &v, 1, DDP_I64, DDP_SUM, 0, 30000);
        CHECK_OK(ddp__transport_mpi.run(sub, &c));
        CHECK(v == want);
        ddp__transport_mpi.destroy(sub);
    }
    /* The parent goes on working. */
    ddp__collective_t b = make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 30000);
    CHECK_OK(ddp__transport_mpi.run(parent, &b));
    int dup[2] = {0, 0}, out_of_range[1] = {g_world};
    CHECK_STATUS(ddp__mpi_split(parent, out_of_range, 1, "bad", &sub), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("ranks[0]");
    if (g_world > 1) {
        CHECK_STATUS(ddp__mpi_split(parent, dup, 2, "bad", &sub), DDP_ERR_INVALID_ARGUMENT);
        CHECK_ERROR_MENTIONS("listed twice");
    }
    CHECK_STATUS(ddp__mpi_split(NULL, members, n, "bad", &sub), DDP_ERR_INVALID_ARGUMENT);
    ddp__transport_mpi.destroy(parent);
}

/* ---- failures ------------------------------------------------------------------------------- */

static void test_rank_checks(void)
{
    void *t = NULL;
    CHECK_STATUS(ddp__transport_mpi.create(NULL, "bad", (g_rank + 1) % (g_world + 1), g_world + 1,
                                           1000, &t),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("MPI_COMM_WORLD says rank");
    char want[64];
    snprintf(want, sizeof want, "rank %d of %d", g_rank, g_world);
    CHECK_ERROR_MENTIONS(want);
    CHECK_STATUS(ddp__transport_mpi.create(NULL, "bad", g_world, g_world, 1000, &t),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("rank");
    CHECK_STATUS(ddp__transport_mpi.create(NULL, "bad", 0, 1, 1000, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("state");
}

/* Creates a fresh state over MPI_COMM_WORLD, runs one collective described by the caller on
 * every rank, and expects `want` on every rank with `needles` in the text. */
static void expect_failure(ddp__collective_t *c, ddp_status_t want, const char *const *needles,
                           int nneedles, int inject)
{
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "fail", g_rank, g_world, 30000, &t));
    if (inject) ddp__mpi_inject_fault(t);
    CHECK_STATUS(ddp__transport_mpi.run(t, c), want);
    for (int i = 0; i < nneedles; i++) CHECK_ERROR_MENTIONS(needles[i]);
    /* The state is broken for good. */
    ddp__collective_t b = make(DDP__BARRIER, c->seq + 1, NULL, NULL, 0, 0, 0, 0, 30000);
    CHECK_STATUS(ddp__transport_mpi.run(t, &b), DDP_ERR_ABORTED);
    CHECK_ERROR_MENTIONS(needles[0]);
    ddp__transport_mpi.destroy(t);
}

static void test_mismatches(void)
{
    if (g_world < 2) return;
    int last = g_world - 1;
    float buf[16] = {0};
    /* A different count on the last rank. */
    ddp__collective_t c = make(DDP__ALLREDUCE, 1, buf, buf, g_rank == last ? 11 : 10, DDP_F32,
                               DDP_SUM, 0, 30000);
    char other[64];
    snprintf(other, sizeof other, "rank %d called", last);
    const char *count_needles[] = {"mismatch", "count 10", "count 11", "rank 0 called", other};
    expect_failure(&c, DDP_ERR_MISMATCH, count_needles, 5, 0);
    /* A count small enough to travel inline on some ranks but not on the last one: the ranks
     * must still meet in the same exchange and agree that they disagree. */
    static float big[600];
    c = make(DDP__ALLREDUCE, 1, big, big, g_rank == last ? 600 : 100, DDP_F32, DDP_SUM, 0, 30000);
    const char *inline_needles[] = {"mismatch", "count 100", "count 600", other};
    expect_failure(&c, DDP_ERR_MISMATCH, inline_needles, 4, 0);
    /* A different dtype. */
    c = make(DDP__ALLREDUCE, 1, buf, buf, 4, g_rank == last ? DDP_I32 : DDP_F32, DDP_SUM, 0, 30000);
    const char *dtype_needles[] = {"mismatch", "f32", "i32", other};
    expect_failure(&c, DDP_ERR_MISMATCH, dtype_needles, 4, 0);
    /* A different op. */
    c = make(DDP__ALLREDUCE, 1, buf, buf, 4, DDP_F32, g_rank == last ? DDP_MAX : DDP_SUM, 0, 30000);
    const char *op_needles[] = {"mismatch", "sum", "max", other};
    expect_failure(&c, DDP_ERR_MISMATCH, op_needles, 4, 0);
    /* A different root. */
    c = make(DDP__BROADCAST, 1, buf, buf, 4, DDP_F32, 0, g_rank == last ? 1 : 0, 30000);
    const char *root_needles[] = {"mismatch", "root 0", "root 1", other};
    expect_failure(&c, DDP_ERR_MISMATCH, root_needles, 4, 0);
    /* A different collective (the last rank skipped one: a barrier against an allgather). */
    float gathered[64];
    c = g_rank == last ? make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 30000)
                       : make(DDP__ALLGATHER, 1, buf, gathered, 1, DDP_F32, 0, 0, 30000);
    const char *kind_needles[] = {"mismatch", other};
    expect_failure(&c, DDP_ERR_MISMATCH, kind_needles, 2, 0);
    /* A different sequence number. */
    c = make(DDP__BARRIER, g_rank == last ? 8 : 7, NULL, NULL, 0, 0, 0, 0, 30000);
    const char *seq_needles[] = {"mismatch", "seq 7", "seq 8"};
    expect_failure(&c, DDP_ERR_MISMATCH, seq_needles, 3, 0);
}

static void test_mpi_error(void)
{
    /* MPI itself refuses MPI_DATATYPE_NULL (OpenMPI says MPI_ERR_OP: no MPI_SUM for it); the
     * communicator's MPI_ERRORS_RETURN hands the error back instead of aborting the job. */
    float buf[4] = {1, 2, 3, 4};
    ddp__collective_t c = make(DDP__ALLREDUCE, 1, buf, buf, 4, DDP_F32, DDP_SUM, 0, 30000);
    const char *needles[] = {"MPI_ERR_", "seq 1 allreduce f32 sum count 4", "invalid", "rank"};
    expect_failure(&c, DDP_ERR_INVALID_ARGUMENT, needles, 4, 1);
    /* The mapping of error classes. */
    CHECK_STATUS(ddp__mpi_error(MPI_ERR_TRUNCATE, "probe"), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("probe: MPI_ERR_TRUNCATE");
    CHECK_STATUS(ddp__mpi_error(MPI_ERR_NO_MEM, "probe"), DDP_ERR_NO_MEMORY);
    CHECK_STATUS(ddp__mpi_error(MPI_ERR_OTHER, "probe"), DDP_ERR_SYSTEM);
    CHECK_STATUS(ddp__mpi_error(MPI_ERR_COUNT, "probe"), DDP_ERR_INVALID_ARGUMENT);
}

static void test_timeout(void)
{
    if (g_world < 2) return;
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "timeout", g_rank, g_world, 30000, &t));
    if (g_rank != 0) {
        /* Rank 0 is late: everyone else gives up after 300 ms. */
        ddp__collective_t c = make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 300);
        CHECK_STATUS(ddp__transport_mpi.run(t, &c), DDP_ERR_TIMEOUT);
        CHECK_ERROR_MENTIONS("seq 1");
        CHECK_ERROR_MENTIONS("timed out");
        /* Up to 8 ranks the records go point to point, so the late rank is named. */
        const char *named = g_world <= ddp__mpi_p2p_max_world ? "rank 0 (no collective seen yet)"
                                                              : "MPI cannot say which";
        CHECK_ERROR_MENTIONS(named);
        /* A later call on the broken state says why. */
        c = make(DDP__BARRIER, 2, NULL, NULL, 0, 0, 0, 0, 300);
        CHECK_STATUS(ddp__transport_mpi.run(t, &c), DDP_ERR_ABORTED);
        CHECK_ERROR_MENTIONS(named);
    }
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    if (g_rank == 0) {
        /* The others' abandoned fingerprint exchange is still posted in MPI, so the late rank
         * completes it; its own time budget still holds. */
        ddp__collective_t c = make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 10000);
        CHECK_OK(ddp__transport_mpi.run(t, &c));
    }
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp__transport_mpi.destroy(t);

    /* The last rank drops out after seq 2: the others name it with the last seq they saw. */
    CHECK_OK(ddp__transport_mpi.create(NULL, "timeout2", g_rank, g_world, 30000, &t));
    int last = g_world - 1;
    for (uint64_t seq = 1; seq <= 2; seq++) {
        float x = 1;
        ddp__collective_t c = make(DDP__ALLREDUCE, seq, &x, &x, 1, DDP_F32, DDP_SUM, 0, 30000);
        CHECK_OK(ddp__transport_mpi.run(t, &c));
        CHECK(x == (float)g_world);
    }
    if (g_rank != last) {
        ddp__collective_t c = make(DDP__BARRIER, 3, NULL, NULL, 0, 0, 0, 0, 300);
        CHECK_STATUS(ddp__transport_mpi.run(t, &c), DDP_ERR_TIMEOUT);
        char want[64];
        snprintf(want, sizeof want, "rank %d (last seen at seq 2)", last);
        CHECK_ERROR_MENTIONS(g_world <= ddp__mpi_p2p_max_world ? want : "MPI cannot say which");
        CHECK_ERROR_MENTIONS("seq 3");
    }
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp__transport_mpi.destroy(t);
}

static void test_abort(void)
{
    if (g_world < 2) return;
    void *t = NULL;
    CHECK_OK(ddp__transport_mpi.create(NULL, "abort", g_rank, g_world, 30000, &t));
    if (g_rank == 0) {
        ddp__transport_mpi.abort(t, "rank 0 ran out of patience");
        ddp__collective_t c = make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 30000);
        CHECK_STATUS(ddp__transport_mpi.run(t, &c), DDP_ERR_ABORTED);
        CHECK_ERROR_MENTIONS("out of patience");
    } else {
        /* Without the notice this would wait the full 30 s. */
        ddp__collective_t c = make(DDP__BARRIER, 1, NULL, NULL, 0, 0, 0, 0, 30000);
        int64_t t0 = ddp__now_ns();
        CHECK_STATUS(ddp__transport_mpi.run(t, &c), DDP_ERR_REMOTE);
        CHECK_ERROR_MENTIONS("rank 0 aborted");
        CHECK_ERROR_MENTIONS("out of patience");
        (void)t0;
    }
    CHECK(MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS);
    ddp__transport_mpi.destroy(t);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--no-large") == 0) g_no_large = 1;
        /* Exercise the exchange larger groups use (one MPI_Iallreduce of the records). */
        if (strcmp(argv[i], "--allreduce-exchange") == 0) ddp__mpi_p2p_max_world = 0;
    }
    /* The transport initialises MPI itself: the first create does. */
    void *t = NULL;
    int mpi_rank = 0, mpi_size = 1;
    {
        /* Learn our place the way a launcher would tell us. */
        const char *r = getenv("OMPI_COMM_WORLD_RANK"), *s = getenv("OMPI_COMM_WORLD_SIZE");
        if (r && s) {
            mpi_rank = atoi(r);
            mpi_size = atoi(s);
        }
    }
    CHECK_OK(ddp__transport_mpi.create(NULL, "first", mpi_rank, mpi_size, 30000, &t));
    int initialized = 0;
    MPI_Initialized(&initialized);
    CHECK(initialized);
    CHECK(ddp__mpi_thread_level() == MPI_THREAD_MULTIPLE);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    CHECK(g_rank == mpi_rank && g_world == mpi_size);
    CHECK(g_world <= 64);
    ddp__transport_mpi.destroy(t);

    const char *only = getenv("TEST_MPI_ONLY");
    if (!only || strstr(only, "rank")) test_rank_checks();
    if (!only || strstr(only, "mismatch")) test_mismatches();
    if (!only || strstr(only, "error")) test_mpi_error();
    if (!only || strstr(only, "abort")) test_abort();
    if (!only || strstr(only, "timeout")) test_timeout();
    if (!only || strstr(only, "sub")) test_subgroups();
    if (!only || strstr(only, "split")) test_split_without_store();
    if (!only || strstr(only, "half")) test_half_rounding();
    if (!only || strstr(only, "all")) test_all_collectives();
    if (g_rank == 0) printf("test_mpi_transport: %d ranks passed\n", g_world);
    /* The transport finalises MPI at exit, since it initialised it. */
    return 0;
}

