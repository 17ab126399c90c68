/* Rendezvous stores: a small key-value service through which ranks find each other.
 *
 * One interface, six implementations: in-memory (threads of one process), file (processes on one
 * machine or a shared filesystem), TCP (a server hosted by a rank or the launcher, many clients),
 * c10d (a client of PyTorch's TCPStore), prefix (namespaces the keys of another store) and
 * callback (the caller's own functions). Keys are NUL-terminated strings of at most
 * DDP_STORE_MAX_KEY bytes; values are byte strings of at most DDP_STORE_MAX_VALUE bytes.
 *
 * Thread-safety: a store handle may be used from several threads at once.
 * Timeouts: every blocking call waits at most the store's timeout (ddp_store_set_timeout; default
 * DDP_TIMEOUT). A timeout returns DDP_ERR_TIMEOUT and ddp_last_error() names the missing keys.
 * A creation that needs DDP_TIMEOUT (hash, file, and TCP with timeout_ms 0; a prefix store takes
 * its base's timeout) fails with DDP_ERR_INVALID_ARGUMENT when its value is bad (ddp/config.h). */
#ifndef DDP_STORE_H
#define DDP_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP_STORE_MAX_KEY 1024
#define DDP_STORE_MAX_VALUE (64u * 1024u * 1024u)

typedef struct ddp_store ddp_store_t;

/* ---- creation ---------------------------------------------------------------------------- */

/* In-memory store shared by the threads of one process. */
DDP_API ddp_status_t ddp_store_hash_create(ddp_store_t **out);

/* File store at `path` (created if missing). Safe for concurrent processes on one machine (and on
 * a shared filesystem with working fcntl locks). The file is not removed by destroy. */
DDP_API ddp_status_t ddp_store_file_create(const char *path, ddp_store_t **out);

/* Connects to a TCP store server at host:port, authenticating with `token` (may be NULL or "" only
 * if the server has no token). Retries with backoff while the server is not yet up, until
 * timeout_ms (0: DDP_TIMEOUT) passes. */
DDP_API ddp_status_t ddp_store_tcp_connect(const char *host, int port, const char *token,
                                           int timeout_ms, ddp_store_t **out);

/* Connects to PyTorch's c10d TCPStore at host:port (torch.distributed.TCPStore, the store
 * torchrun's agent hosts on MASTER_ADDR:MASTER_PORT), speaking torch 1.13's wire protocol
 * (docs/store-protocol.md lists the subset). c10d has no authentication. Retries while nothing
 * listens, until timeout_ms (0: DDP_TIMEOUT). A server that is a libddp store is
 * DDP_ERR_PROTOCOL at once, naming it. */
DDP_API ddp_status_t ddp_store_c10d_connect(const char *host, int port, int timeout_ms,
                                            ddp_store_t **out);

/* Connects to whichever store listens at host:port: libddp's own (authenticating with `token`)
 * or a c10d TCPStore (token unused), told apart by one probe on a first connection (a c10d
 * CHECK of no keys: c10d answers it, a libddp server closes the connection). A server speaking
 * neither protocol is DDP_ERR_PROTOCOL within 5 s of connecting. */
DDP_API ddp_status_t ddp_store_connect(const char *host, int port, const char *token,
                                       int timeout_ms, ddp_store_t **out);

/* A view of `base` whose keys are prefixed with "<prefix>/". Does not own `base`: base must
 * outlive the prefix store. */
DDP_API ddp_status_t ddp_store_prefix_create(ddp_store_t *base, const char *prefix,
                                             ddp_store_t **out);

/* A store whose operations are the caller's functions: how a program that already has a
 * rendezvous service (torch's c10d::Store, a job scheduler's key-value service) hands it to
 * libddp. Every function gets `ctx` first and may be called from several threads at once.
 * On failure a function returns a negative status and may write a NUL-terminated description
 * into error[error_size]; the store's error text then quotes it with the operation and key.
 * Required: set, get, add, wait. Optional (NULL: that operation returns DDP_ERR_UNSUPPORTED):
 * compare_set, check, remove, num_keys, destroy. The public ddp_store_* calls validate keys and
 * values before calling these. */
typedef struct ddp_store_callbacks {
    void *ctx;
    ddp_status_t (*set)(void *ctx, const char *key, const void *value, size_t len, char *error,
                        size_t error_size);
    /* Waits at most timeout_ms (> 0) for `key`; stores a malloc'd copy of its value in *value
     * (libddp frees it) and its length in *len. */
    ddp_status_t (*get)(void *ctx, const char *key, int timeout_ms, void **value, size_t *len,
                        char *error, size_t error_size);
    ddp_status_t (*add)(void *ctx, const char *key, int64_t delta, int64_t *result, char *error,
                        size_t error_size);
    /* Waits at most timeout_ms (> 0) until every key exists; DDP_ERR_TIMEOUT if not. */
    ddp_status_t (*wait)(void *ctx, const char *const *keys, size_t nkeys, int timeout_ms,
                         char *error, size_t error_size);
    /* As ddp_store_compare_set; *current malloc'd. */
    ddp_status_t (*compare_set)(void *ctx, const char *key, const void *expected,
                                size_t expected_len, const void *desired, size_t desired_len,
                                void **current, size_t *current_len, char *error,
                                size_t error_size);
    ddp_status_t (*check)(void *ctx, const char *const *keys, size_t nkeys, int *all_exist,
                          char *error, size_t error_size);
    ddp_status_t (*remove)(void *ctx, const char *key, int *deleted, char *error,
                           size_t error_size);
    ddp_status_t (*num_keys)(void *ctx, int64_t *count, char *error, size_t error_size);
    /* Called once by ddp_store_destroy: releases ctx. */
    void (*destroy)(void *ctx);
} ddp_store_callbacks_t;

/* Creates a store over `callbacks` (copied; ctx must stay valid until destroy). timeout_ms > 0
 * bounds its blocking calls; 0 uses DDP_TIMEOUT. DDP_ERR_INVALID_ARGUMENT names a missing
 * required function. */
DDP_API ddp_status_t ddp_store_callback_create(const ddp_store_callbacks_t *callbacks,
                                               int timeout_ms, ddp_store_t **out);

/* Closes the handle and frees it. NULL is allowed. */
DDP_API void ddp_store_destroy(ddp_store_t *store);

/* Sets the timeout of blocking calls through this handle, in milliseconds (> 0). */
DDP_API ddp_status_t ddp_store_set_timeout(ddp_store_t *store, int timeout_ms);
DDP_API int ddp_store_timeout(const ddp_store_t *store);

/* ---- operations -------------------------------------------------------------------------- */

DDP_API ddp_status_t ddp_store_set(ddp_store_t *store, const char *key, const void *value,
                                   size_t len);

/* Waits until `key` exists (or the timeout passes), then returns a copy of its value in *value
 * (free with ddp_free; NUL-terminated one byte past len for convenience) and its length. */
DDP_API ddp_status_t ddp_store_get(ddp_store_t *store, const char *key, void **value,
                                   size_t *len);

/* Atomically adds `delta` to the integer stored at `key` (missing counts as 0; the value is kept
 * as decimal text) and returns the new value in *result. */
DDP_API ddp_status_t ddp_store_add(ddp_store_t *store, const char *key, int64_t delta,
                                   int64_t *result);

/* Atomically: if the key's value equals `expected` (a missing key matches expected_len == 0 with
 * expected == NULL), set it to `desired`. Returns the value now stored in *current (ddp_free);
 * the caller compares it with `desired` to learn whether it won. */
DDP_API ddp_status_t ddp_store_compare_set(ddp_store_t *store, const char *key,
                                           const void *expected, size_t expected_len,
                                           const void *desired, size_t desired_len,
                                           void **current, size_t *current_len);

/* *all_exist = 1 when every key exists now, 0 otherwise. Does not block. */
DDP_API ddp_status_t ddp_store_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                                     int *all_exist);

/* Waits until every key exists. timeout_ms 0 uses the store's timeout. On timeout the error text
 * lists the keys still missing. */
DDP_API ddp_status_t ddp_store_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                                    int timeout_ms);

/* Deletes `key`; *deleted (may be NULL) says whether it existed. */
DDP_API ddp_status_t ddp_store_delete(ddp_store_t *store, const char *key, int *deleted);

/* Number of keys in the store (for a prefix store: the base store's count). */
DDP_API ddp_status_t ddp_store_num_keys(ddp_store_t *store, int64_t *count);

/* ---- TCP server -------------------------------------------------------------------------- */

typedef struct ddp_store_server ddp_store_server_t;

/* Starts a TCP store server on bind_addr:port (NULL bind_addr: 127.0.0.1; port 0: any free port)
 * in a background thread. Every connection must authenticate with `token` first (NULL or "": no
 * authentication). Malformed, oversized or unauthenticated frames close only that connection. */
DDP_API ddp_status_t ddp_store_server_start(const char *bind_addr, int port, const char *token,
                                            ddp_store_server_t **out);
/* The port the server listens on. */
DDP_API int ddp_store_server_port(const ddp_store_server_t *server);
/* Stops the server thread, closes every connection and frees it. NULL is allowed. */
DDP_API void ddp_store_server_stop(ddp_store_server_t *server);

#ifdef __cplusplus
}
#endif
#endif
