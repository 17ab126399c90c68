/* CPU feature checks with CPUID and XGETBV read directly: clang 14's __builtin_cpu_supports
 * knows no "f16c" (a compile error), so neither compiler's builtin is used. */
#include <stdatomic.h>
#include <stddef.h>

#include "core/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>

/* Bit 0: AVX + F16C with OS support; bit 1: AVX2 as well; bit 2: AVX-512 F, BW and VL too, with
 * the OS saving the opmask and ZMM state; bit 3: AVX-512 DQ and BF16 as well. */
static int probe(void)
{
    unsigned a = 0, b = 0, c = 0, d = 0;
    /* Leaf 1 ECX: OSXSAVE (27), AVX (28), F16C (29). */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 27)) || !(c & (1u << 28)) || !(c & (1u << 29))) return 0;
    /* XCR0 bits 1-2: the OS saves SSE and YMM state. */
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6u) != 6u) return 0;
    int v = 1;
    /* Leaf 7 subleaf 0 EBX bit 5: AVX2. */
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (b & (1u << 5)) v |= 2;
        /* EBX bits 16 (AVX512F), 30 (AVX512BW), 31 (AVX512VL); XCR0 bits 5-7: opmask, the
         * upper halves of ZMM0-15, ZMM16-31. */
        const unsigned avx512 = (1u << 16) | (1u << 30) | (1u << 31);
        if ((v & 2) && (b & avx512) == avx512 && (lo & 0xe0u) == 0xe0u) v |= 4;
        /* EBX bit 17: AVX512DQ; leaf 7 subleaf 1 EAX bit 5: AVX512_BF16. */
        const int dq = (b & (1u << 17)) != 0;
        const unsigned max_sub = a;
        if ((v & 4) && dq && max_sub >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            if (a & (1u << 5)) v |= 8;
        }
    }
    return v;
}
#else
static int probe(void) { return 0; }
#endif

static int features(void)
{
    static _Atomic int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        v = probe();
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

int ddp__cpu_has_avx_f16c(void) { return (features() & 1) != 0; }

int ddp__cpu_has_avx2_f16c(void) { return (features() & 3) == 3; }

int ddp__cpu_has_avx512(void) { return (features() & 7) == 7; }

int ddp__cpu_has_avx512_bf16(void) { return features() == 15; }

int ddp__cpu_is_intel(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu; /* "Genu" "ineI" "ntel" */
#else
    return 0;
#endif
}
