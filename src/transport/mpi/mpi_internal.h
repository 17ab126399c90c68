/* Internals of the MPI transport that its tests reach into: the mapping of MPI error codes to
 * libddp statuses, and a hook that makes the next collective fail inside MPI. Not installed. */
#ifndef DDP_TRANSPORT_MPI_INTERNAL_H
#define DDP_TRANSPORT_MPI_INTERNAL_H

#include "ddp/ddp.h"
#include "transport/transport.h"

extern const ddp__transport_ops_t ddp__transport_mpi;

/* Records and returns the libddp status for MPI error code `mpi_code` (MPI_ERR_TRUNCATE is a
 * mismatch, MPI_ERR_NO_MEM no memory, argument classes invalid arguments, the rest system
 * errors); the text is "<what>: <MPI error class name>: <MPI_Error_string>". */
ddp_status_t ddp__mpi_error(int mpi_code, const char *what);

/* A subgroup of the group `parent` without a store: ranks[i] (ranks of the parent, distinct)
 * becomes rank i of the new group, whose state is returned in *state; on ranks not listed
 * *state = NULL and nothing is called. Uses MPI_Comm_create_group over the parent's
 * communicator, which involves only the members and blocks until all of them call (so call it
 * when every member is known to be calling, e.g. after comparing the member lists, and while the
 * parent has no collective in flight). `name` names the new group (its tag is derived from it).
 * The table's `split` entry. */
ddp_status_t ddp__mpi_split(void *parent, const int *ranks, int nranks, const char *name,
                            void **state);

/* Test hook: the next collective run on `state` (a state made by ddp__transport_mpi.create)
 * hands MPI_DATATYPE_NULL to MPI after the fingerprint check, so that MPI itself reports an
 * error through the communicator's MPI_ERRORS_RETURN handler. */
void ddp__mpi_inject_fault(void *state);

/* Groups of up to this many ranks (default 8) exchange fingerprint records point to point,
 * which names the missing ranks at a timeout; larger ones use one MPI_Iallreduce. Read when a
 * group is created; tests set it to 0 to exercise the allreduce exchange with few ranks. */
extern int ddp__mpi_p2p_max_world;

/* The MPI thread level the transport runs with (MPI_THREAD_*); -1 before the first create. */
int ddp__mpi_thread_level(void);

#endif
