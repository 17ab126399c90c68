/* Fuzz target for the GPT trainer's checkpoint reader (examples/gpt/checkpoint.c,
 * gpt_checkpoint_read, what --resume runs) and, when it accepts a file, libddp's optimizer
 * loading the state it holds (ddp_optim_state_load into the trainer's AdamW, as main.c does).
 * Each input is written to a file and read as it is and with its closing FNV-1a checksum
 * recomputed. A read returns 0 or -1 with a message, and never allocates more than the file
 * holds. */
#define FUZZ_WITH_GPT 1
#include "fuzz_checkpoint_file.h"
#include "fuzz_common.h"
#include "fuzz_setups.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static gpt_t model;
static ddp_param_t *params;
static uint32_t *groups;
static ddp_optim_t *optim;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[256];
    gpt_config_t c = fuzz_gpt_config();
    if (fuzz_file_init("fuzz_gpt_checkpoint") != 0 || gpt_create(&c, 1, 1, &model, err, sizeof err))
        abort();
    params = calloc(model.ntensors, sizeof *params);
    groups = calloc(model.ntensors, sizeof *groups);
    if (!params || !groups || fuzz_gpt_optim(&model, params, groups, &optim) != DDP_OK) abort();
    return 0;
}

static void read_one(const uint8_t *data, size_t size)
{
    fuzz_file_write(data, size);
    gpt_ckpt_header_t want = fuzz_gpt_header(model.nparams);
    void *state = NULL;
    size_t bytes = 0;
    uint64_t steps = 0;
    char err[1024] = "";
    if (gpt_checkpoint_read(fuzz_path, &want, 10, model.params, &state, &bytes, &steps, err,
                            sizeof err) != 0) {
        FUZZ_MUST(err[0] != 0, "a refused checkpoint has a message");
        /* A state size the file cannot hold is refused for that, never by trying to allocate
         * it (the reader once malloc'd up to 1 TiB on the header's word). */
        FUZZ_MUST(strstr(err, "out of memory") == NULL, "no allocation beyond the file");
        return;
    }
    FUZZ_MUST(bytes <= size && steps <= 10, "what was read lies within the file and the run");
    ddp_status_t s = ddp_optim_state_load(optim, state, bytes);
    if (s != DDP_OK) FUZZ_FAILED_WELL(s);
    free(state);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 20)) return 0;
    read_one(data, size);
    /* The checksum is the FNV-1a 64 of everything before it, from the same offset basis. */
    uint8_t *fixed = fuzz_restamped(data, size);
    if (fixed) {
        /* The state blob inside has its own checksum: recompute it too when the header's size
         * field places it inside the file. */
        if (size >= sizeof(gpt_ckpt_header_t) + 8) {
            gpt_ckpt_header_t h;
            memcpy(&h, fixed, sizeof h);
            uint64_t at = sizeof h + h.nparams * sizeof(float);
            if (h.nparams < size && h.state_bytes >= 8 && at <= size - 8 &&
                h.state_bytes <= size - 8 - at) {
                uint8_t *blob = fixed + at;
                uint64_t sum = fuzz_fnv1a(FUZZ_FNV_INIT, blob, (size_t)h.state_bytes - 8);
                memcpy(blob + h.state_bytes - 8, &sum, 8);
                sum = fuzz_fnv1a(FUZZ_FNV_INIT, fixed, size - 8);
                memcpy(fixed + size - 8, &sum, 8);
            }
        }
        read_one(fixed, size);
        free(fixed);
    }
    return 0;
}
