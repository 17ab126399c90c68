/* Transport registry: maps a transport name to its table of functions.
 *
 * tcp and mpi live in src/transport/tcp and src/transport/mpi and may be missing from a build
 * (mpi is only compiled when MPI is found), so they are referenced weakly: a missing one has a
 * NULL address and is reported as DDP_ERR_UNSUPPORTED instead of breaking the link. */
#include <string.h>

#include "core/internal.h"
#include "group/registry.h"

extern const ddp__transport_ops_t ddp__transport_tcp __attribute__((weak));
extern const ddp__transport_ops_t ddp__transport_mpi __attribute__((weak));

const ddp__transport_ops_t *ddp__transport_find(const char *name, ddp_status_t *status)
{
    const ddp__transport_ops_t *ops = NULL;
    int known = 1;
    if (strcmp(name, "self") == 0) ops = &ddp__transport_self;
    else if (strcmp(name, "shm") == 0) ops = &ddp__transport_shm;
    else if (strcmp(name, "tcp") == 0) ops = &ddp__transport_tcp;
    else if (strcmp(name, "mpi") == 0) ops = &ddp__transport_mpi;
    else known = 0;
    if (!known) {
        *status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                             "transport '%s' is unknown (expected auto, shm, tcp or mpi)", name);
        return NULL;
    }
    if (!ops) {
        *status = ddp__error(DDP_ERR_UNSUPPORTED,
                             "transport '%s' is not built into this libddp%s", name,
                             strcmp(name, "mpi") == 0
                                 ? " (it needs MPI at configure time and -DDDP_WITH_MPI=ON)"
                                 : "");
        return NULL;
    }
    *status = DDP_OK;
    return ops;
}
