/* The public store API: validates every argument once, then dispatches through the table of
 * functions of the handle's implementation (store_impl.h). Also the key-value table and value
 * helpers shared by the hash, file and TCP implementations. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_impl.h"

ddp_store_t *ddp__store_new(const ddp__store_ops_t *ops, void *impl, int timeout_ms)
{
    ddp_store_t *store = ddp__calloc(1, sizeof *store, "store handle");
    if (!store) return NULL;
    store->ops = ops;
    store->impl = impl;
    atomic_store(&store->timeout_ms, timeout_ms);
    return store;
}

/* ---- argument validation ----------------------------------------------------------------- */

static ddp_status_t check_store(const ddp_store_t *store, const char *fn)
{
    if (!store) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: store is NULL", fn);
    return DDP_OK;
}

static ddp_status_t check_key(const char *key, const char *name, const char *fn)
{
    if (!key) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);
    size_t n = strnlen(key, DDP_STORE_MAX_KEY + 1);
    if (n > DDP_STORE_MAX_KEY)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: %s '%.40s...' is longer than DDP_STORE_MAX_KEY (%d bytes)", fn, name,
                          key, DDP_STORE_MAX_KEY);
    return DDP_OK;
}

static ddp_status_t check_value(const void *value, size_t len, const char *name, const char *fn)
{
    if (!value && len > 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL but its length is %zu", fn,
                          name, len);
    if (len > DDP_STORE_MAX_VALUE)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: %s is %zu bytes, more than DDP_STORE_MAX_VALUE (%u bytes)", fn, name,
                          len, DDP_STORE_MAX_VALUE);
    return DDP_OK;
}

static ddp_status_t check_keys(const char *const *keys, size_t nkeys, const char *fn)
{
    if (!keys && nkeys > 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: keys is NULL but nkeys is %zu", fn,
                          nkeys);
    for (size_t i = 0; i < nkeys; i++) {
        char name[32];
        snprintf(name, sizeof name, "keys[%zu]", i);
        ddp_status_t s = check_key(keys[i], name, fn);
        if (s != DDP_OK) return s;
    }
    return DDP_OK;
}

#define OUT_NOT_NULL(ptr, fn)                                                                     \
    do {                                                                                          \
        if (!(ptr)) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, #ptr);       \
    } while (0)

#define RETURN_IF_ERROR(expr)                                                                     \
    do {                                                                                          \
        ddp_status_t status_ = (expr);                                                            \
        if (status_ != DDP_OK) return status_;                                                    \
    } while (0)

/* ---- the public API ---------------------------------------------------------------------- */

void ddp_store_destroy(ddp_store_t *store)
{
    if (!store) return;
    if (store->ops && store->ops->destroy) store->ops->destroy(store);
    free(store);
}

ddp_status_t ddp_store_set_timeout(ddp_store_t *store, int timeout_ms)
{
    RETURN_IF_ERROR(check_store(store, "ddp_store_set_timeout"));
    if (timeout_ms <= 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp_store_set_timeout: timeout_ms must be > 0 (got %d)", timeout_ms);
    atomic_store(&store->timeout_ms, timeout_ms);
    ddp__clear_error();
    return DDP_OK;
}

int ddp_store_timeout(const ddp_store_t *store)
{
    if (!store) {
        ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_timeout: store is NULL");
        return -1;
    }
    return atomic_load(&((ddp_store_t *)store)->timeout_ms);
}

ddp_status_t ddp_store_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    static const char fn[] = "ddp_store_set";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_key(key, "key", fn));
    RETURN_IF_ERROR(check_value(value, len, "value", fn));
    ddp__clear_error();
    return store->ops->set(store, key, value ? value : "", len);
}

ddp_status_t ddp_store_get(ddp_store_t *store, const char *key, void **value, size_t *len)
{
    static const char fn[] = "ddp_store_get";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_key(key, "key", fn));
    OUT_NOT_NULL(value, fn);
    OUT_NOT_NULL(len, fn);
    ddp__clear_error();
    void *v = NULL;
    size_t n = 0;
    ddp_status_t s = store->ops->get(store, key, atomic_load(&store->timeout_ms), &v, &n);
    if (s == DDP_OK) {
        *value = v;
        *len = n;
    }
    return s;
}

ddp_status_t ddp_store_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    static const char fn[] = "ddp_store_add";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_key(key, "key", fn));
    OUT_NOT_NULL(result, fn);
    ddp__clear_error();
    int64_t r = 0;
    ddp_status_t s = store->ops->add(store, key, delta, &r);
    if (s == DDP_OK) *result = r;
    return s;
}

ddp_status_t ddp_store_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                   size_t expected_len, const void *desired, size_t desired_len,
                                   void **current, size_t *current_len)
{
    static const char fn[] = "ddp_store_compare_set";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_key(key, "key", fn));
    RETURN_IF_ERROR(check_value(expected, expected_len, "expected", fn));
    RETURN_IF_ERROR(check_value(desired, desired_len, "desired", fn));
    OUT_NOT_NULL(current, fn);
    OUT_NOT_NULL(current_len, fn);
    ddp__clear_error();
    void *v = NULL;
    size_t n = 0;
    ddp_status_t s = store->ops->compare_set(store, key, expected ? expected : "", expected_len,
                                             desired ? desired : "", desired_len, &v, &n);
    if (s == DDP_OK) {
        *current = v;
        *current_len = n;
    }
    return s;
}

ddp_status_t ddp_store_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                             int *all_exist)
{
    static const char fn[] = "ddp_store_check";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_keys(keys, nkeys, fn));
    OUT_NOT_NULL(all_exist, fn);
    ddp__clear_error();
    if (nkeys == 0) {
        *all_exist = 1;
        return DDP_OK;
    }
    int all = 0;
    ddp_status_t s = store->ops->check(store, keys, nkeys, &all);
    if (s == DDP_OK) *all_exist = all;
    return s;
}

ddp_status_t ddp_store_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                            int timeout_ms)
{
    static const char fn[] = "ddp_store_wait";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_keys(keys, nkeys, fn));
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: timeout_ms must be >= 0 (0: the store's timeout), got %d", fn,
                          timeout_ms);
    ddp__clear_error();
    if (nkeys == 0) return DDP_OK;
    if (timeout_ms == 0) timeout_ms = atomic_load(&store->timeout_ms);
    return store->ops->wait(store, keys, nkeys, timeout_ms);
}

ddp_status_t ddp_store_delete(ddp_store_t *store, const char *key, int *deleted)
{
    static const char fn[] = "ddp_store_delete";
    RETURN_IF_ERROR(check_store(store, fn));
    RETURN_IF_ERROR(check_key(key, "key", fn));
    ddp__clear_error();
    int d = 0;
    ddp_status_t s = store->ops->remove(store, key, &d);
    if (s == DDP_OK && deleted) *deleted = d;
    return s;
}

ddp_status_t ddp_store_num_keys(ddp_store_t *store, int64_t *count)
{
    static const char fn[] = "ddp_store_num_keys";
    RETURN_IF_ERROR(check_store(store, fn));
    OUT_NOT_NULL(count, fn);
    ddp__clear_error();
    int64_t c = 0;
    ddp_status_t s = store->ops->num_keys(store, &c);
    if (s == DDP_OK) *count = c;
    return s;
}

/* ---- key -> value table: chained hashing, doubling at load factor 1 ---------------------- */

static uint64_t hash_key(const char *key)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)key; *p; p++) {
        h ^= *p;
        h *= 1099511628211ULL;
    }
    return h;
}

ddp_status_t ddp__kv_init(ddp__kv_table_t *table)
{
    table->nbuckets = 64;
    table->count = 0;
    table->buckets = ddp__calloc(table->nbuckets, sizeof *table->buckets, "store table");
    return table->buckets ? DDP_OK : DDP_ERR_NO_MEMORY;
}

void ddp__kv_free(ddp__kv_table_t *table)
{
    if (!table->buckets) return;
    for (size_t i = 0; i < table->nbuckets; i++) {
        ddp__kv_entry_t *e = table->buckets[i];
        while (e) {
            ddp__kv_entry_t *next = e->next;
            free(e->key);
            free(e->value);
            free(e);
            e = next;
        }
    }
    free(table->buckets);
    table->buckets = NULL;
    table->count = 0;
}

ddp__kv_entry_t *ddp__kv_find(const ddp__kv_table_t *table, const char *key)
{
    ddp__kv_entry_t *e = table->buckets[hash_key(key) & (table->nbuckets - 1)];
    for (; e; e = e->next)
        if (strcmp(e->key, key) == 0) return e;
    return NULL;
}

static void grow(ddp__kv_table_t *table)
{
    size_t n = table->nbuckets * 2;
    ddp__kv_entry_t **b = calloc(n, sizeof *b);
    if (!b) return; /* keep the longer chains: still correct */
    for (size_t i = 0; i < table->nbuckets; i++) {
        ddp__kv_entry_t *e = table->buckets[i];
        while (e) {
            ddp__kv_entry_t *next = e->next;
            size_t j = hash_key(e->key) & (n - 1);
            e->next = b[j];
            b[j] = e;
            e = next;
        }
    }
    free(table->buckets);
    table->buckets = b;
    table->nbuckets = n;
}

ddp_status_t ddp__kv_put_owned(ddp__kv_table_t *table, const char *key, uint8_t *value,
                               size_t len)
{
    ddp__kv_entry_t *e = ddp__kv_find(table, key);
    if (e) {
        free(e->value);
        e->value = value;
        e->len = len;
        return DDP_OK;
    }
    e = ddp__malloc(sizeof *e, "store entry");
    char *k = e ? ddp__strdup(key, "store key") : NULL;
    if (!k) {
        free(e);
        free(value);
        return DDP_ERR_NO_MEMORY;
    }
    e->key = k;
    e->value = value;
    e->len = len;
    if (table->count + 1 > table->nbuckets) grow(table);
    size_t i = hash_key(key) & (table->nbuckets - 1);
    e->next = table->buckets[i];
    table->buckets[i] = e;
    table->count++;
    return DDP_OK;
}

ddp_status_t ddp__kv_put(ddp__kv_table_t *table, const char *key, const void *value, size_t len)
{
    uint8_t *copy = ddp__store_copy_value(value, len);
    if (!copy) return DDP_ERR_NO_MEMORY;
    return ddp__kv_put_owned(table, key, copy, len);
}

int ddp__kv_remove(ddp__kv_table_t *table, const char *key)
{
    ddp__kv_entry_t **link = &table->buckets[hash_key(key) & (table->nbuckets - 1)];
    for (; *link; link = &(*link)->next) {
        ddp__kv_entry_t *e = *link;
        if (strcmp(e->key, key) == 0) {
            *link = e->next;
            free(e->key);
            free(e->value);
            free(e);
            table->count--;
            return 1;
        }
    }
    return 0;
}

/* ---- value helpers ----------------------------------------------------------------------- */

void *ddp__store_copy_value(const void *value, size_t len)
{
    uint8_t *copy = ddp__malloc(len + 1, "store value");
    if (!copy) return NULL;
    if (len) memcpy(copy, value, len);
    copy[len] = 0;
    return copy;
}

ddp_status_t ddp__store_add_text(const char *key, const uint8_t *current, size_t current_len,
                                 int present, int64_t delta, char text[32], size_t *text_len,
                                 int64_t *result)
{
    int64_t old = 0;
    if (present) {
        char buf[32];
        int ok = current_len > 0 && current_len < sizeof buf;
        if (ok) {
            memcpy(buf, current, current_len);
            buf[current_len] = 0;
            char *end = NULL;
            errno = 0;
            long long v = strtoll(buf, &end, 10);
            ok = errno == 0 && end == buf + current_len && (buf[0] == '-' || (buf[0] >= '0' && buf[0] <= '9'));
            old = v;
        }
        if (!ok)
            return ddp__error(DDP_ERR_INVALID_USAGE,
                              "add: key '%s' holds a %zu-byte value that is not a decimal integer",
                              key, current_len);
    }
    if ((delta > 0 && old > INT64_MAX - delta) || (delta < 0 && old < INT64_MIN - delta))
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "add: key '%s': %" PRId64 " + %" PRId64 " overflows 64 bits", key, old,
                          delta);
    int64_t now = old + delta;
    int n = snprintf(text, 32, "%" PRId64, now);
    *text_len = (size_t)n;
    *result = now;
    return DDP_OK;
}

int ddp__store_cas_matches(const uint8_t *current, size_t current_len, int present,
                           const void *expected, size_t expected_len)
{
    if (!present) return expected_len == 0;
    return current_len == expected_len &&
           (expected_len == 0 || memcmp(current, expected, expected_len) == 0);
}

void ddp__store_format_keys(char *buf, size_t size, const char *const *keys, size_t nkeys,
                            const unsigned char *missing)
{
    size_t used = 0;
    buf[0] = 0;
    int first = 1;
    for (size_t i = 0; i < nkeys; i++) {
        if (missing && !missing[i]) continue;
        char item[DDP_STORE_MAX_KEY + 8];
        int n = snprintf(item, sizeof item, "%s'%s'", first ? "" : ", ", keys[i]);
        if (n < 0) continue;
        if (used + (size_t)n + 5 >= size) {
            snprintf(buf + used, size - used, "%s...", first ? "" : ", ");
            return;
        }
        memcpy(buf + used, item, (size_t)n + 1);
        used += (size_t)n;
        first = 0;
    }
}
