/* Internals of the MPI transport that its tests reach into: the mapping of MPI error codes to
 * libddp statuses, and a hook that makes the next collective fail inside MPI. Not installed. */
#ifndef DDP_TRANSPORT_MPI_INTERNAL_H
#define DDP_TRANSPORT_MPI_INTERNAL_H

#include "ddp/ddp.h"
#include "group/transport.h"

extern const ddp__transport_ops_t ddp__transport_mpi;

/* Records and returns the libddp status for MPI error code `mpi_code` (MPI_ERR_TRUNCATE is a
 * mismatch, MPI_ERR_NO_MEM no memory, argument classes invalid arguments, the rest system
 * errors); the text is "<what>: <MPI error class name>: <MPI_Error_string>". */
ddp_status_t ddp__mpi_error(int mpi_code, const char *what);

/* Test hook: the next collective run on `state` (a state made by ddp__transport_mpi.create)
 * hands MPI_DATATYPE_NULL to MPI after the fingerprint check, so that MPI itself reports an
 * error through the communicator's MPI_ERRORS_RETURN handler. */
void ddp__mpi_inject_fault(void *state);

/* The MPI thread level the transport runs with (MPI_THREAD_*); -1 before the first create. */
int ddp__mpi_thread_level(void);

#endif
