/* Legacy mode, after fairseq's LegacyDistributedDataParallel: no hooks and no overlap. After
 * backward the caller asks for one reduction of every gradient, which goes through a single flat
 * buffer: gradients of one dtype are copied in (in registration order) until the next one would
 * not fit, the buffer is divided by the world size and all-reduced, and the results are copied
 * back. A parameter larger than the whole buffer is reduced alone, in place. Parameters without
 * a gradient are zero-filled and take part, so every rank issues the same collectives. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "reducer/reducer_internal.h"

typedef struct legacy_param {
    char *name;
    void *grad;
    size_t numel;
    ddp_dtype_t dtype;
} legacy_param_t;

struct ddp_legacy {
    ddp_group_t *group;
    int world;
    legacy_param_t *params;
    size_t nparams;
    size_t buffer_numel;
    unsigned char *buffer; /* buffer_numel elements of the widest dtype */
    int sync;
};

/* Frees without touching the error text (create's failure paths keep theirs). */
static void free_legacy(ddp_legacy_t *legacy)
{
    if (!legacy) return;
    for (size_t i = 0; i < legacy->nparams; i++) free(legacy->params[i].name);
    free(legacy->params);
    free(legacy->buffer);
    free(legacy);
}

void ddp_legacy_destroy(ddp_legacy_t *legacy)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    free_legacy(legacy);
}

ddp_status_t ddp_legacy_create(ddp_group_t *group, const ddp_param_t *params, size_t nparams,
                               size_t buffer_numel, ddp_legacy_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    if (nparams == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nparams is 0: nothing to reduce");
    if (!params) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "params is NULL");
    size_t total = 0, widest = 1;
    for (size_t i = 0; i < nparams; i++) {
        const ddp_param_t *p = &params[i];
        const char *name = p->name ? p->name : "(unnamed)";
        if (p->dtype != DDP_F32 && p->dtype != DDP_F64 && p->dtype != DDP_F16 &&
            p->dtype != DDP_BF16)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): dtype %s is not a floating type",
                              name, i, ddp_dtype_name(p->dtype));
        if (p->numel > 0 && !p->grad)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): grad is NULL (legacy mode reduces "
                              "user-owned gradients)",
                              name, i);
        if (p->sparse)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "parameter '%s' (params[%zu]) is sparse: legacy mode reduces dense "
                              "gradients only",
                              name, i);
        /* total and the flat buffer's byte size are size_t: keep them exact. */
        if (p->numel > PTRDIFF_MAX / 8 - total)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "parameter '%s' (params[%zu]): numel %zu is too large", name, i,
                              p->numel);
        total += p->numel;
        if (ddp_dtype_size(p->dtype) > widest) widest = ddp_dtype_size(p->dtype);
    }
    if (buffer_numel == 0) buffer_numel = (size_t)1 << 28;
    if (buffer_numel > total) buffer_numel = total;

    ddp_legacy_t *l = ddp__calloc(1, sizeof *l, "legacy reducer");
    if (!l) return DDP_ERR_NO_MEMORY;
    l->group = group;
    l->world = ddp_group_size(group);
    l->sync = 1;
    l->buffer_numel = buffer_numel;
    l->params = ddp__calloc(nparams, sizeof *l->params, "legacy reducer");
    l->buffer = ddp__malloc(buffer_numel ? buffer_numel * widest : 1, "legacy buffer");
    if (!l->params || !l->buffer) {
        free_legacy(l);
        return DDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < nparams; i++) {
        legacy_param_t *q = &l->params[i];
        q->name = ddp__strdup(params[i].name ? params[i].name : "(unnamed)", "legacy reducer");
        if (!q->name) {
            free_legacy(l);
            return DDP_ERR_NO_MEMORY;
        }
        q->grad = params[i].grad;
        q->numel = params[i].numel;
        q->dtype = params[i].dtype;
        l->nparams++;
    }
    *out = l;
    return DDP_OK;
}

ddp_status_t ddp_legacy_set_sync(ddp_legacy_t *legacy, int enabled)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!legacy) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "legacy is NULL");
    legacy->sync = enabled ? 1 : 0;
    return DDP_OK;
}

/* Reduces members [first, end) of the dtype list through the flat buffer. */
static ddp_status_t flush(ddp_legacy_t *l, const size_t *members, size_t n)
{
    if (n == 0) return DDP_OK;
    ddp_dtype_t dtype = l->params[members[0]].dtype;
    size_t es = ddp_dtype_size(dtype), offset = 0;
    for (size_t j = 0; j < n; j++) {
        const legacy_param_t *p = &l->params[members[j]];
        memcpy(l->buffer + offset * es, p->grad, p->numel * es);
        offset += p->numel;
    }
    if (l->world > 1) ddp__divide_by(l->buffer, offset, dtype, l->world);
    ddp_status_t s = ddp_group_allreduce(l->group, l->buffer, l->buffer, offset, dtype, DDP_SUM);
    if (s != DDP_OK)
        return ddp__error_context(s, "legacy allreduce of %zu parameters starting at '%s'", n,
                                  l->params[members[0]].name);
    offset = 0;
    for (size_t j = 0; j < n; j++) {
        const legacy_param_t *p = &l->params[members[j]];
        memcpy(p->grad, l->buffer + offset * es, p->numel * es);
        offset += p->numel;
    }
    return DDP_OK;
}

ddp_status_t ddp_legacy_allreduce(ddp_legacy_t *l, const unsigned char *has_grad)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!l) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "legacy is NULL");
    if (!l->sync) return DDP_OK;
    for (size_t i = 0; i < l->nparams; i++)
        if (has_grad && !has_grad[i] && l->params[i].numel > 0)
            memset(l->params[i].grad, 0, l->params[i].numel * ddp_dtype_size(l->params[i].dtype));

    size_t *members = ddp__malloc(l->nparams * sizeof(size_t), "legacy reduction");
    if (!members) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = DDP_OK;
    /* One pass per dtype (fairseq keeps one buffer per device; here per dtype), registration
     * order within it. */
    for (int d = 0; d < DDP_DTYPE_COUNT && s == DDP_OK; d++) {
        size_t n = 0, used = 0;
        for (size_t i = 0; i < l->nparams && s == DDP_OK; i++) {
            legacy_param_t *p = &l->params[i];
            if ((int)p->dtype != d) continue;
            if (p->numel > l->buffer_numel) {
                if (l->world > 1) ddp__divide_by(p->grad, p->numel, p->dtype, l->world);
                s = ddp_group_allreduce(l->group, p->grad, p->grad, p->numel, p->dtype, DDP_SUM);
                if (s != DDP_OK) ddp__error_context(s, "legacy allreduce of '%s'", p->name);
                continue;
            }
            if (used + p->numel > l->buffer_numel) {
                s = flush(l, members, n);
                n = 0;
                used = 0;
            }
            members[n++] = i;
            used += p->numel;
        }
        if (s == DDP_OK) s = flush(l, members, n);
    }
    free(members);
    return s;
}
