/* Agreement in the shared-memory transport: the first phase of every collective publishes the
 * caller's fingerprint in this rank's mailbox line (with a small collective's data and the
 * zero-copy hints), waits for every rank and compares, so that ranks that disagree all see it
 * before anyone reads a byte of someone else's data. Rank 0's tuner decisions ride along. */
#include <string.h>

#include "transport/shm/shm_internal.h"

void ddp__shm_fingerprint_of(const ddp__collective_t *c, shm_fingerprint_t *fp)
{
    memset(fp, 0, sizeof *fp);
    fp->id = ddp__fingerprint_of(c);
    fp->buffer_id = -1;
    fp->map[0].slot = fp->map[1].slot = -1;
}

/* The common record a mailbox was packed from (for the text of a mismatch). */
static ddp__fingerprint_t fingerprint_in(const shm_mailbox_t *mb)
{
    ddp__fingerprint_t f;
    memset(&f, 0, sizeof f);
    f.seq = mb->seq;
    f.count = mb->count;
    f.kind = mb->kind;
    f.dtype = mb->dtype;
    f.op = mb->op;
    f.root = mb->root;
    return f;
}

/* The first phase of every collective in two halves, for callers that stage data in between:
 * the arrival (the step swap, with the sleepers check deferred to the wait), which returns the
 * step to publish; then ddp__shm_first_publish. Writing the stage after the swap keeps the
 * swap, a locked instruction, from waiting for those stores to reach the peers' caches. */
uint64_t ddp__shm_first_arrive(shm_state_t *S) { return ddp__shm_arrive_ex(S, 1); }

/* The second half: publish the fingerprint (with up to MAILBOX_DATA bytes of the caller's data,
 * and the zero-copy hints) in this rank's mailbox for step `target`, wait for everyone,
 * compare. Every rank compares every rank with rank 0, so all ranks reach the same verdict and
 * print the same text. Returns the mailbox parity in *parity. `defer` 0: the sleepers check
 * runs right after the stamp, not in the wait (see arrive_ex). */
ddp_status_t ddp__shm_first_publish(shm_state_t *S, const ddp__collective_t *c,
                                    const shm_fingerprint_t *mine, const void *data,
                                    size_t data_bytes, uint64_t target, int defer,
                                    unsigned *parity)
{
    unsigned q = (unsigned)(target & 1);
    if (S->refused) return ddp__shm_poisoned_error(S, S->rank, S->refused, c);
    shm_rank_t *me = &S->ranks[S->rank];
    shm_mailbox_t *mb = &me->mailbox[q];
    mb->seq = mine->id.seq;
    mb->count = mine->id.count;
    mb->kind = (uint8_t)mine->id.kind;
    mb->dtype = (uint8_t)mine->id.dtype;
    mb->op = (uint8_t)mine->id.op;
    mb->root = (int16_t)mine->id.root;
    mb->tune_update = S->rank == 0 ? ddp__shm_tune_take_update(&S->tune) : 0;
    if (data_bytes) memcpy(mb->data, data, data_bytes);
    me->hints[q].buffer_id = mine->buffer_id;
    me->hints[q].send_offset = mine->send_offset;
    me->hints[q].recv_offset = mine->recv_offset;
    me->map_hints[q][0] = mine->map[0];
    me->map_hints[q][1] = mine->map[1];
    atomic_store_explicit(&mb->stamp, target, memory_order_release);
    if (!defer) ddp__shm_settle_arrival(S);
    ddp_status_t s = ddp__shm_wait_all_on(S, target, (int)q, c, c->deadline_ns);
    if (s != DDP_OK) return s;
    *parity = q;
    const shm_mailbox_t *m0 = &S->ranks[0].mailbox[q];
    for (int j = 1; j < S->world; j++) {
        const shm_mailbox_t *mj = &S->ranks[j].mailbox[q];
        if (mj->seq != m0->seq || mj->count != m0->count || mj->kind != m0->kind ||
            mj->dtype != m0->dtype || mj->op != m0->op || mj->root != m0->root) {
            ddp__fingerprint_t f0 = fingerprint_in(m0), fj = fingerprint_in(mj);
            char d0[256], dj[256];
            ddp__fingerprint_text(&f0, d0, sizeof d0);
            ddp__fingerprint_text(&fj, dj, sizeof dj);
            return ddp__error(DDP_ERR_MISMATCH,
                              "collective mismatch (seen on rank %d): rank 0 called %s but rank %d "
                              "called %s",
                              S->rank, d0, j, dj);
        }
    }
    /* Every rank applies rank 0's tuner decision at this same collective. */
    if (m0->tune_update) ddp__shm_tune_apply(&S->tune, m0->tune_update, c->trace);
    return DDP_OK;
}

/* Both halves. Arrive first (the step swap), then publish the mailbox: a stamp a peer sees is
 * then the stamp of a rank that is in, which no give-up can undo. `defer`: see arrive_ex. */
ddp_status_t ddp__shm_first_sync_data(shm_state_t *S, const ddp__collective_t *c,
                                      const shm_fingerprint_t *mine, const void *data,
                                      size_t data_bytes, int defer, unsigned *parity)
{
    uint64_t target = ddp__shm_first_arrive(S);
    return ddp__shm_first_publish(S, c, mine, data, data_bytes, target, defer, parity);
}

ddp_status_t ddp__shm_first_sync(shm_state_t *S, const ddp__collective_t *c,
                                 const shm_fingerprint_t *mine)
{
    unsigned q;
    return ddp__shm_first_sync_data(S, c, mine, NULL, 0, 1, &q);
}
