/* One group's views of its peers' registrations (shm_map.h, the second half): which of them
 * this rank has mapped, agreed with every rank at collectives (shm_allreduce_mapped.c drives
 * the protocol), and the mappings themselves, opened through /proc/<pid>/fd/<fd> of the owner.
 * The exports they map are shm_map.c's. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/shm/shm_map.h"

ddp_status_t ddp__shm_views_init(ddp__shm_views_t *vs, int world, int rank)
{
    memset(vs, 0, sizeof *vs);
    vs->world = world;
    vs->rank = rank;
    vs->v = ddp__calloc((size_t)world * DDP__SHM_MAP_SLOTS, sizeof *vs->v,
                        "the registered-memory views");
    return vs->v ? DDP_OK : DDP_ERR_NO_MEMORY;
}

static void unmap_view(ddp__shm_view_t *v)
{
    if (v->base) munmap(v->base, v->bytes);
    v->base = NULL;
    v->bytes = 0;
}

void ddp__shm_views_release(ddp__shm_views_t *vs)
{
    if (!vs->v) return;
    for (size_t i = 0; i < (size_t)vs->world * DDP__SHM_MAP_SLOTS; i++) unmap_view(&vs->v[i]);
    free(vs->v);
    vs->v = NULL;
}

static ddp__shm_view_t *view_of(const ddp__shm_views_t *vs, int k, const ddp__shm_map_hint_t *h)
{
    return &vs->v[(size_t)k * DDP__SHM_MAP_SLOTS + (size_t)h->slot];
}

static int valid_hint(const ddp__shm_map_hint_t *h)
{
    return h->slot >= 0 && h->slot < DDP__SHM_MAP_SLOTS && h->gen != 0 && h->end > h->start;
}

int ddp__shm_views_ready(const ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf)
{
    int ready = 1;
    for (int k = 0; k < vs->world; k++) {
        for (int b = 0; b < nbuf; b++) {
            const ddp__shm_map_hint_t *h = &hints[k * nbuf + b];
            if (!valid_hint(h)) return -1;
            const ddp__shm_view_t *v = view_of(vs, k, h);
            if (v->gen == h->gen && v->state == DDP__SHM_VIEW_FAILED) return -1;
            if (v->gen != h->gen || v->state != DDP__SHM_VIEW_MAPPED) ready = 0;
        }
    }
    return ready;
}

/* Maps rank k's export described by h into v (replacing an older view of the slot). */
static int map_view(ddp__shm_view_t *v, int k, const ddp__shm_map_hint_t *h, int pid)
{
    unmap_view(v);
    v->gen = h->gen;
    v->state = DDP__SHM_VIEW_NONE;
    const size_t len = (size_t)(h->end - h->start);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, h->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        DDP_LOG(DDP_LOG_INFO, "shm: cannot open rank %d's registered memory (%s: %s)", k, path,
                strerror(errno));
        return 0;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != h->ino || (size_t)st.st_size < len) {
        DDP_LOG(DDP_LOG_INFO, "shm: %s is not rank %d's registered memory any more", path, k);
        close(fd);
        return 0;
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        DDP_LOG(DDP_LOG_INFO, "shm: cannot map rank %d's registered memory (%s)", k,
                strerror(err));
        return 0;
    }
    v->base = p;
    v->bytes = len;
    v->state = DDP__SHM_VIEW_MAPPED;
    return 1;
}

void ddp__shm_views_prune(ddp__shm_views_t *vs, int k, const uint32_t *live)
{
    for (int slot = 0; slot < DDP__SHM_MAP_SLOTS; slot++) {
        ddp__shm_view_t *v = &vs->v[(size_t)k * DDP__SHM_MAP_SLOTS + (size_t)slot];
        if (v->gen && v->gen != live[slot]) {
            unmap_view(v);
            memset(v, 0, sizeof *v);
        }
    }
}

int ddp__shm_views_prepare(ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf,
                           const int *pids)
{
    int ok = 1;
    for (int k = 0; k < vs->world && ok; k++) {
        if (k == vs->rank) continue;
        for (int b = 0; b < nbuf && ok; b++) {
            const ddp__shm_map_hint_t *h = &hints[k * nbuf + b];
            ddp__shm_view_t *v = view_of(vs, k, h);
            if (v->gen == h->gen && v->base) continue; /* mapped here already */
            ok = map_view(v, k, h, pids[k]);
        }
    }
    return ok;
}

void ddp__shm_views_settle(ddp__shm_views_t *vs, const ddp__shm_map_hint_t *hints, int nbuf,
                           int all_ok)
{
    for (int k = 0; k < vs->world; k++) {
        for (int b = 0; b < nbuf; b++) {
            const ddp__shm_map_hint_t *h = &hints[k * nbuf + b];
            ddp__shm_view_t *v = view_of(vs, k, h);
            if (v->gen != h->gen) unmap_view(v);
            v->gen = h->gen;
            if (all_ok && (k == vs->rank || v->base)) {
                v->state = DDP__SHM_VIEW_MAPPED;
            } else {
                v->state = DDP__SHM_VIEW_FAILED;
                unmap_view(v);
            }
        }
    }
}
