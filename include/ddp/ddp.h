/* libddp: data-parallel training in C. Include this one header. */
#ifndef DDP_DDP_H
#define DDP_DDP_H

#include "ddp/config.h"
#include "ddp/env.h"
#include "ddp/fsdp.h"
#include "ddp/group.h"
#include "ddp/hooks.h"
#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "ddp/status.h"
#include "ddp/store.h"
#include "ddp/trace.h"
#include "ddp/types.h"

/* DDP_VERSION_MAJOR/MINOR/PATCH and ddp_version() are in ddp/status.h. */

#endif
