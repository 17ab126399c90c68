/* Linked into every MPI test: they link libddp and libddp_mpi statically, and a static libddp
 * never loads a module, so the MPI transport is registered before main, as a static user would
 * (include/ddp/mpi.h). */
#include "ddp/mpi.h"

__attribute__((constructor)) static void register_mpi_transport(void)
{
    (void)ddp_mpi_register();
}
