/* The launcher's environment: where this rank is and where the rendezvous store lives.
 * Reads torchrun's and ddprun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), Open
 * MPI's mpirun (OMPI_COMM_WORLD_*), MPICH's (PMI_RANK, PMI_SIZE, MPI_LOCAL*) or Slurm's srun
 * (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE, the node
 * list, SLURM_JOB_ID, SLURM_STEP_ID), tried in that order. The store's address is
 * DDP_STORE_ADDR/DDP_STORE_PORT (ddprun's own store) or else MASTER_ADDR/MASTER_PORT (torchrun's
 * c10d store, or a libddp store given by hand); its secret DDP_STORE_TOKEN. */
#ifndef DDP_ENV_H
#define DDP_ENV_H

#include <stddef.h>

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_env {
    int rank;
    int world_size;
    int local_rank;
    int local_world_size;
    char master_addr[256]; /* the store's host: DDP_STORE_ADDR, else MASTER_ADDR; "" if neither */
    int master_port;       /* DDP_STORE_PORT, else MASTER_PORT; 0 when not given */
    char token[128];       /* DDP_STORE_TOKEN; "" when unset */
    const char *source;    /* "torchrun", "openmpi", "pmi", "slurm" (static string) */
    /* Which pair named the store: "DDP_STORE_ADDR" (a libddp store, ddprun's), "MASTER_ADDR"
     * (torchrun's convention: a c10d TCPStore or a libddp store) or NULL (none given). */
    const char *store_source;
    int node_rank;         /* SLURM_NODEID, or GROUP_RANK (ddprun, torchrun); -1 when not given */
    long long job_id;      /* SLURM_JOB_ID; -1 when not under Slurm */
    long long step_id;     /* SLURM_STEP_ID; -1 when not under Slurm */
    char nodelist[4096];   /* SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), as Slurm writes it
                              ("node[01-04,07],gpu3"); "" when not under Slurm */
} ddp_env_t;

/* Fills *out. A missing, malformed or inconsistent variable is DDP_ERR_INVALID_ARGUMENT (or
 * DDP_ERR_NOT_FOUND when no launcher variables exist at all) with a message naming it. */
DDP_API ddp_status_t ddp_env_read(ddp_env_t *out);

/* The index-th host (from 0) of a Slurm host list such as "node[01-04,07],gpu3,rack[1-2]-n[1-2]"
 * (brackets hold comma-separated numbers and ranges whose zero padding is kept; several bracket
 * groups in one name multiply). Writes it to out[size] when index is below the count, and the
 * number of hosts to *count (may be NULL). A malformed list (unbalanced brackets, a descending
 * range, an empty name) is DDP_ERR_INVALID_ARGUMENT naming where. */
DDP_API ddp_status_t ddp_env_hostlist_host(const char *list, int index, char *out, size_t size,
                                           int *count);

#ifdef __cplusplus
}
#endif
#endif
