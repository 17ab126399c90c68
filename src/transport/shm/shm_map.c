/* Registered memory of the shared-memory transport: moving a caller's pages onto a memfd in
 * place, checking that they are still there, and mapping peers' exports. Why and how the
 * allreduce uses them: shm_allreduce_mapped.c and docs/shm-transport.md ("Registered memory").
 *
 * Moving pages in place: the memfd is mapped somewhere, the pages' bytes are copied into it, and
 * mremap moves that mapping over the caller's range in one step (the old pages are released). The
 * caller sees the same bytes at the same addresses; the difference is that the memory is now
 * shared, which is what lets a peer map it. Only whole pages inside the registered range move:
 * the partial pages at its ends may hold other objects, which other threads may be writing while
 * the bytes are copied.
 *
 * Moving pages back is the same in reverse, and only safe while nobody writes them: a write
 * between the copy and the move is lost. The caller's own unregistration promises that. A
 * registration libddp made by itself (DDP_SHM_MAP=auto) and gives up, because the table is full,
 * a new buffer overlaps it, or its buffer went away, promises nothing: the buffer may still be
 * written (a gradient accumulated while another bucket is reduced), or freed and its pages
 * given by malloc to other objects. Those pages are therefore never moved back: the export is
 * forgotten and its pages stay on the memfd, as harmless as private memory to this process.
 * They carry this process's tag in the memfd's name, which is how a later registration may move
 * them again and how a forked child finds them to make them private. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/shm/shm_map.h"
#include "transport/shm/shm_watch.h"

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

/* The memfd's size: far beyond the pages it backs, sparse (nothing is allocated until touched),
 * so that a mapping of it its owner grew with mremap reads zeros where it would otherwise fault
 * with SIGBUS. (glibc's realloc does not: its mremap of a whole mmap'd chunk fails across the
 * chunk header's page, which stays private, and it copies instead.) */
#define MEMFD_BYTES ((off_t)1 << 40)

typedef struct export {
    uintptr_t user, user_end; /* as registered */
    uintptr_t start, end;     /* the whole pages moved onto the memfd */
    int fd;                   /* open while registered: peers open /proc/<pid>/fd/<fd> */
    uint32_t gen;             /* 0: slot free */
    int automatic;            /* registered by libddp itself (DDP_SHM_MAP=auto) */
    uint64_t ino;
    int watched;              /* its pages are watched (shm_watch.c) */
    uint64_t checked;         /* the watch's epoch when they were last found in place (odd: not) */
} export_t;

/* DDP_SHM_MAP=auto: buffers seen before, by (address, size). A buffer is registered the second
 * time it comes (the first call may be its only one); one that went away after being registered
 * twice (freed and allocated again each step) is left alone from then on. */
#define SEEN_SLOTS 64
typedef struct seen {
    uintptr_t addr;
    size_t bytes;
    uint32_t calls, registrations;
    uint64_t last; /* for replacement: the oldest goes */
} seen_t;

static pthread_mutex_t exports_mu = PTHREAD_MUTEX_INITIALIZER;
static export_t exports[DDP__SHM_MAP_SLOTS];
static uint32_t last_gen;
static uint32_t table_epoch; /* changes with the table (ddp__shm_map_live) */
static seen_t seen[SEEN_SLOTS];
static uint64_t seen_clock;
/* The memfds' name, "ddp-registered-" and a random tag of this process: tells its own forgotten
 * exports' pages from anything else shared (peers' exports mapped here have their own tags). */
#define MEMFD_PREFIX "ddp-registered-"
static char memfd_name[sizeof MEMFD_PREFIX + 16];
static int any_forgotten; /* an export was forgotten: its pages may still be mapped */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int maps_fd = -1; /* /proc/self/maps for PROCMAP_QUERY; -1: the kernel has none */
static int glibc_malloc; /* malloc is the C library's (see init_once) */

/* ---- this process's memory areas ---------------------------------------------------------- */

typedef struct area {
    uintptr_t start, end;
    unsigned flags; /* VMA_* */
    uint64_t ino;   /* 0: anonymous */
    uint64_t offset;
    char name[80];  /* "[stack]", "/memfd:..." and the like; "" for plain anonymous memory */
} area_t;

static void fork_child(void);

/* Whether malloc is glibc's. The definition the process uses is libc's, or a program's own
 * (an executable that takes malloc's address gets a stub of its own, which dladdr names) while
 * no known replacement is loaded: jemalloc, tcmalloc, mimalloc, TBB's, or a sanitizer's. */
static int malloc_is_glibcs(void)
{
    static const char *const replacements[] = {
        "mallctl",    "je_malloc",     "tc_malloc",   "MallocExtension_GetStats",
        "mi_malloc",  "scalable_malloc", "rpmalloc",  "__asan_init",
        "__tsan_init", "__msan_init",  "__hwasan_init", "__lsan_init",
    };
    for (size_t i = 0; i < sizeof replacements / sizeof *replacements; i++)
        if (dlsym(RTLD_DEFAULT, replacements[i])) return 0;
    Dl_info info, self;
    void *m = dlsym(RTLD_DEFAULT, "malloc");
    if (!m || !dladdr(m, &info) || !info.dli_fname) return 0;
    if (strstr(info.dli_fname, "/libc.so")) return 1;
    /* The main program's stub: the same object as the program's headers (AT_PHDR). */
    void *phdr = (void *)getauxval(AT_PHDR);
    return phdr && dladdr(phdr, &self) && self.dli_fbase == info.dli_fbase;
}

/* A new tag for this process's memfds (at start, and in a forked child). */
static void new_memfd_name(void)
{
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t)
        t = (uint64_t)ddp__now_ns() ^ ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)&t;
    snprintf(memfd_name, sizeof memfd_name, MEMFD_PREFIX "%016llx", (unsigned long long)t);
}

/* Whether a mapping's name (as /proc/self/maps shows it: "/memfd:NAME", maybe followed by
 * " (deleted)") is one of this process's export memfds. */
static int name_is_ours(const char *name)
{
    const char *memfd = "/memfd:";
    size_t m = strlen(memfd), n = strlen(memfd_name);
    return !strncmp(name, memfd, m) && !strncmp(name + m, memfd_name, n) &&
           (!name[m + n] || name[m + n] == ' ');
}

/* Whether an area is pages of this process's exports. */
static int area_is_ours(const area_t *a)
{
    return (a->flags & VMA_SHARED) && name_is_ours(a->name);
}

static void init_once(void)
{
    new_memfd_name();
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
    /* Automatic registration relies on how glibc's malloc treats a chunk it mmap'd: its own
     * mapping, unmapped by free, never reused for other objects. Allocators loaded in its place
     * (jemalloc, tcmalloc) keep freed extents and reuse them. */
    glibc_malloc = malloc_is_glibcs();
    /* A child forked after registration gets private pages (fork_child). */
    pthread_atfork(NULL, NULL, fork_child);
}

/* The area holding addr (its name only if want_name or from the text): 1 found, 0 not mapped,
 * -1 cannot tell. */
static int area_at(uintptr_t addr, area_t *a, int want_name)
{
    memset(a, 0, sizeof *a);
    if (maps_fd >= 0) {
        struct ddp_procmap_query q;
        memset(&q, 0, sizeof q);
        q.size = sizeof q;
        q.query_addr = addr;
        /* The name costs the kernel a path lookup: 1.1-1.3 us a query with it, 0.76-0.86
         * without (two runs here, Linux 6.18); the check on every mapped call needs none. */
        if (want_name) {
            q.vma_name_addr = (uint64_t)(uintptr_t)a->name;
            q.vma_name_size = sizeof a->name;
        }
        int r = ioctl(maps_fd, DDP_PROCMAP_QUERY, &q);
        if (r != 0 && errno == ENAMETOOLONG && want_name) {
            /* A file's path longer than the buffer: no name then (none of ours is that long). */
            q.vma_name_addr = 0;
            q.vma_name_size = 0;
            r = ioctl(maps_fd, DDP_PROCMAP_QUERY, &q);
        }
        if (r != 0) {
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

/* Whether [start, end) is private anonymous read-write memory, or pages of this process's
 * forgotten exports (what may be moved: the caller dealt with the live exports it overlaps). On
 * failure sets the error text naming what is there instead. */
static ddp_status_t check_movable(uintptr_t start, uintptr_t end)
{
    for (uintptr_t at = start; at < end;) {
        area_t a;
        int r = area_at(at, &a, 1);
        if (r < 0)
            return ddp__error(DDP_ERR_UNSUPPORTED,
                              "register_memory: cannot read this process's memory map");
        if (r == 0)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "register_memory: address %p is not mapped", (void *)at);
        if (!area_is_ours(&a) &&
            (a.ino != 0 || (a.flags & VMA_SHARED) || (a.name[0] == '[' && strcmp(a.name, "[heap]"))))
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

static uint64_t kernel_checks; /* backs_pages calls (under exports_mu), for tests */

/* Whether the export's memfd still backs its pages (on any kernel: without PROCMAP_QUERY this
 * reads /proc/self/maps' text). */
static int backs_pages(const export_t *e)
{
    kernel_checks++;
    area_t a;
    if (area_at(e->start, &a, 0) != 1) return 0;
    return a.start == e->start && a.end == e->end && a.ino == e->ino && a.offset == 0 &&
           (a.flags & VMA_SHARED);
}

/* The same on every use of an export: always 1 where the kernel cannot say cheaply and nothing
 * watches the pages (the caller promised to unregister before unmapping). Watched pages are
 * asked about only when the watch heard of a change to watched memory since they were last
 * found in place; then on any kernel. */
static int still_there(export_t *e)
{
    if (!e->watched) return maps_fd < 0 || backs_pages(e);
    const uint64_t epoch = ddp__shm_watch_epoch();
    if (epoch == e->checked && !(epoch & 1)) return 1;
    if (!backs_pages(e)) return 0;
    if (!(epoch & 1)) e->checked = epoch;
    return 1;
}

/* ---- moving pages --------------------------------------------------------------------------- */

/* Puts a mapping `tmp` of `len` bytes in place of [start, start + len) in one step. */
static int move_over(void *tmp, uintptr_t start, size_t len)
{
    void *r = mremap(tmp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)start);
    return r == (void *)start ? 0 : -1;
}

static void sweep_stale(void);

/* Frees e's slot and leaves its pages where they are (on the memfd): for libddp's own
 * registrations, whose pages may be written by other threads right now, and for exports whose
 * pages moved or went away. */
static void forget_export(export_t *e)
{
    close(e->fd);
    memset(e, 0, sizeof *e);
    e->fd = -1;
    any_forgotten = 1;
    table_epoch++;
}

/* Registers [ptr, ptr + bytes) with exports_mu held. */
static ddp_status_t register_locked(void *ptr, size_t bytes, int automatic)
{
    const uintptr_t user = (uintptr_t)ptr, user_end = user + bytes;
    const uintptr_t start = (user + PAGE - 1) & ~(PAGE - 1), end = user_end & ~(PAGE - 1);
    if (end <= start)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "register_memory: [%p, +%zu bytes) holds no whole page of %zu bytes "
                          "(only whole pages can be shared)",
                          ptr, bytes, (size_t)PAGE);
    const size_t len = end - start;
    ddp_status_t s = DDP_OK;
    int slot = -1;
    sweep_stale();
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) {
        export_t *e = &exports[i];
        /* Memory libddp registered by itself (DDP_SHM_MAP=auto) that the new range overlaps:
         * the caller's registration of the same pages takes it over; otherwise it is forgotten
         * (a buffer first reduced in part, then whole, as ddp-bench does with its growing sizes,
         * is registered again whole; a freed buffer's pages now hold other objects). */
        if (e->gen && e->automatic && user < e->user_end && e->user < user_end) {
            if (!automatic && e->start == start && e->end == end) {
                e->automatic = 0;
                e->user = user;
                e->user_end = user_end;
                return DDP_OK;
            }
            forget_export(e);
        }
        if (!e->gen) {
            if (slot < 0) slot = i;
            continue;
        }
        if (user < e->user_end && e->user < user_end) {
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                           "register_memory: [%p, +%zu bytes) overlaps [%p, +%zu bytes), "
                           "registered already",
                           ptr, bytes, (void *)e->user, (size_t)(e->user_end - e->user));
            return s;
        }
    }
    /* The caller's registrations go before libddp's own: a full table gives one of those back.
     * An automatic one may take the place of the smallest automatic one smaller than itself:
     * small buffers registered early (a model's biases) do not keep a large one out (its
     * gradient bucket), and a buffer displaced is registered again at most once (seen_t). */
    for (int i = 0; i < DDP__SHM_MAP_SLOTS && slot < 0 && !automatic; i++)
        if (exports[i].automatic) {
            forget_export(&exports[i]);
            slot = i;
        }
    if (slot < 0 && automatic) {
        int smallest = -1;
        size_t smallest_len = len; /* only one smaller than the new range may go */
        for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++)
            if (exports[i].automatic && exports[i].end - exports[i].start < smallest_len) {
                smallest = i;
                smallest_len = exports[i].end - exports[i].start;
            }
        if (smallest >= 0) {
            forget_export(&exports[smallest]);
            slot = smallest;
        }
    }
    if (slot < 0) {
        s = ddp__error(DDP_ERR_UNSUPPORTED,
                       "register_memory: %d buffers are registered already, the most a process "
                       "may have; unregister one first",
                       DDP__SHM_MAP_SLOTS);
        return s;
    }
    if ((s = check_movable(start, end)) != DDP_OK) return s;
    int fd = memfd_create(memfd_name, MFD_CLOEXEC);
    if (fd < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "register_memory: memfd_create");
    struct stat st;
    void *tmp = MAP_FAILED;
    if (ftruncate(fd, MEMFD_BYTES) != 0 || fstat(fd, &st) != 0 ||
        (tmp = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        s = ddp__error_errno(DDP_ERR_NO_MEMORY, errno,
                             "register_memory: shared memory for %zu bytes", len);
        close(fd);
        return s;
    }
    memcpy(tmp, (const void *)start, len);
    if (move_over(tmp, start, len) != 0) {
        s = ddp__error_errno(DDP_ERR_SYSTEM, errno,
                             "register_memory: moving %zu bytes at %p onto shared memory", len,
                             (void *)start);
        munmap(tmp, len);
        close(fd);
        return s;
    }
    export_t *e = &exports[slot];
    e->user = user;
    e->user_end = user_end;
    e->start = start;
    e->end = end;
    e->fd = fd;
    e->ino = (uint64_t)st.st_ino;
    e->automatic = automatic;
    e->watched = ddp__shm_watch_add(start, len);
    e->checked = 1; /* odd, never trusted: the first use asks the kernel */
    e->gen = ++last_gen ? last_gen : ++last_gen;
    table_epoch++;
    DDP_LOG(DDP_LOG_DEBUG, "shm: registered %zu bytes at %p (slot %d%s)", len, (void *)start, slot,
            automatic ? ", automatically" : "");
    return DDP_OK;
}

ddp_status_t ddp__shm_map_register(void *ptr, size_t bytes)
{
    pthread_once(&once, init_once);
    pthread_mutex_lock(&exports_mu);
    ddp_status_t s = register_locked(ptr, bytes, 0);
    pthread_mutex_unlock(&exports_mu);
    return s;
}

/* Frees the slots of exports whose pages are gone (the memory was unmapped: freed without
 * unregistering, or an automatic registration whose buffer was freed). */
static void sweep_stale(void)
{
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++)
        if (exports[i].gen && !still_there(&exports[i])) {
            DDP_LOG(DDP_LOG_DEBUG, "shm: registered memory at %p is gone: slot %d freed",
                    (void *)exports[i].user, i);
            forget_export(&exports[i]);
        }
}

static seen_t *seen_of(uintptr_t addr, size_t bytes)
{
    seen_t *oldest = &seen[0];
    for (int i = 0; i < SEEN_SLOTS; i++) {
        if (seen[i].addr == addr && seen[i].bytes == bytes) return &seen[i];
        if (seen[i].last < oldest->last) oldest = &seen[i];
    }
    memset(oldest, 0, sizeof *oldest);
    oldest->addr = addr;
    oldest->bytes = bytes;
    return oldest;
}

int ddp__shm_map_auto_available(void)
{
    pthread_once(&once, init_once);
    return maps_fd >= 0 && glibc_malloc;
}

int ddp__shm_map_auto(const void *p, size_t bytes)
{
    pthread_once(&once, init_once);
    if (maps_fd < 0 || !glibc_malloc) return 0;
    const uintptr_t a = (uintptr_t)p;
    /* No whole page in it: nothing to register (asked at every call of such a buffer). */
    if (((a + PAGE - 1) & ~(PAGE - 1)) + PAGE > a + bytes) return 0;
    pthread_mutex_lock(&exports_mu);
    seen_t *v = seen_of(a, bytes);
    v->last = ++seen_clock;
    int ok = 0;
    if (++v->calls >= 2 && v->registrations < 2) {
        /* Whatever register_memory accepts (private anonymous memory: malloc's mmap'd chunks,
         * its heaps). With glibc's malloc, pages that stay shared after the buffer is freed are
         * harmless: freed mmap'd chunks are unmapped, and pages of a heap it reuses are never
         * assumed to read as zero; a fork gives the child private pages (fork_child). They are
         * never moved back (forget_export). */
        ddp_status_t s = register_locked((void *)a, bytes, 1);
        if (s == DDP_OK) {
            v->registrations++;
            ok = 1;
        } else {
            DDP_LOG(DDP_LOG_DEBUG, "shm: not registering %zu bytes at %p: %s", bytes, p,
                    ddp_last_error());
            ddp__clear_error();
            v->registrations = 2;
        }
    }
    pthread_mutex_unlock(&exports_mu);
    return ok;
}

/* Gives the pages of e back to private anonymous memory with the same bytes, closes the memfd
 * and frees the slot: the caller's unregistration, who promised nobody writes them meanwhile.
 * `check`: only if the export still backs them. */
static ddp_status_t release_export(export_t *e, int check)
{
    const size_t len = e->end - e->start;
    ddp_status_t s = DDP_OK;
    /* Checked on any kernel: copying from pages the caller already unmapped would fault. */
    if (check && !backs_pages(e)) {
        s = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                       "unregister_memory: the memory registered at %p was unmapped or moved "
                       "before it was unregistered (it is forgotten now)",
                       (void *)e->user);
        any_forgotten = 1; /* moved pages are still on the memfd: a child must copy them */
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
    table_epoch++;
    return s;
}

ddp_status_t ddp__shm_map_unregister(void *ptr)
{
    pthread_once(&once, init_once);
    pthread_mutex_lock(&exports_mu);
    int slot = -1;
    for (int i = 0; i < DDP__SHM_MAP_SLOTS && slot < 0; i++)
        if (exports[i].gen && !exports[i].automatic && exports[i].user == (uintptr_t)ptr) slot = i;
    ddp_status_t s = slot >= 0 ? release_export(&exports[slot], 1)
                               : ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                            "unregister_memory: %p was not registered (pass the "
                                            "pointer given to ddp_group_register_memory)",
                                            ptr);
    pthread_mutex_unlock(&exports_mu);
    return s;
}

/* In a child after fork(): its registered pages would be shared with the parent. Each export
 * is mapped again, privately (MAP_PRIVATE of the same memfd): the child's writes stay its own,
 * nothing is copied (a DataLoader forking workers would otherwise copy every registered
 * gradient), and the registrations are forgotten. Only this thread runs in the child, so the
 * lock is not taken (the parent may have held it at the fork; it is reinitialised instead). */
static void fork_child(void)
{
    /* The descriptor of /proc/self/maps names the parent's memory: "self" was resolved when it
     * was opened. */
    if (maps_fd >= 0) {
        close(maps_fd);
        maps_fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    }
    /* The watch is the parent's, and a change the parent made just before the fork may not have
     * reached it yet: the child checks as without a watch (asking the kernel where it has
     * PROCMAP_QUERY; on older kernels the caller's promise stands, as it always did there). */
    ddp__shm_watch_forked();
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) {
        export_t *e = &exports[i];
        if (!e->gen) continue;
        e->watched = 0;
        if (still_there(e))
            mmap((void *)e->start, e->end - e->start, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_FIXED, e->fd, 0);
        else
            any_forgotten = 1; /* its pages moved (mremap): found by name below */
        close(e->fd);
        memset(e, 0, sizeof *e);
    }
    memset(seen, 0, sizeof seen);
    pthread_mutex_init(&exports_mu, NULL);
    /* Pages of forgotten exports (given up, moved by mremap, or partly replaced) are found by
     * the memfds' name among the shared mappings and copied into private memory; peers' exports
     * mapped here have other names and are left alone. Raw reads into a static buffer: this runs
     * right after fork. Then the child takes a tag of its own. */
    if (any_forgotten) {
        static char buf[1 << 16];
        int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
        size_t have = 0;
        while (fd >= 0) {
            ssize_t r = read(fd, buf + have, sizeof buf - 1 - have);
            if (r <= 0) break;
            have += (size_t)r;
            buf[have] = 0;
            char *line = buf, *nl;
            while ((nl = strchr(line, '\n'))) {
                *nl = 0;
                unsigned long long lo, hi, off, ino = 0;
                char perms[8], dev[16];
                int name_at = 0;
                if (sscanf(line, "%llx-%llx %7s %llx %15s %llu %n", &lo, &hi, perms, &off, dev,
                           &ino, &name_at) >= 6 &&
                    name_at > 0 && perms[3] == 's' && hi > lo && name_is_ours(line + name_at)) {
                    size_t len = (size_t)(hi - lo);
                    void *tmp = mmap(NULL, len, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                    if (tmp != MAP_FAILED) {
                        memcpy(tmp, (const void *)(uintptr_t)lo, len);
                        if (move_over(tmp, (uintptr_t)lo, len) != 0) munmap(tmp, len);
                    }
                }
                line = nl + 1;
            }
            have = (size_t)(buf + have - line);
            memmove(buf, line, have);
        }
        if (fd >= 0) close(fd);
        any_forgotten = 0;
    }
    new_memfd_name();
}

int ddp__shm_map_watched(const void *p)
{
    const uintptr_t a = (uintptr_t)p;
    int watched = 0;
    pthread_mutex_lock(&exports_mu);
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++)
        if (exports[i].gen && a >= exports[i].start && a < exports[i].end)
            watched = exports[i].watched;
    pthread_mutex_unlock(&exports_mu);
    return watched;
}

uint64_t ddp__shm_map_kernel_checks(void)
{
    pthread_mutex_lock(&exports_mu);
    uint64_t n = kernel_checks;
    pthread_mutex_unlock(&exports_mu);
    return n;
}

uint32_t ddp__shm_map_live(uint32_t gens[DDP__SHM_MAP_SLOTS])
{
    /* Registrations whose memory was unmapped are noticed here too, at most every 50 ms (one
     * PROCMAP_QUERY per registration), so that peers let go of it even if no registration
     * follows. */
    static int64_t last_sweep_ns;
    pthread_mutex_lock(&exports_mu);
    int64_t now = ddp__now_ns();
    if (now - last_sweep_ns > 50000000) {
        last_sweep_ns = now;
        sweep_stale();
    }
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) gens[i] = exports[i].gen;
    uint32_t epoch = table_epoch;
    pthread_mutex_unlock(&exports_mu);
    return epoch;
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
    for (int i = 0; i < DDP__SHM_MAP_SLOTS && slot < 0; i++) {
        const export_t *x = &exports[i];
        /* Covered but for less than a page at each end (those bytes go through the segment). */
        if (x->gen && a < x->end && b > x->start && (a >= x->start || x->start - a < PAGE) &&
            (b <= x->end || b - x->end < PAGE))
            slot = i;
    }
    if (slot >= 0 && !still_there(&exports[slot])) {
        if (!exports[slot].automatic)
            DDP_LOG(DDP_LOG_INFO,
                    "shm: the memory registered at %p is no longer where it was (freed without "
                    "ddp_group_unregister_memory?): forgotten",
                    (void *)exports[slot].user);
        forget_export(&exports[slot]);
        slot = -1;
    }
    if (slot >= 0) e = exports[slot];
    pthread_mutex_unlock(&exports_mu);
    if (slot < 0) return 0;
    hint->start = e.start;
    hint->end = e.end;
    hint->ino = e.ino;
    hint->slot = slot;
    hint->gen = e.gen;
    hint->fd = e.fd;
    return 1;
}
