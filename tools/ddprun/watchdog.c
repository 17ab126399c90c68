/* The watchdog: a process ddprun forks first, so nothing of the job outlives ddprun (why and how
 * below). ddprun tells it each worker's process group (watchdog_send) and, at its end, whether
 * to stand down or sweep (finish_watchdog). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddprun.h"

/* PR_SET_PDEATHSIG reaches only a worker itself; what it started (`sh -c 'trainer ...'`, data
 * loaders) would live on with parent 1 if ddprun were SIGKILLed. So before anything else ddprun
 * forks a watchdog into a session of its own. It holds the read end of a pipe whose only writer
 * is ddprun and learns each worker's process group through it; when the pipe reaches end of file
 * without a stand-down (ddprun died, or it ends a failed job), the watchdog kills every process
 * of the job and exits. A process belongs to the job when it is in a worker's process group or
 * carries this run's DDPRUN_JOB_ID in its environment: the group catches children that cleared
 * their environment, the mark catches those that left the group (setsid, double forks), and
 * a mark is random per run, so another job's processes never match.
 * Why not PR_SET_CHILD_SUBREAPER in ddprun: it adopts the orphans only while ddprun lives; once
 * ddprun dies they go to init all the same. The watchdog needs no privileges and works under any
 * init; what it cannot see is a process that both left the group and cleared its environment,
 * or one whose /proc entry another user owns. */

#define WATCHDOG_STAND_DOWN 0 /* message: the job ended well, exit without killing anything */
#define WATCHDOG_ROUNDS 500   /* each round scans /proc once; then it gives up (about 5 s) */

static char job_id[64];         /* this run's DDPRUN_JOB_ID, 48 hex digits */
static pid_t watchdog_pid = -1; /* ddprun's child */
static int watchdog_fd = -1;    /* ddprun's write end of the watchdog's pipe */

/* Reads a small /proc file of `pid` into buf (NUL-terminated); the number of bytes or -1. */
static ssize_t read_proc(pid_t pid, const char *what, char *buf, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, what);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t len = 0;
    ssize_t n;
    while (len + 1 < size && (n = read(fd, buf + len, size - 1 - len)) != 0) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    return (ssize_t)len;
}

/* Whether `pid`'s initial environment holds `mark` ("DDPRUN_JOB_ID=..."). An environment larger
 * than the buffer is searched in pieces that overlap by the length of the mark. */
static int environment_has(pid_t pid, const char *mark)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    static char buf[65536 + 1];
    size_t mlen = strlen(mark) + 1; /* with its terminating NUL */
    size_t len = 1;
    buf[0] = '\0'; /* so the first entry, too, follows a NUL */
    int found = 0;
    for (;;) {
        ssize_t n = read(fd, buf + len, sizeof buf - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t)n;
        for (size_t at = 0; !found && at + mlen + 1 <= len; at++)
            found = buf[at] == '\0' && memcmp(buf + at + 1, mark, mlen) == 0;
        if (found) break;
        if (len > mlen + 1) { /* keep the tail: a mark may straddle two reads */
            memmove(buf, buf + len - (mlen + 1), mlen + 1);
            len = mlen + 1;
        }
    }
    close(fd);
    return found;
}

/* One pass over /proc: SIGKILL every live process of the job; returns how many it signalled. */
static int kill_job_once(const pid_t *groups, int ngroups, const char *mark)
{
    for (int g = 0; g < ngroups; g++) kill(-groups[g], SIGKILL);
    DIR *proc = opendir("/proc");
    if (!proc) return 0;
    int signalled = 0;
    struct dirent *e;
    while ((e = readdir(proc))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end != '\0' || pid <= 1 || pid == getpid()) continue;
        char stat[512];
        if (read_proc((pid_t)pid, "stat", stat, sizeof stat) <= 0) continue;
        /* "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses. */
        const char *after = strrchr(stat, ')');
        char state = 0;
        int ppid = 0, pgrp = 0;
        if (!after || sscanf(after + 1, " %c %d %d", &state, &ppid, &pgrp) != 3) continue;
        if (state == 'Z' || state == 'X') continue; /* dead already */
        int ours = 0;
        for (int g = 0; g < ngroups && !ours; g++) ours = pgrp == groups[g];
        if (!ours) ours = environment_has((pid_t)pid, mark);
        if (ours && kill((pid_t)pid, SIGKILL) == 0) signalled++;
    }
    closedir(proc);
    return signalled;
}

static void watchdog_main(int fd)
{
    /* Its own session: a terminal's Ctrl-C or hang-up, and kill(-pgid) aimed at ddprun's group,
     * must not take the watchdog along. It ignores the termination signals for the same reason:
     * ddprun's own death is what ends it. */
    setsid();
    prctl(PR_SET_NAME, "ddprun-watchdog");
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    /* Keep no other descriptor of ddprun's open: a reader of ddprun's output waits for EOF. */
    if (dup2(fd, 3) < 0) _exit(1);
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
        dup2(devnull, 0);
        dup2(devnull, 1);
        dup2(devnull, 2);
    }
    if (close_range(4, ~0u, 0) != 0) { /* a kernel before 5.9: one by one */
        long max = sysconf(_SC_OPEN_MAX);
        for (long k = 4; k < (max > 0 ? max : 65536); k++) close((int)k);
    }
    fd = 3;

    char mark[128];
    snprintf(mark, sizeof mark, "DDPRUN_JOB_ID=%s", job_id);
    pid_t groups[MAX_LOCAL_WORKERS];
    int ngroups = 0;
    unsigned char msg[sizeof(int32_t)];
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fd, msg + have, sizeof msg - have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break; /* ddprun is gone, or it ends a failed job */
        have += (size_t)n;
        if (have < sizeof msg) continue;
        have = 0;
        int32_t group;
        memcpy(&group, msg, sizeof group);
        if (group == WATCHDOG_STAND_DOWN) _exit(0);
        if (ngroups < MAX_LOCAL_WORKERS) groups[ngroups++] = (pid_t)group;
    }
    /* SIGKILLed processes take a moment to become zombies, and one may fork while we scan:
     * repeat until a pass finds nobody alive. */
    for (int round = 0; round < WATCHDOG_ROUNDS; round++) {
        if (kill_job_once(groups, ngroups, mark) == 0) break;
        sleep_ms(10);
    }
    _exit(0);
}

/* Forks the watchdog. Called before ddprun starts any thread, so the child may use the C library
 * freely. Without a watchdog the job still runs, protected by PR_SET_PDEATHSIG alone. */
void start_watchdog(void)
{
    make_token(job_id, sizeof job_id);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        perror("ddprun: pipe (the watchdog is not started)");
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[1]);
        watchdog_main(fds[0]);
    }
    close(fds[0]);
    if (pid < 0) {
        perror("ddprun: fork (the watchdog is not started)");
        close(fds[1]);
        return;
    }
    watchdog_pid = pid;
    watchdog_fd = fds[1];
}

const char *watchdog_job_id(void) { return job_id; }

void watchdog_send(int32_t message)
{
    if (watchdog_fd < 0) return;
    /* Four bytes: one atomic pipe write. A watchdog that died gives EPIPE (SIGPIPE is ignored). */
    ssize_t ignored = write(watchdog_fd, &message, sizeof message);
    (void)ignored;
}

/* At ddprun's exit: a job that ended well leaves what its workers left running (as without the
 * watchdog); after a failure or a signal the watchdog sweeps the job, and ddprun waits for it so
 * that nothing of the job is left when ddprun returns. */
void finish_watchdog(int job_failed)
{
    if (watchdog_fd < 0) return;
    if (!job_failed) watchdog_send(WATCHDOG_STAND_DOWN);
    close(watchdog_fd);
    watchdog_fd = -1;
    for (int waited_ms = 0; waited_ms < 10000; waited_ms += 10) {
        pid_t got = waitpid(watchdog_pid, NULL, WNOHANG);
        if (got == watchdog_pid || (got < 0 && errno != EINTR)) return;
        sleep_ms(10);
    }
}
