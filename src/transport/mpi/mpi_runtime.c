/* The MPI transport's process-wide part: initialising MPI once (or adopting the program's), the
 * lock that serialises calls under MPI_THREAD_SERIALIZED, MPI errors as ddp statuses, waiting on
 * requests against a deadline while watching for abort notices, and the MPI types and ops of
 * ddp's dtypes (mpi_private.h). */
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

/* ---- process-wide MPI initialisation ---------------------------------------------------- */

/* Up to this world size the fingerprint records go point to point (see ddp__mpi_exchange_p2p). */
int ddp__mpi_p2p_max_world = 8;

pthread_mutex_t ddp__mpi_init_lock = PTHREAD_MUTEX_INITIALIZER;
int ddp__mpi_provided_level = -1;
static int we_initialized;     /* we called MPI_Init_thread, so we finalise at exit */
int ddp__mpi_live_states;        /* groups not yet destroyed */
int ddp__mpi_leaked_requests;    /* requests abandoned at a timeout that MPI never completed */
int ddp__mpi_kept_comms;         /* communicators of failed groups, never freed (see destroy) */

/* Under MPI_THREAD_SERIALIZED two groups' progress threads must not be inside MPI together. */
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static int serialize_calls;

void ddp__mpi_enter_mpi(void)
{
    if (serialize_calls) pthread_mutex_lock(&call_lock);
}

void ddp__mpi_leave_mpi(void)
{
    if (serialize_calls) pthread_mutex_unlock(&call_lock);
}

const char *ddp__mpi_thread_level_name(int level)
{
    switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown thread level";
    }
}

static void finalize_at_exit(void)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    pthread_mutex_lock(&ddp__mpi_init_lock);
    /* A group still alive may have its progress thread inside MPI: skip finalising then (mpirun
     * will report the process as having exited without MPI_Finalize). Requests abandoned at a
     * timeout do not stop OpenMPI's MPI_Finalize, which only waits for every process to call it
     * (checked by test_mpi_transport's timeout and abort cases). */
    int safe = we_initialized && !finalized && ddp__mpi_live_states == 0;
    int leaked = ddp__mpi_leaked_requests;
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    if (!safe) return;
    if (leaked)
        DDP_LOG(DDP_LOG_DEBUG, "MPI transport: finalising MPI with %d abandoned requests", leaked);
    MPI_Finalize();
}

ddp_status_t ddp__mpi_ensure_mpi(void)
{
    ddp_status_t status = DDP_OK;
    pthread_mutex_lock(&ddp__mpi_init_lock);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
        status = ddp__error(DDP_ERR_INVALID_USAGE,
                            "MPI transport: MPI has already been finalised in this process");
        goto out;
    }
    if (!initialized) {
        int provided = MPI_THREAD_SINGLE;
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) {
            status = ddp__mpi_error(rc, "MPI transport: MPI_Init_thread");
            goto out;
        }
        we_initialized = 1;
        atexit(finalize_at_exit);
    }
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_SERIALIZED) {
        status = ddp__error(DDP_ERR_UNSUPPORTED,
                            "MPI transport: MPI runs with %s, but the group's progress thread "
                            "calls MPI: initialise MPI with MPI_Init_thread(..., "
                            "MPI_THREAD_MULTIPLE, ...) (or MPI_THREAD_SERIALIZED)",
                            ddp__mpi_thread_level_name(level));
        goto out;
    }
    ddp__mpi_provided_level = level;
    serialize_calls = level < MPI_THREAD_MULTIPLE;
out:
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    return status;
}

int ddp__mpi_thread_level(void)
{
    pthread_mutex_lock(&ddp__mpi_init_lock);
    int level = ddp__mpi_provided_level;
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    return level;
}

/* ---- errors ------------------------------------------------------------------------------ */

static const char *error_class_name(int cls)
{
    switch (cls) {
    case MPI_ERR_BUFFER: return "MPI_ERR_BUFFER";
    case MPI_ERR_COUNT: return "MPI_ERR_COUNT";
    case MPI_ERR_TYPE: return "MPI_ERR_TYPE";
    case MPI_ERR_TAG: return "MPI_ERR_TAG";
    case MPI_ERR_COMM: return "MPI_ERR_COMM";
    case MPI_ERR_RANK: return "MPI_ERR_RANK";
    case MPI_ERR_ROOT: return "MPI_ERR_ROOT";
    case MPI_ERR_GROUP: return "MPI_ERR_GROUP";
    case MPI_ERR_OP: return "MPI_ERR_OP";
    case MPI_ERR_ARG: return "MPI_ERR_ARG";
    case MPI_ERR_REQUEST: return "MPI_ERR_REQUEST";
    case MPI_ERR_TRUNCATE: return "MPI_ERR_TRUNCATE";
    case MPI_ERR_NO_MEM: return "MPI_ERR_NO_MEM";
    case MPI_ERR_INTERN: return "MPI_ERR_INTERN";
    case MPI_ERR_OTHER: return "MPI_ERR_OTHER";
    case MPI_ERR_UNSUPPORTED_OPERATION: return "MPI_ERR_UNSUPPORTED_OPERATION";
    case MPI_ERR_UNSUPPORTED_DATAREP: return "MPI_ERR_UNSUPPORTED_DATAREP";
    default: return "MPI error";
    }
}

ddp_status_t ddp__mpi_error(int mpi_code, const char *what)
{
    char text[MPI_MAX_ERROR_STRING + 1] = "";
    int len = 0;
    int cls = MPI_ERR_OTHER;
    if (MPI_Error_class(mpi_code, &cls) != MPI_SUCCESS) cls = MPI_ERR_OTHER;
    if (MPI_Error_string(mpi_code, text, &len) != MPI_SUCCESS) {
        snprintf(text, sizeof text, "error code %d", mpi_code);
    } else {
        text[len < 0 ? 0 : (len > MPI_MAX_ERROR_STRING ? MPI_MAX_ERROR_STRING : len)] = '\0';
    }
    ddp_status_t status;
    switch (cls) {
    case MPI_ERR_TRUNCATE: status = DDP_ERR_MISMATCH; break;
    case MPI_ERR_NO_MEM: status = DDP_ERR_NO_MEMORY; break;
    case MPI_ERR_UNSUPPORTED_OPERATION:
    case MPI_ERR_UNSUPPORTED_DATAREP: status = DDP_ERR_UNSUPPORTED; break;
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_TAG:
    case MPI_ERR_COMM:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_GROUP:
    case MPI_ERR_OP:
    case MPI_ERR_ARG: status = DDP_ERR_INVALID_ARGUMENT; break;
    default: status = DDP_ERR_SYSTEM; break;
    }
    const char *cls_name = error_class_name(cls);
    if (strncmp(text, cls_name, strlen(cls_name)) == 0) /* OpenMPI's text starts with it */
        return ddp__error(status, "%s: %s", what ? what : "MPI", text);
    return ddp__error(status, "%s: %s: %s", what ? what : "MPI", cls_name, text);
}

/* Marks the state unusable, keeping the current error text as the reason, and returns status. */
ddp_status_t ddp__mpi_break_state(mpi_state_t *s, ddp_status_t status)
{
    if (!s->broken) {
        s->broken = 1;
        atomic_store(&s->broken_status, (int)status);
        snprintf(s->broken_reason, sizeof s->broken_reason, "%s", ddp_last_error());
    }
    return status;
}

void ddp__mpi_describe(const ddp__collective_t *c, char *buf, size_t size)
{
    ddp__fingerprint_describe(c, buf, size);
}

ddp_status_t ddp__mpi_post_failed(mpi_state_t *s, int rc, const ddp__collective_t *c,
                                const char *call)
{
    char fp[256], what[512];
    ddp__mpi_describe(c, fp, sizeof fp);
    snprintf(what, sizeof what, "MPI transport, group '%s', rank %d: %s for %s", s->name,
             s->rank, call, fp);
    return ddp__mpi_break_state(s, ddp__mpi_error(rc, what));
}

MPI_Datatype ddp__mpi_faulty(mpi_state_t *s, MPI_Datatype type)
{
    if (!s->inject_fault) return type;
    s->inject_fault = 0;
    return MPI_DATATYPE_NULL;
}

/* ---- waiting ----------------------------------------------------------------------------- */

/* The reason of the notice in s->abort_notice, past its marks; its sequence number in *seq, its
 * group's notice id in *id, and whether it follows a mismatch in *mismatch. */
const char *ddp__mpi_parse_notice(mpi_state_t *s, unsigned long long *seq, unsigned long long *id,
                                int *mismatch)
{
    const char *text = s->abort_notice;
    int skip = 0;
    *seq = 0;
    *id = 0;
    *mismatch = 0;
    if (sscanf(text, MISMATCH_MARK "%llu" GROUP_MARK "%llx%n", seq, id, &skip) == 2) *mismatch = 1;
    else if (sscanf(text, FAILED_MARK "%llu" GROUP_MARK "%llx%n", seq, id, &skip) != 2) skip = 0;
    text += skip;
    if (*text == '\n') text++;
    return text;
}

/* Receives a pending abort notice of this group into s->abort_notice (or takes the one ddp__mpi_confirm
 * kept): 1 and its sender in *source, 0 when there is none, <0 on an MPI error (status in
 * *error). Notices of an earlier group that had this communicator's context id are dropped. */
int ddp__mpi_receive_notice(mpi_state_t *s, int *source, ddp_status_t *error)
{
    if (s->notice_kept) {
        s->notice_kept = 0;
        *source = s->notice_source;
        return 1;
    }
    for (;;) {
        int flag = 0;
        MPI_Status st;
        ddp__mpi_enter_mpi();
        int rc = MPI_Iprobe(MPI_ANY_SOURCE, ABORT_TAG, s->comm, &flag, &st);
        if (rc == MPI_SUCCESS && flag) {
            int len = 0;
            MPI_Get_count(&st, MPI_CHAR, &len);
            if (len < 0 || len >= ABORT_TEXT_MAX) len = ABORT_TEXT_MAX - 1;
            rc = MPI_Recv(s->abort_notice, ABORT_TEXT_MAX, MPI_CHAR, st.MPI_SOURCE, ABORT_TAG,
                          s->comm, MPI_STATUS_IGNORE);
            s->abort_notice[len] = '\0';
        }
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) {
            *error = ddp__mpi_error(rc, "MPI transport: receiving an abort notice");
            return -1;
        }
        if (!flag) return 0;
        unsigned long long seq = 0, id = 0;
        int mismatch = 0;
        ddp__mpi_parse_notice(s, &seq, &id, &mismatch);
        if (id != s->notice_id) {
            DDP_LOG(DDP_LOG_DEBUG, "MPI transport, group '%s': dropped a notice of an earlier "
                    "group from rank %d", s->name, st.MPI_SOURCE);
            continue;
        }
        *source = st.MPI_SOURCE;
        return 1;
    }
}

/* Receives a pending abort notice from a peer, if any: DDP_ERR_REMOTE naming it, else DDP_OK. */
ddp_status_t ddp__mpi_check_abort_notice(mpi_state_t *s)
{
    int source = -1;
    ddp_status_t error = DDP_OK;
    int got = ddp__mpi_receive_notice(s, &source, &error);
    if (got < 0) return error;
    if (!got) return DDP_OK;
    unsigned long long seq = 0, id = 0;
    int mismatch = 0;
    const char *text = ddp__mpi_parse_notice(s, &seq, &id, &mismatch);
    /* The peer found a mismatch in the exchange we are in: every record (or contribution)
     * reached it, so ours will complete too and name the mismatch itself. Keep waiting, so
     * that every rank reports DDP_ERR_MISMATCH rather than some DDP_ERR_REMOTE. */
    if (mismatch && seq == (unsigned long long)atomic_load(&s->current_seq)) {
        DDP_LOG(DDP_LOG_DEBUG, "MPI transport, group '%s': rank %d saw the mismatch at seq %llu "
                "first", s->name, source, seq);
        return DDP_OK;
    }
    return ddp__error(DDP_ERR_REMOTE, "MPI transport, group '%s': rank %d aborted the group: %s",
                      s->name, source, text);
}

/* Polls the n requests until all complete, the deadline passes, this group is aborted or a
 * peer's abort notice arrives. `step` names what they are for in error texts. On failure the
 * requests still pending stay in reqs (MPI cannot cancel a collective) and the state is broken. */
ddp_status_t ddp__mpi_wait_requests(mpi_state_t *s, int n, MPI_Request *reqs,
                                  const ddp__collective_t *c, const char *step)
{
    char fp[256];
    for (unsigned long spins = 1;; spins++) {
        int done = 0;
        ddp__mpi_enter_mpi();
        int rc = n == 1 ? MPI_Test(reqs, &done, MPI_STATUS_IGNORE)
                        : MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) {
            ddp__mpi_describe(c, fp, sizeof fp);
            char what[512];
            snprintf(what, sizeof what, "MPI transport, group '%s', rank %d: %s of %s", s->name,
                     s->rank, step, fp);
            return ddp__mpi_break_state(s, ddp__mpi_error(rc, what));
        }
        if (done) return DDP_OK;
        if (spins % PROBE_EVERY == 0) {
            ddp_status_t status = DDP_OK;
            if (atomic_load(&s->aborted)) {
                status = ddp__error(DDP_ERR_ABORTED, "MPI transport, group '%s': aborted: %s",
                                    s->name, s->abort_reason);
            } else if (ddp__now_ns() > c->deadline_ns) {
                ddp__mpi_describe(c, fp, sizeof fp);
                status = ddp__error(
                    DDP_ERR_TIMEOUT,
                    "MPI transport, group '%s': rank %d timed out in the %s of %s: at least one "
                    "of the other %d ranks has not reached seq %llu (MPI cannot say which)",
                    s->name, s->rank, step, fp, s->world - 1, (unsigned long long)c->seq);
            } else {
                status = ddp__mpi_check_abort_notice(s);
            }
            if (status != DDP_OK) return ddp__mpi_break_state(s, status);
        }
        if (spins > YIELD_AFTER) sched_yield();
    }
}

/* One request; on failure it is kept so that destroy can see whether it ever completed. */
ddp_status_t ddp__mpi_wait_request(mpi_state_t *s, MPI_Request *req, const ddp__collective_t *c,
                                 const char *step)
{
    ddp_status_t status = ddp__mpi_wait_requests(s, 1, req, c, step);
    if (status != DDP_OK && *req != MPI_REQUEST_NULL &&
        s->nabandoned < (int)(sizeof s->abandoned / sizeof s->abandoned[0]))
        s->abandoned[s->nabandoned++] = *req;
    return status;
}

/* ---- types ------------------------------------------------------------------------------- */

/* The MPI type for moving (not reducing) elements of `dtype`. */
MPI_Datatype ddp__mpi_move_type(ddp_dtype_t dtype)
{
    switch (dtype) {
    case DDP_F32: return MPI_FLOAT;
    case DDP_F64: return MPI_DOUBLE;
    case DDP_F16:
    case DDP_BF16: return MPI_UINT16_T;
    case DDP_I32: return MPI_INT32_T;
    case DDP_I64: return MPI_INT64_T;
    case DDP_U8: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
    }
}

MPI_Op ddp__mpi_op(ddp_reduce_op_t op)
{
    switch (op) {
    case DDP_SUM:
    case DDP_AVG: return MPI_SUM;
    case DDP_MIN: return MPI_MIN;
    case DDP_MAX: return MPI_MAX;
    case DDP_PROD: return MPI_PROD;
    default: return MPI_OP_NULL;
    }
}

/* The type a reduction runs in: core's accumulation type (ddp__acc_dtype: f32 for f16/bf16, i64
 * for an AVG of i32/u8), and for MPI also i64 for u8 SUM and PROD, which wrap when narrowed back:
 * OpenMPI 4.1's AVX op component adds MPI_UINT8_T with unsigned saturation (200 + 100 gives 255,
 * not 44), which test_mpi_transport caught. */
ddp_dtype_t ddp__mpi_reduce_dtype(ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    if (dtype == DDP_U8 && (op == DDP_SUM || op == DDP_PROD)) return DDP_I64;
    return ddp__acc_dtype(dtype, op);
}

void *ddp__mpi_scratch(mpi_state_t *s, size_t bytes)
{
    if (bytes <= s->scratch_bytes) return s->scratch;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
        ddp__error(DDP_ERR_NO_MEMORY, "MPI transport: %zu bytes of ddp__mpi_scratch", bytes);
        return NULL;
    }
    free(s->scratch);
    s->scratch = p;
    s->scratch_bytes = bytes;
    return p;
}

