/* The Reducer: data-parallel gradient averaging with c10d's semantics, in C.
 *
 * C has no autograd, so the caller's backward pass reports each gradient as it is finished
 * (ddp_reducer_grad_ready is the autograd hook). Parameters are grouped into buckets (1 MiB for the
 * first, then bucket_cap, per dtype; config.bucket_layout says which parameters the first one
 * holds); the moment a bucket's last gradient is ready its averaging allreduce starts on the
 * group's progress thread, overlapping communication with the rest of backward.
 *
 *     ddp_reducer_create(group, params, n, buffers, nb, &config, &reducer);  // verify + broadcast
 *     for each step:
 *         ddp_reducer_prepare(reducer);                 // buffers broadcast, iteration starts
 *         ddp_reducer_grad(reducer, i, &g);             // where param i's gradient lives
 *         forward; backward writing g and calling ddp_reducer_grad_ready(reducer, i)
 *         ddp_reducer_finalize(reducer);                // averaged gradients are in place
 *         optimizer step; ddp_reducer_zero_grad(reducer);
 *
 * Thread-safety: one thread drives a reducer. Errors from any rank (mismatch, timeout, death)
 * reach every rank as a status; usage errors name the parameter. */
#ifndef DDP_REDUCER_H
#define DDP_REDUCER_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/group.h"
#include "ddp/status.h"
#include "ddp/trace.h"
#include "ddp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_param {
    const char *name; /* unique per model; copied */
    void *data;       /* values; overwritten with rank 0's at create; must outlive the reducer */
    size_t numel;
    ddp_dtype_t dtype; /* f32, f64, f16 or bf16 */
    size_t rows;       /* matrix view rows (numel % rows == 0), 0 for a vector; sparse: table rows */
    int sparse;        /* gradient arrives as rows (ddp_reducer_sparse_grad), reduced by allgather */
    /* user-owned gradient (numel elements) when config.user_grads, or where the gradient lives
     * in the caller's block with config.grad_memory = DDP_GRAD_MEMORY_USER_BLOCK; else NULL.
     * ddp_optim_step and ddp_zero_step (ddp/shard.h) read it when given grads == NULL. */
    void *grad;
} ddp_param_t;

typedef struct ddp_buffer {
    const char *name;
    void *data; /* e.g. running statistics: broadcast from rank 0, never reduced */
    size_t numel;
    ddp_dtype_t dtype;
} ddp_buffer_t;

/* What a communication hook is given: one bucket, already divided by the world size. */
typedef struct ddp_comm_bucket {
    size_t index;          /* position in reduction order (0 is reduced first) */
    void *data;            /* flattened gradients: numel elements of dtype */
    size_t numel;
    ddp_dtype_t dtype;
    size_t nparams;
    const size_t *params;  /* parameter indices, in bucket order */
    const size_t *offsets; /* element offset of each parameter in data */
    const size_t *numels;  /* elements of each parameter */
    const size_t *rows;    /* matrix rows of each parameter (0: vector) */
    uint64_t iteration;    /* synchronised iterations completed before this one */
    int prescaled; /* 1: data was divided by the world size, so summing averages; 0: the hook
                      must average (config.comm_hook_averages) */
    /* Ranks whose data this iteration is (config.join); 0 (a hand-made bucket) means the world
     * size. The Reducer gives the world size, except in the
     * iterations after some rank called ddp_reducer_join, where the joined ranks contribute
     * zeros and prescaled data was divided by this count instead of the world size. */
    int contributors;
} ddp_comm_bucket_t;

/* Starts reducing bucket->data asynchronously so that, when *work completes, data holds the
 * average over ranks: by default the Reducer prescales the bucket by 1/world (c10d's div) and the
 * hook sums; a hook registered with config.comm_hook_averages = 1 gets the bucket as it is
 * (bucket->prescaled == 0) and averages itself, e.g. with DDP_AVG, which saves the prescale pass
 * over the bucket on the backward's thread. The bucket memory stays valid and untouched by the
 * reducer until then. Without a hook the Reducer allreduces with DDP_AVG (no prescale). */
typedef ddp_status_t (*ddp_comm_hook_fn)(void *state, ddp_group_t *group,
                                         const ddp_comm_bucket_t *bucket, ddp_work_t **work);

typedef struct ddp_reducer_config {
    size_t bucket_cap_bytes;       /* 25 MiB */
    size_t first_bucket_bytes;     /* 1 MiB */
    size_t broadcast_bucket_bytes; /* 250 MiB: coalescing of the initial broadcast */
    int find_unused_parameters;    /* 0: every parameter must be marked ready each iteration */
    int user_grads;                /* 0: gradients live in bucket memory; 1: param.grad, copied */
    int broadcast_buffers;         /* 1: prepare broadcasts buffers from rank 0 */
    int rebuild_buckets;           /* 1: after the first iteration, rebuild once in arrival order */
    int sync_at_create;            /* 1: verify the model across ranks and broadcast from rank 0 */
    ddp_comm_hook_fn comm_hook;    /* NULL: allreduce with DDP_AVG (sum, divide once) */
    void *comm_hook_state;
    /* NULL, or bucket allreduce spans are recorded here; while the reducer lives it is also its
     * group's trace (ddp_group_set_trace, unless the group had one), where the transport records
     * its tuner's decisions. Keep it open until the reducer is destroyed and every collective
     * issued on the group meanwhile has completed. */
    ddp_trace_t *trace;
    /* 0 (off): a bucket is reduced whole when all its parameters are ready. > 0 (e.g. 4 MiB,
     * for callers of ddp_reducer_grad_ready_rows): with the default hook (comm_hook NULL), each
     * dense bucket is cut into pieces of this many bytes (whole elements; the last piece is
     * shorter) when buckets are made, and at the rebuild along the row ranges marked, at most
     * this many bytes each (ddp_reducer_grad_ready_rows); a piece is reduced as soon as every
     * element in it has been marked ready and the pieces before it in the launch order have
     * started. Off by default because each piece is a collective of its
     * own: with whole-tensor grad_ready on CPU-bound ranks the extra synchronisations cost more
     * than the earlier start gains (docs/reducer.md has the numbers). Must be the same on every
     * rank (checked at create with sync_at_create). */
    size_t piece_bytes;
    /* 0: a comm_hook gets the bucket prescaled by 1/world and sums; 1: it gets the local sum
     * and averages itself (ddp_zero_hook honours both; see ddp_comm_hook_fn). */
    int comm_hook_averages;
    /* The initial bucket layout (kept for good with rebuild_buckets 0 or find_unused_parameters),
     * one of ddp_bucket_layout_t. Must be the same on every rank (checked at create with
     * sync_at_create). */
    int bucket_layout;
    /* Where gradients live, one of ddp_grad_memory_t. Must be the same on every rank (checked at
     * create with sync_at_create, with every parameter's offset in the block). */
    int grad_memory;
    /* DDP_GRAD_MEMORY_USER_BLOCK: the caller's gradient block and its size in bytes. Every dense
     * parameter's param.grad points into it (numel elements, aligned to its dtype); it must
     * outlive the reducer. Otherwise NULL and 0. */
    void *grad_block;
    size_t grad_block_bytes;
    /* 1: uneven inputs (c10d's Join). Each ddp_reducer_prepare starts with one small allreduce
     * in which the ranks agree on who still has data; a rank that has run out calls
     * ddp_reducer_join, which shadows the others' iterations with zero contributions, and the
     * average is over the ranks with data. 0 (default): no agreement, ddp_reducer_join is a
     * usage error. Must be the same on every rank (checked at create with sync_at_create). Not
     * combinable with comm_hook_averages (ZeRO's hook) or sparse parameters. */
    int join;
} ddp_reducer_config_t;

/* Where gradients live. docs/reducer.md ("Gradient memory") explains the choice.
 *
 * With both block modes the gradients form one contiguous block whose addresses never change for
 * the reducer's life: a bucket is a contiguous run of that block (its params adjacent, of one
 * dtype), reduced in place without a copy, and the rebuild after the first iteration only
 * changes which runs are reduced together and in which order. Parameters that are not adjacent
 * in the block, or that arrive far apart in backward, end up in different buckets (with pieces,
 * config.piece_bytes, the rebuild takes the runs in address order and launches pieces in the
 * order they became complete: see ddp_reducer_grad_ready_rows). Sparse
 * parameters are not in the block (param.grad must be NULL; their rows are given with
 * ddp_reducer_sparse_grad as in every mode). Not combinable with user_grads. */
typedef enum ddp_grad_memory {
    /* Bucket memory from ddp_group_alloc_buffer, one allocation per bucket. The one-time bucket
     * rebuild moves every gradient at the next ddp_reducer_prepare: pointers from
     * ddp_reducer_grad are valid until then only. A gradient written through a pointer fetched
     * before the rebuild is detected at the next synchronised ddp_reducer_finalize, which fails on
     * every rank naming the parameter (the old memory is kept, filled with a marker, until
     * then). */
    DDP_GRAD_MEMORY_BUCKETS = 0,
    /* The caller's block (config.grad_block, grad_block_bytes), laid out as the caller likes:
     * param.grad says where each gradient is. Any memory works on every transport. On shm, how
     * a bucket (or piece) is reduced depends on where the block is:
     *   - from ddp_group_alloc_buffer: in the shared segment, reduced in place (it must be at
     *     the same offset of the buffer on every rank; shm compares them per operation and
     *     copies otherwise), and marked as holding results read later (streaming stores), as
     *     the Reducer's own bucket memory is. Costs: allocated and freed collectively (same
     *     sizes, same order on every rank), freed with ddp_group_free_buffer before the group
     *     is destroyed, never with free();
     *   - from malloc (or any private anonymous memory): the Reducer registers it with
     *     ddp_group_register_memory at create and unregisters it when destroyed, so it is
     *     reduced in place as well ("mapped": the same bytes at the same addresses; one
     *     registration of the 32 a process has). Destroy the reducer before freeing the block.
     *     Register it yourself before create if you like (the Reducer then leaves it to you);
     *     registering it after create fails (it overlaps the Reducer's registration). If it
     *     cannot be registered (no registration left, no whole page in it) it works as before:
     *     DDP_SHM_MAP=auto maps ranges of at least 128 KiB that come back, at most 32 per
     *     process, and the rest are copied (process_vm_readv or through the segment).
     * Measured alike on shm (docs/benchmarks.md, "The llm.c layout"). */
    DDP_GRAD_MEMORY_USER_BLOCK = 1,
    /* libddp allocates one block with ddp_group_alloc_buffer at create, laid out in the initial
     * bucket order (each bucket's params adjacent, buckets 64-byte aligned). ddp_reducer_grad
     * pointers and ddp_reducer_grad_block stay valid for the reducer's life. */
    DDP_GRAD_MEMORY_BLOCK = 2
} ddp_grad_memory_t;

/* Which parameters the small first bucket (first_bucket_bytes) holds before any rebuild.
 * docs/reducer.md ("Differences from c10d") has the measurements behind the default. */
typedef enum ddp_bucket_layout {
    DDP_BUCKET_LAYOUT_DEFAULT = 0, /* the library's choice: DDP_BUCKET_LAYOUT_LAST_FIRST */
    /* Parameters assigned in reverse registration order: the small bucket holds the
     * last-defined parameters (whose gradients backward finishes first) and is reduced first;
     * the leftover bucket holds the first-defined ones and is reduced last. */
    DDP_BUCKET_LAYOUT_LAST_FIRST = 1,
    /* c10d's (_ddp_init_helper): assigned in registration order, then the bucket list
     * reversed: the small bucket holds the first-defined parameters and is reduced last; the
     * leftover bucket holds the last-defined ones and is reduced first. */
    DDP_BUCKET_LAYOUT_C10D = 2
} ddp_bucket_layout_t;

/* Fills *config with the defaults written beside each field above (what DDP_REDUCER_CONFIG_INIT
 * gives). Works from C and C++ alike; fields added later get their defaults here, so code that
 * starts from it and sets fields by name keeps compiling and meaning the same. NULL is ignored. */
DDP_API void ddp_reducer_config_init(ddp_reducer_config_t *config);

/* `ddp_reducer_config_t c = DDP_REDUCER_CONFIG_INIT;` In C, designated initializers (adding a
 * field cannot shift the others); in C++, the same values from ddp_reducer_config_init. */
#ifndef __cplusplus
#define DDP_REDUCER_CONFIG_INIT                                                                   \
    {.bucket_cap_bytes = (size_t)25 << 20,                                                        \
     .first_bucket_bytes = (size_t)1 << 20,                                                       \
     .broadcast_bucket_bytes = (size_t)250 << 20,                                                 \
     .find_unused_parameters = 0,                                                                 \
     .user_grads = 0,                                                                             \
     .broadcast_buffers = 1,                                                                      \
     .rebuild_buckets = 1,                                                                        \
     .sync_at_create = 1,                                                                         \
     .comm_hook = NULL,                                                                           \
     .comm_hook_state = NULL,                                                                     \
     .trace = NULL,                                                                               \
     .piece_bytes = 0,                                                                            \
     .comm_hook_averages = 0,                                                                     \
     .bucket_layout = DDP_BUCKET_LAYOUT_DEFAULT,                                                  \
     .grad_memory = DDP_GRAD_MEMORY_BUCKETS,                                                      \
     .grad_block = NULL,                                                                          \
     .grad_block_bytes = 0,                                                                       \
     .join = 0}
#else
#define DDP_REDUCER_CONFIG_INIT                                                                   \
    ([] {                                                                                         \
        ddp_reducer_config_t ddp_config_;                                                         \
        ddp_reducer_config_init(&ddp_config_);                                                    \
        return ddp_config_;                                                                       \
    }())
#endif

typedef struct ddp_reducer ddp_reducer_t;

/* Collective. Deduplicates parameters registered twice (same data pointer), verifies count,
 * names, numel, shape (rows), dtype and sparsity across ranks (a mismatch names the first
 * differing parameter and both sides, on every rank), broadcasts parameters and buffers from rank 0 in coalesced
 * buckets, and assigns gradient buckets. params/buffers arrays are copied; data pointers must
 * outlive the reducer. */
DDP_API ddp_status_t ddp_reducer_create(ddp_group_t *group, const ddp_param_t *params,
                                        size_t nparams, const ddp_buffer_t *buffers,
                                        size_t nbuffers, const ddp_reducer_config_t *config,
                                        ddp_reducer_t **out);
DDP_API void ddp_reducer_destroy(ddp_reducer_t *reducer);

/* Where parameter i's gradient lives (index as registered, duplicates map to the kept one).
 * param.grad with user_grads or DDP_GRAD_MEMORY_USER_BLOCK, valid for the reducer's life; inside
 * the block with DDP_GRAD_MEMORY_BLOCK, valid for the reducer's life; otherwise bucket memory,
 * valid until the next ddp_reducer_prepare only (the rebuild moves it; gradients are preserved
 * across a rebuild, and a write through a stale pointer fails the next finalize). */
DDP_API ddp_status_t ddp_reducer_grad(ddp_reducer_t *reducer, size_t index, void **grad);

/* The gradient block of either block mode: its address and size in bytes, valid for the
 * reducer's life (e.g. for an optimizer that loops over all gradients as one array; bytes
 * between buckets, if any, are never written by the reducer). DDP_ERR_INVALID_USAGE in the other
 * modes. */
DDP_API ddp_status_t ddp_reducer_grad_block(ddp_reducer_t *reducer, void **block, size_t *bytes);

/* Zeroes every gradient (dense ones and pending sparse rows). */
DDP_API ddp_status_t ddp_reducer_zero_grad(ddp_reducer_t *reducer);

/* Starts an iteration. Broadcasts buffers when configured. DDP_ERR_INVALID_USAGE if the previous
 * synchronised iteration was not finalized. */
DDP_API ddp_status_t ddp_reducer_prepare(ddp_reducer_t *reducer);

/* Parameter i's gradient is complete for this iteration. The last gradient of a bucket launches
 * its reduction (strictly in bucket order). Marking a parameter twice is DDP_ERR_INVALID_USAGE (a
 * gradient completed in parts, such as a stacked (L, ...) tensor's layers, is reported with
 * ddp_reducer_grad_ready_rows instead). */
DDP_API ddp_status_t ddp_reducer_grad_ready(ddp_reducer_t *reducer, size_t index);

/* Rows [row_begin, row_end) of parameter i's gradient are complete for this iteration: the
 * part-wise form of ddp_reducer_grad_ready, for a backward that computes a weight gradient in
 * row blocks (one GEMM per block of output rows). Rows are those of the matrix view: param.rows
 * rows of numel / rows elements; a vector parameter (rows == 0) has numel rows of one element.
 *
 * With config.piece_bytes > 0, the rows' elements count towards the bucket's pieces: a piece whose
 * elements are all marked starts its allreduce (an average, like a bucket's) as soon as every
 * piece before it in the launch order has started, so a bucket holding one large matrix starts
 * reducing while the rest of that matrix is still being computed. Until the bucket rebuild the
 * pieces are piece_bytes slices of each bucket, launched bucket after bucket in ascending order.
 * At the rebuild (after the first synchronised iteration) rank 0's record of that iteration
 * fixes them for good: pieces are cut along the row ranges rank 0 marked (consecutive ones
 * merged up to piece_bytes, larger ones split), and every piece of every bucket goes in one
 * launch order, the order in which rank 0's pieces became complete. So a stacked (L, ...) tensor
 * (llm.c's layout: each kind of weight of all layers in one tensor) reported layer by layer from
 * the top has its top layers' rows reduced while the layers below are computed, whichever bucket
 * they are in and whatever first_bucket_bytes or the order a layer's rows are marked in. The
 * plan is broadcast from rank 0, so every rank issues the same collectives in the same order
 * whatever blocks each rank marks; ranks that mark in another order only overlap less.
 * ddp_reducer_stats's `reductions` show what was launched when. With a user comm hook or
 * piece_bytes 0 there are no pieces: the bucket is handed over whole once it is complete. With
 * user_grads the rows are copied from param.grad now, so they must be final.
 *
 * Marking the last unmarked rows of a parameter is exactly ddp_reducer_grad_ready (it counts
 * for bucket order, the rebuild's arrival order and find_unused_parameters). After some of its
 * rows were marked, ddp_reducer_grad_ready(i) marks the remaining rows. A parameter with some
 * but not all rows marked at finalize is an unmarked parameter (an error on every rank, or,
 * with find_unused_parameters, a used one whose other rows are taken as they are). Works in
 * no_sync iterations (nothing is communicated then).
 *
 * Errors, each naming the parameter: DDP_ERR_INVALID_ARGUMENT for an empty range or rows beyond
 * the parameter's rows (an empty parameter has no rows: use grad_ready); DDP_ERR_INVALID_USAGE
 * for a sparse parameter, outside prepare..finalize, or rows already marked in this iteration
 * (overlapping ranges, or the parameter was already complete). Like marking a parameter twice,
 * the overlap also makes finalize fail on every rank. */
DDP_API ddp_status_t ddp_reducer_grad_ready_rows(ddp_reducer_t *reducer, size_t index,
                                                 size_t row_begin, size_t row_end);

/* Sparse gradient of parameter i: nrows rows of numel/rows elements each, at `indices`. Counts as
 * grad_ready. Data is copied. */
DDP_API ddp_status_t ddp_reducer_sparse_grad(ddp_reducer_t *reducer, size_t index,
                                             const int64_t *indices, const void *values,
                                             size_t nrows);

/* Uneven inputs (config.join): this rank has no more data. Collective with the other ranks'
 * iterations: until every rank has called it, it takes part in each of their iterations (the
 * buffer broadcast, the bucket rebuild if one is due, every bucket reduction with zeros as its
 * contribution, the status exchange), so their collectives complete and their gradients are
 * the sum over the ranks with data divided by the count of those ranks. When every rank has
 * joined, parameters and buffers are broadcast from the last rank to join (the lowest of
 * them), so every rank leaves with the same model, and ddp_reducer_join returns DDP_OK on every
 * rank; the next prepare starts a new round with every rank contributing (e.g. the next
 * epoch). A rank that shadowed at least one iteration leaves with the average of the last one
 * in its gradients, bitwise that of the ranks with data (globally unused parameters with
 * find_unused_parameters: zero; user_grads: param.grad untouched): when the ranks run out within
 * one iteration of each other (an epoch's remainder), it can take the same optimizer step so its
 * optimizer state stays that of the others. Call ddp_reducer_zero_grad before the next round. An
 * error on any rank during those
 * iterations (a failed reduction, a usage error) is returned on every rank.
 * DDP_ERR_INVALID_USAGE without config.join, or between prepare and finalize of a synchronised
 * iteration. */
DDP_API ddp_status_t ddp_reducer_join(ddp_reducer_t *reducer);

/* Waits for every bucket; afterwards each gradient holds the average over ranks. With
 * find_unused_parameters, gradients of globally unused parameters are left untouched. */
DDP_API ddp_status_t ddp_reducer_finalize(ddp_reducer_t *reducer);

/* The averaged sparse gradient of parameter i after finalize: sorted unique row indices and their
 * rows (owned by the reducer, valid until the next prepare). */
DDP_API ddp_status_t ddp_reducer_sparse_result(ddp_reducer_t *reducer, size_t index,
                                               const int64_t **indices, const void **values,
                                               size_t *nrows);

/* no_sync: with enabled = 0, iterations accumulate gradients locally without communication; the
 * next iteration with sync enabled averages the accumulated sums. */
DDP_API ddp_status_t ddp_reducer_set_sync(ddp_reducer_t *reducer, int enabled);

/* Bucket layout (after any rebuild): number of buckets, and bucket b's parameter indices. */
DDP_API size_t ddp_reducer_bucket_count(const ddp_reducer_t *reducer);
DDP_API ddp_status_t ddp_reducer_bucket_params(const ddp_reducer_t *reducer, size_t bucket,
                                               const size_t **params, size_t *nparams);

typedef struct ddp_bucket_stats {
    size_t bytes;
    double ready_us; /* last gradient ready, relative to the first grad_ready of the iteration */
    double launch_us; /* the bucket's first piece (or the whole bucket) handed to the group */
    double done_us;   /* its last piece done */
} ddp_bucket_stats_t;

/* One reduction (a piece, or a whole bucket) of an iteration. */
typedef struct ddp_reduction_stats {
    size_t bucket;        /* the bucket it is part of */
    size_t offset, bytes; /* its byte range within the bucket (a sparse bucket: its bytes) */
    /* ddp_reducer_grad_ready, _grad_ready_rows and _sparse_grad calls of the iteration made when
     * it was launched, the launching call included (every call, if finalize launched it): where
     * in backward it started, whatever the clock says. */
    size_t ready_calls;
    int by_finalize;       /* 1: launched by ddp_reducer_finalize, after backward */
    double launch_us, done_us; /* relative to the first grad_ready, like the buckets' */
} ddp_reduction_stats_t;

typedef struct ddp_reducer_stats {
    uint64_t iteration;
    double backward_us; /* first grad_ready to finalize entry */
    double comm_us;     /* sum over reductions (buckets or pieces) of done - launch */
    double exposed_us;  /* time finalize waited */
    size_t bytes;       /* bytes reduced this iteration (before any hook's compression) */
    size_t nbuckets;
    const ddp_bucket_stats_t *buckets; /* valid until the next prepare */
    size_t npieces;  /* reductions issued (pieces, or whole buckets) */
    double busy_us;  /* union of every reduction's launch..done interval: time in flight */
    /* npieces entries in launch order, valid until the next prepare */
    const ddp_reduction_stats_t *reductions;
    size_t bytes_launched_in_backward; /* bytes of the reductions launched before finalize */
} ddp_reducer_stats_t;

/* Statistics of the last finalized synchronised iteration. */
DDP_API ddp_status_t ddp_reducer_stats(const ddp_reducer_t *reducer, ddp_reducer_stats_t *out);

/* ---- bucket assignment, on its own --------------------------------------------------------
 * c10d's compute_bucket_assignment_by_size: tensors visited in `order` (NULL: index order) are
 * grouped per dtype; a bucket closes when it reaches the current limit (limits[0] for the first
 * bucket of each dtype, then the next limit, the last one repeating); sparse tensors get a bucket
 * each. Buckets are sorted by their smallest tensor index. The Reducer passes the parameters in
 * reverse order and reverses the result (DDP_BUCKET_LAYOUT_LAST_FIRST), or in index order and
 * reverses the result (DDP_BUCKET_LAYOUT_C10D). */
typedef struct ddp_bucket_assignment {
    size_t nbuckets;
    size_t *starts;  /* nbuckets + 1 offsets into indices */
    size_t *indices; /* tensor indices, bucket by bucket */
} ddp_bucket_assignment_t;

DDP_API ddp_status_t ddp_compute_bucket_assignment(const ddp_param_t *params, size_t nparams,
                                                   const size_t *limits, size_t nlimits,
                                                   const size_t *order,
                                                   ddp_bucket_assignment_t *out);
DDP_API void ddp_bucket_assignment_free(ddp_bucket_assignment_t *assignment);

/* ---- legacy mode (fairseq's LegacyDistributedDataParallel) --------------------------------
 * After backward, one call all-reduces every gradient (param.grad, user-owned) through one flat
 * buffer of buffer_numel elements (0: 2^28, capped at the total parameter count); a parameter
 * larger than the buffer is reduced on its own; gradients are divided by the world size first. */
typedef struct ddp_legacy ddp_legacy_t;
DDP_API ddp_status_t ddp_legacy_create(ddp_group_t *group, const ddp_param_t *params,
                                       size_t nparams, size_t buffer_numel, ddp_legacy_t **out);
DDP_API void ddp_legacy_destroy(ddp_legacy_t *legacy);
/* enabled = 0: ddp_legacy_allreduce does nothing (gradients accumulate). */
DDP_API ddp_status_t ddp_legacy_set_sync(ddp_legacy_t *legacy, int enabled);
/* has_grad[i] = 0 means parameter i got no gradient: it is zero-filled and takes part. NULL:
 * every parameter has one. */
DDP_API ddp_status_t ddp_legacy_allreduce(ddp_legacy_t *legacy, const unsigned char *has_grad);

#ifdef __cplusplus
}
#endif
#endif
