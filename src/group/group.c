/* Process groups: issuing the transports' five collectives after one set of argument checks
 * (checks.h), ddp_group_submit, buffers and memory registration, and the accessors. The queue
 * and progress thread are in group_queue.c, create/split/destroy in group_life.c.
 *
 * The progress thread hands each collective to the transport (src/transport/transport.h) with
 * an absolute deadline. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/group_internal.h"
#include "group/group_private.h"
#include "group/group_state.h"
#include "transport/transport.h"

/* ---- argument checks (checks.h) ----------------------------------------------------------- */

/* What each of the transports' five kinds takes, so that one function checks and builds them
 * all. A per-rank kind has one buffer of world blocks of `count` (reduce_scatter's send,
 * allgather's recv) and one of a block; in place is the block at this rank's position. */
typedef struct kind_rules {
    const char *fn;         /* the name errors start with */
    const char *count_name; /* the count argument's name; NULL: none (barrier) */
    int has_op;
    int has_root;            /* one buffer, `buf`, and a root (broadcast) */
    int send_is_per_rank;    /* send holds world blocks (reduce_scatter) */
    int recv_is_per_rank;    /* recv holds world blocks (allgather) */
    const char *overlap_text; /* why overlapping buffers that are not in place are refused */
} kind_rules_t;

static const kind_rules_t kind_rules[] = {
    [DDP__ALLREDUCE] = {"allreduce", "count", 1, 0, 0, 0,
                        "send and recv overlap without being equal (in place needs send == recv)"},
    [DDP__BROADCAST] = {"broadcast", "count", 0, 1, 0, 0, NULL},
    [DDP__REDUCE_SCATTER] = {"reduce_scatter", "recv_count", 1, 0, 1, 0,
                             "recv overlaps send but is not send + rank * recv_count elements "
                             "(the in-place position)"},
    [DDP__ALLGATHER] = {"allgather", "send_count", 0, 0, 0, 1,
                        "send overlaps recv but is not recv + rank * send_count elements (the "
                        "in-place position)"},
    [DDP__BARRIER] = {"barrier", NULL, 0, 0, 0, 0, NULL},
};

/* Checks the arguments of one of the five kinds and fills *c with them. broadcast passes its
 * buffer as both send and recv. */
static ddp_status_t build(ddp_group_t *g, ddp__collective_kind_t kind, const void *send,
                          void *recv, size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                          int root, ddp__collective_t *c)
{
    const kind_rules_t *k = &kind_rules[kind];
    TRY(ddp__check_group(g, k->fn));
    memset(c, 0, sizeof *c);
    c->kind = kind;
    if (!k->count_name) {
        c->dtype = DDP_U8;
        return DDP_OK;
    }
    int per_rank = k->send_is_per_rank || k->recv_is_per_rank;
    TRY(ddp__check_dtype(dtype, k->fn));
    if (k->has_op) TRY(ddp__check_op(op, k->fn));
    TRY(ddp__check_count(count, per_rank ? (size_t)g->world : 1, dtype, k->fn, k->count_name));
    if (k->has_root) {
        TRY(ddp__check_buffer(recv, count, k->fn, "buf", k->count_name));
        TRY(ddp__check_rank(ddp_group_size(g), root, k->fn, "root"));
    } else {
        TRY(ddp__check_buffer(send, count, k->fn, "send", k->count_name));
        TRY(ddp__check_buffer(recv, count, k->fn, "recv", k->count_name));
        size_t block = count * ddp_dtype_size(dtype);
        size_t blocks = per_rank ? (size_t)g->world : 1;
        uintptr_t whole = (uintptr_t)(k->recv_is_per_rank ? (const void *)recv : send);
        uintptr_t part = (uintptr_t)(k->recv_is_per_rank ? (const void *)send : recv);
        uintptr_t in_place = whole + (per_rank ? (size_t)g->rank * block : 0);
        if (in_place != part && ddp__overlaps((const void *)whole, block * blocks,
                                              (const void *)part, block))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %s", k->fn, k->overlap_text);
    }
    c->send = send;
    c->recv = recv;
    c->count = count;
    c->dtype = dtype;
    if (k->has_op) c->op = op;
    if (k->has_root) c->root = root;
    return DDP_OK;
}

static ddp_status_t issue(ddp_group_t *g, const ddp__collective_t *c, ddp_work_t **work,
                          const char *fn)
{
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: work is NULL", fn);
    return ddp__group_enqueue(g, c, NULL, NULL, work);
}

/* ---- public collectives ------------------------------------------------------------------- */

ddp_status_t ddp_group_allreduce_async(ddp_group_t *group, const void *send, void *recv,
                                       size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                       ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLREDUCE, send, recv, count, dtype, op, 0, &c));
    return issue(group, &c, work, "allreduce_async");
}

ddp_status_t ddp_group_broadcast_async(ddp_group_t *group, void *buf, size_t count,
                                       ddp_dtype_t dtype, int root, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BROADCAST, buf, buf, count, dtype, 0, root, &c));
    return issue(group, &c, work, "broadcast_async");
}

ddp_status_t ddp_group_reduce_scatter_async(ddp_group_t *group, const void *send, void *recv,
                                            size_t recv_count, ddp_dtype_t dtype,
                                            ddp_reduce_op_t op, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__REDUCE_SCATTER, send, recv, recv_count, dtype, op, 0, &c));
    return issue(group, &c, work, "reduce_scatter_async");
}

ddp_status_t ddp_group_allgather_async(ddp_group_t *group, const void *send, void *recv,
                                       size_t send_count, ddp_dtype_t dtype, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLGATHER, send, recv, send_count, dtype, 0, 0, &c));
    return issue(group, &c, work, "allgather_async");
}

ddp_status_t ddp_group_barrier_async(ddp_group_t *group, ddp_work_t **work)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BARRIER, NULL, NULL, 0, DDP_U8, 0, 0, &c));
    return issue(group, &c, work, "barrier_async");
}

ddp_status_t ddp_group_allreduce(ddp_group_t *group, const void *send, void *recv, size_t count,
                                 ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLREDUCE, send, recv, count, dtype, op, 0, &c));
    return ddp__group_run_blocking(group, &c);
}

ddp_status_t ddp_group_broadcast(ddp_group_t *group, void *buf, size_t count, ddp_dtype_t dtype,
                                 int root)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BROADCAST, buf, buf, count, dtype, 0, root, &c));
    return ddp__group_run_blocking(group, &c);
}

ddp_status_t ddp_group_reduce_scatter(ddp_group_t *group, const void *send, void *recv,
                                      size_t recv_count, ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__REDUCE_SCATTER, send, recv, recv_count, dtype, op, 0, &c));
    return ddp__group_run_blocking(group, &c);
}

ddp_status_t ddp_group_allgather(ddp_group_t *group, const void *send, void *recv,
                                 size_t send_count, ddp_dtype_t dtype)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__ALLGATHER, send, recv, send_count, dtype, 0, 0, &c));
    return ddp__group_run_blocking(group, &c);
}

ddp_status_t ddp_group_barrier(ddp_group_t *group)
{
    ddp__clear_error();
    ddp__collective_t c;
    TRY(build(group, DDP__BARRIER, NULL, NULL, 0, DDP_U8, 0, 0, &c));
    return ddp__group_run_blocking(group, &c);
}

int ddp__group_has_alltoall(const ddp_group_t *group) { return group->ops->alltoall; }

/* A kind only some transports take (their table says so): queued like the five kinds' _async
 * calls, or run now when work is NULL. */
static ddp_status_t queue_or_run(ddp_group_t *group, ddp__collective_t *c,
                                 ddp_work_t **work)
{
    return work ? ddp__group_enqueue(group, c, NULL, NULL, work)
                : ddp__group_run_blocking(group, c);
}

ddp_status_t ddp__group_alltoall(ddp_group_t *group, const void *send, void *recv, size_t count,
                                 ddp_dtype_t dtype, ddp_work_t **work)
{
    ddp__collective_t c = {
        .kind = DDP__ALLTOALL, .send = send, .recv = recv, .count = count, .dtype = dtype};
    return queue_or_run(group, &c, work);
}

int ddp__group_has_reduce_scatter_apply(const ddp_group_t *group)
{
    return group->ops->reduce_scatter_apply;
}

ddp_status_t ddp__group_reduce_scatter_apply(ddp_group_t *group, const void *send, void *recv,
                                             size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                             ddp_apply_fn fn, void *arg, ddp_work_t **work)
{
    ddp__collective_t c = {.kind = DDP__REDUCE_SCATTER_APPLY,
                                 .send = send,
                                 .recv = recv,
                                 .count = count,
                                 .dtype = dtype,
                                 .op = op,
                                 .apply = fn,
                                 .apply_arg = arg};
    return queue_or_run(group, &c, work);
}

ddp_status_t ddp_group_submit(ddp_group_t *group, ddp_task_fn fn, void *arg, ddp_work_t **work)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "submit"));
    if (!fn) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "submit: fn is NULL");
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "submit: work is NULL");
    return ddp__group_enqueue(group, NULL, fn, arg, work);
}

/* ---- buffers ------------------------------------------------------------------------------ */

ddp_status_t ddp_group_alloc_buffer(ddp_group_t *group, size_t bytes, void **out)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "alloc_buffer"));
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alloc_buffer: out is NULL");
    if (bytes > SIZE_MAX / 4)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "alloc_buffer: bytes %zu is too large", bytes);
    if (atomic_load(&group->broken)) return ddp__group_aborted_error(group, "alloc_buffer");
    if (group->ops->alloc_buffer) {
        ddp_status_t s = group->ops->alloc_buffer(group->state, bytes, out);
        if (s == DDP_ERR_MISMATCH) {
            /* Ranks disagree on the sizes (and on later buffers' order): like a mismatched
             * collective, this breaks the group so later calls fail instead of hanging. */
            char text[DDP_ERROR_TEXT_MAX];
            snprintf(text, sizeof text, "%s", ddp_last_error());
            ddp__group_break_group(group, s, text);
            ddp__set_error_text(text);
        }
        return s;
    }
    /* Ordinary memory: nothing to agree on, but the call is collective, so check that every
     * rank asked for the same size (as shm does) and break the group if not: a rank that later
     * reduces more elements than its peers' buffers hold would otherwise fail far from here. */
    if (group->world > 1) {
        int64_t range[2] = {(int64_t)bytes, -(int64_t)bytes}; /* MAX gives largest, -smallest */
        ddp_status_t s = ddp_group_allreduce(group, range, range, 2, DDP_I64, DDP_MAX);
        if (s != DDP_OK) return s;
        if (range[0] != -range[1]) {
            char text[DDP_ERROR_TEXT_MAX];
            snprintf(text, sizeof text,
                     "alloc_buffer on rank %d: the ranks asked for different sizes (smallest "
                     "%lld bytes, largest %lld bytes; this rank %zu bytes): every rank must ask "
                     "for the same size in the same order",
                     group->rank, (long long)-range[1], (long long)range[0], bytes);
            ddp__group_break_group(group, DDP_ERR_MISMATCH, text);
            return ddp__error(DDP_ERR_MISMATCH, "%s", text);
        }
    }
    fallback_buffer_t *node = ddp__calloc(1, sizeof *node, "a buffer record");
    if (!node) return DDP_ERR_NO_MEMORY;
    size_t rounded = (bytes + 63) / 64 * 64;
    node->ptr = aligned_alloc(64, rounded ? rounded : 64);
    if (!node->ptr) {
        free(node);
        return ddp__error(DDP_ERR_NO_MEMORY, "alloc_buffer: out of memory for %zu bytes", bytes);
    }
    memset(node->ptr, 0, rounded ? rounded : 64);
    pthread_mutex_lock(&group->mu);
    node->next = group->fallback_buffers;
    group->fallback_buffers = node;
    pthread_mutex_unlock(&group->mu);
    *out = node->ptr;
    return DDP_OK;
}

void ddp__group_advise_cold_results(ddp_group_t *group, void *buffer)
{
    if (group && buffer && group->ops->advise_cold_results)
        group->ops->advise_cold_results(group->state, buffer);
}

ddp_status_t ddp_group_free_buffer(ddp_group_t *group, void *buffer)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "free_buffer"));
    if (!buffer) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "free_buffer: buffer is NULL");
    if (group->ops->free_buffer) return group->ops->free_buffer(group->state, buffer);
    pthread_mutex_lock(&group->mu);
    fallback_buffer_t **link = &group->fallback_buffers;
    while (*link && (*link)->ptr != buffer) link = &(*link)->next;
    fallback_buffer_t *node = *link;
    if (node) *link = node->next;
    pthread_mutex_unlock(&group->mu);
    if (!node)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "free_buffer: %p was not returned by ddp_group_alloc_buffer on this group",
                          buffer);
    free(node->ptr);
    free(node);
    return DDP_OK;
}

ddp_status_t ddp_group_register_memory(ddp_group_t *group, void *ptr, size_t bytes)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "register_memory"));
    if (!ptr || bytes == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "register_memory: %s",
                          ptr ? "bytes is 0" : "ptr is NULL");
    if ((uintptr_t)ptr > UINTPTR_MAX - bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "register_memory: %p + %zu bytes wraps around the address space", ptr,
                          bytes);
    if (atomic_load(&group->broken)) return ddp__group_aborted_error(group, "register_memory");
    return group->ops->register_memory ? group->ops->register_memory(group->state, ptr, bytes)
                                       : DDP_OK;
}

ddp_status_t ddp_group_unregister_memory(ddp_group_t *group, void *ptr)
{
    ddp__clear_error();
    TRY(ddp__check_group(group, "unregister_memory"));
    if (!ptr) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "unregister_memory: ptr is NULL");
    /* Also on a broken group: the pages must go back to ordinary memory whatever happened. */
    return group->ops->unregister_memory ? group->ops->unregister_memory(group->state, ptr)
                                         : DDP_OK;
}

/* ---- accessors ---------------------------------------------------------------------------- */

int ddp_group_rank(const ddp_group_t *group) { return group ? group->rank : -1; }
int ddp_group_size(const ddp_group_t *group) { return group ? group->world : 0; }
int ddp_group_timeout_ms(const ddp_group_t *group) { return group ? group->timeout_ms : 0; }
const char *ddp_group_transport(const ddp_group_t *group)
{
    return group && group->ops ? group->ops->name : "none";
}

const char *ddp_group_algorithm(const ddp_group_t *group)
{
    if (!group || !group->ops) return "none";
    if (!group->ops->algorithm || !group->state) return group->ops->name;
    return group->ops->algorithm(group->state);
}

void ddp_group_set_trace(ddp_group_t *group, ddp_trace_t *trace)
{
    ddp__clear_error(); /* status.h: a libddp call that cannot fail leaves no text */
    if (group) atomic_store_explicit(&group->trace, trace, memory_order_release);
}

ddp_trace_t *ddp_group_trace(const ddp_group_t *group)
{
    ddp__clear_error();
    return group ? atomic_load_explicit(&((ddp_group_t *)group)->trace, memory_order_acquire)
                 : NULL;
}

