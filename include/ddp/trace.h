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
/* Names a thread lane (shown by the viewer). */
DDP_API ddp_status_t ddp_trace_name_lane(ddp_trace_t *trace, int tid, const char *name);
/* Finishes the JSON document and closes the file. NULL is allowed. */
DDP_API ddp_status_t ddp_trace_close(ddp_trace_t *trace);

#ifdef __cplusplus
}
#endif
#endif
