/* Watching registered pages. Before each mapped collective, shm_map.c must know that a
 * registration's memfd still backs the caller's addresses: a buffer freed (glibc unmaps a large
 * chunk) and allocated again at the same address is private memory there, and peers reading the
 * memfd would read old bytes. Asking the kernel (PROCMAP_QUERY) every call cost more than the
 * ioctl's 0.3 us: watched instead, the five mapped collectives of 32-512 KiB took 0.65-0.98x
 * the time on the Intel Xeon (2 ranks, medians of 5 alternating runs; 2-8 MiB even within the
 * noise; bench/results/2026-11-29-0321-watch-ab.txt).
 *
 * A userfaultfd with the unmap and remap events hears of every munmap, mremap, brk or mmap
 * MAP_FIXED that takes pages it watches away or moves them, and the thread that does it waits,
 * after the change, until the report is read. The watch thread sleeps in poll until a report
 * comes, makes the epoch odd, reads every report there is, and makes it even again. So a change
 * that returned to its caller made the epoch odd first, and a check that reads the epoch after
 * it sees a value it did not trust before: shm_map.c then asks the kernel. The pages are watched
 * in write-protect mode and nothing is ever write-protected: the watch causes no fault, it only
 * hears (Linux 5.19 on, for shared memory). Where the kernel or a sandbox refuses any of it,
 * nothing is watched and every check is a system call, as before; DDP_SHM_MAP_WATCH=off asks
 * for that.
 *
 * What it does not hear: shmat(SHM_REMAP) over the pages (the kernel does not report it), a
 * caller's contract broken anyway. The thread lives as long as the process: a change to
 * watched pages would wait for it forever otherwise. A forked child has no watch (the kernel
 * does not carry it into the child, whose registrations shm_map.c drops anyway). */
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/shm/shm_watch.h"

static int uffd = -1; /* -1: none (not opened yet, refused, or off) */
static int tried;     /* opening was tried in this process */
static _Atomic uint64_t epoch;

/* Reads every report there is. A page fault is never expected (nothing is write-protected):
 * should one come, the page is made writable and the thread woken rather than left waiting. */
static void take_reports(void)
{
    struct uffd_msg msg[16];
    for (;;) {
        ssize_t r = read(uffd, msg, sizeof msg);
        if (r < 0 && errno == EINTR) continue;
        if (r < (ssize_t)sizeof *msg) return; /* EAGAIN: none left */
        for (size_t i = 0; i < (size_t)r / sizeof *msg; i++) {
            if (msg[i].event != UFFD_EVENT_PAGEFAULT) continue;
            struct uffdio_writeprotect wp;
            memset(&wp, 0, sizeof wp);
            wp.range.start = msg[i].arg.pagefault.address & ~(uint64_t)4095;
            wp.range.len = 4096;
            ioctl(uffd, UFFDIO_WRITEPROTECT, &wp);
            ioctl(uffd, UFFDIO_WAKE, &wp.range);
        }
    }
}

static void *watch_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct pollfd p = {.fd = uffd, .events = POLLIN, .revents = 0};
        int r = poll(&p, 1, -1);
        if (r <= 0 || (p.revents & (POLLERR | POLLNVAL))) {
            if (r != 0 && errno != EINTR) usleep(1000); /* never expected: do not spin */
            continue;
        }
        atomic_fetch_add_explicit(&epoch, 1, memory_order_seq_cst);
        take_reports();
        atomic_fetch_add_explicit(&epoch, 1, memory_order_seq_cst);
    }
    return NULL;
}

/* Opens the userfaultfd and starts the thread: the descriptor, or -1 (logged at debug). */
static int open_watch(void)
{
    const char *setting = NULL;
    if (ddp__env_text("DDP_SHM_MAP_WATCH", &setting) != DDP_OK) {
        DDP_LOG(DDP_LOG_WARN, "shm: %s; registered memory is not watched", ddp_last_error());
        ddp__clear_error();
        return -1;
    }
    if (setting && !strcmp(setting, "off")) return -1;
    /* User faults only: what an unprivileged process may open (vm.unprivileged_userfaultfd=0),
     * and all a watch that never faults needs. Kernels before 5.11 have no such flag. */
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0 && errno == EINVAL) fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: no userfaultfd (%s): registered memory is checked by system "
                               "call every collective",
                strerror(errno));
        return -1;
    }
    struct uffdio_api api;
    memset(&api, 0, sizeof api);
    api.api = UFFD_API;
    api.features = UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMAP |
                   UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
    if (ioctl(fd, UFFDIO_API, &api) != 0) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: the userfaultfd cannot watch shared memory here (%s)",
                strerror(errno));
        close(fd);
        return -1;
    }
    uffd = fd;
    /* Every signal blocked in the thread: handlers run on the caller's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_t thread;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&thread, &attr, watch_main, NULL);
        pthread_attr_destroy(&attr);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: no thread to watch registered memory (%s)", strerror(rc));
        uffd = -1;
        close(fd);
        return -1;
    }
    return fd;
}

int ddp__shm_watch_add(uintptr_t start, size_t len)
{
    if (!tried) {
        tried = 1;
        open_watch();
    }
    if (uffd < 0) return 0;
    struct uffdio_register reg;
    memset(&reg, 0, sizeof reg);
    reg.range.start = start;
    reg.range.len = len;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: cannot watch %zu registered bytes at %p (%s)", len,
                (void *)start, strerror(errno));
        return 0;
    }
    return 1;
}

uint64_t ddp__shm_watch_epoch(void)
{
    return atomic_load_explicit(&epoch, memory_order_seq_cst);
}

void ddp__shm_watch_forked(void)
{
    /* The descriptor names the parent's memory and no thread reads it here. */
    if (uffd >= 0) close(uffd);
    uffd = -1;
    tried = 0;
}
