/* Registered memory of the shared-memory transport: moving a caller's pages onto a memfd in
 * place, checking that they are still there, and mapping peers' exports. Why and how the
 * allreduce uses them: shm.c (run_allreduce_mapped) and docs/shm-transport.md ("Registered
 * memory").
 *
 * Moving pages in place: the memfd is mapped somewhere, the pages' bytes are copied into it, and
 * mremap moves that mapping over the caller's range in one step (the old pages are released). The
 * caller sees the same bytes at the same addresses; the difference is that the memory is now
 * shared, which is what lets a peer map it. Only whole pages inside the registered range move:
 * the partial pages at its ends may hold other objects, which other threads may be writing while
 * the bytes are copied. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/shm/shm_map.h"

#define PAGE ((uintptr_t)4096)

/* PROCMAP_QUERY (Linux 6.11): one memory area of this process by address, without reading
 * /proc/self/maps. Declared here because Debian 12's kernel headers predate it. */
struct ddp_procmap_query {
    uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size,
        vma_offset, inode;
    uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
    uint64_t vma_name_addr, build_id_addr;
};
#define DDP_PROCMAP_QUERY _IOWR('f', 17, struct ddp_procmap_query)
#define VMA_READABLE 0x01u
#define VMA_WRITABLE 0x02u
#define VMA_SHARED 0x08u

typedef struct export {
    uintptr_t user, user_end; /* as registered */
    uintptr_t start, end;     /* the whole pages moved onto the memfd */
    int fd;                   /* open while registered: peers open /proc/<pid>/fd/<fd> */
    uint32_t gen;             /* 0: slot free */
    uint64_t ino;
} export_t;

static pthread_mutex_t exports_mu = PTHREAD_MUTEX_INITIALIZER;
static export_t exports[DDP__SHM_MAP_SLOTS];
static uint32_t last_gen;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int maps_fd = -1; /* /proc/self/maps for PROCMAP_QUERY; -1: the kernel has none */

/* ---- this process's memory areas ---------------------------------------------------------- */

typedef struct area {
    uintptr_t start, end;
    unsigned flags; /* VMA_* */
    uint64_t ino;   /* 0: anonymous */
    uint64_t offset;
    char name[32];  /* "[stack]" and the like; "" for plain anonymous memory */
} area_t;

static void fork_child(void);

static void init_once(void)
{
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        struct ddp_procmap_query q;
        memset(&q, 0, sizeof q);
        q.size = sizeof q;
        q.query_addr = (uint64_t)(uintptr_t)&maps_fd;
        if (ioctl(fd, DDP_PROCMAP_QUERY, &q) == 0) {
            maps_fd = fd;
        } else {
            close(fd);
        }
    }
    /* A child forked after registration gets private copies (fork_child). */
    pthread_atfork(NULL, NULL, fork_child);
}

/* The area holding addr: 1 found, 0 not mapped, -1 cannot tell. */
static int area_at(uintptr_t addr, area_t *a)
{
    memset(a, 0, sizeof *a);
    if (maps_fd >= 0) {
        struct ddp_procmap_query q;
        memset(&q, 0, sizeof q);
        q.size = sizeof q;
        q.query_addr = addr;
        q.vma_name_addr = (uint64_t)(uintptr_t)a->name;
        q.vma_name_size = sizeof a->name;
        if (ioctl(maps_fd, DDP_PROCMAP_QUERY, &q) != 0) {
            a->name[0] = 0;
            return errno == ENOENT ? 0 : -1;
        }
        a->start = q.vma_start;
        a->end = q.vma_end;
        a->flags = (unsigned)q.vma_flags;
        a->ino = q.inode;
        a->offset = q.vma_offset;
        a->name[q.vma_name_size ? sizeof a->name - 1 : 0] = 0;
        return 1;
    }
    /* Older kernels: read the text. Only registration and unregistration come here. */
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return -1;
    char line[512];
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, off, ino;
        char perms[8], dev[16];
        int name_at = 0;
        if (sscanf(line, "%llx-%llx %7s %llx %15s %llu %n", &lo, &hi, perms, &off, dev, &ino,
                   &name_at) < 6)
            continue;
        if (addr < lo || addr >= hi) continue;
        a->start = (uintptr_t)lo;
        a->end = (uintptr_t)hi;
        a->flags = (perms[0] == 'r' ? VMA_READABLE : 0u) | (perms[1] == 'w' ? VMA_WRITABLE : 0u) |
                   (perms[3] == 's' ? VMA_SHARED : 0u);
        a->ino = ino;
        a->offset = off;
        if (name_at > 0) {
            snprintf(a->name, sizeof a->name, "%s", line + name_at);
            a->name[strcspn(a->name, "\n")] = 0;
        }
        found = 1;
        break;
    }
    fclose(f);
    return found;
}

/* Whether [start, end) is private anonymous read-write memory (what may be moved). On failure
 * sets the error text naming what is there instead. */
static ddp_status_t check_movable(uintptr_t start, uintptr_t end)
{
    for (uintptr_t at = start; at < end;) {
        area_t a;
        int r = area_at(at, &a);
        if (r < 0)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "register_memory: cannot read this process's memory map");
        if (r == 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "register_memory: address %p is not mapped", (void *)at);
        if (a.ino != 0 || (a.flags & VMA_SHARED) || (a.name[0] == '[' && strcmp(a.name, "[heap]")))
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "register_memory: %p lies in %s%s%s memory, not private anonymous "
                              "memory (malloc, or mmap MAP_PRIVATE|MAP_ANONYMOUS)",
                              (void *)at, a.flags & VMA_SHARED ? "shared " : "",
                              a.ino ? "file-backed " : "", a.name[0] ? a.name : "");
        if ((a.flags & (VMA_READABLE | VMA_WRITABLE)) != (VMA_READABLE | VMA_WRITABLE))
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "register_memory: %p is not readable and writable memory",
                              (void *)at);
        at = a.end;
    }
    return DDP_OK;
}

/* Whether the export still backs its pages: always 1 where the kernel cannot say cheaply (the
 * caller promised to unregister before unmapping). */
static int still_there(const export_t *e)
{
    if (maps_fd < 0) return 1;
    area_t a;
    if (area_at(e->start, &a) != 1) return 0;
    return a.start == e->start && a.end == e->end && a.ino == e->ino && a.offset == 0 &&
           (a.flags & VMA_SHARED);
}

/* ---- moving pages --------------------------------------------------------------------------- */

/* Puts a mapping `tmp` of `len` bytes in place of [start, start + len) in one step. */
static int move_over(void *tmp, uintptr_t start, size_t len)
{
    void *r = mremap(tmp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)start);
    return r == (void *)start ? 0 : -1;
}

ddp_status_t ddp__shm_map_register(void *ptr, size_t bytes)
{
    pthread_once(&once, init_once);
    const uintptr_t user = (uintptr_t)ptr, user_end = user + bytes;
    const uintptr_t start = (user + PAGE - 1) & ~(PAGE - 1), end = user_end & ~(PAGE - 1);
    if (end <= start)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "register_memory: [%p, +%zu bytes) holds no whole page of %zu bytes "
                          "(only whole pages can be shared)",
                          ptr, bytes, (size_t)PAGE);
    const size_t len = end - start;
    pthread_mutex_lock(&exports_mu);
    ddp_status_t s = DDP_OK;
    int slot = -1;
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) {
        const export_t *e = &exports[i];
        if (!e->gen) {
            if (slot < 0) slot = i;
            continue;
        }
        if (user < e->user_end && e->user < user_end) {
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                           "register_memory: [%p, +%zu bytes) overlaps [%p, +%zu bytes), "
                           "registered already",
                           ptr, bytes, (void *)e->user, (size_t)(e->user_end - e->user));
            goto out;
        }
    }
    if (slot < 0) {
        s = ddp__error(DDP_ERR_UNSUPPORTED,
                       "register_memory: %d buffers are registered already, the most a process "
                       "may have; unregister one first",
                       DDP__SHM_MAP_SLOTS);
        goto out;
    }
    if ((s = check_movable(start, end)) != DDP_OK) goto out;
    int fd = memfd_create("ddp-registered", MFD_CLOEXEC);
    if (fd < 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "register_memory: memfd_create");
        goto out;
    }
    struct stat st;
    void *tmp = MAP_FAILED;
    if (ftruncate(fd, (off_t)len) != 0 || fstat(fd, &st) != 0 ||
        (tmp = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        s = ddp__error_errno(DDP_ERR_NO_MEMORY, errno,
                             "register_memory: shared memory for %zu bytes", len);
        close(fd);
        goto out;
    }
    memcpy(tmp, (const void *)start, len);
    if (move_over(tmp, start, len) != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, errno,
                             "register_memory: moving %zu bytes at %p onto shared memory", len,
                             (void *)start);
        munmap(tmp, len);
        close(fd);
        goto out;
    }
    export_t *e = &exports[slot];
    e->user = user;
    e->user_end = user_end;
    e->start = start;
    e->end = end;
    e->fd = fd;
    e->ino = (uint64_t)st.st_ino;
    e->gen = ++last_gen ? last_gen : ++last_gen;
    DDP_LOG(DDP_LOG_DEBUG, "shm: registered %zu bytes at %p (slot %d)", len, (void *)start, slot);
out:
    pthread_mutex_unlock(&exports_mu);
    return s;
}

/* Gives the pages of e back to private anonymous memory with the same bytes, closes the memfd
 * and frees the slot. `check`: only if the export still backs them. */
static ddp_status_t release_export(export_t *e, int check)
{
    const size_t len = e->end - e->start;
    ddp_status_t s = DDP_OK;
    if (check && !still_there(e)) {
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                       "unregister_memory: the memory registered at %p was unmapped or moved "
                       "before it was unregistered (it is forgotten now)",
                       (void *)e->user);
    } else {
        void *tmp = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (tmp == MAP_FAILED)
            return ddp__error_errno(DDP_ERR_NO_MEMORY, errno,
                                    "unregister_memory: private memory for %zu bytes", len);
        memcpy(tmp, (const void *)e->start, len);
        if (move_over(tmp, e->start, len) != 0) {
            int err = errno;
            munmap(tmp, len);
            return ddp__error_errno(DDP_ERR_SYSTEM, err,
                                    "unregister_memory: moving %zu bytes at %p back", len,
                                    (void *)e->start);
        }
    }
    close(e->fd);
    memset(e, 0, sizeof *e);
    e->fd = -1;
    return s;
}

ddp_status_t ddp__shm_map_unregister(void *ptr)
{
    pthread_once(&once, init_once);
    pthread_mutex_lock(&exports_mu);
    ddp_status_t s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "unregister_memory: %p was not registered (pass the pointer given "
                                "to ddp_group_register_memory)",
                                ptr);
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) {
        if (exports[i].gen && exports[i].user == (uintptr_t)ptr) {
            ddp__clear_error();
            s = release_export(&exports[i], 1);
            break;
        }
    }
    pthread_mutex_unlock(&exports_mu);
    return s;
}

/* In a child after fork(): its registered pages would be shared with the parent; they become
 * private copies, as with ordinary memory, and the registrations are forgotten. Only this
 * thread runs in the child, so the lock is not taken (the parent may have held it at the
 * fork; it is reinitialised instead). */
static void fork_child(void)
{
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++)
        if (exports[i].gen) release_export(&exports[i], 0);
    pthread_mutex_init(&exports_mu, NULL);
}

int ddp__shm_map_find(const void *p, size_t bytes, ddp__shm_map_hint_t *hint)
{
    memset(hint, 0, sizeof *hint);
    hint->slot = -1;
    hint->addr = (uint64_t)(uintptr_t)p;
    if (!bytes) return 0;
    const uintptr_t a = (uintptr_t)p, b = a + bytes;
    export_t e;
    int slot = -1;
    pthread_mutex_lock(&exports_mu);
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) {
        const export_t *x = &exports[i];
        /* Covered but for less than a page at each end (those bytes go through the segment). */
        if (x->gen && a < x->end && b > x->start && (a >= x->start || x->start - a < PAGE) &&
            (b <= x->end || b - x->end < PAGE)) {
            e = *x;
            slot = i;
            break;
        }
    }
    pthread_mutex_unlock(&exports_mu);
    if (slot < 0) return 0;
    if (!still_there(&e)) {
        DDP_LOG(DDP_LOG_INFO,
                "shm: the memory registered at %p is no longer where it was (freed without "
                "ddp_group_unregister_memory?): not used",
                (void *)e.user);
        return 0;
    }
    hint->start = e.start;
    hint->end = e.end;
    hint->ino = e.ino;
    hint->slot = slot;
    hint->gen = e.gen;
    hint->fd = e.fd;
    return 1;
}

/* ---- views ------------------------------------------------------------------------------- */

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
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != h->ino || (size_t)st.st_size != len) {
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
