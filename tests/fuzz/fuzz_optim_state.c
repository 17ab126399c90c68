/* Fuzz target for libddp's optimizer state blobs (src/shard/optim.c, zero.c) as `--resume`
 * hands them over from a checkpoint: ddp_optim_state_load into SGD (momentum), Adam (amsgrad)
 * and AdamW, and ddp_zero_state_load (a rank's shard or a consolidated state) into ZeRO at
 * stages 1 and 2, over the parameters of fuzz_setups.h. Each input is tried as it is and with
 * its closing checksum recomputed, so the fuzzer reaches the records behind the checksum. A load
 * returns DDP_OK or an error with a message; a load the plain optimizer rejects changes nothing
 * (its state saved before and after is the same). */
#include "fuzz_common.h"
#include "fuzz_setups.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static fuzz_optims_t f;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    if (fuzz_optims_create(&f) != 0) {
        fprintf(stderr, "fuzz_optim_state: set-up failed: %s\n", ddp_last_error());
        abort();
    }
    return 0;
}

static void load_all(const uint8_t *data, size_t size)
{
    /* A NULL buffer for an empty input would be an argument error, not a parse. */
    static const uint8_t empty[1];
    const void *buf = size ? (const void *)data : (const void *)empty;
    for (int k = 0; k < FUZZ_NOPTIMS; k++) {
        size_t bytes = 0;
        FUZZ_MUST(ddp_optim_state_size(f.optim[k], &bytes) == DDP_OK, "state size");
        uint8_t *before = malloc(bytes), *after = malloc(bytes);
        FUZZ_MUST(before && after, "memory");
        FUZZ_MUST(ddp_optim_state_save(f.optim[k], before, bytes) == DDP_OK, "state save");
        ddp_status_t s = ddp_optim_state_load(f.optim[k], buf, size);
        if (s != DDP_OK) {
            FUZZ_FAILED_WELL(s);
            FUZZ_MUST(ddp_optim_state_save(f.optim[k], after, bytes) == DDP_OK, "state save");
            FUZZ_MUST(memcmp(before, after, bytes) == 0, "a rejected load changes nothing");
        }
        free(before);
        free(after);
    }
    for (int k = 0; k < FUZZ_NZEROS; k++) {
        ddp_status_t s = ddp_zero_state_load(f.zero[k], buf, size);
        if (s != DDP_OK) FUZZ_FAILED_WELL(s);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    load_all(data, size);
    uint8_t *fixed = fuzz_restamped(data, size);
    if (fixed) {
        load_all(fixed, size);
        free(fixed);
    }
    return 0;
}
