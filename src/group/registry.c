/* Transport registry: maps a transport name to its table of functions.
 *
 * shm and self are always built. tcp and hierarchical live in src/transport/tcp and
 * src/transport/hier, mpi in src/transport/mpi (compiled only when CMake found MPI, which then
 * defines DDP_HAVE_MPI). They are referenced strongly when present — a weak reference would not
 * pull their objects out of the static library — and reported as DDP_ERR_UNSUPPORTED when absent,
 * so a build without one of them still links. */
#include <string.h>

#include "core/internal.h"
#include "group/registry.h"

#if defined(__has_include)
#if __has_include("transport/tcp/tcp.h")
#include "transport/tcp/tcp.h"
#define REGISTRY_TCP (&ddp__transport_tcp)
#endif
#if __has_include("transport/hier/hier.h")
#include "transport/hier/hier.h"
#define REGISTRY_HIER (&ddp__transport_hierarchical)
#endif
#endif
#if defined(DDP_HAVE_MPI)
extern const ddp__transport_ops_t ddp__transport_mpi;
#define REGISTRY_MPI (&ddp__transport_mpi)
#endif

#ifndef REGISTRY_TCP
#define REGISTRY_TCP NULL
#endif
#ifndef REGISTRY_HIER
#define REGISTRY_HIER NULL
#endif
#ifndef REGISTRY_MPI
#define REGISTRY_MPI NULL
#endif

const ddp__transport_ops_t *ddp__transport_find(const char *name, ddp_status_t *status)
{
    const ddp__transport_ops_t *ops = NULL;
    int known = 1;
    if (strcmp(name, "self") == 0) ops = &ddp__transport_self;
    else if (strcmp(name, "shm") == 0) ops = &ddp__transport_shm;
    else if (strcmp(name, "tcp") == 0) ops = REGISTRY_TCP;
    else if (strcmp(name, "hierarchical") == 0) ops = REGISTRY_HIER;
    else if (strcmp(name, "mpi") == 0) ops = REGISTRY_MPI;
    else known = 0;
    if (!known) {
        *status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                             "transport '%s' is unknown (expected auto, shm, tcp, hierarchical or "
                             "mpi)",
                             name);
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
