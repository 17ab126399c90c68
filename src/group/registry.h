/* The transports the group layer can choose from, looked up by name. shm and self are always
 * built; tcp and mpi are written in their own folders and may be absent from a build. */
#ifndef DDP_GROUP_REGISTRY_H
#define DDP_GROUP_REGISTRY_H

#include "group/transport.h"

/* Built-in transports. */
extern const ddp__transport_ops_t ddp__transport_self;
extern const ddp__transport_ops_t ddp__transport_shm;

/* The transport called `name` ("self", "shm", "tcp", "mpi"), or NULL with DDP_ERR_UNSUPPORTED
 * (not built into this library) or DDP_ERR_INVALID_ARGUMENT (unknown name) recorded as the
 * calling thread's error. */
const ddp__transport_ops_t *ddp__transport_find(const char *name, ddp_status_t *status);

#endif
