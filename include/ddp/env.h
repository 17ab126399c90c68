/* The launcher's environment: where this rank is and where the rendezvous store lives.
 * Reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT, plus DDP_STORE_TOKEN from ddprun) or, under mpirun, OMPI_COMM_WORLD_* / PMI_*. */
#ifndef DDP_ENV_H
#define DDP_ENV_H

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_env {
    int rank;
    int world_size;
    int local_rank;
    int local_world_size;
    char master_addr[256]; /* "" when not given (e.g. under mpirun) */
    int master_port;       /* 0 when not given */
    char token[128];       /* DDP_STORE_TOKEN; "" when unset */
    const char *source;    /* "torchrun", "openmpi", "pmi" (static string) */
} ddp_env_t;

/* Fills *out. A missing, malformed or inconsistent variable is DDP_ERR_INVALID_ARGUMENT (or
 * DDP_ERR_NOT_FOUND when no launcher variables exist at all) with a message naming it. */
DDP_API ddp_status_t ddp_env_read(ddp_env_t *out);

#ifdef __cplusplus
}
#endif
#endif
