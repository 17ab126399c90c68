/* The table of every DDP_* environment variable libddp reads, with its default and help. */
#ifndef DDP_CONFIG_H
#define DDP_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_env_var {
    const char *name;          /* "DDP_TIMEOUT" */
    const char *default_value; /* as text; "" when unset means "none" */
    const char *help;          /* one line */
} ddp_env_var_t;

/* The table (static storage) and its length. */
DDP_API size_t ddp_env_vars(const ddp_env_var_t **table);

/* Prints the table with each variable's current value to `out`. */
DDP_API ddp_status_t ddp_config_print(FILE *out);

/* The default timeout in milliseconds: DDP_TIMEOUT (seconds, may be fractional) or 300 s. */
DDP_API int ddp_default_timeout_ms(void);

#ifdef __cplusplus
}
#endif
#endif
