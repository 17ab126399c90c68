/* Single-copy transfers for the shared-memory transport: a rank reads its peers' own (malloc)
 * buffers directly with Linux cross-memory attach (process_vm_readv) instead of staging them
 * through the segment. shm_allreduce.c and the collectives' files own the protocol (phases,
 * agreement); this file owns the kernel calls, the permission set-up and the huge-page
 * registration cache. Not installed. */
#ifndef DDP_TRANSPORT_SHM_CMA_H
#define DDP_TRANSPORT_SHM_CMA_H

#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "ddp/types.h"

#define DDP__SHM_CMA_CACHE 16

/* One buffer range this rank has passed to single-copy collectives (see ddp__shm_cma_register). */
typedef struct ddp__shm_cma_range {
    uintptr_t start, end;
    uint32_t uses;
    int collapsed; /* 1: asked the kernel to back it with huge pages (done once) */
} ddp__shm_cma_range_t;

typedef struct ddp__shm_cma {
    int hugepages;     /* DDP_SHM_CMA_HUGEPAGES */
    char *scratch;     /* per peer, `scratch_bytes` for the pieces read before a reduction */
    size_t scratch_bytes;
    int scratch_peers;
    ddp__shm_cma_range_t ranges[DDP__SHM_CMA_CACHE];
    unsigned next_victim;
} ddp__shm_cma_t;

/* Lets the group's peers read this process's memory where Yama's ptrace_scope is 1 (only
 * descendants may, unless the process names a tracer: PR_SET_PTRACER_ANY). Nothing to do where
 * Yama is absent or 0; under 2 or 3 no process may, and the probe finds the refusal. */
void ddp__shm_cma_allow_peers(void);

/* Reads `bytes` at `remote` in process `pid` into `local`, retrying short reads. On failure
 * returns DDP_ERR_SYSTEM (or DDP_ERR_REMOTE when the process is gone) naming `what` and the
 * errno; *err_out gets the errno (0 on success). */
ddp_status_t ddp__shm_cma_read(int pid, void *local, uintptr_t remote, size_t bytes,
                               const char *what, int *err_out);

/* Records that [p, p + bytes) takes part in a single-copy collective. The second time a range
 * is seen (a buffer reused, as training loops reuse their gradients), and if huge pages are
 * enabled, the 2 MiB-aligned pages inside it are collapsed into transparent huge pages
 * (MADV_COLLAPSE): the kernel then pins a peer's pages for process_vm_readv in 2 MiB units,
 * which doubles its speed (docs/shm-transport.md). Content is unchanged; failures are ignored
 * (the copy works on small pages, only slower). Returns the nanoseconds the collapse took (0 when
 * none), which the tuner leaves out of the call's time: it is paid once per buffer. */
int64_t ddp__shm_cma_register(ddp__shm_cma_t *cma, const void *p, size_t bytes);

/* dst[0..n) = op over ranks 0..p-1 (in rank order) of element [lo + i] of every rank's send
 * buffer: rank `me`'s from `own` (already offset to lo), the others' read from their `sends[j]`
 * (addresses in process pids[j], not offset) piece by piece into scratch memory. `stream`: write
 * dst with non-temporal stores. Bitwise the same as reducing the same sources with
 * ddp__reduce (the same kernel, the same order). */
ddp_status_t ddp__shm_cma_reduce(ddp__shm_cma_t *cma, const int *pids, const uintptr_t *sends,
                                 int me, int p, const void *own, void *dst, size_t lo, size_t n,
                                 ddp_dtype_t dtype, ddp_reduce_op_t op, int stream);

void ddp__shm_cma_release(ddp__shm_cma_t *cma);

#endif
