/* Internals shared by the Reducer's files: the bucket assignment with a choice of sort key (the
 * rebuild sorts by arrival position), the initial/buffer broadcast, and the Reducer's state with
 * the calls its files make to one another. */
#ifndef DDP_REDUCER_INTERNAL_H
#define DDP_REDUCER_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "ddp/ddp.h"
#include "group/group_internal.h"

/* How finished buckets are ordered. */
enum {
    DDP__SORT_BY_INDEX = 0,   /* smallest tensor index first (c10d, the public function) */
    DDP__SORT_BY_POSITION = 1 /* smallest position in `order` first (rebuild in arrival order) */
};

/* ddp_compute_bucket_assignment with a sort key. */
ddp_status_t ddp__bucket_assignment(const ddp_param_t *params, size_t nparams,
                                    const size_t *limits, size_t nlimits, const size_t *order,
                                    int sort_key, ddp_bucket_assignment_t *out);

/* ddp_bucket_assignment_free without clearing the error text, for failure paths. */
void ddp__bucket_assignment_free(ddp_bucket_assignment_t *assignment);

/* One tensor taking part in a coalesced broadcast. */
typedef struct ddp__tensor_ref {
    void *data;
    size_t numel;
    ddp_dtype_t dtype;
} ddp__tensor_ref_t;

/* Broadcasts every tensor from rank 0: tensors of one dtype are packed in order into flat chunks
 * of at most bucket_bytes (a larger tensor goes alone, in place), at most two chunks in flight. */
ddp_status_t ddp__broadcast_coalesced(ddp_group_t *group, const ddp__tensor_ref_t *tensors,
                                      size_t ntensors, size_t bucket_bytes);

/* ---- the Reducer's state, shared by its files ----------------------------------------------
 * reducer.c creates, destroys and answers queries; buckets.c makes and rebuilds buckets, from
 * the layouts of bucket_layout.c and with the piece order of piece_schedule.c; verify.c checks that every rank registers the same model; iteration.c runs prepare, the
 * launches and grad_ready; sparse.c reduces sparse gradients; finalize.c ends an iteration. */

#define DDP__COMM_LANE 2 /* trace lane ("tid") of bucket reductions */

/* 1: at the rebuild, pieces are cut along the row ranges rank 0 marked and launched in one
 * schedule across buckets, in the order they became complete (docs/reducer.md, "Stacked
 * tensors"). 0: the behaviour before it (fixed-size pieces, bucket after bucket), kept only so
 * that a second build (-DCMAKE_C_FLAGS=-DDDP__READINESS_SCHEDULE=0) can measure the difference
 * (bench/stacked_ab.sh). */
#ifndef DDP__READINESS_SCHEDULE
#define DDP__READINESS_SCHEDULE 1
#endif

/* A unit of launching: one piece of a bucket, or a whole bucket (piece == DDP__WHOLE). */
#define DDP__WHOLE ((size_t)-1)
typedef struct launch_unit {
    size_t bucket, piece;
} launch_unit_t;

/* What was launched, in launch order, this iteration (statistics). */
typedef struct launch_record {
    size_t bucket, piece;
    size_t ready_calls; /* ready calls made by then (the launching one included) */
    int by_finalize;
} launch_record_t;

/* Usage errors a rank reports in finalize's status vector: kind << 32 | (kept index + 1). */
#define DDP__ERROR_TWICE 1LL
#define DDP__ERROR_UNMARKED 2LL
#define DDP__ERROR_ROWS_TWICE 3LL
#define DDP__ERROR_STALE 4LL


typedef struct rparam {
    char *name;
    size_t registered; /* index as registered (the first of any duplicates) */
    void *data;
    size_t numel;
    ddp_dtype_t dtype;
    size_t rows;
    int sparse;
    void *user_grad;
    size_t bucket, slot, offset; /* where its gradient lives */
    size_t block_offset; /* block modes, dense and numel > 0: byte offset in the gradient block */
    /* sparse gradient: pending rows (accumulated since zero_grad) and the averaged result */
    int64_t *pending_index;
    unsigned char *pending_values;
    size_t pending_rows, pending_cap;
    int64_t *result_index;
    unsigned char *result_values;
    size_t result_rows;
    int contribute; /* sparse: rows take part in this reduction */
    /* row readiness (dense): a byte per row at row_marks + row_base, rows_marked of them set */
    size_t row_base, rows_marked;
} rparam_t;

/* A fixed slice of a dense bucket, reduced on its own as soon as all its elements are marked. */
typedef struct piece {
    struct bucket *bucket;
    size_t index;
    size_t begin, numel; /* element range within the bucket */
    size_t pending;      /* elements not yet marked this iteration */
    ddp_work_t *work;
    double launch_us;
    _Atomic uint64_t done_bits;
    _Atomic int done_set;
} piece_t;

typedef struct bucket {
    struct ddp_reducer *owner;
    size_t index;
    size_t nparams;
    size_t *params;     /* kept parameter indices */
    size_t *registered; /* the same, as registered indices (what users see) */
    size_t *offsets, *numels, *rows;
    ddp_dtype_t dtype;
    size_t numel;
    int sparse;
    void *data; /* from ddp_group_alloc_buffer; NULL when empty or sparse */
    size_t pending; /* parameters not yet marked this iteration */
    int launched;
    ddp_work_t *work;
    double ready_us, launch_us;
    _Atomic uint64_t done_bits; /* done time (double bits) written by the completion callback */
    _Atomic int done_set;
    char trace_name[40];
    ddp_comm_bucket_t view;
    /* Piece-wise launch (default hook and piece_bytes > 0): npieces > 0. */
    piece_t *pieces;
    size_t npieces, next_piece;
    /* The order pieces are launched in (piece indices): ascending until the rebuild, then the
     * order in which rank 0's pieces became complete in the first synchronised iteration, so a
     * backward that finishes a matrix's last rows first reduces them first. */
    size_t *piece_order;
} bucket_t;

struct ddp_reducer {
    ddp_group_t *group;
    int rank, world;
    ddp_reducer_config_t config;
    int set_group_trace; /* 1: config.trace was made the group's (ddp_group_set_trace) */
    size_t nregistered;
    size_t *kept_of; /* registered index -> kept index */
    size_t nparams;
    rparam_t *params;
    size_t nbuffers;
    ddp__tensor_ref_t *buffers;
    bucket_t *buckets;
    size_t nbuckets;
    size_t next_launch;
    /* After the rebuild with pieces: every piece (and pieceless bucket) of every bucket in one
     * launch order, fixed from rank 0's recording iteration; NULL before (or without pieces):
     * bucket after bucket, each bucket's pieces in its piece_order. */
    launch_unit_t *schedule;
    size_t nschedule, next_unit;
    /* This iteration's launches (capacity: one per unit) and its grad_ready / grad_ready_rows /
     * sparse_grad calls so far; finalizing: finalize is launching. */
    launch_record_t *launch_log;
    size_t launch_cap, ready_calls;
    int finalizing;
    ddp_reduction_stats_t *reduction_stats;

    unsigned char *marked;          /* this iteration */
    unsigned char *row_marks;       /* per row of every dense parameter, this iteration;
                                     * allocated by the first grad_ready_rows */
    size_t total_rows;
    size_t launches;                /* reductions started this iteration */
    unsigned char *used_since_sync; /* marked in any iteration since the last synchronised one */
    int active, iter_sync, sync_enabled;
    uint64_t iteration; /* synchronised iterations completed */
    int64_t local_error; /* ERROR_TWICE << 32 | (param + 1) for this iteration, 0 if none */
    char local_error_text[DDP_ERROR_TEXT_MAX];
    double first_ready_us;

    int rebuilt, rebuild_due, recording;
    /* Block modes: the one gradient block (buckets are runs of it); owned when libddp
     * allocated it (DDP_GRAD_MEMORY_BLOCK). */
    unsigned char *block;
    size_t block_bytes;
    int block_owned;
    /* DDP_GRAD_MEMORY_USER_BLOCK: the Reducer registered the caller's block with
     * ddp_group_register_memory and unregisters it when destroyed. */
    int block_registered;
    /* Bucket mode after a rebuild moved the gradients: the old bucket memory, filled with
     * DDP__STALE_BYTE until the next synchronised finalize checks that nobody wrote it, and each
     * parameter's old slot in it (NULL for sparse and empty ones). */
    void **stale_memory;
    size_t nstale;
    unsigned char **stale_slot;
    size_t *arrival;
    size_t narrival;
    /* The recording iteration's row marks in the order they became final (kept index, element
     * range within the parameter; an empty range: the parameter became complete): the rebuild
     * cuts and orders the pieces by them. */
    struct final_range {
        size_t param, begin, end;
    } *finals;
    size_t nfinals, finals_cap;

    unsigned char *saved; /* slots of locally unused parameters, restored if globally unused */
    int64_t *status_vector;
    _Atomic int callbacks_pending;

    /* Uneven inputs (config.join). contributors: ranks with data in this iteration (the
     * divisor; the world size without config.join). post_divide: the default hook sums and
     * finalize divides by contributors (set when some rank has joined). join_flags: the
     * agreement's vector (world has-data flags, then the count of ranks that synchronise);
     * join_prev: the has-data flags of the last agreement in which some rank had data, whose
     * lowest rank is the last to join. rebuild_root: the rank whose arrival order the rebuild
     * takes, the lowest with data in the recording iteration. */
    int contributors, post_divide, rebuild_root;
    int64_t *join_flags;
    unsigned char *join_prev;

    int have_stats;
    ddp_reducer_stats_t stats;
    ddp_bucket_stats_t *bucket_stats;
};

/* ---- small helpers ---------------------------------------------------------------------- */

static inline double load(ddp_dtype_t d, const void *p, size_t i)
{
    switch (d) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    case DDP_BF16: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0;
    }
}

static inline void store(ddp_dtype_t d, void *p, size_t i, double v)
{
    switch (d) {
    case DDP_F32: ((float *)p)[i] = (float)v; break;
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)p)[i] = ddp_f32_to_bf16((float)v); break;
    default: break;
    }
}


static inline unsigned char *slot_of(ddp_reducer_t *r, const rparam_t *p)
{
    bucket_t *b = &r->buckets[p->bucket];
    if (!b->data) return NULL; /* an empty bucket (only empty parameters) has no memory */
    return (unsigned char *)b->data + p->offset * ddp_dtype_size(p->dtype);
}

static inline size_t param_bytes(const rparam_t *p) { return p->numel * ddp_dtype_size(p->dtype); }

static inline size_t row_bytes(const rparam_t *p)
{
    return p->rows ? p->numel / p->rows * ddp_dtype_size(p->dtype) : 0;
}

/* Rows of the matrix view for row readiness: a vector is numel rows of one element. */
static inline size_t ready_rows(const rparam_t *p) { return p->rows ? p->rows : p->numel; }

static inline size_t row_numel(const rparam_t *p)
{
    size_t n = ready_rows(p);
    return n ? p->numel / n : 0;
}

/* Looks up a registered index: the kept parameter and its index. */
static inline ddp_status_t ddp__reducer_lookup(ddp_reducer_t *r, size_t index, const char *what,
                                               rparam_t **p, size_t *kept)
{
    if (!r) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: reducer is NULL", what);
    if (index >= r->nregistered)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: index %zu is out of range (%zu parameters registered)", what, index,
                          r->nregistered);
    *kept = r->kept_of[index];
    *p = &r->params[*kept];
    return DDP_OK;
}

static inline ddp_status_t ddp__reducer_check_active(ddp_reducer_t *r, const char *what)
{
    if (!r->active)
        return ddp__error(DDP_ERR_INVALID_USAGE,
                          "%s outside an iteration: call ddp_reducer_prepare first", what);
    return DDP_OK;
}

/* buckets.c: the initial layout (config.bucket_layout) with its memory, allocated collectively. */
ddp_status_t ddp__reducer_initial_buckets(ddp_reducer_t *r);

/* The marker byte old bucket memory is filled with after a rebuild moved the gradients: as f32,
 * f64, f16 or bf16 it is a tiny subnormal (or, for bf16/f16, a small number), so a write or an
 * accumulation through a stale pointer changes it. */
#define DDP__STALE_BYTE 0x01

static inline int block_mode(const ddp_reducer_t *r) { return r->config.grad_memory != 0; }

/* buckets.c: frees every bucket's memory (collectively) and descriptors. */
void ddp__reducer_free_buckets(ddp_reducer_t *r);

/* buckets.c, collective, at prepare: reassigns buckets in rank 0's arrival order. */
ddp_status_t ddp__reducer_rebuild(ddp_reducer_t *r);

/* buckets.c, at finalize: the first parameter whose pre-rebuild slot was written (its kept
 * index), or (size_t)-1; then frees the old memory (collectively). */
size_t ddp__reducer_check_stale(ddp_reducer_t *r);

/* buckets.c: frees the old memory kept after a rebuild (collectively), without checking. */
void ddp__reducer_free_stale(ddp_reducer_t *r);

/* bucket_layout.c: the assignment over kept parameters; `order` NULL means the initial one of
 * config.bucket_layout, otherwise arrival order (sorted by arrival position). */
ddp_status_t ddp__reducer_assign(ddp_reducer_t *r, const size_t *order,
                                 ddp_bucket_assignment_t *out);

/* bucket_layout.c, block modes: buckets as runs of the gradient block, parameters visited in
 * `order`; reverse_list reverses the list of runs (c10d's initial rule). */
ddp_status_t ddp__reducer_block_assign(ddp_reducer_t *r, const size_t *order, int reverse_list,
                                       ddp_bucket_assignment_t *out);

/* bucket_layout.c: the initial visiting order of config.bucket_layout over kept parameters. */
void ddp__reducer_initial_order(const ddp_reducer_t *r, size_t *order, int *reverse_list);

/* bucket_layout.c, DDP_GRAD_MEMORY_BLOCK: places every parameter in the block in the order of
 * assignment `a` and allocates the block collectively. */
ddp_status_t ddp__reducer_layout_block(ddp_reducer_t *r, const ddp_bucket_assignment_t *a);

/* bucket_layout.c, block modes: kept parameters in block address order (sparse ones last). */
ddp_status_t ddp__reducer_address_order(const ddp_reducer_t *r, size_t *order);

/* piece_schedule.c: whether the rebuild plans pieces and one schedule from rank 0's record. */
int ddp__reducer_schedules_pieces(const ddp_reducer_t *r);

/* piece_schedule.c, collective, at the rebuild: the stacked-tensor schedule (pieces cut along
 * rank 0's row ranges, one launch order across buckets). */
ddp_status_t ddp__reducer_schedule_pieces(ddp_reducer_t *r);

/* piece_schedule.c, collective, at the rebuild: each bucket's piece order, rank 0's completion
 * order. */
ddp_status_t ddp__reducer_order_pieces(ddp_reducer_t *r);

/* verify.c, collective: every rank's creation status, counts, config and parameter signatures
 * are compared with rank 0's; `local` is this rank's status so far (a failure is reported on
 * every rank). */
ddp_status_t ddp__reducer_verify_model(ddp_group_t *group, ddp_status_t local,
                                       const rparam_t *params, size_t nparams, size_t nbuffers,
                                       size_t piece_bytes, int bucket_layout, int grad_memory,
                                       int join);

/* buckets.c: waits (bounded by the group's timeout) for every completion callback (iteration.c's
 * on_bucket_done and on_piece_done), before bucket memory is freed or statistics are read. */
void ddp__reducer_wait_callbacks(ddp_reducer_t *r);

/* iteration.c: the collectives that start every iteration, in prepare and in a joined rank's
 * shadow alike: the rebuild if due, the buffer broadcast, and with config.join the agreement on
 * who has data (has_data for this rank, sync whether it synchronises); sets r->contributors,
 * r->post_divide and *sync_out (whether the ranks with data synchronise; 0 when none has). */
ddp_status_t ddp__reducer_start_collectives(ddp_reducer_t *r, int has_data, int sync,
                                            int *sync_out);

/* iteration.c: resets the marks, buckets and pieces for a new iteration. */
void ddp__reducer_reset_iteration(ddp_reducer_t *r);

/* iteration.c: launches ready buckets (or pieces) strictly in bucket order. */
ddp_status_t ddp__reducer_launch_in_order(ddp_reducer_t *r);

/* iteration.c: marks kept parameter k ready (the twice error if it already is). */
ddp_status_t ddp__reducer_mark_ready(ddp_reducer_t *r, size_t k);

/* iteration.c: the rows of p not marked in this iteration become final. */
void ddp__reducer_unmarked_rows_final(ddp_reducer_t *r, rparam_t *p);

/* iteration.c: elements [begin, end) of bucket b are final (counted off its pieces). */
void ddp__reducer_count_off(bucket_t *b, size_t begin, size_t end);

/* The piece of b holding element e (pieces are sorted by begin and cover the bucket). */
static inline size_t ddp__piece_at(const bucket_t *b, size_t e)
{
    size_t lo = 0, hi = b->npieces;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->pieces[mid].begin <= e) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* piece_schedule.c: sizes the launch log and its statistics for the current buckets and pieces. */
ddp_status_t ddp__reducer_size_launch_log(ddp_reducer_t *r);

/* sparse.c: the progress-thread task reducing a sparse bucket (arg is the bucket_t). */
ddp_status_t ddp__reducer_sparse_task(ddp_group_t *group, void *arg);

/* sparse.c: after a synchronised finalize, the averaged rows become p's accumulated gradient. */
ddp_status_t ddp__reducer_keep_sparse_result(rparam_t *p);

#endif
