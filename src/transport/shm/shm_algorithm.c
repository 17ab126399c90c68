/* The names of the shared-memory transport's algorithms (shm_algorithm.h): what
 * ddp_group_algorithm answers and what the tuner logs and traces. */
#include "transport/shm/shm_algorithm.h"

static const char *const names[DDP__SHM_ALGORITHMS] = {
    [DDP__SHM_ALG_STAGED_NT] = "staged:nt",
    [DDP__SHM_ALG_STAGED_PLAIN] = "staged:plain",
    [DDP__SHM_ALG_ONESHOT] = "one-shot",
    [DDP__SHM_ALG_CMA] = "single-copy",
    [DDP__SHM_ALG_ROUNDS] = "rounds",
    [DDP__SHM_ALG_STAGED_NT_SHORT] = "staged:nt:short",
    [DDP__SHM_ALG_STAGED_PLAIN_LONG] = "staged:plain:long",
    [DDP__SHM_ALG_MAILBOX] = "mailbox",
    [DDP__SHM_ALG_ZERO_COPY] = "zero-copy",
    [DDP__SHM_ALG_MAPPED] = "mapped",
    [DDP__SHM_ALG_BARRIER] = "barrier",
};

const char *ddp__shm_algorithm_name(int algorithm)
{
    return algorithm >= 0 && algorithm < DDP__SHM_ALGORITHMS ? names[algorithm] : "none";
}
