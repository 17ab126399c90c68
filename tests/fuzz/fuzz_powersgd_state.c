/* Fuzz target for PowerSGD's saved state (src/hooks/powersgd/powersgd.c) as `--resume` hands it
 * over from a checkpoint: ddp_powersgd_state_load into a fresh state of fuzz_setups.h's config,
 * as it is and with its closing checksum recomputed. The bucket records it holds (layouts, Q,
 * residuals) are planned back as the hook would plan them: whatever they claim, the load returns
 * DDP_OK or an error with a message and allocates no more than the blob's size implies. */
#define FUZZ_WITH_POWERSGD 1
#include <stdlib.h> /* defines __GLIBC__ on glibc */
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "fuzz_common.h"
#include "fuzz_setups.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Bytes the process holds on the heap (glibc; 0 elsewhere, and under ASan, whose allocator glibc
 * does not see: there -malloc_limit_mb bounds each allocation instead). */
static size_t heap_held(void)
{
#ifdef __GLIBC__
    struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
#else
    return 0;
#endif
}

static void load(const uint8_t *data, size_t size)
{
    ddp_powersgd_config_t c = fuzz_powersgd_config();
    ddp_powersgd_state_t *st = NULL;
    FUZZ_MUST(ddp_powersgd_state_create(&c, &st) == DDP_OK, "state create");
    size_t before = heap_held();
    static const uint8_t empty[1];
    ddp_status_t s = ddp_powersgd_state_load(st, size ? (const void *)data : (const void *)empty,
                                             size);
    if (s != DDP_OK) {
        FUZZ_FAILED_WELL(s);
    } else {
        /* A loaded state holds P, Q, the uncompressed span and the residual of each bucket:
         * with the config's rank 2 at most about 6 times the elements the blob carries. */
        size_t held = heap_held() - before;
        FUZZ_MUST(held <= 16 * size + 65536, "a loaded state's memory is bounded by the blob's");
        /* What loaded saves again, to a blob of the size it reports. */
        size_t bytes = 0;
        FUZZ_MUST(ddp_powersgd_state_size(st, &bytes) == DDP_OK, "state size");
        void *again = malloc(bytes ? bytes : 1);
        FUZZ_MUST(again && ddp_powersgd_state_save(st, again, bytes) == DDP_OK, "state save");
        free(again);
    }
    ddp_powersgd_state_destroy(st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    load(data, size);
    uint8_t *fixed = fuzz_restamped(data, size);
    if (fixed) {
        load(fixed, size);
        free(fixed);
    }
    return 0;
}
