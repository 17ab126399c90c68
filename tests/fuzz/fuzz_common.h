/* What the fuzz targets share: an invariant check that stops the run (a finding), and the check
 * that a failed call left a message. */
#ifndef DDP_FUZZ_COMMON_H
#define DDP_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ddp/ddp.h>

#define FUZZ_MUST(cond, what)                                                                    \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: invariant broken: %s (last error: %s)\n", __FILE__,       \
                    __LINE__, what, ddp_last_error());                                          \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

/* A failed call returns a negative status with a message saying what is wrong. */
#define FUZZ_FAILED_WELL(status)                                                                 \
    FUZZ_MUST((status) < 0 && ddp_last_error()[0] != 0, "an error has a status and a message")

/* FNV-1a 64 (the checksum that closes libddp's optimizer and PowerSGD state blobs and the GPT
 * trainer's checkpoint): the targets recompute it over a mutated input, so that the fuzzer gets
 * past the checksum to the fields behind it. */
static inline uint64_t fuzz_fnv1a(uint64_t h, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define FUZZ_FNV_INIT 0xcbf29ce484222325ull

/* A copy of data whose last 8 bytes are the FNV-1a of the rest (NULL when size < 8). */
static inline uint8_t *fuzz_restamped(const uint8_t *data, size_t size)
{
    if (size < 8) return NULL;
    uint8_t *copy = malloc(size);
    if (!copy) return NULL;
    memcpy(copy, data, size);
    uint64_t sum = fuzz_fnv1a(FUZZ_FNV_INIT, copy, size - 8);
    memcpy(copy + size - 8, &sum, 8);
    return copy;
}

#endif
