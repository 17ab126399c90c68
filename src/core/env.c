/* ddp_env_read: where this rank sits in the job, from the variables a launcher exported.
 * Three launchers are understood, tried in this order: torchrun/ddprun (RANK, WORLD_SIZE, ...),
 * Open MPI's mpirun (OMPI_COMM_WORLD_*) and MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCAL*). */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

/* The variable names of one launcher. The local pair may be absent on a single host. */
typedef struct launcher_vars {
    const char *source;
    const char *rank;
    const char *world_size;
    const char *local_rank;
    const char *local_world_size;
} launcher_vars_t;

static const launcher_vars_t launchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
};

/* Parses a variable that must be a non-negative decimal integer fitting an int.
 * Returns 1 and *out when set, 0 when unset, or an error status (< 0). */
static int read_count(const char *name, int *out)
{
    const char *text = getenv(name);
    if (!text) return 0;
    const char *p = text;
    if (*p == '+') p++;
    if (*p < '0' || *p > '9') {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a non-negative integer", name,
                          text);
    }
    errno = 0;
    char *end = NULL;
    long long value = strtoll(p, &end, 10);
    if (*end != '\0') {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a non-negative integer", name,
                          text);
    }
    if (errno == ERANGE || value > INT_MAX) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is too large (at most %d)", name, text,
                          INT_MAX);
    }
    *out = (int)value;
    return 1;
}

static int any_set(const launcher_vars_t *l)
{
    return getenv(l->rank) || getenv(l->world_size) || getenv(l->local_rank) ||
           getenv(l->local_world_size);
}

static ddp_status_t read_launcher(const launcher_vars_t *l, ddp_env_t *env)
{
    int rank = 0, world = 0, local_rank = 0, local_world = 0;
    int got;
    if ((got = read_count(l->world_size, &world)) < 0) return (ddp_status_t)got;
    if (got == 0) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s is not set, but other %s variables (%s, %s, %s) are",
                          l->world_size, l->source, l->rank, l->local_rank,
                          l->local_world_size);
    }
    if ((got = read_count(l->rank, &rank)) < 0) return (ddp_status_t)got;
    if (got == 0) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not set, but %s=%d is", l->rank,
                          l->world_size, world);
    }
    if (world < 1) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s=%d: the job needs at least one rank",
                          l->world_size, world);
    }
    if (rank >= world) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s=%d is not below %s=%d", l->rank, rank,
                          l->world_size, world);
    }

    int has_local_rank = read_count(l->local_rank, &local_rank);
    if (has_local_rank < 0) return (ddp_status_t)has_local_rank;
    int has_local_world = read_count(l->local_world_size, &local_world);
    if (has_local_world < 0) return (ddp_status_t)has_local_world;
    if (!has_local_rank && !has_local_world) {
        /* A hand-set environment with only the global pair: assume one host. */
        local_rank = rank;
        local_world = world;
    } else if (!has_local_rank) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not set but %s=%d is", l->local_rank,
                          l->local_world_size, local_world);
    } else if (!has_local_world) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not set but %s=%d is",
                          l->local_world_size, l->local_rank, local_rank);
    }
    if (local_world < 1 || local_world > world) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s=%d must be between 1 and %s=%d",
                          l->local_world_size, local_world, l->world_size, world);
    }
    if (local_rank >= local_world) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s=%d is not below %s=%d", l->local_rank,
                          local_rank, l->local_world_size, local_world);
    }
    env->rank = rank;
    env->world_size = world;
    env->local_rank = local_rank;
    env->local_world_size = local_world;
    env->source = l->source;
    return DDP_OK;
}

/* MASTER_ADDR/MASTER_PORT (both or neither) and DDP_STORE_TOKEN, under any launcher: mpirun jobs
 * that use a TCP store export them by hand. */
static ddp_status_t read_rendezvous(ddp_env_t *env)
{
    const char *addr = getenv("MASTER_ADDR");
    const char *port_text = getenv("MASTER_PORT");
    if (addr) {
        if (addr[0] == '\0') return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is empty");
        if (strlen(addr) >= sizeof env->master_addr) {
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "MASTER_ADDR is %zu characters long (at most %zu)", strlen(addr),
                              sizeof env->master_addr - 1);
        }
    }
    int port = 0;
    if (port_text) {
        int got = read_count("MASTER_PORT", &port);
        if (got < 0) return (ddp_status_t)got;
        if (port < 1 || port > 65535) {
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "MASTER_PORT='%s' is out of range (1 to 65535)", port_text);
        }
    }
    if (addr && !port_text) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MASTER_PORT is not set but MASTER_ADDR='%s' is",
                          addr);
    }
    if (port_text && !addr) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is not set but MASTER_PORT=%d is",
                          port);
    }
    const char *token = getenv("DDP_STORE_TOKEN");
    if (token && strlen(token) >= sizeof env->token) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "DDP_STORE_TOKEN is %zu characters long (at most %zu)", strlen(token),
                          sizeof env->token - 1);
    }
    snprintf(env->master_addr, sizeof env->master_addr, "%s", addr ? addr : "");
    env->master_port = port;
    snprintf(env->token, sizeof env->token, "%s", token ? token : "");
    return DDP_OK;
}

ddp_status_t ddp_env_read(ddp_env_t *out)
{
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    ddp__clear_error();
    const launcher_vars_t *found = NULL;
    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0] && !found; i++) {
        if (any_set(&launchers[i])) found = &launchers[i];
    }
    if (!found) {
        return ddp__error(DDP_ERR_NOT_FOUND,
                          "no launcher variables: looked for RANK and WORLD_SIZE (ddprun, "
                          "torchrun), OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (Open MPI "
                          "mpirun), PMI_RANK and PMI_SIZE (MPICH mpiexec); start the program "
                          "with ddprun -n N");
    }
    /* Fill a copy so *out is set only on success. */
    ddp_env_t env;
    memset(&env, 0, sizeof env);
    ddp_status_t status = read_launcher(found, &env);
    if (status != DDP_OK) return status;
    status = read_rendezvous(&env);
    if (status != DDP_OK) return status;
    *out = env;
    return DDP_OK;
}
