/* The texts the shared-memory transport's ranks exchange through the store: rank 0's description
 * of a memfd ("pid fd bytes" for the group segment, "pid fd total asked" for a segment buffer)
 * and a peer's answer with the size it asked for. They come from another process, so they are
 * parsed strictly here, apart from the mapping, where tests/fuzz/fuzz_shm_desc.c reaches them. */
#ifndef DDP_TRANSPORT_SHM_DESC_H
#define DDP_TRANSPORT_SHM_DESC_H

#include <stddef.h>

typedef struct ddp__shm_desc {
    int pid;                  /* rank 0's process id: >= 1 */
    int fd;                   /* its descriptor of the memfd: >= 0 */
    unsigned long long total; /* bytes of the memfd */
    unsigned long long asked; /* a buffer's size as rank 0 asked for it (4-field form only) */
} ddp__shm_desc_t;

/* Parses text[0 .. len) (a NUL ends it early) as `fields` (3 or 4) unsigned decimal numbers
 * separated by single spaces, nothing else: "pid fd total" or "pid fd total asked". pid must be
 * in 1..INT_MAX, fd in 0..INT_MAX, the sizes at most SIZE_MAX. Returns 0, or -1 for anything
 * else (no number overflows, nothing is allocated). */
int ddp__shm_desc_parse(const char *text, size_t len, int fields, ddp__shm_desc_t *out);

/* Parses a peer's answer: one unsigned decimal number of at most SIZE_MAX, nothing else.
 * Returns 0 or -1. */
int ddp__shm_size_parse(const char *text, size_t len, unsigned long long *out);

#endif
