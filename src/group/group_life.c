/* The group's life cycle: create (from a store or from the launcher's environment), split into
 * subgroups, the two-rank pair groups of point-to-point messages with their bookkeeping, and
 * destroy. Works and the group are reference counted (group_queue.c): a work holds its group,
 * so a handle stays valid (and ddp_work_wait answers) even after ddp_group_destroy. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/group_private.h"
#include "group/group_state.h"
#include "group/rendezvous.h"
#include "transport/transport.h"

/* ---- creation ----------------------------------------------------------------------------- */

/* Sets `key` and reads the same key of every rank into values[r] (malloc'd, NUL-terminated). */
static ddp_status_t exchange(ddp_store_t *store, const char *prefix, const char *what, int rank,
                             int world, int timeout_ms, const char *mine, char **values)
{
    char key[700];
    snprintf(key, sizeof key, "%s/%s/%d", prefix, what, rank);
    ddp_status_t s = ddp_store_set(store, key, mine, strlen(mine));
    if (s != DDP_OK) return ddp__error_context(s, "group rendezvous: publishing %s", key);
    char **keys = calloc((size_t)world, sizeof *keys);
    char *keybuf = calloc((size_t)world, 700);
    if (!keys || !keybuf) {
        free(keys);
        free(keybuf);
        return ddp__error(DDP_ERR_NO_MEMORY, "group rendezvous: out of memory");
    }
    for (int r = 0; r < world; r++) {
        keys[r] = keybuf + (size_t)r * 700;
        snprintf(keys[r], 700, "%s/%s/%d", prefix, what, r);
    }
    s = ddp_store_wait(store, (const char *const *)keys, (size_t)world, timeout_ms);
    if (s != DDP_OK) {
        ddp__error_context(s, "group rendezvous (rank %d of %d) waiting for every rank's %s",
                           rank, world, what);
        goto out;
    }
    for (int r = 0; r < world; r++) {
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(store, keys[r], &v, &len);
        if (s != DDP_OK) {
            ddp__error_context(s, "group rendezvous: reading %s", keys[r]);
            for (int k = 0; k < r; k++) {
                free(values[k]);
                values[k] = NULL;
            }
            goto out;
        }
        values[r] = v;
    }
out:
    free(keys);
    free(keybuf);
    return s;
}

static void free_values(char **values, int n)
{
    for (int i = 0; i < n; i++) {
        ddp_free(values[i]);
        values[i] = NULL;
    }
}

/* A state made by a transport's split op that no group took over. */
typedef struct split_state {
    const ddp__transport_ops_t *ops;
    void *state;
} split_state_t;

static void release_split(split_state_t *made)
{
    if (made && made->state) made->ops->destroy(made->state);
}

/* Numbers this instance of group `name` on the store (setting g->prefix), exchanges the
 * transport each rank asked for and its host identity, and chooses: auto picks shm on one host,
 * else hierarchical (or tcp when DDP_HIERARCHICAL=0); a transport asked for by name must agree
 * on every rank and, unless it declares multi_host, have every rank on one host. */
static ddp_status_t choose_over_store(ddp_group_t *g, ddp_store_t *store, const char *name,
                                      int rank, int world, int timeout_ms, const char *asked,
                                      const char *hierarchical, const char **chosen)
{
    ddp_status_t s;
    /* Instances of one name on one store are numbered: the k-th creation on every rank gets
     * instance k (every rank's add for instance k precedes any for k+1, since creation is
     * collective and completes only after every rank has added). */
    char key[600];
    snprintf(key, sizeof key, "ddp/group/%s/instances", name);
    int64_t v = 0;
    s = ddp_store_add(store, key, 1, &v);
    if (s != DDP_OK) {
        ddp__error_context(s, "group_create: counting instances of group '%s'", name);
        return s;
    }
    snprintf(g->prefix, sizeof g->prefix, "ddp/group/%s/%lld", name,
             (long long)((v - 1) / world));

    char mine[512];
    char ident[400];
    ddp__host_identity(ident, sizeof ident);
    snprintf(mine, sizeof mine, "%s|%s", asked, ident);
    char **values = ddp__calloc((size_t)world, sizeof *values, "host identities");
    if (!values) {
        s = DDP_ERR_NO_MEMORY;
        return s;
    }
    s = exchange(store, g->prefix, "host", rank, world, timeout_ms, mine, values);
    if (s != DDP_OK) {
        free(values);
        return s;
    }
    int same_host = 1;
    int bad = -1;
    for (int r = 0; r < world; r++) {
        const char *bar = strchr(values[r], '|');
        size_t alen = bar ? (size_t)(bar - values[r]) : strlen(values[r]);
        if (alen != strlen(asked) || strncmp(values[r], asked, alen) != 0) bad = r;
        if (!bar || strcmp(bar + 1, ident) != 0) same_host = 0;
    }
    if (bad >= 0) {
        s = ddp__error(DDP_ERR_MISMATCH,
                       "group_create: ranks ask for different transports: rank %d asks for "
                       "'%s' but rank %d asks for '%.*s'",
                       rank, asked, bad, (int)strcspn(values[bad], "|"), values[bad]);
        free_values(values, world);
        free(values);
        return s;
    }
    int other = 0;
    for (int r = 0; r < world; r++) {
        const char *bar = strchr(values[r], '|');
        if (!bar || strcmp(bar + 1, ident) != 0) {
            other = r;
            break;
        }
    }
    char other_host[256];
    snprintf(other_host, sizeof other_host, "%s", strchr(values[other], '|') ? strchr(values[other], '|') + 1 : "?");
    free_values(values, world);
    free(values);

    if (strcmp(asked, "auto") == 0) {
        /* Several hosts: shared memory inside each, TCP between them, unless
         * DDP_HIERARCHICAL=0 asks for flat TCP. */
        *chosen = same_host ? "shm"
                           : (strcmp(hierarchical, "0") != 0 ? "hierarchical" : "tcp");
    } else {
        /* What the transport declares (transport.h), not its name, says whether it can
         * span hosts; an unknown one fails below with the text naming the known ones. */
        const ddp__transport_ops_t *ops = ddp__transport_find(asked, &s);
        if (ops && !ops->multi_host && !same_host) {
            s = ddp__error(DDP_ERR_UNSUPPORTED,
                           "group_create: transport %s needs every rank on one host, but "
                           "rank %d is on '%s' and rank %d on '%s'",
                           ops->name, rank, ident, other, other_host);
            return s;
        }
        *chosen = asked;
    }
    return DDP_OK;
}

/* made: NULL, or the state of a store-less subgroup already made by its transport's split op
 * (the group takes it over, also on failure). */
static ddp_status_t create_internal(ddp_store_t *store, int owns_store, int rank, int world,
                                    const ddp_group_options_t *options, const char *name,
                                    int timeout_ms, split_state_t *made, ddp_group_t **out)
{
    ddp_status_t s;
    ddp_group_t *g = ddp__calloc(1, sizeof *g, "a process group");
    if (!g) {
        release_split(made);
        return DDP_ERR_NO_MEMORY;
    }
    atomic_init(&g->refs, 1);
    g->store = store;
    g->owns_store = 0;
    g->rank = rank;
    g->world = world;
    g->timeout_ms = timeout_ms;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->queue_cv, NULL);
    pthread_cond_init(&g->done_cv, NULL);
    atomic_store(&g->last_progress_ns, ddp__now_ns());

    /* Which transport was asked for: the options, else DDP_TRANSPORT, else auto. Both variables
     * are read before the store is touched, so a bad value fails every rank at once. */
    const char *asked = options && options->transport ? options->transport : NULL;
    const char *env = NULL;
    const char *hierarchical = NULL;
    if ((s = ddp__env_text("DDP_TRANSPORT", &env)) != DDP_OK ||
        (s = ddp__env_text("DDP_HIERARCHICAL", &hierarchical)) != DDP_OK) {
        ddp__error_context(s, "group_create");
        goto fail;
    }
    if (!asked || strcmp(asked, "auto") == 0) asked = env ? env : "auto";
    if (!ddp__transport_known(asked)) {
        ddp__transport_find(asked, &s); /* records the text naming the known transports */
        ddp__error_context(s, "group_create");
        goto fail;
    }

    const char *chosen = "self";
    const ddp__transport_ops_t *storeless = NULL;
    if (world == 1 || !store) {
        snprintf(g->prefix, sizeof g->prefix, "ddp/group/%s/local", name);
        /* Without a store only a storeless transport can connect several ranks (MPI_COMM_WORLD
         * in rank order, or a subgroup made by its split op, whose state is handed in). */
        if (made) {
            storeless = made->ops;
        } else if (world > 1) {
            storeless = strcmp(asked, "auto") == 0 ? ddp__transport_storeless(&s)
                                                   : ddp__transport_find(asked, &s);
            if (!storeless) {
                ddp__error_context(s, "group_create (rank %d of %d)", rank, world);
                goto fail;
            }
            if (!storeless->storeless) {
                s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                               "group_create: transport '%s' needs a store (MASTER_ADDR and "
                               "MASTER_PORT); without one it cannot connect %d ranks",
                               asked, world);
                goto fail;
            }
        }
    } else {
        s = choose_over_store(g, store, name, rank, world, timeout_ms, asked, hierarchical,
                              &chosen);
        if (s != DDP_OK) goto fail;
    }
    g->ops = storeless ? storeless : ddp__transport_find(chosen, &s);
    if (!g->ops) {
        ddp__error_context(s, "group_create (rank %d of %d)", rank, world);
        goto fail;
    }
    if (made) {
        g->state = made->state;
        made = NULL;
        s = DDP_OK;
    } else {
        s = g->ops->create(store, g->prefix, rank, world, timeout_ms, &g->state);
    }
    if (s != DDP_OK) {
        ddp__error_context(s, "group_create: transport %s (rank %d of %d)", g->ops->name, rank,
                           world);
        g->ops = NULL;
        goto fail;
    }
    int rc = pthread_create(&g->thread, NULL, ddp__group_progress_main, g);
    if (rc != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, rc, "group_create: starting the progress thread");
        g->ops->destroy(g->state);
        goto fail;
    }
    g->thread_started = 1;
    g->owns_store = owns_store;
    *out = g;
    DDP_LOG(DDP_LOG_INFO, "group %s: rank %d of %d over %s", g->prefix, rank, world,
            g->ops->name);
    return DDP_OK;
fail:
    release_split(made);
    ddp__group_free(g);
    return s;
}

static ddp_status_t check_options(const ddp_group_options_t *options, const char *fn)
{
    if (!options) return DDP_OK;
    if (options->timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: options->timeout_ms %d is negative", fn,
                          options->timeout_ms);
    if (options->name && (options->name[0] == '\0' || strlen(options->name) > 200))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: options->name must be 1 to 200 characters", fn);
    return DDP_OK;
}

/* Checks every DDP_* variable before anything else (so a bad value fails each rank at once, before
 * a rank that read it in a transport leaves its peers waiting, and a value read only on some
 * paths - several hosts, several ranks on one host - is caught on the first small run too), then
 * gives the group's timeout: the options', else DDP_TIMEOUT. */
static ddp_status_t checked_timeout(const ddp_group_options_t *options, const char *fn,
                                   int *timeout_ms)
{
    ddp_status_t s = ddp_config_check();
    if (s == DDP_OK && !(options && options->timeout_ms > 0))
        s = ddp__env_seconds_ms("DDP_TIMEOUT", timeout_ms);
    else if (s == DDP_OK)
        *timeout_ms = options->timeout_ms;
    return s == DDP_OK ? DDP_OK : ddp__error_context(s, "%s", fn);
}

ddp_status_t ddp_group_create(ddp_store_t *store, int rank, int world_size,
                              const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    /* A store-less group exists only internally (MPI under mpirun, MPI subgroups); the public
     * entry point always needs the rendezvous store, even for world_size 1. */
    if (!store) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create: store is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create: out is NULL");
    if (world_size < 1 || world_size > GROUP_MAX_WORLD)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "group_create: world_size %d is out of range [1, %d]", world_size,
                          GROUP_MAX_WORLD);
    if (rank < 0 || rank >= world_size)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "group_create: rank %d is out of range [0, %d)", rank, world_size);
    TRY(check_options(options, "group_create"));
    int timeout_ms = 0;
    TRY(checked_timeout(options, "group_create", &timeout_ms));
    const char *name = options && options->name ? options->name : "default";
    return create_internal(store, 0, rank, world_size, options, name, timeout_ms, NULL, out);
}

ddp_status_t ddp_group_create_from_env(const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_create_from_env: out is NULL");
    TRY(check_options(options, "group_create_from_env"));
    int timeout_ms = 0;
    TRY(checked_timeout(options, "group_create_from_env", &timeout_ms));
    ddp_env_t env;
    ddp_status_t s = ddp_env_read(&env);
    if (s != DDP_OK) return ddp__error_context(s, "group_create_from_env");
    const char *name = options && options->name ? options->name : "default";
    /* A storeless transport asked for by name (mpi) connects the ranks by itself when no store
     * is named. Otherwise the ranks meet through a store (src/group/rendezvous.c: the one the
     * launcher names, or one a rank hosts), and the group picks shared memory inside a host. */
    const char *asked = options && options->transport && strcmp(options->transport, "auto")
                            ? options->transport
                            : NULL;
    if (!asked) TRY(ddp__env_text("DDP_TRANSPORT", &asked));
    int storeless = 0;
    if (!env.store_source && env.world_size > 1 && asked && strcmp(asked, "auto") != 0 &&
        ddp__transport_known(asked)) {
        ddp_status_t found = DDP_OK;
        const ddp__transport_ops_t *ops = ddp__transport_find(asked, &found);
        if (ops && ops->storeless) storeless = 1;
        else if (!ops) return ddp__error_context(found, "group_create_from_env");
    }
    ddp__rendezvous_t meet;
    memset(&meet, 0, sizeof meet);
    if (env.world_size > 1 && !storeless) {
        s = ddp__rendezvous(&env, timeout_ms, &meet);
        if (s != DDP_OK)
            return ddp__error_context(s, "group_create_from_env (rank %d of %d, launcher '%s')",
                                      env.rank, env.world_size, env.source);
    }
    s = create_internal(meet.store, 1, env.rank, env.world_size, options, name, timeout_ms, NULL,
                        out);
    if (s != DDP_OK) {
        ddp_store_destroy(meet.store);
        ddp_store_destroy(meet.base);
        ddp_store_server_stop(meet.server);
        return s;
    }
    (*out)->base_store = meet.base;
    (*out)->server = meet.server;
    (*out)->hosted_by_rank = meet.hosted_by_rank;
    return DDP_OK;
}

/* A store hosted by a rank must outlive the other ranks' use of it: each rank leaves a key when
 * its group is gone, and the host waits for them all (bounded by the group's timeout, skipped
 * when the group is broken: a dead rank leaves no key) before stopping its server. */
static void leave_hosted_store(ddp_group_t *g)
{
    if (!g->hosted_by_rank || !g->store || g->world < 2 || atomic_load(&g->broken)) return;
    char key[64];
    if (!g->server) {
        /* The host may be gone already (its rank failed after ours last heard of it): a few
         * seconds to reconnect at most, not the store's whole timeout. */
        ddp_store_set_timeout(g->store, g->timeout_ms < 5000 ? g->timeout_ms : 5000);
        snprintf(key, sizeof key, "ddp/launch/left/%d", g->rank);
        ddp_store_set(g->store, key, "1", 1);
        return;
    }
    char **keys = calloc((size_t)g->world, sizeof *keys);
    int n = 0;
    for (int r = 0; keys && r < g->world; r++) {
        if (r == g->rank) continue;
        snprintf(key, sizeof key, "ddp/launch/left/%d", r);
        keys[n] = strdup(key);
        if (!keys[n]) break;
        n++;
    }
    if (keys && n == g->world - 1) {
        ddp_status_t s = ddp_store_wait(g->store, (const char *const *)keys, (size_t)n,
                                        g->timeout_ms);
        if (s != DDP_OK)
            DDP_LOG(DDP_LOG_WARN, "rank %d: stopping the store it hosts before every rank left: %s",
                    g->rank, ddp_last_error());
    }
    for (int i = 0; keys && i < n; i++) free(keys[i]);
    free(keys);
}

/* group_split's arguments; *my_index is this rank's position in `ranks`, or -1. */
static ddp_status_t check_split(const ddp_group_t *parent, const int *ranks, int nranks,
                                const ddp_group_options_t *options, ddp_group_t **out,
                                int *my_index)
{
    if (!parent) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: parent is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: out is NULL");
    if (!ranks) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: ranks is NULL");
    if (nranks < 1 || nranks > parent->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "group_split: nranks %d is out of range [1, %d]",
                          nranks, parent->world);
    TRY(check_options(options, "group_split"));
    *my_index = -1;
    for (int i = 0; i < nranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= parent->world)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "group_split: ranks[%d] = %d is out of range [0, %d)", i, ranks[i],
                              parent->world);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "group_split: rank %d is listed twice (ranks[%d] and ranks[%d])",
                                  ranks[i], j, i);
        if (ranks[i] == parent->rank) *my_index = i;
    }
    return DDP_OK;
}

ddp_status_t ddp_group_split(ddp_group_t *parent, const int *ranks, int nranks,
                             const ddp_group_options_t *options, ddp_group_t **out)
{
    ddp__clear_error();
    int my_index = -1;
    TRY(check_split(parent, ranks, nranks, options, out, &my_index));
    /* A broken parent fails at once, quoting its cause, on every rank (its failure reached every
     * rank). A parent that is not broken here may still have lost a rank: a barrier on it finds
     * a dead or missing peer within the transport's liveness checks, where the member lists'
     * comparison through the store below would wait the whole timeout for the dead rank's key. */
    if (atomic_load(&parent->broken)) return ddp__group_aborted_error(parent, "group_split");
    if (parent->world > 1) {
        ddp_status_t b = ddp_group_barrier(parent);
        if (b != DDP_OK)
            return atomic_load(&parent->broken) ? ddp__group_aborted_error(parent, "group_split") : b;
    }
    int k = ++parent->splits;
    char name[400];
    snprintf(name, sizeof name, "%s/split%d%s%s", parent->prefix + strlen("ddp/group/"), k,
             options && options->name ? "-" : "", options && options->name ? options->name : "");

    /* Every rank of the parent must pass the same list: compare through the store. */
    char mine[4096];
    size_t off = 0;
    for (int i = 0; i < nranks && off < sizeof mine - 16; i++)
        off += (size_t)snprintf(mine + off, sizeof mine - off, "%s%d", i ? "," : "", ranks[i]);
    int timeout_ms = options && options->timeout_ms > 0 ? options->timeout_ms
                                                        : parent->timeout_ms;
    ddp_status_t s = DDP_OK;
    if (parent->world > 1 && !parent->store) {
        /* A store-less group (MPI_COMM_WORLD over MPI): compare the lists with a collective on
         * the parent (an allgather of a hash of each rank's list), then build the subgroup with
         * the transport's split op (MPI_Comm_create_group over the parent's communicator, among
         * the members only). */
        if (!parent->ops->split)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "group_split: a group without a store can be split only over a "
                              "transport with a split operation, not '%s'",
                              parent->ops->name);
        /* FNV-1a over the count and every rank (not the text `mine`, which is cut at 4 KiB). */
        uint64_t h = 1469598103934665603ull;
        for (int i = -1; i < nranks; i++) {
            uint32_t v = (uint32_t)(i < 0 ? nranks : ranks[i]);
            for (int byte = 0; byte < 4; byte++)
                h = (h ^ ((v >> (8 * byte)) & 0xffu)) * 1099511628211ull;
        }
        int64_t *hashes = ddp__calloc((size_t)parent->world, sizeof *hashes, "split hashes");
        if (!hashes) return DDP_ERR_NO_MEMORY;
        int64_t my_hash = (int64_t)h;
        s = ddp_group_allgather(parent, &my_hash, hashes, 1, DDP_I64);
        if (s != DDP_OK) {
            free(hashes);
            return ddp__error_context(s, "group_split: comparing the member lists");
        }
        for (int r = 0; r < parent->world && s == DDP_OK; r++) {
            if (hashes[r] != my_hash)
                s = ddp__error(DDP_ERR_MISMATCH,
                               "group_split: ranks disagree on the members: rank %d passed [%s] "
                               "but rank %d passed a different list",
                               parent->rank, mine, r);
        }
        free(hashes);
        if (s != DDP_OK) return s;
        if (my_index < 0) {
            *out = NULL;
            return DDP_OK;
        }
        ddp_group_options_t sub = DDP_GROUP_OPTIONS_INIT;
        if (options) sub = *options;
        sub.transport = nranks > 1 ? parent->ops->name : NULL;
        if (nranks == 1)
            return create_internal(NULL, 0, 0, 1, &sub, name, timeout_ms, NULL, out);
        split_state_t made = {parent->ops, NULL};
        s = parent->ops->split(parent->state, ranks, nranks, name, &made.state);
        if (s != DDP_OK) return ddp__error_context(s, "group_split");
        return create_internal(NULL, 0, my_index, nranks, &sub, name, timeout_ms, &made, out);
    }
    if (parent->world > 1) {
        char prefix[600];
        snprintf(prefix, sizeof prefix, "ddp/group/%s", name);
        char **values = ddp__calloc((size_t)parent->world, sizeof *values, "split lists");
        if (!values) return DDP_ERR_NO_MEMORY;
        s = exchange(parent->store, prefix, "members", parent->rank, parent->world, timeout_ms,
                     mine, values);
        if (s != DDP_OK) {
            free(values);
            return ddp__error_context(s, "group_split");
        }
        for (int r = 0; r < parent->world && s == DDP_OK; r++) {
            if (strcmp(values[r], mine) != 0)
                s = ddp__error(DDP_ERR_MISMATCH,
                               "group_split: ranks disagree on the members: rank %d passed [%s] "
                               "but rank %d passed [%s]",
                               parent->rank, mine, r, values[r]);
        }
        free_values(values, parent->world);
        free(values);
        if (s != DDP_OK) return s;
    }
    if (my_index < 0) {
        *out = NULL;
        return DDP_OK;
    }
    ddp_group_options_t sub = DDP_GROUP_OPTIONS_INIT;
    if (options) sub = *options;
    return create_internal(parent->store, 0, my_index, nranks, &sub, name, timeout_ms, NULL, out);
}

ddp_status_t ddp__group_pair(ddp_group_t *g, int peer, ddp_group_t **out)
{
    if (!g->pairs) {
        g->pairs = ddp__calloc((size_t)g->world, sizeof *g->pairs, "point-to-point pairs");
        if (!g->pairs) return DDP_ERR_NO_MEMORY;
    }
    if (g->pairs[peer]) {
        *out = g->pairs[peer];
        return DDP_OK;
    }
    if (!g->store)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "send/recv on rank %d: group %s has no store (a store-less MPI group), "
                          "and point-to-point pairs are made through the store",
                          g->rank, g->prefix);
    /* The pair is a group of two on the parent's store, named after the parent instance and
     * the two ranks: both sides make it at their first send/recv with each other, in issue
     * order, so it is made exactly once per pair. Its transport is the one the parent's declares
     * (pair_transport in transport.h): the parent's own, or tcp for hierarchical. */
    int lo = g->rank < peer ? g->rank : peer, hi = g->rank < peer ? peer : g->rank;
    char name[600];
    snprintf(name, sizeof name, "%s/p2p%d_%d", g->prefix + strlen("ddp/group/"), lo, hi);
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.timeout_ms = g->timeout_ms;
    options.transport = g->ops->pair_transport ? g->ops->pair_transport : g->ops->name;
    ddp_group_t *pair = NULL;
    ddp_status_t s = create_internal(g->store, 0, g->rank == lo ? 0 : 1, 2, &options, name,
                                     g->timeout_ms, NULL, &pair);
    if (s != DDP_OK)
        return ddp__error_context(s, "rank %d making its point-to-point pair with rank %d", g->rank,
                                  peer);
    g->pairs[peer] = pair;
    *out = pair;
    return DDP_OK;
}

ddp_status_t ddp_group_enable_recv_any(ddp_group_t *group)
{
    ddp__clear_error();
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "enable_recv_any: group is NULL");
    if (!group->store)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "enable_recv_any on rank %d: group %s has no store (a store-less MPI "
                          "group), and senders announce themselves through the store",
                          group->rank, group->prefix);
    group->recv_any = 1;
    return DDP_OK;
}

int ddp__group_recv_any_enabled(const ddp_group_t *g) { return g->recv_any; }

static void sent_key(const ddp_group_t *g, int from, int to, char *key, size_t size)
{
    snprintf(key, size, "%s/p2p_sent/%d_%d", g->prefix, from, to);
}

ddp_status_t ddp__group_p2p_count(ddp_group_t *g, int peer, int is_send)
{
    if (is_send) {
        if (!g->recv_any) return DDP_OK;
        char key[700];
        int64_t n = 0;
        sent_key(g, g->rank, peer, key, sizeof key);
        ddp_status_t s = ddp_store_add(g->store, key, 1, &n);
        if (s != DDP_OK)
            return ddp__error_context(s, "rank %d announcing its send to rank %d in the store",
                                      g->rank, peer);
        return DDP_OK;
    }
    if (!g->received) {
        g->received = ddp__calloc((size_t)g->world, sizeof *g->received, "recv counts per peer");
        if (!g->received) return DDP_ERR_NO_MEMORY;
    }
    g->received[peer]++;
    return DDP_OK;
}

/* Polls every peer's count of sends to this rank (one store add of 0 each, round robin from the
 * last source picked) until one exceeds the recvs from it, backing off from 20 us to 2 ms, until
 * the group's timeout or until the group breaks. */
ddp_status_t ddp__group_p2p_any_source(ddp_group_t *g, int tag, int *out)
{
    if (!g->recv_any)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "recv from any source (tag %d) on rank %d: group %s was not enabled "
                          "for it (ddp_group_enable_recv_any on every rank before its first send)",
                          tag, g->rank, g->prefix);
    if (!g->received) {
        g->received = ddp__calloc((size_t)g->world, sizeof *g->received, "recv counts per peer");
        if (!g->received) return DDP_ERR_NO_MEMORY;
    }
    int64_t deadline = ddp__now_ns() + (int64_t)g->timeout_ms * 1000000;
    int64_t pause_us = 20;
    for (;;) {
        for (int i = 1; i <= g->world; i++) {
            int p = (g->any_next + i) % g->world;
            if (p == g->rank) continue;
            char key[700];
            int64_t sent = 0;
            sent_key(g, p, g->rank, key, sizeof key);
            ddp_status_t s = ddp_store_add(g->store, key, 0, &sent);
            if (s != DDP_OK)
                return ddp__error_context(s, "recv from any source on rank %d reading the sends "
                                          "of rank %d", g->rank, p);
            if (sent > g->received[p]) {
                g->any_next = p;
                *out = p;
                return DDP_OK;
            }
        }
        if (atomic_load(&g->broken))
            return ddp__error(DDP_ERR_ABORTED,
                              "recv from any source (tag %d) on rank %d: the group broke while "
                              "it waited for a sender", tag, g->rank);
        if (ddp__now_ns() > deadline)
            return ddp__error(DDP_ERR_TIMEOUT,
                              "recv from any source (tag %d) on rank %d: no rank of the %d sent "
                              "to it within %d ms", tag, g->rank, g->world, g->timeout_ms);
        ddp__sleep_us(pause_us);
        pause_us = pause_us * 2 > 2000 ? 2000 : pause_us * 2;
    }
}

void ddp_group_destroy(ddp_group_t *group)
{
    if (!group) return;
    if (group->thread_started) {
        pthread_mutex_lock(&group->mu);
        group->stop = 1;
        atomic_fetch_add(&group->pending, GROUP_STOPPING);
        pthread_cond_signal(&group->queue_cv);
        pthread_mutex_unlock(&group->mu);
        if (!ddp__group_is_progress_thread(group)) pthread_join(group->thread, NULL);
        else pthread_detach(group->thread);
    }
    if (group->pairs) {
        for (int r = 0; r < group->world; r++) ddp_group_destroy(group->pairs[r]);
        free(group->pairs);
        group->pairs = NULL;
    }
    free(group->received);
    group->received = NULL;
    if (group->ops) group->ops->destroy(group->state);
    group->ops = NULL;
    group->state = NULL;
    if (group->owns_store) {
        leave_hosted_store(group);
        ddp_store_destroy(group->store);
    }
    group->store = NULL;
    ddp_store_destroy(group->base_store);
    group->base_store = NULL;
    ddp_store_server_stop(group->server);
    group->server = NULL;
    ddp__group_unref(group);
}

