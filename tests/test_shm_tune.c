/* The shm allreduce's variants (staged with non-temporal or plain stores, one-shot, single copy
 * through process_vm_readv) and the tuner that chooses among them (docs/shm-transport.md,
 * "Single-copy allreduce" and "Self-tuning").
 *
 *   variants  every variant (the staged ones: both stores x both round sizes), forced through
 *             the config knobs, gives bitwise the same bytes as
 *             every other and on every rank, for sizes around each threshold, in place and not,
 *             f32 sum (also against a reference summed here in rank order), f16 sum, i32 avg,
 *             f64 max; and the variant asked for is the one that ran (ddp_group_algorithm).
 *   fallback  one rank sets DDP_SHM_CMA=off: no rank may read another's memory, so every rank
 *             runs the staged path, with the same results.
 *   collectives  broadcast (two roots), allgather and reduce_scatter (f32 sum against a
 *             reference, f16 sum, i32 avg), in place and not, and alltoall (apart, one buffer,
 *             overlapping): rounds and single copy give the same bytes on every rank (each
 *             rank's own, for alltoall), and the variant asked for ran.
 *   agree     online tuning with each rank's measurements skewed so that every rank believes a
 *             different variant is fastest: after every call all ranks report the same variant,
 *             and it is rank 0's favourite once the probe is over.
 *   trace     the tuner's decision shows up: rank 0's skewed clock makes staged:plain win at
 *             64 KiB; every rank's Chrome trace (ddp_group_set_trace) gets the instant event
 *             naming it, rank 0 logs it at DDP_LOG_LEVEL=info (set by the test's registration),
 *             and a Reducer made with config.trace hands its trace to the group while it lives.
 *             With a directory as 3rd argument the traces stay there (tests/group.cmake parses
 *             them as JSON).
 *   knobs     online tuning with DDP_SHM_STAGED_ROUNDS or DDP_SHM_STAGED_STORES set: only the
 *             staged variants they allow run (both of them), same bytes on every rank.
 * Usage: test_shm_tune <world> variants|fallback|collectives|agree|trace|knobs [DIR] */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "transport/shm/shm.h"

static const char *mode;

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

typedef struct {
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    size_t count;
} case_t;

/* Sizes around the mailbox (32 B), one-shot (16 KiB), tuner (256 KiB) and single-copy (1 MiB)
 * thresholds, odd counts (slices of unequal length, some empty with 4 ranks), and one that is
 * several stage rounds long. */
static const size_t f32_counts[] = {1,     8,      9,      4096,        4097,         16411,
                                    65536, 65551,  262147, (1u << 20) + 13, (3u << 20) + 5};
static const size_t other_counts[] = {9, 4097, 65551, 262147};
#define MAX_CASES 64

static int make_cases(case_t *cases)
{
    int n = 0;
    for (size_t i = 0; i < sizeof f32_counts / sizeof *f32_counts; i++)
        cases[n++] = (case_t){DDP_F32, DDP_SUM, f32_counts[i]};
    const case_t others[3] = {{DDP_F16, DDP_SUM, 0}, {DDP_I32, DDP_AVG, 0}, {DDP_F64, DDP_MAX, 0}};
    for (int o = 0; o < 3; o++)
        for (size_t i = 0; i < sizeof other_counts / sizeof *other_counts; i++) {
            cases[n] = others[o];
            cases[n++].count = other_counts[i];
        }
    return n;
}

/* The knobs that force each variant (tuning off). */
typedef struct {
    const char *name;      /* what ddp_group_algorithm must say above the one-shot size */
    const char *env[4][2]; /* variable, value */
} variant_t;

static const variant_t variants[] = {
    {"staged:nt", {{"DDP_SHM_CMA", "off"}, {"DDP_SHM_STAGED_STORES", "nt"}}},
    {"staged:plain", {{"DDP_SHM_CMA", "off"}, {"DDP_SHM_STAGED_STORES", "plain"}}},
    {"one-shot", {{"DDP_SHM_CMA", "off"}, {"DDP_SHM_ONESHOT_BYTES", "1048576"}}},
    {"single-copy", {{"DDP_SHM_CMA_BYTES", "0"}, {"DDP_SHM_ONESHOT_BYTES", "0"}}},
    {"staged:nt:short",
     {{"DDP_SHM_CMA", "off"}, {"DDP_SHM_STAGED_STORES", "nt"}, {"DDP_SHM_STAGED_ROUNDS", "short"}}},
    {"staged:plain:long",
     {{"DDP_SHM_CMA", "off"},
      {"DDP_SHM_STAGED_STORES", "plain"},
      {"DDP_SHM_STAGED_ROUNDS", "long"}}},
    /* Rounds of a prime number of bytes (chunks cut at odd places): the same bytes. */
    {"staged:nt",
     {{"DDP_SHM_CMA", "off"}, {"DDP_SHM_STAGED_ROUNDS", "long"},
      {"DDP_SHM_ALLREDUCE_ROUND_BYTES", "69997"}}},
};
#define NVARIANTS ((int)(sizeof variants / sizeof *variants))

static void clear_env(void)
{
    const char *names[] = {"DDP_SHM_CMA",           "DDP_SHM_STAGED_STORES",
                           "DDP_SHM_ONESHOT_BYTES", "DDP_SHM_CMA_BYTES",
                           "DDP_SHM_TUNE",          "DDP_SHM_STAGED_ROUNDS",
                           "DDP_SHM_ALLREDUCE_ROUND_BYTES"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) unsetenv(names[i]);
    /* The variants of unregistered buffers: with DDP_SHM_MAP=auto the buffers this test reuses
     * call after call would be registered and go mapped (tests/test_shm_map.c tests that). */
    setenv("DDP_SHM_MAP", "on", 1);
}

static ddp_group_t *make_group(int rank, int world, ddp_store_t *store, const char *name)
{
    ddp_group_options_t options;
    ddp_group_options_init(&options);
    options.name = name;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &options, &g));
    return g;
}

/* Checks that a 64-bit value is the same on every rank. */
static void check_same_everywhere(ddp_group_t *g, uint64_t v, const char *what, int k)
{
    int64_t lo = (int64_t)v, hi = (int64_t)v;
    CHECK_OK(ddp_group_allreduce(g, &lo, &lo, 1, DDP_I64, DDP_MIN));
    CHECK_OK(ddp_group_allreduce(g, &hi, &hi, 1, DDP_I64, DDP_MAX));
    CHECK_MSG(lo == hi, "%s of case %d differs between ranks", what, k);
}

/* Runs every case on g (in place when `inplace`); returns the hashes of the results. */
static void run_cases(ddp_group_t *g, const case_t *cases, int ncases, int inplace,
                      const char *expect_algorithm, uint64_t *hashes)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    for (int k = 0; k < ncases; k++) {
        const case_t *c = &cases[k];
        size_t bytes = c->count * ddp_dtype_size(c->dtype);
        char *send = malloc(bytes + 64), *recv = malloc(bytes + 64);
        CHECK(send && recv);
        ddp_test_fill(send, c->dtype, rank, c->count, k);
        memset(recv, 0xA5, bytes + 64);
        if (inplace) memcpy(recv, send, bytes);
        CHECK_OK(ddp_group_allreduce(g, inplace ? recv : send, recv, c->count, c->dtype, c->op));
        const char *ran = ddp_group_algorithm(g);
        /* Guard bytes past the end stay untouched. */
        for (size_t i = bytes; i < bytes + 64; i++)
            CHECK_MSG((unsigned char)recv[i] == 0xA5, "case %d wrote past its end", k);
        if (world > 1 && expect_algorithm && bytes > 16384)
            CHECK_MSG(strcmp(ran, expect_algorithm) == 0, "case %d (%zu bytes) ran %s, not %s", k,
                      bytes, ran, expect_algorithm);
        if (c->dtype == DDP_F32 && c->op == DDP_SUM) {
            for (size_t i = 0; i < c->count; i++) {
                float want = ddp_test_input_f32(0, i, k);
                for (int r = 1; r < world; r++) want += ddp_test_input_f32(r, i, k);
                float got = ((float *)recv)[i];
                CHECK_MSG(memcmp(&got, &want, sizeof got) == 0,
                          "case %d (%zu f32, %s, in place %d) element %zu: %.9g, want %.9g", k,
                          c->count, ran, inplace, i, got, want);
            }
        }
        hashes[k] = hash_bytes(recv, bytes);
        check_same_everywhere(g, hashes[k], "the result", k);
        free(send);
        free(recv);
    }
}

static int rank_variants(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    case_t cases[MAX_CASES];
    int ncases = make_cases(cases);
    static uint64_t hashes[NVARIANTS][2][MAX_CASES];
    for (int v = 0; v < NVARIANTS; v++) {
        clear_env();
        setenv("DDP_SHM_TUNE", "off", 1);
        for (int e = 0; e < 4 && variants[v].env[e][0]; e++)
            setenv(variants[v].env[e][0], variants[v].env[e][1], 1);
        char name[64];
        snprintf(name, sizeof name, "variant%d", v);
        ddp_group_t *g = make_group(rank, world, store, name);
        for (int inplace = 0; inplace < 2; inplace++) {
            /* The one-shot variant runs only up to its threshold; above it the staged path. */
            int k_max = ncases;
            run_cases(g, cases, k_max, inplace, v == 2 ? NULL : variants[v].name,
                      hashes[v][inplace]);
            if (v == 2 && world > 1) {
                /* 65551 f32 (256 KiB) is within the one-shot size set above. */
                case_t one = {DDP_F32, DDP_SUM, 65551};
                uint64_t h;
                run_cases(g, &one, 1, inplace, "one-shot", &h);
            }
        }
        ddp_group_destroy(g);
    }
    for (int v = 1; v < NVARIANTS; v++)
        for (int inplace = 0; inplace < 2; inplace++)
            for (int k = 0; k < ncases; k++)
                CHECK_MSG(hashes[v][inplace][k] == hashes[0][inplace][k],
                          "case %d (%zu elements, dtype %d, in place %d): %s differs from %s", k,
                          cases[k].count, (int)cases[k].dtype, inplace, variants[v].name,
                          variants[0].name);
    for (int k = 0; k < ncases; k++)
        CHECK_MSG(hashes[0][0][k] == hashes[0][1][k], "case %d: in place differs from not", k);
    return 0;
}

static int rank_fallback(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    case_t cases[MAX_CASES];
    int ncases = make_cases(cases);
    static uint64_t on[MAX_CASES], off[MAX_CASES];
    clear_env();
    setenv("DDP_SHM_TUNE", "off", 1);
    setenv("DDP_SHM_CMA_BYTES", "0", 1);
    ddp_group_t *g = make_group(rank, world, store, "all-on");
    run_cases(g, cases, ncases, 0, "single-copy", on);
    ddp_group_destroy(g);
    /* The last rank refuses: nobody reads anybody. */
    if (rank == world - 1) setenv("DDP_SHM_CMA", "off", 1);
    g = make_group(rank, world, store, "one-off");
    run_cases(g, cases, ncases, 0, "staged:nt", off);
    ddp_group_destroy(g);
    for (int k = 0; k < ncases; k++)
        CHECK_MSG(on[k] == off[k], "case %d: the fallback's result differs", k);
    return 0;
}

/* One alltoall case, f32 or another dtype: send and recv apart (overlap 0), one buffer
 * (overlap 1, as torch passes a tensor as both), or recv 64 bytes past send (overlap 2). Every
 * block must be the one its sender meant for this rank; returns the hash of the result. */
static uint64_t run_alltoall(ddp_group_t *g, ddp_dtype_t dt, size_t n, int overlap, int k,
                             const char *expect)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(dt), total = n * (size_t)world;
    char *mem = malloc(2 * total * es + 256), *want = malloc(total * es + 1);
    CHECK(mem && want);
    memset(mem, 0xA5, 2 * total * es + 256);
    char *send = mem, *recv = overlap == 0 ? mem + total * es + 64 : overlap == 1 ? mem : mem + 64;
    ddp_test_fill(send, dt, rank, total, k);
    CHECK_OK(ddp_group_alltoall(g, send, recv, n, dt));
    for (int i = 0; i < world; i++) {
        ddp_test_fill(want, dt, i, total, k);
        CHECK_MSG(memcmp(recv + (size_t)i * n * es, want + (size_t)rank * n * es, n * es) == 0,
                  "alltoall case %d (overlap %d, %zu elements): block from rank %d differs", k,
                  overlap, n, i);
    }
    for (size_t i = total * es; i < total * es + 64; i++)
        CHECK_MSG((unsigned char)recv[i] == 0xA5, "alltoall case %d wrote past its end", k);
    const char *ran = ddp_group_algorithm(g);
    if (world > 1 && n > 0)
        CHECK_MSG(strcmp(ran, expect) == 0, "alltoall case %d (%zu elements) ran %s, not %s", k, n,
                  ran, expect);
    uint64_t h = hash_bytes(recv, total * es);
    free(mem);
    free(want);
    return h;
}

/* One broadcast, allgather or reduce_scatter case; returns the hash of this rank's result. */
static uint64_t run_other(ddp_group_t *g, int kind, ddp_dtype_t dt, ddp_reduce_op_t op, size_t n,
                          int inplace, int root, int k, const char *expect)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(dt), total = n * (size_t)world;
    char *send = malloc(total * es + 64), *recv = malloc(total * es + 64);
    CHECK(send && recv);
    memset(recv, 0xA5, total * es + 64);
    size_t out_bytes = 0;
    const char *what = kind == 1 ? "broadcast" : kind == 2 ? "allgather" : "reduce_scatter";
    if (kind == 1) {
        ddp_test_fill(recv, dt, rank == root ? 0 : rank + 100, n, k); /* only the root's survives */
        CHECK_OK(ddp_group_broadcast(g, recv, n, dt, root));
        out_bytes = n * es;
        char *want = malloc(n * es + 1);
        ddp_test_fill(want, dt, 0, n, k);
        CHECK_MSG(memcmp(recv, want, n * es) == 0, "broadcast case %d differs from the root's", k);
        free(want);
    } else if (kind == 2) {
        char *mine = inplace ? recv + (size_t)rank * n * es : send;
        ddp_test_fill(mine, dt, rank, n, k);
        CHECK_OK(ddp_group_allgather(g, mine, recv, n, dt));
        out_bytes = total * es;
        char *want = malloc(n * es + 1);
        for (int r = 0; r < world; r++) {
            ddp_test_fill(want, dt, r, n, k);
            CHECK_MSG(memcmp(recv + (size_t)r * n * es, want, n * es) == 0,
                      "allgather case %d: block %d differs", k, r);
        }
        free(want);
    } else {
        ddp_test_fill(send, dt, rank, total, k);
        char *out = inplace ? send + (size_t)rank * n * es : recv;
        CHECK_OK(ddp_group_reduce_scatter(g, send, out, n, dt, op));
        if (inplace) memcpy(recv, out, n * es);
        out_bytes = n * es;
        if (dt == DDP_F32 && op == DDP_SUM)
            for (size_t i = 0; i < n; i++) {
                size_t at = (size_t)rank * n + i;
                float want = ddp_test_input_f32(0, at, k);
                for (int r = 1; r < world; r++) want += ddp_test_input_f32(r, at, k);
                float got = ((float *)recv)[i];
                CHECK_MSG(memcmp(&got, &want, sizeof got) == 0,
                          "reduce_scatter case %d element %zu: %.9g, want %.9g", k, i, got, want);
            }
    }
    for (size_t i = (inplace && kind == 3 ? n * es : total * es); i < total * es + 64; i++)
        if (kind != 3 || !inplace)
            CHECK_MSG((unsigned char)recv[i] == 0xA5 || i < out_bytes,
                      "%s case %d wrote past its end", what, k);
    const char *ran = ddp_group_algorithm(g);
    if (world > 1 && n > 0)
        CHECK_MSG(strcmp(ran, expect) == 0, "%s case %d (%zu elements) ran %s, not %s", what, k, n,
                  ran, expect);
    uint64_t h = hash_bytes(recv, out_bytes);
    free(send);
    free(recv);
    return h;
}

static int rank_collectives(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    static const size_t counts[] = {0, 1, 7, 4099, 65543, 300001};
    static const struct {
        ddp_dtype_t dt;
        ddp_reduce_op_t op;
    } types[3] = {{DDP_F32, DDP_SUM}, {DDP_F16, DDP_SUM}, {DDP_I32, DDP_AVG}};
    static uint64_t hashes[2][512];
    static int same_everywhere[512]; /* broadcast and allgather: every rank has the same bytes */
    static const char *const names[2] = {"rounds", "single-copy"};
    int ncases = 0;
    for (int v = 0; v < 2; v++) {
        clear_env();
        setenv("DDP_SHM_TUNE", "off", 1);
        if (v == 0) setenv("DDP_SHM_CMA", "off", 1);
        else setenv("DDP_SHM_CMA_BYTES", "0", 1);
        char name[32];
        snprintf(name, sizeof name, "others%d", v);
        ddp_group_t *g = make_group(rank, world, store, name);
        int k = 0;
        for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
            size_t n = counts[c];
            for (int root = 0; root < world; root += world > 1 ? world - 1 : 1, k++) {
                hashes[v][k] = run_other(g, 1, DDP_F32, DDP_SUM, n, 0, root, k, names[v]);
                same_everywhere[k] = 1;
            }
            for (int inplace = 0; inplace < 2; inplace++, k++) {
                hashes[v][k] = run_other(g, 2, DDP_F32, DDP_SUM, n, inplace, 0, k, names[v]);
                same_everywhere[k] = 1;
            }
            for (int t = 0; t < 3; t++)
                for (int inplace = 0; inplace < 2; inplace++, k++)
                    hashes[v][k] = run_other(g, 3, types[t].dt, types[t].op, n, inplace, 0, k,
                                             names[v]);
            for (int overlap = 0; overlap < 3; overlap++, k++)
                hashes[v][k] = run_alltoall(g, overlap == 2 ? DDP_F16 : DDP_F32, n, overlap, k,
                                            names[v]);
        }
        for (int i = 0; i < k; i++)
            if (same_everywhere[i]) check_same_everywhere(g, hashes[v][i], "the result", i);
        ncases = k;
        ddp_group_destroy(g);
    }
    for (int i = 0; i < ncases; i++)
        CHECK_MSG(hashes[0][i] == hashes[1][i], "case %d: single copy differs from rounds", i);
    return 0;
}

static int variant_index(const char *name)
{
    /* In ddp__shm_variant_t's order (4 is broadcast's "rounds"). */
    static const char *const names[] = {"staged:nt",   "staged:plain", "one-shot",
                                        "single-copy", "rounds",       "staged:nt:short",
                                        "staged:plain:long"};
    for (int v = 0; v < 7; v++)
        if (!strcmp(name, names[v])) return v;
    return -1;
}

static int rank_agree(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    clear_env();
    setenv("DDP_SHM_TUNE", "online", 1);
    /* Rank r's clock says variant r % 4 is a million times faster than the others (no load
     * on a shared machine jitters by that much). */
    double skew[4] = {1, 1, 1, 1};
    for (int v = 0; v < 4; v++) skew[v] = v == rank % 4 ? 1e-6 : 1.0;
    ddp__shm_set_tune_skew(skew, 4);
    ddp_group_t *g = make_group(rank, world, store, "agree");
    /* 64 KiB: staged nt/plain and one-shot are candidates (rank 0 favours staged:nt); 1 MiB:
     * staged nt/plain and single copy. */
    static const size_t counts[2] = {16384, 262144};
    float *buf = malloc(counts[1] * sizeof(float));
    CHECK(buf);
    for (int s = 0; s < 2; s++) {
        int last = -1;
        for (int call = 0; call < 80; call++) {
            for (size_t i = 0; i < counts[s]; i++) buf[i] = ddp_test_input_f32(rank, i, call);
            CHECK_OK(ddp_group_allreduce(g, buf, buf, counts[s], DDP_F32, DDP_SUM));
            int v = variant_index(ddp_group_algorithm(g));
            CHECK_MSG(v >= 0, "unexpected algorithm %s", ddp_group_algorithm(g));
            uint64_t h = hash_bytes(buf, counts[s] * sizeof(float));
            check_same_everywhere(g, (uint64_t)v, "the variant", call);
            check_same_everywhere(g, h, "the result", call);
            if (call % 32 < 30) last = v; /* not a trial (the last 2 calls of every 32) */
        }
        /* Rank 0's favourite, staged:nt (variant 0), won everywhere. */
        CHECK_MSG(world == 1 || last == 0, "size %zu: after the probe ran variant %d, not 0",
                  counts[s], last);
    }
    free(buf);
    ddp_group_destroy(g);
    return 0;
}

/* With tuning on, a staged knob set explicitly bounds what the tuner tries: every call of a
 * 2 MiB allreduce (longer than the short round, so both round sizes are candidates otherwise)
 * runs one of the allowed variants, each of them runs during the probe, and the results are the
 * same bytes on every rank. */
static int rank_knobs(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    static const struct {
        const char *stores, *rounds; /* NULL: unset */
        const char *allowed[2];
    } knobs[] = {
        {NULL, "short", {"staged:nt:short", "staged:plain"}},
        {NULL, "long", {"staged:nt", "staged:plain:long"}},
        {"plain", NULL, {"staged:plain", "staged:plain:long"}},
        {"nt", NULL, {"staged:nt", "staged:nt:short"}},
    };
    const size_t count = (size_t)1 << 19; /* 2 MiB of f32 */
    float *buf = malloc(count * sizeof(float));
    CHECK(buf);
    for (size_t k = 0; k < sizeof knobs / sizeof *knobs; k++) {
        clear_env();
        setenv("DDP_SHM_TUNE", "online", 1);
        setenv("DDP_SHM_CMA", "off", 1);
        if (knobs[k].stores) setenv("DDP_SHM_STAGED_STORES", knobs[k].stores, 1);
        if (knobs[k].rounds) setenv("DDP_SHM_STAGED_ROUNDS", knobs[k].rounds, 1);
        char name[32];
        snprintf(name, sizeof name, "knobs%zu", k);
        ddp_group_t *g = make_group(rank, world, store, name);
        int seen[2] = {0, 0};
        for (int call = 0; call < 40; call++) {
            for (size_t i = 0; i < count; i++) buf[i] = ddp_test_input_f32(rank, i, call);
            CHECK_OK(ddp_group_allreduce(g, buf, buf, count, DDP_F32, DDP_SUM));
            const char *ran = ddp_group_algorithm(g);
            int which = !strcmp(ran, knobs[k].allowed[0]) ? 0
                        : !strcmp(ran, knobs[k].allowed[1]) ? 1
                                                            : -1;
            CHECK_MSG(world == 1 || which >= 0, "knobs %zu, call %d ran %s, not %s or %s", k, call,
                      ran, knobs[k].allowed[0], knobs[k].allowed[1]);
            if (which >= 0) seen[which] = 1;
            check_same_everywhere(g, hash_bytes(buf, count * sizeof(float)), "the result", call);
        }
        CHECK_MSG(world == 1 || (seen[0] && seen[1]), "knobs %zu: the probe did not try both", k);
        ddp_group_destroy(g);
    }
    free(buf);
    return 0;
}

static const char *trace_dir;

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    CHECK_MSG(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    CHECK(text && fread(text, 1, (size_t)n, f) == (size_t)n);
    text[n] = 0;
    fclose(f);
    return text;
}

static int rank_trace(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    clear_env();
    setenv("DDP_SHM_TUNE", "online", 1);
    /* Rank 0's clock says staged:plain is a million times faster: the probe ends with rank 0
     * publishing it, which replaces the default (staged:nt), a decision every rank applies. */
    double skew[2] = {1.0, rank == 0 ? 1e-6 : 1.0};
    ddp__shm_set_tune_skew(skew, 2);
    char path[700], log_path[700];
    snprintf(path, sizeof path, "%s/shm-tune.rank%d.json", trace_dir, rank);
    snprintf(log_path, sizeof log_path, "%s/log.rank%d.txt", trace_dir, rank);
    /* The log goes to stderr: catch it in a file while the collectives run. */
    fflush(stderr);
    int saved_stderr = dup(2);
    FILE *log = fopen(log_path, "w");
    CHECK(saved_stderr >= 0 && log && dup2(fileno(log), 2) == 2);
    ddp_trace_t *trace = NULL;
    CHECK_OK(ddp_trace_open(path, rank, &trace));
    ddp_group_t *g = make_group(rank, world, store, "trace");
    CHECK(ddp_group_trace(g) == NULL);
    ddp_group_set_trace(g, trace);
    CHECK(ddp_group_trace(g) == trace);
    const size_t count = 16384; /* 64 KiB: staged nt/plain and one-shot are candidates */
    float *buf = malloc(count * sizeof(float));
    CHECK(buf);
    for (int call = 0; call < 20; call++) {
        for (size_t i = 0; i < count; i++) buf[i] = ddp_test_input_f32(rank, i, call);
        CHECK_OK(ddp_group_allreduce(g, buf, buf, count, DDP_F32, DDP_SUM));
    }
    if (world > 1)
        CHECK_MSG(!strcmp(ddp_group_algorithm(g), "staged:plain"), "ran %s, not staged:plain",
                  ddp_group_algorithm(g));
    ddp_group_set_trace(g, NULL);

    /* A Reducer with config.trace gives it to the group (for the transport's events) while it
     * lives, and takes it back when destroyed. */
    float weights[5] = {1, 2, 3, 4, 5};
    ddp_param_t param = {.name = "w", .data = weights, .numel = 5, .dtype = DDP_F32};
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    config.trace = trace;
    ddp_reducer_t *reducer = NULL;
    CHECK_OK(ddp_reducer_create(g, &param, 1, NULL, 0, &config, &reducer));
    CHECK(ddp_group_trace(g) == trace);
    ddp_reducer_destroy(reducer);
    CHECK(ddp_group_trace(g) == NULL);
    ddp_group_destroy(g);
    CHECK_OK(ddp_trace_close(trace));
    fflush(stderr);
    CHECK(dup2(saved_stderr, 2) == 2);
    close(saved_stderr);
    fclose(log);

    char *text = read_text(path);
    if (world > 1) {
        const char *event = strstr(text, "\"shm tune: allreduce [64 KiB, 128 KiB): staged:plain\"");
        CHECK_MSG(event, "no tuner decision in %s:\n%s", path, text);
        CHECK(strstr(event, "\"cat\":\"tune\",\"ph\":\"i\""));
        CHECK(strstr(event, "\"replaces\":\"the default\""));
        /* Rank 0's event carries the estimates that decided. */
        CHECK((strstr(event, "\"ns per byte on rank 0\"") != NULL) == (rank == 0));
    } else {
        CHECK_MSG(!strstr(text, "shm tune"), "world 1 has nothing to tune, yet:\n%s", text);
    }
    free(text);
    text = read_text(log_path);
    if (world > 1 && rank == 0)
        CHECK_MSG(strstr(text, "[libddp info] shm tune: allreduce 65536-131071 bytes: "
                               "staged:plain"),
                  "rank 0's log at info has no decision:\n%s", text);
    else
        CHECK_MSG(!strstr(text, "shm tune"), "rank %d logged a decision:\n%s", rank, text);
    free(text);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    mode = argc > 2 ? argv[2] : "variants";
    setenv("DDP_TRANSPORT", "auto", 1);
    ddp_test_rank_fn fn = !strcmp(mode, "variants")   ? rank_variants
                          : !strcmp(mode, "fallback") ? rank_fallback
                          : !strcmp(mode, "agree")    ? rank_agree
                          : !strcmp(mode, "collectives") ? rank_collectives
                          : !strcmp(mode, "trace")    ? rank_trace
                          : !strcmp(mode, "knobs")    ? rank_knobs
                                                      : NULL;
    if (!fn) {
        fprintf(stderr,
                "usage: test_shm_tune <world> variants|fallback|collectives|agree|trace|knobs [DIR]\n");
        return 2;
    }
    trace_dir = argc > 3 ? argv[3] : ddp_test_tmpdir();
    CHECK(trace_dir);
    return ddp_test_run_ranks(world, 300, fn, NULL);
}
