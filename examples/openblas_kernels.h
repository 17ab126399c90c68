/* The trainers' guard against OpenBLAS's oldest kernels on a CPU it does not know
 * (examples/openblas_kernels.c). */
#ifndef EXAMPLES_OPENBLAS_KERNELS_H
#define EXAMPLES_OPENBLAS_KERNELS_H

/* Call first in main: when OpenBLAS fell back to its SSE3 kernels on a CPU that can run its AVX2
 * or AVX-512 ones, starts this program again (same argv, same pid) with OPENBLAS_CORETYPE set;
 * returns when there is nothing to do or the restart failed (after saying so on stderr). */
void example_openblas_kernels(char **argv);

#endif
