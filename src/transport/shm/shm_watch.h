/* Watching registered pages (for shm_map.c): the kernel tells this process, through a
 * userfaultfd, whenever pages it watches are unmapped or moved, so that the check that a
 * registration still backs its addresses needs no system call while nothing of the kind
 * happened. shm_watch.c says how, and what it cannot see. Not installed. */
#ifndef DDP_TRANSPORT_SHM_WATCH_H
#define DDP_TRANSPORT_SHM_WATCH_H

#include <stddef.h>
#include <stdint.h>

/* Watches [start, start + len), a whole mapping of a memfd: 1 when watched from now on, 0 when
 * this kernel or process cannot (no userfaultfd, or none that may watch shared memory). The
 * caller serialises calls (shm_map.c's lock). Unmapping or moving the pages ends the watch. */
int ddp__shm_watch_add(uintptr_t start, size_t len);

/* Changes whenever watched pages were unmapped or moved: read it before checking a registration
 * the slow way, and trust the result for as long as it reads the same. Odd while such a change
 * is being reported: never trust that. */
uint64_t ddp__shm_watch_epoch(void);

/* In a child after fork(): the watch belongs to the parent's memory; the child has none. */
void ddp__shm_watch_forked(void);

#endif
