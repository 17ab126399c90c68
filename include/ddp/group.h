/* Process groups: collectives among `world_size` ranks, asynchronous on a progress thread.
 *
 * A group is created collectively by every rank from a store (the rendezvous), its rank and the
 * world size. The transport is chosen automatically (shared memory when every rank is on one host)
 * or by DDP_TRANSPORT / the options. Each collective returns a work handle at once; works run in
 * issue order on the group's progress thread, so the caller's thread stays free to compute.
 *
 * Every collective carries a fingerprint (sequence number, op, dtype, count, root): ranks that
 * disagree all get DDP_ERR_MISMATCH with both sides stated, never wrong data or a hang. Every wait
 * is bounded by the group's timeout; a timeout names the ranks that did not arrive. After a
 * timeout, mismatch or dead peer the group is broken: later calls return DDP_ERR_ABORTED and the
 * group must be destroyed. Results are bitwise identical on every rank.
 *
 * Thread-safety: collectives may be issued from any one thread at a time per group (issue order
 * defines the sequence, so two threads issuing concurrently on one group is a usage error). */
#ifndef DDP_GROUP_H
#define DDP_GROUP_H

#include <stddef.h>

#include "ddp/status.h"
#include "ddp/store.h"
#include "ddp/trace.h"
#include "ddp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_group ddp_group_t;
typedef struct ddp_work ddp_work_t;

typedef struct ddp_group_options {
    int timeout_ms;        /* 0: DDP_TIMEOUT (default 300 s) */
    const char *transport; /* NULL or "auto", or a transport's name: the accepted values of
                              DDP_TRANSPORT (`ddprun --print-config` or ddp_env_vars() list them
                              with a line of help each); DDP_TRANSPORT overrides auto */
    const char *name;      /* distinguishes groups created on one store; NULL: "default" */
} ddp_group_options_t;

/* `ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;` Every default is 0/NULL. In C, designated
 * initializers (adding a field cannot shift the others); in C++, value-initialization, which
 * zeroes every field by name. */
#ifndef __cplusplus
#define DDP_GROUP_OPTIONS_INIT {.timeout_ms = 0, .transport = NULL, .name = NULL}
#else
#define DDP_GROUP_OPTIONS_INIT (ddp_group_options_t())
#endif

/* Fills *options with the defaults (all 0/NULL), from C or C++. NULL is ignored. */
static inline void ddp_group_options_init(ddp_group_options_t *options)
{
    if (!options) return;
    options->timeout_ms = 0;
    options->transport = NULL;
    options->name = NULL;
}

/* Collective over all `world_size` ranks. The store must stay valid until ddp_group_destroy.
 * First, on every rank and before the store is used, checks every DDP_* variable
 * (ddp_config_check): a bad value - DDP_TIMEOUT, DDP_TRANSPORT, DDP_HIERARCHICAL, DDP_LOG_LEVEL,
 * any DDP_SHM_* - returns DDP_ERR_INVALID_ARGUMENT naming the variable, the value and what it
 * accepts, even when the options or the transport chosen would not use it. */
DDP_API ddp_status_t ddp_group_create(ddp_store_t *store, int rank, int world_size,
                                      const ddp_group_options_t *options, ddp_group_t **out);

/* Reads the launcher's environment (see ddp/env.h), connects to its TCP store and creates the
 * group; the group owns that store and closes it on destroy. Checks the DDP_* variables first,
 * as ddp_group_create does. */
DDP_API ddp_status_t ddp_group_create_from_env(const ddp_group_options_t *options,
                                               ddp_group_t **out);

/* Collective over every rank of `parent` (like torch's new_group): ranks listed in `ranks`
 * (sorted ascending or not; no duplicates) form a new group, ordered as listed; *out is NULL on
 * the ranks not listed. */
DDP_API ddp_status_t ddp_group_split(ddp_group_t *parent, const int *ranks, int nranks,
                                     const ddp_group_options_t *options, ddp_group_t **out);

/* Waits for queued works, stops the progress thread, frees everything. NULL is allowed. */
DDP_API void ddp_group_destroy(ddp_group_t *group);

/* Breaks the group on purpose (torch's ProcessGroup.abort): queued and running works fail with
 * DDP_ERR_ABORTED quoting `reason`, the peers are told through the transport and fail theirs
 * the same way, and every later call fails. The group must still be destroyed. A broken group
 * stays broken; aborting it again does nothing. */
DDP_API ddp_status_t ddp_group_abort(ddp_group_t *group, const char *reason);

DDP_API int ddp_group_rank(const ddp_group_t *group);
DDP_API int ddp_group_size(const ddp_group_t *group);
DDP_API int ddp_group_timeout_ms(const ddp_group_t *group);
/* "shm", "tcp", "mpi", "hierarchical", "self" (world size 1). */
DDP_API const char *ddp_group_transport(const ddp_group_t *group);
/* How this rank's last completed collective moved its data, as the transport names it (shm:
 * "mailbox", "one-shot", "staged", "single-copy", "zero-copy", ...; docs/shm-transport.md), or
 * the transport's name when it has only one way. For benchmarks and logs; a static string. */
DDP_API const char *ddp_group_algorithm(const ddp_group_t *group);
/* Where the group's transport records its own events (NULL: nowhere, the default): the shm
 * transport's tuner decisions as instant events named "shm tune: ..." (category "tune"), so a
 * trace shows when a size class switched its algorithm. A Reducer created with config.trace sets
 * it for its group while it lives. The trace must stay open until the group is destroyed or
 * until this is called again with no work of the group in flight. */
DDP_API void ddp_group_set_trace(ddp_group_t *group, ddp_trace_t *trace);
/* The trace set by ddp_group_set_trace, or NULL. */
DDP_API ddp_trace_t *ddp_group_trace(const ddp_group_t *group);

/* ---- asynchronous collectives ------------------------------------------------------------
 * Buffers must stay valid and untouched until the work completes. send == recv is in-place.
 * A count of 0 is valid (the ranks still synchronise and check fingerprints). */

/* recv[i] = op over ranks of send[i]. */
DDP_API ddp_status_t ddp_group_allreduce_async(ddp_group_t *group, const void *send, void *recv,
                                               size_t count, ddp_dtype_t dtype,
                                               ddp_reduce_op_t op, ddp_work_t **work);
/* buf on every rank = buf on `root`. */
DDP_API ddp_status_t ddp_group_broadcast_async(ddp_group_t *group, void *buf, size_t count,
                                               ddp_dtype_t dtype, int root, ddp_work_t **work);
/* send holds world_size blocks of recv_count elements; recv = op over ranks of block[rank].
 * In place when recv == send + rank * recv_count elements. */
DDP_API ddp_status_t ddp_group_reduce_scatter_async(ddp_group_t *group, const void *send,
                                                    void *recv, size_t recv_count,
                                                    ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                    ddp_work_t **work);
/* recv (world_size * send_count elements) = concatenation of every rank's send, in rank order.
 * In place when send == recv + rank * send_count elements. */
DDP_API ddp_status_t ddp_group_allgather_async(ddp_group_t *group, const void *send, void *recv,
                                               size_t send_count, ddp_dtype_t dtype,
                                               ddp_work_t **work);
DDP_API ddp_status_t ddp_group_barrier_async(ddp_group_t *group, ddp_work_t **work);

/* ---- blocking conveniences: issue, then wait ------------------------------------------- */
DDP_API ddp_status_t ddp_group_allreduce(ddp_group_t *group, const void *send, void *recv,
                                         size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op);
DDP_API ddp_status_t ddp_group_broadcast(ddp_group_t *group, void *buf, size_t count,
                                         ddp_dtype_t dtype, int root);
DDP_API ddp_status_t ddp_group_reduce_scatter(ddp_group_t *group, const void *send, void *recv,
                                              size_t recv_count, ddp_dtype_t dtype,
                                              ddp_reduce_op_t op);
DDP_API ddp_status_t ddp_group_allgather(ddp_group_t *group, const void *send, void *recv,
                                         size_t send_count, ddp_dtype_t dtype);
DDP_API ddp_status_t ddp_group_barrier(ddp_group_t *group);

/* ---- more collectives: rooted, all-to-all, variable counts, coalesced ----------------------
 * Same rules as above: async forms return a work at once, blocking forms issue and wait; works
 * run in issue order; every rank must make the same call (kind, dtype, op, root, counts: a
 * difference is DDP_ERR_MISMATCH on every rank, naming rank 0's call and the first that differs);
 * results are bitwise identical wherever they are replicated; f16/bf16 are reduced in f32 and
 * rounded once. Arrays of counts, displacements and buffer pointers are copied at issue: only the
 * data buffers must stay valid until the work completes. Counts and displacements are in
 * elements. These are built from the five above (one small allgather of a header to agree, then
 * allreduce, reduce_scatter, allgather or broadcast), on every transport. */

/* recv on `root` = op over ranks of send (count elements); recv is ignored (may be NULL) on the
 * other ranks. In place when send == recv on the root. */
DDP_API ddp_status_t ddp_group_reduce_async(ddp_group_t *group, const void *send, void *recv,
                                            size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                            int root, ddp_work_t **work);
/* recv on `root` (world_size * send_count elements) = every rank's send, in rank order; recv is
 * ignored elsewhere. In place on the root when send == recv + root * send_count elements. */
DDP_API ddp_status_t ddp_group_gather_async(ddp_group_t *group, const void *send, void *recv,
                                            size_t send_count, ddp_dtype_t dtype, int root,
                                            ddp_work_t **work);
/* recv (recv_count elements) on rank r = block r of send on `root` (world_size * recv_count
 * elements; ignored elsewhere). In place on the root when recv == send + root * recv_count. */
DDP_API ddp_status_t ddp_group_scatter_async(ddp_group_t *group, const void *send, void *recv,
                                             size_t recv_count, ddp_dtype_t dtype, int root,
                                             ddp_work_t **work);
/* send and recv hold world_size blocks of `count` elements: block j of rank i's send becomes
 * block i of rank j's recv. send == recv is allowed. */
DDP_API ddp_status_t ddp_group_alltoall_async(ddp_group_t *group, const void *send, void *recv,
                                              size_t count, ddp_dtype_t dtype, ddp_work_t **work);
/* Rank r's send (send_count == recv_counts[r] elements) lands at recv + displs[r] on every
 * rank. recv_counts (world_size entries) must be equal on every rank; displs (NULL: packed in
 * rank order) are this rank's own layout. In place when send == recv + displs[rank]. */
DDP_API ddp_status_t ddp_group_allgatherv_async(ddp_group_t *group, const void *send,
                                                size_t send_count, void *recv,
                                                const size_t *recv_counts, const size_t *displs,
                                                ddp_dtype_t dtype, ddp_work_t **work);
/* send holds world_size blocks, block r of recv_counts[r] elements, packed in rank order; recv
 * (recv_counts[rank] elements) = op over ranks of block[rank]. recv_counts equal on every rank. */
DDP_API ddp_status_t ddp_group_reduce_scatterv_async(ddp_group_t *group, const void *send,
                                                     void *recv, const size_t *recv_counts,
                                                     ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                     ddp_work_t **work);
/* send_counts[j] elements at send + send_displs[j] go to rank j, which receives them at
 * recv + recv_displs[i] (recv_counts[i] elements, i = this rank); displacements NULL: packed.
 * recv_counts[j] on rank i must equal send_counts[i] on rank j (checked on every rank: a
 * difference is DDP_ERR_MISMATCH naming both). Not in place (send != recv). */
DDP_API ddp_status_t ddp_group_alltoallv_async(ddp_group_t *group, const void *send,
                                               const size_t *send_counts,
                                               const size_t *send_displs, void *recv,
                                               const size_t *recv_counts,
                                               const size_t *recv_displs, ddp_dtype_t dtype,
                                               ddp_work_t **work);
/* In place allreduce of nbufs buffers (bufs[i] of counts[i] elements, one dtype) as one
 * operation: packed into one buffer, one allreduce, unpacked. counts equal on every rank. */
DDP_API ddp_status_t ddp_group_allreduce_coalesced_async(ddp_group_t *group, void *const *bufs,
                                                         const size_t *counts, size_t nbufs,
                                                         ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                         ddp_work_t **work);
/* bufs on every rank = bufs on `root`, as one broadcast. */
DDP_API ddp_status_t ddp_group_broadcast_coalesced_async(ddp_group_t *group, void *const *bufs,
                                                         const size_t *counts, size_t nbufs,
                                                         ddp_dtype_t dtype, int root,
                                                         ddp_work_t **work);

/* A reduce-scatter whose result each rank transforms before an allgather, in one operation
 * (ZeRO's step: average the gradients, update the owner's chunk, give every rank the new
 * values). send and recv each hold world_size blocks of `count` elements (send == recv is
 * allowed, other overlaps are not). Rank r reduces block r over the ranks (bitwise as
 * reduce_scatter would) and calls fn on it, in one or more pieces in element order: fn(arg,
 * first, values, n) gets the reduced values of elements [first, first + n) of the whole array
 * (in scratch memory it may modify) and must write the values to keep into recv[first ...
 * first + n) on this rank, where it may read the old ones first. Every rank's recv then holds
 * every block. fn runs on the group's progress thread, must not call the group and must give
 * the same output for the same input wherever it runs. On shared memory with send and recv in
 * registered memory on every rank (ddp_group_register_memory or DDP_SHM_MAP=auto), each piece
 * is reduced from the peers' memory, transformed while in cache and written into every rank's
 * recv: each byte is read once and written once. Elsewhere: reduce_scatter, fn, allgather. */
typedef void (*ddp_apply_fn)(void *arg, size_t first, void *values, size_t n);
DDP_API ddp_status_t ddp_group_reduce_scatter_apply_async(ddp_group_t *group, const void *send,
                                                          void *recv, size_t count,
                                                          ddp_dtype_t dtype, ddp_reduce_op_t op,
                                                          ddp_apply_fn fn, void *arg,
                                                          ddp_work_t **work);
DDP_API ddp_status_t ddp_group_reduce_scatter_apply(ddp_group_t *group, const void *send,
                                                    void *recv, size_t count, ddp_dtype_t dtype,
                                                    ddp_reduce_op_t op, ddp_apply_fn fn,
                                                    void *arg);

DDP_API ddp_status_t ddp_group_reduce(ddp_group_t *group, const void *send, void *recv,
                                      size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                      int root);
DDP_API ddp_status_t ddp_group_gather(ddp_group_t *group, const void *send, void *recv,
                                      size_t send_count, ddp_dtype_t dtype, int root);
DDP_API ddp_status_t ddp_group_scatter(ddp_group_t *group, const void *send, void *recv,
                                       size_t recv_count, ddp_dtype_t dtype, int root);
DDP_API ddp_status_t ddp_group_alltoall(ddp_group_t *group, const void *send, void *recv,
                                        size_t count, ddp_dtype_t dtype);
DDP_API ddp_status_t ddp_group_allgatherv(ddp_group_t *group, const void *send,
                                          size_t send_count, void *recv,
                                          const size_t *recv_counts, const size_t *displs,
                                          ddp_dtype_t dtype);
DDP_API ddp_status_t ddp_group_reduce_scatterv(ddp_group_t *group, const void *send, void *recv,
                                               const size_t *recv_counts, ddp_dtype_t dtype,
                                               ddp_reduce_op_t op);
DDP_API ddp_status_t ddp_group_alltoallv(ddp_group_t *group, const void *send,
                                         const size_t *send_counts, const size_t *send_displs,
                                         void *recv, const size_t *recv_counts,
                                         const size_t *recv_displs, ddp_dtype_t dtype);
DDP_API ddp_status_t ddp_group_allreduce_coalesced(ddp_group_t *group, void *const *bufs,
                                                   const size_t *counts, size_t nbufs,
                                                   ddp_dtype_t dtype, ddp_reduce_op_t op);
DDP_API ddp_status_t ddp_group_broadcast_coalesced(ddp_group_t *group, void *const *bufs,
                                                   const size_t *counts, size_t nbufs,
                                                   ddp_dtype_t dtype, int root);

/* ---- point to point ------------------------------------------------------------------------
 * send: count elements of buf to rank `peer`; recv: count elements from `peer` into buf.
 * Ordering rule (like NCCL): a send/recv is a collective of two ranks in the group's issue order.
 * Between two ranks, the k-th point-to-point call of one to the other matches the k-th of the
 * other, and it runs when both reach it in their queues; a recv issued before work the peer
 * issues ahead of its send waits behind it (a cycle of such waits fails with DDP_ERR_TIMEOUT
 * naming the rank, not a hang). The matched pair must agree on dtype, count and tag and be one
 * send and one recv: otherwise DDP_ERR_MISMATCH on both, naming both calls (tags are checked,
 * not used to reorder). Ranks not involved do nothing. The first message between two ranks
 * makes their pair (through the group's store, with the group's timeout; shm for an shm group,
 * tcp otherwise); a group without a store (MPI without MASTER_ADDR) returns
 * DDP_ERR_UNSUPPORTED. peer == own rank is DDP_ERR_INVALID_ARGUMENT. A failed send/recv
 * breaks the group like a failed collective. */
DDP_API ddp_status_t ddp_group_send_async(ddp_group_t *group, const void *buf, size_t count,
                                          ddp_dtype_t dtype, int peer, int tag,
                                          ddp_work_t **work);
DDP_API ddp_status_t ddp_group_recv_async(ddp_group_t *group, void *buf, size_t count,
                                          ddp_dtype_t dtype, int peer, int tag,
                                          ddp_work_t **work);
DDP_API ddp_status_t ddp_group_send(ddp_group_t *group, const void *buf, size_t count,
                                    ddp_dtype_t dtype, int peer, int tag);
DDP_API ddp_status_t ddp_group_recv(ddp_group_t *group, void *buf, size_t count,
                                    ddp_dtype_t dtype, int peer, int tag);

/* Receive from any source (torch's recv without src, MPI_ANY_SOURCE): count elements into buf
 * from whichever rank's next message to this rank is waiting; its rank goes to *source (valid
 * once the work completes; *source must stay valid until then). Runs in issue order like recv:
 * when its turn comes it picks a peer that has started a send to this rank that no recv of this
 * rank matched yet (round robin among several), and is then that peer's matching recv, with the
 * same checks (dtype, count and tag must agree, else DDP_ERR_MISMATCH). Needs
 * ddp_group_enable_recv_any (DDP_ERR_INVALID_USAGE otherwise). No sender within the group's
 * timeout: DDP_ERR_TIMEOUT naming this rank and the tag, and the group is broken as after any
 * failed send/recv. */
DDP_API ddp_status_t ddp_group_recv_any_async(ddp_group_t *group, void *buf, size_t count,
                                              ddp_dtype_t dtype, int tag, int *source,
                                              ddp_work_t **work);
DDP_API ddp_status_t ddp_group_recv_any(ddp_group_t *group, void *buf, size_t count,
                                        ddp_dtype_t dtype, int tag, int *source);

/* Lets the group receive from any source. Call on every rank before the group's first send (a
 * send executed before it is not announced, and a recv from any source could miss it). From
 * then on every send costs one store add (a round trip to a TCP store) that announces it to the
 * receiver; groups without it pay nothing. DDP_ERR_UNSUPPORTED on a group without a store. */
DDP_API ddp_status_t ddp_group_enable_recv_any(ddp_group_t *group);

/* ---- tasks: ordered user code on the progress thread --------------------------------------
 * Runs fn(group, arg) on the progress thread, in issue order with the collectives. Inside fn,
 * the blocking collective calls above execute inline (they are the next sequence numbers on
 * every rank), so a communication hook can chain compress → allreduce → compute → allreduce while
 * the caller's thread goes on computing. fn must not wait on works. fn's status becomes the
 * work's status. */
typedef ddp_status_t (*ddp_task_fn)(ddp_group_t *group, void *arg);
DDP_API ddp_status_t ddp_group_submit(ddp_group_t *group, ddp_task_fn fn, void *arg,
                                      ddp_work_t **work);

/* ---- works ------------------------------------------------------------------------------- */

/* Waits until the work completes (at most the group's timeout) and returns its status; the
 * error text of a failed work is available through ddp_last_error() on the waiting thread. */
DDP_API ddp_status_t ddp_work_wait(ddp_work_t *work);
/* *done = 1 when complete (then ddp_work_wait returns at once). */
DDP_API ddp_status_t ddp_work_test(ddp_work_t *work, int *done);
/* Runs fn(arg, status) on the progress thread as soon as the work completes (at once, on the
 * calling thread, if it already has). fn must be quick and must not wait on works. One per work.
 * When status is not DDP_OK, ddp_last_error() inside fn is the work's error text (the rank, the
 * operation and what failed), so fn can hand it on without waiting. */
typedef void (*ddp_work_callback_fn)(void *arg, ddp_status_t status);
DDP_API ddp_status_t ddp_work_on_complete(ddp_work_t *work, ddp_work_callback_fn fn, void *arg);
/* Releases the handle. A work still running goes on (its buffers must stay valid until then).
 * NULL is allowed. */
DDP_API void ddp_work_free(ddp_work_t *work);

/* ---- buffers in the transport's memory -----------------------------------------------------
 * Collective: every rank calls with the same size, in the same order. Returns this rank's buffer
 * of `bytes` bytes (64-byte aligned, zeroed) living in memory the transport reads directly (the
 * shared segment for shm), so collectives on it skip the copy in. On transports without such
 * memory it is ordinary memory. Free collectively with ddp_group_free_buffer, before destroy. */
DDP_API ddp_status_t ddp_group_alloc_buffer(ddp_group_t *group, size_t bytes, void **out);
DDP_API ddp_status_t ddp_group_free_buffer(ddp_group_t *group, void *buffer);

/* ---- registering your own memory -----------------------------------------------------------
 * Not collective. Declares [ptr, ptr + bytes), memory from malloc (or any private anonymous
 * mapping) that this rank will pass to collectives again and again, such as a gradient block.
 * On shm the whole pages inside the range are moved onto shared memory in place: the same
 * addresses, the same bytes, nothing for the caller to change; from then on an allreduce whose
 * buffers lie in registered memory on every rank reads and writes the peers' buffers directly
 * (ddp_group_algorithm says "mapped"): each rank reads every input once and writes every output
 * once, with no copy through the segment. Results are bitwise those of the other paths.
 * The contract, as for any registered memory (ibv_reg_mr, cudaHostRegister):
 *   - keep the memory allocated, unmoved (no realloc) and unregistered until
 *     ddp_group_unregister_memory; no collective on it may be pending then;
 *   - do not write it while a collective on it runs (as for any buffer);
 *   - a process forked afterwards gets the pages privately: its writes stay its own, but pages
 *     it has not written show the parent's later writes (no copy is made at fork: a DataLoader
 *     forking workers would otherwise copy every registered gradient).
 * With DDP_SHM_MAP=auto (the default) libddp also registers, by itself, allreduce buffers of at
 * least 128 KiB that come back (glibc malloc and Linux >= 6.11 only: docs/shm-transport.md);
 * registering such a buffer yourself takes it over.
 * Errors: NULL/0 or a range overlapping one already registered (DDP_ERR_INVALID_ARGUMENT);
 * memory that is not private anonymous and writable, a range holding no whole page, or too many
 * registrations (DDP_ERR_UNSUPPORTED: nothing changed, the memory works as before). On
 * transports without shared memory (tcp, mpi) both calls succeed and do nothing. */
DDP_API ddp_status_t ddp_group_register_memory(ddp_group_t *group, void *ptr, size_t bytes);
/* Gives the pages back as ordinary private memory, content unchanged. `ptr` as registered. */
DDP_API ddp_status_t ddp_group_unregister_memory(ddp_group_t *group, void *ptr);

#ifdef __cplusplus
}
#endif
#endif
