/* Callback store: the store interface over functions the caller supplies (ddp/store.h), so a
 * program that already runs a rendezvous service - torch's c10d::Store in the PyTorch backend -
 * can hand it to ddp_group_create instead of starting a second one. This file only adapts
 * calling conventions: it quotes the callback's error text with the operation and key, and
 * gives returned values the trailing NUL every store's values carry. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_impl.h"

#define CALLBACK_ERROR_MAX 512

static const ddp_store_callbacks_t *cbs(ddp_store_t *store) { return store->impl; }

/* Turns a failed callback into the thread's error text. */
static ddp_status_t failed(ddp_status_t s, const char *op, const char *key, const char *error)
{
    if (s == DDP_OK) s = DDP_ERR_SYSTEM; /* defensive: callers pass a failure */
    if (s > 0 || s < DDP_ERR_ABORTED) s = DDP_ERR_SYSTEM;
    return ddp__error(s, "callback store: %s%s%s%s failed: %s", op, key ? " of key '" : "",
                      key ? key : "", key ? "'" : "",
                      error[0] ? error : ddp_status_string(s));
}

static ddp_status_t unsupported(const char *op)
{
    return ddp__error(DDP_ERR_UNSUPPORTED,
                      "callback store: %s is not provided by this store's callbacks", op);
}

/* A malloc'd value from the callback becomes one with a NUL past its end. */
static ddp_status_t terminate_value(void **value, size_t len)
{
    void *v = realloc(*value, len + 1);
    if (!v) {
        free(*value);
        *value = NULL;
        return ddp__error(DDP_ERR_NO_MEMORY, "callback store: no memory for a %zu-byte value",
                          len);
    }
    ((char *)v)[len] = '\0';
    *value = v;
    return DDP_OK;
}

static ddp_status_t cb_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    char error[CALLBACK_ERROR_MAX] = "";
    ddp_status_t s = cbs(store)->set(cbs(store)->ctx, key, value, len, error, sizeof error);
    return s == DDP_OK ? s : failed(s, "set", key, error);
}

static ddp_status_t cb_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                           size_t *len)
{
    char error[CALLBACK_ERROR_MAX] = "";
    void *v = NULL;
    size_t n = 0;
    ddp_status_t s =
        cbs(store)->get(cbs(store)->ctx, key, timeout_ms, &v, &n, error, sizeof error);
    if (s != DDP_OK) {
        free(v);
        return failed(s, "get", key, error);
    }
    if (!v && n > 0) return failed(DDP_ERR_SYSTEM, "get", key, "returned no value but a length");
    s = terminate_value(&v, n);
    if (s != DDP_OK) return s;
    *value = v;
    *len = n;
    return DDP_OK;
}

static ddp_status_t cb_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    char error[CALLBACK_ERROR_MAX] = "";
    ddp_status_t s = cbs(store)->add(cbs(store)->ctx, key, delta, result, error, sizeof error);
    return s == DDP_OK ? s : failed(s, "add", key, error);
}

static ddp_status_t cb_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                   size_t expected_len, const void *desired, size_t desired_len,
                                   void **current, size_t *current_len)
{
    if (!cbs(store)->compare_set) return unsupported("compare_set");
    char error[CALLBACK_ERROR_MAX] = "";
    void *v = NULL;
    size_t n = 0;
    ddp_status_t s = cbs(store)->compare_set(cbs(store)->ctx, key, expected, expected_len,
                                             desired, desired_len, &v, &n, error, sizeof error);
    if (s != DDP_OK) {
        free(v);
        return failed(s, "compare_set", key, error);
    }
    s = terminate_value(&v, n);
    if (s != DDP_OK) return s;
    *current = v;
    *current_len = n;
    return DDP_OK;
}

static ddp_status_t cb_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                             int *all_exist)
{
    if (!cbs(store)->check) return unsupported("check");
    char error[CALLBACK_ERROR_MAX] = "";
    ddp_status_t s = cbs(store)->check(cbs(store)->ctx, keys, nkeys, all_exist, error,
                                       sizeof error);
    return s == DDP_OK ? s : failed(s, "check", nkeys ? keys[0] : NULL, error);
}

static ddp_status_t cb_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                            int timeout_ms)
{
    char error[CALLBACK_ERROR_MAX] = "";
    ddp_status_t s =
        cbs(store)->wait(cbs(store)->ctx, keys, nkeys, timeout_ms, error, sizeof error);
    if (s == DDP_OK) return s;
    if (s > 0 || s < DDP_ERR_ABORTED) s = DDP_ERR_SYSTEM;
    /* The callback's text should say which keys are missing; only without it list them all. */
    if (error[0])
        return ddp__error(s, "callback store: wait (timeout %d ms) failed: %s", timeout_ms, error);
    char names[512];
    ddp__store_format_keys(names, sizeof names, keys, nkeys, NULL);
    return ddp__error(s, "callback store: wait for %s (timeout %d ms) failed: %s", names,
                      timeout_ms, ddp_status_string(s));
}

static ddp_status_t cb_remove(ddp_store_t *store, const char *key, int *deleted)
{
    if (!cbs(store)->remove) return unsupported("delete");
    char error[CALLBACK_ERROR_MAX] = "";
    int d = 0;
    ddp_status_t s = cbs(store)->remove(cbs(store)->ctx, key, &d, error, sizeof error);
    if (s != DDP_OK) return failed(s, "delete", key, error);
    if (deleted) *deleted = d;
    return DDP_OK;
}

static ddp_status_t cb_num_keys(ddp_store_t *store, int64_t *count)
{
    if (!cbs(store)->num_keys) return unsupported("num_keys");
    char error[CALLBACK_ERROR_MAX] = "";
    ddp_status_t s = cbs(store)->num_keys(cbs(store)->ctx, count, error, sizeof error);
    return s == DDP_OK ? s : failed(s, "num_keys", NULL, error);
}

static void cb_destroy(ddp_store_t *store)
{
    ddp_store_callbacks_t *c = store->impl;
    if (c->destroy) c->destroy(c->ctx);
    free(c);
}

static const ddp__store_ops_t callback_ops = {
    .kind = "callback",
    .set = cb_set,
    .get = cb_get,
    .add = cb_add,
    .compare_set = cb_compare_set,
    .check = cb_check,
    .wait = cb_wait,
    .remove = cb_remove,
    .num_keys = cb_num_keys,
    .destroy = cb_destroy,
};

ddp_status_t ddp_store_callback_create(const ddp_store_callbacks_t *callbacks, int timeout_ms,
                                       ddp_store_t **out)
{
    static const char fn[] = "ddp_store_callback_create";
    ddp__clear_error();
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (!callbacks) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: callbacks is NULL", fn);
    const char *missing = !callbacks->set    ? "set"
                          : !callbacks->get  ? "get"
                          : !callbacks->add  ? "add"
                          : !callbacks->wait ? "wait"
                                             : NULL;
    if (missing)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: callbacks->%s is NULL (set, get, add and wait are required)", fn,
                          missing);
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: timeout_ms must be >= 0 (0: DDP_TIMEOUT), got %d", fn, timeout_ms);
    if (timeout_ms == 0) {
        ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
        if (s != DDP_OK) return s;
    }
    ddp_store_callbacks_t *copy = ddp__malloc(sizeof *copy, "callback store");
    if (!copy) return DDP_ERR_NO_MEMORY;
    *copy = *callbacks;
    ddp_store_t *store = ddp__store_new(&callback_ops, copy, timeout_ms);
    if (!store) {
        free(copy);
        return DDP_ERR_NO_MEMORY;
    }
    *out = store;
    return DDP_OK;
}
