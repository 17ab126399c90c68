/* Single-copy transfers of the shared-memory transport (cross-memory attach): the kernel calls,
 * the ptrace permission a peer needs, and the registration cache that backs reused buffers with
 * huge pages. The protocol that makes these reads safe is in shm_allreduce.c
 * (ddp__shm_allreduce_cma) and docs/shm-transport.md ("Single-copy allreduce"). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/shm/shm_cma.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

#define HUGE_PAGE ((uintptr_t)2 << 20)
/* Scratch per peer for the pieces of a reduction: small enough that all peers' pieces and the
 * output block stay in L2 while they are reduced (measured no faster above 128 KiB). */
#ifndef PIECE_BYTES_MAX
#define PIECE_BYTES_MAX ((size_t)128 << 10)
#endif
#define PIECE_BYTES_MIN ((size_t)16 << 10)
#ifndef SCRATCH_TOTAL
#define SCRATCH_TOTAL ((size_t)512 << 10)
#endif

void ddp__shm_cma_allow_peers(void)
{
    FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
    if (!f) return; /* no Yama: same-user processes may read each other */
    int scope = -1;
    if (fscanf(f, "%d", &scope) != 1) scope = -1;
    fclose(f);
    /* Scope 1 is the only one a process can relax for itself. ANY, because a process names at
     * most one tracer and it has several peers; it admits only processes of the same user that
     * could otherwise read /proc/<pid>/mem after a fork anyway. */
    if (scope == 1) (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
}

ddp_status_t ddp__shm_cma_read(int pid, void *local, uintptr_t remote, size_t bytes,
                               const char *what, int *err_out)
{
    char *to = local;
    size_t done = 0;
    *err_out = 0;
    while (done < bytes) {
        struct iovec l = {to + done, bytes - done};
        struct iovec r = {(void *)(remote + done), bytes - done};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            int err = got < 0 ? errno : EFAULT;
            *err_out = err;
            return ddp__error_errno(err == ESRCH ? DDP_ERR_REMOTE : DDP_ERR_SYSTEM, err,
                                    "shm: reading %zu bytes of %s at %#lx in pid %d "
                                    "(process_vm_readv)",
                                    bytes - done, what, (unsigned long)(remote + done), pid);
        }
        done += (size_t)got;
    }
    return DDP_OK;
}

int64_t ddp__shm_cma_register(ddp__shm_cma_t *cma, const void *p, size_t bytes)
{
    uintptr_t start = (uintptr_t)p, end = start + bytes;
    ddp__shm_cma_range_t *hit = NULL;
    for (int i = 0; i < DDP__SHM_CMA_CACHE; i++)
        if (cma->ranges[i].start == start && cma->ranges[i].end == end) hit = &cma->ranges[i];
    if (!hit) {
        /* Round robin: a buffer seen once and never again ages out without a collapse. */
        hit = &cma->ranges[cma->next_victim++ % DDP__SHM_CMA_CACHE];
        *hit = (ddp__shm_cma_range_t){.start = start, .end = end};
    }
    hit->uses++;
    /* The second use: a buffer allocated for one call and freed is not worth a collapse (a few
     * ms for 32 MiB); one that comes back is. A buffer freed and a new one allocated at the same
     * place keeps its entry and runs on small pages: slower, never wrong. */
    if (!cma->hugepages || hit->collapsed || hit->uses < 2) return 0;
    hit->collapsed = 1;
    uintptr_t a = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), b = end & ~(HUGE_PAGE - 1);
    if (b <= a) return 0;
    /* Only whole huge pages inside the caller's range: every small page they cover belongs to
     * the buffer, which this collective reads or writes in full anyway. */
    int64_t t0 = ddp__now_ns();
    int r1 = madvise((void *)a, b - a, MADV_HUGEPAGE);
    int e1 = r1 ? errno : 0;
    int r2 = madvise((void *)a, b - a, MADV_COLLAPSE);
    int e2 = r2 ? errno : 0;
    int64_t spent = ddp__now_ns() - t0;
    DDP_LOG(DDP_LOG_DEBUG,
            "shm: huge pages for the buffer %#lx + %zu bytes: MADV_HUGEPAGE %s, MADV_COLLAPSE %s "
            "(%.2f ms)",
            (unsigned long)start, bytes, r1 ? strerror(e1) : "ok", r2 ? strerror(e2) : "ok",
            (double)spent / 1e6);
    return spent;
}

static size_t piece_bytes_for(int p)
{
    size_t piece = p > 1 ? SCRATCH_TOTAL / (size_t)(p - 1) : PIECE_BYTES_MAX;
    if (piece > PIECE_BYTES_MAX) piece = PIECE_BYTES_MAX;
    if (piece < PIECE_BYTES_MIN) piece = PIECE_BYTES_MIN;
    return piece & ~(size_t)63;
}

ddp_status_t ddp__shm_cma_reduce(ddp__shm_cma_t *cma, const int *pids, const uintptr_t *sends,
                                 int me, int p, const void *own, void *dst, size_t lo, size_t n,
                                 ddp_dtype_t dtype, ddp_reduce_op_t op, int stream)
{
    const size_t esize = ddp_dtype_size(dtype);
    const size_t piece_bytes = piece_bytes_for(p);
    if (!cma->scratch || cma->scratch_peers < p - 1) {
        free(cma->scratch);
        cma->scratch = NULL;
        if (p > 1 && posix_memalign((void **)&cma->scratch, 4096, piece_bytes * (size_t)(p - 1)))
            return ddp__error(DDP_ERR_NO_MEMORY, "shm: %zu bytes of single-copy scratch",
                              piece_bytes * (size_t)(p - 1));
        cma->scratch_bytes = piece_bytes;
        cma->scratch_peers = p - 1;
    }
    const size_t piece = piece_bytes / esize;
    const void *srcs[64];
    for (size_t o = 0; o < n; o += piece) {
        size_t k = n - o < piece ? n - o : piece;
        int slot = 0;
        for (int j = 0; j < p; j++) {
            if (j == me) {
                srcs[j] = (const char *)own + o * esize;
                continue;
            }
            char *to = cma->scratch + (size_t)slot++ * cma->scratch_bytes;
            int err;
            ddp_status_t s = ddp__shm_cma_read(pids[j], to, sends[j] + (lo + o) * esize,
                                               k * esize, "a peer's send buffer", &err);
            if (s != DDP_OK) return ddp__error_context(s, "rank %d's data", j);
            srcs[j] = to;
        }
        void *dsts[1] = {(char *)dst + o * esize};
        ddp__reduce_multi_stream(dsts, 1, stream ? 1u : 0u, srcs, p, k, dtype, op);
    }
    return DDP_OK;
}

void ddp__shm_cma_release(ddp__shm_cma_t *cma)
{
    free(cma->scratch);
    cma->scratch = NULL;
    cma->scratch_peers = 0;
}
