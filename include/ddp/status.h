/* Status codes and error text shared by every libddp call.
 * Every public function returns a ddp_status_t; on failure ddp_last_error() says exactly what went
 * wrong (which argument, key, parameter, rank or sequence number). */
#ifndef DDP_STATUS_H
#define DDP_STATUS_H

#if defined(DDP_BUILDING_LIBRARY) && defined(__GNUC__)
#define DDP_API __attribute__((visibility("default")))
#else
#define DDP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the headers; CMakeLists.txt refuses to configure when project() says another. */
#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0

typedef enum ddp_status {
    DDP_OK = 0,
    DDP_ERR_INVALID_ARGUMENT = -1, /* a NULL, out-of-range or inconsistent argument */
    DDP_ERR_INVALID_USAGE = -2,    /* a valid call at the wrong time (e.g. grad_ready twice) */
    DDP_ERR_TIMEOUT = -3,          /* a wait ran past its timeout; the text names who is missing */
    DDP_ERR_MISMATCH = -4,         /* ranks disagree (collective fingerprint, model shape, ...) */
    DDP_ERR_REMOTE = -5,           /* another rank failed or died; the text names it */
    DDP_ERR_SYSTEM = -6,           /* an operating-system call failed; the text has errno's text */
    DDP_ERR_NO_MEMORY = -7,        /* an allocation failed */
    DDP_ERR_UNSUPPORTED = -8,      /* valid but not supported here (dtype/op/transport) */
    DDP_ERR_NOT_FOUND = -9,        /* a key, file or name does not exist */
    DDP_ERR_PROTOCOL = -10,        /* a peer sent a malformed or unauthenticated message */
    DDP_ERR_ABORTED = -11          /* the object was broken by an earlier failure; recreate it */
} ddp_status_t;

/* Short constant name of a status ("DDP_ERR_TIMEOUT"); never NULL. */
DDP_API const char *ddp_status_string(ddp_status_t status);

/* The version of the libddp the program runs with, "MAJOR.MINOR.PATCH" (a static string, never
 * NULL). It can differ from the DDP_VERSION_* macros the program was compiled with when another
 * libddp.so is found at run time; compare them to detect that. Thread-safe. */
DDP_API const char *ddp_version(void);

/* Text describing the last failure on the calling thread. Valid until the next libddp call on this
 * thread. Empty string when the last call succeeded without setting an error. Never NULL. */
DDP_API const char *ddp_last_error(void);

/* Frees memory that libddp returned to the caller (store values, ...). NULL is allowed. */
DDP_API void ddp_free(void *ptr);

#ifdef __cplusplus
}
#endif
#endif
