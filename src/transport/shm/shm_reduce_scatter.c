/* The shared-memory reduce-scatter: in rounds through every rank's stage, or single copy (rank r
 * reads block r of every peer's send with process_vm_readv). shm_choose.c picks one per call. */
#include <string.h>

#include "transport/shm/shm_internal.h"

/* In rounds of DDP_SHM_ROUND_BYTES: every rank stages its round of every block, one phase, rank r
 * reduces its block's round from every stage in rank order. */
ddp_status_t ddp__shm_reduce_scatter_rounds(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t per_block = S->round_bytes / esize / (size_t)p; /* elements of each block per round */
    if (per_block == 0) per_block = 1;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    const char *send = c->send;
    char *recv = c->recv;
    const size_t n = c->count;
    size_t o = 0;
    int first = 1;
    do {
        size_t k = n - o < per_block ? n - o : per_block;
        unsigned q = (unsigned)(S->use++ & 1);
        const size_t staged = (size_t)p * k * esize;
        const int tiny = k == n && staged <= MAILBOX_DATA;
        const uint64_t early = ddp__shm_early_arrival(S, first, staged);
        unsigned char line[MAILBOX_DATA];
        char *mine = tiny ? (char *)line : stage_of(S, me, q);
        for (int b = 0; b < p && k; b++)
            memcpy(mine + (size_t)b * k * esize, send + ((size_t)b * n + o) * esize, k * esize);
        int fq;
        ddp_status_t s = ddp__shm_round_phase(S, c, &fp, first, early, tiny, line, staged, &fq);
        if (s != DDP_OK) return s;
        first = 0;
        if (k) {
            const void *srcs[DDP__SHM_MAX_WORLD];
            for (int j = 0; j < p; j++) srcs[j] = round_of(S, j, q, fq) + (size_t)me * k * esize;
            ddp__reduce(recv + o * esize, srcs, p, k, c->dtype, c->op);
        }
        o += k;
    } while (o < n);
    return DDP_OK;
}

/* Rank r reads block r of every peer's send and reduces them with its own, in rank order (as
 * the rounds do), into recv. In place (recv is block r of send) is safe: peers read the other
 * blocks of this rank's send. */
ddp_status_t ddp__shm_reduce_scatter_cma(shm_state_t *S, const ddp__collective_t *c)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype), n = c->count;
    ddp__shm_cma_publish(S, c->send, n * esize * (size_t)p);
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    ddp_status_t s = ddp__shm_first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    int pids[DDP__SHM_MAX_WORLD];
    uintptr_t sends[DDP__SHM_MAX_WORLD];
    for (int j = 0; j < p; j++) {
        pids[j] = pid_of(S, j);
        sends[j] = (uintptr_t)S->ranks[j].cma_send;
    }
    s = ddp__shm_cma_reduce(&S->cma, pids, sends, me, p, (const char *)c->send + (size_t)me * n * esize,
                            c->recv, (size_t)me * n, n, c->dtype, c->op, 0);
    if (s != DDP_OK) return ddp__shm_cma_failed(S, c, s);
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}
