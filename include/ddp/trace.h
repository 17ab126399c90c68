/* Chrome trace (JSON) writer: spans viewable in Perfetto or chrome://tracing, plus a clock. */
#ifndef DDP_TRACE_H
#define DDP_TRACE_H

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_trace ddp_trace_t;

/* Monotonic clock in microseconds. */
DDP_API double ddp_time_us(void);

/* Opens `path` for writing a trace of process id `pid` (use the rank). */
DDP_API ddp_status_t ddp_trace_open(const char *path, int pid, ddp_trace_t **out);
/* Records a complete span ("ph":"X") on thread lane `tid`; times from ddp_time_us(). Thread-safe. */
DDP_API ddp_status_t ddp_trace_span(ddp_trace_t *trace, const char *name, const char *category,
                                    int tid, double start_us, double end_us);
/* Records an instant event ("ph":"i") at ts_us (from ddp_time_us()) with process scope: the
 * viewer draws it as a line across all of the rank's lanes. `args` holds 2 * nargs strings, key
 * then value (shown when the event is selected); args may be NULL when nargs is 0. Used by the
 * library itself for decisions that are not spans (the shm transport's tuner, see
 * ddp_group_set_trace). Thread-safe. */
DDP_API ddp_status_t ddp_trace_instant(ddp_trace_t *trace, const char *name, const char *category,
                                       int tid, double ts_us, const char *const *args, int nargs);
/* Names a thread lane (shown by the viewer). */
DDP_API ddp_status_t ddp_trace_name_lane(ddp_trace_t *trace, int tid, const char *name);
/* Finishes the JSON document and closes the file. NULL is allowed. */
DDP_API ddp_status_t ddp_trace_close(ddp_trace_t *trace);

#ifdef __cplusplus
}
#endif
#endif
