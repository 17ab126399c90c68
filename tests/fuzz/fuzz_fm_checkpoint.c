/* Fuzz target for the Fashion-MNIST trainer's checkpoint reader (examples/fashion-mnist/
 * checkpoint.c, fm_checkpoint_load, what --resume runs): each input is written to a file and
 * loaded with each of fuzz_setups.h's three settings (the trainer's SGD, its Adam, libddp's
 * AdamW with PowerSGD states), as it is and with its closing CRC-32 recomputed, so the fuzzer
 * gets past the checksum to the length-prefixed parts behind it. A load returns 0 or -1 with a
 * message; blobs it returns lie within the file. */
#include <zlib.h>

#define FUZZ_WITH_FM 1
#include "fuzz_checkpoint_file.h"
#include "fuzz_common.h"
#include "fuzz_setups.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static fm_mlp_t model;
static fm_optim_t opt[2];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    if (fuzz_file_init("fuzz_fm_checkpoint") != 0 || fm_mlp_create(FUZZ_FM_HIDDEN, 1, 1, &model))
        abort();
    for (int k = 0; k < 2; k++) {
        opt[k].kind = k == 0 ? FM_OPTIM_SGD : FM_OPTIM_ADAM;
        if (fm_optim_create(&opt[k], model.numel)) abort();
    }
    return 0;
}

static void load_all(const uint8_t *data, size_t size)
{
    fuzz_file_write(data, size);
    for (int which = 0; which < FUZZ_FM_CONFIGS; which++) {
        fm_hyper_t h = fuzz_fm_hyper(which);
        fm_progress_t progress;
        fm_extra_t extra = {0};
        char err[1024] = "";
        int rc = fm_checkpoint_load(fuzz_path, &h, &progress, &model, &opt[which == 1], &extra,
                                    err, sizeof err);
        if (rc != 0) {
            FUZZ_MUST(rc == -1 && err[0] != 0, "a refused checkpoint has a message");
            continue;
        }
        size_t blobs = extra.optim_state_bytes;
        for (uint64_t r = 0; r < extra.hook_ranks; r++) blobs += extra.hook_state_bytes[r];
        FUZZ_MUST(blobs <= size, "the blobs lie within the file");
        fm_extra_free(&extra);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 20)) return 0;
    load_all(data, size);
    if (size >= 4) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
        crc = (uint32_t)crc32(crc, fixed, (unsigned)(size - 4));
        memcpy(fixed + size - 4, &crc, 4);
        load_all(fixed, size);
        free(fixed);
    }
    return 0;
}
