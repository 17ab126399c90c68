/* Registered memory for the shared-memory transport (ddp_group_register_memory): a process's
 * own buffers, moved in place onto memfds that its peers map, so that an allreduce reads and
 * writes every rank's buffer directly ("mapped", docs/shm-transport.md).
 *
 * Two halves. Exports are this process's registrations: process-wide (any shm group of the
 * process may use them), kept in a table under one lock, each a memfd now backing whole pages of
 * the caller's memory at their old addresses. Views are one group's mappings of its peers'
 * exports; which of them every rank holds is agreed state (changed only at collectives where
 * every rank saw the same hints), so the choice of the mapped path needs no extra phase once the
 * views exist. shm_allreduce_mapped.c owns the protocol; shm_map.c the exports (with
 * shm_watch.c, which hears when their pages go), shm_views.c the views. Not installed. */
#ifndef DDP_TRANSPORT_SHM_MAP_H
#define DDP_TRANSPORT_SHM_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "ddp/types.h"

/* Registrations per process. */
#define DDP__SHM_MAP_SLOTS 32

/* What a rank publishes about one buffer of a collective (in the segment, before its first
 * phase): the export holding it, or slot -1. Addresses are in the owner's address space. */
typedef struct ddp__shm_map_hint {
    uint64_t addr;       /* the buffer as passed to the collective */
    uint64_t start, end; /* the export's pages */
    uint64_t ino;        /* the memfd's inode, so a peer opening /proc/<pid>/fd/<fd> can tell */
    int32_t slot;
    uint32_t gen;
    int32_t fd;
    int32_t pad;
} ddp__shm_map_hint_t;

/* Registers [ptr, ptr + bytes) (see ddp_group_register_memory). Thread-safe. */
ddp_status_t ddp__shm_map_register(void *ptr, size_t bytes);
/* Undoes it: the pages become private anonymous memory again with the same bytes. */
ddp_status_t ddp__shm_map_unregister(void *ptr);

/* DDP_SHM_MAP=auto: registers [p, p + bytes) if it is a buffer seen before in private anonymous
 * memory (a malloc chunk of its own mapping or in a heap), where malloc is glibc's and the kernel
 * has PROCMAP_QUERY to notice when it is freed. Returns 1 when registered now. A registration
 * made this way is never moved back, only forgotten (shm_map.c says why). */
int ddp__shm_map_auto(const void *p, size_t bytes);
/* Whether ddp__shm_map_auto can register anything here (glibc's malloc and PROCMAP_QUERY; not
 * under ASan or TSan, whose malloc is their own). For tests. */
int ddp__shm_map_auto_available(void);

/* For tests: whether the registration holding p is watched (shm_watch.c), and how many times
 * this process asked the kernel whether a registration is still in place. */
int ddp__shm_map_watched(const void *p);
uint64_t ddp__shm_map_kernel_checks(void);

/* This process's registrations: gens[slot] (0: none); returns a counter that changes whenever
 * they do. */
uint32_t ddp__shm_map_live(uint32_t gens[DDP__SHM_MAP_SLOTS]);

/* The hint for a collective buffer [p, p + bytes): an export whose pages cover all of it but
 * less than a page at each end, still backing those addresses. Returns 0 (hint->slot = -1)
 * when there is none. Cheap: a table scan and, unless the watch heard nothing since the last
 * time (shm_watch.c), one PROCMAP_QUERY ioctl where the kernel has it. */
int ddp__shm_map_find(const void *p, size_t bytes, ddp__shm_map_hint_t *hint);

/* One group's views of its peers' exports, by (rank, slot). Agreed: changed only through
 * ddp__shm_map_settle, which every rank calls at the same collective with the same hints. */
typedef struct ddp__shm_view {
    uint32_t gen;  /* of the export this entry is about (0: none) */
    int state;     /* DDP__SHM_VIEW_* */
    char *base;    /* this rank's mapping of it (peers' exports only) */
    size_t bytes;
} ddp__shm_view_t;

enum { DDP__SHM_VIEW_NONE, DDP__SHM_VIEW_MAPPED, DDP__SHM_VIEW_FAILED };

typedef struct ddp__shm_views {
    int world, rank;
    ddp__shm_view_t *v; /* [world][DDP__SHM_MAP_SLOTS]; own rank's entries have no mapping */
} ddp__shm_views_t;

ddp_status_t ddp__shm_views_init(ddp__shm_views_t *vs, int world, int rank);
void ddp__shm_views_release(ddp__shm_views_t *vs);

/* After a first phase in which every rank published hints for its `nbuf` buffers
 * (hints[rank * nbuf + b], slot >= 0 everywhere): 1 when every rank already agreed on views of
 * every one of them (the mapped path may run now), 0 when views are missing (call
 * ddp__shm_views_prepare, exchange its verdict, then settle), -1 when one of them failed before
 * (every rank falls back, no extra phase). The same answer on every rank. */
int ddp__shm_views_ready(const ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf);

/* Maps the missing views (pids[rank]: the owners' processes). Returns 1 when every one of them
 * is mapped, 0 when one failed (logged at info, not an error: the collective falls back). */
int ddp__shm_views_prepare(ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf,
                           const int *pids);

/* Every rank, with every rank's verdict `all_ok`: records the views as agreed (mapped or
 * failed; failed ones are unmapped). */
void ddp__shm_views_settle(ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf,
                           int all_ok);

/* Drops this rank's views of rank k's registrations that are not in `live` (its gens by slot):
 * their memory was freed there, and a mapping here would keep it. Generations never come back,
 * so this needs no agreement. */
void ddp__shm_views_prune(ddp__shm_views_t *vs, int k, const uint32_t *live);

/* This rank's address of byte `addr` (owner's address) of rank k's buffer described by `h`,
 * which must be agreed mapped (own rank: the address itself). */
static inline char *ddp__shm_view_at(const ddp__shm_views_t *vs, int k,
                                     const ddp__shm_map_hint_t *h, uint64_t addr)
{
    if (k == vs->rank) return (char *)(uintptr_t)addr;
    const ddp__shm_view_t *v = &vs->v[(size_t)k * DDP__SHM_MAP_SLOTS + (size_t)h->slot];
    return v->base + (addr - h->start);
}

#endif
