/* The shared-memory transport's table and its segment's life cycle: reading the environment's
 * knobs, creating the segment (rank 0) or attaching it (the others), the single-copy probe at
 * create, abort and destroy. Collectives start in shm_choose.c (ddp__shm_run); the other files
 * are listed in shm_internal.h. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/cpu.h"
#include "transport/shm/shm.h"
#include "transport/shm/shm_internal.h"

static double tune_skew[DDP__SHM_VARIANTS];

void ddp__shm_set_tune_skew(const double *skew, int n)
{
    for (int v = 0; v < DDP__SHM_VARIANTS; v++) tune_skew[v] = v < n ? skew[v] : 0.0;
}

static void shm_destroy(void *state);

/* The environment's tuning knobs (src/core/config.c has their defaults and bounds). Every rank
 * reads them all, so that a bad value fails every rank here rather than rank 0 alone while the
 * others wait for its segment; the sizes used are rank 0's (it publishes them in the header). A
 * wait budget of -1 means unset. */
typedef struct {
    long long round_bytes, allreduce_round_bytes, oneshot_bytes;
    long long yield_ns, spin_ns;
    long long cma_bytes, cma_hugepages;
    int cma_wanted;
    int map_wanted; /* DDP_SHM_MAP */
    int mapped_stream; /* DDP_SHM_MAPPED_STORES: the mapped allreduce streams its results */
    int tune_mode;  /* ddp__shm_tune_mode_t */
    uint32_t fixed; /* FIXED_* */
} shm_tuning_t;

static int set_explicitly(const char *name)
{
    const char *v = getenv(name);
    return v && *v;
}

/* One byte-count knob; `built_in` is the default documented above, which the config table must
 * give too (checked when the variable is unset, in builds with asserts). */
static ddp_status_t tuned_bytes(const char *name, size_t built_in, long long *out)
{
    ddp_status_t s = ddp__env_integer(name, -1, out);
    if (s != DDP_OK) return s;
    const char *set = getenv(name);
    assert((set && *set) || *out == (long long)built_in);
    (void)set;
    (void)built_in;
    /* The table's bounds keep a round inside one stage. */
    assert(*out >= 0 && (size_t)*out <= STAGE_BYTES);
    return DDP_OK;
}

static ddp_status_t read_tuning(shm_tuning_t *t)
{
    ddp_status_t s;
    if ((s = tuned_bytes("DDP_SHM_ROUND_BYTES", ROUND_BYTES_DEFAULT, &t->round_bytes)) != DDP_OK ||
        (s = tuned_bytes("DDP_SHM_ALLREDUCE_ROUND_BYTES", ALLREDUCE_ROUND_BYTES_DEFAULT,
                         &t->allreduce_round_bytes)) != DDP_OK ||
        (s = tuned_bytes("DDP_SHM_ONESHOT_BYTES", ONESHOT_BYTES_DEFAULT, &t->oneshot_bytes)) !=
            DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_YIELD_NS", -1, &t->yield_ns)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_SPIN_NS", -1, &t->spin_ns)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_CMA_BYTES", -1, &t->cma_bytes)) != DDP_OK ||
        (s = ddp__env_integer("DDP_SHM_CMA_HUGEPAGES", -1, &t->cma_hugepages)) != DDP_OK)
        return ddp__error_context(s, "shm");
    const char *cma = NULL;
    if ((s = ddp__env_text("DDP_SHM_CMA", &cma)) != DDP_OK) return ddp__error_context(s, "shm");
    t->cma_wanted = !cma || strcmp(cma, "off") != 0;
    const char *map = NULL, *watch = NULL;
    /* DDP_SHM_MAP_WATCH is used by the process's first registration (shm_watch.c); checked here,
     * where a bad value stops the group forming instead of going unnoticed. */
    if ((s = ddp__env_text("DDP_SHM_MAP", &map)) != DDP_OK ||
        (s = ddp__env_text("DDP_SHM_MAP_WATCH", &watch)) != DDP_OK)
        return ddp__error_context(s, "shm");
    t->map_wanted = !map || !strcmp(map, "auto") ? MAP_AUTO : !strcmp(map, "on") ? MAP_ON : MAP_OFF;
    const char *mstores = NULL;
    if ((s = ddp__env_text("DDP_SHM_MAPPED_STORES", &mstores)) != DDP_OK)
        return ddp__error_context(s, "shm");
    /* auto (or unset, or empty): non-temporal on Intel, plain elsewhere (docs/shm-transport.md,
     * "Knobs"). */
    t->mapped_stream = mstores && *mstores && strcmp(mstores, "auto") ? !strcmp(mstores, "nt")
                                                                      : ddp__cpu_is_intel();
    const char *tune = NULL, *stores = NULL, *rounds = NULL;
    if ((s = ddp__env_text("DDP_SHM_TUNE", &tune)) != DDP_OK ||
        (s = ddp__env_text("DDP_SHM_STAGED_STORES", &stores)) != DDP_OK ||
        (s = ddp__env_text("DDP_SHM_STAGED_ROUNDS", &rounds)) != DDP_OK)
        return ddp__error_context(s, "shm");
    t->tune_mode = !tune || !strcmp(tune, "online") ? DDP__SHM_TUNE_ONLINE
                   : !strcmp(tune, "probe")         ? DDP__SHM_TUNE_PROBE
                                                    : DDP__SHM_TUNE_OFF;
    t->fixed = 0;
    if (set_explicitly("DDP_SHM_ONESHOT_BYTES")) t->fixed |= FIXED_ONESHOT;
    if (set_explicitly("DDP_SHM_CMA_BYTES")) t->fixed |= FIXED_CMA;
    if (stores && !strcmp(stores, "nt")) t->fixed |= FIXED_STORES_NT;
    if (stores && !strcmp(stores, "plain")) t->fixed |= FIXED_STORES_PLAIN;
    if (rounds && !strcmp(rounds, "long")) t->fixed |= FIXED_ROUNDS_LONG;
    if (rounds && !strcmp(rounds, "short")) t->fixed |= FIXED_ROUNDS_SHORT;
    return DDP_OK;
}

/* Decides, the same way on every rank, whether allreduces may read peers' buffers directly:
 * every rank that wants it lets its peers read it, publishes a word for them to read, and
 * tries to read every peer's; then every rank's verdict is in the segment and single copy is
 * on only if every rank read every peer (one refusal, or one rank with DDP_SHM_CMA=off, turns
 * it off everywhere, so no collective ever needs a rank's consent it did not give). */
static ddp_status_t setup_cma(shm_state_t *S, int wanted, int64_t deadline_ns)
{
    shm_rank_t *me = &S->ranks[S->rank];
    if (wanted) ddp__shm_cma_allow_peers();
    S->cma_probe = SHM_MAGIC ^ (uint64_t)getpid();
    me->cma_probe_addr = (uint64_t)(uintptr_t)&S->cma_probe;
    me->cma_verdict = wanted ? 0 : -1;
    ddp_status_t s = ddp__shm_sync_all(S, NULL, deadline_ns);
    if (s != DDP_OK) return ddp__error_context(s, "shm: single-copy probe");
    int verdict = wanted ? 0 : -1, refused = -1;
    for (int j = 0; j < S->world && verdict == 0; j++) {
        if (j == S->rank) continue;
        if (S->ranks[j].cma_verdict != 0) { /* that rank does not want it: no need to try */
            verdict = -1;
            break;
        }
        int pid = atomic_load(&S->ranks[j].pid);
        uint64_t word = 0;
        int err = 0;
        s = ddp__shm_cma_read(pid, &word, (uintptr_t)S->ranks[j].cma_probe_addr, sizeof word,
                              "the single-copy probe", &err);
        if (s == DDP_OK && word != (SHM_MAGIC ^ (uint64_t)pid)) err = EIO;
        if (err) {
            verdict = err;
            refused = j;
        }
    }
    ddp__clear_error();
    me->cma_verdict = verdict;
    s = ddp__shm_sync_all(S, NULL, deadline_ns);
    if (s != DDP_OK) return ddp__error_context(s, "shm: single-copy probe");
    S->cma_enabled = 1;
    for (int j = 0; j < S->world; j++) {
        int v = S->ranks[j].cma_verdict;
        if (v == 0) continue;
        S->cma_enabled = 0;
        if (j == S->rank && v > 0)
            DDP_LOG(DDP_LOG_INFO, "shm: rank %d cannot read rank %d's memory (%s): allreduces of "
                                  "user buffers stage through the segment",
                    S->rank, refused, strerror(v));
    }
    DDP_LOG(DDP_LOG_INFO, "shm: rank %d: single-copy allreduce (process_vm_readv) %s", S->rank,
            S->cma_enabled ? "on from the first size where it is chosen"
                           : "off (a rank refused or set DDP_SHM_CMA=off): staged copies");
    return DDP_OK;
}

/* How long a waiter spins and yields before it sleeps (shm_sync.c), unless set explicitly. */
static void set_wait_budgets(shm_state_t *S, const shm_tuning_t *tuning)
{
    const int world = S->world;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    /* More ranks than cores: a spinning waiter steals the core of the rank it waits for. */
    if (ncpu > 0 && world <= ncpu) {
        S->spin_max_ns = 50000;
        S->spin_ns = 20000;
        S->yield_ns = 200000;
    } else {
        S->spin_max_ns = 4000;
        S->spin_ns = 1000;
        S->yield_ns = 200000;
    }
    S->spin_min_ns = 1000;
    S->progress_yield_ns = 20000000;
    if (tuning->yield_ns >= 0) S->yield_ns = S->progress_yield_ns = tuning->yield_ns;
    if (tuning->spin_ns >= 0) S->spin_ns = S->spin_max_ns = S->spin_min_ns = tuning->spin_ns;
}

/* Rank 0: creates the segment, writes its header (the sizes and knobs every rank uses are rank
 * 0's) and publishes it under `key`. */
static ddp_status_t create_segment(shm_state_t *S, const shm_tuning_t *tuning, const char *key)
{
    ddp_status_t s;
    s = ddp__shm_memfd_create(S->size, "ddp-shm-group", &S->fd, &S->base);
    if (s != DDP_OK) return s;
    shm_header_t *hdr = (shm_header_t *)S->base;
    hdr->magic = SHM_MAGIC;
    hdr->world = (uint32_t)S->world;
    hdr->stage_bytes = STAGE_BYTES;
    hdr->segment_bytes = S->size;
    hdr->round_bytes = (uint64_t)tuning->round_bytes;
    hdr->oneshot_bytes = (uint64_t)tuning->oneshot_bytes;
    hdr->allreduce_round_bytes = (uint64_t)tuning->allreduce_round_bytes;
    hdr->cma_bytes = (uint64_t)tuning->cma_bytes;
    hdr->tune_mode = (uint32_t)tuning->tune_mode;
    hdr->fixed = tuning->fixed;
    shm_rank_t *ranks = (shm_rank_t *)(S->base + sizeof(shm_header_t));
    for (int j = 0; j < S->world; j++) atomic_store(&ranks[j].cpu, -1);
    char value[128];
    snprintf(value, sizeof value, "%d %d %zu", (int)getpid(), S->fd, S->size);
    s = ddp_store_set(S->store, key, value, strlen(value));
    if (s != DDP_OK) return ddp__error_context(s, "shm: publishing the segment");
    return DDP_OK;
}

/* The other ranks: wait for rank 0's description under `key`, map the segment, check it. */
static ddp_status_t attach_segment(shm_state_t *S, const char *key)
{
    ddp_status_t s;
    const char *keys[1] = {key};
    s = ddp_store_wait(S->store, keys, 1, S->timeout_ms);
    if (s != DDP_OK)
        return ddp__error_context(s, "shm: rank %d waiting for rank 0's segment", S->rank);
    void *v = NULL;
    size_t len = 0;
    s = ddp_store_get(S->store, key, &v, &len);
    if (s != DDP_OK) return s;
    ddp__shm_desc_t desc;
    if (ddp__shm_desc_parse(v, len, 3, &desc) != 0)
        s = ddp__error(DDP_ERR_PROTOCOL, "shm: malformed description of the group segment "
                       "'%.*s' (\"pid fd bytes\" expected)", len > 64 ? 64 : (int)len,
                       (const char *)v);
    else
        s = ddp__shm_memfd_attach(&desc, S->size, &S->base, "the group segment");
    ddp_free(v);
    if (s != DDP_OK) return s;
    shm_header_t *hdr = (shm_header_t *)S->base;
    if (hdr->magic != SHM_MAGIC || hdr->world != (uint32_t)S->world)
        return ddp__error(DDP_ERR_PROTOCOL, "shm: the segment of rank 0 is not a %d-rank segment",
                          S->world);
    return DDP_OK;
}

static ddp_status_t shm_create(ddp_store_t *store, const char *group_name, int rank, int world,
                               int timeout_ms, void **state)
{
    if (world > DDP__SHM_MAX_WORLD)
        return ddp__error(DDP_ERR_UNSUPPORTED, "shm: world size %d exceeds the maximum %d", world,
                          DDP__SHM_MAX_WORLD);
    shm_tuning_t tuning;
    ddp_status_t s = read_tuning(&tuning);
    if (s != DDP_OK) return s;
    shm_state_t *S = ddp__calloc(1, sizeof *S, "the shm transport");
    if (!S) return DDP_ERR_NO_MEMORY;
    S->rank = rank;
    S->world = world;
    S->timeout_ms = timeout_ms;
    S->store = store;
    S->fd = -1;
    S->cpu = -1;
    atomic_store_explicit(&S->last_algorithm, -1, memory_order_relaxed);
    snprintf(S->prefix, sizeof S->prefix, "%s/shm", group_name);
    pthread_mutex_init(&S->buffers_mu, NULL);
    set_wait_budgets(S, &tuning);

    size_t header = sizeof(shm_header_t) + (size_t)world * sizeof(shm_rank_t);
    size_t stage_off = round_up(header, PAGE);
    S->size = stage_off + (size_t)world * 2 * STAGE_BYTES;

    char key[700];
    snprintf(key, sizeof key, "%s/segment", S->prefix);
    s = rank == 0 ? create_segment(S, &tuning, key) : attach_segment(S, key);
    if (s != DDP_OK) goto fail;
    S->hdr = (shm_header_t *)S->base;
    S->round_bytes = (size_t)S->hdr->round_bytes;
    S->oneshot_bytes = (size_t)S->hdr->oneshot_bytes;
    S->allreduce_round_bytes = (size_t)S->hdr->allreduce_round_bytes;
    S->cma_bytes = (size_t)S->hdr->cma_bytes;
    S->cma.hugepages = tuning.cma_hugepages != 0;
    S->map_wanted = tuning.map_wanted;
    S->mapped_stream = tuning.mapped_stream;
    if ((s = ddp__shm_views_init(&S->views, world, rank)) != DDP_OK) goto fail;
    S->fixed = S->hdr->fixed;
    S->tune.mode = (int)S->hdr->tune_mode;
    S->tune.rank = rank;
    for (int v = 0; v < DDP__SHM_VARIANTS; v++) S->tune.skew[v] = tune_skew[v];
    S->ranks = (shm_rank_t *)(S->base + sizeof(shm_header_t));
    S->stage = S->base + stage_off;
    atomic_store(&S->ranks[rank].pid, (int32_t)getpid());

    /* Everyone attached: rank 0 closes the memfd, after which the segment has no name anywhere
     * and disappears with the last mapping, whatever happens to the processes. */
    s = ddp__shm_sync_all(S, NULL, ddp__now_ns() + (int64_t)timeout_ms * 1000000LL);
    if (s != DDP_OK) {
        ddp__error_context(s, "shm: waiting for every rank to attach the segment");
        goto fail;
    }
    if (S->fd >= 0) {
        close(S->fd);
        S->fd = -1;
    }
    s = setup_cma(S, tuning.cma_wanted, ddp__now_ns() + (int64_t)timeout_ms * 1000000LL);
    if (s != DDP_OK) goto fail;
    *state = S;
    return DDP_OK;
fail:
    if (S->ranks) ddp__shm_publish_abort(S, s, ddp_last_error());
    {
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        shm_destroy(S);
        ddp__set_error_text(text);
    }
    return s;
}

static void shm_abort(void *state, const char *reason)
{
    shm_state_t *S = state;
    if (!S || !S->ranks) return;
    ddp__shm_publish_abort(S, S->last_status ? S->last_status : DDP_ERR_REMOTE, reason);
}

static void shm_destroy(void *state)
{
    shm_state_t *S = state;
    if (!S) return;
    if (S->ranks) {
        char reason[128];
        snprintf(reason, sizeof reason, "rank %d left the group (ddp_group_destroy) after seq %llu",
                 S->rank, (unsigned long long)atomic_load(&S->ranks[S->rank].seq));
        ddp__shm_publish_abort(S, DDP_ERR_REMOTE, reason);
    }
    ddp__shm_buffers_release(S);
    if (S->base) munmap(S->base, S->size);
    if (S->fd >= 0) close(S->fd);
    ddp__shm_cma_release(&S->cma);
    ddp__shm_views_release(&S->views);
    pthread_mutex_destroy(&S->buffers_mu);
    free(S);
}

static const char *shm_algorithm(void *state)
{
    shm_state_t *S = state;
    int a = atomic_load_explicit(&S->last_algorithm, memory_order_relaxed);
    return ddp__shm_algorithm_name(a);
}

const ddp__transport_ops_t ddp__transport_shm = {
    .algorithm = shm_algorithm,
    .name = "shm",
    .create = shm_create,
    .run = ddp__shm_run,
    .alloc_buffer = ddp__shm_alloc_buffer,
    .free_buffer = ddp__shm_free_buffer,
    .advise_cold_results = ddp__shm_advise_cold_results,
    .register_memory = ddp__shm_register_memory,
    .unregister_memory = ddp__shm_unregister_memory,
    .abort = shm_abort,
    .destroy = shm_destroy,
    .alltoall = 1,
    .reduce_scatter_apply = 1,
};
