/* The contract between the process-group layer and a transport (shm, tcp, mpi, hierarchical).
 *
 * The group layer owns the work queue, the progress thread, sequence numbers and timeouts; it
 * hands one collective at a time, in issue order, to its transport's `run`, on the progress
 * thread. A transport knows nothing above this header. Each transport is one table of function
 * pointers (like NCCL's transports or gloo's transport/), so a new backend touches one folder. */
#ifndef DDP_GROUP_TRANSPORT_H
#define DDP_GROUP_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/ddp.h"

typedef enum ddp__collective_kind {
    DDP__ALLREDUCE = 0,
    DDP__BROADCAST,
    DDP__REDUCE_SCATTER,
    DDP__ALLGATHER,
    DDP__BARRIER,
} ddp__collective_kind_t;

/* One collective as every rank must agree on it. The fingerprint is (seq, kind, dtype, op,
 * count, root): a transport must detect any disagreement among ranks and return
 * DDP_ERR_MISMATCH on every rank with both sides in the text (ddp__fingerprint_describe). */
typedef struct ddp__collective {
    ddp__collective_kind_t kind;
    uint64_t seq;       /* 1, 2, 3 ... per group, identical on every rank */
    const void *send;   /* input; may equal recv (in place) */
    void *recv;         /* output */
    size_t count;       /* allreduce/broadcast: elements; reduce_scatter: elements per rank
                           (recv count); allgather: elements each rank sends; barrier: 0 */
    ddp_dtype_t dtype;
    ddp_reduce_op_t op; /* allreduce and reduce_scatter only; 0 otherwise */
    int root;           /* broadcast only; 0 otherwise */
    int64_t deadline_ns; /* absolute, on ddp__now_ns()'s clock: fail with DDP_ERR_TIMEOUT after
                            it, naming the ranks that did not arrive and their sequence numbers */
} ddp__collective_t;

typedef struct ddp__transport_ops {
    const char *name; /* "shm", "tcp", "mpi", "hierarchical" */

    /* Collective over `world` ranks: rendezvous through `store` (keys under `group_name`), set up
     * connections or segments. timeout_ms bounds the rendezvous. */
    ddp_status_t (*create)(ddp_store_t *store, const char *group_name, int rank, int world,
                           int timeout_ms, void **state);

    /* Runs one collective to completion on the calling (progress) thread. Must verify the
     * fingerprint across ranks, honour c->deadline_ns, notice dead peers, and produce results
     * that are bitwise identical on every rank. */
    ddp_status_t (*run)(void *state, const ddp__collective_t *c);

    /* Optional (NULL: the group falls back to aligned malloc). Collective: every rank calls with
     * the same size in the same order; returns memory the transport reads without a copy. */
    ddp_status_t (*alloc_buffer)(void *state, size_t bytes, void **out);
    ddp_status_t (*free_buffer)(void *state, void *buffer);

    /* Optional hint on a buffer from alloc_buffer: results of collectives on it are read later,
     * after other work (gradient buckets, read by the optimizer), not right away. The transport
     * may then write other ranks' results with non-temporal stores. Results are unchanged. */
    void (*advise_cold_results)(void *state, void *buffer);

    /* Marks the transport broken with a reason peers can read, so that they fail fast instead
     * of waiting for their timeout. Optional. */
    void (*abort)(void *state, const char *reason);

    void (*destroy)(void *state);
} ddp__transport_ops_t;

/* Writes "seq S allreduce f32 sum count N root R" into buf. Implemented in src/group/. */
void ddp__fingerprint_describe(const ddp__collective_t *c, char *buf, size_t size);

#endif
