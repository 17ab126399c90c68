/* The coalesced collectives (collectives.h): allreduce and broadcast over a list of buffers,
 * packed end to end into one scratch buffer so that they cost one collective of the transport. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

ddp_status_t ddp__coll_run_coalesced(ddp_group_t *g, const coll_args_t *a,
                                     const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g);
    size_t es = ddp_dtype_size(a->dtype);
    int is_allreduce = a->kind == K_ALLREDUCE_COALESCED;
    void *tmp = ddp__scratch(a->count, es, 1);
    if (!tmp) return DDP_ERR_NO_MEMORY;
    size_t off = 0;
    if (is_allreduce || rank == a->root)
        for (size_t i = 0; i < a->nbufs; i++) {
            if (a->counts[i]) memcpy((char *)tmp + off * es, a->bufs[i], a->counts[i] * es);
            off += a->counts[i];
        }
    ddp_status_t s = is_allreduce ? ddp_group_allreduce(g, tmp, tmp, a->count, a->dtype, a->op)
                                  : ddp_group_broadcast(g, tmp, a->count, a->dtype, a->root);
    off = 0;
    if (s == DDP_OK && (is_allreduce || rank != a->root))
        for (size_t i = 0; i < a->nbufs; i++) {
            if (a->counts[i]) memcpy(a->bufs[i], (char *)tmp + off * es, a->counts[i] * es);
            off += a->counts[i];
        }
    free(tmp);
    return s;
}
