/* The shared-memory allgather: in rounds through every rank's stage, or single copy (every rank
 * reads every peer's send with process_vm_readv). shm_choose.c picks one per call. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* In rounds of DDP_SHM_ROUND_BYTES per rank: every rank copies its round into its stage, one
 * phase, every rank copies every other rank's round out to its place in recv. */
ddp_status_t ddp__shm_allgather_rounds(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    const size_t chunk = S->round_bytes / esize;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    const char *send = c->send;
    char *recv = c->recv;
    const size_t n = c->count;
    const int in_place = send == recv + (size_t)me * n * esize;
    size_t o = 0;
    int first = 1;
    do {
        size_t k = n - o < chunk ? n - o : chunk;
        unsigned q = (unsigned)(S->use++ & 1);
        const int tiny = k == n && k * esize <= MAILBOX_DATA;
        const uint64_t early = ddp__shm_early_arrival(S, first, k * esize);
        if (k && !tiny) memcpy(stage_of(S, me, q), send + o * esize, k * esize);
        int fq;
        ddp_status_t s =
            ddp__shm_round_phase(S, c, &fp, first, early, tiny, send, k * esize, &fq);
        if (s != DDP_OK) return s;
        first = 0;
        for (int j = 0; j < p && k; j++) {
            char *dst = recv + ((size_t)j * n + o) * esize;
            if (j == me) {
                if (!in_place) memcpy(dst, send + o * esize, k * esize);
            } else {
                copy_out(dst, round_of(S, j, q, fq), k * esize,
                         n * (size_t)p * esize >= STREAM_MIN_BYTES);
            }
        }
        o += k;
    } while (o < n);
    return DDP_OK;
}

/* Every rank reads every peer's send straight into its place in recv. In place (send is this
 * rank's block of recv) is safe: a rank writes only the other ranks' blocks of its recv, and
 * peers read only its own block. */
ddp_status_t ddp__shm_allgather_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t bytes = c->count * ddp_dtype_size(c->dtype);
    char *recv = c->recv;
    ddp__shm_cma_publish(S, c->send, bytes);
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    ddp_status_t s = ddp__shm_first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    for (int j = 0; j < p; j++) {
        if (j == me) continue;
        int err;
        s = ddp__shm_cma_read(pid_of(S, j), recv + (size_t)j * bytes,
                              (uintptr_t)S->ranks[j].cma_send, bytes, "a peer's send buffer", &err);
        if (s != DDP_OK)
            return ddp__shm_cma_failed(S, c, ddp__error_context(s, "rank %d's block", j));
    }
    if (c->send != recv + (size_t)me * bytes) memcpy(recv + (size_t)me * bytes, c->send, bytes);
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}
