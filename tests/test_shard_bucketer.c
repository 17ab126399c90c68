/* ReduceScatterBucketer: shards equal a direct reduce-scatter of the same inputs (bitwise: values
 * are small integers or eighths, exact in any summation order), callbacks run only once their
 * bucket was reduced (never before a flush or a fuller input forced it out), inputs larger than a
 * bucket's block go out on their own, teardown frees memory (refused while inputs wait), setup
 * re-creates it, and a cap of 0 sends every input directly.
 *
 * usage: test_shard_bucketer args | WORLD */
#include <stdint.h>
#include <string.h>

#include "harness.h"

#define MAX_INPUTS 64

typedef struct result {
    int ran;
    size_t count;
    unsigned char *shard; /* copy of what the callback received */
} result_t;

typedef struct ctx {
    result_t results[MAX_INPUTS];
    int calls;
} ctx_t;

typedef struct cb_arg {
    ctx_t *ctx;
    int index;
    size_t esize;
} cb_arg_t;

static void on_shard(void *arg, const void *shard, size_t count)
{
    cb_arg_t *a = arg;
    result_t *r = &a->ctx->results[a->index];
    CHECK(!r->ran);
    r->ran = 1;
    r->count = count;
    a->ctx->calls++;
    if (count) {
        r->shard = malloc(count * a->esize);
        memcpy(r->shard, shard, count * a->esize);
    }
}

/* Element e of rank `rank`'s input number k (world * count elements), as a double. */
static double value(int rank, int k, size_t e)
{
    long v = (long)((rank + 1) * 7 + k * 13 + (long)(e % 101) * 3) % 61 - 30;
    return (double)v / 8.0;
}

static void fill(ddp_dtype_t dt, void *buf, int rank, int k, size_t n)
{
    for (size_t e = 0; e < n; e++) {
        double v = value(rank, k, e);
        switch (dt) {
        case DDP_F32: ((float *)buf)[e] = (float)v; break;
        case DDP_F64: ((double *)buf)[e] = v; break;
        case DDP_I32: ((int32_t *)buf)[e] = (int32_t)(v * 8); break;
        default: CHECK(0);
        }
    }
}

typedef struct input {
    size_t count;
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    int as_blocks;
} input_t;

/* Submits every input through the bucketer (contiguous or as block pointers), flushes, and
 * compares each shard with ddp_group_reduce_scatter of the same data. */
static void run_inputs(ddp_group_t *g, ddp_rs_bucketer_t *b, const input_t *in, int n,
                       ctx_t *ctx)
{
    int world = ddp_group_size(g), rank = ddp_group_rank(g);
    cb_arg_t args[MAX_INPUTS];
    void *data[MAX_INPUTS];
    memset(ctx, 0, sizeof *ctx);
    for (int k = 0; k < n; k++) {
        size_t es = ddp_dtype_size(in[k].dtype);
        data[k] = calloc((size_t)world * in[k].count + 1, es);
        fill(in[k].dtype, data[k], rank, k, (size_t)world * in[k].count);
        args[k] = (cb_arg_t){ctx, k, es};
        if (in[k].as_blocks) {
            const void *blocks[8];
            for (int r = 0; r < world; r++)
                blocks[r] = (unsigned char *)data[k] + (size_t)r * in[k].count * es;
            CHECK_OK(ddp_rs_bucketer_reduce_scatter_blocks_async(
                b, g, blocks, in[k].count, in[k].dtype, in[k].op, on_shard, &args[k]));
            /* Block inputs are copied at the call: scribbling now must not change the result. */
            memset(data[k], 0x5a, (size_t)world * in[k].count * es);
        } else {
            CHECK_OK(ddp_rs_bucketer_reduce_scatter_async(b, g, data[k], in[k].count,
                                                          in[k].dtype, in[k].op, on_shard,
                                                          &args[k]));
        }
    }
    CHECK_OK(ddp_rs_bucketer_flush(b));
    CHECK(ctx->calls == n);
    for (int k = 0; k < n; k++) {
        size_t es = ddp_dtype_size(in[k].dtype), c = in[k].count;
        CHECK(ctx->results[k].ran && ctx->results[k].count == c);
        fill(in[k].dtype, data[k], rank, k, (size_t)world * c);
        void *want = calloc(c + 1, es);
        CHECK_OK(ddp_group_reduce_scatter(g, data[k], want, c, in[k].dtype, in[k].op));
        CHECK_MSG(c == 0 || memcmp(want, ctx->results[k].shard, c * es) == 0,
                  "input %d (%zu %s elements per rank) differs from a direct reduce-scatter", k,
                  c, ddp_dtype_name(in[k].dtype));
        /* And from the exact value computed locally (sum or max over ranks). */
        for (size_t e = 0; e < c && in[k].dtype == DDP_F64; e++) {
            double acc = in[k].op == DDP_MAX ? -1e300 : 0.0;
            for (int r = 0; r < world; r++) {
                double v = value(r, k, (size_t)rank * c + e);
                acc = in[k].op == DDP_MAX ? (v > acc ? v : acc) : acc + v;
            }
            CHECK(((double *)ctx->results[k].shard)[e] == acc);
        }
        free(want);
        free(ctx->results[k].shard);
        free(data[k]);
    }
}

static int rank_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    int world = ddp_group_size(g);
    ctx_t *ctx = calloc(1, sizeof *ctx);

    /* 1. Equality over a mix of sizes (0, 1, odd, prime, large), dtypes, ops and both input
     * forms; a block of 64 f64 / 128 f32 elements per rank so some inputs are direct. */
    {
        size_t cap = (size_t)world * 64 * 8;
        ddp_rs_bucketer_t *b;
        CHECK_OK(ddp_rs_bucketer_create(cap, &b));
        input_t in[] = {
            {0, DDP_F32, DDP_SUM, 0},    {1, DDP_F32, DDP_SUM, 0},   {7, DDP_F32, DDP_SUM, 1},
            {13, DDP_F64, DDP_SUM, 0},   {97, DDP_F32, DDP_SUM, 0},  {31, DDP_F64, DDP_MAX, 0},
            {64, DDP_F64, DDP_SUM, 0},   {1, DDP_F64, DDP_SUM, 1},   {5, DDP_I32, DDP_SUM, 0},
            {1009, DDP_F64, DDP_SUM, 1}, {3, DDP_F32, DDP_SUM, 0},   {65, DDP_F64, DDP_SUM, 0},
            {127, DDP_F32, DDP_SUM, 1},  {129, DDP_F32, DDP_SUM, 0}, {100003, DDP_F32, DDP_SUM, 0},
            {11, DDP_I32, DDP_MAX, 1},   {2, DDP_F64, DDP_SUM, 0},
        };
        int n = (int)(sizeof in / sizeof in[0]);
        run_inputs(g, b, in, n, ctx);
        uint64_t flushes = 0, direct = 0;
        CHECK_OK(ddp_rs_bucketer_counts(b, &flushes, &direct));
        /* Blocks hold 128 f32/i32 or 64 f64 elements: 1009 and 65 (f64), 129 and 100003 (f32)
         * are direct; 64 f64 and 127 f32 just fit. */
        CHECK_MSG(direct == 4, "direct = %llu, expected 4", (unsigned long long)direct);
        CHECK(flushes >= 4); /* f32/sum, f64/sum, f64/max, i32/sum, i32/max buckets at least */
        ddp_rs_bucketer_destroy(b);
    }

    /* 2. Callbacks only after the reduction: small inputs wait in the bucket (no callback even
     * after a barrier); an input that does not fit issues the bucket; flush runs the rest. */
    {
        ddp_rs_bucketer_t *b;
        CHECK_OK(ddp_rs_bucketer_create((size_t)world * 100 * sizeof(float), &b));
        float *in = calloc((size_t)world * 100, sizeof(float));
        cb_arg_t args[4];
        memset(ctx, 0, sizeof *ctx);
        for (int k = 0; k < 4; k++) args[k] = (cb_arg_t){ctx, k, sizeof(float)};
        fill(DDP_F32, in, ddp_group_rank(g), 0, (size_t)world * 100);
        CHECK_OK(ddp_rs_bucketer_reduce_scatter_async(b, g, in, 40, DDP_F32, DDP_SUM, on_shard,
                                                      &args[0]));
        CHECK_OK(ddp_rs_bucketer_reduce_scatter_async(b, g, in, 30, DDP_F32, DDP_SUM, on_shard,
                                                      &args[1]));
        CHECK_OK(ddp_group_barrier(g));
        uint64_t flushes = 9, direct = 9;
        CHECK_OK(ddp_rs_bucketer_counts(b, &flushes, &direct));
        CHECK(flushes == 0 && direct == 0 && ctx->calls == 0);
        /* 40 + 30 + 31 > 100: the bucket goes out before the third input is packed. */
        CHECK_OK(ddp_rs_bucketer_reduce_scatter_async(b, g, in, 31, DDP_F32, DDP_SUM, on_shard,
                                                      &args[2]));
        CHECK_OK(ddp_rs_bucketer_counts(b, &flushes, &direct));
        CHECK(flushes == 1 && direct == 0);
        CHECK(!ctx->results[2].ran); /* still in the bucket */
        /* Teardown with an input waiting is refused and says what to do. */
        CHECK_STATUS(ddp_rs_bucketer_teardown(b), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("flush");
        CHECK_OK(ddp_rs_bucketer_flush(b));
        CHECK(ctx->calls == 3 && ctx->results[0].ran && ctx->results[1].ran &&
              ctx->results[2].ran);
        CHECK_OK(ddp_rs_bucketer_counts(b, &flushes, &direct));
        CHECK(flushes == 2 && direct == 0);
        for (int k = 0; k < 3; k++) free(ctx->results[k].shard);

        /* 3. Teardown frees everything, setup re-creates the bucket, use after teardown works. */
        CHECK(ddp_rs_bucketer_memory_bytes(b) > 0);
        CHECK_OK(ddp_rs_bucketer_teardown(b));
        CHECK(ddp_rs_bucketer_memory_bytes(b) == 0);
        CHECK_OK(ddp_rs_bucketer_setup(b));
        CHECK_MSG(ddp_rs_bucketer_memory_bytes(b) == ((size_t)world + 1) * 100 * sizeof(float),
                  "memory %zu after setup", ddp_rs_bucketer_memory_bytes(b));
        CHECK_OK(ddp_rs_bucketer_teardown(b));
        CHECK(ddp_rs_bucketer_memory_bytes(b) == 0);
        input_t again[] = {{5, DDP_F32, DDP_SUM, 0}, {17, DDP_F32, DDP_SUM, 1}};
        run_inputs(g, b, again, 2, ctx); /* re-created on demand */
        CHECK(ddp_rs_bucketer_memory_bytes(b) > 0);
        free(in);
        ddp_rs_bucketer_destroy(b);
    }

    /* 4. cap 0: every input (but count 0) is reduce-scattered on its own; results still equal. */
    {
        ddp_rs_bucketer_t *b;
        CHECK_OK(ddp_rs_bucketer_create(0, &b));
        input_t in[] = {{1, DDP_F32, DDP_SUM, 0}, {0, DDP_F32, DDP_SUM, 0},
                        {3, DDP_F64, DDP_SUM, 1}, {257, DDP_F32, DDP_SUM, 0}};
        run_inputs(g, b, in, 4, ctx);
        uint64_t flushes = 9, direct = 0;
        CHECK_OK(ddp_rs_bucketer_counts(b, &flushes, &direct));
        CHECK(flushes == 0 && direct == 3);
        /* Direct buffers are kept for reuse (memory stays > 0 after the flush) and the pool is
         * bounded: at most 4 kept flights, each at most the largest input's output and block
         * copy (x2 for growth rounding), however many times the inputs come back. How many
         * flights a run needs depends on whether earlier reductions finished before later
         * inputs arrived, so the exact figure may differ between runs; the bound may not. */
        CHECK(ddp_rs_bucketer_memory_bytes(b) > 0);
        size_t largest = 257 * sizeof(float);
        size_t bound = 4 * 2 * (largest + (size_t)ddp_group_size(g) * largest);
        for (int again = 0; again < 20; again++) run_inputs(g, b, in, 4, ctx);
        CHECK(ddp_rs_bucketer_memory_bytes(b) > 0);
        CHECK_MSG(ddp_rs_bucketer_memory_bytes(b) <= bound,
                  "direct buffers kept %zu bytes, more than the bound %zu",
                  ddp_rs_bucketer_memory_bytes(b), bound);
        CHECK_OK(ddp_rs_bucketer_teardown(b));
        CHECK(ddp_rs_bucketer_memory_bytes(b) == 0);
        ddp_rs_bucketer_destroy(b);
    }
    free(ctx);
    return 0;
}

static int args_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    ddp_rs_bucketer_t *b = NULL;
    float x[4] = {0};
    CHECK_STATUS(ddp_rs_bucketer_create(64, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_rs_bucketer_create(64, &b));
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_async(NULL, g, x, 1, DDP_F32, DDP_SUM, NULL,
                                                      NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("bucketer");
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_async(b, NULL, x, 1, DDP_F32, DDP_SUM, NULL,
                                                      NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_async(b, g, NULL, 1, DDP_F32, DDP_SUM, NULL,
                                                      NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("input");
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_async(b, g, x, 1, (ddp_dtype_t)99, DDP_SUM,
                                                      NULL, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("dtype");
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_async(b, g, x, 1, DDP_F32, (ddp_reduce_op_t)77,
                                                      NULL, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("op");
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_blocks_async(b, g, NULL, 1, DDP_F32, DDP_SUM,
                                                             NULL, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("blocks");
    const void *blocks[1] = {NULL};
    CHECK_STATUS(ddp_rs_bucketer_reduce_scatter_blocks_async(b, g, blocks, 1, DDP_F32, DDP_SUM,
                                                             NULL, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("blocks[0]");
    CHECK_STATUS(ddp_rs_bucketer_flush(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_rs_bucketer_teardown(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_rs_bucketer_setup(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK(ddp_rs_bucketer_memory_bytes(NULL) == 0);
    /* A NULL callback is allowed. */
    CHECK_OK(ddp_rs_bucketer_reduce_scatter_async(b, g, x, 2, DDP_F32, DDP_SUM, NULL, NULL));
    CHECK_OK(ddp_rs_bucketer_flush(b));
    ddp_rs_bucketer_destroy(b);
    ddp_rs_bucketer_destroy(NULL);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s args | WORLD\n", argv[0]);
        return 2;
    }
    if (strcmp(argv[1], "args") == 0) return ddp_test_run_group(1, 60, NULL, args_main, NULL);
    int world = atoi(argv[1]);
    CHECK(world >= 1 && world <= 8);
    return ddp_test_run_group(world, 120, NULL, rank_main, NULL);
}
