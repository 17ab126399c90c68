/* The rendezvous of ddp_group_create_from_env (src/group/rendezvous.c). Not installed. */
#ifndef DDP_GROUP_RENDEZVOUS_H
#define DDP_GROUP_RENDEZVOUS_H

#include "ddp/env.h"
#include "ddp/store.h"

typedef struct ddp__rendezvous {
    ddp_store_t *store;          /* connected; the group owns it */
    ddp_store_t *base;           /* when `store` is a prefix view of it (a restart attempt's
                                    keys): the group destroys it after `store`; else NULL */
    ddp_store_server_t *server;  /* the server this rank hosts, or NULL; the group owns it */
    int hosted_by_rank;          /* the store lives in a rank (mpirun, srun): its host must
                                    outlast the others' use of it (see ddp_group_destroy) */
} ddp__rendezvous_t;

/* Finds (or, on the rank whose turn it is, hosts) the store of a job of env->world_size > 1
 * ranks and connects to it. On failure nothing is left open. */
ddp_status_t ddp__rendezvous(const ddp_env_t *env, int timeout_ms, ddp__rendezvous_t *out);

/* The port an srun job's store listens on, from its job and step ids (10000-32767). */
int ddp__slurm_store_port(long long job_id, long long step_id);

#endif
