/* The MPI transport's record exchange, which every collective starts with (mpi_private.h):
 * fingerprints as words, point to point up to ddp__mpi_p2p_max_world ranks, else one fused
 * MPI_Iallreduce with a user op; a mismatch is reported on every rank with both sides. */
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/mpi/mpi_private.h"

/* ---- fingerprints ------------------------------------------------------------------------ */

/* The common fingerprint (transport.h) as the words the fused record reduces: MIN over each word
 * and over its complement finds any word on which ranks differ, whatever fields it packs. */
_Static_assert(sizeof(ddp__fingerprint_t) % sizeof(int64_t) == 0, "fingerprint is whole words");

static void fingerprint_fields(const ddp__collective_t *c, int64_t out[FP_FIELDS])
{
    ddp__fingerprint_t f = ddp__fingerprint_of(c);
    memcpy(out, &f, sizeof f);
}

static ddp__fingerprint_t fingerprint_from_fields(const int64_t w[FP_FIELDS])
{
    ddp__fingerprint_t f;
    memcpy(&f, w, sizeof f);
    return f;
}

/* The ranks disagree: gathers every fingerprint and names rank 0 and the first rank that differs
 * from it. Every rank builds the same text. */
static ddp_status_t report_mismatch(mpi_state_t *s, const ddp__collective_t *c)
{
    int64_t mine[FP_FIELDS];
    fingerprint_fields(c, mine);
    int64_t *all = ddp__malloc((size_t)s->world * sizeof mine, "MPI transport fingerprints");
    if (!all) return ddp__mpi_break_state(s, DDP_ERR_NO_MEMORY);
    MPI_Request req;
    ddp__mpi_enter_mpi();
    int rc = MPI_Iallgather(mine, FP_FIELDS, MPI_INT64_T, all, FP_FIELDS, MPI_INT64_T, s->comm,
                            &req);
    ddp__mpi_leave_mpi();
    ddp_status_t status;
    if (rc != MPI_SUCCESS) {
        status = ddp__mpi_break_state(s, ddp__mpi_error(rc, "MPI transport: gathering fingerprints"));
    } else {
        status = ddp__mpi_wait_request(s, &req, c, "fingerprint gather");
    }
    if (status != DDP_OK) {
        /* `all` may still be written by MPI after a timeout: leak it rather than free it. */
        return status;
    }
    int other = 1;
    while (other < s->world && memcmp(all, all + (size_t)other * FP_FIELDS, sizeof mine) == 0)
        other++;
    if (other == s->world) other = 1; /* cannot happen: min and max differed */
    ddp__fingerprint_t first = fingerprint_from_fields(all);
    ddp__fingerprint_t second = fingerprint_from_fields(all + (size_t)other * FP_FIELDS);
    char a[256], b[256];
    ddp__fingerprint_text(&first, a, sizeof a);
    ddp__fingerprint_text(&second, b, sizeof b);
    free(all);
    status = ddp__error(DDP_ERR_MISMATCH,
                        "MPI transport, group '%s': collective mismatch: rank 0 called %s but "
                        "rank %d called %s",
                        s->name, a, other, b);
    return ddp__mpi_break_state(s, status);
}

/* ---- the fused exchange ----------------------------------------------------------------
 * The fingerprint travels in a fixed-size record with room for a small payload: an allreduce whose
 * data fits (in its reduction type) rides along and completes in this one MPI call. The record is
 * one element of a contiguous datatype, so MPI never splits it, and is reduced by fused_reduce:
 * MIN over the fingerprint words and, when both inputs carry the same fingerprint of an inline
 * allreduce, the collective's own op over the payload. Inputs whose fingerprints differ leave the
 * payload unreduced: the MIN/MAX disagreement is then reported and the payload never used. The
 * record has the same size whatever each rank called, so ranks that disagree still match. */

static MPI_Datatype fused_type = MPI_DATATYPE_NULL;
static MPI_Op fused_op = MPI_OP_NULL;

/* Whether an allreduce described by fingerprint f travels inside the record. */
static int inline_allreduce(const ddp__fingerprint_t *f)
{
    if (f->kind != DDP__ALLREDUCE || f->dtype < 0 || f->dtype >= DDP_DTYPE_COUNT || f->op < 0 ||
        f->op >= DDP_OP_COUNT || f->count == 0 || f->count > INT64_MAX)
        return 0;
    ddp_dtype_t rtype = ddp__mpi_reduce_dtype((ddp_dtype_t)f->dtype, (ddp_reduce_op_t)f->op);
    return f->count <= INLINE_BYTES / ddp_dtype_size(rtype);
}

#define COMBINE(T, a, b, n, op)                                                                   \
    do {                                                                                          \
        const T *x_ = (const T *)(a);                                                             \
        T *y_ = (T *)(b);                                                                         \
        for (size_t i_ = 0; i_ < (n); i_++) {                                                     \
            switch (op) {                                                                         \
            case DDP_MIN: y_[i_] = x_[i_] < y_[i_] ? x_[i_] : y_[i_]; break;                      \
            case DDP_MAX: y_[i_] = x_[i_] > y_[i_] ? x_[i_] : y_[i_]; break;                      \
            case DDP_PROD: y_[i_] = x_[i_] * y_[i_]; break;                                       \
            default: y_[i_] = x_[i_] + y_[i_]; break;                                             \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* Integers wrap (two's complement) instead of overflowing, like the other transports. */
#define COMBINE_INT(T, U, a, b, n, op)                                                            \
    do {                                                                                          \
        const T *x_ = (const T *)(a);                                                             \
        T *y_ = (T *)(b);                                                                         \
        for (size_t i_ = 0; i_ < (n); i_++) {                                                     \
            switch (op) {                                                                         \
            case DDP_MIN: y_[i_] = x_[i_] < y_[i_] ? x_[i_] : y_[i_]; break;                      \
            case DDP_MAX: y_[i_] = x_[i_] > y_[i_] ? x_[i_] : y_[i_]; break;                      \
            case DDP_PROD: y_[i_] = (T)((U)x_[i_] * (U)y_[i_]); break;                            \
            default: y_[i_] = (T)((U)x_[i_] + (U)y_[i_]); break;                                  \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* The payload is bytes; these element types may alias them (reading a char array through a
 * plain float lvalue is undefined behaviour that an optimiser may exploit). */
typedef float alias_f32 __attribute__((may_alias));
typedef double alias_f64 __attribute__((may_alias));
typedef int32_t alias_i32 __attribute__((may_alias));
typedef int64_t alias_i64 __attribute__((may_alias));

static void fused_reduce(void *invec, void *inoutvec, int *len, MPI_Datatype *type)
{
    (void)type;
    fused_record_t *in = invec, *inout = inoutvec;
    for (int k = 0; k < *len; k++) {
        fused_record_t *a = &in[k], *b = &inout[k];
        ddp__fingerprint_t f = fingerprint_from_fields(a->fp);
        if (memcmp(a->fp, b->fp, sizeof a->fp) == 0 &&
            memcmp(a->group, b->group, sizeof a->group) == 0 && inline_allreduce(&f)) {
            ddp_reduce_op_t op = (ddp_reduce_op_t)f.op;
            size_t n = (size_t)f.count;
            switch (ddp__mpi_reduce_dtype((ddp_dtype_t)f.dtype, op)) {
            case DDP_F32: COMBINE(alias_f32, a->payload, b->payload, n, op); break;
            case DDP_F64: COMBINE(alias_f64, a->payload, b->payload, n, op); break;
            case DDP_I32: COMBINE_INT(alias_i32, uint32_t, a->payload, b->payload, n, op); break;
            case DDP_I64: COMBINE_INT(alias_i64, uint64_t, a->payload, b->payload, n, op); break;
            case DDP_U8: COMBINE_INT(uint8_t, uint32_t, a->payload, b->payload, n, op); break;
            default: break; /* f16 and bf16 never reach here: they reduce in f32 */
            }
        }
        for (int i = 0; i < 2 * FP_FIELDS; i++)
            if (a->fp[i] < b->fp[i]) b->fp[i] = a->fp[i];
        for (int i = 0; i < 2; i++)
            if (a->group[i] < b->group[i]) b->group[i] = a->group[i];
    }
}

/* Creates the record's datatype and op once per process (freed by MPI_Finalize). */
ddp_status_t ddp__mpi_ensure_fused(void)
{
    if (fused_op != MPI_OP_NULL) return DDP_OK;
    int rc = MPI_Type_contiguous((int)sizeof(fused_record_t), MPI_BYTE, &fused_type);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&fused_type);
    if (rc == MPI_SUCCESS) rc = MPI_Op_create(fused_reduce, 1, &fused_op);
    if (rc != MPI_SUCCESS)
        return ddp__mpi_error(rc, "MPI transport: creating the fingerprint record");
    return DDP_OK;
}

/* Up to ddp__mpi_p2p_max_world ranks (8) the records go point to point: each rank sends its record
 * to every other and receives theirs (world - 1 messages each way, the same round trip as an
 * allreduce on a few ranks). Every rank then holds every record, so a mismatch names both sides at
 * once, an inline allreduce is reduced locally in rank order 0..p-1 (bitwise identical everywhere,
 * whatever MPI's algorithms), and at a timeout the receives still pending are exactly the ranks
 * that have not arrived: they are named with the last sequence number seen from them, and the
 * receives are cancelled (point-to-point receives can be, unlike collectives). Records of one
 * pair arrive in order on one tag, so sequence numbers never cross. */
ddp_status_t ddp__mpi_exchange_p2p(mpi_state_t *s, const ddp__collective_t *c)
{
    int n = 0;
    size_t bytes = sizeof(fused_record_t);
    ddp__mpi_enter_mpi();
    int rc = MPI_SUCCESS;
    for (int q = 0; q < s->world && rc == MPI_SUCCESS; q++) {
        if (q == s->rank) continue;
        rc = MPI_Irecv(&s->records[q], (int)bytes, MPI_BYTE, q, EXCHANGE_TAG, s->comm,
                       &s->xreqs[n]);
        if (rc == MPI_SUCCESS) n++;
    }
    MPI_Datatype type = ddp__mpi_faulty(s, MPI_BYTE);
    for (int q = 0; q < s->world && rc == MPI_SUCCESS; q++) {
        if (q == s->rank) continue;
        rc = MPI_Isend(&s->fused_send, (int)bytes, type, q, EXCHANGE_TAG, s->comm, &s->xreqs[n]);
        if (rc == MPI_SUCCESS) n++;
    }
    ddp__mpi_leave_mpi();
    ddp_status_t status = DDP_OK;
    if (rc != MPI_SUCCESS)
        status = ddp__mpi_post_failed(s, rc, c, "MPI_Isend/MPI_Irecv (fingerprint exchange)");
    else status = ddp__mpi_wait_requests(s, n, s->xreqs, c, "fingerprint exchange");
    while (status == DDP_OK) {
        /* A record stamped with another group's id was sent on an earlier communicator that
         * had this one's context id (see ddp__mpi_destroy): drop it and receive again; the
         * peer's own record follows it (one source, one tag, one communicator: in order). */
        int stale = 0;
        ddp__mpi_enter_mpi();
        for (int i = 0, q = 0; q < s->world && rc == MPI_SUCCESS; q++) {
            if (q == s->rank) continue;
            MPI_Request *r = &s->xreqs[i++];
            if ((uint64_t)s->records[q].group[0] == s->notice_id) continue;
            DDP_LOG(DDP_LOG_DEBUG, "MPI transport, group '%s' (id %llx), rank %d: dropped rank "
                    "%d's record of another group (id %llx) at seq %llu", s->name,
                    (unsigned long long)s->notice_id, s->rank, q,
                    (unsigned long long)s->records[q].group[0], (unsigned long long)c->seq);
            rc = MPI_Irecv(&s->records[q], (int)bytes, MPI_BYTE, q, EXCHANGE_TAG, s->comm, r);
            stale++;
        }
        ddp__mpi_leave_mpi();
        if (!stale) break;
        if (rc != MPI_SUCCESS)
            status = ddp__mpi_post_failed(s, rc, c, "MPI_Irecv (fingerprint exchange, again)");
        else status = ddp__mpi_wait_requests(s, n, s->xreqs, c, "fingerprint exchange");
    }
    if (status == DDP_OK) {
        memcpy(&s->records[s->rank], &s->fused_send, bytes);
        for (int q = 0; q < s->world; q++) s->last_seq[q] = (uint64_t)s->records[q].fp[0];
        return DDP_OK;
    }
    /* Which receives never completed: those ranks have not arrived. Cancel them so MPI lets go
     * of the records; sends to them are small and normally complete on their own. */
    char missing[1024] = "";
    size_t off = 0;
    int nmissing = 0;
    ddp__mpi_enter_mpi();
    for (int i = 0, q = 0; q < s->world; q++) {
        if (q == s->rank) continue;
        MPI_Request *r = &s->xreqs[i++];
        if (i > n || *r == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(r, &done, MPI_STATUS_IGNORE);
        if (done) continue;
        MPI_Cancel(r);
        MPI_Wait(r, MPI_STATUS_IGNORE);
        nmissing++;
        if (off < sizeof missing - 64) {
            if (s->last_seq[q])
                off += (size_t)snprintf(
                    missing + off, sizeof missing - off, "%srank %d (last seen at seq %llu)",
                    nmissing > 1 ? ", " : "", q, (unsigned long long)s->last_seq[q]);
            else
                off += (size_t)snprintf(missing + off, sizeof missing - off,
                                        "%srank %d (no collective seen yet)",
                                        nmissing > 1 ? ", " : "", q);
        }
    }
    ddp__mpi_leave_mpi();
    if (status == DDP_ERR_TIMEOUT && nmissing > 0) {
        char fp[256];
        ddp__mpi_describe(c, fp, sizeof fp);
        ddp__error(
            DDP_ERR_TIMEOUT,
            "MPI transport, group '%s': rank %d timed out in the fingerprint exchange of %s: "
            "%s not reached seq %llu: %s",
            s->name, s->rank, fp, nmissing > 1 ? "ranks have" : "a rank has",
            (unsigned long long)c->seq, missing);
        snprintf(s->broken_reason, sizeof s->broken_reason, "%s", ddp_last_error());
    }
    return status;
}

/* Every record is here: DDP_ERR_MISMATCH naming rank 0 and the first rank that differs from it;
 * for an inline allreduce, the payloads reduced in rank order into fused_recv. */
static ddp_status_t combine_records(mpi_state_t *s, int inline_data)
{
    const fused_record_t *r = s->records;
    for (int q = 1; q < s->world; q++) {
        if (memcmp(r[0].fp, r[q].fp, FP_FIELDS * sizeof(int64_t)) != 0) {
            ddp__fingerprint_t first = fingerprint_from_fields(r[0].fp);
            ddp__fingerprint_t other = fingerprint_from_fields(r[q].fp);
            char a[256], b[256];
            ddp__fingerprint_text(&first, a, sizeof a);
            ddp__fingerprint_text(&other, b, sizeof b);
            return ddp__mpi_break_state(s, ddp__error(DDP_ERR_MISMATCH,
                                             "MPI transport, group '%s': collective mismatch: "
                                             "rank 0 called %s but rank %d called %s",
                                             s->name, a, q, b));
        }
    }
    if (!inline_data) return DDP_OK;
    /* fused_reduce computes b = a op b; folding ranks 1.. into rank 0's copy keeps rank order
     * for every rank alike. */
    memcpy(&s->fused_recv, &r[0], sizeof s->fused_recv);
    for (int q = 1; q < s->world; q++) {
        fused_record_t a = r[q];
        memcpy(a.fp, s->fused_recv.fp, sizeof a.fp);
        int one = 1;
        MPI_Datatype t = fused_type;
        fused_reduce(&a, &s->fused_recv, &one, &t);
    }
    return DDP_OK;
}

/* Exchanges the fingerprint (and, for a small allreduce, its data): DDP_ERR_MISMATCH on every
 * rank when any field differs. *done = 1 when the payload carried the whole collective and its
 * result is already in c->recv. */
ddp_status_t ddp__mpi_exchange_fingerprint(mpi_state_t *s, const ddp__collective_t *c, int *done)
{
    int64_t f[FP_FIELDS];
    fingerprint_fields(c, f);
    for (int i = 0; i < FP_FIELDS; i++) {
        s->fused_send.fp[i] = f[i];
        s->fused_send.fp[FP_FIELDS + i] = ~f[i]; /* min of ~x is ~max of x */
    }
    s->fused_send.group[0] = (int64_t)s->notice_id;
    s->fused_send.group[1] = ~(int64_t)s->notice_id;
    ddp__fingerprint_t mine = fingerprint_from_fields(f);
    int inline_data = inline_allreduce(&mine);
    ddp_dtype_t rtype = ddp__mpi_reduce_dtype(c->dtype, c->op);
    if (inline_data) {
        if (rtype != c->dtype) ddp__acc_widen(s->fused_send.payload, c->send, c->count, c->dtype);
        else memcpy(s->fused_send.payload, c->send, c->count * ddp_dtype_size(c->dtype));
    }
    ddp_status_t status;
    if (s->records) {
        status = ddp__mpi_exchange_p2p(s, c);
        if (status == DDP_OK) status = combine_records(s, inline_data);
        if (status != DDP_OK) return status;
    } else {
        MPI_Request req;
        ddp__mpi_enter_mpi();
        int rc = MPI_Iallreduce(&s->fused_send, &s->fused_recv, 1, ddp__mpi_faulty(s, fused_type),
                                fused_op, s->comm, &req);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS)
            return ddp__mpi_post_failed(s, rc, c, "MPI_Iallreduce (fingerprint exchange)");
        status = ddp__mpi_wait_request(s, &req, c, "fingerprint exchange");
        if (status != DDP_OK) return status;
        for (int i = 0; i < FP_FIELDS; i++) {
            if (s->fused_recv.fp[i] != ~s->fused_recv.fp[FP_FIELDS + i])
                return report_mismatch(s, c);
        }
        /* A contribution of another group (sent on an earlier communicator with this one's
         * context id) cannot be told apart and dropped inside a collective: report it. */
        if (s->fused_recv.group[0] != ~s->fused_recv.group[1]) {
            char fp[256];
            ddp__mpi_describe(c, fp, sizeof fp);
            return ddp__mpi_break_state(
                s, ddp__error(DDP_ERR_PROTOCOL,
                              "MPI transport, group '%s', rank %d: the fingerprint exchange of "
                              "%s combined a record of another group (a message sent on an "
                              "earlier communicator that MPI gave the same context id)",
                              s->name, s->rank, fp));
        }
    }
    *done = 0;
    if (inline_data) {
        void *result = s->fused_recv.payload;
        ddp__acc_finish(c->recv, result, c->count, c->dtype, rtype, c->op, s->world);
        *done = 1;
    }
    return DDP_OK;
}

