/* Prefix store: a view of another store whose keys become "<prefix>/<key>", so several groups or
 * jobs can share one rendezvous store without seeing each other's keys. Blocking calls use the
 * prefix handle's own timeout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_impl.h"

struct prefix_store {
    ddp_store_t *base;
    char *prefix;
    size_t prefix_len;
};

static struct prefix_store *impl_of(ddp_store_t *store) { return store->impl; }

/* Writes "<prefix>/<key>" into full[DDP_STORE_MAX_KEY + 1]. */
static ddp_status_t full_key(ddp_store_t *store, const char *key, char *full)
{
    struct prefix_store *ps = impl_of(store);
    size_t klen = strlen(key);
    if (ps->prefix_len + 1 + klen > DDP_STORE_MAX_KEY)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "prefix store: key '%.40s' with prefix '%.40s/' is %zu bytes, more than "
                          "DDP_STORE_MAX_KEY (%d)",
                          key, ps->prefix, ps->prefix_len + 1 + klen, DDP_STORE_MAX_KEY);
    memcpy(full, ps->prefix, ps->prefix_len);
    full[ps->prefix_len] = '/';
    memcpy(full + ps->prefix_len + 1, key, klen + 1);
    return DDP_OK;
}

/* The prefixed copies of a key list, in one allocation; free() it. */
static char **full_keys(ddp_store_t *store, const char *const *keys, size_t nkeys,
                        ddp_status_t *status)
{
    size_t total = nkeys * sizeof(char *);
    for (size_t i = 0; i < nkeys; i++) total += impl_of(store)->prefix_len + 2 + strlen(keys[i]);
    char **out = ddp__malloc(total, "prefixed keys");
    if (!out) {
        *status = DDP_ERR_NO_MEMORY;
        return NULL;
    }
    char *p = (char *)(out + nkeys);
    for (size_t i = 0; i < nkeys; i++) {
        char full[DDP_STORE_MAX_KEY + 1];
        *status = full_key(store, keys[i], full);
        if (*status != DDP_OK) {
            free(out);
            return NULL;
        }
        size_t n = strlen(full) + 1;
        memcpy(p, full, n);
        out[i] = p;
        p += n;
    }
    *status = DDP_OK;
    return out;
}

static ddp_status_t prefix_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    char full[DDP_STORE_MAX_KEY + 1];
    ddp_status_t s = full_key(store, key, full);
    if (s != DDP_OK) return s;
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->set(base, full, value, len);
}

static ddp_status_t prefix_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                               size_t *len)
{
    char full[DDP_STORE_MAX_KEY + 1];
    ddp_status_t s = full_key(store, key, full);
    if (s != DDP_OK) return s;
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->get(base, full, timeout_ms, value, len);
}

static ddp_status_t prefix_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    char full[DDP_STORE_MAX_KEY + 1];
    ddp_status_t s = full_key(store, key, full);
    if (s != DDP_OK) return s;
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->add(base, full, delta, result);
}

static ddp_status_t prefix_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                       size_t expected_len, const void *desired,
                                       size_t desired_len, void **current, size_t *current_len)
{
    char full[DDP_STORE_MAX_KEY + 1];
    ddp_status_t s = full_key(store, key, full);
    if (s != DDP_OK) return s;
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->compare_set(base, full, expected, expected_len, desired, desired_len,
                                  current, current_len);
}

static ddp_status_t prefix_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                                 int *all_exist)
{
    ddp_status_t s;
    char **full = full_keys(store, keys, nkeys, &s);
    if (!full) return s;
    ddp_store_t *base = impl_of(store)->base;
    s = base->ops->check(base, (const char *const *)full, nkeys, all_exist);
    free(full);
    return s;
}

static ddp_status_t prefix_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                                int timeout_ms)
{
    ddp_status_t s;
    char **full = full_keys(store, keys, nkeys, &s);
    if (!full) return s;
    ddp_store_t *base = impl_of(store)->base;
    s = base->ops->wait(base, (const char *const *)full, nkeys, timeout_ms);
    free(full);
    return s;
}

static ddp_status_t prefix_remove(ddp_store_t *store, const char *key, int *deleted)
{
    char full[DDP_STORE_MAX_KEY + 1];
    ddp_status_t s = full_key(store, key, full);
    if (s != DDP_OK) return s;
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->remove(base, full, deleted);
}

static ddp_status_t prefix_num_keys(ddp_store_t *store, int64_t *count)
{
    ddp_store_t *base = impl_of(store)->base;
    return base->ops->num_keys(base, count);
}

static void prefix_destroy(ddp_store_t *store)
{
    struct prefix_store *ps = impl_of(store);
    if (!ps) return;
    free(ps->prefix);
    free(ps);
}

static const ddp__store_ops_t prefix_ops = {
    .kind = "prefix",
    .set = prefix_set,
    .get = prefix_get,
    .add = prefix_add,
    .compare_set = prefix_compare_set,
    .check = prefix_check,
    .wait = prefix_wait,
    .remove = prefix_remove,
    .num_keys = prefix_num_keys,
    .destroy = prefix_destroy,
};

ddp_status_t ddp_store_prefix_create(ddp_store_t *base, const char *prefix, ddp_store_t **out)
{
    static const char fn[] = "ddp_store_prefix_create";
    if (!base) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: base is NULL", fn);
    if (!prefix) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: prefix is NULL", fn);
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    size_t n = strnlen(prefix, DDP_STORE_MAX_KEY);
    if (n >= DDP_STORE_MAX_KEY)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: prefix '%.40s...' leaves no room for keys within DDP_STORE_MAX_KEY "
                          "(%d bytes)",
                          fn, prefix, DDP_STORE_MAX_KEY);
    ddp__clear_error();
    struct prefix_store *ps = ddp__calloc(1, sizeof *ps, "prefix store");
    if (!ps) return DDP_ERR_NO_MEMORY;
    ps->base = base;
    ps->prefix = ddp__strdup(prefix, "store prefix");
    ps->prefix_len = n;
    /* The base's timeout, not DDP_TIMEOUT: a prefix store is a view of its base. */
    ddp_store_t *store =
        ps->prefix ? ddp__store_new(&prefix_ops, ps, atomic_load(&base->timeout_ms)) : NULL;
    if (!store) {
        free(ps->prefix);
        free(ps);
        return DDP_ERR_NO_MEMORY;
    }
    *out = store;
    return DDP_OK;
}
