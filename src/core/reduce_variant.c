/* The reduction kernels' variant (reduce.h): the widest this CPU runs, chosen once, or one a
 * test forces. Shared by the block kernels (reduce.c) and the streamed ones (reduce_stream.c). */
#include <stdatomic.h>

#include "core/cpu.h"
#include "core/reduce_kernels.h"

static _Atomic int kernels_chosen = -1; /* -1 unknown, else a variant (reduce.h) */

static int best_variant(void)
{
#if DDP_REDUCE_X86
    if (ddp__cpu_has_avx512_bf16()) return 3;
    if (ddp__cpu_has_avx512()) return 2;
    if (ddp__cpu_has_avx2_f16c()) return 1;
#endif
    return 0;
}

int ddp__reduce_choose(void)
{
    int v = atomic_load_explicit(&kernels_chosen, memory_order_relaxed);
    if (v >= 0) return v;
    v = best_variant();
    atomic_store_explicit(&kernels_chosen, v, memory_order_relaxed);
    return v;
}

const char *ddp__reduce_variant(void)
{
    static const char *const names[] = {"baseline", "avx2+f16c", "avx512", "avx512+bf16"};
    return names[ddp__reduce_choose()];
}

int ddp__reduce_force_variant(int variant)
{
    atomic_store_explicit(&kernels_chosen, -1, memory_order_relaxed);
    if (variant < 0) return 0;
    if (variant > best_variant()) return -1;
    atomic_store_explicit(&kernels_chosen, variant, memory_order_relaxed);
    return 0;
}
