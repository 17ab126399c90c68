/* Broadcast and allgather from registered memory (issue #27): when every rank's source (a
 * broadcast's buffer, an allgather's send) is in registered memory and the views of it are
 * agreed, each rank reads its peers' sources where they lie, one copy per byte, instead of a copy
 * into the stage and one out of it (rounds) or a system call per peer (single copy). The edges
 * outside an export's whole pages come from the owner's stage, as in the mapped allreduce.
 *
 * Whether to try is agreed state: per size class, the last try's outcome, and a retry at calls
 * 1, 2, 4, ..., 64 of the class and every 64th after, so that DDP_SHM_MAP=auto (which registers a
 * buffer the second time it sees it) gets its chance and a class whose buffers are never
 * registered pays the try's one phase rarely. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* Retry the mapped way at this call of a size class (calls counted from 1). */
static int retry_due(uint32_t n) { return n <= 64 ? (n & (n - 1)) == 0 : n % 64 == 0; }

/* Copies rank k's source (n elements, hint h) into dst: the pages through this rank's view of
 * its export, the edges from its stage of parity q. */
static void pull(shm_state_t *S, int k, const ddp__shm_map_hint_t *h, unsigned q, char *dst,
                 size_t n, size_t esize, int stream)
{
    size_t lo, hi;
    ddp__shm_covered(h, n, esize, &lo, &hi);
    const char *stage = stage_of(S, k, q);
    if (lo) memcpy(dst, stage + EDGE_SEND_HEAD, lo * esize);
    if (hi > lo)
        copy_out(dst + lo * esize, ddp__shm_view_at(&S->views, k, h, h->addr + lo * esize),
                 (hi - lo) * esize, stream);
    if (n > hi) memcpy(dst + hi * esize, stage + EDGE_SEND_TAIL, (n - hi) * esize);
}

/* Stages this rank's edges of src (n elements, hint h) for the peers that pull it. */
static void stage_edges(shm_state_t *S, const ddp__shm_map_hint_t *h, const char *src, size_t n,
                        size_t esize)
{
    size_t lo, hi;
    ddp__shm_covered(h, n, esize, &lo, &hi);
    char *stage = stage_of(S, S->rank, (unsigned)(S->use & 1));
    if (lo) memcpy(stage + EDGE_SEND_HEAD, src, lo * esize);
    if (n > hi) memcpy(stage + EDGE_SEND_TAIL, src + hi * esize, (n - hi) * esize);
}

ddp_status_t ddp__shm_try_pulled(shm_state_t *S, const ddp__collective_t *c, int key, int *ran)
{
    *ran = 0;
    const uint32_t calls = ++S->pull_calls[key];
    if (!S->pull_ok[key] && !retry_due(calls)) return DDP_OK;
    const int p = S->world, me = S->rank, bcast = c->kind == DDP__BROADCAST;
    const size_t esize = ddp_dtype_size(c->dtype), n = c->count, bytes = n * esize;
    /* The source: a broadcast's buffer on every rank (the root's is read, the others' need not
     * be registered, but asking every rank keeps one rule), an allgather's send. */
    const char *src = bcast ? (const char *)c->recv : (const char *)c->send;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    if (ddp__shm_map_one(S, src, bytes, esize, &fp.map[0])) stage_edges(S, &fp.map[0], src, n, esize);
    unsigned fparity;
    ddp_status_t s = ddp__shm_first_sync_data(S, c, &fp, NULL, 0, 0, &fparity);
    if (s != DDP_OK) return s;
    ddp__shm_prune_views(S);
    int all = 1;
    for (int k = 0; k < p; k++) all &= S->ranks[k].map_hints[fparity][0].slot >= 0;
    ddp__shm_map_hint_t hints[DDP__SHM_MAX_WORLD];
    int mapped = all && ddp__shm_decide_mapped(S, c, fparity, 1, hints, &s);
    if (s != DDP_OK) return s;
    S->pull_ok[key] = (uint8_t)mapped;
    if (!mapped) return DDP_OK;
    *ran = 1;
    set_algorithm(S, DDP__SHM_ALG_MAPPED);
    const unsigned q = (unsigned)(S->use++ & 1);
    const int stream = bytes * (size_t)(bcast ? 1 : p) >= STREAM_MIN_BYTES;
    if (bcast) {
        if (me != c->root) pull(S, c->root, &hints[c->root], q, c->recv, n, esize, stream);
    } else {
        char *recv = c->recv;
        for (int j = 1; j < p; j++) { /* peers from the next rank on: not all on one at once */
            const int k = (me + j) % p;
            pull(S, k, &hints[k], q, recv + (size_t)k * bytes, n, esize, stream);
        }
        if (c->send != recv + (size_t)me * bytes) memcpy(recv + (size_t)me * bytes, c->send, bytes);
    }
    /* No rank changes its source until every rank has read it. */
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}
