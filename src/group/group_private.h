/* What the group's own files share beyond group.c: internal tasks (the collectives built from
 * others in collectives.c run as tasks, in issue order) and the two-rank groups that carry
 * point-to-point messages. Not for the layers above (they use group_internal.h). */
#ifndef DDP_GROUP_GROUP_PRIVATE_H
#define DDP_GROUP_GROUP_PRIVATE_H

#include "ddp/ddp.h"

/* Runs fn(group, arg) in issue order with the group's other works. With work != NULL it is
 * queued and *work returned (free_arg(arg) runs when the work is released); with work == NULL it
 * runs now and its status is returned: inline on the progress thread or the calling thread when
 * the group is idle, else queued and waited for. The blocking collectives fn calls run inline
 * (they are the next sequence numbers on every rank). free_arg may be NULL; it also runs when
 * the task could not be issued. */
ddp_status_t ddp__group_task(ddp_group_t *group, ddp_task_fn fn, void *arg,
                             void (*free_arg)(void *), ddp_work_t **work);

/* Breaks the group with `status` and `text` (as a failed collective does): later works fail
 * with DDP_ERR_ABORTED quoting it; with tell_peers the transport tells the peers (not needed
 * when every rank reached the same verdict from the same data: an MPI abort notice nobody
 * receives outlives its communicator). */
void ddp__group_fail(ddp_group_t *group, ddp_status_t status, const char *text, int tell_peers);

/* The two-rank group this rank shares with `peer` (made through the group's store on first use,
 * destroyed with the group). Call only while running a task of `group`. DDP_ERR_UNSUPPORTED on
 * a group without a store. */
ddp_status_t ddp__group_pair(ddp_group_t *group, int peer, ddp_group_t **pair);

/* Point-to-point bookkeeping for recv from any source, called while running a send or recv
 * task: counts a send to `peer` (announced in the store when the group has recv from any
 * source enabled) or a recv from it. */
ddp_status_t ddp__group_p2p_count(ddp_group_t *group, int peer, int is_send);

/* The rank whose next message to this one is waiting: a peer that announced more sends to this
 * rank than this rank has received from it. Polls the store until one does (DDP_ERR_TIMEOUT
 * after the group's timeout, DDP_ERR_ABORTED when the group breaks meanwhile);
 * DDP_ERR_INVALID_USAGE when ddp_group_enable_recv_any was not called. */
ddp_status_t ddp__group_p2p_any_source(ddp_group_t *group, int tag, int *peer);

/* Whether ddp_group_enable_recv_any was called (checked when a recv from any source is issued,
 * so that a missing call is an error of the call, not a broken group). */
int ddp__group_recv_any_enabled(const ddp_group_t *group);

/* Alltoall as one collective of the group's transport, when its table says it has one
 * (transport.h, `alltoall`); ddp__group_has_alltoall says whether it does. Every rank of a group
 * answers the same. The arguments were checked by the caller; send and recv may overlap. work
 * NULL: run it now (blocking); else queue it like the five kinds' _async calls. */
int ddp__group_has_alltoall(const ddp_group_t *group);
ddp_status_t ddp__group_alltoall(ddp_group_t *group, const void *send, void *recv, size_t count,
                                 ddp_dtype_t dtype, ddp_work_t **work);

/* The same for reduce_scatter_apply (transport.h, `reduce_scatter_apply`). */
int ddp__group_has_reduce_scatter_apply(const ddp_group_t *group);
ddp_status_t ddp__group_reduce_scatter_apply(ddp_group_t *group, const void *send, void *recv,
                                             size_t count, ddp_dtype_t dtype, ddp_reduce_op_t op,
                                             ddp_apply_fn fn, void *arg, ddp_work_t **work);

#endif
