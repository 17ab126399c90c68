/* ZeRO's saved state: a shard is this rank's runs in the optimizer state format (optim_state.c);
 * consolidation gathers every shard everywhere and merges them on the root into whole
 * parameters. */
#include <stdlib.h>

#include "core/internal.h"
#include "shard/zero_internal.h"

static ddp__optim_view_t shard_view(const ddp_zero_t *z)
{
    return (ddp__optim_view_t){&z->setup, z->nparams, z->numel, z->dtype, z->runs,
                               (uint32_t)z->world, (uint32_t)z->rank};
}

/* Overlap mode learns the partition in the first step; before that the shard is not defined. */
static ddp_status_t check_partition_known(const ddp_zero_t *z, const char *who)
{
    for (size_t i = 0; i < z->nparams; i++)
        if (z->stage == 1 && !z->chunked && z->owner[i] < 0)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s: parameter %zu (%s) has no owner yet "
                              "(overlap mode assigns buckets in the first step)", who, i,
                              pname(z, i));
    return DDP_OK;
}

ddp_status_t ddp_zero_state_size(const ddp_zero_t *z, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state size: zero is NULL");
    if (!bytes) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state size: bytes is NULL");
    ddp_status_t s = check_partition_known(z, "zero state size");
    if (s != DDP_OK) return s;
    ddp__optim_view_t v = shard_view(z);
    *bytes = ddp__optim_state_size(&v);
    return DDP_OK;
}

ddp_status_t ddp_zero_state_save(const ddp_zero_t *z, void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state save: zero is NULL");
    ddp_status_t s = check_partition_known(z, "zero state save");
    if (s != DDP_OK) return s;
    ddp__optim_view_t v = shard_view(z);
    return ddp__optim_state_write(&v, buf, size, "zero state save");
}

ddp_status_t ddp_zero_state_load(ddp_zero_t *z, const void *buf, size_t size)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero state load: zero is NULL");
    if (z->overlap)
        return ddp__error(DDP_ERR_UNSUPPORTED, "zero state load: overlap mode learns which rank "
                          "owns which bucket during the first step, after which loading is too "
                          "late; resume with stage 1 without overlap or stage 2");
    ddp__optim_view_t v = shard_view(z);
    return ddp__optim_state_read(&v, &z->setup, z->runs, buf, size, "zero state load");
}

/* The whole-parameter view's runs. */
static ddp__optim_run_t *whole_runs(const ddp_zero_t *z)
{
    return ddp__optim_whole_runs(z->numel, z->nparams, "zero consolidated state");
}

ddp_status_t ddp_zero_consolidated_state_size(const ddp_zero_t *z, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero consolidated state size: zero is "
                              "NULL");
    if (!bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "zero consolidated state size: bytes is "
                          "NULL");
    return ddp__optim_whole_state_size(&z->setup, z->nparams, z->numel, z->dtype, bytes);
}

ddp_status_t ddp_zero_state_consolidate(ddp_zero_t *z, int root, void *buf, size_t size)
{
    const char *who = "zero state consolidate";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!z) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: zero is NULL", who);
    if (root < 0 || root >= z->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: root is %d, expected 0..%d", who, root,
                          z->world - 1);
    ddp_status_t s = check_partition_known(z, who);
    if (s != DDP_OK) return s;
    ddp__optim_view_t mine = shard_view(z);
    ddp__optim_run_t *runs = whole_runs(z);
    if (!runs) return DDP_ERR_NO_MEMORY;
    ddp__optim_view_t whole = {&z->setup, z->nparams, z->numel, z->dtype, runs, 1, 0};
    s = ddp__optim_state_consolidate(z->group, &mine, &whole, root, buf, size, who,
                                     "ddp_zero_consolidated_state_size");
    free(runs);
    return s;
}
