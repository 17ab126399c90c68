/* The MPI transport lives in a library of its own, so that libddp never links MPI. A program
 * linked with the shared libddp needs nothing from this header: asking for transport "mpi"
 * (options.transport, DDP_TRANSPORT=mpi, or mpirun without a store) loads libddp_mpi.so from
 * beside libddp.so, or else from the install libdir (docs/mpi-transport.md). A program that
 * links libddp *statically* never loads a module; it links the module statically too and
 * registers it once, before creating a group:
 *
 *     cc app.c $(pkg-config --static --libs ddp-mpi)   # -lddp_mpi -lddp, MPI's libraries
 *
 *     #include <ddp/mpi.h>
 *     ddp_mpi_register();
 *
 * Not included by ddp/ddp.h: the function is defined in libddp_mpi, not in libddp. */
#ifndef DDP_MPI_H
#define DDP_MPI_H

#include "ddp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes the MPI transport of the linked libddp_mpi the table libddp uses for transport "mpi"
 * (instead of loading libddp_mpi.so). Idempotent; thread-safe; calling it with the shared
 * libraries is allowed and changes nothing visible. Returns DDP_OK. */
DDP_API ddp_status_t ddp_mpi_register(void);

#ifdef __cplusplus
}
#endif

#endif
