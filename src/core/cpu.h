/* Run-time CPU feature checks shared by the kernels that have an AVX/F16C variant. */
#ifndef DDP_CORE_CPU_H
#define DDP_CORE_CPU_H

/* 1 when the CPU has AVX and F16C and the OS saves YMM state (so target("avx,f16c") code may
 * run), else 0. Read once with CPUID/XGETBV and cached; always 0 off x86-64. */
int ddp__cpu_has_avx_f16c(void);

/* 1 when, in addition, the CPU has AVX2 (CPUID leaf 7, EBX bit 5): target("avx2,f16c") code may
 * run. Cached like ddp__cpu_has_avx_f16c. */
int ddp__cpu_has_avx2_f16c(void);

/* 1 when, in addition, the CPU has AVX-512 F, BW and VL (CPUID leaf 7 EBX bits 16, 30, 31) and
 * the OS saves the opmask and ZMM state (XCR0 bits 5-7): target("avx512f,avx512bw,avx512vl")
 * code may run. Cached like ddp__cpu_has_avx_f16c. */
int ddp__cpu_has_avx512(void);

/* 1 when, in addition, the CPU has AVX-512 DQ (CPUID leaf 7 EBX bit 17) and BF16 (leaf 7
 * subleaf 1 EAX bit 5): target("avx512dq,avx512bf16") code may run too. Cached likewise. */
int ddp__cpu_has_avx512_bf16(void);

/* 1 when CPUID's vendor string is "GenuineIntel", else 0 (always 0 off x86-64). */
int ddp__cpu_is_intel(void);

#endif
