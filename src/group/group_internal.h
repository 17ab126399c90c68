/* What the layers above the group (reducer, hooks, shard) may use of it beyond the public
 * ddp/group.h. Not installed. */
#ifndef DDP_GROUP_GROUP_INTERNAL_H
#define DDP_GROUP_GROUP_INTERNAL_H

#include "ddp/ddp.h"

/* Hint for a buffer from ddp_group_alloc_buffer: collective results written into it are read
 * later, after other work, not right away (see advise_cold_results in transport/transport.h). */
void ddp__group_advise_cold_results(ddp_group_t *group, void *buffer);

#endif
