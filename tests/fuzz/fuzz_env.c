/* Fuzz target for the parsing of environment variables (src/core/config.c: every DDP_* variable
 * of ddp_env_vars(); src/core/env.c: the launchers' variables and Slurm host lists). Input: lines
 * "NAME=VALUE"; the variables of the table and the launchers' are cleared, the lines exported,
 * then every reader runs. Each must return DDP_OK or an error naming what is wrong. */
#include <stdint.h>
#include <stdlib.h>

#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const launcher_names[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "DDP_STORE_ADDR", "DDP_STORE_PORT",
    "DDP_STORE_TOKEN"};

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    devnull = fopen("/dev/null", "w");
    return 0;
}

static void clear(void)
{
    const ddp_env_var_t *table;
    size_t n = ddp_env_vars(&table);
    for (size_t i = 0; i < n; i++) unsetenv(table[i].name);
    for (size_t i = 0; i < sizeof launcher_names / sizeof launcher_names[0]; i++)
        unsetenv(launcher_names[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 65536) return 0;
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    clear();
    const char *last_value = "";
    for (char *line = text; line && *line;) {
        char *end = strchr(line, '\n');
        if (end) *end = 0;
        char *eq = strchr(line, '=');
        if (eq && eq != line) {
            *eq = 0;
            /* A name with a NUL cut short, or an '=' in it, is what a shell could not export
             * either; setenv refuses the latter. */
            setenv(line, eq + 1, 1);
            last_value = eq + 1;
        }
        line = end ? end + 1 : NULL;
    }
    ddp_status_t s = ddp_config_check();
    if (s != DDP_OK) FUZZ_FAILED_WELL(s);
    int ms = -1;
    s = ddp_config_timeout_ms(&ms);
    if (s == DDP_OK) FUZZ_MUST(ms > 0, "a timeout is positive");
    else FUZZ_FAILED_WELL(s);
    FUZZ_MUST(ddp_default_timeout_ms() > 0, "the default timeout is positive");
    if (devnull) ddp_config_print(devnull);
    ddp_env_t env;
    s = ddp_env_read(&env);
    if (s == DDP_OK) {
        FUZZ_MUST(env.rank >= 0 && env.rank < env.world_size, "rank within the world");
        FUZZ_MUST(env.local_rank >= 0 && env.local_rank < env.local_world_size,
                  "local rank within the host");
        FUZZ_MUST(env.master_port >= 0 && env.master_port <= 65535, "a port");
        FUZZ_MUST(memchr(env.master_addr, 0, sizeof env.master_addr) != NULL, "terminated host");
    } else {
        FUZZ_FAILED_WELL(s);
    }
    /* The last value as a Slurm host list, too. */
    for (int index = 0; index < 3; index++) {
        char host[256];
        int count = -1;
        s = ddp_env_hostlist_host(last_value, index, host, sizeof host, &count);
        if (s != DDP_OK) {
            FUZZ_FAILED_WELL(s);
            break;
        }
        FUZZ_MUST(count >= 0, "a host count");
        if (index < count) FUZZ_MUST(memchr(host, 0, sizeof host) != NULL, "terminated host");
    }
    free(text);
    return 0;
}
