/* A trainer laid out like llm.c's train_gpt2.c, over real rank processes: one parameter block and
 * one gradient block, each kind of weight of all L layers stacked in one (L, ...) tensor, and a
 * backward from the last layer down that reports each layer's rows of every stacked tensor with
 * ddp_reducer_grad_ready_rows. After the bucket rebuild the reductions must start as the layers'
 * rows become final, spread over backward, whatever the bucket limits and whatever order a
 * layer's rows are marked in; the results equal a float64 reference computed in one process and
 * are bitwise identical on every rank.
 *
 * What is asserted is structure, never time: ddp_reducer_stats's reductions say how many
 * grad_ready calls had been made when each one was launched, so "launched while layer l was
 * being reported" is a count, the same on any machine however loaded.
 *
 * usage: test_reducer_stacked CASE WORLD
 *   scaled     bucket limits scaled to this small model as llm.c's GPT-2 is to 1 MiB / 25 MiB
 *              (the first bucket holds layer 0's rows of the last stacked tensors), a layer's
 *              rows marked in backward order (fcproj first)
 *   blockorder the same limits, a layer's rows marked in backward order, then in block order (ln1
 *              first) by a second reducer: the same overlap and the same buckets
 *   default    the default limits (one bucket here), backward order, the block from
 *              ddp_group_alloc_buffer */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"

#define L 4   /* layers */
#define C 32  /* channels */
#define V 50  /* vocabulary */
#define T 16  /* positions */
#define NP 16 /* tensors, in llm.c's order */

enum { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW,
       FCPROJB, LNFW, LNFB };
static const char *pname[NP] = {"wte",  "wpe",      "ln1w",     "ln1b", "qkvw", "qkvb",
                                "attprojw", "attprojb", "ln2w", "ln2b", "fcw",  "fcb",
                                "fcprojw",  "fcprojb",  "lnfw", "lnfb"};
/* Elements of each tensor, and the rows of its matrix view (a stacked tensor's rows are its
 * layers' rows one after the other, so layer l's rows are [l * rows / L, (l + 1) * rows / L)). */
static const size_t pnumel[NP] = {V * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C,
                                  L * C * C, L * C, L * C, L * C, L * 4 * C * C, L * 4 * C,
                                  L * C * 4 * C, L * C, C, C};
static const size_t prows[NP] = {V, T, L, L, L * 3 * C, L, L * C, L, L, L, L * 4 * C, L,
                                 L * C, L, 0, 0};
static const int stacked[NP] = {0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
/* llm.c's backward within a layer: the MLP's projection first, the first layernorm last. */
static const int backward_order[12] = {FCPROJW, FCPROJB, FCW,  FCB,  LN2W, LN2B,
                                       ATTPROJW, ATTPROJB, QKVW, QKVB, LN1W, LN1B};
static const int block_order[12] = {LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB,
                                    LN2W, LN2B, FCW,  FCB,  FCPROJW,  FCPROJB};

typedef struct test_case {
    const char *name;
    int scaled, in_block_order, group_block;
} test_case_t;

static double gval(size_t i, int rank, int step, size_t e)
{
    return sin(0.37 * (double)e + 1.3 * (double)i + 0.71 * rank + 2.1 * step) / 3.0;
}

/* "Compute" layer l's gradient of tensor i (its rows, or the whole tensor when not stacked)
 * into the block. */
static void produce(float *g, size_t i, int layer, int rank, int step)
{
    size_t lo = 0, hi = pnumel[i];
    if (stacked[i]) {
        lo = pnumel[i] / L * (size_t)layer;
        hi = lo + pnumel[i] / L;
    }
    for (size_t e = lo; e < hi; e++) g[e] += (float)gval(i, rank, step, e);
}

/* The bucket layout: per bucket, its parameter count and parameters. */
typedef struct layout {
    size_t n, v[2 * NP + 1];
} layout_t;

/* Trains 4 steps marking each layer's rows in `order`; returns the layout after the rebuild. */
static void train(ddp_group_t *group, const test_case_t *tc, const int *order, layout_t *layout)
{
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    size_t off[NP + 1];
    off[0] = 0;
    for (size_t i = 0; i < NP; i++) off[i + 1] = off[i] + pnumel[i];
    size_t total = off[NP], bytes = total * sizeof(float);
    float *params = calloc(total, sizeof(float));
    float *block = NULL;
    if (tc->group_block) CHECK_OK(ddp_group_alloc_buffer(group, bytes, (void **)&block));
    else block = malloc(bytes);
    float *copy = malloc(bytes);
    CHECK(params && block && copy);
    memset(block, 0, bytes);
    ddp_param_t p[NP];
    for (size_t i = 0; i < NP; i++)
        p[i] = (ddp_param_t){pname[i], params + off[i], pnumel[i], DDP_F32, prows[i], 0,
                             block + off[i]};
    ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;
    c.grad_memory = DDP_GRAD_MEMORY_USER_BLOCK;
    c.grad_block = block;
    c.grad_block_bytes = bytes;
    c.piece_bytes = 16 << 10; /* a layer's rows of qkvw: 12 KiB; of fcw: 16 KiB */
    if (tc->scaled) {
        /* GPT-2 124M's gradients are ~475 MiB: 1 MiB is 1/475 of them, 25 MiB 1/19. */
        c.first_bucket_bytes = bytes / 475;
        c.bucket_cap_bytes = bytes / 19;
    }
    ddp_reducer_t *r = NULL;
    CHECK_OK(ddp_reducer_create(group, p, NP, NULL, 0, &c, &r));
    /* On shared memory the Reducer registered the malloc'd block for its life (one registration
     * maps every bucket and piece in place): the caller's own registration now overlaps it. */
    if (!tc->group_block && world > 1) {
        CHECK_STATUS(ddp_group_register_memory(group, block, bytes), DDP_ERR_INVALID_ARGUMENT);
        CHECK_ERROR_MENTIONS("overlap");
    }
    /* Calls made before layer 0's rows are reported: lnf's two, then 12 per layer. */
    const size_t before_layer0 = 2 + 12 * (L - 1);
    double early_before_rebuild = -1;
    for (int s = 0; s < 4; s++) {
        CHECK_OK(ddp_reducer_prepare(r));
        produce(block + off[LNFB], LNFB, 0, rank, s);
        CHECK_OK(ddp_reducer_grad_ready(r, LNFB));
        produce(block + off[LNFW], LNFW, 0, rank, s);
        CHECK_OK(ddp_reducer_grad_ready(r, LNFW));
        for (int l = L - 1; l >= 0; l--) {
            for (int j = 0; j < 12; j++) {
                size_t i = (size_t)order[j];
                produce(block + off[i], i, l, rank, s);
                size_t per = prows[i] / L;
                CHECK_OK(ddp_reducer_grad_ready_rows(r, i, per * (size_t)l, per * (size_t)(l + 1)));
            }
        }
        produce(block + off[WPE], WPE, 0, rank, s);
        CHECK_OK(ddp_reducer_grad_ready(r, WPE));
        produce(block + off[WTE], WTE, 0, rank, s);
        CHECK_OK(ddp_reducer_grad_ready(r, WTE));
        CHECK_OK(ddp_reducer_finalize(r));

        /* Results: the float64 average computed in one process, to f32 rounding. */
        for (size_t i = 0; i < NP; i++)
            for (size_t e = 0; e < pnumel[i]; e++) {
                double want = 0;
                for (int q = 0; q < world; q++) want += gval(i, q, s, e);
                want /= world;
                CHECK_MSG(fabs(block[off[i] + e] - want) <= 2e-6,
                          "step %d: %s[%zu] = %.9g, want %.9g", s, pname[i], e, block[off[i] + e],
                          want);
            }
        /* Bitwise identical on every rank. */
        memcpy(copy, block, bytes);
        CHECK_OK(ddp_group_broadcast(group, copy, total, DDP_F32, 0));
        CHECK_MSG(memcmp(copy, block, bytes) == 0,
                  "step %d: rank %d's gradients differ from rank 0's", s, rank);

        ddp_reducer_stats_t st;
        CHECK_OK(ddp_reducer_stats(r, &st));
        CHECK(st.reductions != NULL && st.npieces > 0);
        size_t sum = 0, early = 0, last_calls = 0;
        int launched_in_layer[L] = {0};
        for (size_t k = 0; k < st.npieces; k++) {
            const ddp_reduction_stats_t *x = &st.reductions[k];
            CHECK_MSG(x->ready_calls >= last_calls, "step %d: reductions out of launch order", s);
            CHECK(x->launch_us <= x->done_us);
            last_calls = x->ready_calls;
            sum += x->bytes;
            if (x->ready_calls <= before_layer0) early += x->bytes;
            /* Layer l is reported by calls (2 + 12 (L-1-l), 2 + 12 (L-l)]. */
            if (x->ready_calls > 2 && x->ready_calls <= before_layer0 + 12) {
                size_t j = (x->ready_calls - 3) / 12;
                launched_in_layer[L - 1 - j] = 1;
            }
        }
        CHECK_MSG(sum == bytes, "step %d: reductions cover %zu of %zu bytes", s, sum, bytes);
        /* Every tensor is reported before finalize: finalize launches nothing. */
        CHECK_MSG(st.bytes_launched_in_backward == bytes, "step %d: %zu of %zu bytes launched in "
                  "backward", s, st.bytes_launched_in_backward, bytes);
        double fraction = (double)early / (double)bytes;
        if (rank == 0)
            printf("%s, %s order, step %d: %zu buckets, %zu reductions, %.1f %% of the bytes "
                   "launched before layer 0's rows\n",
                   tc->name, order == block_order ? "block" : "backward", s, st.nbuckets,
                   st.npieces, 100 * fraction);
        CHECK_OK(ddp_reducer_zero_grad(r));
        if (s == 0) {
            early_before_rebuild = fraction;
            continue;
        }
        /* After the rebuild: layers L-1 .. 1 hold 3/4 of the stacked matrices' bytes, and
         * their rows are launched while the layers below are still being reported. */
        CHECK_MSG(fraction >= 0.6, "step %d: only %.1f %% of the bytes were launched before "
                  "layer 0's rows were reported", s, 100 * fraction);
        for (int l = L - 1; l >= 1; l--)
            CHECK_MSG(launched_in_layer[l], "step %d: nothing was launched while layer %d's rows "
                      "were reported", s, l);
        if (tc->scaled)
            CHECK_MSG(fraction > early_before_rebuild, "step %d: %.1f %% launched before layer "
                      "0, not more than before the rebuild (%.1f %%)", s, 100 * fraction,
                      100 * early_before_rebuild);
    }
    layout->n = 0;
    for (size_t k = 0; k < ddp_reducer_bucket_count(r); k++) {
        const size_t *ps;
        size_t np;
        CHECK_OK(ddp_reducer_bucket_params(r, k, &ps, &np));
        layout->v[layout->n++] = np;
        for (size_t j = 0; j < np; j++) layout->v[layout->n++] = ps[j];
    }
    ddp_reducer_destroy(r);
    if (!tc->group_block && world > 1) { /* destroy gave the registration back */
        CHECK_OK(ddp_group_register_memory(group, block, bytes));
        CHECK_OK(ddp_group_unregister_memory(group, block));
    }
    if (tc->group_block) ddp_group_free_buffer(group, block);
    else free(block);
    free(params);
    free(copy);
}

static int run(ddp_group_t *group, void *arg)
{
    const test_case_t *tc = arg;
    layout_t backward, block;
    train(group, tc, backward_order, &backward);
    if (!tc->in_block_order) return 0;
    /* The order a layer's rows are marked in does not decide the buckets either: the same
     * layout (runs of the block in address order) for both. */
    train(group, tc, block_order, &block);
    CHECK_MSG(backward.n == block.n &&
                  memcmp(backward.v, block.v, backward.n * sizeof(size_t)) == 0,
              "marking a layer in block order gave other buckets than in backward order");
    return 0;
}

int main(int argc, char **argv)
{
    static const test_case_t cases[] = {{"scaled", 1, 0, 0},
                                        {"blockorder", 1, 1, 0},
                                        {"default", 0, 0, 1}};
    if (argc != 3) {
        fprintf(stderr, "usage: %s scaled|blockorder|default WORLD\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (strcmp(argv[1], cases[i].name) == 0)
            return ddp_test_run_group(atoi(argv[2]), 120, NULL, run, (void *)&cases[i]);
    fprintf(stderr, "unknown case %s\n", argv[1]);
    return 2;
}
