/* Optimizer state save/load: a run interrupted after K steps and resumed from its saved state ends
 * bitwise equal to an uninterrupted one, with AdamW + amsgrad, two parameter groups, a warmup +
 * cosine schedule, clipping, and an f32 and a bf16 parameter (its master copy travels in the
 * state). Plain optimizer, and ZeRO stage 1/2 at worlds 1-3: resumed from each rank's shard, and
 * from a consolidated state (gathered on a non-zero root and broadcast); the consolidated state
 * equals the plain optimizer's byte for byte. Damaged or mismatching states are refused, naming
 * what is wrong.
 *
 *   test_optim_state plain
 *   test_optim_state zero STAGE WORLD */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ddp/shard.h"
#include "harness.h"

#define NPARAMS 3
#define STEPS 8
#define SPLIT 4

static const size_t numel[NPARAMS] = {37, 35, 7};
static const ddp_dtype_t dtypes[NPARAMS] = {DDP_F32, DDP_BF16, DDP_F32};
static const uint32_t param_groups[NPARAMS] = {0, 0, 1};
static const ddp_optim_group_t groups[2] = {{0.01, 0.1}, {0.02, 0.0}};

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Gradients are multiples of 1/256 in [-1, 1]: exact in bf16, and their average over up to 3
 * ranks holding the same value is exact, so ZeRO-2's averaged gradient is the plain one's. */
static float grad_value(int step, size_t i, size_t k)
{
    return (float)((int)(mix((uint64_t)step * 1000003u + i * 10007u + k) % 513) - 256) / 256.0f;
}

typedef struct model {
    void *data[NPARAMS];
    void *grad[NPARAMS];
    ddp_param_t params[NPARAMS];
} model_t;

static void model_init(model_t *m)
{
    for (size_t i = 0; i < NPARAMS; i++) {
        size_t es = ddp_dtype_size(dtypes[i]);
        m->data[i] = malloc(numel[i] * es);
        m->grad[i] = malloc(numel[i] * es);
        CHECK(m->data[i] && m->grad[i]);
        for (size_t k = 0; k < numel[i]; k++) {
            float v = (float)((int)(mix(i * 7919u + k) % 2001) - 1000) / 1000.0f;
            if (dtypes[i] == DDP_BF16)
                ((uint16_t *)m->data[i])[k] = ddp_f32_to_bf16(v);
            else
                ((float *)m->data[i])[k] = v;
        }
        m->params[i] = (ddp_param_t){"p", m->data[i], numel[i], dtypes[i], 0, 0, NULL};
    }
}

static void model_copy(model_t *dst, const model_t *src)
{
    for (size_t i = 0; i < NPARAMS; i++)
        memcpy(dst->data[i], src->data[i], numel[i] * ddp_dtype_size(dtypes[i]));
}

static int model_equal(const model_t *a, const model_t *b)
{
    for (size_t i = 0; i < NPARAMS; i++)
        if (memcmp(a->data[i], b->data[i], numel[i] * ddp_dtype_size(dtypes[i]))) return 0;
    return 1;
}

static void model_free(model_t *m)
{
    for (size_t i = 0; i < NPARAMS; i++) {
        free(m->data[i]);
        free(m->grad[i]);
    }
}

static void set_grads(model_t *m, int step)
{
    for (size_t i = 0; i < NPARAMS; i++)
        for (size_t k = 0; k < numel[i]; k++) {
            float g = grad_value(step, i, k);
            if (dtypes[i] == DDP_BF16)
                ((uint16_t *)m->grad[i])[k] = ddp_f32_to_bf16(g);
            else
                ((float *)m->grad[i])[k] = g;
        }
}

static ddp_optim_config_t config(void)
{
    ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
    c.kind = DDP_OPTIM_ADAMW;
    c.amsgrad = 1;
    c.max_grad_norm = 2.0; /* the gradients' norm is about 5: clipping is active */
    c.ngroups = 2;
    c.groups = groups;
    c.param_groups = param_groups;
    return c;
}

static double factor(int step) { return ddp_lr_warmup_cosine((uint64_t)step, 2, STEPS, 1.0, 0.1); }

static void plain_steps(ddp_optim_t *o, model_t *m, int from, int to)
{
    for (int s = from; s < to; s++) {
        CHECK_OK(ddp_optim_scale_lr(o, factor(s)));
        set_grads(m, s);
        CHECK_OK(ddp_optim_step(o, m->grad));
    }
}

static void *optim_blob(const ddp_optim_t *o, size_t *size)
{
    CHECK_OK(ddp_optim_state_size(o, size));
    void *b = malloc(*size);
    CHECK(b);
    CHECK_OK(ddp_optim_state_save(o, b, *size));
    return b;
}

static int run_plain(void)
{
    ddp_optim_config_t oc = config();
    model_t a, b, c;
    model_init(&a);
    model_init(&b);
    model_init(&c);
    ddp_optim_t *oa, *ob, *occ;
    CHECK_OK(ddp_optim_create(a.params, NPARAMS, &oc, &oa));
    plain_steps(oa, &a, 0, STEPS);
    size_t size_a;
    void *blob_a = optim_blob(oa, &size_a);

    CHECK_OK(ddp_optim_create(b.params, NPARAMS, &oc, &ob));
    plain_steps(ob, &b, 0, SPLIT);
    size_t size_b;
    void *blob_b = optim_blob(ob, &size_b);
    double lr_b;
    CHECK_OK(ddp_optim_get_lr(ob, 1, &lr_b));
    CHECK(!model_equal(&a, &b)); /* otherwise the comparison below proves nothing */

    /* The resumed run: the model's parameters as they were, a fresh optimizer, the state. */
    model_copy(&c, &b);
    CHECK_OK(ddp_optim_create(c.params, NPARAMS, &oc, &occ));
    CHECK_OK(ddp_optim_set_lr(occ, DDP_OPTIM_ALL_GROUPS, 0.5));
    CHECK_OK(ddp_optim_state_load(occ, blob_b, size_b));
    double lr_c;
    CHECK_OK(ddp_optim_get_lr(occ, 1, &lr_c));
    CHECK_MSG(lr_c == lr_b, "group 1's lr after load is %g, saved %g", lr_c, lr_b);
    plain_steps(occ, &c, SPLIT, STEPS);
    CHECK_MSG(model_equal(&a, &c), "resumed parameters differ from the uninterrupted run's");
    size_t size_c;
    void *blob_c = optim_blob(occ, &size_c);
    CHECK(size_c == size_a && memcmp(blob_a, blob_c, size_a) == 0);

    /* Damage and mismatches: refused, nothing changed. */
    unsigned char *bad = malloc(size_b);
    CHECK(bad);
    memcpy(bad, blob_b, size_b);
    bad[size_b / 2] ^= 1;
    CHECK_STATUS(ddp_optim_state_load(occ, bad, size_b), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("corrupt");
    CHECK_STATUS(ddp_optim_state_load(occ, blob_b, size_b - 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(ddp_optim_state_load(occ, blob_b, 10), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("too few");
    CHECK_STATUS(ddp_optim_state_load(occ, NULL, size_b), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("buf");
    size_t small = size_b - 1;
    CHECK_STATUS(ddp_optim_state_save(occ, bad, small), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("size");
    CHECK_MSG(model_equal(&a, &c), "a refused load changed the parameters");
    ddp_optim_config_t adam = oc;
    adam.kind = DDP_OPTIM_ADAM;
    ddp_optim_t *oadam;
    CHECK_OK(ddp_optim_create(c.params, NPARAMS, &adam, &oadam));
    CHECK_STATUS(ddp_optim_state_load(oadam, blob_b, size_b), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("kind");
    ddp_optim_destroy(oadam);
    ddp_param_t shorter[NPARAMS];
    memcpy(shorter, c.params, sizeof shorter);
    shorter[2].numel = 6;
    ddp_optim_t *oshort;
    CHECK_OK(ddp_optim_create(shorter, NPARAMS, &oc, &oshort));
    CHECK_STATUS(ddp_optim_state_load(oshort, blob_b, size_b), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("parameter 2");
    ddp_optim_destroy(oshort);
    free(bad);

    printf("plain: resumed after %d of %d steps, bitwise equal (state %zu bytes)\n", SPLIT, STEPS,
           size_b);
    ddp_optim_destroy(oa);
    ddp_optim_destroy(ob);
    ddp_optim_destroy(occ);
    free(blob_a);
    free(blob_b);
    free(blob_c);
    model_free(&a);
    model_free(&b);
    model_free(&c);
    return 0;
}

static int zero_stage;

static ddp_zero_t *zero_new(ddp_group_t *g, model_t *m, int stage)
{
    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    zc.stage = stage;
    zc.optim = config();
    zc.bucket_cap_bytes = 256;
    ddp_zero_t *z = NULL;
    CHECK_OK(ddp_zero_create(g, m->params, NPARAMS, &zc, &z));
    return z;
}

static void zero_steps(ddp_zero_t *z, model_t *m, int from, int to)
{
    for (int s = from; s < to; s++) {
        CHECK_OK(ddp_zero_scale_lr(z, factor(s)));
        set_grads(m, s); /* stage 1: the average; stage 2: every rank's local gradient */
        CHECK_OK(ddp_zero_step(z, m->grad));
    }
}

/* The consolidated state on root, then broadcast to every rank (size on every rank). */
static void *consolidated(ddp_group_t *g, ddp_zero_t *z, int root, size_t *size)
{
    CHECK_OK(ddp_zero_consolidated_state_size(z, size));
    void *buf = calloc(1, *size);
    CHECK(buf);
    int rank = ddp_group_rank(g);
    CHECK_OK(ddp_zero_state_consolidate(z, root, rank == root ? buf : NULL,
                                        rank == root ? *size : 0));
    CHECK_OK(ddp_group_broadcast(g, buf, *size, DDP_U8, root));
    return buf;
}

static int zero_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g), root = world - 1;
    model_t a, b, c, d, p;
    model_init(&a);
    model_init(&b);
    model_init(&c);
    model_init(&d);
    model_init(&p);

    ddp_zero_t *za = zero_new(g, &a, zero_stage);
    zero_steps(za, &a, 0, STEPS);
    size_t size_ca;
    void *cons_a = consolidated(g, za, 0, &size_ca);

    ddp_zero_t *zb = zero_new(g, &b, zero_stage);
    zero_steps(zb, &b, 0, SPLIT);
    size_t size_sb;
    CHECK_OK(ddp_zero_state_size(zb, &size_sb));
    void *shard_b = malloc(size_sb);
    CHECK(shard_b);
    CHECK_OK(ddp_zero_state_save(zb, shard_b, size_sb));
    size_t size_cb;
    void *cons_b = consolidated(g, zb, root, &size_cb);

    /* Resumed from this rank's shard. */
    model_copy(&c, &b);
    ddp_zero_t *zc = zero_new(g, &c, zero_stage);
    CHECK_OK(ddp_zero_state_load(zc, shard_b, size_sb));
    zero_steps(zc, &c, SPLIT, STEPS);
    CHECK_MSG(model_equal(&a, &c), "rank %d: resumed from its shard, parameters differ", rank);
    size_t size_cc;
    void *cons_c = consolidated(g, zc, 0, &size_cc);
    CHECK(size_cc == size_ca && memcmp(cons_a, cons_c, size_ca) == 0);

    /* Resumed from the consolidated state. */
    model_copy(&d, &b);
    ddp_zero_t *zd = zero_new(g, &d, zero_stage);
    CHECK_OK(ddp_zero_state_load(zd, cons_b, size_cb));
    zero_steps(zd, &d, SPLIT, STEPS);
    CHECK_MSG(model_equal(&a, &d), "rank %d: resumed from the consolidated state, parameters "
              "differ", rank);

    /* The consolidated state is the plain optimizer's, byte for byte (the averaged gradients
     * are exact, so ZeRO's arithmetic is the plain one's), and the plain optimizer resumes
     * from it to the same parameters. */
    ddp_optim_config_t oc = config();
    ddp_optim_t *op;
    CHECK_OK(ddp_optim_create(p.params, NPARAMS, &oc, &op));
    plain_steps(op, &p, 0, SPLIT);
    size_t size_p;
    CHECK_OK(ddp_optim_state_size(op, &size_p));
    void *blob_p = malloc(size_p);
    CHECK(blob_p);
    CHECK_OK(ddp_optim_state_save(op, blob_p, size_p));
    CHECK_MSG(size_p == size_cb && memcmp(blob_p, cons_b, size_p) == 0,
              "rank %d: consolidated state (%zu bytes) differs from the plain optimizer's (%zu)",
              rank, size_cb, size_p);
    ddp_optim_destroy(op);
    model_copy(&p, &b);
    CHECK_OK(ddp_optim_create(p.params, NPARAMS, &oc, &op));
    CHECK_OK(ddp_optim_state_load(op, cons_b, size_cb));
    plain_steps(op, &p, SPLIT, STEPS);
    CHECK_MSG(model_equal(&a, &p), "plain optimizer resumed from ZeRO's consolidated state "
              "differs");
    ddp_optim_destroy(op);
    free(blob_p);

    /* A shard loaded into another partition names the run it lacks. */
    if (world > 1) {
        ddp_zero_t *zo = zero_new(g, &p, zero_stage == 1 ? 2 : 1);
        if (ddp_zero_owned_numel(zo) > 0) {
            CHECK_STATUS(ddp_zero_state_load(zo, shard_b, size_sb), DDP_ERR_MISMATCH);
            CHECK_ERROR_MENTIONS("own shard or a consolidated state");
        }
        ddp_zero_destroy(zo);
    }
    /* Overlap mode learns its partition too late to load into. */
    {
        ddp_zero_config_t zoc = DDP_ZERO_CONFIG_INIT;
        zoc.overlap = 1;
        zoc.optim = config();
        zoc.optim.max_grad_norm = 0;
        ddp_zero_t *zo;
        CHECK_OK(ddp_zero_create(g, p.params, NPARAMS, &zoc, &zo));
        CHECK_STATUS(ddp_zero_state_load(zo, cons_b, size_cb), DDP_ERR_UNSUPPORTED);
        CHECK_ERROR_MENTIONS("overlap");
        size_t ignored;
        CHECK_STATUS(ddp_zero_state_size(zo, &ignored), DDP_ERR_INVALID_USAGE);
        ddp_zero_destroy(zo);
    }
    /* A root with no room: refused there, and the others complete the collective. */
    ddp_status_t s = ddp_zero_state_consolidate(zb, 0, NULL, 0);
    if (rank == 0) {
        CHECK_STATUS(s, DDP_ERR_INVALID_ARGUMENT);
        CHECK_ERROR_MENTIONS("consolidated_state_size");
    } else {
        CHECK_OK(s);
    }

    if (rank == 0)
        printf("zero-%d world %d: resumed from shards and from the consolidated state (%zu "
               "bytes), bitwise equal\n", zero_stage, world, size_cb);
    ddp_zero_destroy(za);
    ddp_zero_destroy(zb);
    ddp_zero_destroy(zc);
    ddp_zero_destroy(zd);
    free(cons_a);
    free(cons_b);
    free(cons_c);
    free(shard_b);
    model_free(&a);
    model_free(&b);
    model_free(&c);
    model_free(&d);
    model_free(&p);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "plain")) return run_plain();
    if (argc == 4 && !strcmp(argv[1], "zero")) {
        zero_stage = atoi(argv[2]);
        return ddp_test_run_group(atoi(argv[3]), 120, NULL, zero_main, NULL);
    }
    fprintf(stderr, "usage: %s plain | zero STAGE WORLD\n", argv[0]);
    return 2;
}
