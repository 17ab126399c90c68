/* The one table of DDP_* environment variables (and the launcher variables libddp reads), the
 * log level, and clocks. Add a row here for every variable any part of libddp reads. */
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"

static const ddp_env_var_t env_table[] = {
    {"DDP_TIMEOUT", "300", "seconds any collective, store wait or rendezvous may block"},
    {"DDP_LOG_LEVEL", "none", "none, error, warn, info or debug: what libddp prints to stderr"},
    {"DDP_TRANSPORT", "auto", "auto, shm, tcp or mpi: the process-group transport"},
    {"DDP_STORE_TOKEN", "", "shared secret every TCP store connection presents (set by ddprun)"},
    {"DDP_SOCKET_IFNAME", "", "network interface whose address TCP transports bind to"},
    {"DDP_HIERARCHICAL", "1", "1: allreduce inside each host, then among hosts; 0: flat"},
    {"DDP_SHM_ROUND_BYTES", "262144",
     "shm: bytes per rank per round of broadcast, allgather, reduce_scatter (rank 0's wins)"},
    {"DDP_SHM_ALLREDUCE_ROUND_BYTES", "1048576",
     "shm: bytes per rank per round of the staged allreduce (rank 0's value wins)"},
    {"DDP_SHM_ONESHOT_BYTES", "16384", "shm: allreduces up to this size use the one-shot path"},
    {"DDP_SHM_YIELD_NS", "",
     "shm: how long a waiter yields before it sleeps (default 200 us, 20 ms on progress threads)"},
    {"DDP_SHM_SPIN_NS", "", "shm: fixed spin budget of a waiter before it yields (default adapts)"},
    {"RANK", "", "global rank of this process (set by ddprun or torchrun)"},
    {"WORLD_SIZE", "", "number of ranks in the job"},
    {"LOCAL_RANK", "", "rank of this process on its host"},
    {"LOCAL_WORLD_SIZE", "", "number of ranks on this host"},
    {"MASTER_ADDR", "", "address of the host running the TCP store"},
    {"MASTER_PORT", "", "port of the TCP store"},
    {"GROUP_RANK", "", "rank of this host (node) in the job (set by ddprun)"},
    {"OMPI_COMM_WORLD_RANK", "", "global rank under Open MPI mpirun (when RANK is unset)"},
    {"OMPI_COMM_WORLD_SIZE", "", "number of ranks under Open MPI mpirun"},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "", "rank on this host under Open MPI mpirun"},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "", "number of ranks on this host under Open MPI mpirun"},
    {"PMI_RANK", "", "global rank under MPICH mpiexec (when RANK and OMPI_* are unset)"},
    {"PMI_SIZE", "", "number of ranks under MPICH mpiexec"},
    {"MPI_LOCALRANKID", "", "rank on this host under MPICH mpiexec"},
    {"MPI_LOCALNRANKS", "", "number of ranks on this host under MPICH mpiexec"},
};

size_t ddp_env_vars(const ddp_env_var_t **table)
{
    if (table) *table = env_table;
    return sizeof env_table / sizeof env_table[0];
}

ddp_status_t ddp_config_print(FILE *out)
{
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    fprintf(out, "%-30s %-10s %-16s %s\n", "VARIABLE", "DEFAULT", "CURRENT", "MEANING");
    for (size_t i = 0; i < sizeof env_table / sizeof env_table[0]; i++) {
        const char *cur = getenv(env_table[i].name);
        int secret = strcmp(env_table[i].name, "DDP_STORE_TOKEN") == 0;
        fprintf(out, "%-30s %-10s %-16s %s\n", env_table[i].name,
                env_table[i].default_value[0] ? env_table[i].default_value : "-",
                cur ? (secret ? "(set)" : cur) : "(unset)", env_table[i].help);
    }
    return DDP_OK;
}

const char *ddp__env(const char *name)
{
    const char *v = getenv(name);
    if (v && *v) return v;
    for (size_t i = 0; i < sizeof env_table / sizeof env_table[0]; i++) {
        if (strcmp(env_table[i].name, name) == 0)
            return env_table[i].default_value[0] ? env_table[i].default_value : NULL;
    }
    return NULL;
}

long long ddp__env_int(const char *name, long long fallback)
{
    const char *v = ddp__env(name);
    if (!v) return fallback;
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') return fallback;
    return x;
}

int ddp_default_timeout_ms(void)
{
    const char *v = ddp__env("DDP_TIMEOUT");
    if (v) {
        char *end = NULL;
        double s = strtod(v, &end);
        if (end != v && *end == '\0' && s > 0 && s < 2e6) {
            int ms = (int)(s * 1000.0);
            return ms > 0 ? ms : 1;
        }
    }
    return 300 * 1000;
}

int ddp__log_level(void)
{
    static _Atomic int cached = -1;
    int level = cached;
    if (level >= 0) return level;
    const char *v = getenv("DDP_LOG_LEVEL");
    level = DDP_LOG_NONE;
    if (v) {
        if (!strcmp(v, "error")) level = DDP_LOG_ERROR;
        else if (!strcmp(v, "warn")) level = DDP_LOG_WARN;
        else if (!strcmp(v, "info")) level = DDP_LOG_INFO;
        else if (!strcmp(v, "debug")) level = DDP_LOG_DEBUG;
    }
    cached = level;
    return level;
}

void ddp__log(int level, const char *fmt, ...)
{
    static const char *const names[] = {"", "error", "warn", "info", "debug"};
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[libddp %s] %s\n", names[level < 0 || level > 4 ? 0 : level], line);
}

static int64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t ddp__now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

int64_t ddp__coarse_now_ns(void) { return clock_ns(CLOCK_MONOTONIC_COARSE); }

int64_t ddp__deadline_ns(int timeout_ms)
{
    /* The coarse clock lags the precise one by up to a tick and the tick's own lateness (6.9
     * ms measured with 4 ms ticks): two resolutions of slack keep a deadline from coming early
     * (it may come that much late instead). */
    static _Atomic int64_t slack_ns = -1;
    int64_t slack = atomic_load_explicit(&slack_ns, memory_order_relaxed);
    if (slack < 0) {
        struct timespec res;
        slack = clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0
                    ? 2 * ((int64_t)res.tv_sec * 1000000000LL + res.tv_nsec)
                    : 20000000LL;
        atomic_store_explicit(&slack_ns, slack, memory_order_relaxed);
    }
    return ddp__coarse_now_ns() + (int64_t)timeout_ms * 1000000LL + slack;
}

double ddp__now_us(void) { return (double)ddp__now_ns() / 1000.0; }

double ddp_time_us(void) { return ddp__now_us(); }
