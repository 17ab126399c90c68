/* The hierarchical transport: when ranks span several hosts, each collective runs inside each host
 * over shared memory (the shm transport, among that host's ranks), among one leader per host
 * (the lowest rank of the host) over TCP, and inside each host again, so only one rank per host
 * puts data on the network and the in-host traffic stays in memory.
 *
 * Allreduce: reduce inside the host (a local allreduce), allreduce among the leaders, broadcast
 * from the leader inside the host; every rank ends with the leader's bytes, so results are
 * bitwise identical. f16/bf16 (and AVG of i32/u8) travel in their accumulation type (f32, i64)
 * through all three steps and are rounded once at the end, as src/core/reduce.h defines them.
 * Broadcast: inside the root's host, among leaders, inside the other hosts. Allgather and
 * reduce_scatter reuse the allreduce (a zero-padded gather summed as bytes; a full reduction
 * from which each rank keeps its block): correct and simple, not bandwidth-optimal.
 *
 * Before data moves, the fingerprints of all ranks are compared in three small steps (an
 * allgather inside each host, an allgather of per-host verdicts among leaders, a broadcast of
 * the global verdict inside each host), so a disagreement anywhere is DDP_ERR_MISMATCH on every
 * rank naming both sides. A failure in any step breaks the transport and aborts both
 * sub-transports, so the other ranks of this host and the other leaders fail fast. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/hier/hier.h"
#include "transport/shm/shm.h"
#include "transport/tcp/tcp.h"

static const char *_Atomic identity_override;
static const ddp__transport_ops_t *_Atomic local_override;

void ddp__hier_set_host_identity(const char *identity) { identity_override = identity; }
void ddp__hier_set_local_transport(const ddp__transport_ops_t *ops) { local_override = ops; }

typedef struct hier {
    int rank, world;
    char group[512];
    int nhosts, host, local_rank, local_n;
    int *host_of;        /* [world] host index of each rank */
    int *leader_of_host; /* [nhosts] global rank of each host's leader */
    int *local_ranks;    /* [local_n] global ranks of my host, ascending */
    const ddp__transport_ops_t *lops;
    void *local;   /* NULL when I am alone on my host */
    void *leaders; /* NULL unless I lead my host and there are several hosts */
    uint64_t lseq, xseq, parent_seq;
    int on_progress_thread; /* of the collective being run: handed to the sub-collectives */
    ddp_trace_t *trace;     /* the same */
    char local_map[160], leader_map[160]; /* "local rank i = global rank g" for error texts */
    char *work;
    size_t work_bytes;
    int broken;
    char broken_text[DDP_ERROR_TEXT_MAX];
} hier_t;

/* ---- sub-collectives ------------------------------------------------------------------------ */
static ddp_status_t sub(hier_t *h, int among_leaders, ddp__collective_kind_t kind,
                        const void *send, void *recv, size_t count, ddp_dtype_t dtype,
                        ddp_reduce_op_t op, int root, int64_t deadline_ns)
{
    void *state = among_leaders ? h->leaders : h->local;
    if (!state) return DDP_OK;
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.seq = among_leaders ? ++h->xseq : ++h->lseq;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dtype;
    c.op = op;
    c.root = root;
    c.deadline_ns = deadline_ns;
    c.on_progress_thread = h->on_progress_thread;
    c.trace = h->trace;
    const ddp__transport_ops_t *ops = among_leaders ? &ddp__transport_tcp : h->lops;
    ddp_status_t s = ops->run(state, &c);
    /* The sub-transport numbers ranks and sequence numbers its own way: say how to read them. */
    if (s != DDP_OK)
        ddp__error_context(s, "hierarchical transport, group '%s', rank %d (host %d), seq %llu, "
                           "%s (its ranks %s; its seq %llu)", h->group, h->rank, h->host,
                           (unsigned long long)h->parent_seq,
                           among_leaders ? "among host leaders over tcp" : "inside the host",
                           among_leaders ? h->leader_map : h->local_map,
                           (unsigned long long)c.seq);
    return s;
}

static ddp_status_t ensure(hier_t *h, size_t bytes)
{
    if (h->work_bytes >= bytes) return DDP_OK;
    free(h->work);
    h->work_bytes = 0;
    h->work = malloc(bytes < 4096 ? 4096 : bytes);
    if (!h->work) return ddp__error(DDP_ERR_NO_MEMORY, "hierarchical transport: %zu bytes", bytes);
    h->work_bytes = bytes < 4096 ? 4096 : bytes;
    return DDP_OK;
}

/* ---- fingerprints --------------------------------------------------------------------------- */
typedef ddp__fingerprint_t fprec_t;

typedef struct verdict {
    fprec_t first; /* the fingerprint of the host's leader */
    int32_t bad, a, b, pad;
    fprec_t fa, fb; /* when bad: rank a called fa, rank b called fb */
} verdict_t;

static fprec_t fprec_of(const ddp__collective_t *c) { return ddp__fingerprint_of(c); }

static void describe(const fprec_t *f, char *buf, size_t size) { ddp__fingerprint_text(f, buf, size); }

static ddp_status_t check_fingerprints(hier_t *h, const ddp__collective_t *c)
{
    ddp_status_t s = ensure(h, sizeof(fprec_t) * (size_t)(h->local_n > h->nhosts ? h->local_n : h->nhosts) +
                                   sizeof(verdict_t) * (size_t)h->nhosts);
    if (s != DDP_OK) return s;
    verdict_t v;
    memset(&v, 0, sizeof v);
    v.first = fprec_of(c);
    /* (a) inside the host */
    fprec_t *local = (fprec_t *)h->work;
    local[h->local_rank] = v.first;
    s = sub(h, 0, DDP__ALLGATHER, &local[h->local_rank], local, sizeof(fprec_t), DDP_U8, 0, 0,
            c->deadline_ns);
    if (s != DDP_OK) return s;
    v.first = local[0];
    for (int j = 1; j < h->local_n && !v.bad; j++) {
        if (memcmp(&local[j], &local[0], sizeof local[0]) != 0) {
            v.bad = 1;
            v.a = h->local_ranks[0];
            v.fa = local[0];
            v.b = h->local_ranks[j];
            v.fb = local[j];
        }
    }
    /* (b) among leaders: every leader computes the same global verdict */
    if (h->leaders) {
        verdict_t *all = (verdict_t *)h->work;
        all[h->host] = v;
        s = sub(h, 1, DDP__ALLGATHER, &all[h->host], all, sizeof(verdict_t), DDP_U8, 0, 0,
                c->deadline_ns);
        if (s != DDP_OK) return s;
        verdict_t g = all[0];
        for (int k = 0; k < h->nhosts && !g.bad; k++) {
            if (all[k].bad) {
                g = all[k];
            } else if (memcmp(&all[k].first, &all[0].first, sizeof all[0].first) != 0) {
                g.bad = 1;
                g.a = h->leader_of_host[0];
                g.fa = all[0].first;
                g.b = h->leader_of_host[k];
                g.fb = all[k].first;
            }
        }
        v = g;
    }
    /* (c) the verdict to the rest of the host */
    s = sub(h, 0, DDP__BROADCAST, &v, &v, sizeof v, DDP_U8, 0, 0, c->deadline_ns);
    if (s != DDP_OK) return s;
    if (v.bad) {
        char fa[200], fb[200];
        describe(&v.fa, fa, sizeof fa);
        describe(&v.fb, fb, sizeof fb);
        return ddp__error(DDP_ERR_MISMATCH, "hierarchical transport, group '%s': ranks disagree "
                          "on the collective: rank %d called %s but rank %d called %s", h->group,
                          v.a, fa, v.b, fb);
    }
    return DDP_OK;
}

/* ---- allreduce ------------------------------------------------------------------------------- */
static ddp_status_t allreduce(hier_t *h, const void *send, void *recv, size_t count,
                              ddp_dtype_t dtype, ddp_reduce_op_t op, int64_t deadline)
{
    ddp_dtype_t at = ddp__acc_dtype(dtype, op);
    ddp_status_t s;
    if (at == dtype && op != DDP_AVG) {
        if (!h->local && send != recv) memmove(recv, send, count * ddp_dtype_size(dtype));
        if ((s = sub(h, 0, DDP__ALLREDUCE, send, recv, count, dtype, op, 0, deadline))) return s;
        if ((s = sub(h, 1, DDP__ALLREDUCE, recv, recv, count, dtype, op, 0, deadline))) return s;
        return sub(h, 0, DDP__BROADCAST, recv, recv, count, dtype, 0, 0, deadline);
    }
    /* Sums travel in the accumulation type; the division and rounding happen once, on every
     * rank, from identical bytes. */
    size_t as = ddp_dtype_size(at);
    if ((s = ensure(h, count * as))) return s;
    char *w = h->work;
    if (at != dtype) ddp__acc_widen(w, send, count, dtype);
    else memmove(w, send, count * as);
    ddp_reduce_op_t sop = op == DDP_AVG ? DDP_SUM : op;
    if ((s = sub(h, 0, DDP__ALLREDUCE, w, w, count, at, sop, 0, deadline))) return s;
    if ((s = sub(h, 1, DDP__ALLREDUCE, w, w, count, at, sop, 0, deadline))) return s;
    if ((s = sub(h, 0, DDP__BROADCAST, w, w, count, at, 0, 0, deadline))) return s;
    ddp__acc_finish(recv, w, count, dtype, at, op, h->world);
    return DDP_OK;
}

static ddp_status_t broadcast(hier_t *h, const ddp__collective_t *c)
{
    size_t bytes = c->count * ddp_dtype_size(c->dtype);
    void *buf = c->recv;
    ddp_status_t s;
    if (h->rank == c->root && c->send && c->send != c->recv) memmove(buf, c->send, bytes);
    int root_host = h->host_of[c->root];
    if (root_host == h->host) {
        int root_local = 0;
        for (int j = 0; j < h->local_n; j++)
            if (h->local_ranks[j] == c->root) root_local = j;
        if ((s = sub(h, 0, DDP__BROADCAST, buf, buf, c->count, c->dtype, 0, root_local,
                     c->deadline_ns)))
            return s;
    }
    if ((s = sub(h, 1, DDP__BROADCAST, buf, buf, c->count, c->dtype, 0, root_host,
                 c->deadline_ns)))
        return s;
    if (root_host != h->host)
        return sub(h, 0, DDP__BROADCAST, buf, buf, c->count, c->dtype, 0, 0, c->deadline_ns);
    return DDP_OK;
}

/* Allgather as a byte-wise sum of zero-padded contributions (x + 0 is exact on bytes). */
static ddp_status_t allgather(hier_t *h, const ddp__collective_t *c)
{
    size_t block = c->count * ddp_dtype_size(c->dtype);
    char *recv = c->recv;
    char *mine = recv + block * (size_t)h->rank;
    if (c->send != mine) memmove(mine, c->send, block);
    memset(recv, 0, block * (size_t)h->rank);
    memset(mine + block, 0, block * (size_t)(h->world - h->rank - 1));
    return allreduce(h, recv, recv, block * (size_t)h->world, DDP_U8, DDP_SUM, c->deadline_ns);
}

/* Reduce-scatter as a full reduction into a scratch vector, keeping this rank's block. */
static ddp_status_t reduce_scatter(hier_t *h, const ddp__collective_t *c)
{
    size_t es = ddp_dtype_size(c->dtype);
    size_t total = c->count * (size_t)h->world;
    char *full = malloc(total * es);
    if (!full) return ddp__error(DDP_ERR_NO_MEMORY, "hierarchical reduce_scatter: %zu bytes",
                                 total * es);
    ddp_status_t s = allreduce(h, c->send, full, total, c->dtype, c->op, c->deadline_ns);
    if (s == DDP_OK) memmove(c->recv, full + c->count * (size_t)h->rank * es, c->count * es);
    free(full);
    return s;
}

static ddp_status_t dispatch(hier_t *h, const ddp__collective_t *c)
{
    ddp_status_t s = check_fingerprints(h, c);
    if (s != DDP_OK || c->kind == DDP__BARRIER || c->count == 0) return s;
    switch (c->kind) {
    case DDP__ALLREDUCE:
        return allreduce(h, c->send, c->recv, c->count, c->dtype, c->op, c->deadline_ns);
    case DDP__BROADCAST: return broadcast(h, c);
    case DDP__ALLGATHER: return allgather(h, c);
    case DDP__REDUCE_SCATTER: return reduce_scatter(h, c);
    default: return DDP_OK;
    }
}

/* ---- the ops table ---------------------------------------------------------------------------- */
static void host_identity(char *buf, size_t size)
{
    const char *forced = identity_override;
    if (forced) snprintf(buf, size, "%s", forced);
    else ddp__host_identity(buf, size);
}

static void hier_destroy(void *state);

static ddp_status_t hier_create(ddp_store_t *store, const char *group_name, int rank, int world,
                                int timeout_ms, void **state)
{
    if (!store) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: store is NULL");
    if (!group_name || !*group_name || strlen(group_name) > 400)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: group_name is "
                          "NULL, empty or longer than 400 bytes");
    if (world < 1 || rank < 0 || rank >= world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: rank %d of world "
                          "%d", rank, world);
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: state is NULL");
    /* The group resolves its timeout (its options, else DDP_TIMEOUT) and hands it down: a
     * transport reads no configuration of its own. */
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: timeout_ms %d is negative",
                          timeout_ms);
    int64_t deadline = ddp__now_ns() + (int64_t)timeout_ms * 1000000LL;

    hier_t *h = calloc(1, sizeof *h);
    if (!h) return ddp__error(DDP_ERR_NO_MEMORY, "hierarchical transport: state");
    h->rank = rank;
    h->world = world;
    h->lops = local_override ? local_override : &ddp__transport_shm;
    snprintf(h->group, sizeof h->group, "%s", group_name);
    h->host_of = calloc((size_t)world * 3, sizeof(int));
    char **ids = calloc((size_t)world, sizeof *ids);
    ddp_status_t s = DDP_OK;
    if (!h->host_of || !ids) {
        s = ddp__error(DDP_ERR_NO_MEMORY, "hierarchical transport: tables");
        goto fail;
    }
    h->leader_of_host = h->host_of + world;
    h->local_ranks = h->host_of + 2 * world;

    /* Who shares a host with whom: hosts are numbered in order of their lowest rank. */
    char mine[600], key[DDP_STORE_MAX_KEY];
    host_identity(mine, sizeof mine);
    snprintf(key, sizeof key, "%s/hier/host/%d", group_name, rank);
    if ((s = ddp_store_set(store, key, mine, strlen(mine) + 1))) goto fail;
    for (int r = 0; r < world; r++) {
        snprintf(key, sizeof key, "%s/hier/host/%d", group_name, r);
        const char *keys[1] = {key};
        int ms = (int)((deadline - ddp__now_ns()) / 1000000);
        if ((s = ddp_store_wait(store, keys, 1, ms > 0 ? ms : 1))) {
            ddp__error_context(s, "hierarchical transport: waiting for the host of rank %d", r);
            goto fail;
        }
        size_t len = 0;
        if ((s = ddp_store_get(store, key, (void **)&ids[r], &len))) goto fail;
        int found = -1;
        for (int q = 0; q < r && found < 0; q++)
            if (strcmp(ids[q], ids[r]) == 0) found = h->host_of[q];
        if (found < 0) {
            found = h->nhosts++;
            h->leader_of_host[found] = r;
        }
        h->host_of[r] = found;
    }
    h->host = h->host_of[rank];
    for (int r = 0; r < world; r++) {
        if (h->host_of[r] != h->host) continue;
        if (r == rank) h->local_rank = h->local_n;
        h->local_ranks[h->local_n++] = r;
    }

    size_t used = 0;
    for (int j = 0; j < h->local_n && used + 24 < sizeof h->local_map; j++)
        used += (size_t)snprintf(h->local_map + used, sizeof h->local_map - used, "%s%d=rank %d",
                                 j ? ", " : "", j, h->local_ranks[j]);
    used = 0;
    for (int k = 0; k < h->nhosts && used + 24 < sizeof h->leader_map; k++)
        used += (size_t)snprintf(h->leader_map + used, sizeof h->leader_map - used,
                                 "%s%d=rank %d", k ? ", " : "", k, h->leader_of_host[k]);
    int ms = (int)((deadline - ddp__now_ns()) / 1000000);
    if (h->local_n > 1) {
        snprintf(key, sizeof key, "%s/hier/host%d", group_name, h->host);
        if ((s = h->lops->create(store, key, h->local_rank, h->local_n, ms > 0 ? ms : 1,
                                 &h->local))) {
            ddp__error_context(s, "hierarchical transport: %s among the %d ranks of host %d",
                               h->lops->name, h->local_n, h->host);
            h->local = NULL;
            goto fail;
        }
    }
    ms = (int)((deadline - ddp__now_ns()) / 1000000);
    if (h->local_rank == 0 && h->nhosts > 1) {
        snprintf(key, sizeof key, "%s/hier/leaders", group_name);
        if ((s = ddp__transport_tcp.create(store, key, h->host, h->nhosts, ms > 0 ? ms : 1,
                                           &h->leaders))) {
            ddp__error_context(s, "hierarchical transport: tcp among the %d host leaders",
                               h->nhosts);
            h->leaders = NULL;
            goto fail;
        }
    }
    DDP_LOG(DDP_LOG_INFO, "hierarchical transport: group '%s' rank %d: host %d of %d, local rank "
            "%d of %d%s", group_name, rank, h->host, h->nhosts, h->local_rank, h->local_n,
            h->leaders ? ", leader" : "");
    for (int r = 0; r < world; r++) ddp_free(ids[r]);
    free(ids);
    *state = h;
    return DDP_OK;

fail:
    if (ids)
        for (int r = 0; r < world; r++) ddp_free(ids[r]);
    free(ids);
    hier_destroy(h);
    return s;
}

static ddp_status_t hier_run(void *state, const ddp__collective_t *c)
{
    hier_t *h = state;
    if (!h || !c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: %s is NULL",
                                    h ? "collective" : "state");
    if ((unsigned)c->kind > DDP__BARRIER ||
        (c->kind != DDP__BARRIER && ddp_dtype_size(c->dtype) == 0) ||
        ((c->kind == DDP__ALLREDUCE || c->kind == DDP__REDUCE_SCATTER) &&
         (unsigned)c->op >= DDP_OP_COUNT) ||
        (c->kind == DDP__BROADCAST && (c->root < 0 || c->root >= h->world)))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "hierarchical transport: invalid collective "
                          "(kind %d, dtype %d, op %d, root %d)", (int)c->kind, (int)c->dtype,
                          (int)c->op, c->root);
    if (h->broken)
        return ddp__error(DDP_ERR_ABORTED, "hierarchical transport, group '%s', rank %d: broken "
                          "by an earlier failure (%s); seq %llu not run", h->group, h->rank,
                          h->broken_text, (unsigned long long)c->seq);
    if (h->world == 1) {
        size_t bytes = c->count * ddp_dtype_size(c->dtype);
        if (c->kind != DDP__BARRIER && bytes && c->send && c->send != c->recv)
            memmove(c->recv, c->send, bytes);
        return DDP_OK;
    }
    h->parent_seq = c->seq;
    h->on_progress_thread = c->on_progress_thread;
    h->trace = c->trace;
    ddp_status_t s = dispatch(h, c);
    if (s != DDP_OK) {
        h->broken = 1;
        snprintf(h->broken_text, sizeof h->broken_text, "%s", ddp_last_error());
        char reason[DDP_ERROR_TEXT_MAX];
        snprintf(reason, sizeof reason, "rank %d: %s", h->rank, ddp_last_error());
        if (h->local && h->lops->abort) h->lops->abort(h->local, reason);
        if (h->leaders) ddp__transport_tcp.abort(h->leaders, reason);
        ddp__set_error_text(h->broken_text);
    }
    return s;
}

static void hier_abort(void *state, const char *reason)
{
    hier_t *h = state;
    if (!h) return;
    if (h->local && h->lops->abort) h->lops->abort(h->local, reason);
    if (h->leaders) ddp__transport_tcp.abort(h->leaders, reason);
}

static void hier_destroy(void *state)
{
    hier_t *h = state;
    if (!h) return;
    if (h->local) h->lops->destroy(h->local);
    if (h->leaders) ddp__transport_tcp.destroy(h->leaders);
    free(h->host_of);
    free(h->work);
    free(h);
}

/* Registered memory helps the host-local step, which runs on the caller's buffers. */
static ddp_status_t hier_register_memory(void *state, void *ptr, size_t bytes)
{
    hier_t *h = state;
    return h->local && h->lops->register_memory ? h->lops->register_memory(h->local, ptr, bytes)
                                                : DDP_OK;
}

static ddp_status_t hier_unregister_memory(void *state, void *ptr)
{
    hier_t *h = state;
    return h->local && h->lops->unregister_memory ? h->lops->unregister_memory(h->local, ptr)
                                                  : DDP_OK;
}

const ddp__transport_ops_t ddp__transport_hierarchical = {
    .name = "hierarchical",
    .create = hier_create,
    .run = hier_run,
    .alloc_buffer = NULL,
    .free_buffer = NULL,
    .register_memory = hier_register_memory,
    .unregister_memory = hier_unregister_memory,
    .abort = hier_abort,
    .destroy = hier_destroy,
    .pair_transport = "tcp", /* two ranks need no hierarchy */
    .multi_host = 1,
};
