/* OpenBLAS built for several CPUs (Debian's is) picks its kernels when it loads, by the CPU's
 * family and model. A release older than the CPU does not know the model and falls back to its
 * oldest x86-64 kernels, "Prescott" (SSE3): Debian 12's OpenBLAS 0.3.21 does so on an Emerald
 * Rapids Xeon (family 6, model 207), where the Fashion-MNIST trainer's step at hidden 4096,
 * batch 64 took 302 ms against 103 ms with OPENBLAS_CORETYPE=SkylakeX (1 rank, 20 steps).
 * OpenBLAS reads that variable only as it loads, before main, so a trainer that finds the
 * fallback on a CPU with AVX2 or AVX-512 starts itself again with it set. A value the user set
 * (any) is left alone, and so is every CPU OpenBLAS recognised. */
#include "openblas_kernels.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef EXAMPLE_HAVE_OPENBLAS_CORENAME
char *openblas_get_corename(void);
#endif

void example_openblas_kernels(char **argv)
{
#if defined(EXAMPLE_HAVE_OPENBLAS_CORENAME) && defined(__x86_64__) && defined(__GNUC__)
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename();
    if (!core || strcmp(core, "Prescott") != 0) return;
    __builtin_cpu_init();
    /* libgcc's answers include the OS's consent (XCR0) for the AVX and AVX-512 registers. */
    const char *want = NULL;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        want = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        want = "Haswell";
    if (!want) return;
    const char *rank = getenv("RANK");
    const int say = !rank || strcmp(rank, "0") == 0;
    if (say)
        fprintf(stderr,
                "%s: OpenBLAS does not know this CPU and chose its %s kernels; starting again "
                "with OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to choose)\n",
                argv[0], core, want);
    if (setenv("OPENBLAS_CORETYPE", want, 1) != 0) return;
    execv("/proc/self/exe", argv);
    fprintf(stderr, "%s: could not start again (%s): going on with OpenBLAS's %s kernels\n",
            argv[0], strerror(errno), core);
    unsetenv("OPENBLAS_CORETYPE");
#else
    (void)argv;
#endif
}
