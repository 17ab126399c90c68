/* Consolidation of sharded optimizer state on one root, shared by ZeRO (zero_state.c) and FSDP
 * (fsdp.c): every rank's shard blob travels to every rank (an allgather of the blobs padded to
 * the largest; the group's gather would let only the root hold them all, but the allgather is
 * what every transport runs natively) and the root merges them into whole parameters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

ddp_status_t ddp__optim_state_consolidate(ddp_group_t *group, const ddp__optim_view_t *mine,
                                          const ddp__optim_view_t *whole, int root, void *buf,
                                          size_t size, const char *who,
                                          const char *size_fn)
{
    /* The root's buffer is checked after the exchange, so that a bad one fails there and every
     * other rank still completes the collective rather than waiting for the timeout. */
    int rank = ddp_group_rank(group);
    size_t world = (size_t)ddp_group_size(group);
    int64_t my_size = (int64_t)ddp__optim_state_size(mine), max_size = my_size;
    int64_t *sizes = ddp__calloc(world, sizeof *sizes, "consolidated state");
    if (!sizes) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = ddp_group_allgather(group, &my_size, sizes, 1, DDP_I64);
    if (s != DDP_OK) {
        free(sizes);
        return ddp__error_context(s, "%s: allgather of the shard sizes", who);
    }
    for (size_t r = 0; r < world; r++)
        if (sizes[r] > max_size) max_size = sizes[r];
    unsigned char *all = ddp__calloc(world, (size_t)max_size, "consolidated state");
    unsigned char *own = ddp__calloc(1, (size_t)max_size, "consolidated state");
    const void **blobs = ddp__calloc(world, sizeof *blobs, "consolidated state");
    size_t *blob_sizes = ddp__calloc(world, sizeof *blob_sizes, "consolidated state");
    if (!all || !own || !blobs || !blob_sizes) {
        s = DDP_ERR_NO_MEMORY;
        goto out;
    }
    s = ddp__optim_state_write(mine, own, (size_t)max_size, who);
    if (s != DDP_OK) goto out;
    s = ddp_group_allgather(group, own, all, (size_t)max_size, DDP_U8);
    if (s != DDP_OK) {
        ddp__error_context(s, "%s: allgather of the shards", who);
        goto out;
    }
    if (rank != root) goto out;
    for (size_t r = 0; r < world; r++) {
        blobs[r] = all + r * (size_t)max_size;
        blob_sizes[r] = (size_t)sizes[r];
    }
    size_t need = ddp__optim_state_size(whole);
    if (!buf || size < need) {
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: root's buffer is %s of %zu bytes; the "
                       "consolidated state needs %zu (%s)", who, buf ? "" : "NULL instead",
                       size, need, size_fn);
        goto out;
    }
    s = ddp__optim_state_merge(whole, blobs, blob_sizes, world, buf, size, who);
out:
    free(sizes);
    free(all);
    free(own);
    free(blobs);
    free(blob_sizes);
    return s;
}
