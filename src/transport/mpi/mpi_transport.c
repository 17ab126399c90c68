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
 * cannot wrap before the division (u8 SUM and PROD too: see reduce_dtype).
 * docs/mpi-transport.md explains the design and its limits. */
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
#include "transport/transport.h"
#include "transport/mpi/mpi_internal.h"
#include "ddp/mpi.h"

enum {
    /* transport.h's ddp__fingerprint_t as 64-bit words (seq first), reduced by MIN */
    FP_FIELDS = sizeof(ddp__fingerprint_t) / sizeof(int64_t),
    ABORT_TAG = 0xdd0,   /* point-to-point tag of abort notices on the group's communicator */
    ABORT_TEXT_MAX = 512,
    EXCHANGE_TAG = 0xdd1, /* point-to-point tag of fingerprint records */
    PROBE_EVERY = 64,    /* MPI_Test calls between deadline and abort-notice checks */
    YIELD_AFTER = 256,   /* MPI_Test calls after which the poller yields the core each time */
};

/* Starts an abort notice sent after a mismatch, followed by the sequence number and "\n". */
#define MISMATCH_MARK "\001mismatch at seq "
/* Starts every other abort notice: the sequence number of the collective the sender gave up on
 * (0: between collectives), then "\n" and the reason (see confirm). */
#define FAILED_MARK "\002failed at seq "
/* Follows either mark's sequence number: the group's notice id (see adopt_comm). */
#define GROUP_MARK " group "

/* The record every collective starts with: fingerprint, its complement, a small payload. */
enum { INLINE_BYTES = 512 };
typedef struct fused_record {
    int64_t fp[2 * FP_FIELDS];
    /* The sending group's notice id and its complement (reduced by MIN like fp): a record of
     * another group that reached this group's communicator is told apart (see exchange_p2p). */
    int64_t group[2];
    _Alignas(8) unsigned char payload[INLINE_BYTES];
} fused_record_t;

/* Largest element count handed to one MPI call (MPI counts are int). */
#define MPI_CHUNK ((size_t)1 << 30)

typedef struct mpi_state {
    MPI_Comm comm;
    int rank;
    int world;
    char name[128];

    /* The exchanged records live here, not on the stack: after a timeout MPI still owns them. */
    fused_record_t fused_send;
    fused_record_t fused_recv;

    void *scratch; /* f32/i64 widening buffer, grown on demand */
    size_t scratch_bytes;

    /* The point-to-point exchange (world <= ddp__mpi_p2p_max_world): every rank's record, the
     * requests (receives first, then sends; MPI_REQUEST_NULL when done) and the last sequence
     * number received from each rank, which names how far a missing rank got. */
    fused_record_t *records;
    MPI_Request *xreqs;
    uint64_t *last_seq;

    /* Requests given up at a timeout; tested again at destroy. */
    MPI_Request abandoned[4];
    int nabandoned;

    /* Set after a timeout or failure: later collectives return DDP_ERR_ABORTED with this text.
     * broken_status and current_seq are also read by abort(), possibly from another thread. */
    int broken;
    _Atomic int broken_status;
    _Atomic uint64_t current_seq;
    char broken_reason[DDP_ERROR_TEXT_MAX];

    /* abort(): may be called from another thread while the progress thread polls. */
    _Atomic int abort_claimed;
    _Atomic int aborted;
    char abort_reason[ABORT_TEXT_MAX];
    char abort_wire[ABORT_TEXT_MAX]; /* the notice as sent: reason, maybe behind a mismatch mark */
    MPI_Request abort_sends[64]; /* notices go to the first 64 peers only */
    int nabort_sends;
    char abort_notice[ABORT_TEXT_MAX];
    /* Agreed by the group's ranks at creation and carried by its abort notices: Open MPI reuses
     * a freed communicator's context id, so a notice sent on a group that one rank had already
     * destroyed can arrive on a later group's communicator (seen in test_mpi_agreement late). */
    uint64_t notice_id;
    int timeout_ms; /* the group's: bounds the creation of its subgroups */
    int notice_kept;   /* abort_notice holds a notice received early by confirm (see there) */
    int notice_source; /* its sender */

    int inject_fault;
} mpi_state_t;

/* ---- process-wide MPI initialisation ---------------------------------------------------- */

static ddp_status_t ensure_fused(void);

/* Up to this world size the fingerprint records go point to point (see exchange_p2p). */
int ddp__mpi_p2p_max_world = 8;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static int thread_level = -1;
static int we_initialized;     /* we called MPI_Init_thread, so we finalise at exit */
static int live_states;        /* groups not yet destroyed */
static int leaked_requests;    /* requests abandoned at a timeout that MPI never completed */
static int kept_comms;         /* communicators of failed groups, never freed (see destroy) */

/* Under MPI_THREAD_SERIALIZED two groups' progress threads must not be inside MPI together. */
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static int serialize_calls;

static void enter_mpi(void)
{
    if (serialize_calls) pthread_mutex_lock(&call_lock);
}

static void leave_mpi(void)
{
    if (serialize_calls) pthread_mutex_unlock(&call_lock);
}

static const char *thread_level_name(int level)
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
    pthread_mutex_lock(&init_lock);
    /* A group still alive may have its progress thread inside MPI: skip finalising then (mpirun
     * will report the process as having exited without MPI_Finalize). Requests abandoned at a
     * timeout do not stop OpenMPI's MPI_Finalize, which only waits for every process to call it
     * (checked by test_mpi_transport's timeout and abort cases). */
    int safe = we_initialized && !finalized && live_states == 0;
    int leaked = leaked_requests;
    pthread_mutex_unlock(&init_lock);
    if (!safe) return;
    if (leaked)
        DDP_LOG(DDP_LOG_DEBUG, "MPI transport: finalising MPI with %d abandoned requests", leaked);
    MPI_Finalize();
}

static ddp_status_t ensure_mpi(void)
{
    ddp_status_t status = DDP_OK;
    pthread_mutex_lock(&init_lock);
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
                            thread_level_name(level));
        goto out;
    }
    thread_level = level;
    serialize_calls = level < MPI_THREAD_MULTIPLE;
    status = ensure_fused();
out:
    pthread_mutex_unlock(&init_lock);
    return status;
}

int ddp__mpi_thread_level(void)
{
    pthread_mutex_lock(&init_lock);
    int level = thread_level;
    pthread_mutex_unlock(&init_lock);
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
static ddp_status_t break_state(mpi_state_t *s, ddp_status_t status)
{
    if (!s->broken) {
        s->broken = 1;
        atomic_store(&s->broken_status, (int)status);
        snprintf(s->broken_reason, sizeof s->broken_reason, "%s", ddp_last_error());
    }
    return status;
}

static void describe(const ddp__collective_t *c, char *buf, size_t size)
{
    ddp__fingerprint_describe(c, buf, size);
}

static ddp_status_t post_failed(mpi_state_t *s, int rc, const ddp__collective_t *c,
                                const char *call)
{
    char fp[256], what[512];
    describe(c, fp, sizeof fp);
    snprintf(what, sizeof what, "MPI transport, group '%s', rank %d: %s for %s", s->name,
             s->rank, call, fp);
    return break_state(s, ddp__mpi_error(rc, what));
}

static MPI_Datatype faulty(mpi_state_t *s, MPI_Datatype type)
{
    if (!s->inject_fault) return type;
    s->inject_fault = 0;
    return MPI_DATATYPE_NULL;
}

/* ---- waiting ----------------------------------------------------------------------------- */

/* The reason of the notice in s->abort_notice, past its marks; its sequence number in *seq, its
 * group's notice id in *id, and whether it follows a mismatch in *mismatch. */
static const char *parse_notice(mpi_state_t *s, unsigned long long *seq, unsigned long long *id,
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

/* Receives a pending abort notice of this group into s->abort_notice (or takes the one confirm
 * kept): 1 and its sender in *source, 0 when there is none, <0 on an MPI error (status in
 * *error). Notices of an earlier group that had this communicator's context id are dropped. */
static int receive_notice(mpi_state_t *s, int *source, ddp_status_t *error)
{
    if (s->notice_kept) {
        s->notice_kept = 0;
        *source = s->notice_source;
        return 1;
    }
    for (;;) {
        int flag = 0;
        MPI_Status st;
        enter_mpi();
        int rc = MPI_Iprobe(MPI_ANY_SOURCE, ABORT_TAG, s->comm, &flag, &st);
        if (rc == MPI_SUCCESS && flag) {
            int len = 0;
            MPI_Get_count(&st, MPI_CHAR, &len);
            if (len < 0 || len >= ABORT_TEXT_MAX) len = ABORT_TEXT_MAX - 1;
            rc = MPI_Recv(s->abort_notice, ABORT_TEXT_MAX, MPI_CHAR, st.MPI_SOURCE, ABORT_TAG,
                          s->comm, MPI_STATUS_IGNORE);
            s->abort_notice[len] = '\0';
        }
        leave_mpi();
        if (rc != MPI_SUCCESS) {
            *error = ddp__mpi_error(rc, "MPI transport: receiving an abort notice");
            return -1;
        }
        if (!flag) return 0;
        unsigned long long seq = 0, id = 0;
        int mismatch = 0;
        parse_notice(s, &seq, &id, &mismatch);
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
static ddp_status_t check_abort_notice(mpi_state_t *s)
{
    int source = -1;
    ddp_status_t error = DDP_OK;
    int got = receive_notice(s, &source, &error);
    if (got < 0) return error;
    if (!got) return DDP_OK;
    unsigned long long seq = 0, id = 0;
    int mismatch = 0;
    const char *text = parse_notice(s, &seq, &id, &mismatch);
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
static ddp_status_t wait_requests(mpi_state_t *s, int n, MPI_Request *reqs,
                                  const ddp__collective_t *c, const char *step)
{
    char fp[256];
    for (unsigned long spins = 1;; spins++) {
        int done = 0;
        enter_mpi();
        int rc = n == 1 ? MPI_Test(reqs, &done, MPI_STATUS_IGNORE)
                        : MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
        leave_mpi();
        if (rc != MPI_SUCCESS) {
            describe(c, fp, sizeof fp);
            char what[512];
            snprintf(what, sizeof what, "MPI transport, group '%s', rank %d: %s of %s", s->name,
                     s->rank, step, fp);
            return break_state(s, ddp__mpi_error(rc, what));
        }
        if (done) return DDP_OK;
        if (spins % PROBE_EVERY == 0) {
            ddp_status_t status = DDP_OK;
            if (atomic_load(&s->aborted)) {
                status = ddp__error(DDP_ERR_ABORTED, "MPI transport, group '%s': aborted: %s",
                                    s->name, s->abort_reason);
            } else if (ddp__now_ns() > c->deadline_ns) {
                describe(c, fp, sizeof fp);
                status = ddp__error(
                    DDP_ERR_TIMEOUT,
                    "MPI transport, group '%s': rank %d timed out in the %s of %s: at least one "
                    "of the other %d ranks has not reached seq %llu (MPI cannot say which)",
                    s->name, s->rank, step, fp, s->world - 1, (unsigned long long)c->seq);
            } else {
                status = check_abort_notice(s);
            }
            if (status != DDP_OK) return break_state(s, status);
        }
        if (spins > YIELD_AFTER) sched_yield();
    }
}

/* One request; on failure it is kept so that destroy can see whether it ever completed. */
static ddp_status_t wait_request(mpi_state_t *s, MPI_Request *req, const ddp__collective_t *c,
                                 const char *step)
{
    ddp_status_t status = wait_requests(s, 1, req, c, step);
    if (status != DDP_OK && *req != MPI_REQUEST_NULL &&
        s->nabandoned < (int)(sizeof s->abandoned / sizeof s->abandoned[0]))
        s->abandoned[s->nabandoned++] = *req;
    return status;
}

/* ---- types ------------------------------------------------------------------------------- */

/* The MPI type for moving (not reducing) elements of `dtype`. */
static MPI_Datatype move_type(ddp_dtype_t dtype)
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

static MPI_Op mpi_op(ddp_reduce_op_t op)
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
static ddp_dtype_t reduce_dtype(ddp_dtype_t dtype, ddp_reduce_op_t op)
{
    if (dtype == DDP_U8 && (op == DDP_SUM || op == DDP_PROD)) return DDP_I64;
    return ddp__acc_dtype(dtype, op);
}

static void *scratch(mpi_state_t *s, size_t bytes)
{
    if (bytes <= s->scratch_bytes) return s->scratch;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
        ddp__error(DDP_ERR_NO_MEMORY, "MPI transport: %zu bytes of scratch", bytes);
        return NULL;
    }
    free(s->scratch);
    s->scratch = p;
    s->scratch_bytes = bytes;
    return p;
}

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
    if (!all) return break_state(s, DDP_ERR_NO_MEMORY);
    MPI_Request req;
    enter_mpi();
    int rc = MPI_Iallgather(mine, FP_FIELDS, MPI_INT64_T, all, FP_FIELDS, MPI_INT64_T, s->comm,
                            &req);
    leave_mpi();
    ddp_status_t status;
    if (rc != MPI_SUCCESS) {
        status = break_state(s, ddp__mpi_error(rc, "MPI transport: gathering fingerprints"));
    } else {
        status = wait_request(s, &req, c, "fingerprint gather");
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
    return break_state(s, status);
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
    ddp_dtype_t rtype = reduce_dtype((ddp_dtype_t)f->dtype, (ddp_reduce_op_t)f->op);
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
            switch (reduce_dtype((ddp_dtype_t)f.dtype, op)) {
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
static ddp_status_t ensure_fused(void)
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
static ddp_status_t exchange_p2p(mpi_state_t *s, const ddp__collective_t *c)
{
    int n = 0;
    size_t bytes = sizeof(fused_record_t);
    enter_mpi();
    int rc = MPI_SUCCESS;
    for (int q = 0; q < s->world && rc == MPI_SUCCESS; q++) {
        if (q == s->rank) continue;
        rc = MPI_Irecv(&s->records[q], (int)bytes, MPI_BYTE, q, EXCHANGE_TAG, s->comm,
                       &s->xreqs[n]);
        if (rc == MPI_SUCCESS) n++;
    }
    MPI_Datatype type = faulty(s, MPI_BYTE);
    for (int q = 0; q < s->world && rc == MPI_SUCCESS; q++) {
        if (q == s->rank) continue;
        rc = MPI_Isend(&s->fused_send, (int)bytes, type, q, EXCHANGE_TAG, s->comm, &s->xreqs[n]);
        if (rc == MPI_SUCCESS) n++;
    }
    leave_mpi();
    ddp_status_t status = DDP_OK;
    if (rc != MPI_SUCCESS)
        status = post_failed(s, rc, c, "MPI_Isend/MPI_Irecv (fingerprint exchange)");
    else status = wait_requests(s, n, s->xreqs, c, "fingerprint exchange");
    while (status == DDP_OK) {
        /* A record stamped with another group's id was sent on an earlier communicator that
         * had this one's context id (see mpi_destroy): drop it and receive again; the
         * peer's own record follows it (one source, one tag, one communicator: in order). */
        int stale = 0;
        enter_mpi();
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
        leave_mpi();
        if (!stale) break;
        if (rc != MPI_SUCCESS)
            status = post_failed(s, rc, c, "MPI_Irecv (fingerprint exchange, again)");
        else status = wait_requests(s, n, s->xreqs, c, "fingerprint exchange");
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
    enter_mpi();
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
    leave_mpi();
    if (status == DDP_ERR_TIMEOUT && nmissing > 0) {
        char fp[256];
        describe(c, fp, sizeof fp);
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
            return break_state(s, ddp__error(DDP_ERR_MISMATCH,
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
static ddp_status_t exchange_fingerprint(mpi_state_t *s, const ddp__collective_t *c, int *done)
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
    ddp_dtype_t rtype = reduce_dtype(c->dtype, c->op);
    if (inline_data) {
        if (rtype != c->dtype) ddp__acc_widen(s->fused_send.payload, c->send, c->count, c->dtype);
        else memcpy(s->fused_send.payload, c->send, c->count * ddp_dtype_size(c->dtype));
    }
    ddp_status_t status;
    if (s->records) {
        status = exchange_p2p(s, c);
        if (status == DDP_OK) status = combine_records(s, inline_data);
        if (status != DDP_OK) return status;
    } else {
        MPI_Request req;
        enter_mpi();
        int rc = MPI_Iallreduce(&s->fused_send, &s->fused_recv, 1, faulty(s, fused_type),
                                fused_op, s->comm, &req);
        leave_mpi();
        if (rc != MPI_SUCCESS)
            return post_failed(s, rc, c, "MPI_Iallreduce (fingerprint exchange)");
        status = wait_request(s, &req, c, "fingerprint exchange");
        if (status != DDP_OK) return status;
        for (int i = 0; i < FP_FIELDS; i++) {
            if (s->fused_recv.fp[i] != ~s->fused_recv.fp[FP_FIELDS + i])
                return report_mismatch(s, c);
        }
        /* A contribution of another group (sent on an earlier communicator with this one's
         * context id) cannot be told apart and dropped inside a collective: report it. */
        if (s->fused_recv.group[0] != ~s->fused_recv.group[1]) {
            char fp[256];
            describe(c, fp, sizeof fp);
            return break_state(
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

/* ---- collectives --------------------------------------------------------------------------- */

/* Allreduce of n elements of `dtype` (already the reduction type), in chunks MPI can count. */
static ddp_status_t allreduce_chunks(mpi_state_t *s, const ddp__collective_t *c, const void *send,
                                     void *recv, size_t n, ddp_dtype_t dtype)
{
    size_t esz = ddp_dtype_size(dtype);
    MPI_Datatype type = faulty(s, move_type(dtype));
    for (size_t off = 0; off < n; off += MPI_CHUNK) {
        size_t len = n - off < MPI_CHUNK ? n - off : MPI_CHUNK;
        const void *src = send == MPI_IN_PLACE ? MPI_IN_PLACE : (const char *)send + off * esz;
        MPI_Request req;
        enter_mpi();
        int rc = MPI_Iallreduce(src, (char *)recv + off * esz, (int)len, type, mpi_op(c->op),
                                s->comm, &req);
        leave_mpi();
        if (rc != MPI_SUCCESS) return post_failed(s, rc, c, "MPI_Iallreduce");
        ddp_status_t status = wait_request(s, &req, c, "MPI_Iallreduce");
        if (status != DDP_OK) return status;
    }
    return DDP_OK;
}

static ddp_status_t run_allreduce(mpi_state_t *s, const ddp__collective_t *c)
{
    ddp_dtype_t rtype = reduce_dtype(c->dtype, c->op);
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
    void *wide = scratch(s, n * ddp_dtype_size(rtype));
    if (!wide) return break_state(s, DDP_ERR_NO_MEMORY);
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
    MPI_Datatype type = faulty(s, move_type(c->dtype));
    for (size_t off = 0; off < c->count; off += MPI_CHUNK) {
        size_t len = c->count - off < MPI_CHUNK ? c->count - off : MPI_CHUNK;
        MPI_Request req;
        enter_mpi();
        int rc = MPI_Ibcast((char *)c->recv + off * esz, (int)len, type, c->root, s->comm, &req);
        leave_mpi();
        if (rc != MPI_SUCCESS) return post_failed(s, rc, c, "MPI_Ibcast");
        ddp_status_t status = wait_request(s, &req, c, "MPI_Ibcast");
        if (status != DDP_OK) return status;
    }
    return DDP_OK;
}

static ddp_status_t run_reduce_scatter(mpi_state_t *s, const ddp__collective_t *c)
{
    size_t n = c->count;
    size_t total = n * (size_t)s->world;
    ddp_dtype_t rtype = reduce_dtype(c->dtype, c->op);
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
    MPI_Datatype type = move_type(rtype);
    if (rtype != c->dtype) {
        void *wide = scratch(s, total * rsz);
        if (!wide) return break_state(s, DDP_ERR_NO_MEMORY);
        ddp__acc_widen(wide, send, total, c->dtype);
        in = MPI_IN_PLACE;
        out = wide;
    } else if (overlap) {
        out = scratch(s, n * esz);
        if (!out) return break_state(s, DDP_ERR_NO_MEMORY);
    }
    MPI_Request req;
    enter_mpi();
    int rc = MPI_Ireduce_scatter_block(in, out, (int)n, faulty(s, type), mpi_op(c->op), s->comm,
                                       &req);
    leave_mpi();
    if (rc != MPI_SUCCESS) return post_failed(s, rc, c, "MPI_Ireduce_scatter_block");
    ddp_status_t status = wait_request(s, &req, c, "MPI_Ireduce_scatter_block");
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
    MPI_Datatype type = faulty(s, move_type(c->dtype));
    MPI_Request req;
    enter_mpi();
    int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c->recv, (int)c->count, type,
                            s->comm, &req);
    leave_mpi();
    if (rc != MPI_SUCCESS) return post_failed(s, rc, c, "MPI_Iallgather");
    return wait_request(s, &req, c, "MPI_Iallgather");
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
    enter_mpi();
    int rc = MPI_Ibarrier(s->comm, &req);
    leave_mpi();
    if (rc != MPI_SUCCESS) return post_failed(s, rc, c, "MPI_Ibarrier (commit round)");
    return wait_request(s, &req, c, "commit round (MPI_Ibarrier)");
}

static ddp_status_t confirm(mpi_state_t *s, const ddp__collective_t *c)
{
    int source = -1;
    ddp_status_t error = DDP_OK;
    int got = receive_notice(s, &source, &error);
    if (got < 0) return break_state(s, error);
    if (!got) return DDP_OK;
    unsigned long long seq = 0, id = 0;
    int mismatch = 0;
    const char *text = parse_notice(s, &seq, &id, &mismatch);
    if (seq != (unsigned long long)c->seq) {
        s->notice_kept = 1;
        s->notice_source = source;
        return DDP_OK;
    }
    char fp[256];
    describe(c, fp, sizeof fp);
    return break_state(s, ddp__error(DDP_ERR_REMOTE, "MPI transport, group '%s', rank %d, %s: "
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
    status = exchange_fingerprint(s, c, &done);
    if (status != DDP_OK) return status;
    /* The fingerprint exchange synchronised every rank: a barrier, an empty collective or one
     * whose data rode in the exchange is done, and was one all-to-all step. */
    if (!done && c->kind != DDP__BARRIER && c->count != 0) {
        status = run_data(s, c);
        if (status == DDP_OK) status = commit(s, c);
        if (status != DDP_OK) return status;
    }
    return confirm(s, c);
}

/* ---- creation ------------------------------------------------------------------------------ */

/* Polls a communicator-creating request until timeout_ms passes. */
static ddp_status_t wait_setup(MPI_Request *req, int timeout_ms, const char *what)
{
    int64_t deadline = ddp__now_ns() + (int64_t)timeout_ms * 1000000;
    for (unsigned long spins = 1;; spins++) {
        int done = 0;
        enter_mpi();
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        leave_mpi();
        if (rc != MPI_SUCCESS) return ddp__mpi_error(rc, what);
        if (done) return DDP_OK;
        if (ddp__now_ns() > deadline) {
            pthread_mutex_lock(&init_lock);
            leaked_requests++;
            pthread_mutex_unlock(&init_lock);
            return ddp__error(DDP_ERR_TIMEOUT,
                              "%s: not every process of MPI_COMM_WORLD joined within %d ms", what,
                              timeout_ms);
        }
        if (spins > YIELD_AFTER) sched_yield();
    }
}

static uint32_t name_hash(const char *name)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 16777619u;
    return h;
}

/* The tag MPI_Comm_create_group uses for its own messages on the parent communicator, from the
 * group's name, in 0..32767 (MPI_TAG_UB is at least that) but never one of the transport's
 * tags: a member that finished the creation may already send the parent's next fingerprint
 * record (EXCHANGE_TAG) to a member still inside it, which must not take it for its own. */
static int creation_tag(const char *name)
{
    int tag = (int)(name_hash(name) & 0x7fff);
    if (tag == ABORT_TAG || tag == EXCHANGE_TAG) tag ^= 0x4000;
    return tag;
}

/* Learns, through the store, which MPI_COMM_WORLD rank holds each group rank: map[r]. */
static ddp_status_t exchange_world_ranks(ddp_store_t *store, const char *group_name, int rank,
                                         int world, int timeout_ms, int world_rank, int world_size,
                                         int *map)
{
    char key[DDP_STORE_MAX_KEY];
    char value[64];
    snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, rank);
    int len = snprintf(value, sizeof value, "%d %d", world_rank, world_size);
    ddp_status_t status = ddp_store_set(store, key, value, (size_t)len);
    if (status != DDP_OK)
        return ddp__error_context(status, "MPI transport: publishing rank %d's MPI rank", rank);
    /* Wait for everyone within timeout_ms (the store's text names the missing keys, i.e. ranks),
     * then read. */
    char **keys = ddp__calloc((size_t)world, sizeof *keys, "MPI transport keys");
    if (!keys) return DDP_ERR_NO_MEMORY;
    for (int r = 0; r < world && status == DDP_OK; r++) {
        snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, r);
        keys[r] = ddp__strdup(key, "MPI transport key");
        if (!keys[r]) status = DDP_ERR_NO_MEMORY;
    }
    if (status == DDP_OK) status = ddp_store_wait(store, (const char *const *)keys, (size_t)world,
                                                  timeout_ms);
    for (int r = 0; r < world; r++) free(keys[r]);
    free(keys);
    if (status != DDP_OK)
        return ddp__error_context(status,
                                  "MPI transport: rank %d waiting for the others' MPI ranks", rank);
    for (int r = 0; r < world; r++) {
        snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, r);
        void *got = NULL;
        size_t got_len = 0;
        status = ddp_store_get(store, key, &got, &got_len);
        if (status != DDP_OK)
            return ddp__error_context(status, "MPI transport: waiting for rank %d's MPI rank", r);
        int their_rank = -1, their_size = -1;
        int parsed = sscanf((const char *)got, "%d %d", &their_rank, &their_size);
        ddp_free(got);
        if (parsed != 2 || their_rank < 0 || their_rank >= their_size)
            return ddp__error(DDP_ERR_PROTOCOL, "MPI transport: malformed value under key '%s'",
                              key);
        if (their_size != world_size)
            return ddp__error(DDP_ERR_MISMATCH,
                              "MPI transport: rank %d sees an MPI_COMM_WORLD of %d processes but "
                              "rank %d sees %d: the ranks were not started by one mpirun",
                              rank, world_size, r, their_size);
        map[r] = their_rank;
        for (int q = 0; q < r; q++) {
            if (map[q] == their_rank)
                return ddp__error(DDP_ERR_MISMATCH,
                                  "MPI transport: ranks %d and %d are both MPI_COMM_WORLD rank "
                                  "%d (of %d): the ranks were not started by one mpirun",
                                  q, r, their_rank, world_size);
        }
    }
    return DDP_OK;
}

/* Finishes a state whose communicator was just made: errors return, a name for MPI tools, and
 * the communicator's rank and size must be the group's. Frees the communicator on failure. */
static ddp_status_t adopt_comm(mpi_state_t *s, const char *group_name, int rank, int world,
                               int timeout_ms)
{
    enter_mpi();
    MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
    char comm_name[MPI_MAX_OBJECT_NAME];
    snprintf(comm_name, sizeof comm_name, "libddp:%s", group_name);
    MPI_Comm_set_name(s->comm, comm_name);
    int comm_rank = -1, comm_size = -1;
    MPI_Comm_rank(s->comm, &comm_rank);
    MPI_Comm_size(s->comm, &comm_size);
    leave_mpi();
    if (comm_rank != rank || comm_size != world) {
        enter_mpi();
        MPI_Comm_free(&s->comm);
        leave_mpi();
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "MPI transport: rank %d of world size %d was given, but the group's "
                          "communicator says rank %d of %d",
                          rank, world, comm_rank, comm_size);
    }
    s->timeout_ms = timeout_ms;
    if (world > 1) {
        /* Rank 0 draws the group's notice id; every rank learns it before any notice can be sent
         * (see notice_id). Polled, so a rank that never comes cannot hang creation. */
        static _Atomic uint64_t groups_made;
        /* On the heap: a broadcast given up at the timeout may still write it later (leaked). */
        uint64_t *id = ddp__calloc(1, sizeof *id, "the group's notice id");
        if (!id) {
            enter_mpi();
            MPI_Comm_free(&s->comm);
            leave_mpi();
            return DDP_ERR_NO_MEMORY;
        }
        if (rank == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            *id = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^
                  (atomic_fetch_add(&groups_made, 1) + 1) * 0x9e3779b97f4a7c15ULL;
        }
        MPI_Request req;
        enter_mpi();
        int rc = MPI_Ibcast(id, 1, MPI_UINT64_T, 0, s->comm, &req);
        leave_mpi();
        ddp_status_t status = rc == MPI_SUCCESS
                                  ? wait_setup(&req, timeout_ms, "agreeing on the group's notice id")
                                  : ddp__mpi_error(rc, "MPI transport: MPI_Ibcast (notice id)");
        if (status != DDP_OK) {
            /* After a timeout the broadcast may still arrive: keep the communicator, as destroy
             * does for a failed group, so that its context id is not handed on with it. */
            if (rc != MPI_SUCCESS) {
                enter_mpi();
                MPI_Comm_free(&s->comm);
                leave_mpi();
                free(id);
            }
            return status;
        }
        s->notice_id = *id;
        free(id);
    }
    if (world > 1 && world <= ddp__mpi_p2p_max_world) {
        s->records = ddp__calloc((size_t)world, sizeof *s->records, "MPI transport records");
        s->xreqs = ddp__calloc(2 * (size_t)world, sizeof *s->xreqs, "MPI transport requests");
        s->last_seq = ddp__calloc((size_t)world, sizeof *s->last_seq, "MPI transport sequence");
        if (!s->records || !s->xreqs || !s->last_seq) {
            free(s->records);
            free(s->xreqs);
            free(s->last_seq);
            enter_mpi();
            MPI_Comm_free(&s->comm);
            leave_mpi();
            return DDP_ERR_NO_MEMORY;
        }
        for (int i = 0; i < 2 * world; i++) s->xreqs[i] = MPI_REQUEST_NULL;
    }
    pthread_mutex_lock(&init_lock);
    live_states++;
    pthread_mutex_unlock(&init_lock);
    return DDP_OK;
}

static ddp_status_t mpi_create(ddp_store_t *store, const char *group_name, int rank, int world,
                               int timeout_ms, void **state)
{
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: state is NULL");
    if (world < 1)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: world size %d", world);
    if (rank < 0 || rank >= world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: rank %d outside 0..%d", rank,
                          world - 1);
    if (timeout_ms <= 0) {
        ddp_status_t timeout_status = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
        if (timeout_status != DDP_OK) return ddp__error_context(timeout_status, "MPI transport");
    }
    if (!group_name) group_name = "default";

    ddp_status_t status = ensure_mpi();
    if (status != DDP_OK) return status;
    int world_rank = 0, world_size = 0;
    enter_mpi();
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    leave_mpi();

    mpi_state_t *s = ddp__calloc(1, sizeof *s, "MPI transport state");
    if (!s) return DDP_ERR_NO_MEMORY;
    s->comm = MPI_COMM_NULL;
    s->rank = rank;
    s->world = world;
    snprintf(s->name, sizeof s->name, "%s", group_name);
    int *map = NULL;

    if (!store) {
        /* Without a store the only group we can build is MPI_COMM_WORLD itself. */
        if (rank != world_rank || world != world_size) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "MPI transport: rank %d of world size %d was given, but "
                                "MPI_COMM_WORLD says rank %d of %d (without a store a group must "
                                "span MPI_COMM_WORLD in its rank order)",
                                rank, world, world_rank, world_size);
            goto fail_state;
        }
    } else {
        if (world > world_size) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "MPI transport: world size %d was given, but MPI_COMM_WORLD has "
                                "only %d processes (rank %d is MPI rank %d): were the ranks "
                                "started by one mpirun?",
                                world, world_size, rank, world_rank);
            goto fail_state;
        }
        map = ddp__malloc((size_t)world * sizeof *map, "MPI transport rank map");
        if (!map) {
            status = DDP_ERR_NO_MEMORY;
            goto fail_state;
        }
        status = exchange_world_ranks(store, group_name, rank, world, timeout_ms, world_rank,
                                      world_size, map);
        if (status != DDP_OK) goto fail_map;
    }

    int identity = world == world_size;
    for (int r = 0; map && identity && r < world; r++) identity = map[r] == r;
    if (identity) {
        /* Every process of MPI_COMM_WORLD is in the group, in order: a non-blocking duplicate,
         * polled so that a process that never comes cannot hang us. */
        MPI_Request req;
        enter_mpi();
        int rc = MPI_Comm_idup(MPI_COMM_WORLD, &s->comm, &req);
        leave_mpi();
        if (rc != MPI_SUCCESS) {
            status = ddp__mpi_error(rc, "MPI transport: MPI_Comm_idup(MPI_COMM_WORLD)");
            goto fail_map;
        }
        status = wait_setup(&req, timeout_ms, "MPI transport: MPI_Comm_idup(MPI_COMM_WORLD)");
        if (status != DDP_OK) goto fail_map; /* the communicator is leaked with the request */
    } else {
        /* A subset or a reordering: MPI_Comm_create_group is collective over the members only.
         * It blocks, but every member has just shown through the store that it is here. */
        MPI_Group world_group, group;
        enter_mpi();
        MPI_Comm_group(MPI_COMM_WORLD, &world_group);
        int rc = MPI_Group_incl(world_group, world, map, &group);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, creation_tag(group_name), &s->comm);
            MPI_Group_free(&group);
        }
        MPI_Group_free(&world_group);
        leave_mpi();
        if (rc != MPI_SUCCESS) {
            status = ddp__mpi_error(rc, "MPI transport: MPI_Comm_create_group");
            goto fail_map;
        }
    }
    free(map);
    map = NULL;
    status = adopt_comm(s, group_name, rank, world, timeout_ms);
    if (status != DDP_OK) goto fail_state;
    DDP_LOG(DDP_LOG_INFO, "MPI transport: group '%s' rank %d/%d is MPI_COMM_WORLD rank %d (%s)",
            group_name, rank, world, world_rank, thread_level_name(thread_level));
    *state = s;
    return DDP_OK;

fail_map:
    free(map);
fail_state:
    free(s);
    return status;
}

ddp_status_t ddp__mpi_split(void *parent, const int *ranks, int nranks, const char *name,
                            void **state)
{
    mpi_state_t *p = parent;
    if (!p) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: parent is NULL");
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: state is NULL");
    if (!name || !*name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: name is empty");
    if (!ranks) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: ranks is NULL");
    if (nranks < 1 || nranks > p->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: nranks %d outside 1..%d", nranks,
                          p->world);
    int me = -1;
    for (int i = 0; i < nranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= p->world)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "MPI split: ranks[%d] = %d outside 0..%d", i, ranks[i], p->world - 1);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "MPI split: rank %d listed twice (ranks[%d] and ranks[%d])",
                                  ranks[i], j, i);
        if (ranks[i] == p->rank) me = i;
    }
    if (p->broken)
        return ddp__error(DDP_ERR_ABORTED, "MPI split: parent group '%s' is broken: %s", p->name,
                          p->broken_reason);
    if (me < 0) {
        *state = NULL; /* not a member: MPI_Comm_create_group involves the members only */
        return DDP_OK;
    }
    mpi_state_t *s = ddp__calloc(1, sizeof *s, "MPI transport state");
    if (!s) return DDP_ERR_NO_MEMORY;
    s->comm = MPI_COMM_NULL;
    s->rank = me;
    s->world = nranks;
    snprintf(s->name, sizeof s->name, "%s", name);
    MPI_Group parent_group, group;
    enter_mpi();
    MPI_Comm_group(p->comm, &parent_group);
    int rc = MPI_Group_incl(parent_group, nranks, ranks, &group);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Comm_create_group(p->comm, group, creation_tag(name), &s->comm);
        MPI_Group_free(&group);
    }
    MPI_Group_free(&parent_group);
    leave_mpi();
    ddp_status_t status;
    if (rc != MPI_SUCCESS) {
        status = ddp__mpi_error(rc, "MPI split: MPI_Comm_create_group");
    } else {
        status = adopt_comm(s, name, me, nranks, p->timeout_ms);
    }
    if (status != DDP_OK) {
        free(s);
        return status;
    }
    *state = s;
    return DDP_OK;
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
     * follows a mismatch says so with its sequence number (see check_abort_notice). Under
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
    enter_mpi();
    for (int r = 0; r < s->world && s->nabort_sends < 64; r++) {
        if (r == s->rank) continue;
        MPI_Request req;
        if (MPI_Isend(s->abort_wire, len, MPI_CHAR, r, ABORT_TAG, s->comm, &req) == MPI_SUCCESS)
            s->abort_sends[s->nabort_sends++] = req;
    }
    leave_mpi();
}

static void mpi_destroy(void *state)
{
    mpi_state_t *s = state;
    if (!s) return;
    enter_mpi();
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
     * an abort notice that reaches a reused id is dropped by its group id (receive_notice),
     * a record by its group id (exchange_p2p). */
    int keep = s->broken || atomic_load(&s->aborted);
    if (!pending && !keep && s->comm != MPI_COMM_NULL) MPI_Comm_free(&s->comm);
    leave_mpi();
    pthread_mutex_lock(&init_lock);
    live_states--;
    leaked_requests += pending;
    if (keep && !pending) kept_comms++;
    int kept = kept_comms;
    pthread_mutex_unlock(&init_lock);
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
    ddp_status_t s = ensure_mpi();
    if (s != DDP_OK) return s;
    MPI_Request req = MPI_REQUEST_NULL;
    enter_mpi();
    int rc = MPI_Comm_rank(MPI_COMM_WORLD, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(MPI_COMM_WORLD, world);
    if (rc == MPI_SUCCESS) rc = MPI_Ibcast(buf, (int)len, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    leave_mpi();
    if (rc != MPI_SUCCESS) return ddp__mpi_error(rc, "MPI bootstrap: MPI_Ibcast");
    return wait_setup(&req, timeout_ms, "MPI bootstrap: the broadcast of rank 0's store address");
}

static const ddp__bootstrap_ops_t mpi_bootstrap = {
    .bcast = mpi_bootstrap_bcast,
};

/* Exported from libddp_mpi.so: src/transport/registry.c finds the table by this name. */
DDP_MODULE_API const ddp__transport_ops_t ddp__transport_mpi = {
    .name = "mpi",
    .create = mpi_create,
    .run = mpi_run,
    .alloc_buffer = NULL,
    .free_buffer = NULL,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
    .split = ddp__mpi_split,
    .storeless = 1,
    .multi_host = 1,
    .bootstrap = &mpi_bootstrap,
};

ddp_status_t ddp_mpi_register(void)
{
    return ddp__transport_register(&ddp__transport_mpi);
}
