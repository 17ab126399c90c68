/* Fuzz target for the parsing of environment variables (src/core/config.c: every DDP_* variable
 * of ddp_env_vars(); src/core/env.c: the launchers' variables and Slurm host lists). Input: lines
 * "NAME=VALUE", which become the whole environment while every reader runs. Each must return
 * DDP_OK or an error naming what is wrong. */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h> /* environ */

#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    devnull = fopen("/dev/null", "w");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 65536) return 0;
    char *text = malloc(size + 1);
    char **vars = malloc((size / 2 + 2) * sizeof *vars); /* a line takes at least 2 bytes */
    if (!text || !vars) {
        free(text);
        free(vars);
        return 0;
    }
    memcpy(text, data, size);
    text[size] = 0;
    /* The input's lines are the whole environment: environ points at them while the readers run
     * (setenv would keep every string it was ever given, and the process would grow with each
     * input). A line without '=' or starting with one is not a variable and is left out. */
    size_t n = 0;
    const char *last_value = "";
    for (char *line = text; line && *line;) {
        char *end = strchr(line, '\n');
        if (end) *end = 0;
        char *eq = strchr(line, '=');
        if (eq && eq != line) {
            vars[n++] = line;
            last_value = eq + 1;
        }
        line = end ? end + 1 : NULL;
    }
    vars[n] = NULL;
    char **saved = environ;
    environ = vars;
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
    environ = saved;
    free(vars);
    free(text);
    return 0;
}
