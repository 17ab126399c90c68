/* The shared-memory alltoall: in rounds through every rank's stage, or single copy (every rank
 * reads its block of every peer's send with process_vm_readv). shm_choose.c picks one per call.
 * Each byte moves twice in rounds (into the sender's stage, out to the receiver's recv) and once
 * single copy, against world times over the allgather the group would otherwise build it from.
 *
 * send and recv may overlap in any way (the group does not refuse it; torch passes one tensor
 * as both). A rank whose buffers overlap first copies its send aside, so that neither what
 * peers read nor what this rank still has to stage is overwritten by what it receives; the
 * other ranks do not need to know. */
#include <stdlib.h>
#include <string.h>

#include "transport/shm/shm_internal.h"

/* send, or a private copy of it when recv overlaps it (*copy: what to free). */
static const char *send_apart(const ddp__collective_t *c, size_t bytes, char **copy)
{
    *copy = NULL;
    if (!ddp__overlaps(c->send, bytes, c->recv, bytes)) return c->send;
    *copy = ddp__malloc(bytes ? bytes : 1, "a copy of alltoall's send (it overlaps recv)");
    if (*copy && bytes) memcpy(*copy, c->send, bytes);
    return *copy;
}

/* In rounds of DDP_SHM_ROUND_BYTES per rank: a round carries the next k elements of every
 * block; every rank puts its k for each destination side by side in its stage, one phase, every
 * rank copies its k out of every peer's stage. Its own block goes straight from send to recv. */
static ddp_status_t alltoall_rounds(shm_state_t *S, const ddp__collective_t *c, const char *send)
{
    const int p = S->world, me = S->rank;
    const size_t esize = ddp_dtype_size(c->dtype);
    size_t chunk = S->round_bytes / esize / (size_t)p;
    if (chunk == 0) chunk = 1;
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    char *recv = c->recv;
    const size_t n = c->count;
    const int stream = n * (size_t)p * esize >= STREAM_MIN_BYTES;
    size_t o = 0;
    int first = 1;
    do {
        size_t k = n - o < chunk ? n - o : chunk;
        unsigned q = (unsigned)(S->use++ & 1);
        /* The stage holds block j at j * k: the line a tiny one rides in needs all p of them. */
        const size_t staged = (size_t)p * k * esize;
        const int tiny = k == n && staged <= MAILBOX_DATA;
        const uint64_t early = ddp__shm_early_arrival(S, first, (size_t)(p - 1) * k * esize);
        unsigned char line[MAILBOX_DATA] = {0}; /* its own block stays unwritten: no stack bytes */
        char *mine = tiny ? (char *)line : stage_of(S, me, q);
        for (int j = 0; j < p && k; j++)
            if (j != me)
                memcpy(mine + (size_t)j * k * esize, send + ((size_t)j * n + o) * esize, k * esize);
        int fq;
        ddp_status_t s = ddp__shm_round_phase(S, c, &fp, first, early, tiny, line, staged, &fq);
        if (s != DDP_OK) return s;
        first = 0;
        for (int j = 0; j < p && k; j++) {
            char *dst = recv + ((size_t)j * n + o) * esize;
            if (j == me) {
                memcpy(dst, send + ((size_t)j * n + o) * esize, k * esize);
            } else {
                copy_out(dst, round_of(S, j, q, fq) + (size_t)me * k * esize, k * esize, stream);
            }
        }
        o += k;
    } while (o < n);
    return DDP_OK;
}

/* Every rank reads block `me` of every peer's send straight into block j of its recv; the last
 * phase keeps each send alive until every peer has read it. */
static ddp_status_t alltoall_cma(shm_state_t *S, const ddp__collective_t *c, const char *send)
{
    const int p = S->world, me = S->rank;
    const size_t block = c->count * ddp_dtype_size(c->dtype);
    char *recv = c->recv;
    ddp__shm_cma_publish(S, send, block * (size_t)p);
    shm_fingerprint_t fp;
    ddp__shm_fingerprint_of(c, &fp);
    ddp_status_t s = ddp__shm_first_sync(S, c, &fp);
    if (s != DDP_OK) return s;
    for (int j = 0; j < p; j++) {
        if (j == me) continue;
        int err;
        s = ddp__shm_cma_read(pid_of(S, j), recv + (size_t)j * block,
                              (uintptr_t)S->ranks[j].cma_send + (size_t)me * block, block,
                              "a peer's send buffer", &err);
        if (s != DDP_OK)
            return ddp__shm_cma_failed(S, c, ddp__error_context(s, "rank %d's block", j));
    }
    memcpy(recv + (size_t)me * block, send + (size_t)me * block, block);
    return ddp__shm_sync_all(S, c, c->deadline_ns);
}

/* Runs `body` on send, or on a private copy of it when recv overlaps it. */
static ddp_status_t with_send_apart(shm_state_t *S, const ddp__collective_t *c,
                                    ddp_status_t (*body)(shm_state_t *, const ddp__collective_t *,
                                                         const char *))
{
    char *copy;
    const char *send = send_apart(c, c->count * ddp_dtype_size(c->dtype) * (size_t)S->world, &copy);
    if (!send) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = body(S, c, send);
    free(copy);
    return s;
}

ddp_status_t ddp__shm_alltoall_rounds(shm_state_t *S, const ddp__collective_t *c)
{
    return with_send_apart(S, c, alltoall_rounds);
}

ddp_status_t ddp__shm_alltoall_cma(shm_state_t *S, const ddp__collective_t *c)
{
    return with_send_apart(S, c, alltoall_cma);
}
