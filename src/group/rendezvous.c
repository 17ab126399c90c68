/* Where ddp_group_create_from_env meets the other ranks, whatever launched the job: the store a
 * launcher named (DDP_STORE_ADDR: libddp's own; MASTER_ADDR: probed, c10d's TCPStore or libddp's),
 * else a store one rank hosts - found through MPI under mpirun (rank 0 broadcasts its address with
 * the MPI module's bootstrap op, so the core never links MPI), or under srun at a place every task
 * can compute: the first host of the step's node list, a port derived from the job and step ids.
 * With a store, the group then picks shared memory inside a host and TCP between hosts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"
#include "group/rendezvous.h"
#include "transport/transport.h"

/* 32 hex characters from /dev/urandom. */
static ddp_status_t random_hex(char *out, size_t size)
{
    unsigned char bytes[16];
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, bytes, sizeof bytes) : -1;
    int err = errno;
    if (fd >= 0) close(fd);
    if (n != (ssize_t)sizeof bytes)
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "reading /dev/urandom for a store token");
    for (size_t i = 0; i < sizeof bytes && 2 * i + 2 < size; i++)
        snprintf(out + 2 * i, 3, "%02x", bytes[i]);
    return DDP_OK;
}

static ddp_status_t connect_to(const char *host, int port, const char *token, int timeout_ms,
                               ddp_store_t **store)
{
    ddp__set_rendezvous_host(host);
    ddp_status_t s = ddp_store_tcp_connect(host, port, token, timeout_ms, store);
    return s == DDP_OK ? s : ddp__error_context(s, "connecting to the store at %s:%d", host, port);
}

/* ---- mpirun: rank 0 hosts, MPI carries its address ------------------------------------------- */

#define BOOTSTRAP_BYTES 768

/* The address other hosts reach rank 0's store by: the IPv4 address of DDP_SOCKET_IFNAME when
 * set, else of the first interface that is up and not loopback, else the hostname. Not the
 * hostname first: Debian maps it to 127.0.1.1, which no other host can reach. */
static ddp_status_t advertise_address(char *out, size_t size)
{
    const char *ifname = ddp__env("DDP_SOCKET_IFNAME");
    struct ifaddrs *list = NULL;
    if (getifaddrs(&list) == 0) {
        for (struct ifaddrs *a = list; a; a = a->ifa_next) {
            if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
            if (ifname ? strcmp(a->ifa_name, ifname) != 0
                       : (a->ifa_flags & IFF_LOOPBACK) || !(a->ifa_flags & IFF_UP))
                continue;
            inet_ntop(AF_INET, &((struct sockaddr_in *)a->ifa_addr)->sin_addr, out,
                      (socklen_t)size);
            freeifaddrs(list);
            return DDP_OK;
        }
        freeifaddrs(list);
    }
    if (ifname)
        return ddp__error(DDP_ERR_NOT_FOUND, "DDP_SOCKET_IFNAME=%s has no IPv4 address", ifname);
    if (gethostname(out, size) != 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "gethostname");
    out[size - 1] = '\0';
    return DDP_OK;
}

static ddp_status_t through_mpi(const ddp_env_t *env, int timeout_ms, ddp__rendezvous_t *out)
{
    ddp_status_t s;
    /* The launcher's runtime is reached through the storeless transport that declares a
     * bootstrap (transport.h), not by a name. */
    const ddp__transport_ops_t *runtime = ddp__transport_storeless(&s);
    if (!runtime || !runtime->bootstrap) {
        char why[DDP_ERROR_TEXT_MAX];
        if (runtime)
            snprintf(why, sizeof why, "transport %s declares no bootstrap", runtime->name);
        else
            snprintf(why, sizeof why, "%s", ddp_last_error());
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "%d ranks started by %s with no store address meet through MPI, but "
                          "%s; or export DDP_STORE_ADDR and DDP_STORE_PORT naming a libddp store "
                          "(ddprun -n 1 hosts one)",
                          env->world_size, env->source, why);
    }
    /* One host (mpirun's local size is the world): loopback. Several: every interface, and the
     * address others reach this host by (advertise_address). The token keeps other users'
     * processes out. */
    int one_host = env->local_world_size == env->world_size;
    char msg[BOOTSTRAP_BYTES];
    memset(msg, 0, sizeof msg);
    if (env->rank == 0) {
        char token[40] = "", host[256] = "127.0.0.1";
        s = random_hex(token, sizeof token);
        if (s == DDP_OK && !one_host) s = advertise_address(host, sizeof host);
        if (s == DDP_OK)
            s = ddp_store_server_start(one_host ? "127.0.0.1" : "0.0.0.0", 0, token, &out->server);
        if (s == DDP_OK)
            snprintf(msg, sizeof msg, "S %d %s %s", ddp_store_server_port(out->server), token,
                     host);
        else
            snprintf(msg, sizeof msg, "E rank 0 could not host the store: %s", ddp_last_error());
    }
    int mpi_rank = -1, mpi_world = -1;
    s = runtime->bootstrap->bcast(msg, sizeof msg, timeout_ms, &mpi_rank, &mpi_world);
    if (s != DDP_OK) return ddp__error_context(s, "the rendezvous through MPI");
    msg[sizeof msg - 1] = '\0';
    if (mpi_rank != env->rank || mpi_world != env->world_size)
        return ddp__error(DDP_ERR_MISMATCH,
                          "the rendezvous through MPI: MPI_COMM_WORLD says rank %d of %d, but the "
                          "launcher's variables (%s) say rank %d of %d",
                          mpi_rank, mpi_world, env->source, env->rank, env->world_size);
    if (msg[0] != 'S') return ddp__error(DDP_ERR_REMOTE, "%s", msg[0] == 'E' ? msg + 2 : msg);
    int port = 0;
    char token[64] = "", host[300] = "";
    if (sscanf(msg, "S %d %63s %299s", &port, token, host) != 3)
        return ddp__error(DDP_ERR_PROTOCOL, "the rendezvous through MPI: rank 0 sent '%s'", msg);
    out->hosted_by_rank = 1;
    DDP_LOG(DDP_LOG_INFO, "rank %d: the store is rank 0's at %s:%d (found through MPI)", env->rank,
            host, port);
    return connect_to(host, port, token, timeout_ms, &out->store);
}

/* ---- srun: the first node's first task hosts at a computed place ---------------------------- */

int ddp__slurm_store_port(long long job_id, long long step_id)
{
    /* A mix of both ids (splitmix64's finaliser), into 10000-32767: below Linux's ephemeral
     * range (32768-60999), where outgoing connections take their ports, and above the usual
     * services. Two jobs sharing a first node collide with probability 1/22768; the host then
     * fails to bind and names DDP_STORE_PORT. */
    uint64_t h = (uint64_t)job_id * 0x9e3779b97f4a7c15ull + (uint64_t)step_id + 1;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    return 10000 + (int)(h % 22768u);
}

/* The job's token: DDP_STORE_TOKEN when the user exported it (srun hands every task the
 * submitting shell's environment, so one `export DDP_STORE_TOKEN=$(openssl rand -hex 16)` in the
 * batch script reaches every rank and no file is needed), else the secret in $HOME/.ddp/
 * store-secret: created on first use with mode 0600 in a 0700 directory, read by every task
 * through the home directory a cluster shares among its nodes, and refused if anyone but its
 * owner could read it. */
static ddp_status_t slurm_token(const ddp_env_t *env, char *out, size_t size)
{
    if (env->token[0]) {
        snprintf(out, size, "%s", env->token);
        return DDP_OK;
    }
    const char *home = getenv("HOME");
    if (!home || !*home)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "under srun without DDP_STORE_TOKEN the store's secret is read from "
                          "$HOME/.ddp/store-secret, but HOME is not set");
    char dir[PATH_MAX], path[PATH_MAX], tmp[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/.ddp", home);
    snprintf(path, sizeof path, "%s/store-secret", dir);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "creating %s for the store's secret", dir);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
        /* Create it whole under a private name, then link it into place: link is atomic even on
         * NFS, so a task on another node sees no file or the whole secret, and of two creators
         * one wins and both read the winner's. */
        char secret[40] = "", host[64] = "host";
        ddp_status_t s = random_hex(secret, sizeof secret);
        if (s != DDP_OK) return s;
        gethostname(host, sizeof host);
        host[sizeof host - 1] = '\0';
        snprintf(tmp, sizeof tmp, "%s.%s.%d", path, host, (int)getpid());
        int w = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (w < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "creating %s", tmp);
        size_t n = strlen(secret);
        int ok = write(w, secret, n) == (ssize_t)n && write(w, "\n", 1) == 1 && fsync(w) == 0;
        int err = errno;
        close(w);
        if (ok && link(tmp, path) != 0 && errno != EEXIST) {
            ok = 0;
            err = errno;
        }
        unlink(tmp);
        if (!ok) return ddp__error_errno(DDP_ERR_SYSTEM, err, "writing the store's secret %s", path);
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "opening %s", path);
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0 ||
        !S_ISREG(st.st_mode)) {
        close(fd);
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "the store's secret %s must be a file of yours that only you can read "
                          "(it is mode %03o, owner %d): chmod 600 it, or export DDP_STORE_TOKEN",
                          path, (unsigned)(st.st_mode & 0777), (int)st.st_uid);
    }
    char buf[130];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) n = 0;
    buf[n] = '\0';
    buf[strcspn(buf, "\r\n")] = '\0';
    if (strlen(buf) < 16 || strlen(buf) >= size)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "the store's secret %s holds %zu characters (16 to %zu expected)", path,
                          strlen(buf), size - 1);
    snprintf(out, size, "%s", buf);
    return DDP_OK;
}

static ddp_status_t through_slurm(const ddp_env_t *env, int timeout_ms, ddp__rendezvous_t *out)
{
    if (!env->nodelist[0])
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%d ranks started by srun with no store address: the store's host is "
                          "the first of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), and neither "
                          "is set; or export DDP_STORE_ADDR and DDP_STORE_PORT",
                          env->world_size);
    if (env->job_id < 0 || env->step_id < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%d ranks started by srun with no store address: the store's port "
                          "derives from SLURM_JOB_ID and SLURM_STEP_ID, and %s is not set; or "
                          "export DDP_STORE_ADDR and DDP_STORE_PORT",
                          env->world_size, env->job_id < 0 ? "SLURM_JOB_ID" : "SLURM_STEP_ID");
    char first[256];
    int nodes = 0;
    ddp_status_t s = ddp_env_hostlist_host(env->nodelist, 0, first, sizeof first, &nodes);
    if (s != DDP_OK) return ddp__error_context(s, "the step's node list");
    char token[128];
    s = slurm_token(env, token, sizeof token);
    if (s != DDP_OK) return s;
    int port = ddp__slurm_store_port(env->job_id, env->step_id);
    /* One node: loopback only. Several: every interface of the first node, behind the token. */
    const char *host = nodes == 1 ? "127.0.0.1" : first;
    int hosting = env->node_rank >= 0 ? env->node_rank == 0 && env->local_rank == 0
                                      : env->rank == 0;
    if (hosting) {
        s = ddp_store_server_start(nodes == 1 ? "127.0.0.1" : "0.0.0.0", port, token, &out->server);
        if (s != DDP_OK)
            return ddp__error_context(s,
                                      "rank %d (the first task of node %s) cannot host the store "
                                      "on port %d, derived from SLURM_JOB_ID=%lld and "
                                      "SLURM_STEP_ID=%lld (another job on this node may hold it: "
                                      "export DDP_STORE_ADDR and DDP_STORE_PORT to choose one)",
                                      env->rank, first, port, env->job_id, env->step_id);
    }
    out->hosted_by_rank = 1;
    DDP_LOG(DDP_LOG_INFO, "rank %d: the store is at %s:%d (node %s, job %lld step %lld)", env->rank,
            host, port, first, env->job_id, env->step_id);
    return connect_to(host, port, token, timeout_ms, &out->store);
}

ddp_status_t ddp__rendezvous(const ddp_env_t *env, int timeout_ms, ddp__rendezvous_t *out)
{
    memset(out, 0, sizeof *out);
    ddp_status_t s;
    if (env->store_source && strcmp(env->store_source, "DDP_STORE_ADDR") == 0) {
        s = connect_to(env->master_addr, env->master_port, env->token, timeout_ms, &out->store);
    } else if (env->store_source) {
        /* torchrun's convention: MASTER_ADDR may name its c10d TCPStore or a libddp store. */
        ddp__set_rendezvous_host(env->master_addr);
        s = ddp_store_connect(env->master_addr, env->master_port, env->token, timeout_ms,
                              &out->store);
        if (s != DDP_OK)
            ddp__error_context(s, "the store at MASTER_ADDR=%s MASTER_PORT=%d", env->master_addr,
                               env->master_port);
    } else if (strcmp(env->source, "openmpi") == 0 || strcmp(env->source, "pmi") == 0) {
        s = through_mpi(env, timeout_ms, out);
    } else if (strcmp(env->source, "slurm") == 0) {
        s = through_slurm(env, timeout_ms, out);
    } else {
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                       "%d ranks from launcher '%s' need a store: DDP_STORE_ADDR and "
                       "DDP_STORE_PORT (a libddp store, as ddprun exports) or MASTER_ADDR and "
                       "MASTER_PORT (a c10d TCPStore, as torchrun exports, or a libddp store)",
                       env->world_size, env->source);
    }
    /* torchrun restarts its workers on the same store (its agent's): each attempt's keys go
     * under their own prefix, as torch's own workers' do (/worker/attempt_N), so keys a failed
     * attempt left half-written - a group's instance counter one rank had bumped - cannot
     * mislead the next attempt. */
    const char *attempt = getenv("TORCHELASTIC_RESTART_COUNT");
    if (s == DDP_OK && attempt && *attempt) {
        char *end = NULL;
        long n = strtol(attempt, &end, 10);
        if (*end || n < 0 || end == attempt) {
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                           "TORCHELASTIC_RESTART_COUNT='%s' is not a non-negative integer",
                           attempt);
        } else {
            char prefix[64];
            snprintf(prefix, sizeof prefix, "ddp/attempt_%ld", n);
            out->base = out->store;
            out->store = NULL;
            s = ddp_store_prefix_create(out->base, prefix, &out->store);
        }
    }
    if (s != DDP_OK) {
        ddp_store_destroy(out->store);
        ddp_store_destroy(out->base);
        ddp_store_server_stop(out->server);
        memset(out, 0, sizeof *out);
    }
    return s;
}
