/* ddp_env_read: where this rank sits in the job, from the variables a launcher exported.
 * Four launchers are understood, tried in this order: torchrun/ddprun (RANK, WORLD_SIZE, ...),
 * Open MPI's mpirun (OMPI_COMM_WORLD_*), MPICH/Hydra (PMI_RANK, PMI_SIZE, MPI_LOCAL*) and Slurm's
 * srun (SLURM_PROCID, ...). The order matters where launchers nest: mpirun or torchrun inside a
 * Slurm allocation still see Slurm's variables, and their own come first. Also here: Slurm's
 * compressed host lists ("node[01-04,07]"). */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
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
    /* Slurm has no local-size variable: it comes from the tasks-per-node list (read_slurm). */
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL},
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
    /* Slurm exports SLURM_NTASKS to a batch script too, which is no task of a step: only
     * SLURM_PROCID marks a process srun started. */
    if (strcmp(l->source, "slurm") == 0) return getenv(l->rank) != NULL;
    return getenv(l->rank) || getenv(l->world_size) || getenv(l->local_rank) ||
           (l->local_world_size && getenv(l->local_world_size));
}

/* The count of node `node` in a Slurm tasks-per-node list such as "2(x3),1" (2 tasks on each of
 * three nodes, then 1). Returns 1 and *out when found, 0 when the list is too short, or an
 * error status (< 0) naming the variable. */
static int tasks_on_node(const char *name, const char *text, int node, int *out)
{
    const char *p = text;
    int first = 0; /* index of the first node the current item covers */
    while (*p) {
        char *end = NULL;
        errno = 0;
        long tasks = strtol(p, &end, 10);
        long repeat = 1;
        if (end == p || tasks < 0 || errno) goto bad;
        p = end;
        if (*p == '(') {
            if (p[1] != 'x') goto bad;
            repeat = strtol(p + 2, &end, 10);
            if (end == p + 2 || *end != ')' || repeat < 1) goto bad;
            p = end + 1;
        }
        if (node < first + repeat) {
            if (tasks > INT_MAX) goto bad;
            *out = (int)tasks;
            return 1;
        }
        if (repeat > INT_MAX - first) goto bad;
        first += (int)repeat;
        if (*p == ',') p++;
        else if (*p) goto bad;
    }
    return 0;
bad:
    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                      "%s='%s' is not a Slurm tasks-per-node list (such as '2(x3),1')", name,
                      text);
}

/* Slurm's extra variables: the step's size (a step may use fewer tasks than the job), node index,
 * tasks on this node, node list, job and step ids. */
static ddp_status_t read_slurm(ddp_env_t *env)
{
    int got, value = 0;
    if ((got = read_count("SLURM_STEP_NUM_TASKS", &value)) < 0) return (ddp_status_t)got;
    if (got && value != env->world_size) {
        if (value < 1 || env->rank >= value)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "SLURM_STEP_NUM_TASKS=%d does not hold SLURM_PROCID=%d", value,
                              env->rank);
        env->world_size = value;
    }
    int node = 0;
    if ((got = read_count("SLURM_NODEID", &node)) < 0) return (ddp_status_t)got;
    env->node_rank = got ? node : -1;
    const char *per_node_name = getenv("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                                                                     : "SLURM_TASKS_PER_NODE";
    const char *per_node = getenv(per_node_name);
    if (per_node && got) {
        int local = 0;
        int found = tasks_on_node(per_node_name, per_node, node, &local);
        if (found < 0) return (ddp_status_t)found;
        if (!found)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' has no entry for SLURM_NODEID=%d",
                              per_node_name, per_node, node);
        if (local < 1 || local > env->world_size || env->local_rank >= local)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "%s='%s' gives node %d %d tasks, which does not hold "
                              "SLURM_LOCALID=%d of %d",
                              per_node_name, per_node, node, local, env->local_rank,
                              env->world_size);
        env->local_world_size = local;
    }
    const char *ids[2] = {"SLURM_JOB_ID", "SLURM_STEP_ID"};
    long long *dest[2] = {&env->job_id, &env->step_id};
    for (int i = 0; i < 2; i++) {
        const char *text = getenv(ids[i]);
        if (!text) continue;
        char *end = NULL;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (end == text || *end || v < 0 || errno)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is not a non-negative integer",
                              ids[i], text);
        *dest[i] = v;
    }
    const char *list_name = getenv("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST"
                                                          : "SLURM_JOB_NODELIST";
    const char *list = getenv(list_name);
    if (list) {
        if (strlen(list) >= sizeof env->nodelist)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is %zu characters long (at most %zu)",
                              list_name, strlen(list), sizeof env->nodelist - 1);
        int count = 0;
        char first[256];
        ddp_status_t s = ddp_env_hostlist_host(list, 0, first, sizeof first, &count);
        if (s != DDP_OK) return ddp__error_context(s, "%s", list_name);
        snprintf(env->nodelist, sizeof env->nodelist, "%s", list);
    }
    return DDP_OK;
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
    int has_local_world = l->local_world_size ? read_count(l->local_world_size, &local_world) : 0;
    if (has_local_world < 0) return (ddp_status_t)has_local_world;
    if (!l->local_world_size) {
        /* Slurm: read_slurm narrows the local size from the tasks-per-node list. */
        local_world = world;
        if (!has_local_rank) local_rank = rank;
        has_local_world = 1;
        has_local_rank = 1;
    }
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

/* One address pair (both or neither). Returns 1 when set, 0 when not, or an error (< 0). */
static int read_address(const char *addr_name, const char *port_name, ddp_env_t *env)
{
    const char *addr = getenv(addr_name);
    const char *port_text = getenv(port_name);
    if (addr) {
        if (addr[0] == '\0') return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is empty", addr_name);
        if (strlen(addr) >= sizeof env->master_addr) {
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is %zu characters long (at most %zu)",
                              addr_name, strlen(addr), sizeof env->master_addr - 1);
        }
    }
    int port = 0;
    if (port_text) {
        int got = read_count(port_name, &port);
        if (got < 0) return got;
        if (port < 1 || port > 65535) {
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%s' is out of range (1 to 65535)",
                              port_name, port_text);
        }
    }
    if (addr && !port_text) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not set but %s='%s' is", port_name,
                          addr_name, addr);
    }
    if (port_text && !addr) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not set but %s=%d is", addr_name,
                          port_name, port);
    }
    if (!addr) return 0;
    snprintf(env->master_addr, sizeof env->master_addr, "%s", addr);
    env->master_port = port;
    env->store_source = addr_name;
    return 1;
}

/* The store's address - DDP_STORE_ADDR/DDP_STORE_PORT (ddprun's own store, which leaves the
 * MASTER_* pair to torch), else MASTER_ADDR/MASTER_PORT - and DDP_STORE_TOKEN, under any
 * launcher. Only the pair in use is checked: under ddprun a torch-only MASTER_PORT need not be
 * valid for libddp. */
static ddp_status_t read_rendezvous(ddp_env_t *env)
{
    int got = read_address("DDP_STORE_ADDR", "DDP_STORE_PORT", env);
    if (got == 0) got = read_address("MASTER_ADDR", "MASTER_PORT", env);
    if (got < 0) return (ddp_status_t)got;
    const char *token = getenv("DDP_STORE_TOKEN");
    if (token && strlen(token) >= sizeof env->token) {
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "DDP_STORE_TOKEN is %zu characters long (at most %zu)", strlen(token),
                          sizeof env->token - 1);
    }
    snprintf(env->token, sizeof env->token, "%s", token ? token : "");
    return DDP_OK;
}

/* ---- Slurm host lists ------------------------------------------------------------------------ */

/* The k-th number (from 0) of a bracket's content such as "01-04,07", with its zero padding, or
 * the count of numbers when out is NULL. Returns the count, or -1 when malformed. */
static long long bracket_numbers(const char *p, size_t len, long long k, char *out, size_t size)
{
    long long total = 0;
    size_t i = 0;
    while (i < len) {
        size_t start = i;
        while (i < len && p[i] >= '0' && p[i] <= '9') i++;
        if (i == start || i - start > 18) return -1;
        int width = (int)(i - start);
        long long lo = strtoll(p + start, NULL, 10), hi = lo;
        if (i < len && p[i] == '-') {
            size_t hs = ++i;
            while (i < len && p[i] >= '0' && p[i] <= '9') i++;
            if (i == hs || i - hs > 18) return -1;
            hi = strtoll(p + hs, NULL, 10);
            if (hi < lo) return -1;
        }
        if (i < len && p[i] != ',') return -1;
        if (i < len) {
            i++;
            if (i == len) return -1; /* a trailing comma */
        }
        long long n = hi - lo + 1;
        if (out && k >= total && k < total + n) {
            snprintf(out, size, "%0*lld", width, lo + (k - total));
            out = NULL; /* found: keep counting only */
        }
        total += n;
        if (total > INT_MAX) return -1;
    }
    return total;
}

/* Hosts of one comma-free element ("rack[1-2]-n[01-02]"): the count, and the k-th when out. */
static ddp_status_t element_host(const char *e, size_t len, long long k, char *out, size_t size,
                                 long long *count)
{
    /* First pass: the count of every bracket group, and their product. */
    long long total = 1;
    for (size_t i = 0; i < len; i++) {
        if (e[i] == ']')
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list: ']' without '[' in '%.*s'",
                              (int)len, e);
        if (e[i] != '[') continue;
        const char *close = memchr(e + i, ']', len - i);
        if (!close)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list: '[' without ']' in '%.*s'",
                              (int)len, e);
        long long n = bracket_numbers(e + i + 1, (size_t)(close - e - i - 1), 0, NULL, 0);
        if (n < 1)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "host list: '%.*s' is not a list of numbers and ascending ranges "
                              "(such as [01-04,07])",
                              (int)(close - e - i + 1), e + i);
        total *= n;
        if (total > INT_MAX)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list: '%.*s' names too many hosts",
                              (int)len, e);
        i = (size_t)(close - e);
    }
    *count = total;
    if (!out || k >= total) return DDP_OK;
    /* Second pass: the last group varies fastest (rack1-n1, rack1-n2, rack2-n1, ...). */
    char buf[512];
    size_t o = 0;
    long long rest = k, span = total;
    for (size_t i = 0; i < len && o < sizeof buf - 1; i++) {
        if (e[i] != '[') {
            buf[o++] = e[i];
            continue;
        }
        const char *close = memchr(e + i, ']', len - i);
        size_t inner = (size_t)(close - e - i - 1);
        long long n = bracket_numbers(e + i + 1, inner, 0, NULL, 0);
        span /= n;
        char number[32] = "";
        bracket_numbers(e + i + 1, inner, rest / span, number, sizeof number);
        rest %= span;
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s", number);
        if (o >= sizeof buf) o = sizeof buf - 1;
        i = (size_t)(close - e);
    }
    buf[o] = '\0';
    if (strlen(buf) >= size)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list: host '%s' is too long (at most %zu)",
                          buf, size - 1);
    memcpy(out, buf, strlen(buf) + 1);
    return DDP_OK;
}

ddp_status_t ddp_env_hostlist_host(const char *list, int index, char *out, size_t size,
                                   int *count)
{
    if (!list) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hostlist_host: list is NULL");
    if (index < 0) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hostlist_host: index %d < 0", index);
    if (!out || size == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hostlist_host: out is NULL or empty");
    long long total = 0;
    const char *p = list;
    int found = 0;
    for (;;) {
        /* The element ends at a comma outside brackets. */
        size_t len = 0;
        int depth = 0;
        while (p[len] && (p[len] != ',' || depth > 0)) {
            if (p[len] == '[') depth++;
            if (p[len] == ']') depth--;
            len++;
        }
        if (len == 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list '%s' has an empty name", list);
        long long n = 0;
        ddp_status_t s = element_host(p, len, found ? -1 : index - total, found ? NULL : out,
                                      size, &n);
        if (s != DDP_OK) return s;
        if (!found && index - total < n) found = 1;
        total += n;
        if (total > INT_MAX)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list '%.60s...' is too long", list);
        if (!p[len]) break;
        p += len + 1;
    }
    if (count) *count = (int)total;
    if (!found)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "host list '%s' has %lld hosts, not %d",
                          list, total, index + 1);
    return DDP_OK;
}

/* ---- the rendezvous host ------------------------------------------------------------------- */

static pthread_mutex_t rendezvous_lock = PTHREAD_MUTEX_INITIALIZER;
static char rendezvous_host[256];

void ddp__set_rendezvous_host(const char *host)
{
    pthread_mutex_lock(&rendezvous_lock);
    snprintf(rendezvous_host, sizeof rendezvous_host, "%s", host ? host : "");
    pthread_mutex_unlock(&rendezvous_lock);
}

const char *ddp__rendezvous_host(void)
{
    /* Written once per rendezvous, before the transports that read it are created: the
     * pointer stays valid, the text is replaced only by a later rendezvous. */
    pthread_mutex_lock(&rendezvous_lock);
    const char *host = rendezvous_host[0] ? rendezvous_host : NULL;
    pthread_mutex_unlock(&rendezvous_lock);
    if (host) return host;
    host = ddp__env("DDP_STORE_ADDR");
    return host ? host : ddp__env("MASTER_ADDR");
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
                          "mpirun), PMI_RANK and PMI_SIZE (MPICH mpiexec), SLURM_PROCID (srun); "
                          "start the program with ddprun -n N");
    }
    /* Fill a copy so *out is set only on success. */
    ddp_env_t env;
    memset(&env, 0, sizeof env);
    env.node_rank = -1;
    env.job_id = -1;
    env.step_id = -1;
    ddp_status_t status = read_launcher(found, &env);
    if (status == DDP_OK && strcmp(found->source, "slurm") == 0) status = read_slurm(&env);
    if (status != DDP_OK) return status;
    if (env.node_rank < 0) {
        int node = 0;
        int got = read_count("GROUP_RANK", &node);
        if (got < 0) return (ddp_status_t)got;
        if (got) env.node_rank = node;
    }
    status = read_rendezvous(&env);
    if (status != DDP_OK) return status;
    *out = env;
    return DDP_OK;
}
