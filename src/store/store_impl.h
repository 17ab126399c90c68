/* The store interface behind include/ddp/store.h: a table of functions each implementation fills
 * (hash, file, tcp, prefix), plus the key-value table and value helpers they share. The public
 * ddp_store_* functions in store.c validate arguments once and dispatch through the table. */
#ifndef DDP_STORE_IMPL_H
#define DDP_STORE_IMPL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"

/* Operations an implementation provides. Arguments arrive validated (keys non-NULL and at most
 * DDP_STORE_MAX_KEY bytes, values at most DDP_STORE_MAX_VALUE bytes, outputs non-NULL).
 * timeout_ms > 0 bounds the blocking calls (get, wait). Returned values are malloc'd with a NUL
 * byte one past their length. */
typedef struct ddp__store_ops {
    const char *kind; /* "hash", "file", "tcp", "prefix": used in error texts */
    ddp_status_t (*set)(ddp_store_t *store, const char *key, const void *value, size_t len);
    ddp_status_t (*get)(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                        size_t *len);
    ddp_status_t (*add)(ddp_store_t *store, const char *key, int64_t delta, int64_t *result);
    ddp_status_t (*compare_set)(ddp_store_t *store, const char *key, const void *expected,
                                size_t expected_len, const void *desired, size_t desired_len,
                                void **current, size_t *current_len);
    ddp_status_t (*check)(ddp_store_t *store, const char *const *keys, size_t nkeys,
                          int *all_exist);
    ddp_status_t (*wait)(ddp_store_t *store, const char *const *keys, size_t nkeys,
                         int timeout_ms);
    ddp_status_t (*remove)(ddp_store_t *store, const char *key, int *deleted);
    ddp_status_t (*num_keys)(ddp_store_t *store, int64_t *count);
    void (*destroy)(ddp_store_t *store); /* frees impl state, not the ddp_store itself */
} ddp__store_ops_t;

struct ddp_store {
    const ddp__store_ops_t *ops;
    _Atomic int timeout_ms;
    void *impl;
};

/* Allocates a store handle whose blocking calls wait at most `timeout_ms` (> 0; the public
 * creators pass DDP_TIMEOUT, read with ddp__env_seconds_ms so that a bad value fails them). */
ddp_store_t *ddp__store_new(const ddp__store_ops_t *ops, void *impl, int timeout_ms);

/* Test entry of the TCP store server (tcp_server.c, for tests/fuzz/fuzz_store_server.c): runs the
 * server's handling of nstreams (at most 8) connections whose clients send streams[i] (lens[i]
 * bytes each, then close), with the given token, until every connection has ended; replied[i]
 * (may be NULL) gets the bytes the server answered on each. DDP_OK, or DDP_ERR_TIMEOUT when a
 * connection never ends (a hang), DDP_ERR_SYSTEM when no socket pair can be made. */
ddp_status_t ddp__store_server_replay(const uint8_t *const *streams, const size_t *lens,
                                      size_t nstreams, const char *token, size_t *replied);

/* ---- a key -> value table (not thread-safe: callers lock) -------------------------------- */

typedef struct ddp__kv_entry {
    char *key;
    uint8_t *value; /* len bytes plus a NUL */
    size_t len;
    struct ddp__kv_entry *next;
} ddp__kv_entry_t;

typedef struct ddp__kv_table {
    ddp__kv_entry_t **buckets;
    size_t nbuckets; /* a power of two */
    size_t count;
} ddp__kv_table_t;

ddp_status_t ddp__kv_init(ddp__kv_table_t *table);
void ddp__kv_free(ddp__kv_table_t *table);
ddp__kv_entry_t *ddp__kv_find(const ddp__kv_table_t *table, const char *key);
/* Copies key and value in (replacing an existing value). */
ddp_status_t ddp__kv_put(ddp__kv_table_t *table, const char *key, const void *value, size_t len);
/* Same, taking ownership of `value` (malloc'd, len bytes plus a NUL) even on failure. */
ddp_status_t ddp__kv_put_owned(ddp__kv_table_t *table, const char *key, uint8_t *value,
                               size_t len);
/* Returns 1 when the key existed. */
int ddp__kv_remove(ddp__kv_table_t *table, const char *key);

/* ---- value helpers shared by every implementation ---------------------------------------- */

/* A malloc'd copy of len bytes plus a NUL (what get/compare_set return). NULL on no memory. */
void *ddp__store_copy_value(const void *value, size_t len);

/* Computes the new text of `key` after adding delta to its current value (NULL: missing = 0).
 * Writes it to text[32] and its length to *text_len, the number to *result. Fails with
 * DDP_ERR_INVALID_USAGE when the value is not a decimal integer, or on overflow. */
ddp_status_t ddp__store_add_text(const char *key, const uint8_t *current, size_t current_len,
                                 int present, int64_t delta, char text[32], size_t *text_len,
                                 int64_t *result);

/* 1 when compare_set should store `desired`: the current value (a missing key counts as the empty
 * value) equals `expected`. */
int ddp__store_cas_matches(const uint8_t *current, size_t current_len, int present,
                           const void *expected, size_t expected_len);

/* Formats "'k1', 'k2', ..." for the keys that are missing (missing[i] != 0) into buf, truncating
 * with "..." when it does not fit. */
void ddp__store_format_keys(char *buf, size_t size, const char *const *keys, size_t nkeys,
                            const unsigned char *missing);

#endif
