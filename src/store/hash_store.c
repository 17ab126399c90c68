/* In-memory store shared by the threads of one process: a table under one mutex, and a condition
 * variable (on the monotonic clock) that every write broadcasts so get/wait wake when keys appear. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_impl.h"

struct hash_store {
    pthread_mutex_t mutex;
    pthread_cond_t changed;
    ddp__kv_table_t table;
};

static struct hash_store *impl_of(ddp_store_t *store) { return store->impl; }

static ddp_status_t hash_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    ddp_status_t s = ddp__kv_put(&hs->table, key, value, len);
    pthread_cond_broadcast(&hs->changed);
    pthread_mutex_unlock(&hs->mutex);
    return s;
}

/* Waits (mutex held) until every key exists or the deadline passes. */
static ddp_status_t wait_locked(struct hash_store *hs, const char *const *keys, size_t nkeys,
                                int timeout_ms)
{
    struct timespec deadline = ddp__timespec_in(CLOCK_MONOTONIC, (int64_t)timeout_ms * 1000000LL);
    size_t first_missing = 0;
    for (;;) {
        while (first_missing < nkeys && ddp__kv_find(&hs->table, keys[first_missing]))
            first_missing++;
        if (first_missing == nkeys) return DDP_OK;
        int rc = pthread_cond_timedwait(&hs->changed, &hs->mutex, &deadline);
        if (rc == ETIMEDOUT) {
            /* A key seen earlier may have been deleted since: recheck all of them. */
            unsigned char *missing = calloc(nkeys, 1);
            int n = 0;
            for (size_t i = 0; i < nkeys; i++) {
                int absent = ddp__kv_find(&hs->table, keys[i]) == NULL;
                if (missing) missing[i] = (unsigned char)absent;
                n += absent;
            }
            if (n == 0) {
                free(missing);
                return DDP_OK;
            }
            char list[DDP_ERROR_TEXT_MAX / 2];
            ddp__store_format_keys(list, sizeof list, keys, nkeys, missing);
            free(missing);
            return ddp__error(DDP_ERR_TIMEOUT,
                              "hash store: timed out after %d ms waiting for %d missing key%s: %s",
                              timeout_ms, n, n == 1 ? "" : "s", list);
        }
        first_missing = 0;
    }
}

static ddp_status_t hash_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                             size_t *len)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    ddp_status_t s = wait_locked(hs, &key, 1, timeout_ms);
    if (s == DDP_OK) {
        ddp__kv_entry_t *e = ddp__kv_find(&hs->table, key);
        *value = ddp__store_copy_value(e->value, e->len);
        *len = e->len;
        if (!*value) s = DDP_ERR_NO_MEMORY;
    }
    pthread_mutex_unlock(&hs->mutex);
    return s;
}

static ddp_status_t hash_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int timeout_ms)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    ddp_status_t s = wait_locked(hs, keys, nkeys, timeout_ms);
    pthread_mutex_unlock(&hs->mutex);
    return s;
}

static ddp_status_t hash_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                               int *all_exist)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    int all = 1;
    for (size_t i = 0; i < nkeys && all; i++) all = ddp__kv_find(&hs->table, keys[i]) != NULL;
    pthread_mutex_unlock(&hs->mutex);
    *all_exist = all;
    return DDP_OK;
}

static ddp_status_t hash_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    ddp__kv_entry_t *e = ddp__kv_find(&hs->table, key);
    char text[32];
    size_t text_len = 0;
    ddp_status_t s = ddp__store_add_text(key, e ? e->value : NULL, e ? e->len : 0, e != NULL,
                                         delta, text, &text_len, result);
    if (s == DDP_OK) s = ddp__kv_put(&hs->table, key, text, text_len);
    pthread_cond_broadcast(&hs->changed);
    pthread_mutex_unlock(&hs->mutex);
    return s;
}

static ddp_status_t hash_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                     size_t expected_len, const void *desired, size_t desired_len,
                                     void **current, size_t *current_len)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    ddp__kv_entry_t *e = ddp__kv_find(&hs->table, key);
    ddp_status_t s = DDP_OK;
    if (ddp__store_cas_matches(e ? e->value : NULL, e ? e->len : 0, e != NULL, expected,
                               expected_len)) {
        s = ddp__kv_put(&hs->table, key, desired, desired_len);
        e = s == DDP_OK ? ddp__kv_find(&hs->table, key) : NULL;
        pthread_cond_broadcast(&hs->changed);
    }
    if (s == DDP_OK) {
        *current = ddp__store_copy_value(e ? e->value : NULL, e ? e->len : 0);
        *current_len = e ? e->len : 0;
        if (!*current) s = DDP_ERR_NO_MEMORY;
    }
    pthread_mutex_unlock(&hs->mutex);
    return s;
}

static ddp_status_t hash_remove(ddp_store_t *store, const char *key, int *deleted)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    *deleted = ddp__kv_remove(&hs->table, key);
    pthread_mutex_unlock(&hs->mutex);
    return DDP_OK;
}

static ddp_status_t hash_num_keys(ddp_store_t *store, int64_t *count)
{
    struct hash_store *hs = impl_of(store);
    pthread_mutex_lock(&hs->mutex);
    *count = (int64_t)hs->table.count;
    pthread_mutex_unlock(&hs->mutex);
    return DDP_OK;
}

static void hash_destroy(ddp_store_t *store)
{
    struct hash_store *hs = impl_of(store);
    if (!hs) return;
    ddp__kv_free(&hs->table);
    pthread_cond_destroy(&hs->changed);
    pthread_mutex_destroy(&hs->mutex);
    free(hs);
}

static const ddp__store_ops_t hash_ops = {
    .kind = "hash",
    .set = hash_set,
    .get = hash_get,
    .add = hash_add,
    .compare_set = hash_compare_set,
    .check = hash_check,
    .wait = hash_wait,
    .remove = hash_remove,
    .num_keys = hash_num_keys,
    .destroy = hash_destroy,
};

ddp_status_t ddp_store_hash_create(ddp_store_t **out)
{
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_hash_create: out is NULL");
    ddp__clear_error();
    int timeout_ms = 0;
    ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
    if (s != DDP_OK) return ddp__error_context(s, "ddp_store_hash_create");
    struct hash_store *hs = ddp__calloc(1, sizeof *hs, "hash store");
    if (!hs) return DDP_ERR_NO_MEMORY;
    if (ddp__kv_init(&hs->table) != DDP_OK) goto free_hs;
    pthread_mutex_init(&hs->mutex, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&hs->changed, &attr);
    pthread_condattr_destroy(&attr);
    ddp_store_t *store = ddp__store_new(&hash_ops, hs, timeout_ms);
    if (!store) goto destroy_sync;
    *out = store;
    return DDP_OK;
destroy_sync:
    pthread_cond_destroy(&hs->changed);
    pthread_mutex_destroy(&hs->mutex);
    ddp__kv_free(&hs->table);
free_hs:
    free(hs);
    return DDP_ERR_NO_MEMORY;
}
