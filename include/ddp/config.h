/* The table of every DDP_* environment variable libddp reads, with its default, what it accepts
 * and help. A variable that is unset or set to the empty string takes its default; any other
 * value outside what the table accepts is an error of the call that reads it
 * (DDP_ERR_INVALID_ARGUMENT, the error text naming the variable, the value and what is
 * accepted), never silently the default. */
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
    const char *accepted;      /* what a value may be: "one of auto|shm|tcp|mpi|hierarchical" */
} ddp_env_var_t;

/* The table (static storage) and its length. */
DDP_API size_t ddp_env_vars(const ddp_env_var_t **table);

/* Prints the table with each variable's current value and what it accepts to `out`. Prints a bad
 * value as it is (it does not check values: see ddp_config_check). DDP_STORE_TOKEN's value is
 * shown as "(set)". */
DDP_API ddp_status_t ddp_config_print(FILE *out);

/* Checks the current value of every variable in the table against what it accepts. Returns
 * DDP_OK, or DDP_ERR_INVALID_ARGUMENT for the first bad one, with ddp_last_error() naming it,
 * e.g. "DDP_TIMEOUT='5s' is not valid: expected seconds, a number > 0 and <= 2000000 (e.g. 30
 * or 0.5)". ddp_group_create, ddp_group_create_from_env and ddprun call it first. Reads the
 * environment: not safe while another thread calls setenv. */
DDP_API ddp_status_t ddp_config_check(void);

/* The default timeout in milliseconds: DDP_TIMEOUT (seconds, may be fractional: 0.5 is 500 ms;
 * unset or empty: 300 s) into *timeout_ms. A bad value (not a decimal number, <= 0 or above
 * 2000000 s) returns DDP_ERR_INVALID_ARGUMENT naming it and leaves *timeout_ms alone. */
DDP_API ddp_status_t ddp_config_timeout_ms(int *timeout_ms);

/* The same without a way to report a bad value: returns DDP_TIMEOUT in milliseconds, or the
 * default 300 s (300000) when it is unset, empty OR bad. Kept for compatibility; prefer
 * ddp_config_timeout_ms. A bad value does not go unnoticed: every libddp call that needs the
 * default timeout (group and store creation, ddprun) fails with DDP_ERR_INVALID_ARGUMENT. */
DDP_API int ddp_default_timeout_ms(void);

#ifdef __cplusplus
}
#endif
#endif
