/* The shared-memory broadcast: in rounds through the root's stage, or single copy (every rank
 * reads the root's buffer with process_vm_readv). shm_choose.c picks one per call. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* In rounds of DDP_SHM_ROUND_BYTES: the root copies a round into its stage, one phase, every
 * other rank copies it out (streamed when the output is too large for the caches). */
ddp_status_t ddp__shm_broadcast_rounds(shm_state_t *S, const ddp__collective_t *c)
{
    const int me = S->rank, root = c->root;
    const size_t esize = ddp_dtype_size(c->dtype);
    const size_t chunk = S->round_bytes / esize;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    char *buf = c->recv;
    size_t o = 0;
    int first = 1;
    do {
        size_t n = c->count - o < chunk ? c->count - o : chunk;
        unsigned q = (unsigned)(S->use++ & 1);
        const int tiny = n == c->count && n * esize <= MAILBOX_DATA;
        const uint64_t early = ddp__shm_early_arrival(S, first, me == root ? n * esize : 0);
        if (me == root && n && !tiny) memcpy(stage_of(S, root, q), buf + o * esize, n * esize);
        int fq;
        ddp_status_t s = ddp__shm_round_phase(S, c, &fp, first, early, tiny,
                                              me == root ? buf : NULL, n * esize, &fq);
        if (s != DDP_OK) return s;
        first = 0;
        if (me != root && n)
            copy_out(buf + o * esize, round_of(S, root, q, fq), n * esize,
                     c->count * esize >= STREAM_MIN_BYTES);
        o += n;
    } while (o < c->count);
    return DDP_OK;
}

/* Every rank reads the root's buffer straight into its own; the last phase keeps the root's
 * buffer unchanged until every rank has read it. */
ddp_status_t ddp__shm_broadcast_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    if (S->rank == c->root) ddp__shm_cma_publish(S, c->recv, bytes);
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    ddp_status_t s = ddp__shm_first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    if (S->rank != c->root) {
        int err;
        s = ddp__shm_cma_read(pid_of(S, c->root), c->recv,
                              (uintptr_t)S->ranks[c->root].cma_send, bytes, "the root's buffer",
                              &err);
        if (s != DDP_OK) return ddp__shm_cma_failed(S, c, s);
    }
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}
