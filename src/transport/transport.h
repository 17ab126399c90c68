/* The contract between the process-group layer and a transport (self, shm, tcp, hierarchical,
 * mpi), and what transports share: fingerprints, host identity, the registry of transports.
 *
 * The group layer owns the work queue, the progress thread, sequence numbers and timeouts; it
 * hands one collective at a time, in issue order, to its transport's `run`. A transport includes
 * core and this header, nothing above: what it needs to know about its caller (the deadline,
 * whether it runs on a progress thread) comes in the collective. Each transport is one table of
 * function pointers (like NCCL's transports or gloo's transport/) in a folder of its own, named
 * once in the list of src/core/transports.h. */
#ifndef DDP_TRANSPORT_TRANSPORT_H
#define DDP_TRANSPORT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "ddp/ddp.h"

typedef enum ddp__collective_kind {
    DDP__ALLREDUCE = 0,
    DDP__BROADCAST,
    DDP__REDUCE_SCATTER,
    DDP__ALLGATHER,
    DDP__BARRIER,
    DDP__ALLTOALL, /* only to a transport whose table sets `alltoall` */
    DDP__REDUCE_SCATTER_APPLY, /* only to a transport whose table sets `reduce_scatter_apply` */
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
                           (recv count); allgather: elements each rank sends; alltoall: elements
                           each rank sends to each rank (send and recv hold world blocks of
                           count; they may overlap in any way); barrier: 0 */
    ddp_dtype_t dtype;
    ddp_reduce_op_t op; /* allreduce and reduce_scatter only; 0 otherwise */
    int root;           /* broadcast only; 0 otherwise */
    int64_t deadline_ns; /* absolute, on ddp__now_ns()'s clock: fail with DDP_ERR_TIMEOUT after
                            it, naming the ranks that did not arrive and their sequence numbers */
    int on_progress_thread; /* 1: run on a group's progress thread, which shares its rank's CPU
                               with the user's thread when the rank is pinned, so a wait should
                               not spin; 0: on the user's thread. Not part of the fingerprint. */
    ddp_trace_t *trace; /* NULL, or where the transport may record events of this call (the
                           shm tuner's decisions) with ddp_trace_instant; the group's
                           ddp_group_set_trace. Not part of the fingerprint. */
    ddp_apply_fn apply; /* reduce_scatter_apply only (send and recv hold world blocks of count;
                           see ddp_group_reduce_scatter_apply); with apply_arg, not part of the
                           fingerprint */
    void *apply_arg;
} ddp__collective_t;

/* A launcher runtime's way to meet without a store (transport_ops.bootstrap). */
typedef struct ddp__bootstrap_ops {
    /* Broadcasts len bytes from rank 0 of the launcher's world to every rank through the
     * runtime (MPI_Ibcast over MPI_COMM_WORLD), without a store, and gives this process's rank
     * and the world's size there. Collective over the launcher's world; DDP_ERR_TIMEOUT when not
     * every rank joined within timeout_ms. ddp_group_create_from_env uses it under mpirun to
     * hand out the address of a store rank 0 hosts, so the group can use shared memory and TCP
     * like ddprun's. */
    ddp_status_t (*bcast)(void *buf, size_t len, int timeout_ms, int *rank, int *world);
} ddp__bootstrap_ops_t;

typedef struct ddp__transport_ops {
    const char *name; /* its name in src/core/transports.h's list, or "self" */

    /* Collective over `world` ranks: rendezvous through `store` (keys under `group_name`), set up
     * connections or segments. timeout_ms bounds the rendezvous and is the group's timeout,
     * resolved by the group (a transport reads no configuration of its own). A transport with
     * `storeless` set also accepts store == NULL: it then connects through its own runtime
     * (MPI_COMM_WORLD in rank order for mpi). */
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

    /* Optional (NULL: both succeed and do nothing). Not collective; may be called from any
     * thread while collectives run (on other buffers). See ddp_group_register_memory. */
    ddp_status_t (*register_memory)(void *state, void *ptr, size_t bytes);
    ddp_status_t (*unregister_memory)(void *state, void *ptr);

    /* Marks the transport broken with a reason peers can read, so that they fail fast instead
     * of waiting for their timeout. Optional. */
    void (*abort)(void *state, const char *reason);

    void (*destroy)(void *state);

    /* Optional: how this rank's last collective ran ("staged", "single-copy", ...; a static
     * string), for benchmarks. Read by the user's thread after the collective completed. */
    const char *(*algorithm)(void *state);

    /* Optional: a subgroup without a store. ranks[i] (ranks of the parent, distinct) becomes
     * rank i of the new group, whose state (for this same table) is returned in *state; on ranks
     * not listed *state = NULL. Called by every rank of the parent after the group has checked
     * that all passed the same list, while the parent has no collective in flight. `name` names
     * the new group. Only storeless transports need it (a group with a store splits through the
     * store and `create`). */
    ddp_status_t (*split)(void *parent, const int *ranks, int nranks, const char *name,
                          void **state);

    /* ---- what the group needs to know of a transport, declared here instead of the group
     * testing its name (as NCCL's transports answer canConnect). Zero is the default of each. */

    int storeless; /* 1: create accepts store == NULL (see create) */

    /* 1: its ranks may be on different hosts. 0 (the default, so that a transport that says
     * nothing is taken for the narrower kind): every rank must share one kernel (shared memory);
     * the group refuses it, naming two ranks on different hosts, when they do not. */
    int multi_host;

    /* The transport (a name of the list) of the two-rank groups that carry point-to-point
     * messages between ranks of a group of this transport; NULL: this transport itself. A
     * composite transport names the one that connects any two of its ranks (hierarchical: tcp,
     * as two ranks need no hierarchy). */
    const char *pair_transport;

    /* 1: run() takes DDP__ALLTOALL (block j of send goes to rank j, block i of recv comes from
     * rank i). 0: the group builds alltoall from the other kinds. */
    int alltoall;

    /* 1: run() takes DDP__REDUCE_SCATTER_APPLY. 0: the group builds it from reduce_scatter and
     * allgather. */
    int reduce_scatter_apply;

    /* Optional: how the launcher's runtime hands out a store's address when there is none yet
     * (under mpirun). Not a transport operation: the rendezvous uses it before any group
     * exists, so it lives in a table of its own that a storeless transport points to. */
    const struct ddp__bootstrap_ops *bootstrap;
} ddp__transport_ops_t;

/* ---- shared by transports (src/transport/common.c) ------------------------------------------ */

/* "allreduce", "broadcast", "reduce_scatter", "allgather", "barrier", "alltoall". */
const char *ddp__collective_kind_name(ddp__collective_kind_t kind);

/* The fields every rank must agree on, in a fixed 32-byte layout that transports send as is
 * (between ranks of one build on one byte order, as the transports check). */
typedef struct ddp__fingerprint {
    uint64_t seq;
    uint64_t count;
    int32_t kind, dtype, op, root;
} ddp__fingerprint_t;
_Static_assert(sizeof(ddp__fingerprint_t) == 32, "no padding: ranks memcmp fingerprints");

/* The fingerprint of `c`; padding and the op of a kind without one are zero. Inline: shm packs
 * it on its fast path (an 8-byte allreduce takes ~0.5 us), where a call into libddp's exported
 * symbols would go through the PLT. */
static inline ddp__fingerprint_t ddp__fingerprint_of(const ddp__collective_t *c)
{
    ddp__fingerprint_t f = {
        .seq = c->seq,
        .count = c->count,
        .kind = (int32_t)c->kind,
        .dtype = (int32_t)c->dtype,
        .op = (int32_t)c->op,
        .root = c->root,
    };
    return f;
}
/* Writes "seq S allreduce f32 sum count N root R" into buf ("-" for the op of a kind without one,
 * so two descriptions differ only where ranks disagree). */
DDP_MODULE_API void ddp__fingerprint_text(const ddp__fingerprint_t *f, char *buf, size_t size);
/* The same for a collective. */
DDP_MODULE_API void ddp__fingerprint_describe(const ddp__collective_t *c, char *buf, size_t size);

/* "hostname|boot id": equal on two ranks iff they share a kernel, hence shared memory. */
void ddp__host_identity(char *buf, size_t size);

/* ---- the registry (src/transport/registry.c) ------------------------------------------------ */

/* Built-in tables the group reaches without the list: one rank (self). */
extern const ddp__transport_ops_t ddp__transport_self;

/* The transport called `name` (one of src/core/transports.h's list, or "self"), loading its
 * module when it has one; or NULL with DDP_ERR_INVALID_ARGUMENT (an unknown name, the text
 * listing the known ones) or DDP_ERR_UNSUPPORTED (not in this build, or its module cannot be
 * loaded: the text says why and what to install) recorded as the calling thread's error. */
const ddp__transport_ops_t *ddp__transport_find(const char *name, ddp_status_t *status);

/* Makes `ops` (a MODULE transport of the list, linked in statically) the table of its name, so
 * that ddp__transport_find returns it instead of loading libddp_<name>.so. Called by a module's
 * public registration function (ddp_mpi_register); idempotent; DDP_ERR_INVALID_ARGUMENT for a
 * name that is not a MODULE of the list. */
DDP_MODULE_API ddp_status_t ddp__transport_register(const ddp__transport_ops_t *ops);

/* Whether `name` is "auto" or in the list (without loading anything). */
int ddp__transport_known(const char *name);

/* The first transport of the list that can connect ranks without a store (ops->storeless), or
 * NULL with the reason recorded as for ddp__transport_find. */
const ddp__transport_ops_t *ddp__transport_storeless(ddp_status_t *status);

#endif
