/* FSDP (ZeRO-3) against the unsharded optimizer: every rank trains a 3-layer MLP (13-17-11-3)
 * whose parameters live only as shards, gathering each layer's unit before its forward and its
 * backward (prefetching the next), releasing it after, and handing each unit's gradient over as
 * its backward finishes; 2 micro-steps per step (with sync, or the first under no_sync). The
 * reference is ddp_optim on full parameters fed the average over ranks of the same local
 * gradients, computed in one process. Units: {W0, b0, b2} (not contiguous: like a model's root
 * unit it stays gathered from the first forward to the last backward), {W1, b1}, {W2}.
 *
 * usage: test_fsdp args | mismatch WORLD
 *        test_fsdp train sgd|adam|adamw WORLD f32|f64|bf16 sync|nosync
 *        test_fsdp ckpt WORLD_SAVE WORLD_LOAD */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"

#define NLAYERS 3
static const size_t dims[NLAYERS + 1] = {13, 17, 11, 3};
#define NPARAMS (2 * NLAYERS)
#define NUNITS 3
#define BATCH 12 /* divisible by 1, 2, 3 and 4 */
#define MICRO 2
#define MAXW 32
static const uint32_t unit_of[NPARAMS] = {0, 0, 1, 1, 2, 0};
static const char *names[NPARAMS] = {"W0", "b0", "W1", "b1", "W2", "b2"};

static size_t numel_of(int i)
{
    int l = i / 2;
    return i % 2 ? dims[l + 1] : dims[l + 1] * dims[l];
}

static void sample(size_t s, double *x, double *y)
{
    unsigned long long seed = 7000 + s;
    for (size_t i = 0; i < dims[0]; i++) x[i] = ddp_test_random(&seed);
    for (size_t i = 0; i < dims[NLAYERS]; i++) y[i] = ddp_test_random(&seed);
}

/* Where a layer's parameters and gradients are: full arrays, or an FSDP object's gathered units. */
typedef struct model_io {
    ddp_fsdp_t *fsdp; /* NULL: params/grads below */
    void **params, **grads;
    int check_release; /* FSDP: a released unit's parameters must be refused */
} model_io_t;

static void *param_of(model_io_t *io, int i)
{
    if (!io->fsdp) return io->params[i];
    void *p = NULL;
    CHECK_OK(ddp_fsdp_param(io->fsdp, (size_t)i, &p));
    return p;
}

static void *grad_of(model_io_t *io, int i)
{
    if (!io->fsdp) return io->grads[i];
    void *g = NULL;
    CHECK_OK(ddp_fsdp_grad(io->fsdp, (size_t)i, &g));
    return g;
}

static void enter(model_io_t *io, int layer, int backward)
{
    if (!io->fsdp) return;
    size_t u = unit_of[2 * layer];
    CHECK_OK(ddp_fsdp_gather(io->fsdp, u));
    CHECK_OK(ddp_fsdp_gather(io->fsdp, 0)); /* b2 of the last layer lives in unit 0 */
    int next = backward ? layer - 1 : layer + 1;
    if (next >= 0 && next < NLAYERS) CHECK_OK(ddp_fsdp_prefetch(io->fsdp, unit_of[2 * next]));
}

static void leave(model_io_t *io, int layer)
{
    size_t u = unit_of[2 * layer];
    if (!io->fsdp || u == 0) return; /* unit 0 stays until the end of backward */
    CHECK_OK(ddp_fsdp_release(io->fsdp, u));
    if (io->check_release) {
        void *p;
        CHECK_STATUS(ddp_fsdp_param(io->fsdp, (size_t)(2 * layer), &p), DDP_ERR_INVALID_USAGE);
        CHECK_ERROR_MENTIONS("ddp_fsdp_gather");
    }
}

/* Gradients of scale * mean loss 0.5 |out - y|^2 over `count` samples from global sample
 * `first`, ACCUMULATED into the gradients (tanh hidden layers), layer by layer through io. With
 * FSDP each unit's gradient is handed over when its last layer's backward is done. */
static void forward_backward(model_io_t *io, ddp_dtype_t dt, size_t first, size_t count,
                             double scale)
{
    double act[NLAYERS + 1][BATCH][MAXW], delta[BATCH][MAXW], prev[BATCH][MAXW], y[BATCH][MAXW];
    for (size_t s = 0; s < count; s++) sample(first + s, act[0][s], y[s]);
    for (int l = 0; l < NLAYERS; l++) {
        enter(io, l, 0);
        const void *W = param_of(io, 2 * l), *b = param_of(io, 2 * l + 1);
        for (size_t s = 0; s < count; s++)
            for (size_t o = 0; o < dims[l + 1]; o++) {
                double z = ddp_test_get(dt, b, o);
                for (size_t i = 0; i < dims[l]; i++)
                    z += ddp_test_get(dt, W, o * dims[l] + i) * act[l][s][i];
                act[l + 1][s][o] = l + 1 < NLAYERS ? tanh(z) : z;
            }
        if (l + 1 < NLAYERS) leave(io, l);
    }
    for (size_t s = 0; s < count; s++)
        for (size_t o = 0; o < dims[NLAYERS]; o++)
            delta[s][o] = scale * (act[NLAYERS][s][o] - y[s][o]) / (double)count;
    for (int l = NLAYERS - 1; l >= 0; l--) {
        if (l + 1 < NLAYERS) enter(io, l, 1);
        else if (io->fsdp && l > 0) CHECK_OK(ddp_fsdp_prefetch(io->fsdp, unit_of[2 * (l - 1)]));
        const void *W = param_of(io, 2 * l);
        void *gW = grad_of(io, 2 * l), *gb = grad_of(io, 2 * l + 1);
        for (size_t o = 0; o < dims[l + 1]; o++) {
            double sb = 0.0;
            for (size_t s = 0; s < count; s++) sb += delta[s][o];
            ddp_test_put(dt, gb, o, ddp_test_get(dt, gb, o) + sb);
            for (size_t i = 0; i < dims[l]; i++) {
                double sw = 0.0;
                for (size_t s = 0; s < count; s++) sw += delta[s][o] * act[l][s][i];
                ddp_test_put(dt, gW, o * dims[l] + i, ddp_test_get(dt, gW, o * dims[l] + i) + sw);
            }
        }
        if (l > 0) {
            for (size_t s = 0; s < count; s++)
                for (size_t i = 0; i < dims[l]; i++) {
                    double d = 0.0;
                    for (size_t o = 0; o < dims[l + 1]; o++)
                        d += ddp_test_get(dt, W, o * dims[l] + i) * delta[s][o];
                    prev[s][i] = d * (1.0 - act[l][s][i] * act[l][s][i]);
                }
            memcpy(delta, prev, sizeof delta);
        }
        if (io->fsdp && unit_of[2 * l] != 0) {
            CHECK_OK(ddp_fsdp_grad_ready(io->fsdp, unit_of[2 * l]));
            leave(io, l);
        }
    }
    if (io->fsdp) {
        CHECK_OK(ddp_fsdp_grad_ready(io->fsdp, 0));
        CHECK_OK(ddp_fsdp_release(io->fsdp, 0));
    }
}

static void init_params(void **p, ddp_dtype_t dt, unsigned long long seed)
{
    for (int i = 0; i < NPARAMS; i++)
        for (size_t e = 0; e < numel_of(i); e++) ddp_test_put(dt, p[i], e, 0.5 * ddp_test_random(&seed));
}

static ddp_optim_config_t optim_config(const char *kind)
{
    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    static const ddp_optim_group_t groups[2] = {{0.02, 0.01}, {0.04, 0.0}};
    static const uint32_t pg[NPARAMS] = {0, 1, 0, 1, 0, 1}; /* biases: twice the lr, no decay */
    if (!strcmp(kind, "sgd")) {
        oc.kind = DDP_OPTIM_SGD;
        oc.momentum = 0.9;
        oc.nesterov = 1;
    } else {
        oc.kind = !strcmp(kind, "adam") ? DDP_OPTIM_ADAM : DDP_OPTIM_ADAMW;
        oc.amsgrad = !strcmp(kind, "adam");
        oc.max_grad_norm = 0.5; /* the norm over every rank's shards */
    }
    oc.ngroups = 2;
    oc.groups = groups;
    oc.param_groups = pg;
    return oc;
}

static uint64_t fnv(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Every parameter whole on every rank (gathered unit by unit), into full[i]. */
static void gather_all(ddp_fsdp_t *f, void **full, ddp_dtype_t dt)
{
    for (int i = 0; i < NPARAMS; i++) {
        CHECK_OK(ddp_fsdp_gather(f, unit_of[i]));
        void *p;
        CHECK_OK(ddp_fsdp_param(f, (size_t)i, &p));
        memcpy(full[i], p, numel_of(i) * ddp_dtype_size(dt));
        CHECK_OK(ddp_fsdp_release(f, unit_of[i]));
    }
}

typedef struct train_case {
    const char *optim;
    ddp_dtype_t dtype;
    int nosync;
} train_case_t;

/* One optimizer step of the FSDP model: MICRO micro-batches of this rank's share. */
static void fsdp_step(ddp_fsdp_t *f, ddp_dtype_t dt, int step, int rank, int world, int nosync)
{
    size_t local = BATCH / (size_t)world;
    model_io_t io = {f, NULL, NULL, step == 0};
    for (int k = 0; k < MICRO; k++) {
        CHECK_OK(ddp_fsdp_set_sync(f, !(nosync && k + 1 < MICRO)));
        forward_backward(&io, dt, ((size_t)step * MICRO + (size_t)k) * BATCH + (size_t)rank * local,
                         local, 1.0 / MICRO);
    }
    CHECK_OK(ddp_fsdp_step(f));
}

static int train_main(ddp_group_t *g, void *arg)
{
    const train_case_t *tc = arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    ddp_dtype_t dt = tc->dtype;
    size_t es = ddp_dtype_size(dt), local = BATCH / (size_t)world;
    void *ref[NPARAMS], *refg[NPARAMS], *rankg[NPARAMS], *full[NPARAMS];
    ddp_param_t params[NPARAMS];
    for (int i = 0; i < NPARAMS; i++) {
        ref[i] = calloc(numel_of(i), es);
        refg[i] = calloc(numel_of(i), es);
        rankg[i] = calloc(numel_of(i), sizeof(double));
        full[i] = calloc(numel_of(i), es);
        params[i] = (ddp_param_t){names[i], ref[i], numel_of(i), dt, 0, 0, NULL};
    }
    /* Every rank but 0 starts from other values: sync_params must broadcast rank 0's. */
    init_params(ref, dt, 42 + (unsigned long long)rank);
    ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
    fc.optim = optim_config(tc->optim);
    /* Unit 2 (33 elements) is under half a bucket: bucketed; units 0 and 1 (241, 198) go on
     * their own at once. */
    fc.bucket_cap_bytes = 80 * es * (size_t)world;
    fc.cache_buffers = dt != DDP_F64; /* f64 cases: every released buffer freed at once */
    ddp_fsdp_t *f = NULL;
    CHECK_OK(ddp_fsdp_create(g, params, NPARAMS, unit_of, NUNITS, &fc, &f));
    init_params(ref, dt, 42); /* the reference: rank 0's values, full */
    ddp_optim_t *plain = NULL;
    CHECK_OK(ddp_optim_create(params, NPARAMS, &fc.optim, &plain));

    for (int step = 0; step < 4; step++) {
        CHECK_OK(ddp_fsdp_scale_lr(f, 1.0 - 0.1 * step));
        CHECK_OK(ddp_optim_scale_lr(plain, 1.0 - 0.1 * step));
        fsdp_step(f, dt, step, rank, world, tc->nosync);
        /* Reference: every rank's local gradients of both micro-batches, averaged over ranks. */
        for (int i = 0; i < NPARAMS; i++) memset(rankg[i], 0, numel_of(i) * sizeof(double));
        for (int k = 0; k < MICRO; k++)
            for (int r = 0; r < world; r++) {
                for (int i = 0; i < NPARAMS; i++) memset(refg[i], 0, numel_of(i) * es);
                model_io_t io = {NULL, ref, refg, 0};
                forward_backward(&io, dt, ((size_t)step * MICRO + (size_t)k) * BATCH + (size_t)r * local,
                                 local, 1.0 / MICRO);
                for (int i = 0; i < NPARAMS; i++)
                    for (size_t e = 0; e < numel_of(i); e++)
                        ((double *)rankg[i])[e] += ddp_test_get(dt, refg[i], e) / world;
            }
        for (int i = 0; i < NPARAMS; i++)
            for (size_t e = 0; e < numel_of(i); e++)
                ddp_test_put(dt, refg[i], e, ((double *)rankg[i])[e]);
        CHECK_OK(ddp_optim_step(plain, refg));

        gather_all(f, full, dt);
        double tol = dt == DDP_F64 ? 1e-11 : dt == DDP_F32 ? 2e-5 : 2e-2;
        for (int i = 0; i < NPARAMS; i++)
            for (size_t e = 0; e < numel_of(i); e++) {
                double a = ddp_test_get(dt, full[i], e), b = ddp_test_get(dt, ref[i], e);
                CHECK_MSG(fabs(a - b) <= tol * (1.0 + fabs(b)),
                          "step %d: %s[%zu] = %.17g with FSDP, %.17g unsharded", step, names[i],
                          e, a, b);
            }
        if (fc.optim.max_grad_norm > 0) {
            double n1, n2;
            CHECK_OK(ddp_fsdp_grad_norm(f, &n1));
            CHECK_OK(ddp_optim_grad_norm(plain, &n2));
            CHECK_MSG(fabs(n1 - n2) <= (dt == DDP_BF16 ? 1e-2 : 1e-5) * n2,
                      "step %d: norm %.17g with FSDP, %.17g unsharded", step, n1, n2);
        }
        /* The gathered parameters are bitwise the same on every rank. */
        uint64_t h = 1469598103934665603ull;
        for (int i = 0; i < NPARAMS; i++) h = fnv(h, full[i], numel_of(i) * es);
        int64_t hs[8], mine = (int64_t)h;
        CHECK_OK(ddp_group_allgather(g, &mine, hs, 1, DDP_I64));
        for (int r = 0; r < world; r++)
            CHECK_MSG(hs[r] == hs[0], "step %d: rank %d's parameters differ from rank 0's", step, r);
    }
    /* Memory: the shards add up to the whole (plus padding), the optimizer state to the plain
     * optimizer's, and nothing stays gathered. */
    ddp_fsdp_memory_t m;
    CHECK_OK(ddp_fsdp_memory(f, &m));
    size_t total = 0, padded = 0, unit_numel[NUNITS] = {0};
    for (int i = 0; i < NPARAMS; i++) {
        total += numel_of(i);
        unit_numel[unit_of[i]] += numel_of(i);
    }
    for (int u = 0; u < NUNITS; u++)
        padded += (unit_numel[u] + (size_t)world - 1) / (size_t)world;
    CHECK_MSG(m.param_shard_bytes == padded * es && m.grad_shard_bytes == padded * es,
              "rank %d: shards of %zu / %zu bytes, expected %zu", rank, m.param_shard_bytes,
              m.grad_shard_bytes, padded * es);
    CHECK(m.full_model_bytes == total * es);
    CHECK(m.gathered_bytes == 0 && m.grad_full_bytes == 0);
    CHECK_MSG(fc.cache_buffers ? m.cached_bytes >= m.gathered_peak_bytes : m.cached_bytes == 0,
              "%zu bytes cached (cache_buffers %d), gathered peak %zu", m.cached_bytes,
              fc.cache_buffers, m.gathered_peak_bytes);
    CHECK(m.gathered_peak_bytes > 0 && m.gathered_peak_bytes <= (total + 3 * (size_t)world) * es);
    int64_t st = (int64_t)m.optim_state_bytes, sts[8], sum = 0;
    CHECK_OK(ddp_group_allgather(g, &st, sts, 1, DDP_I64));
    for (int r = 0; r < world; r++) sum += sts[r];
    CHECK_MSG((size_t)sum == ddp_optim_state_bytes(plain), "optimizer state over ranks %lld "
              "bytes, unsharded %zu", (long long)sum, ddp_optim_state_bytes(plain));
    size_t owned = 0;
    for (int i = 0; i < NPARAMS; i++) {
        size_t u, first, count;
        CHECK_OK(ddp_fsdp_param_shard(f, (size_t)i, &u, &first, &count));
        CHECK(u == unit_of[i] && first + count <= numel_of(i));
        owned += count;
    }
    int64_t o = (int64_t)owned, os[8], osum = 0;
    CHECK_OK(ddp_group_allgather(g, &o, os, 1, DDP_I64));
    for (int r = 0; r < world; r++) osum += os[r];
    CHECK((size_t)osum == total); /* every element has exactly one owner */
    ddp_fsdp_destroy(f);
    ddp_optim_destroy(plain);
    for (int i = 0; i < NPARAMS; i++) {
        free(ref[i]);
        free(refg[i]);
        free(rankg[i]);
        free(full[i]);
    }
    return 0;
}

/* ---- checkpoints ----------------------------------------------------------------------------- */

typedef struct ckpt_case {
    int save_world, load_world;
    char dir[512];
} ckpt_case_t;

static void write_file(const char *dir, const char *name, const void *p, size_t n)
{
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    CHECK_MSG(fp && fwrite(p, 1, n, fp) == n && fclose(fp) == 0, "writing %s", path);
}

static void *read_file(const char *dir, const char *name, size_t *n)
{
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "rb");
    CHECK_MSG(fp != NULL, "opening %s", path);
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    void *p = malloc(len > 0 ? (size_t)len : 1);
    CHECK(p && fread(p, 1, (size_t)len, fp) == (size_t)len);
    fclose(fp);
    *n = (size_t)len;
    return p;
}

static ddp_fsdp_t *ckpt_model(ddp_group_t *g, unsigned long long seed)
{
    void *p[NPARAMS];
    ddp_param_t params[NPARAMS];
    for (int i = 0; i < NPARAMS; i++) {
        p[i] = calloc(numel_of(i), sizeof(float));
        params[i] = (ddp_param_t){names[i], p[i], numel_of(i), DDP_F32, 0, 0, NULL};
    }
    init_params(p, DDP_F32, seed);
    ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
    fc.optim = optim_config("adamw");
    fc.bucket_cap_bytes = 0;
    ddp_fsdp_t *f = NULL;
    CHECK_OK(ddp_fsdp_create(g, params, NPARAMS, unit_of, NUNITS, &fc, &f));
    for (int i = 0; i < NPARAMS; i++) free(p[i]); /* the FSDP object keeps its shards only */
    return f;
}

/* The consolidated parameters and optimizer state on rank 0 written as `tag`.params/.optim. */
static void save_consolidated(ddp_fsdp_t *f, int rank, const char *dir, const char *tag)
{
    size_t ob;
    CHECK_OK(ddp_fsdp_consolidated_optim_size(f, &ob));
    void *full[NPARAMS], *optim = rank == 0 ? malloc(ob) : NULL;
    size_t total = 0;
    for (int i = 0; i < NPARAMS; i++) total += numel_of(i);
    float *flat = calloc(total, sizeof(float));
    for (int i = 0, off = 0; i < NPARAMS; off += (int)numel_of(i), i++) full[i] = flat + off;
    CHECK_OK(ddp_fsdp_consolidate(f, 0, rank == 0 ? full : NULL, optim, rank == 0 ? ob : 0));
    if (rank == 0) {
        char name[64];
        snprintf(name, sizeof name, "%s.params", tag);
        write_file(dir, name, flat, total * sizeof(float));
        snprintf(name, sizeof name, "%s.optim", tag);
        write_file(dir, name, optim, ob);
    }
    free(flat);
    free(optim);
}

static void expect_same_file(const char *dir, const char *a, const char *b)
{
    size_t na, nb;
    void *pa = read_file(dir, a, &na), *pb = read_file(dir, b, &nb);
    CHECK_MSG(na == nb && memcmp(pa, pb, na) == 0, "%s and %s differ (%zu and %zu bytes)", a, b,
              na, nb);
    free(pa);
    free(pb);
}

static int ckpt_save_main(ddp_group_t *g, void *arg)
{
    const ckpt_case_t *cc = arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    ddp_fsdp_t *f = ckpt_model(g, 42);
    for (int step = 0; step < 3; step++) fsdp_step(f, DDP_F32, step, rank, world, 0);
    size_t n;
    CHECK_OK(ddp_fsdp_state_size(f, &n));
    void *blob = malloc(n);
    CHECK_STATUS(ddp_fsdp_state_save(f, blob, n - 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("ddp_fsdp_state_size");
    CHECK_OK(ddp_fsdp_state_save(f, blob, n));
    char name[64];
    snprintf(name, sizeof name, "shard.%d", rank);
    write_file(cc->dir, name, blob, n);
    save_consolidated(f, rank, cc->dir, "at3");
    /* Its own shard back: nothing changes, and 3 more steps give the uninterrupted result. */
    const void *blobs[1] = {blob};
    CHECK_OK(ddp_fsdp_state_load(f, blobs, &n, 1));
    for (int step = 3; step < 6; step++) fsdp_step(f, DDP_F32, step, rank, world, 0);
    save_consolidated(f, rank, cc->dir, "at6");
    free(blob);
    ddp_fsdp_destroy(f);
    return 0;
}

static int ckpt_load_main(ddp_group_t *g, void *arg)
{
    const ckpt_case_t *cc = arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    int saved = cc->save_world;
    void *blobs[8];
    size_t sizes[8];
    for (int r = 0; r < saved; r++) {
        char name[64];
        snprintf(name, sizeof name, "shard.%d", r);
        blobs[r] = read_file(cc->dir, name, &sizes[r]);
    }
    /* Resharded from every shard of the saved run: consolidating again gives the same bytes. */
    ddp_fsdp_t *f = ckpt_model(g, 7); /* other values: the load must replace them */
    CHECK_OK(ddp_fsdp_state_load(f, (const void *const *)blobs, sizes, (size_t)saved));
    char tag[32];
    snprintf(tag, sizeof tag, "re%d", world);
    save_consolidated(f, rank, cc->dir, tag);
    ddp_group_barrier(g);
    if (rank == 0) {
        char a[48];
        snprintf(a, sizeof a, "%s.params", tag);
        expect_same_file(cc->dir, "at3.params", a);
        snprintf(a, sizeof a, "%s.optim", tag);
        expect_same_file(cc->dir, "at3.optim", a);
    }
    if (world == saved) { /* the same world: 3 more steps end bitwise where the saver ended */
        for (int step = 3; step < 6; step++) fsdp_step(f, DDP_F32, step, rank, world, 0);
        save_consolidated(f, rank, cc->dir, "resumed6");
        ddp_group_barrier(g);
        if (rank == 0) {
            expect_same_file(cc->dir, "at6.params", "resumed6.params");
            expect_same_file(cc->dir, "at6.optim", "resumed6.optim");
        }
    }
    ddp_fsdp_destroy(f);

    /* From the consolidated files: the same state again. */
    f = ckpt_model(g, 9);
    size_t np, no;
    float *flat = read_file(cc->dir, "at3.params", &np);
    void *optim = read_file(cc->dir, "at3.optim", &no);
    const void *full[NPARAMS];
    for (int i = 0, off = 0; i < NPARAMS; off += (int)numel_of(i), i++) full[i] = flat + off;
    CHECK_OK(ddp_fsdp_load_consolidated(f, full, optim, no));
    snprintf(tag, sizeof tag, "co%d", world);
    save_consolidated(f, rank, cc->dir, tag);
    ddp_group_barrier(g);
    if (rank == 0) {
        char a[48];
        snprintf(a, sizeof a, "%s.optim", tag);
        expect_same_file(cc->dir, "at3.optim", a);
        /* The consolidated optimizer state is ddp_optim's format: a plain optimizer loads it. */
        void *p[NPARAMS];
        ddp_param_t params[NPARAMS];
        for (int i = 0; i < NPARAMS; i++) {
            p[i] = (void *)full[i];
            params[i] = (ddp_param_t){names[i], p[i], numel_of(i), DDP_F32, 0, 0, NULL};
        }
        ddp_optim_config_t oc = optim_config("adamw");
        ddp_optim_t *plain;
        CHECK_OK(ddp_optim_create(params, NPARAMS, &oc, &plain));
        CHECK_OK(ddp_optim_state_load(plain, optim, no));
        ddp_optim_destroy(plain);
    }
    /* Misuse: another run's shard alone does not hold the last rank's elements; a damaged blob
     * is refused by its checksum; neither changes anything. */
    if (saved > 1 && rank == world - 1) {
        CHECK_STATUS(ddp_fsdp_state_load(f, (const void *const *)blobs, sizes, 1),
                     DDP_ERR_MISMATCH);
        CHECK_ERROR_MENTIONS("every blob");
    }
    ((unsigned char *)blobs[0])[sizes[0] / 2] ^= 1;
    CHECK_STATUS(ddp_fsdp_state_load(f, (const void *const *)blobs, sizes, (size_t)saved),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("corrupt");
    snprintf(tag, sizeof tag, "after%d", world);
    save_consolidated(f, rank, cc->dir, tag);
    ddp_group_barrier(g);
    if (rank == 0) {
        char a[48];
        snprintf(a, sizeof a, "%s.optim", tag);
        expect_same_file(cc->dir, "at3.optim", a);
    }
    ddp_fsdp_destroy(f);
    free(flat);
    free(optim);
    for (int r = 0; r < saved; r++) free(blobs[r]);
    return 0;
}

/* ---- argument and usage errors ---------------------------------------------------------------- */

static int args_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    float w[6] = {1, 2, 3, 4, 5, 6}, b[2] = {0.5f, -0.5f};
    double d[2] = {1, 2};
    ddp_param_t p[3] = {{"w", w, 6, DDP_F32, 0, 0, NULL}, {"b", b, 2, DDP_F32, 0, 0, NULL},
                        {"d", d, 2, DDP_F64, 0, 0, NULL}};
    ddp_fsdp_config_t fc;
    ddp_fsdp_config_init(&fc);
    CHECK(fc.sync_params == 1 && fc.cache_buffers == 1 && fc.bucket_cap_bytes == (size_t)1 << 20);
    ddp_fsdp_t *f = NULL;
    uint32_t units[3] = {0, 0, 1};
    CHECK_STATUS(ddp_fsdp_create(NULL, p, 3, units, 2, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, units, 2, NULL, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("config");
    uint32_t bad[3] = {0, 2, 1};
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, bad, 2, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("param_units[1] (b) is 2");
    uint32_t mixed[3] = {0, 1, 1};
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, mixed, 2, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("mixes dtypes");
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, units, 3, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("unit 2 has no parameter");
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, NULL, 2, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("nunits");
    fc.optim.lr = -1;
    CHECK_STATUS(ddp_fsdp_create(g, p, 3, units, 2, &fc, &f), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("lr");
    fc.optim.lr = 0.1;
    CHECK(f == NULL);
    CHECK_OK(ddp_fsdp_create(g, p, 3, units, 2, &fc, &f));

    void *ptr;
    CHECK_STATUS(ddp_fsdp_param(f, 0, &ptr), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("unit 0");
    CHECK_STATUS(ddp_fsdp_gather(f, 2), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("unit 2 out of range");
    CHECK_STATUS(ddp_fsdp_param(f, 3, &ptr), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_fsdp_prefetch(f, 0));
    CHECK_STATUS(ddp_fsdp_param(f, 1, &ptr), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("prefetched");
    CHECK_OK(ddp_fsdp_gather(f, 0));
    CHECK_OK(ddp_fsdp_param(f, 1, &ptr));
    CHECK(((float *)ptr)[0] == 0.5f && ((float *)ptr)[1] == -0.5f);
    /* A step with a unit gathered is refused (its full copy would be stale). */
    CHECK_STATUS(ddp_fsdp_step(f), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("unit 0 is gathered");
    CHECK_OK(ddp_fsdp_release(f, 0));
    CHECK_OK(ddp_fsdp_release(f, 0)); /* twice: nothing */
    /* no_sync gradients must be reduced before a step. */
    void *gw;
    CHECK_OK(ddp_fsdp_set_sync(f, 0));
    CHECK_OK(ddp_fsdp_grad(f, 0, &gw));
    for (int i = 0; i < 6; i++) ((float *)gw)[i] = 1.0f;
    CHECK_OK(ddp_fsdp_grad_ready(f, 0));
    CHECK_STATUS(ddp_fsdp_step(f), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("no_sync");
    CHECK_OK(ddp_fsdp_set_sync(f, 1));
    CHECK_OK(ddp_fsdp_grad(f, 0, &gw)); /* still the accumulated buffer */
    CHECK(((float *)gw)[5] == 1.0f);
    CHECK_OK(ddp_fsdp_grad_ready(f, 0));
    CHECK_OK(ddp_fsdp_grad_ready(f, 1)); /* never asked for: zeros */
    CHECK_OK(ddp_fsdp_step(f));           /* SGD lr 0.1 on one rank: w -= 0.1 */
    CHECK_OK(ddp_fsdp_gather(f, 0));
    CHECK_OK(ddp_fsdp_param(f, 0, &ptr));
    CHECK(((float *)ptr)[0] == 1.0f - 0.1f && ((float *)ptr)[5] == 6.0f - 0.1f);
    CHECK_OK(ddp_fsdp_param(f, 1, &ptr));
    CHECK(((float *)ptr)[0] == 0.5f); /* zero gradient */
    CHECK_OK(ddp_fsdp_release(f, 0));
    /* Blobs: NULL, short, another shape. */
    size_t n;
    CHECK_OK(ddp_fsdp_state_size(f, &n));
    CHECK_STATUS(ddp_fsdp_state_load(f, NULL, &n, 1), DDP_ERR_INVALID_ARGUMENT);
    unsigned char junk[16] = {0};
    const void *jb[1] = {junk};
    size_t js = sizeof junk;
    CHECK_STATUS(ddp_fsdp_state_load(f, jb, &js, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("too few");
    ddp_param_t q[3] = {p[0], p[1], p[2]};
    q[0].numel = 5;
    ddp_fsdp_t *other = NULL;
    CHECK_OK(ddp_fsdp_create(g, q, 3, units, 2, &fc, &other));
    size_t on;
    CHECK_OK(ddp_fsdp_state_size(other, &on));
    void *ob = malloc(on);
    CHECK_OK(ddp_fsdp_state_save(other, ob, on));
    const void *obs[1] = {ob};
    CHECK_STATUS(ddp_fsdp_state_load(f, obs, &on, 1), DDP_ERR_MISMATCH);
    CHECK_ERROR_MENTIONS("parameter 0 (w)");
    free(ob);
    ddp_fsdp_destroy(other);
    CHECK_STATUS(ddp_fsdp_consolidate(f, 1, NULL, NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("root is 1");
    CHECK_STATUS(ddp_fsdp_load_consolidated(f, NULL, NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("params");
    CHECK_OK(ddp_fsdp_gather(f, 1));
    const void *full3[3] = {w, b, d};
    CHECK_STATUS(ddp_fsdp_load_consolidated(f, full3, NULL, 0), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("unit 1 is gathered");
    CHECK_OK(ddp_fsdp_release(f, 1));
    CHECK_OK(ddp_fsdp_load_consolidated(f, full3, NULL, 0)); /* parameters only: back to w, b */
    CHECK_OK(ddp_fsdp_gather(f, 0));
    CHECK_OK(ddp_fsdp_param(f, 0, &ptr));
    CHECK(((float *)ptr)[0] == 1.0f && ((float *)ptr)[5] == 6.0f);
    CHECK_OK(ddp_fsdp_release(f, 0));
    ddp_fsdp_memory_t m;
    CHECK_OK(ddp_fsdp_memory(f, &m));
    CHECK(m.full_model_bytes == 8 * 4 + 2 * 8 && m.gathered_bytes == 0 && m.cached_bytes > 0);
    ddp_fsdp_destroy(f);
    ddp_fsdp_destroy(NULL);
    return 0;
}

/* Ranks that disagree on a unit's size (the last rank's W0 is longer) get an error from the
 * gather on every rank within the timeout, naming the unit, instead of wrong data or a hang. */
static int mismatch_main(ddp_group_t *g, void *arg)
{
    (void)arg;
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    float a[64] = {0}, b[7] = {0};
    ddp_param_t p[2] = {{"a", a, rank == world - 1 ? 60 : 30, DDP_F32, 0, 0, NULL},
                        {"b", b, 7, DDP_F32, 0, 0, NULL}};
    ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
    fc.sync_params = 0; /* else create's broadcast is where it fails */
    ddp_fsdp_t *f = NULL;
    CHECK_OK(ddp_fsdp_create(g, p, 2, NULL, 2, &fc, &f));
    ddp_status_t s = ddp_fsdp_gather(f, 0);
    CHECK_MSG(s == DDP_ERR_MISMATCH || s == DDP_ERR_REMOTE || s == DDP_ERR_ABORTED,
              "rank %d: gather returned %s (%s)", rank, ddp_status_string(s), ddp_last_error());
    CHECK_ERROR_MENTIONS("unit 0");
    if (rank == 0) fprintf(stderr, "rank 0: %s: %s\n", ddp_status_string(s), ddp_last_error());
    ddp_fsdp_destroy(f);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "args")) return ddp_test_run_group(1, 60, NULL, args_main, NULL);
    if (argc == 3 && !strcmp(argv[1], "mismatch")) {
        ddp_group_options_t go = DDP_GROUP_OPTIONS_INIT;
        go.timeout_ms = 20000;
        return ddp_test_run_group(atoi(argv[2]), 60, &go, mismatch_main, NULL);
    }
    if (argc == 6 && !strcmp(argv[1], "train")) {
        train_case_t tc = {argv[2], DDP_F32, !strcmp(argv[5], "nosync")};
        CHECK(ddp_dtype_parse(argv[4], &tc.dtype) == DDP_OK);
        int world = atoi(argv[3]);
        CHECK(world >= 1 && world <= 4);
        return ddp_test_run_group(world, 120, NULL, train_main, &tc);
    }
    if (argc == 4 && !strcmp(argv[1], "ckpt")) {
        ckpt_case_t cc = {atoi(argv[2]), atoi(argv[3]), ""};
        CHECK(cc.save_world >= 1 && cc.save_world <= 4 && cc.load_world >= 1 && cc.load_world <= 4);
        const char *dir = ddp_test_tmpdir();
        CHECK(dir != NULL);
        snprintf(cc.dir, sizeof cc.dir, "%s", dir);
        if (ddp_test_run_group(cc.save_world, 120, NULL, ckpt_save_main, &cc)) return 1;
        return ddp_test_run_group(cc.load_world, 120, NULL, ckpt_load_main, &cc);
    }
    fprintf(stderr, "usage: %s args | mismatch WORLD | train sgd|adam|adamw WORLD f32|f64|bf16 sync|nosync | "
            "ckpt WORLD_SAVE WORLD_LOAD\n", argv[0]);
    return 2;
}
