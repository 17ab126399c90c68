/* What the files of the MPI transport share (mpi_runtime.c, mpi_fused.c, mpi_create.c,
 * mpi_transport.c): the state of a group, the record every collective starts with, the marks
 * of abort notices, the process-wide MPI bookkeeping, and the functions each file offers the
 * others. Private to src/transport/mpi/ (mpi_internal.h is what the tests may use). */
#ifndef DDP_TRANSPORT_MPI_MPI_PRIVATE_H
#define DDP_TRANSPORT_MPI_MPI_PRIVATE_H

#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "transport/transport.h"
#include "transport/mpi/mpi_internal.h"

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
 * (0: between collectives), then "\n" and the reason (see ddp__mpi_confirm). */
#define FAILED_MARK "\002failed at seq "
/* Follows either mark's sequence number: the group's notice id (see ddp__mpi_adopt_comm). */
#define GROUP_MARK " group "

/* The record every collective starts with: fingerprint, its complement, a small payload. */
enum { INLINE_BYTES = 512 };
typedef struct fused_record {
    int64_t fp[2 * FP_FIELDS];
    /* The sending group's notice id and its complement (reduced by MIN like fp): a record of
     * another group that reached this group's communicator is told apart (see ddp__mpi_exchange_p2p). */
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
    int notice_kept;   /* abort_notice holds a notice received early by ddp__mpi_confirm (see there) */
    int notice_source; /* its sender */

    int inject_fault;
} mpi_state_t;

/* ---- mpi_runtime.c: process-wide MPI, errors, waiting, types ---- */

/* Guards the process-wide counts below and MPI's initialisation and finalisation. */
extern pthread_mutex_t ddp__mpi_init_lock;
extern int ddp__mpi_provided_level;  /* the thread level MPI provides; -1 before init */
extern int ddp__mpi_live_states;     /* groups not yet destroyed */
extern int ddp__mpi_leaked_requests; /* requests abandoned at a timeout MPI never completed */
extern int ddp__mpi_kept_comms;      /* communicators of failed groups, never freed */

/* Initialises MPI (or checks the program's initialisation) once per process. */
ddp_status_t ddp__mpi_ensure_mpi(void);
/* Around every MPI call: under MPI_THREAD_SERIALIZED one thread at a time. */
void ddp__mpi_enter_mpi(void);
void ddp__mpi_leave_mpi(void);
const char *ddp__mpi_thread_level_name(int level);
/* Marks the state broken with `status` (kept for later calls) and returns it. */
ddp_status_t ddp__mpi_break_state(mpi_state_t *s, ddp_status_t status);
void ddp__mpi_describe(const ddp__collective_t *c, char *buf, size_t size);
/* The error of an MPI call (named `call`) that failed to start c's step. */
ddp_status_t ddp__mpi_post_failed(mpi_state_t *s, int rc, const ddp__collective_t *c,
                                  const char *call);
/* Test hook: a datatype MPI rejects when a fault was injected, else `type`. */
MPI_Datatype ddp__mpi_faulty(mpi_state_t *s, MPI_Datatype type);
/* An abort notice's sequence number and group id, and whether it reports a mismatch; returns
 * its reason. */
const char *ddp__mpi_parse_notice(mpi_state_t *s, unsigned long long *seq, unsigned long long *id,
                                  int *mismatch);
int ddp__mpi_receive_notice(mpi_state_t *s, int *source, ddp_status_t *error);
ddp_status_t ddp__mpi_check_abort_notice(mpi_state_t *s);
/* Polls n requests (or one) until done, the deadline of c, or an abort notice. */
ddp_status_t ddp__mpi_wait_requests(mpi_state_t *s, int n, MPI_Request *reqs,
                                    const ddp__collective_t *c, const char *step);
ddp_status_t ddp__mpi_wait_request(mpi_state_t *s, MPI_Request *req, const ddp__collective_t *c,
                                   const char *step);
MPI_Datatype ddp__mpi_move_type(ddp_dtype_t dtype);
MPI_Op ddp__mpi_op(ddp_reduce_op_t op);
/* The dtype MPI reduces in (f16/bf16 widened to f32, narrow ints to i64 where they could wrap). */
ddp_dtype_t ddp__mpi_reduce_dtype(ddp_dtype_t dtype, ddp_reduce_op_t op);
/* The state's scratch buffer, grown to at least `bytes`. */
void *ddp__mpi_scratch(mpi_state_t *s, size_t bytes);

/* ---- mpi_fused.c: the record exchange every collective starts with ---- */

/* The fused record's MPI type and op, made once; call with ddp__mpi_init_lock held. */
ddp_status_t ddp__mpi_ensure_fused(void);
ddp_status_t ddp__mpi_exchange_p2p(mpi_state_t *s, const ddp__collective_t *c);
/* *done: the collective completed inside the exchange (barrier, count 0, inline allreduce). */
ddp_status_t ddp__mpi_exchange_fingerprint(mpi_state_t *s, const ddp__collective_t *c, int *done);

/* ---- mpi_create.c: creation ---- */

ddp_status_t ddp__mpi_wait_setup(MPI_Request *req, int timeout_ms, const char *what);
ddp_status_t ddp__mpi_adopt_comm(mpi_state_t *s, const char *group_name, int rank, int world,
                                 int timeout_ms);
ddp_status_t ddp__mpi_create(ddp_store_t *store, const char *group_name, int rank, int world,
                             int timeout_ms, void **state);

/* ---- mpi_transport.c ---- */

ddp_status_t ddp__mpi_confirm(mpi_state_t *s, const ddp__collective_t *c);
void ddp__mpi_destroy(void *state);

#endif
