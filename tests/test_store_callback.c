/* Callback store (ddp_store_callback_create): the store semantics every implementation shares,
 * run through callbacks that forward to another store; creation checks; a callback's failure
 * quoted with the operation and key; optional operations left out; and process groups at world
 * sizes 1-4 whose rendezvous goes only through callbacks (how the PyTorch backend uses it). */
#include "test_store_common.h"

/* Callbacks forwarding to the ddp store in ctx, copying its error text as a callback would. */
static void copy_error(char *error, size_t size) { snprintf(error, size, "%s", ddp_last_error()); }

static ddp_status_t fwd_set(void *ctx, const char *key, const void *value, size_t len, char *error,
                            size_t error_size)
{
    ddp_status_t s = ddp_store_set(ctx, key, value, len);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_get(void *ctx, const char *key, int timeout_ms, void **value, size_t *len,
                            char *error, size_t error_size)
{
    ddp_status_t s = ddp_store_wait(ctx, &key, 1, timeout_ms);
    if (s == DDP_OK) s = ddp_store_get(ctx, key, value, len);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_add(void *ctx, const char *key, int64_t delta, int64_t *result,
                            char *error, size_t error_size)
{
    ddp_status_t s = ddp_store_add(ctx, key, delta, result);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_wait(void *ctx, const char *const *keys, size_t nkeys, int timeout_ms,
                             char *error, size_t error_size)
{
    ddp_status_t s = ddp_store_wait(ctx, keys, nkeys, timeout_ms);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_compare_set(void *ctx, const char *key, const void *expected,
                                    size_t expected_len, const void *desired, size_t desired_len,
                                    void **current, size_t *current_len, char *error,
                                    size_t error_size)
{
    ddp_status_t s = ddp_store_compare_set(ctx, key, expected, expected_len, desired, desired_len,
                                           current, current_len);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_check(void *ctx, const char *const *keys, size_t nkeys, int *all_exist,
                              char *error, size_t error_size)
{
    ddp_status_t s = ddp_store_check(ctx, keys, nkeys, all_exist);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_remove(void *ctx, const char *key, int *deleted, char *error,
                               size_t error_size)
{
    ddp_status_t s = ddp_store_delete(ctx, key, deleted);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static ddp_status_t fwd_num_keys(void *ctx, int64_t *count, char *error, size_t error_size)
{
    ddp_status_t s = ddp_store_num_keys(ctx, count);
    if (s != DDP_OK) copy_error(error, error_size);
    return s;
}

static int destroyed;
static void fwd_destroy(void *ctx)
{
    (void)ctx;
    destroyed++;
}

static ddp_store_callbacks_t forwarding(ddp_store_t *inner)
{
    ddp_store_callbacks_t c = {.ctx = inner,
                               .set = fwd_set,
                               .get = fwd_get,
                               .add = fwd_add,
                               .wait = fwd_wait,
                               .compare_set = fwd_compare_set,
                               .check = fwd_check,
                               .remove = fwd_remove,
                               .num_keys = fwd_num_keys,
                               .destroy = fwd_destroy};
    return c;
}

/* A set that always fails, as a broken remote service would. */
static ddp_status_t refusing_set(void *ctx, const char *key, const void *value, size_t len,
                                 char *error, size_t error_size)
{
    (void)ctx, (void)key, (void)value, (void)len;
    snprintf(error, error_size, "the service said no");
    return DDP_ERR_REMOTE;
}

static void creation_and_errors(void)
{
    ddp_store_t *inner = NULL, *s = NULL;
    CHECK_OK(ddp_store_hash_create(&inner));
    ddp_store_callbacks_t c = forwarding(inner);

    CHECK_STATUS(ddp_store_callback_create(NULL, 0, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("callbacks is NULL");
    CHECK_STATUS(ddp_store_callback_create(&c, 0, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out is NULL");
    CHECK_STATUS(ddp_store_callback_create(&c, -5, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("timeout_ms");
    ddp_store_callbacks_t no_get = c;
    no_get.get = NULL;
    CHECK_STATUS(ddp_store_callback_create(&no_get, 0, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("callbacks->get is NULL");
    ddp_store_callbacks_t no_wait = c;
    no_wait.wait = NULL;
    CHECK_STATUS(ddp_store_callback_create(&no_wait, 0, &s), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("callbacks->wait is NULL");
    CHECK(s == NULL);

    /* Optional operations left out answer UNSUPPORTED, naming the operation. */
    ddp_store_callbacks_t minimal = c;
    minimal.compare_set = NULL;
    minimal.check = NULL;
    minimal.remove = NULL;
    minimal.num_keys = NULL;
    minimal.destroy = NULL;
    CHECK_OK(ddp_store_callback_create(&minimal, 2000, &s));
    CHECK(ddp_store_timeout(s) == 2000);
    void *v = NULL;
    size_t n = 0;
    int64_t count = 0;
    int all = 0;
    const char *key = "k";
    CHECK_STATUS(ddp_store_compare_set(s, "k", NULL, 0, "d", 1, &v, &n), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("compare_set");
    CHECK_STATUS(ddp_store_check(s, &key, 1, &all), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("check");
    CHECK_STATUS(ddp_store_delete(s, "k", NULL), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("delete");
    CHECK_STATUS(ddp_store_num_keys(s, &count), DDP_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("num_keys");
    CHECK_OK(ddp_store_set(s, "k", "abc", 3));
    expect_value(s, "k", "abc", 3);
    ddp_store_destroy(s);

    /* A failing callback: its status and text come back with the operation and the key. */
    ddp_store_callbacks_t refusing = c;
    refusing.set = refusing_set;
    refusing.destroy = NULL;
    CHECK_OK(ddp_store_callback_create(&refusing, 0, &s));
    CHECK_STATUS(ddp_store_set(s, "the-key", "v", 1), DDP_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("the service said no");
    CHECK_ERROR_MENTIONS("set of key 'the-key'");
    /* Arguments are still checked before any callback runs. */
    CHECK_STATUS(ddp_store_set(s, NULL, "v", 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("key is NULL");
    ddp_store_destroy(s);

    /* destroy runs exactly once, on ddp_store_destroy. */
    destroyed = 0;
    CHECK_OK(ddp_store_callback_create(&c, 0, &s));
    CHECK(destroyed == 0);
    ddp_store_destroy(s);
    CHECK(destroyed == 1);
    ddp_store_destroy(inner);
}

static void semantics(void)
{
    ddp_store_t *inner = NULL, *s = NULL;
    CHECK_OK(ddp_store_hash_create(&inner));
    ddp_store_callbacks_t c = forwarding(inner);
    CHECK_OK(ddp_store_callback_create(&c, 0, &s));
    store_semantics(s, "callback", DDP_STORE_MAX_KEY);
    ddp_store_destroy(s);
    ddp_store_destroy(inner);
}

/* One rank: a group whose whole rendezvous runs through callbacks over the harness's file
 * store; an allreduce proves the ranks found each other. */
static int group_rank(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_store_callbacks_t c = forwarding(store);
    c.destroy = NULL;
    ddp_store_t *s = NULL;
    CHECK_OK(ddp_store_callback_create(&c, 0, &s));
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(s, rank, world, NULL, &g));
    double x[3] = {rank, 1.0, -rank};
    CHECK_OK(ddp_group_allreduce(g, x, x, 3, DDP_F64, DDP_SUM));
    double want = world * (world - 1) / 2.0;
    CHECK_MSG(x[0] == want && x[1] == world && x[2] == -want, "rank %d: got %g %g %g", rank,
              x[0], x[1], x[2]);
    ddp_group_destroy(g);
    ddp_store_destroy(s);
    return 0;
}

int main(void)
{
    creation_and_errors();
    semantics();
    for (int world = 1; world <= 4; world++) {
        CHECK_MSG(ddp_test_run_ranks(world, 60, group_rank, NULL) == 0,
                  "group over a callback store failed at world size %d", world);
    }
    printf("callback store: ok\n");
    return 0;
}
