/* The one table of DDP_* environment variables (and the launcher variables libddp reads). Add a
 * row here for every variable any part of libddp reads. The log is in log.c, clocks in clock.c. */
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "core/transports.h"

/* Every variable is one row: X(name, default, rule, low, high, choices, help). The rule says how
 * a value is checked by the readers below, and the "accepted" column of the public table is made
 * from it, so what the error text, --print-config and the check say cannot drift apart:
 *   TEXT     any value; `choices` says what it is (shown as accepted)
 *   CHOICE   one of the '|'-separated `choices`, spelled exactly
 *   INTEGER  a decimal integer from `low` to `high`
 *   SECONDS  a decimal number of seconds, > 0 and <= `high`, read as milliseconds
 * Unset and empty both mean the default. */
#define ENV_TABLE(X)                                                                               \
    X("DDP_TIMEOUT", "300", SECONDS, 0, 2000000, "",                                               \
      "seconds any collective, store wait or rendezvous may block")                               \
    X("DDP_LOG_LEVEL", "none", CHOICE, 0, 0, "none|error|warn|info|debug",                         \
      "what libddp prints to stderr")                                                              \
    X("DDP_TRANSPORT", "auto", CHOICE, 0, 0, DDP_TRANSPORT_CHOICES,                                \
      "the process-group transport; auto: shm on one host, else hierarchical"                     \
      DDP_TRANSPORT_HELP)                                                                          \
    X("DDP_STORE_TOKEN", "", TEXT, 0, 0, "any text",                                               \
      "shared secret every TCP store connection presents (set by ddprun)")                        \
    X("DDP_SOCKET_IFNAME", "", TEXT, 0, 0, "an interface name",                                    \
      "network interface whose address TCP transports bind to")                                   \
    X("DDP_HIERARCHICAL", "1", CHOICE, 0, 0, "0|1",                                                \
      "1: allreduce inside each host, then among hosts; 0: flat")                                 \
    /* shm: the byte counts' bounds are those of the stage (STAGE_BYTES, 1 MiB) in shm.c. */     \
    X("DDP_SHM_ROUND_BYTES", "262144", INTEGER, 4096, 1048576, "",                                 \
      "shm: bytes per rank per round of broadcast, allgather, reduce_scatter (rank 0's wins)")    \
    X("DDP_SHM_ALLREDUCE_ROUND_BYTES", "1048576", INTEGER, 4096, 1048576, "",                      \
      "shm: bytes per rank per round of the staged allreduce (rank 0's value wins)")              \
    X("DDP_SHM_ONESHOT_BYTES", "16384", INTEGER, 0, 1048576, "",                                   \
      "shm: allreduces up to this size use the one-shot path (rank 0's value wins)")              \
    X("DDP_SHM_TUNE", "online", CHOICE, 0, 0, "off|probe|online",                                \
      "shm: how allreduce variants are chosen: off: fixed thresholds; probe: measured on the "    \
      "first calls of each size; online: and re-tried now and then (rank 0 decides)")            \
    X("DDP_SHM_STAGED_STORES", "auto", CHOICE, 0, 0, "auto|nt|plain",                            \
      "shm: stage writes of the staged allreduce: auto: tuned; nt: non-temporal stores only; "    \
      "plain: plain stores only (the round size is DDP_SHM_STAGED_ROUNDS')")                       \
    X("DDP_SHM_STAGED_ROUNDS", "auto", CHOICE, 0, 0, "auto|long|short",                           \
      "shm: round size of the staged allreduce: auto: tuned (default long with nt stores, short "  \
      "with plain); long: DDP_SHM_ALLREDUCE_ROUND_BYTES only; short: DDP_SHM_ROUND_BYTES only")   \
    X("DDP_SHM_MAPPED_STORES", "auto", CHOICE, 0, 0, "auto|nt|plain",                             \
      "shm: result writes of the mapped allreduce and pulled allgather and alltoall from 2 MiB "   \
      "and pulled broadcast from 4 MiB (else from 8 MiB): auto: non-temporal from there on Intel " \
      "CPUs, plain elsewhere; nt: non-temporal; plain: plain stores")                              \
    X("DDP_SHM_CMA", "auto", CHOICE, 0, 0, "auto|off",                                            \
      "shm: auto: large allreduces of user buffers read peers' buffers directly "                 \
      "(process_vm_readv) when every rank can; off: stage them through the segment")             \
    X("DDP_SHM_MAP", "auto", CHOICE, 0, 0, "auto|on|off",                                        \
      "shm: on: memory registered with ddp_group_register_memory moves onto shared memory and "   \
      "allreduces on it read peers' buffers in place; auto: also allreduce buffers that are "      \
      "large malloc chunks, registered by libddp when they come back; off: neither")              \
    X("DDP_SHM_MAP_WATCH", "auto", CHOICE, 0, 0, "auto|off",                                      \
      "shm: auto: a userfaultfd hears when registered memory is unmapped or moved, so that a "     \
      "mapped collective needs no system call to check it is still there; off: a system call "    \
      "every collective")                                                                          \
    X("DDP_SHM_CMA_BYTES", "1048576", INTEGER, 0, 1099511627776, "",                              \
      "shm: smallest allreduce that may read peers' buffers directly (rank 0's value wins)")      \
    X("DDP_SHM_CMA_HUGEPAGES", "1", INTEGER, 0, 1, "",                                             \
      "shm: 1: back a user buffer reused by single-copy allreduces with huge pages "              \
      "(MADV_COLLAPSE, content unchanged); 0: leave its pages alone")                             \
    /* At most 100 ms: the spin and yield loops look at neither deadlines nor peers' deaths. */   \
    X("DDP_SHM_YIELD_NS", "", INTEGER, 0, 100000000, "",                                           \
      "shm: how long a waiter yields before it sleeps (default 200 us, 20 ms on progress "        \
      "threads)")                                                                                  \
    X("DDP_SHM_SPIN_NS", "", INTEGER, 0, 100000000, "",                                            \
      "shm: fixed spin budget of a waiter before it yields (default adapts)")                     \
    X("RANK", "", TEXT, 0, 0, "", "global rank of this process (set by ddprun or torchrun)")       \
    X("WORLD_SIZE", "", TEXT, 0, 0, "", "number of ranks in the job")                              \
    X("LOCAL_RANK", "", TEXT, 0, 0, "", "rank of this process on its host")                        \
    X("LOCAL_WORLD_SIZE", "", TEXT, 0, 0, "", "number of ranks on this host")                      \
    X("DDP_STORE_ADDR", "", TEXT, 0, 0, "a host name or address",                                \
      "host of the libddp TCP store (set by ddprun)")                                             \
    X("DDP_STORE_PORT", "", TEXT, 0, 0, "1 to 65535", "port of the libddp TCP store (set by ddprun)") \
    X("MASTER_ADDR", "", TEXT, 0, 0, "",                                                           \
      "host of the store when DDP_STORE_ADDR is unset: a c10d TCPStore (torchrun) or libddp's")   \
    X("MASTER_PORT", "", TEXT, 0, 0, "",                                                           \
      "port of that store (ddprun leaves it free for torch)")                                      \
    X("GROUP_RANK", "", TEXT, 0, 0, "", "rank of this host (node) in the job (set by ddprun)")     \
    X("TORCHELASTIC_RESTART_COUNT", "", TEXT, 0, 0, "",                                            \
      "torchrun's restart attempt: each attempt's store keys get their own prefix")               \
    X("OMPI_COMM_WORLD_RANK", "", TEXT, 0, 0, "",                                                  \
      "global rank under Open MPI mpirun (when RANK is unset)")                                   \
    X("OMPI_COMM_WORLD_SIZE", "", TEXT, 0, 0, "", "number of ranks under Open MPI mpirun")         \
    X("OMPI_COMM_WORLD_LOCAL_RANK", "", TEXT, 0, 0, "", "rank on this host under Open MPI mpirun") \
    X("OMPI_COMM_WORLD_LOCAL_SIZE", "", TEXT, 0, 0, "",                                            \
      "number of ranks on this host under Open MPI mpirun")                                       \
    X("PMI_RANK", "", TEXT, 0, 0, "",                                                              \
      "global rank under MPICH mpiexec (when RANK and OMPI_* are unset)")                         \
    X("PMI_SIZE", "", TEXT, 0, 0, "", "number of ranks under MPICH mpiexec")                       \
    X("MPI_LOCALRANKID", "", TEXT, 0, 0, "", "rank on this host under MPICH mpiexec")              \
    X("MPI_LOCALNRANKS", "", TEXT, 0, 0, "", "number of ranks on this host under MPICH mpiexec")  \
    X("SLURM_PROCID", "", TEXT, 0, 0, "", "global rank under srun (when no other launcher's is set)") \
    X("SLURM_NTASKS", "", TEXT, 0, 0, "", "number of ranks under srun (SLURM_STEP_NUM_TASKS wins)") \
    X("SLURM_LOCALID", "", TEXT, 0, 0, "", "rank on this node under srun")                         \
    X("SLURM_NODEID", "", TEXT, 0, 0, "", "index of this node under srun (node 0 hosts the store)") \
    X("SLURM_STEP_NODELIST", "", TEXT, 0, 0, "",                                                   \
      "the step's nodes under srun (else SLURM_JOB_NODELIST); the first hosts the store")         \
    X("SLURM_JOB_NODELIST", "", TEXT, 0, 0, "", "the job's nodes under srun")                    \
    X("SLURM_STEP_NUM_TASKS", "", TEXT, 0, 0, "", "number of ranks of this srun step")            \
    X("SLURM_STEP_TASKS_PER_NODE", "", TEXT, 0, 0, "",                                             \
      "ranks per node of this step, as 2(x3),1 (else SLURM_TASKS_PER_NODE)")                      \
    X("SLURM_TASKS_PER_NODE", "", TEXT, 0, 0, "", "ranks per node of the job under srun")         \
    X("SLURM_JOB_ID", "", TEXT, 0, 0, "", "under srun: with SLURM_STEP_ID, derives the store's port") \
    X("SLURM_STEP_ID", "", TEXT, 0, 0, "", "the srun step's id")

/* The launcher's variables (RANK ... MPI_LOCALNRANKS) are TEXT here: ddp_env_read checks them and
 * reports its own errors, which say which launcher set them. */

#define ACCEPTED_TEXT(low, high, choices) choices
#define ACCEPTED_CHOICE(low, high, choices) "one of " choices
#define ACCEPTED_INTEGER(low, high, choices) "an integer from " #low " to " #high
#define ACCEPTED_SECONDS(low, high, choices)                                                      \
    "seconds, a number > 0 and <= " #high " (e.g. 30 or 0.5)"
#define PUBLIC_ROW(name, def, rule, low, high, choices, help)                                    \
    {name, def, help, ACCEPTED_##rule(low, high, choices)},

static const ddp_env_var_t env_table[] = {ENV_TABLE(PUBLIC_ROW)};

enum rule_kind { RULE_TEXT, RULE_CHOICE, RULE_INTEGER, RULE_SECONDS };

typedef struct {
    enum rule_kind kind;
    long long low, high;
    const char *choices;
} env_rule_t;

#define RULE_ROW(name, def, rule, low, high, choices, help) {RULE_##rule, low, high, choices},

static const env_rule_t env_rules[] = {ENV_TABLE(RULE_ROW)};

#define ENV_ROWS (sizeof env_table / sizeof env_table[0])

size_t ddp_env_vars(const ddp_env_var_t **table)
{
    if (table) *table = env_table;
    return ENV_ROWS;
}

static size_t row_of(const char *name)
{
    for (size_t i = 0; i < ENV_ROWS; i++) {
        if (strcmp(env_table[i].name, name) == 0) return i;
    }
    return ENV_ROWS;
}

/* The value in effect: the environment's when set and non-empty, else the row's default, else
 * NULL. */
static const char *value_of(size_t row)
{
    const char *v = getenv(env_table[row].name);
    if (v && *v) return v;
    return env_table[row].default_value[0] ? env_table[row].default_value : NULL;
}

static ddp_status_t bad_value(size_t row, const char *value)
{
    const ddp_env_var_t *e = &env_table[row];
    return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s='%.200s' is not valid: expected %s%s%s",
                      e->name, value, e->accepted,
                      e->default_value[0] ? "; unset or empty means " : "", e->default_value);
}

/* Whether `value` is one of the '|'-separated words of `choices`. */
static int is_choice(const char *value, const char *choices)
{
    size_t n = strlen(value);
    for (const char *c = choices; *c;) {
        size_t len = strcspn(c, "|");
        if (len == n && strncmp(c, value, n) == 0) return 1;
        c += len;
        if (*c == '|') c++;
    }
    return 0;
}

/* Whether `value` (not NULL) follows row `row`'s rule; the parsed number goes to *integer or
 * *milliseconds when given. Records no error: callers that can report one call bad_value. */
static int is_valid(size_t row, const char *value, long long *integer, int *milliseconds)
{
    const env_rule_t *r = &env_rules[row];
    switch (r->kind) {
    case RULE_TEXT:
        return 1;
    case RULE_CHOICE:
        return is_choice(value, r->choices);
    case RULE_INTEGER: {
        char *end = NULL;
        errno = 0;
        long long x = strtoll(value, &end, 10);
        if (errno != 0 || end == value || *end != '\0' || x < r->low || x > r->high) return 0;
        if (integer) *integer = x;
        return 1;
    }
    case RULE_SECONDS: {
        /* Decimal notation only: strtod would also take "0x10", "inf" and "nan". */
        const char *digits = value + strspn(value, " \t");
        if (digits[strspn(digits, "0123456789.eE+-")] != '\0') return 0;
        char *end = NULL;
        errno = 0;
        double s = strtod(value, &end);
        if (errno != 0 || end == value || *end != '\0' || !(s > 0) || s > (double)r->high)
            return 0;
        /* A value below a millisecond still waits a little: 1 ms. */
        int ms = (int)(s * 1000.0);
        if (milliseconds) *milliseconds = ms > 0 ? ms : 1;
        return 1;
    }
    }
    return 0;
}

ddp_status_t ddp_config_print(FILE *out)
{
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    fprintf(out, "%-30s %-10s %-16s %s\n", "VARIABLE", "DEFAULT", "CURRENT", "MEANING");
    for (size_t i = 0; i < ENV_ROWS; i++) {
        const char *cur = getenv(env_table[i].name);
        int secret = strcmp(env_table[i].name, "DDP_STORE_TOKEN") == 0;
        fprintf(out, "%-30s %-10s %-16s %s\n", env_table[i].name,
                env_table[i].default_value[0] ? env_table[i].default_value : "-",
                cur ? (secret ? "(set)" : cur) : "(unset)", env_table[i].help);
        if (env_table[i].accepted[0])
            fprintf(out, "%-30s accepts %s%s\n", "", env_table[i].accepted,
                    cur && *cur && !is_valid(i, cur, NULL, NULL) ? " - the current value is not"
                                                                 : "");
    }
    return DDP_OK;
}

static ddp_status_t unknown_variable(const char *name)
{
    return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                      "%s is not in libddp's table of variables (src/core/config.c)", name);
}

ddp_status_t ddp__env_text(const char *name, const char **out)
{
    size_t row = row_of(name);
    if (row == ENV_ROWS) return unknown_variable(name);
    const char *v = value_of(row);
    if (v && !is_valid(row, v, NULL, NULL)) return bad_value(row, v);
    *out = v;
    return DDP_OK;
}

ddp_status_t ddp__env_integer(const char *name, long long unset, long long *out)
{
    size_t row = row_of(name);
    if (row == ENV_ROWS) return unknown_variable(name);
    if (env_rules[row].kind != RULE_INTEGER)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not an integer variable", name);
    const char *v = value_of(row);
    long long x = unset;
    if (v && !is_valid(row, v, &x, NULL)) return bad_value(row, v);
    *out = x;
    return DDP_OK;
}

ddp_status_t ddp__env_seconds_ms(const char *name, int *out_ms)
{
    size_t row = row_of(name);
    if (row == ENV_ROWS) return unknown_variable(name);
    if (env_rules[row].kind != RULE_SECONDS || !env_table[row].default_value[0])
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s is not a variable of seconds with a "
                          "default", name);
    int ms = 0;
    const char *v = value_of(row);
    if (!is_valid(row, v, NULL, &ms)) return bad_value(row, v);
    *out_ms = ms;
    return DDP_OK;
}

const char *ddp__env(const char *name)
{
    size_t row = row_of(name);
    if (row != ENV_ROWS) return value_of(row);
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

ddp_status_t ddp_config_check(void)
{
    ddp__clear_error();
    for (size_t row = 0; row < ENV_ROWS; row++) {
        const char *v = value_of(row);
        if (v && !is_valid(row, v, NULL, NULL)) return bad_value(row, v);
    }
    return DDP_OK;
}

ddp_status_t ddp_config_timeout_ms(int *timeout_ms)
{
    if (!timeout_ms)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_config_timeout_ms: timeout_ms is NULL");
    ddp__clear_error();
    return ddp__env_seconds_ms("DDP_TIMEOUT", timeout_ms);
}

int ddp_default_timeout_ms(void)
{
    /* A bad value cannot be reported here, and the caller's last error is left alone: the calls
     * that need the timeout report it (see config.h). */
    int ms = 0;
    const char *v = value_of(row_of("DDP_TIMEOUT"));
    return is_valid(row_of("DDP_TIMEOUT"), v, NULL, &ms) ? ms : 300 * 1000;
}
