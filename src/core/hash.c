/* FNV-1a over bytes: the checksum of libddp's saved states (optimizer, ZeRO, FSDP, PowerSGD). */
#include "core/internal.h"

uint64_t ddp__fnv1a(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
