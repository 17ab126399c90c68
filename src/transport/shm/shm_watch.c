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
 * What it does not hear: shmat(SHM_REMAP) and remap_file_pages over the pages (the kernel
 * maps those without reporting), a caller's contract broken anyway; nor mremap growing the
 * mapping in place or mprotect splitting it, which leave the memfd where it was (the next
 * check after any report then finds the area changed and forgets the registration).
 *
 * The thread must read every report, or the thread that caused it waits for ever. It lives as
 * long as the process (libddp is linked -z nodelete, so dlclose cannot take its code away) but
 * not longer: when it is the last thread (main called pthread_exit), it closes the descriptor
 * and ends. Should its descriptor fail (closed by a program closing what it did not open), it
 * gives up: the epoch stays odd, the descriptor is closed if still its own (the kernel then
 * lets every waiter go and drops the watch), and every check is a system call again. A forked
 * child has no watch (the kernel does not carry it into the child, whose registrations
 * shm_map.c drops anyway). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/internal.h"
#include "transport/shm/shm_watch.h"

static int uffd = -1; /* -1: none (not opened yet, refused, off, or given up) */
static int tried;     /* opening was tried in this process */
static _Atomic int dead; /* the thread gave up: nothing is watched from then on */
static _Atomic uint64_t epoch;

/* The thread cannot read reports any more (its descriptor failed or was closed under it, or it
 * is the process's last thread): the epoch stays odd for good, so nothing is trusted again, and
 * closing the descriptor lets every thread waiting on a report go and ends the watch of every
 * page. `close_it`: the descriptor is still this thread's to close. */
static void give_up(int close_it, const char *why)
{
    atomic_store(&dead, 1);
    atomic_fetch_or(&epoch, 1);
    if (close_it) close(uffd);
    DDP_LOG(DDP_LOG_DEBUG, "shm: registered memory is no longer watched (%s)", why);
}

/* Reads every report there is: 1, or 0 when reading failed. A page fault is never expected
 * (nothing is write-protected): should one come, the page is made writable and the thread
 * woken rather than left waiting. */
static int take_reports(void)
{
    struct uffd_msg msg[16];
    for (;;) {
        ssize_t r = read(uffd, msg, sizeof msg);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno == EAGAIN;
        if (r < (ssize_t)sizeof *msg) return 0;
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

/* Whether this is the process's only live thread (its main thread called pthread_exit, which
 * leaves it a zombie that /proc still counts, and every other thread ended): then the watch
 * must end too, or the process would never exit. Stops at the second live thread found. */
static int last_thread(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d) return 0;
    int live = 0;
    struct dirent *t;
    while (live < 2 && (t = readdir(d))) {
        if (t->d_name[0] == '.') continue;
        char path[64], stat[512];
        snprintf(path, sizeof path, "/proc/self/task/%.20s/stat", t->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, stat, sizeof stat - 1);
        close(fd);
        if (n <= 0) continue;
        stat[n] = 0;
        /* "tid (name) S ...": the name may hold anything, the state follows its last ')'. */
        const char *state = strrchr(stat, ')');
        if (state && state[1] == ' ' && state[2] != 'Z' && state[2] != 'X') live++;
    }
    closedir(d);
    return live == 1;
}

static void *watch_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct pollfd p = {.fd = uffd, .events = POLLIN, .revents = 0};
        int r = poll(&p, 1, 1000);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) {
            give_up(!(p.revents & POLLNVAL), "its descriptor failed");
            return NULL;
        }
        if (r == 0) {
            if (last_thread()) {
                give_up(1, "the process's last thread");
                return NULL;
            }
            continue;
        }
        atomic_fetch_add_explicit(&epoch, 1, memory_order_seq_cst);
        if (!take_reports()) {
            give_up(1, "reading its reports failed"); /* odd already: stays so */
            return NULL;
        }
        atomic_fetch_add_explicit(&epoch, 1, memory_order_seq_cst);
    }
}

/* Opens the userfaultfd and starts the thread; leaves uffd at -1 where it cannot (logged at
 * debug). */
static void open_watch(void)
{
    const char *setting = NULL;
    if (ddp__env_text("DDP_SHM_MAP_WATCH", &setting) != DDP_OK) {
        DDP_LOG(DDP_LOG_WARN, "shm: %s; registered memory is not watched", ddp_last_error());
        ddp__clear_error();
        return;
    }
    if (setting && !strcmp(setting, "off")) return;
    /* User faults only: what an unprivileged process may open (vm.unprivileged_userfaultfd=0),
     * and all a watch that never faults needs. Kernels before 5.11 have no such flag. */
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0 && errno == EINVAL) fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: no userfaultfd (%s): registered memory is checked by system "
                               "call every collective",
                strerror(errno));
        return;
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
        return;
    }
    /* The thread must be able to wait for reports and read them (a sandbox may refuse poll), or
     * a thread unmapping watched pages would wait for ever: both are tried first. */
    struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
    struct uffd_msg msg;
    if (poll(&p, 1, 0) != 0 || read(fd, &msg, sizeof msg) >= 0 || errno != EAGAIN) {
        DDP_LOG(DDP_LOG_DEBUG, "shm: cannot wait for the userfaultfd's reports here");
        close(fd);
        return;
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
        return;
    }
}

int ddp__shm_watch_add(uintptr_t start, size_t len)
{
    if (!tried) {
        tried = 1;
        open_watch();
    }
    if (uffd < 0 || atomic_load(&dead)) return 0;
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
    /* The descriptor names the parent's memory and no thread reads it here. A fork while the
     * parent's thread took a report leaves the epoch odd: even again, so that a watch the child
     * opens keeps odd for its reports. */
    if (uffd >= 0 && !atomic_load(&dead)) close(uffd);
    uffd = -1;
    tried = 0;
    atomic_store(&dead, 0);
    atomic_store(&epoch, (atomic_load(&epoch) + 1) & ~(uint64_t)1);
}
