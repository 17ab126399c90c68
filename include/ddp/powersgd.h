/* PowerSGD gradient compression (Vogels et al., 2019) as a Reducer communication hook, after
 * PyTorch's powerSGD_hook. Lives in its own library, libddp_powersgd (link -lddp_powersgd -lddp;
 * it needs CBLAS), so this header is not included by ddp/ddp.h.
 *
 *     ddp_powersgd_config_t pc = DDP_POWERSGD_CONFIG_INIT;
 *     pc.matrix_approximation_rank = 2;
 *     ddp_powersgd_state_t *psgd;
 *     ddp_powersgd_state_create(&pc, &psgd);
 *     config.comm_hook = ddp_powersgd_hook;
 *     config.comm_hook_state = psgd;
 *
 * Per bucket, from iteration start_powersgd_iter on (before it: a plain allreduce):
 *   - each parameter with rows > 1 is an n x m matrix M (n = rows, m = numel / rows); it is
 *     compressed when (n + m) r < n m / min_compression_rate, with r = min(rank, n, m); vectors and
 *     small matrices are allreduced uncompressed in one contiguous buffer;
 *   - with error feedback, last iteration's local residual is added to M first;
 *   - P = M Q for every compressed M; all P's in one allreduce; each P orthonormalised
 *     (Gram-Schmidt, norms + epsilon); Q = Mᵀ P; all Q's in one allreduce; M := P Qᵀ, the rank-r
 *     approximation of the average (the bucket arrives divided by the world size, so the sums are
 *     averages already);
 *   - Q starts from a normal(0, 1) draw that every rank makes identically from random_seed; with
 *     warm_start it is kept (and re-orthonormalised) across iterations, else redrawn each time;
 *   - when the Reducer rebuilds a bucket with the same parameters in another order, each
 *     parameter keeps its Q and residual (they are per parameter; before they restarted).
 * Results are bitwise identical on every rank. f32 buckets are computed with cblas_sgemm, f64 ones
 * with cblas_dgemm; f16/bf16 buckets are allreduced uncompressed. Everything after the hook call
 * runs as one task on the group's progress thread. */
#ifndef DDP_POWERSGD_H
#define DDP_POWERSGD_H

#include <stdint.h>

#include "ddp/hooks.h"
#include "ddp/reducer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_powersgd_config {
    int matrix_approximation_rank; /* r >= 1 (1); larger is more exact and sends more */
    uint64_t start_powersgd_iter;  /* plain allreduce for iterations below this (1000) */
    double min_compression_rate;   /* compress a matrix only if it shrinks by this factor (2) */
    int use_error_feedback;        /* 1: keep the local residual and add it next iteration */
    int warm_start;                /* 1: reuse Q across iterations */
    double orthogonalization_epsilon; /* added to column norms (0); > 0 avoids dividing by 0 */
    uint64_t random_seed;          /* same on every rank (0) */
} ddp_powersgd_config_t;

/* Fills *config with the defaults written beside each field above (DDP_POWERSGD_CONFIG_INIT's),
 * from C or C++. NULL is ignored. */
DDP_API void ddp_powersgd_config_init(ddp_powersgd_config_t *config);

/* In C, designated initializers (adding a field cannot shift the others); in C++, the same
 * values from ddp_powersgd_config_init. */
#ifndef __cplusplus
#define DDP_POWERSGD_CONFIG_INIT                                                                  \
    {.matrix_approximation_rank = 1,                                                              \
     .start_powersgd_iter = 1000,                                                                 \
     .min_compression_rate = 2.0,                                                                 \
     .use_error_feedback = 1,                                                                     \
     .warm_start = 1,                                                                             \
     .orthogonalization_epsilon = 0.0,                                                            \
     .random_seed = 0}
#else
#define DDP_POWERSGD_CONFIG_INIT                                                                  \
    ([] {                                                                                         \
        ddp_powersgd_config_t ddp_config_;                                                        \
        ddp_powersgd_config_init(&ddp_config_);                                                   \
        return ddp_config_;                                                                       \
    }())
#endif

typedef struct ddp_powersgd_state ddp_powersgd_state_t;

/* Validates config (names the bad field) and makes a state. One state per reducer. OpenBLAS, if
 * that is the CBLAS, is set to one thread (the ranks are the parallelism). */
DDP_API ddp_status_t ddp_powersgd_state_create(const ddp_powersgd_config_t *config,
                                               ddp_powersgd_state_t **out);
/* Frees the state (residuals, P and Q memory). After the reducer using it has finalized or been
 * destroyed. NULL is allowed. */
DDP_API void ddp_powersgd_state_destroy(ddp_powersgd_state_t *state);

/* The hook (ddp_comm_hook_fn); state is a ddp_powersgd_state_t. DDP_ERR_INVALID_ARGUMENT for
 * NULLs, a dtype that is not a ddp_dtype_t, a numel whose byte size overflows, rows that do not
 * divide a parameter's numel, a parameter outside the bucket or parameters that overlap (their
 * numels add up to more than the bucket's); DDP_ERR_UNSUPPORTED for integer
 * buckets; collective failures arrive through the work, naming the bucket and the allreduce. */
DDP_API ddp_status_t ddp_powersgd_hook(void *state, ddp_group_t *group,
                                       const ddp_comm_bucket_t *bucket, ddp_work_t **work);

typedef struct ddp_powersgd_stats {
    /* Like PyTorch's total_numel_before/after_compression: cumulative over PowerSGD iterations
     * only; before counts every element of the bucket, after counts (n + m) r per compressed
     * matrix plus the uncompressed elements. */
    uint64_t numel_before;
    uint64_t numel_after;
    double compression_rate;      /* numel_before / numel_after (0 before any PowerSGD bucket) */
    uint64_t compressed_tensors;  /* cumulative count of matrices approximated */
    uint64_t uncompressed_tensors; /* cumulative count of tensors sent as they are */
    uint64_t plain_buckets;       /* buckets allreduced plainly (before start_powersgd_iter) */
    uint64_t powersgd_buckets;    /* buckets compressed */
    ddp_hook_stats_t wire;        /* every bucket, plain or compressed: bytes before and after */
} ddp_powersgd_stats_t;

/* Statistics since create. Read from the thread that drives the reducer. */
DDP_API ddp_status_t ddp_powersgd_stats(const ddp_powersgd_state_t *state,
                                        ddp_powersgd_stats_t *out);

/* Saved state, so a run resumed from a checkpoint continues bitwise: the seed generator, the
 * iteration count (start_powersgd_iter keeps counting from the saved run's iterations), the
 * statistics, and per bucket its layout, Q (warm start) and this rank's residual (error
 * feedback). The residual is local: every rank saves and loads its own state. Native byte order,
 * ends with a checksum. size: *bytes gets the size; save: buf of at least that size. load: into
 * a state created with the same config (a differing field is DDP_ERR_MISMATCH), before its
 * Reducer's first iteration; everything is checked before anything changes. A resumed Reducer
 * starts from its initial bucket layout and rebuilds again; a bucket that holds the same
 * parameters in another order keeps each parameter's Q and residual (as at the rebuild of an
 * uninterrupted run), so the run continues bitwise on one node (shm reduces in rank order
 * wherever an element sits; warm_start 0 redraws Q by layout, so there the layout must match).
 * A bucket with other parameters starts over. */
DDP_API ddp_status_t ddp_powersgd_state_size(const ddp_powersgd_state_t *state, size_t *bytes);
DDP_API ddp_status_t ddp_powersgd_state_save(const ddp_powersgd_state_t *state, void *buf,
                                             size_t size);
DDP_API ddp_status_t ddp_powersgd_state_load(ddp_powersgd_state_t *state, const void *buf,
                                             size_t size);

/* The compression test, as the hook applies it: 1 when an n x m matrix is compressed at
 * approximation rank `rank` (clipped to min(n, m)) and min_compression_rate. */
DDP_API int ddp_powersgd_should_compress(size_t n, size_t m, int rank,
                                         double min_compression_rate);

#ifdef __cplusplus
}
#endif
#endif
