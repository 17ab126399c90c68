/* Internal helpers every part of libddp uses: error recording, logging, environment look-ups,
 * clocks, sleeping. The ground floor: it declares nothing of a layer above. Not installed. */
#ifndef DDP_CORE_INTERNAL_H
#define DDP_CORE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "ddp/ddp.h"

#if defined(__GNUC__)
#define DDP_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define DDP_PRINTF(f, a)
#endif

#define DDP_ERROR_TEXT_MAX 2048

/* Marks an internal function a transport module (libddp_mpi.so, loaded at run time) calls:
 * libddp.so exports it, so the module uses the core's one copy of every piece of state (the
 * thread's last error above all, which the user reads with ddp_last_error) instead of carrying a
 * copy of its own. Not part of the API: a module is built from the same tree as its libddp. */
#if defined(__GNUC__)
#define DDP_MODULE_API __attribute__((visibility("default")))
#else
#define DDP_MODULE_API
#endif

/* Records `status` with a formatted message as the calling thread's last error; returns status,
 * so callers write `return ddp__error(DDP_ERR_INVALID_ARGUMENT, "count: ...")`. */
DDP_MODULE_API ddp_status_t ddp__error(ddp_status_t status, const char *fmt, ...) DDP_PRINTF(2, 3);
/* Same, appending ": <strerror(errnum)>". */
ddp_status_t ddp__error_errno(ddp_status_t status, int errnum, const char *fmt, ...)
    DDP_PRINTF(3, 4);
/* Clears the calling thread's last error (public calls do this on entry when convenient). */
void ddp__clear_error(void);
/* Replaces the calling thread's error text (used to carry a work's error to the waiting thread). */
void ddp__set_error_text(const char *text);
/* Prefixes the current error text with "<prefix>: " keeping the status. */
DDP_MODULE_API ddp_status_t ddp__error_context(ddp_status_t status, const char *fmt, ...) DDP_PRINTF(2, 3);

/* Logging, only when DDP_LOG_LEVEL asks (error, warn, info, debug); to stderr. */
enum { DDP_LOG_NONE = 0, DDP_LOG_ERROR = 1, DDP_LOG_WARN = 2, DDP_LOG_INFO = 3, DDP_LOG_DEBUG = 4 };
DDP_MODULE_API int ddp__log_level(void);

/* FNV-1a (64-bit) of n bytes: the checksum libddp's saved states end with (core/hash.c). */
DDP_MODULE_API uint64_t ddp__fnv1a(const void *data, size_t n);
DDP_MODULE_API void ddp__log(int level, const char *fmt, ...) DDP_PRINTF(2, 3);
#define DDP_LOG(level, ...)                                                                       \
    do {                                                                                          \
        if (ddp__log_level() >= (level)) ddp__log((level), __VA_ARGS__);                          \
    } while (0)

/* Environment: the variable must be in the table (src/core/config.c). The checked readers check
 * the value against the row's rule; a bad one returns DDP_ERR_INVALID_ARGUMENT with text naming
 * the variable, the value and what is accepted, and leaves *out alone. Unset or empty means the
 * table's default. */
/* The value, or the table's default, or NULL when neither (any rule). */
ddp_status_t ddp__env_text(const char *name, const char **out);
/* An INTEGER row's value, or its default, or `unset` when it has neither. */
ddp_status_t ddp__env_integer(const char *name, long long unset, long long *out);
/* A SECONDS row's value (or its default) in milliseconds, at least 1. */
DDP_MODULE_API ddp_status_t ddp__env_seconds_ms(const char *name, int *out_ms);
/* The raw value or the table's default, NULL when neither: only for TEXT rows (addresses,
 * names, tokens), which have no rule to check. */
const char *ddp__env(const char *name);

/* The host of the store this process met the other ranks through: what the last
 * ddp_group_create_from_env rendezvous chose (a rank-hosted store under mpirun or srun), else
 * DDP_STORE_ADDR, else MASTER_ADDR; NULL when none. The TCP transport binds to the address that
 * routes there (the interface facing the other hosts). The setter copies; thread-safe. */
const char *ddp__rendezvous_host(void);
void ddp__set_rendezvous_host(const char *host);

/* Clocks. */
double ddp__now_us(void);    /* monotonic */
DDP_MODULE_API int64_t ddp__now_ns(void);   /* monotonic */
/* The same clock as of the last tick (up to a few ms behind ddp__now_ns), for watchdogs: ~3 ns
 * against ~26 ns a read here, and a small collective reads it twice. */
int64_t ddp__coarse_now_ns(void);
/* A deadline `timeout_ms` from now on the ddp__now_ns clock, from the coarse clock plus slack
 * for its lag: never early, up to ~8 ms late. */
int64_t ddp__deadline_ns(int timeout_ms);
/* The same from the precise clock (a read more, never late): for a store's waits, whose
 * timeouts callers and tests time to the millisecond. */
int64_t ddp__deadline_precise_ns(int64_t timeout_ms);
/* Whole milliseconds left until `deadline_ns` (rounded up, so 0 only once it has passed), at
 * most `cap_ms`: the timeout argument of poll() and of store waits. */
int ddp__ms_left(int64_t deadline_ns, int cap_ms);
/* The time `ns` (>= 0) from now on clock `clock` (a clockid_t: CLOCK_REALTIME, or the clock
 * a condition variable was set to): the absolute timeout pthread_cond_timedwait takes. */
struct timespec ddp__timespec_in(int clock, int64_t ns);
/* Sleeps `us` microseconds (resumed across signals); nothing for us <= 0. */
void ddp__sleep_us(int64_t us);

/* Checked allocation helpers returning NULL and setting DDP_ERR_NO_MEMORY text. */
DDP_MODULE_API void *ddp__malloc(size_t bytes, const char *what);
DDP_MODULE_API void *ddp__calloc(size_t n, size_t size, const char *what);
DDP_MODULE_API char *ddp__strdup(const char *s, const char *what);

/* Whether [a, a + abytes) and [b, b + bbytes) share a byte. */
static inline int ddp__overlaps(const void *a, size_t abytes, const void *b, size_t bbytes)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return abytes > 0 && bbytes > 0 && pa < pb + bbytes && pb < pa + abytes;
}

#endif
