/* reduce_scatter_apply (collectives.h): the transport's own where its table has one (shared
 * memory: each rank reduces its block from the peers' registered memory, applies the caller's
 * function while the values are in cache and writes them into every rank's recv). Elsewhere it
 * is built from two of the five kinds: reduce_scatter into scratch, the function on this rank's
 * block, allgather in place. Both reduce with the reduce_scatter's kernel in rank order, so the
 * values handed to the function are the same bits whichever way ran. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

ddp_status_t ddp__coll_run_reduce_scatter_apply(ddp_group_t *g, const coll_args_t *a,
                                                const coll_header_t *h)
{
    if (ddp__group_has_reduce_scatter_apply(g))
        return ddp__group_reduce_scatter_apply(g, a->send, a->recv, a->count, a->dtype, a->op,
                                               a->apply, a->apply_arg, NULL);
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    const size_t es = ddp_dtype_size(a->dtype), rank = (size_t)ddp_group_rank(g);
    void *reduced = ddp__scratch(a->count, es, 1);
    if (!reduced) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp_group_reduce_scatter(g, a->send, reduced, a->count, a->dtype, a->op);
    if (s == DDP_OK) {
        if (a->count) a->apply(a->apply_arg, rank * a->count, reduced, a->count);
        char *mine = (char *)a->recv + rank * a->count * es;
        s = ddp_group_allgather(g, mine, a->recv, a->count, a->dtype);
    }
    free(reduced);
    return s;
}
