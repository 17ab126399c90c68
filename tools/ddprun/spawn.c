/* Starting the workers: each one's environment (torchrun's variables), its CPU (--bind), its
 * output pipes, fork and exec; and the signals - those sent to ddprun, which it forwards, and
 * those it sends the workers' process groups. */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "ddprun.h"

extern char **environ;

/* Handlers only write the signal number into a pipe the event loop polls. */
static int signal_pipe[2] = {-1, -1};
static volatile sig_atomic_t workers_started;

static void on_signal(int sig)
{
    if (!workers_started) _exit(128 + sig); /* still joining: nothing to clean up */
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t ignored = write(signal_pipe[1], &b, 1);
    (void)ignored;
    errno = saved;
}

static const int forwarded_signals[] = {SIGINT, SIGTERM, SIGHUP};

void install_signal_handlers(void)
{
    if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        perror("ddprun: pipe");
        exit(1);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof forwarded_signals / sizeof forwarded_signals[0]; i++) {
        sigaction(forwarded_signals[i], &sa, NULL);
    }
    signal(SIGPIPE, SIG_IGN);
}

/* Library threads (the store server, the watcher) must not take our signals: create them with
 * the forwarded signals blocked so only the main thread runs on_signal. */
void block_forwarded_signals(int block, sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    for (size_t i = 0; i < sizeof forwarded_signals / sizeof forwarded_signals[0]; i++) {
        sigaddset(&set, forwarded_signals[i]);
    }
    if (block) pthread_sigmask(SIG_BLOCK, &set, old);
    else pthread_sigmask(SIG_SETMASK, old, NULL);
}

int signal_fd(void) { return signal_pipe[0]; }

void mark_workers_started(void) { workers_started = 1; }

static char *env_entry(const char *name, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static char *env_entry(const char *name, const char *fmt, ...)
{
    char value[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(value, sizeof value, fmt, ap);
    va_end(ap);
    size_t n = strlen(name) + 1 + strlen(value) + 1;
    char *e = malloc(n);
    if (!e) {
        fprintf(stderr, "ddprun: out of memory\n");
        exit(1);
    }
    snprintf(e, n, "%s=%s", name, value);
    return e;
}

static const char *const set_names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                        "GROUP_RANK", "DDP_STORE_ADDR", "DDP_STORE_PORT",
                                        "MASTER_ADDR", "MASTER_PORT", "DDP_STORE_TOKEN",
                                        "DDPRUN_JOB_ID", "DDP_RESTART_COUNT",
                                        "TORCHELASTIC_RESTART_COUNT"};
#define NUM_SET_NAMES (sizeof set_names / sizeof set_names[0])

static int is_set_name(const char *entry)
{
    for (size_t i = 0; i < NUM_SET_NAMES; i++) {
        size_t n = strlen(set_names[i]);
        if (strncmp(entry, set_names[i], n) == 0 && entry[n] == '=') return 1;
    }
    return 0;
}

/* Builds the environment of one worker: ours minus the variables we set, plus them. */
static char **worker_environment(const job_t *job, const worker_t *w)
{
    size_t n = 0;
    while (environ[n]) n++;
    char **envp = calloc(n + NUM_SET_NAMES + 1, sizeof *envp);
    if (!envp) {
        fprintf(stderr, "ddprun: out of memory\n");
        exit(1);
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!is_set_name(environ[i])) envp[k++] = environ[i];
    }
    const options_t *o = &job->opt;
    envp[k++] = env_entry("RANK", "%d", w->rank);
    envp[k++] = env_entry("WORLD_SIZE", "%d", o->nnodes * o->nproc);
    envp[k++] = env_entry("LOCAL_RANK", "%d", w->local_rank);
    envp[k++] = env_entry("LOCAL_WORLD_SIZE", "%d", o->nproc);
    envp[k++] = env_entry("GROUP_RANK", "%d", o->node_rank);
    envp[k++] = env_entry("DDP_STORE_ADDR", "%s", job->master_addr);
    envp[k++] = env_entry("DDP_STORE_PORT", "%d", job->master_port);
    envp[k++] = env_entry("MASTER_ADDR", "%s", job->master_addr);
    envp[k++] = env_entry("MASTER_PORT", "%d", job->torch_port);
    envp[k++] = env_entry("DDP_STORE_TOKEN", "%s", job->token);
    envp[k++] = env_entry("DDPRUN_JOB_ID", "%s", watchdog_job_id());
    envp[k++] = env_entry("DDP_RESTART_COUNT", "%d", job->attempt);
    envp[k++] = env_entry("TORCHELASTIC_RESTART_COUNT", "%d", job->attempt);
    envp[k] = NULL;
    return envp;
}

static void free_environment(char **envp)
{
    size_t n = 0;
    while (envp[n]) n++;
    for (size_t i = n - NUM_SET_NAMES; i < n; i++) free(envp[i]);
    free(envp);
}

static void child_error(const char *what, const char *program)
{
    /* Between fork and exec: write(2) only. strerror is not on the async-signal-safe list,
     * but glibc's reads a static table for known errno values. */
    const char *reason = strerror(errno);
    const char *parts[] = {"ddprun: cannot ", what, " '", program, "': ", reason, "\n"};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        ssize_t ignored = write(2, parts[i], strlen(parts[i]));
        (void)ignored;
    }
}

static void close_pair(int fds[2])
{
    for (int i = 0; i < 2; i++) {
        if (fds[i] >= 0) close(fds[i]);
        fds[i] = -1;
    }
}

/* The CPUs the workers are pinned to (--bind): those ddprun itself may run on, in order. Pinning
 * keeps each rank on one core, so the kernel does not stack two ranks on one core while the
 * other idles, and a rank's memory stays in its core's caches. On this project's 2-core
 * machine: the trainer's communication cost 20 % less per step with 2 ranks, and an 8-byte
 * allreduce of 4 ranks took 10 instead of 18 us (docs/benchmarks.md). */
int choose_cpus(job_t *job)
{
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (job->opt.bind == BIND_NONE || sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return 0;
    int n = CPU_COUNT(&allowed);
    if (n < 1) return 0;
    /* auto: one worker per CPU, or the same number on every CPU (round robin); 3 workers on 2
     * CPUs stay unbound, since pinning would put two on one CPU for good. */
    if (job->opt.bind == BIND_AUTO &&
        (job->nworkers < 2 || (job->nworkers > n && job->nworkers % n != 0)))
        return 0;
    job->cpus = malloc((size_t)n * sizeof *job->cpus);
    if (!job->cpus) return -1;
    for (int c = 0; c < CPU_SETSIZE && job->ncpus < n; c++)
        if (CPU_ISSET(c, &allowed)) job->cpus[job->ncpus++] = c;
    return 0;
}

/* Whether worker w writes straight into ddprun's stream fd (1 or 2) instead of a pipe ddprun
 * prefixes. With --no-prefix every worker does. Otherwise rank 0 does when the stream is a
 * terminal: a program that draws on a terminal when it has one (the trainer's progress bar) can
 * then draw under ddprun too, and the other ranks' lines stay prefixed. */
static int writes_directly(const job_t *job, const worker_t *w, int fd)
{
    if (job->opt.log_dir) return 0; /* ddprun copies every line into the rank's log file */
    if (!job->opt.prefix) return 1;
    return w->rank == 0 && (fd == 1 ? job->stdout_tty : job->stderr_tty);
}

int start_worker(job_t *job, worker_t *w)
{
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    int piped_out = !writes_directly(job, w, 1), piped_err = !writes_directly(job, w, 2);
    if ((piped_out && pipe2(out, O_CLOEXEC) != 0) || (piped_err && pipe2(err, O_CLOEXEC) != 0)) {
        perror("ddprun: pipe");
        close_pair(out);
        return -1;
    }
    char **envp = worker_environment(job, w);
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    /* Block the forwarded signals across fork: until the child has reset their handlers, a
     * signal aimed at it would run ddprun's handler in the child and write into the shared
     * signal pipe, so ddprun would believe it had been signalled itself. */
    sigset_t forwarded, saved;
    sigemptyset(&forwarded);
    for (size_t i = 0; i < sizeof forwarded_signals / sizeof forwarded_signals[0]; i++) {
        sigaddset(&forwarded, forwarded_signals[i]);
    }
    sigprocmask(SIG_BLOCK, &forwarded, &saved);
    pid_t pid = fork();
    if (pid > 0 || pid < 0) sigprocmask(SIG_SETMASK, &saved, NULL);
    if (pid < 0) {
        perror("ddprun: fork");
        free_environment(envp);
        close_pair(out);
        close_pair(err);
        return -1;
    }
    if (pid == 0) {
        /* Its own process group, so stopping a worker also stops whatever it started. */
        setpgid(0, 0);
        /* Die with ddprun even if ddprun is SIGKILLed. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        signal(SIGPIPE, SIG_DFL);
        for (size_t i = 0; i < sizeof forwarded_signals / sizeof forwarded_signals[0]; i++) {
            signal(forwarded_signals[i], SIG_DFL);
        }
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if ((piped_out && dup2(out[1], 1) < 0) || (piped_err && dup2(err[1], 2) < 0)) _exit(127);
        if (job->cpus) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(job->cpus[w->local_rank % job->ncpus], &one);
            if (sched_setaffinity(0, sizeof one, &one) != 0) /* not fatal: runs unbound */
                child_error("pin to its CPU (it runs unbound)", job->opt.program[0]);
        }
        execvpe(job->opt.program[0], job->opt.program, envp);
        child_error("run", job->opt.program[0]);
        _exit(127);
    }
    setpgid(pid, pid); /* also here: no race with a kill(-pid) right after fork */
    watchdog_send((int32_t)pid);
    free_environment(envp);
    w->pid = pid;
    w->running = 1;
    if (piped_out) {
        close(out[1]);
        w->out.fd = out[0];
        fcntl(out[0], F_SETFL, O_NONBLOCK);
    }
    if (piped_err) {
        close(err[1]);
        w->err.fd = err[0];
        fcntl(err[0], F_SETFL, O_NONBLOCK);
    }
    return 0;
}

void signal_workers(job_t *job, int sig)
{
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        /* The group outlives the worker when it left children behind: signal it either way. */
        if (w->pid > 0) kill(-w->pid, sig);
        if (w->running) kill(w->pid, sig);
    }
}
