/* MPI transport: each collective of a process group becomes one of MPI's non-blocking collectives
 * on a communicator private to the group, polled with MPI_Test on the group's progress thread
 * until it completes or the collective's deadline passes. Built only when MPI is found, as a
 * module of its own (libddp_mpi.so, which libddp loads when "mpi" is asked for, and
 * libddp_mpi.a, which a static program registers with ddp_mpi_register), so that libddp itself
 * never links MPI.
 *
 * Every collective first exchanges a fixed-size record holding its fingerprint (seq, kind, dtype,
 * op, count, root), the fingerprint's complement and a small payload: point to point up to 8
 * ranks (every rank then holds every record: a mismatch names both sides, a timeout names the
 * ranks that did not arrive), else in one MPI_Iallreduce taking the MIN of the fingerprint words
 * (MIN of ~x is ~MAX of x, so one round trip tells whether all ranks agree). The exchange is the
 * same on every rank whatever each rank called, so a disagreement can never pair mismatched MPI
 * calls; it also synchronises every rank, so a barrier (or a count of 0) needs nothing more, and
 * an allreduce small enough to ride in the payload needs nothing more either.
 *
 * f16 and bf16 are widened to f32 in a scratch buffer, reduced by MPI in f32 and rounded once at
 * the end (MPI reduces pairwise; reducing in half precision would round at every step). AVG is a
 * SUM followed by a division on every rank; i32 and u8 are widened to i64 for AVG so that the sum
 * cannot wrap before the division (u8 SUM and PROD too: see ddp__mpi_reduce_dtype).
 * docs/mpi-transport.md explains the design and its limits.
 *
 * This file runs the collectives and holds abort, destroy and the ops table; the process-wide
 * part is mpi_runtime.c, the record exchange mpi_fused.c, creation mpi_create.c. */
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
#include "ddp/mpi.h"


/* ---- collectives --------------------------------------------------------------------------- */

/* Allreduce of n elements of `dtype` (already the reduction type), in chunks MPI can count. */
static ddp_status_t allreduce_chunks(mpi_state_t *s, const ddp__collective_t *c, const void *send,
                                     void *recv, size_t n, ddp_dtype_t dtype)
{
    size_t esz = ddp_dtype_size(dtype);
    MPI_Datatype type = ddp__mpi_faulty(s, ddp__mpi_move_type(dtype));
    for (size_t off = 0; off < n; off += MPI_CHUNK) {
        size_t len = n - off < MPI_CHUNK ? n - off : MPI_CHUNK;
        const void *src = send == MPI_IN_PLACE ? MPI_IN_PLACE : (const char *)send + off * esz;
        MPI_Request req;
        ddp__mpi_enter_mpi();
        int rc = MPI_Iallreduce(src, (char *)recv + off * esz, (int)len, type, ddp__mpi_op(c->op),
                                s->comm, &req);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) return ddp__mpi_post_failed(s, rc, c, "MPI_Iallreduce");
        ddp_status_t status = ddp__mpi_wait_request(s, &req, c, "MPI_Iallreduce");
        if (status != DDP_OK) return status;
    }
    return DDP_OK;
}

static ddp_status_t run_allreduce(mpi_state_t *s, const ddp__collective_t *c)
{
    ddp_dtype_t rtype = ddp__mpi_reduce_dtype(c->dtype, c->op);
    size_t n = c->count;
    ddp_status_t status;
    if (rtype == c->dtype) {
        /* MPI requires MPI_IN_PLACE on every rank or on none, but libddp lets each rank choose
         * (a reduce built on allreduce is in place on its root only): every rank reduces in
         * place, after copying its input into recv when it is not already there. */
        if (c->send != c->recv && n) memcpy(c->recv, c->send, n * ddp_dtype_size(c->dtype));
        status = allreduce_chunks(s, c, MPI_IN_PLACE, c->recv, n, c->dtype);
        if (status == DDP_OK && c->op == DDP_AVG) ddp__divide_by(c->recv, n, c->dtype, s->world);
        return status;
    }
    void *wide = ddp__mpi_scratch(s, n * ddp_dtype_size(rtype));
    if (!wide) return ddp__mpi_break_state(s, DDP_ERR_NO_MEMORY);
    ddp__acc_widen(wide, c->send, n, c->dtype);
    status = allreduce_chunks(s, c, MPI_IN_PLACE, wide, n, rtype);
    if (status != DDP_OK) return status;
    ddp__acc_finish(c->recv, wide, n, c->dtype, rtype, c->op, s->world);
    return DDP_OK;
}

static ddp_status_t run_broadcast(mpi_state_t *s, const ddp__collective_t *c)
{
    size_t esz = ddp_dtype_size(c->dtype);
    if (s->rank == c->root && c->send && c->send != c->recv)
        memmove(c->recv, c->send, c->count * esz);
    MPI_Datatype type = ddp__mpi_faulty(s, ddp__mpi_move_type(c->dtype));
    for (size_t off = 0; off < c->count; off += MPI_CHUNK) {
        size_t len = c->count - off < MPI_CHUNK ? c->count - off : MPI_CHUNK;
        MPI_Request req;
        ddp__mpi_enter_mpi();
        int rc = MPI_Ibcast((char *)c->recv + off * esz, (int)len, type, c->root, s->comm, &req);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) return ddp__mpi_post_failed(s, rc, c, "MPI_Ibcast");
        ddp_status_t status = ddp__mpi_wait_request(s, &req, c, "MPI_Ibcast");
        if (status != DDP_OK) return status;
    }
    return DDP_OK;
}

static ddp_status_t run_reduce_scatter(mpi_state_t *s, const ddp__collective_t *c)
{
    size_t n = c->count;
    size_t total = n * (size_t)s->world;
    ddp_dtype_t rtype = ddp__mpi_reduce_dtype(c->dtype, c->op);
    size_t esz = ddp_dtype_size(c->dtype);
    size_t rsz = ddp_dtype_size(rtype);
    const char *send = c->send;
    char *recv = c->recv;
    /* MPI forbids overlapping send and receive buffers, and its MPI_IN_PLACE puts the result at
     * the start of the buffer rather than in this rank's block: an in-place call (recv inside
     * send) reduces into scratch and copies the block out. Widened types always use scratch,
     * reduced in place there. */
    int overlap = recv < send + total * esz && send < recv + n * esz;
    void *out = recv;
    const void *in = send;
    MPI_Datatype type = ddp__mpi_move_type(rtype);
    if (rtype != c->dtype) {
        void *wide = ddp__mpi_scratch(s, total * rsz);
        if (!wide) return ddp__mpi_break_state(s, DDP_ERR_NO_MEMORY);
        ddp__acc_widen(wide, send, total, c->dtype);
        in = MPI_IN_PLACE;
        out = wide;
    } else if (overlap) {
        out = ddp__mpi_scratch(s, n * esz);
        if (!out) return ddp__mpi_break_state(s, DDP_ERR_NO_MEMORY);
    }
    MPI_Request req;
    ddp__mpi_enter_mpi();
    int rc = MPI_Ireduce_scatter_block(in, out, (int)n, ddp__mpi_faulty(s, type), ddp__mpi_op(c->op), s->comm,
                                       &req);
    ddp__mpi_leave_mpi();
    if (rc != MPI_SUCCESS) return ddp__mpi_post_failed(s, rc, c, "MPI_Ireduce_scatter_block");
    ddp_status_t status = ddp__mpi_wait_request(s, &req, c, "MPI_Ireduce_scatter_block");
    if (status != DDP_OK) return status;
    ddp__acc_finish(recv, out, n, c->dtype, rtype, c->op, s->world);
    return DDP_OK;
}

static ddp_status_t run_allgather(mpi_state_t *s, const ddp__collective_t *c)
{
    size_t bytes = c->count * ddp_dtype_size(c->dtype);
    char *mine = (char *)c->recv + (size_t)s->rank * bytes;
    /* MPI_IN_PLACE takes this rank's block from its place in recv, which is exactly libddp's
     * in-place form; any other send buffer is copied there first (memmove: it may overlap). */
    if (c->send != mine) memmove(mine, c->send, bytes);
    MPI_Datatype type = ddp__mpi_faulty(s, ddp__mpi_move_type(c->dtype));
    MPI_Request req;
    ddp__mpi_enter_mpi();
    int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c->recv, (int)c->count, type,
                            s->comm, &req);
    ddp__mpi_leave_mpi();
    if (rc != MPI_SUCCESS) return ddp__mpi_post_failed(s, rc, c, "MPI_Iallgather");
    return ddp__mpi_wait_request(s, &req, c, "MPI_Iallgather");
}

static ddp_status_t validate(const mpi_state_t *s, const ddp__collective_t *c)
{
    if ((unsigned)c->kind > DDP__BARRIER)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: collective kind %d",
                          (int)c->kind);
    if (c->kind == DDP__BARRIER) return DDP_OK;
    if ((unsigned)c->dtype >= DDP_DTYPE_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: dtype %d", (int)c->dtype);
    if ((c->kind == DDP__ALLREDUCE || c->kind == DDP__REDUCE_SCATTER) &&
        (unsigned)c->op >= DDP_OP_COUNT)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: reduce op %d", (int)c->op);
    if (c->kind == DDP__BROADCAST && (c->root < 0 || c->root >= s->world))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: root %d outside 0..%d",
                          c->root, s->world - 1);
    if (c->count > 0 && (!c->recv || (!c->send && c->kind != DDP__BROADCAST)))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: %s buffer is NULL",
                          c->recv ? "send" : "recv");
    if ((c->kind == DDP__REDUCE_SCATTER || c->kind == DDP__ALLGATHER) && c->count > INT_MAX)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "MPI transport: count %zu per rank exceeds MPI's int count (%d)",
                          c->count, INT_MAX);
    return DDP_OK;
}

static ddp_status_t run_data(mpi_state_t *s, const ddp__collective_t *c)
{
    if (c->kind == DDP__BARRIER || c->count == 0) return DDP_OK;
    switch (c->kind) {
    case DDP__ALLREDUCE: return run_allreduce(s, c);
    case DDP__BROADCAST: return run_broadcast(s, c);
    case DDP__REDUCE_SCATTER: return run_reduce_scatter(s, c);
    case DDP__ALLGATHER: return run_allgather(s, c);
    default: return DDP_OK;
    }
}

/* ---- agreement ------------------------------------------------------------------------------
 * A rank that gives up (timeout, abort) sends every peer an abort notice carrying the sequence
 * number it gave up on. MPI completes a collective on one rank before others (a late rank finds
 * the others' contributions waiting; in a multi-step algorithm some ranks finish while another
 * still waits), so, as the TCP transport does (docs/tcp-transport.md, "Agreement"):
 * - a collective that moved data after the fingerprint exchange ends with a commit round, an
 *   MPI_Ibarrier polled like every request: no rank reports success before every rank finished
 *   its part, and a rank that gave up sends its notice instead;
 * - before reporting success a rank probes for a notice about this very collective (a late rank
 *   finds the notice of the rank that gave up on it). A notice about a later collective, from a
 *   peer that finished this one and failed the next, is kept for the next wait. */
static ddp_status_t commit(mpi_state_t *s, const ddp__collective_t *c)
{
    MPI_Request req;
    ddp__mpi_enter_mpi();
    int rc = MPI_Ibarrier(s->comm, &req);
    ddp__mpi_leave_mpi();
    if (rc != MPI_SUCCESS) return ddp__mpi_post_failed(s, rc, c, "MPI_Ibarrier (commit round)");
    return ddp__mpi_wait_request(s, &req, c, "commit round (MPI_Ibarrier)");
}

ddp_status_t ddp__mpi_confirm(mpi_state_t *s, const ddp__collective_t *c)
{
    int source = -1;
    ddp_status_t error = DDP_OK;
    int got = ddp__mpi_receive_notice(s, &source, &error);
    if (got < 0) return ddp__mpi_break_state(s, error);
    if (!got) return DDP_OK;
    unsigned long long seq = 0, id = 0;
    int mismatch = 0;
    const char *text = ddp__mpi_parse_notice(s, &seq, &id, &mismatch);
    if (seq != (unsigned long long)c->seq) {
        s->notice_kept = 1;
        s->notice_source = source;
        return DDP_OK;
    }
    char fp[256];
    ddp__mpi_describe(c, fp, sizeof fp);
    return ddp__mpi_break_state(s, ddp__error(DDP_ERR_REMOTE, "MPI transport, group '%s', rank %d, %s: "
                                     "rank %d gave up on it before this rank finished: %s",
                                     s->name, s->rank, fp, source, text));
}

static ddp_status_t mpi_run(void *state, const ddp__collective_t *c)
{
    mpi_state_t *s = state;
    if (!s) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: state is NULL");
    if (!c) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: collective is NULL");
    if (s->broken)
        return ddp__error(DDP_ERR_ABORTED, "MPI transport, group '%s' is broken: %s", s->name,
                          s->broken_reason);
    if (atomic_load(&s->aborted))
        return ddp__error(DDP_ERR_ABORTED, "MPI transport, group '%s': aborted: %s", s->name,
                          s->abort_reason);
    atomic_store(&s->current_seq, c->seq);
    ddp_status_t status = validate(s, c);
    if (status != DDP_OK) return status;
    if (s->world == 1) return run_data(s, c);
    int done = 0;
    status = ddp__mpi_exchange_fingerprint(s, c, &done);
    if (status != DDP_OK) return status;
    /* The fingerprint exchange synchronised every rank: a barrier, an empty collective or one
     * whose data rode in the exchange is done, and was one all-to-all step. */
    if (!done && c->kind != DDP__BARRIER && c->count != 0) {
        status = run_data(s, c);
        if (status == DDP_OK) status = commit(s, c);
        if (status != DDP_OK) return status;
    }
    return ddp__mpi_confirm(s, c);
}

/* ---- abort and destroy --------------------------------------------------------------------- */

static void mpi_abort(void *state, const char *reason)
{
    mpi_state_t *s = state;
    if (!s) return;
    /* The first caller wins; the reason is complete before `aborted` lets anyone read it. */
    if (atomic_exchange(&s->abort_claimed, 1)) return;
    snprintf(s->abort_reason, sizeof s->abort_reason, "%s", reason ? reason : "(no reason)");
    atomic_store(&s->aborted, 1);
    /* Tell every peer, without waiting: they probe for the notice while they poll. An abort that
     * follows a mismatch says so with its sequence number (see ddp__mpi_check_abort_notice). Under
     * MPI_THREAD_SERIALIZED the call lock keeps this off the progress thread's MPI calls. */
    if (atomic_load(&s->broken_status) == (int)DDP_ERR_MISMATCH)
        snprintf(s->abort_wire, sizeof s->abort_wire, MISMATCH_MARK "%llu" GROUP_MARK "%llx\n%s",
                 (unsigned long long)atomic_load(&s->current_seq),
                 (unsigned long long)s->notice_id, s->abort_reason);
    else
        snprintf(s->abort_wire, sizeof s->abort_wire, FAILED_MARK "%llu" GROUP_MARK "%llx\n%s",
                 (unsigned long long)atomic_load(&s->current_seq),
                 (unsigned long long)s->notice_id, s->abort_reason);
    int len = (int)strlen(s->abort_wire) + 1;
    ddp__mpi_enter_mpi();
    for (int r = 0; r < s->world && s->nabort_sends < 64; r++) {
        if (r == s->rank) continue;
        MPI_Request req;
        if (MPI_Isend(s->abort_wire, len, MPI_CHAR, r, ABORT_TAG, s->comm, &req) == MPI_SUCCESS)
            s->abort_sends[s->nabort_sends++] = req;
    }
    ddp__mpi_leave_mpi();
}

void ddp__mpi_destroy(void *state)
{
    mpi_state_t *s = state;
    if (!s) return;
    ddp__mpi_enter_mpi();
    /* Requests given up at a timeout may have completed since (a late rank came). */
    int pending = 0;
    for (int i = 0; i < s->nabandoned; i++) {
        int done = 0;
        if (MPI_Test(&s->abandoned[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)
            pending++;
    }
    for (int i = 0; s->xreqs && i < 2 * s->world; i++) {
        int done = 0;
        if (s->xreqs[i] == MPI_REQUEST_NULL) continue;
        if (MPI_Test(&s->xreqs[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) pending++;
    }
    /* Abort notices nobody received: cancel them so the communicator can go. */
    for (int i = 0; i < s->nabort_sends; i++) {
        int done = 0;
        MPI_Test(&s->abort_sends[i], &done, MPI_STATUS_IGNORE);
        if (!done) {
            MPI_Cancel(&s->abort_sends[i]);
            MPI_Request_free(&s->abort_sends[i]);
        }
    }
    /* A state that failed or was aborted keeps its communicator for the rest of the process.
     * Its peers may still send on it: a late rank's fingerprint record, the fragments of a data
     * collective it entered, an abort notice. Open MPI (ob1) parks a message for a context id
     * with no communicator and hands it to the next communicator created with that id, and it
     * reuses the id of a freed communicator for the next one made over the same processes: a
     * late rank's record of a destroyed group then completed the next group's exchange
     * (test_mpi_agreement late, 3 ranks: ranks 0 and 1 returned DDP_OK and the late rank's
     * data while it was still held elsewhere), and stray fragments could complete its data
     * collectives. A kept communicator holds its context id, so the next group gets another
     * one and the stray messages land here, where nothing receives them. A healthy state has
     * received every message its peers sent on it (each exchange receives one record from
     * every peer, and data collectives end in a commit round), so it frees its communicator;
     * an abort notice that reaches a reused id is dropped by its group id (ddp__mpi_receive_notice),
     * a record by its group id (ddp__mpi_exchange_p2p). */
    int keep = s->broken || atomic_load(&s->aborted);
    if (!pending && !keep && s->comm != MPI_COMM_NULL) MPI_Comm_free(&s->comm);
    ddp__mpi_leave_mpi();
    pthread_mutex_lock(&ddp__mpi_init_lock);
    ddp__mpi_live_states--;
    ddp__mpi_leaked_requests += pending;
    if (keep && !pending) ddp__mpi_kept_comms++;
    int kept = ddp__mpi_kept_comms;
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    if (keep && !pending)
        DDP_LOG(DDP_LOG_DEBUG, "MPI transport, group '%s': keeping its communicator after a "
                "failure (%d kept in this process)", s->name, kept);
    if (pending) {
        /* MPI may still write into the state's fingerprint buffers: leave them allocated. */
        return;
    }
    free(s->scratch);
    free(s->records);
    free(s->xreqs);
    free(s->last_seq);
    free(s);
}

void ddp__mpi_inject_fault(void *state)
{
    mpi_state_t *s = state;
    if (s) s->inject_fault = 1;
}

/* The bootstrap of ddp_group_create_from_env under mpirun: rank 0's store address to every
 * rank, one MPI_Ibcast over MPI_COMM_WORLD (initialising MPI if the program did not), waited
 * for at most timeout_ms, so a rank that never arrives (it failed before the rendezvous) is a
 * timeout on the others, not a hang. */
static ddp_status_t mpi_bootstrap_bcast(void *buf, size_t len, int timeout_ms, int *rank,
                                        int *world)
{
    if (len > INT_MAX)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI bootstrap: %zu bytes is too many", len);
    ddp_status_t s = ddp__mpi_ensure_mpi();
    if (s != DDP_OK) return s;
    MPI_Request req = MPI_REQUEST_NULL;
    ddp__mpi_enter_mpi();
    int rc = MPI_Comm_rank(MPI_COMM_WORLD, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(MPI_COMM_WORLD, world);
    if (rc == MPI_SUCCESS) rc = MPI_Ibcast(buf, (int)len, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    ddp__mpi_leave_mpi();
    if (rc != MPI_SUCCESS) return ddp__mpi_error(rc, "MPI bootstrap: MPI_Ibcast");
    return ddp__mpi_wait_setup(&req, timeout_ms, "MPI bootstrap: the broadcast of rank 0's store address");
}

static const ddp__bootstrap_ops_t mpi_bootstrap = {
    .bcast = mpi_bootstrap_bcast,
};

/* Exported from libddp_mpi.so: src/transport/registry.c finds the table by this name. */
DDP_MODULE_API const ddp__transport_ops_t ddp__transport_mpi = {
    .name = "mpi",
    .create = ddp__mpi_create,
    .run = mpi_run,
    .alloc_buffer = NULL,
    .free_buffer = NULL,
    .abort = mpi_abort,
    .destroy = ddp__mpi_destroy,
    .split = ddp__mpi_split,
    .storeless = 1,
    .multi_host = 1,
    .bootstrap = &mpi_bootstrap,
};

ddp_status_t ddp_mpi_register(void)
{
    return ddp__transport_register(&ddp__transport_mpi);
}

