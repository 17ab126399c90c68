/* The objects the state and checkpoint fuzz targets load into, made the same way by the targets
 * and by the seed generator (make_seeds.c), so that the seeds are states those objects accept:
 * three parameters (f32 12 elements as a 3x4 matrix, bf16 5, f64 3) in two groups, the plain
 * optimizer as SGD with momentum, Adam with amsgrad and AdamW, and ZeRO (AdamW) at stages 1 and 2
 * on a one-rank group; a PowerSGD config. */
#ifndef DDP_FUZZ_SETUPS_H
#define DDP_FUZZ_SETUPS_H

#include <stdint.h>
#include <string.h>

#include <ddp/ddp.h>

#define FUZZ_NPARAMS 3
#define FUZZ_NOPTIMS 3
#define FUZZ_NZEROS 2

typedef struct fuzz_optims {
    float p0[12];
    uint16_t p1[5];
    double p2[3];
    ddp_param_t params[FUZZ_NPARAMS];
    ddp_optim_t *optim[FUZZ_NOPTIMS];
    ddp_store_t *store;
    ddp_group_t *group;
    ddp_zero_t *zero[FUZZ_NZEROS];
} fuzz_optims_t;

static const ddp_optim_group_t fuzz_groups[2] = {{0.01, 0.1}, {0.02, 0.0}};
static const uint32_t fuzz_param_groups[FUZZ_NPARAMS] = {0, 1, 0};

static inline ddp_optim_config_t fuzz_optim_config(int which)
{
    ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
    c.ngroups = 2;
    c.groups = fuzz_groups;
    c.param_groups = fuzz_param_groups;
    if (which == 0) {
        c.kind = DDP_OPTIM_SGD;
        c.momentum = 0.9;
    } else if (which == 1) {
        c.kind = DDP_OPTIM_ADAM;
        c.amsgrad = 1;
    } else {
        c.kind = DDP_OPTIM_ADAMW;
        c.max_grad_norm = 1.0;
    }
    return c;
}

/* Makes every optimizer; returns 0 or -1. */
static inline int fuzz_optims_create(fuzz_optims_t *f)
{
    memset(f, 0, sizeof *f);
    for (int i = 0; i < 12; i++) f->p0[i] = 0.25f * (float)i;
    for (int i = 0; i < 5; i++) f->p1[i] = (uint16_t)(0x3f80 + i); /* bf16 1.0, 1.0078, ... */
    for (int i = 0; i < 3; i++) f->p2[i] = -1.5 * i;
    static const char *const names[FUZZ_NPARAMS] = {"w", "b", "s"};
    void *data[FUZZ_NPARAMS] = {f->p0, f->p1, f->p2};
    size_t numel[FUZZ_NPARAMS] = {12, 5, 3}, rows[FUZZ_NPARAMS] = {3, 0, 0};
    ddp_dtype_t dtype[FUZZ_NPARAMS] = {DDP_F32, DDP_BF16, DDP_F64};
    for (int i = 0; i < FUZZ_NPARAMS; i++) {
        f->params[i].name = names[i];
        f->params[i].data = data[i];
        f->params[i].numel = numel[i];
        f->params[i].dtype = dtype[i];
        f->params[i].rows = rows[i];
    }
    for (int k = 0; k < FUZZ_NOPTIMS; k++) {
        ddp_optim_config_t c = fuzz_optim_config(k);
        if (ddp_optim_create(f->params, FUZZ_NPARAMS, &c, &f->optim[k]) != DDP_OK) return -1;
    }
    if (ddp_store_hash_create(&f->store) != DDP_OK) return -1;
    if (ddp_group_create(f->store, 0, 1, NULL, &f->group) != DDP_OK) return -1;
    for (int k = 0; k < FUZZ_NZEROS; k++) {
        ddp_zero_config_t z = DDP_ZERO_CONFIG_INIT;
        z.stage = k + 1;
        z.optim = fuzz_optim_config(2);
        if (ddp_zero_create(f->group, f->params, FUZZ_NPARAMS, &z, &f->zero[k]) != DDP_OK)
            return -1;
    }
    return 0;
}

#ifdef FUZZ_WITH_POWERSGD
#include <ddp/powersgd.h>

static inline ddp_powersgd_config_t fuzz_powersgd_config(void)
{
    ddp_powersgd_config_t c = DDP_POWERSGD_CONFIG_INIT;
    c.matrix_approximation_rank = 2;
    c.start_powersgd_iter = 2;
    c.min_compression_rate = 1.0;
    c.random_seed = 7;
    return c;
}
#endif


/* ---- the trainers' checkpoints (fuzz_fm_checkpoint.c, fuzz_gpt_checkpoint.c, make_seeds.c) --- */
#ifdef FUZZ_WITH_FM
#include "trainer.h"

#define FUZZ_FM_HIDDEN 4
#define FUZZ_FM_CONFIGS 3 /* the trainer's SGD, its Adam, libddp's AdamW + PowerSGD states */

static inline fm_hyper_t fuzz_fm_hyper(int which)
{
    fm_hyper_t h;
    memset(&h, 0, sizeof h);
    h.hidden = FUZZ_FM_HIDDEN;
    h.batch = 8;
    h.accumulate = 1;
    h.subset = 64;
    h.seed = 1;
    h.lr = 1e-3;
    h.optim = which == 0 ? FM_OPTIM_SGD : which == 1 ? FM_OPTIM_ADAM : FM_OPTIM_ADAMW;
    if (which == 0) h.momentum = 0.9;
    else {
        h.beta1 = 0.9;
        h.beta2 = 0.999;
        h.eps = 1e-8;
    }
    if (which == 2) {
        h.hook = 3; /* main.c's FM_HOOK_POWERSGD */
        h.library_optim = 1;
        h.lr_schedule = 1;
        h.warmup_steps = 2;
        h.schedule_steps = 16;
        h.clip_grad = 1.0;
    }
    return h;
}
#endif

#ifdef FUZZ_WITH_GPT
#include "gpt.h"

static inline gpt_config_t fuzz_gpt_config(void)
{
    gpt_config_t c = {.layers = 1, .heads = 1, .channels = 4, .context = 4};
    return c;
}

/* The header a run of fuzz_gpt_config with these settings expects (as main.c's ckpt_header). */
static inline gpt_ckpt_header_t fuzz_gpt_header(size_t nparams)
{
    gpt_ckpt_header_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, GPT_CKPT_MAGIC, 8);
    uint64_t u[GPT_CK_NU] = {1, 1, 4, 4, 2, 1, 10, 2, 1337, 0};
    double d[GPT_CK_ND] = {3e-4, 0.1, 0.1, 1.0, 0.1};
    memcpy(h.u, u, sizeof u);
    memcpy(h.d, d, sizeof d);
    h.nparams = nparams;
    return h;
}

/* The trainer's optimizer over the model: one parameter per tensor, AdamW, weight decay on the
 * matrices only (group 0), none on vectors (group 1). params: m->ntensors entries. */
static inline ddp_status_t fuzz_gpt_optim(gpt_t *m, ddp_param_t *params, uint32_t *groups,
                                          ddp_optim_t **out)
{
    static const ddp_optim_group_t g[2] = {{3e-4, 0.1}, {3e-4, 0.0}};
    for (size_t i = 0; i < m->ntensors; i++) {
        memset(&params[i], 0, sizeof params[i]);
        params[i].name = m->tensors[i].name;
        params[i].data = m->params + m->tensors[i].offset;
        params[i].numel = m->tensors[i].numel;
        params[i].dtype = DDP_F32;
        groups[i] = m->tensors[i].rows ? 0 : 1;
    }
    ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
    c.kind = DDP_OPTIM_ADAMW;
    c.max_grad_norm = 1.0;
    c.ngroups = 2;
    c.groups = g;
    c.param_groups = groups;
    return ddp_optim_create(params, m->ntensors, &c, out);
}
#endif

#endif
