/* Built-in communication hooks for the Reducer (ddp_reducer_config_t.comm_hook): buckets that
 * travel in half precision (fp16 or bf16), and the helper a hand-written hook uses to report an
 * error through ddp_last_error(). PowerSGD lives in ddp/powersgd.h (a separate library, it needs
 * CBLAS).
 *
 *     ddp_half_hook_state_t *half;
 *     ddp_half_hook_state_create(DDP_F16, &half);
 *     config.comm_hook = ddp_hook_fp16;       // or ddp_hook_bf16 with a DDP_BF16 state
 *     config.comm_hook_state = half;
 *     ... train ...
 *     ddp_reducer_destroy(reducer);
 *     ddp_half_hook_state_destroy(half);
 *
 * How the half hooks reduce: the bucket (f32 or f64, already divided by the world size) is
 * rounded to f16/bf16, allreduced with DDP_SUM on the half dtype (the group accumulates the ranks'
 * half values in f32 and rounds the sum once, unlike PyTorch's hooks, which add in half precision)
 * and widened back into the bucket. Half the bytes of an f32 bucket cross the wire; the result is
 * bitwise identical on every rank and within half-precision rounding of the exact average. f16
 * and bf16 buckets are allreduced as they are. All of it runs as one task on the group's progress
 * thread, so the caller's backward goes on meanwhile. */
#ifndef DDP_HOOKS_H
#define DDP_HOOKS_H

#include <stdint.h>

#include "ddp/group.h"
#include "ddp/reducer.h"
#include "ddp/status.h"
#include "ddp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Cumulative counts over every bucket a hook reduced. */
typedef struct ddp_hook_stats {
    uint64_t buckets;      /* hook calls */
    uint64_t numel;        /* elements reduced */
    uint64_t bytes_before; /* bytes an allreduce of the buckets as they are would send */
    uint64_t bytes_after;  /* bytes the hook's collectives carried (the "wire" size) */
} ddp_hook_stats_t;

typedef struct ddp_half_hook_state ddp_half_hook_state_t;

/* wire_dtype: DDP_F16 or DDP_BF16, the precision buckets travel in. One state per reducer (it
 * keeps one conversion buffer per bucket, reused every iteration). */
DDP_API ddp_status_t ddp_half_hook_state_create(ddp_dtype_t wire_dtype,
                                                ddp_half_hook_state_t **out);
/* Frees the state and its buffers. Call after the reducer that used it is finalized or
 * destroyed (no bucket may still be in flight). NULL is allowed. */
DDP_API void ddp_half_hook_state_destroy(ddp_half_hook_state_t *state);
/* Statistics since create. Read from the thread that drives the reducer. */
DDP_API ddp_status_t ddp_half_hook_stats(const ddp_half_hook_state_t *state,
                                         ddp_hook_stats_t *out);

/* The hooks (ddp_comm_hook_fn). state: a ddp_half_hook_state_t of the matching wire dtype.
 * DDP_ERR_INVALID_ARGUMENT for a NULL or mismatched state, a NULL group/bucket/work, a dtype that
 * is not a ddp_dtype_t or a numel whose byte size overflows; DDP_ERR_UNSUPPORTED for an integer
 * bucket; collective failures arrive through the work. */
DDP_API ddp_status_t ddp_hook_fp16(void *state, ddp_group_t *group,
                                   const ddp_comm_bucket_t *bucket, ddp_work_t **work);
DDP_API ddp_status_t ddp_hook_bf16(void *state, ddp_group_t *group,
                                   const ddp_comm_bucket_t *bucket, ddp_work_t **work);

/* For hook writers (and libraries of hooks outside libddp, such as ddp_powersgd): records
 * `status` with a printf-style message as the calling thread's ddp_last_error() and returns
 * status. Inside a task the text travels to the thread that waits on the work. */
DDP_API ddp_status_t ddp_hook_error(ddp_status_t status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif
