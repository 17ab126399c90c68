/* What every transport shares: the names of collectives, fingerprints (packing and describing,
 * so every transport's mismatch text reads the same) and the identity of this host. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/transport.h"

const char *ddp__collective_kind_name(ddp__collective_kind_t kind)
{
    switch (kind) {
    case DDP__ALLREDUCE: return "allreduce";
    case DDP__BROADCAST: return "broadcast";
    case DDP__REDUCE_SCATTER: return "reduce_scatter";
    case DDP__ALLGATHER: return "allgather";
    case DDP__BARRIER: return "barrier";
    case DDP__ALLTOALL: return "alltoall";
    case DDP__REDUCE_SCATTER_APPLY: return "reduce_scatter_apply";
    }
    return "unknown";
}

static int has_op(int32_t kind)
{
    return kind == DDP__ALLREDUCE || kind == DDP__REDUCE_SCATTER ||
           kind == DDP__REDUCE_SCATTER_APPLY;
}

void ddp__fingerprint_text(const ddp__fingerprint_t *f, char *buf, size_t size)
{
    snprintf(buf, size, "seq %llu %s %s %s count %llu root %d", (unsigned long long)f->seq,
             ddp__collective_kind_name((ddp__collective_kind_t)f->kind),
             ddp_dtype_name((ddp_dtype_t)f->dtype),
             has_op(f->kind) ? ddp_reduce_op_name((ddp_reduce_op_t)f->op) : "-",
             (unsigned long long)f->count, f->root);
}

void ddp__fingerprint_describe(const ddp__collective_t *c, char *buf, size_t size)
{
    ddp__fingerprint_t f = ddp__fingerprint_of(c);
    ddp__fingerprint_text(&f, buf, size);
}

void ddp__host_identity(char *buf, size_t size)
{
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    snprintf(buf, size, "%s|%s", host, boot);
}
