/* Internals shared by the Reducer's files: the bucket assignment with a choice of sort key (the
 * rebuild sorts by arrival position), the initial/buffer broadcast and model verification. */
#ifndef DDP_REDUCER_INTERNAL_H
#define DDP_REDUCER_INTERNAL_H

#include <stddef.h>

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

#endif
