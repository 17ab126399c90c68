/* ddprun: the launcher. Starts N local worker processes of a data-parallel job with torchrun's
 * environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), hosts the TCP rendezvous store on node 0,
 * prefixes each worker's output lines with its rank, and tears the whole job down - on every
 * node - as soon as one worker fails, so no rank is left blocked in a collective.
 *
 * One thread runs an event loop over the workers' output pipes and a self-pipe fed by signal
 * handlers; in multi-node jobs a second thread watches the store for another node's failure. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"

extern char **environ;

#define MAX_LOCAL_WORKERS 1024
#define LINE_MAX_BYTES (64 * 1024)
#define WATCH_INTERVAL_MS 200
#define STORE_CALL_TIMEOUT_MS 5000
#define FAILURE_TEXT_MAX 512
/* How long a first failure that may be a consequence (a non-zero exit) waits for a more likely
 * cause to be reaped before ddprun names a rank; see choose_culprit. */
#define BLAME_WINDOW_S 1.0

/* ---- options ------------------------------------------------------------------------------- */

enum { BIND_AUTO, BIND_CORE, BIND_NONE };

typedef struct options {
    int nproc;               /* workers on this node (-n) */
    int nnodes;              /* nodes in the job */
    int node_rank;           /* this node */
    const char *master_addr; /* NULL: 127.0.0.1 */
    int master_port;         /* 0: any free port (single node only) */
    const char *token;       /* NULL: generated (single node) or DDP_STORE_TOKEN */
    int prefix;              /* prefix output lines with "[rank] " */
    double timeout_s;        /* 0: no limit on the job's run time */
    double grace_s;          /* SIGTERM -> SIGKILL delay */
    double heartbeat_timeout_s;
    int bind;                /* BIND_AUTO, BIND_CORE or BIND_NONE */
    int max_restarts;        /* --max-restarts: times a failed job is started again */
    const char *log_dir;     /* --log-dir: per-rank log files; NULL: none */
    char **program;          /* PROGRAM ARGS..., NULL-terminated (points into argv) */
} options_t;

static const char usage_text[] =
    "usage: ddprun -n N [options] PROGRAM [ARGS...]\n"
    "\n"
    "Starts N worker processes of a libddp (or torchrun-style) job on this machine and waits for\n"
    "them. Node 0 hosts the TCP rendezvous store the workers meet through.\n"
    "\n"
    "options:\n"
    "  -n, --nproc-per-node N  workers to start on this node (required, 1 to 1024), or auto:\n"
    "                          one per CPU ddprun may run on (its affinity mask, as taskset\n"
    "                          sets it)\n"
    "  --standalone            a one-node job with its own store on a free port of 127.0.0.1\n"
    "                          (the default with --nnodes 1; refused with the multi-node\n"
    "                          options)\n"
    "  --nnodes M              nodes in the job (default 1); run one ddprun per node\n"
    "  --node-rank K           this node's index, 0 to M-1 (default 0); node 0 hosts the store\n"
    "  --master-addr A         address of node 0: node 0's store binds to it, the workers connect\n"
    "                          to it (default 127.0.0.1)\n"
    "  --master-port P         port of the store (default: any free port; required when M > 1)\n"
    "  --token T               shared secret of the store. With M > 1 every node needs the same\n"
    "                          token: give --token or export DDP_STORE_TOKEN (preferred: a\n"
    "                          command line is visible to other users in ps). With M = 1 a\n"
    "                          random token is generated unless --token is given.\n"
    "  --no-prefix             pass the workers' output through untouched (default: each line\n"
    "                          starts with \"[RANK] \"; stdout and stderr stay apart; lines\n"
    "                          longer than 64 KiB are split). Either way, when ddprun's stdout\n"
    "                          or stderr is a terminal, rank 0 writes to it directly and\n"
    "                          unprefixed, so it sees a terminal (progress bars draw)\n"
    "  --timeout S             stop the job if it runs longer than S seconds, restarts\n"
    "                          included (default: no limit);\n"
    "                          joining the other nodes waits at most DDP_TIMEOUT seconds\n"
    "  --grace S               seconds between SIGTERM and SIGKILL when stopping workers\n"
    "                          (default 5)\n"
    "  --heartbeat-timeout S   node 0 stops the job when another node's ddprun has been silent\n"
    "                          for S seconds (default 30; multi-node only)\n"
    "  --bind auto|core|none   pin worker i to the i-th CPU ddprun may run on (core; workers\n"
    "                          beyond the CPU count wrap around), or leave placement to the\n"
    "                          kernel (none). auto (default): core when N >= 2 and every CPU\n"
    "                          gets the same number of workers (N <= CPUs, or N a multiple\n"
    "                          of CPUs); otherwise none. A worker's threads (its progress\n"
    "                          thread too) share its CPU. Jobs side by side on one machine:\n"
    "                          start each under taskset with its own CPUs (ddprun binds\n"
    "                          within the CPUs it may use) or give --bind none\n"
    "  --max-restarts N        when a worker fails, stop every worker and start them all\n"
    "                          again, up to N times (default 0), as torchrun does; the workers\n"
    "                          get the attempt number, 0 first, in DDP_RESTART_COUNT and\n"
    "                          TORCHELASTIC_RESTART_COUNT (a program resumes from its\n"
    "                          checkpoint: the trainer's --resume auto). Each attempt gets a\n"
    "                          fresh store. A job stopped by a signal to ddprun or by --timeout\n"
    "                          is not restarted. Single node only\n"
    "  --log-dir DIR           also write each rank's output to DIR/rank<R>.log (stdout and\n"
    "                          stderr lines, unprefixed, as they arrive; a restart appends a\n"
    "                          line naming the attempt). The terminal shows every rank as\n"
    "                          without --log-dir, except that rank 0 goes through ddprun too\n"
    "                          (no terminal of its own: no progress bar)\n"
    "  --print-config          print libddp's environment variables, their values and what\n"
    "                          they accept, and exit\n"
    "  --version               print ddprun's and libddp's version and exit\n"
    "  -h, --help              print this help and exit\n"
    "  Options may also be written --option=VALUE; \"--\" ends the options.\n"
    "\n"
    "environment set for worker i of node K (N workers per node, M nodes):\n"
    "  RANK=K*N+i  WORLD_SIZE=M*N  LOCAL_RANK=i  LOCAL_WORLD_SIZE=N  GROUP_RANK=K\n"
    "  DDP_STORE_ADDR, DDP_STORE_PORT   where ddprun's store listens (libddp's rendezvous)\n"
    "  DDP_STORE_TOKEN            the store's secret\n"
    "  MASTER_ADDR, MASTER_PORT   node 0's address and a port nothing listens on, left free\n"
    "                             for torch's own store (init_process_group), as torchrun does\n"
    "  DDPRUN_JOB_ID              marks every process of this run (random per run)\n"
    "  DDP_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT   the attempt: 0, then 1.. after restarts\n"
    "Workers run in their own process groups. If ddprun dies (even by SIGKILL), or the job\n"
    "fails, a watchdog process kills everything of the job: the workers' process groups and\n"
    "every process whose environment holds this run's DDPRUN_JOB_ID.\n"
    "\n"
    "failures: SIGINT, SIGTERM and SIGHUP are forwarded to every worker (a second one sends\n"
    "SIGKILL). When a worker exits non-zero or is killed, ddprun reports its rank, stops the\n"
    "others (SIGTERM, then SIGKILL after the grace period) on every node, and exits 1, or 128+N\n"
    "when the worker or ddprun was killed by signal N. The rank named is the cause, not a\n"
    "casualty: after a non-zero exit ddprun waits up to 1 s for the other workers, then names\n"
    "a worker killed by a signal before one whose shell reported a signal (status 128+N), and\n"
    "that before one that exited non-zero (a peer's failure makes ranks exit 1); the first\n"
    "reaped within each. A node that fails marks the store key job/failed; the other nodes\n"
    "see it and stop too.\n"
    "\n"
    "exit status: 0 when every worker exited 0; 1 or 128+N on failure; 2 for bad options or a\n"
    "bad value of a DDP_* variable (see --print-config).\n";

static void usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("ddprun: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\nTry 'ddprun --help'.\n", stderr);
    exit(2);
}

static int parse_int(const char *option, const char *text, int lo, int hi)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (end == text || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
        usage_error("%s: '%s' is not an integer from %d to %d", option, text, lo, hi);
    }
    return (int)v;
}

static double parse_seconds(const char *option, const char *text)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end != '\0' || errno == ERANGE || !(v >= 0) || v > 1e7) {
        usage_error("%s: '%s' is not a number of seconds (0 or more)", option, text);
    }
    return v;
}

/* The CPUs ddprun may run on (its affinity mask, which taskset and cgroups narrow): what
 * `--nproc-per-node auto` starts, one worker each. torchrun's auto counts the machine's CPUs;
 * the mask is the better answer inside `taskset` or a container with fewer CPUs. */
static int cpus_allowed(void)
{
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    int n = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : 0;
    if (n < 1) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? (int)online : 1;
    }
    return n > MAX_LOCAL_WORKERS ? MAX_LOCAL_WORKERS : n;
}

/* Matches argv[*i] against `name`; returns its value ("--name V" or "--name=V"), advancing *i. */
static const char *option_value(int argc, char **argv, int *i, const char *name)
{
    const char *arg = argv[*i];
    size_t n = strlen(name);
    if (strncmp(arg, name, n) != 0) return NULL;
    if (arg[n] == '=') return arg + n + 1;
    if (arg[n] != '\0') return NULL;
    if (*i + 1 >= argc) usage_error("%s needs a value", name);
    *i += 1;
    return argv[*i];
}

static void parse_options(int argc, char **argv, options_t *o)
{
    memset(o, 0, sizeof *o);
    o->nproc = -1;
    o->nnodes = 1;
    o->prefix = 1;
    o->grace_s = 5.0;
    o->heartbeat_timeout_s = 30.0;
    int standalone = 0;
    const char *multinode_option = NULL; /* the first option --standalone contradicts */
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        const char *v;
        if (a[0] != '-' || a[1] == '\0') break;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            exit(0);
        } else if (strcmp(a, "--version") == 0) {
            printf("ddprun (libddp) %s\n", ddp_version());
            exit(0);
        } else if (strcmp(a, "--standalone") == 0) {
            standalone = 1;
        } else if (strcmp(a, "--print-config") == 0) {
            exit(ddp_config_print(stdout) == DDP_OK ? 0 : 1);
        } else if (strcmp(a, "--no-prefix") == 0) {
            o->prefix = 0;
        } else if ((v = option_value(argc, argv, &i, "-n")) ||
                   (v = option_value(argc, argv, &i, "--nproc-per-node"))) {
            o->nproc = strcmp(v, "auto") == 0 ? cpus_allowed() : parse_int(a, v, 1, MAX_LOCAL_WORKERS);
        } else if ((v = option_value(argc, argv, &i, "--nnodes"))) {
            o->nnodes = parse_int("--nnodes", v, 1, 1 << 16);
            multinode_option = multinode_option ? multinode_option : "--nnodes";
        } else if ((v = option_value(argc, argv, &i, "--max-restarts"))) {
            o->max_restarts = parse_int("--max-restarts", v, 0, 1000000);
        } else if ((v = option_value(argc, argv, &i, "--log-dir"))) {
            if (!*v) usage_error("--log-dir needs a directory");
            o->log_dir = v;
        } else if ((v = option_value(argc, argv, &i, "--node-rank"))) {
            o->node_rank = parse_int("--node-rank", v, 0, 1 << 16);
            multinode_option = multinode_option ? multinode_option : "--node-rank";
        } else if ((v = option_value(argc, argv, &i, "--master-addr"))) {
            if (!*v || strlen(v) >= 256) usage_error("--master-addr: '%s' is not an address", v);
            o->master_addr = v;
            multinode_option = multinode_option ? multinode_option : "--master-addr";
        } else if ((v = option_value(argc, argv, &i, "--master-port"))) {
            o->master_port = parse_int("--master-port", v, 1, 65535);
            multinode_option = multinode_option ? multinode_option : "--master-port";
        } else if ((v = option_value(argc, argv, &i, "--token"))) {
            o->token = v;
        } else if ((v = option_value(argc, argv, &i, "--timeout"))) {
            o->timeout_s = parse_seconds("--timeout", v);
        } else if ((v = option_value(argc, argv, &i, "--grace"))) {
            o->grace_s = parse_seconds("--grace", v);
        } else if ((v = option_value(argc, argv, &i, "--bind"))) {
            if (strcmp(v, "auto") == 0) o->bind = BIND_AUTO;
            else if (strcmp(v, "core") == 0) o->bind = BIND_CORE;
            else if (strcmp(v, "none") == 0) o->bind = BIND_NONE;
            else usage_error("--bind: '%s' is not auto, core or none", v);
        } else if ((v = option_value(argc, argv, &i, "--heartbeat-timeout"))) {
            o->heartbeat_timeout_s = parse_seconds("--heartbeat-timeout", v);
            if (o->heartbeat_timeout_s < 1) usage_error("--heartbeat-timeout: at least 1 second");
        } else {
            usage_error("unknown option '%s'", a);
        }
    }
    if (o->nproc < 0) usage_error("-n N (workers per node) is required");
    /* torchrun's --standalone: this machine alone, a store of its own on a free local port. */
    if (standalone && multinode_option) {
        usage_error("--standalone is a one-node job on a local store; it cannot be combined "
                    "with %s",
                    multinode_option);
    }
    /* A restart gives the job a fresh store; across nodes every ddprun would have to agree on
     * the new one (torchrun's rendezvous rounds), which ddprun does not do. */
    if (o->max_restarts > 0 && o->nnodes > 1) {
        usage_error("--max-restarts works on one node only (--nnodes %d given)", o->nnodes);
    }
    if (i >= argc) usage_error("no PROGRAM to run");
    o->program = argv + i;
    if (o->node_rank >= o->nnodes) {
        usage_error("--node-rank %d is not below --nnodes %d", o->node_rank, o->nnodes);
    }
    if ((long long)o->nnodes * o->nproc > INT_MAX) usage_error("--nnodes x -n is too large");
    if (o->nnodes > 1) {
        if (o->master_port == 0) {
            usage_error("--nnodes %d needs --master-port (every node must know it)", o->nnodes);
        }
        if (!o->token) {
            const char *t = getenv("DDP_STORE_TOKEN");
            if (!t || !*t) {
                usage_error("--nnodes %d needs the same token on every node: export "
                            "DDP_STORE_TOKEN or give --token",
                            o->nnodes);
            }
            o->token = t;
        }
    }
    if (o->token && (!*o->token || strlen(o->token) >= 128)) {
        usage_error("--token/DDP_STORE_TOKEN must be 1 to 127 characters");
    }
}

/* ---- small helpers ------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Our stdout/stderr whose reader went away (`ddprun ... | head`), by descriptor. */
static int output_closed[3];

/* Writes everything, retrying on EINTR and on a non-blocking descriptor that is full. */
static void write_all(int fd, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n > 0) {
            data += n;
            len -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && errno == EAGAIN) {
            struct pollfd p = {fd, POLLOUT, 0};
            poll(&p, 1, 100);
        } else {
            if (n < 0 && errno == EPIPE && fd >= 0 && fd < 3) output_closed[fd] = 1;
            return; /* the reader went away: drop the output */
        }
    }
}

static const char *signal_name(int sig)
{
    const char *abbrev = sigabbrev_np(sig);
    static _Thread_local char name[32];
    snprintf(name, sizeof name, "SIG%s", abbrev ? abbrev : "?");
    return name;
}

static void make_token(char *out, size_t size)
{
    unsigned char bytes[24];
    size_t got = 0;
    while (got < sizeof bytes) {
        ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
        if (n > 0) got += (size_t)n;
        else if (n < 0 && errno != EINTR) break;
    }
    if (got < sizeof bytes) {
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, bytes, sizeof bytes);
            if (n == (ssize_t)sizeof bytes) got = sizeof bytes;
            close(fd);
        }
    }
    if (got < sizeof bytes) {
        fprintf(stderr, "ddprun: cannot read random bytes for the store token\n");
        exit(1);
    }
    static const char hex[] = "0123456789abcdef";
    size_t k = 0;
    for (size_t j = 0; j < sizeof bytes && k + 2 < size; j++) {
        out[k++] = hex[bytes[j] >> 4];
        out[k++] = hex[bytes[j] & 15];
    }
    out[k] = '\0';
}

/* ---- signals: handlers only write the signal number into a pipe the event loop polls ------- */

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

static void install_signal_handlers(void)
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
static void block_forwarded_signals(int block, sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    for (size_t i = 0; i < sizeof forwarded_signals / sizeof forwarded_signals[0]; i++) {
        sigaddset(&set, forwarded_signals[i]);
    }
    if (block) pthread_sigmask(SIG_BLOCK, &set, old);
    else pthread_sigmask(SIG_SETMASK, old, NULL);
}

/* ---- the watchdog: nothing of the job outlives ddprun ------------------------------------ */

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
static void start_watchdog(void)
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

static void watchdog_send(int32_t message)
{
    if (watchdog_fd < 0) return;
    /* Four bytes: one atomic pipe write. A watchdog that died gives EPIPE (SIGPIPE is ignored). */
    ssize_t ignored = write(watchdog_fd, &message, sizeof message);
    (void)ignored;
}

/* At ddprun's exit: a job that ended well leaves what its workers left running (as without the
 * watchdog); after a failure or a signal the watchdog sweeps the job, and ddprun waits for it so
 * that nothing of the job is left when ddprun returns. */
static void finish_watchdog(int job_failed)
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

/* ---- workers and their output -------------------------------------------------------------- */

typedef struct stream {
    int fd;        /* read end of the worker's pipe; -1 once closed */
    int target;    /* 1 or 2: where prefixed lines go */
    char *pending; /* bytes of an unfinished line (LINE_MAX_BYTES) */
    size_t len;
} stream_t;

typedef struct worker {
    int rank;
    int local_rank;
    pid_t pid;    /* also its process-group id */
    int running;  /* not reaped yet */
    int status;   /* wait status once reaped */
    int reaped;   /* 1, 2, ...: the order in which ddprun reaped the workers; 0 while running */
    int prefix;   /* its lines get "[rank] " in front (off with --no-prefix) */
    int log_fd;   /* --log-dir: DIR/rank<R>.log, or -1 */
    stream_t out;
    stream_t err;
} worker_t;

/* Writes "[rank] <line>\n" in one write, so lines of different workers never mix; with
 * --log-dir, the line without the prefix goes to the rank's log file too. */
static void emit_line(const worker_t *w, stream_t *s)
{
    char prefix[32] = "";
    int plen = w->prefix ? snprintf(prefix, sizeof prefix, "[%d] ", w->rank) : 0;
    char *buf = malloc((size_t)plen + s->len + 1);
    if (buf) {
        memcpy(buf, prefix, (size_t)plen);
        memcpy(buf + plen, s->pending, s->len);
        buf[(size_t)plen + s->len] = '\n';
        write_all(s->target, buf, (size_t)plen + s->len + 1);
        if (w->log_fd >= 0) write_all(w->log_fd, buf + plen, s->len + 1);
        free(buf);
    }
    s->len = 0;
}

/* Adds bytes of the current line; a line longer than LINE_MAX_BYTES is split into several. */
static void stream_append(const worker_t *w, stream_t *s, const char *data, size_t len)
{
    while (len > 0) {
        if (s->len == LINE_MAX_BYTES) emit_line(w, s);
        size_t take = LINE_MAX_BYTES - s->len;
        if (take > len) take = len;
        memcpy(s->pending + s->len, data, take);
        s->len += take;
        data += take;
        len -= take;
    }
}

/* Reads what the worker wrote; emits every complete line with its rank in front. */
static void stream_read(const worker_t *w, stream_t *s)
{
    if (output_closed[s->target]) {
        /* Nobody reads our side any more: close theirs too, so the worker gets SIGPIPE as it
         * would writing straight into the closed pipe. */
        close(s->fd);
        s->fd = -1;
        s->len = 0;
        return;
    }
    char chunk[16384];
    ssize_t n = read(s->fd, chunk, sizeof chunk);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) { /* EOF (or an error): flush a partial last line and stop watching */
        if (s->len > 0) emit_line(w, s);
        close(s->fd);
        s->fd = -1;
        return;
    }
    size_t start = 0;
    for (size_t k = 0; k < (size_t)n; k++) {
        if (chunk[k] != '\n') continue;
        stream_append(w, s, chunk + start, k - start);
        emit_line(w, s);
        start = k + 1;
    }
    stream_append(w, s, chunk + start, (size_t)n - start);
}

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

typedef struct job {
    options_t opt;
    const char *master_addr;
    int master_port;  /* our store's (DDP_STORE_PORT) */
    int torch_port;   /* free for torch's own store (MASTER_PORT), as torchrun leaves it */
    char token[128];
    worker_t *workers;
    int nworkers;
    int *cpus; /* worker i runs on cpus[i % ncpus]; NULL: not bound */
    int ncpus;
    int running;
    int stdout_tty;       /* ddprun's stdout is a terminal: rank 0 gets it (writes_directly) */
    int stderr_tty;       /* the same for stderr */
    int reaped;           /* workers reaped so far */
    double blame_until;   /* > 0: a worker failed; name the culprit by then at the latest */
    /* how the job ends */
    int stopping;         /* teardown started */
    int killed;           /* SIGKILL already sent */
    double kill_at;       /* when to escalate to SIGKILL */
    int exit_code;
    int final;            /* stopped by a signal to ddprun or --timeout: never restarted */
    int attempt;          /* 0, then 1.. after each --max-restarts restart */
    double deadline;      /* --timeout: when the whole job (every attempt) must end; 0: never */
    /* multi-node */
    ddp_store_t *store;
    ddp_store_server_t *server;
    pthread_t watcher;
    int watcher_running;
    int notify_pipe[2];
    pthread_mutex_t lock;
    char remote_failure[FAILURE_TEXT_MAX]; /* guarded by lock */
    int watcher_stop;                      /* guarded by lock */
    int watcher_done;                      /* guarded by lock: the store is unreachable */
    int64_t nodes_exited;                  /* guarded by lock */
    int nodes_dead;                        /* guarded by lock: node 0 gave up on them */
} job_t;

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
    envp[k++] = env_entry("DDPRUN_JOB_ID", "%s", job_id);
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
static int choose_cpus(job_t *job)
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

static int start_worker(job_t *job, worker_t *w)
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

static void signal_workers(job_t *job, int sig)
{
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        /* The group outlives the worker when it left children behind: signal it either way. */
        if (w->pid > 0) kill(-w->pid, sig);
        if (w->running) kill(w->pid, sig);
    }
}

static void begin_stop(job_t *job, int exit_code)
{
    if (job->stopping) return;
    job->stopping = 1;
    job->exit_code = exit_code;
    if (job->running > 0) {
        fprintf(stderr, "ddprun: stopping %d remaining worker%s (SIGTERM, SIGKILL after %g s)\n",
                job->running, job->running == 1 ? "" : "s", job->opt.grace_s);
        signal_workers(job, SIGTERM);
    }
    job->kill_at = now_s() + job->opt.grace_s;
}

/* ---- multi-node: the store, the watcher thread and job/failed ------------------------------ */

/* The store is there and reachable (a lost store would make every call wait its timeout). */
static int store_usable(job_t *job)
{
    if (!job->store) return 0;
    pthread_mutex_lock(&job->lock);
    int lost = job->watcher_done && !job->watcher_stop;
    pthread_mutex_unlock(&job->lock);
    return !lost;
}

static void publish_failure(job_t *job, const char *text)
{
    if (!store_usable(job)) return;
    void *current = NULL;
    size_t current_len = 0;
    ddp_status_t s = ddp_store_compare_set(job->store, "job/failed", NULL, 0, text, strlen(text),
                                           &current, &current_len);
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: could not tell the other nodes (job/failed): %s\n",
                ddp_last_error());
    }
    ddp_free(current);
}

static void set_remote_failure(job_t *job, const char *text);

/* Reads job/failed into job->remote_failure when some node has set it. */
static ddp_status_t fetch_failure(job_t *job)
{
    const char *failed_key = "job/failed";
    int exists = 0;
    ddp_status_t s = ddp_store_check(job->store, &failed_key, 1, &exists);
    if (s != DDP_OK || !exists) return s;
    void *v = NULL;
    size_t len = 0;
    s = ddp_store_get(job->store, failed_key, &v, &len);
    if (s == DDP_OK) set_remote_failure(job, (const char *)v);
    ddp_free(v);
    return s;
}

/* Counts this node out (job/exited) so node 0 stops waiting for it; returns the new count. */
static int64_t mark_exited(job_t *job)
{
    char key[64];
    int64_t count = 0;
    snprintf(key, sizeof key, "job/exited/%d", job->opt.node_rank);
    if (ddp_store_set(job->store, key, "1", 1) == DDP_OK) {
        ddp_store_add(job->store, "job/exited", 1, &count);
    }
    return count;
}

static void notify_main(job_t *job)
{
    unsigned char b = 1;
    ssize_t ignored = write(job->notify_pipe[1], &b, 1);
    (void)ignored;
}

static int watcher_should_stop(job_t *job)
{
    pthread_mutex_lock(&job->lock);
    int stop = job->watcher_stop;
    pthread_mutex_unlock(&job->lock);
    return stop;
}

static void set_remote_failure(job_t *job, const char *text)
{
    pthread_mutex_lock(&job->lock);
    if (!job->remote_failure[0]) snprintf(job->remote_failure, sizeof job->remote_failure, "%s", text);
    pthread_mutex_unlock(&job->lock);
    notify_main(job);
}

/* Every WATCH_INTERVAL_MS: look for job/failed, beat this node's heartbeat, count the nodes that
 * have finished, and (node 0) notice another node's ddprun that went silent or never came. */
static void *watcher_main(void *arg)
{
    job_t *job = arg;
    const options_t *o = &job->opt;
    int nnodes = o->nnodes;
    int64_t *last_beat = calloc((size_t)nnodes, sizeof *last_beat);
    double *last_change = calloc((size_t)nnodes, sizeof *last_change);
    char *dead = calloc((size_t)nnodes, 1);
    if (!last_beat || !last_change || !dead) {
        set_remote_failure(job, "ddprun watcher: out of memory");
        free(last_beat);
        free(last_change);
        free(dead);
        return NULL;
    }
    double started = now_s();
    double join_limit = ddp_default_timeout_ms() / 1000.0;
    for (int k = 0; k < nnodes; k++) last_change[k] = started;
    char key[64], text[FAILURE_TEXT_MAX];
    snprintf(key, sizeof key, "job/heartbeat/%d", o->node_rank);
    while (!watcher_should_stop(job)) {
        /* Count finished nodes before looking for job/failed: a node sets job/failed before it
         * counts itself out, so a count that includes a failed node comes with its failure. */
        int64_t value = 0;
        ddp_status_t s = ddp_store_add(job->store, key, 1, &value);
        if (s == DDP_OK) s = ddp_store_add(job->store, "job/exited", 0, &value);
        if (s == DDP_OK) s = fetch_failure(job);
        if (s == DDP_OK) {
            pthread_mutex_lock(&job->lock);
            job->nodes_exited = value;
            pthread_mutex_unlock(&job->lock);
            notify_main(job);
        }
        if (s != DDP_OK) {
            if (watcher_should_stop(job)) break;
            snprintf(text, sizeof text, "lost the store at %s:%d (node 0 gone?): %s",
                     job->master_addr, job->master_port, ddp_last_error());
            set_remote_failure(job, text);
            break;
        }
        if (o->node_rank == 0) {
            double now = now_s();
            for (int k = 1; k < nnodes; k++) {
                if (dead[k]) continue;
                char other[64];
                int done = 0;
                snprintf(other, sizeof other, "job/exited/%d", k);
                const char *done_key = other;
                if (ddp_store_check(job->store, &done_key, 1, &done) != DDP_OK || done) continue;
                snprintf(other, sizeof other, "job/heartbeat/%d", k);
                int64_t beat = 0;
                if (ddp_store_add(job->store, other, 0, &beat) != DDP_OK) continue;
                if (beat != last_beat[k]) {
                    last_beat[k] = beat;
                    last_change[k] = now;
                    continue;
                } else if (beat == 0 && now - started > join_limit) {
                    snprintf(text, sizeof text,
                             "node %d did not join within %g s (DDP_TIMEOUT)", k, join_limit);
                } else if (beat > 0 && now - last_change[k] > o->heartbeat_timeout_s) {
                    snprintf(text, sizeof text,
                             "node %d's ddprun has been silent for %g s (--heartbeat-timeout)",
                             k, o->heartbeat_timeout_s);
                } else {
                    continue;
                }
                /* Written here, seen by every node (this one included) on the next check. */
                publish_failure(job, text);
                dead[k] = 1;
                pthread_mutex_lock(&job->lock);
                job->nodes_dead++;
                pthread_mutex_unlock(&job->lock);
            }
        }
        sleep_ms(WATCH_INTERVAL_MS);
    }
    free(last_beat);
    free(last_change);
    free(dead);
    pthread_mutex_lock(&job->lock);
    job->watcher_done = 1;
    pthread_mutex_unlock(&job->lock);
    notify_main(job);
    return NULL;
}

/* A port nothing listens on at addr now, for torch's own store (MASTER_PORT): bind port 0, read
 * what the kernel gave, close. torchrun does the same; the port may be taken again before torch
 * binds it, a small race both accept. 0 when none could be found. */
static int free_port(const char *addr)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(addr, "0", &hints, &res) != 0) return 0;
    int port = 0;
    for (struct addrinfo *ai = res; ai && !port; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        struct sockaddr_storage bound;
        socklen_t len = sizeof bound;
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
            getsockname(fd, (struct sockaddr *)&bound, &len) == 0)
            port = ntohs(bound.ss_family == AF_INET6
                             ? ((struct sockaddr_in6 *)&bound)->sin6_port
                             : ((struct sockaddr_in *)&bound)->sin_port);
        close(fd);
    }
    freeaddrinfo(res);
    return port;
}

/* Node 0 hosts the store (multi-node: every node also connects to it as a client). */
static int setup_store(job_t *job)
{
    const options_t *o = &job->opt;
    job->master_addr = o->master_addr ? o->master_addr : "127.0.0.1";
    job->master_port = o->master_port;
    if (o->token) snprintf(job->token, sizeof job->token, "%s", o->token);
    else make_token(job->token, sizeof job->token);

    if (o->node_rank == 0) {
        sigset_t old;
        block_forwarded_signals(1, &old);
        ddp_status_t s =
            ddp_store_server_start(job->master_addr, o->master_port, job->token, &job->server);
        block_forwarded_signals(0, &old);
        if (s != DDP_OK) {
            fprintf(stderr, "ddprun: cannot host the store on %s:%d: %s\n", job->master_addr,
                    o->master_port, ddp_last_error());
            return -1;
        }
        job->master_port = ddp_store_server_port(job->server);
        job->torch_port = free_port(job->master_addr);
        if (job->torch_port == 0) {
            fprintf(stderr, "ddprun: no free port on %s for MASTER_PORT\n", job->master_addr);
            return -1;
        }
    }
    if (o->nnodes == 1) return 0;

    int timeout_ms = ddp_default_timeout_ms();
    if (o->timeout_s > 0 && o->timeout_s * 1000 < timeout_ms) timeout_ms = (int)(o->timeout_s * 1000);
    if (timeout_ms < 1) timeout_ms = 1;
    /* The client starts no thread; leaving signals open here lets Ctrl-C end a long wait for
     * node 0 at once (on_signal exits while no worker exists). */
    ddp_status_t s = ddp_store_tcp_connect(job->master_addr, job->master_port, job->token,
                                           timeout_ms, &job->store);
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: node %d cannot reach the store at %s:%d: %s\n", o->node_rank,
                job->master_addr, job->master_port, ddp_last_error());
        return -1;
    }
    ddp_store_set_timeout(job->store, timeout_ms);

    /* Every node must agree on the shape of the job, and each node rank be taken once. */
    char config[128], key[64];
    snprintf(config, sizeof config, "nnodes=%d nproc=%d", o->nnodes, o->nproc);
    if (o->node_rank == 0) {
        s = ddp_store_set(job->store, "ddprun/config", config, strlen(config));
    } else {
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(job->store, "ddprun/config", &v, &len);
        if (s == DDP_OK && (len != strlen(config) || memcmp(v, config, len) != 0)) {
            /* The ranks could never meet: stop the nodes that did start. */
            char text[FAILURE_TEXT_MAX];
            snprintf(text, sizeof text, "node %d was started with %s but node 0 with %.*s",
                     o->node_rank, config, (int)len, (const char *)v);
            fprintf(stderr, "ddprun: %s\n", text);
            ddp_store_set_timeout(job->store, STORE_CALL_TIMEOUT_MS);
            publish_failure(job, text);
            mark_exited(job);
            ddp_free(v);
            return -1;
        }
        ddp_free(v);
    }
    if (s == DDP_OK) {
        char mine[128], host[64] = "?";
        gethostname(host, sizeof host);
        host[sizeof host - 1] = '\0';
        snprintf(mine, sizeof mine, "pid %d on %s", (int)getpid(), host);
        snprintf(key, sizeof key, "ddprun/node/%d", o->node_rank);
        void *current = NULL;
        size_t len = 0;
        s = ddp_store_compare_set(job->store, key, NULL, 0, mine, strlen(mine), &current, &len);
        if (s == DDP_OK && (len != strlen(mine) || memcmp(current, mine, len) != 0)) {
            fprintf(stderr, "ddprun: --node-rank %d is already taken by ddprun %.*s\n",
                    o->node_rank, (int)len, (const char *)current);
            ddp_free(current);
            return -1;
        }
        ddp_free(current);
    }
    if (s == DDP_OK) {
        /* Every node's workers get node 0's choice of MASTER_PORT. */
        char text[16];
        if (o->node_rank == 0) {
            snprintf(text, sizeof text, "%d", job->torch_port);
            s = ddp_store_set(job->store, "ddprun/torch_port", text, strlen(text));
        } else {
            void *v = NULL;
            size_t len = 0;
            s = ddp_store_get(job->store, "ddprun/torch_port", &v, &len);
            if (s == DDP_OK) job->torch_port = atoi((const char *)v);
            ddp_free(v);
        }
    }
    if (s != DDP_OK) {
        fprintf(stderr, "ddprun: node %d: rendezvous through the store failed: %s\n",
                o->node_rank, ddp_last_error());
        return -1;
    }
    ddp_store_set_timeout(job->store, STORE_CALL_TIMEOUT_MS);
    return 0;
}

static int start_watcher(job_t *job)
{
    if (pipe2(job->notify_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        perror("ddprun: pipe");
        return -1;
    }
    if (!job->store) return 0;
    sigset_t old;
    block_forwarded_signals(1, &old);
    int rc = pthread_create(&job->watcher, NULL, watcher_main, job);
    block_forwarded_signals(0, &old);
    if (rc != 0) {
        fprintf(stderr, "ddprun: cannot start the store watcher: %s\n", strerror(rc));
        return -1;
    }
    job->watcher_running = 1;
    return 0;
}

static void stop_watcher(job_t *job)
{
    if (!job->watcher_running) return;
    pthread_mutex_lock(&job->lock);
    job->watcher_stop = 1;
    pthread_mutex_unlock(&job->lock);
    pthread_join(job->watcher, NULL);
    job->watcher_running = 0;
}

/* ---- the event loop ------------------------------------------------------------------------ */

static void describe_exit(char *out, size_t size, const worker_t *w, int node, int nnodes)
{
    char where[48] = "";
    if (nnodes > 1) snprintf(where, sizeof where, " on node %d", node);
    if (WIFSIGNALED(w->status)) {
        int sig = WTERMSIG(w->status);
        snprintf(out, size, "rank %d (pid %d) killed by signal %d (%s)%s", w->rank, (int)w->pid,
                 sig, signal_name(sig), where);
    } else {
        snprintf(out, size, "rank %d (pid %d) exited with status %d%s", w->rank, (int)w->pid,
                 WEXITSTATUS(w->status), where);
    }
}

/* How sure ddprun is that a failed worker is the cause rather than a casualty, strongest first.
 * A worker that a peer's failure reached (a libddp rank returns DDP_ERR_REMOTE or
 * DDP_ERR_ABORTED and its program exits 1) dies by its own exit; a worker that ddprun did not
 * signal and that nevertheless died by a signal was killed from outside (the OOM killer, kill -9,
 * a crash) and cannot be anyone's casualty. A shell reports its child's signal death as exit
 * status 128+N, so a worker running `sh -c 'trainer ...'` ranks with the signal deaths. */
enum { FAILURE_NONE, FAILURE_SIGNAL, FAILURE_SHELL_SIGNAL, FAILURE_EXIT };

static int failure_kind(const worker_t *w)
{
    if (w->running || !w->reaped) return FAILURE_NONE;
    if (WIFSIGNALED(w->status)) return FAILURE_SIGNAL;
    int code = WIFEXITED(w->status) ? WEXITSTATUS(w->status) : 1;
    if (code == 0) return FAILURE_NONE;
    if (code > 128 && code <= 128 + 64) return FAILURE_SHELL_SIGNAL;
    return FAILURE_EXIT;
}

/* The culprit among the failed workers: the strongest kind, and among those the first reaped. */
static worker_t *choose_culprit(job_t *job)
{
    worker_t *best = NULL;
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        int kind = failure_kind(w);
        if (kind == FAILURE_NONE) continue;
        if (!best || kind < failure_kind(best) ||
            (kind == failure_kind(best) && w->reaped < best->reaped))
            best = w;
    }
    return best;
}

/* Names the culprit (and, after it, the workers that failed with it), tells the other nodes and
 * stops the rest of the job. ddprun exits with the culprit's status: 128+N for a signal death
 * (also one its shell reported), 1 for any other failure. */
static void blame(job_t *job)
{
    worker_t *culprit = choose_culprit(job);
    job->blame_until = 0;
    if (!culprit || job->stopping) return;
    char text[FAILURE_TEXT_MAX];
    describe_exit(text, sizeof text, culprit, job->opt.node_rank, job->opt.nnodes);
    fprintf(stderr, "ddprun: %s\n", text);
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (w == culprit || failure_kind(w) == FAILURE_NONE) continue;
        char other[FAILURE_TEXT_MAX];
        describe_exit(other, sizeof other, w, job->opt.node_rank, job->opt.nnodes);
        fprintf(stderr, "ddprun: after it, %s\n", other);
    }
    publish_failure(job, text);
    int code = 1;
    if (WIFSIGNALED(culprit->status)) code = 128 + WTERMSIG(culprit->status);
    else if (failure_kind(culprit) == FAILURE_SHELL_SIGNAL) code = WEXITSTATUS(culprit->status);
    begin_stop(job, code);
}

/* Reaps the workers that exited. The first failure does not end the job at once: over TCP a
 * SIGKILLed rank's peers see the connection reset and exit 1 within microseconds, sometimes
 * before ddprun reaps the killed rank, and waitpid then reports the casualty first (6 of 48 kills
 * named the wrong rank). So a failure opens a window of BLAME_WINDOW_S in which the others may
 * be reaped too, and ddprun names the culprit (choose_culprit) once the window closes, once a
 * signal death settles it, or once no worker is left. The workers still running get their SIGTERM
 * that much later; they are blocked in a collective or exiting on the failure anyway. */
static void reap(job_t *job)
{
    for (;;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) break;
        for (int i = 0; i < job->nworkers; i++) {
            worker_t *w = &job->workers[i];
            if (w->pid != pid || !w->running) continue;
            w->running = 0;
            w->status = status;
            w->reaped = ++job->reaped;
            job->running--;
            if (failure_kind(w) != FAILURE_NONE && !job->stopping && job->blame_until == 0)
                job->blame_until = now_s() + BLAME_WINDOW_S;
        }
    }
    if (job->blame_until == 0 || job->stopping) return;
    worker_t *culprit = choose_culprit(job);
    if (failure_kind(culprit) == FAILURE_SIGNAL || job->running == 0 || now_s() >= job->blame_until)
        blame(job);
}

static int streams_open(const job_t *job)
{
    for (int i = 0; i < job->nworkers; i++) {
        if (job->workers[i].out.fd >= 0 || job->workers[i].err.fd >= 0) return 1;
    }
    return 0;
}

static void run_event_loop(job_t *job)
{
    const options_t *o = &job->opt;
    double deadline = job->deadline; /* --timeout counts from the first attempt's start */
    double drain_until = 0;  /* after the last worker: stop waiting for stray pipe writers */
    int sent_exited = 0;
    double linger_until = 0; /* node 0: wait for the other nodes before closing the store */
    struct pollfd *fds = calloc((size_t)job->nworkers * 2 + 2, sizeof *fds);
    worker_t **owner = calloc((size_t)job->nworkers * 2 + 2, sizeof *owner);
    stream_t **stream_of = calloc((size_t)job->nworkers * 2 + 2, sizeof *stream_of);
    if (!fds || !owner || !stream_of) {
        fprintf(stderr, "ddprun: out of memory\n");
        begin_stop(job, 1);
    }
    for (;;) {
        int nfds = 0;
        if (fds) {
            fds[nfds++] = (struct pollfd){signal_pipe[0], POLLIN, 0};
            fds[nfds++] = (struct pollfd){job->notify_pipe[0], POLLIN, 0};
            for (int i = 0; i < job->nworkers; i++) {
                stream_t *ss[2] = {&job->workers[i].out, &job->workers[i].err};
                for (int k = 0; k < 2; k++) {
                    if (ss[k]->fd < 0) continue;
                    owner[nfds] = &job->workers[i];
                    stream_of[nfds] = ss[k];
                    fds[nfds++] = (struct pollfd){ss[k]->fd, POLLIN, 0};
                }
            }
            if (poll(fds, (nfds_t)nfds, 100) < 0 && errno != EINTR) perror("ddprun: poll");
        } else {
            sleep_ms(100);
        }

        /* Signals sent to ddprun go to every worker; a second one escalates to SIGKILL. */
        unsigned char sigs[16];
        ssize_t got;
        while ((got = read(signal_pipe[0], sigs, sizeof sigs)) > 0) {
            /* A failure awaiting its culprit is named before the signal changes the job's end. */
            if (job->blame_until > 0) blame(job);
            for (ssize_t k = 0; k < got; k++) {
                int sig = sigs[k];
                job->final = 1; /* the user stops the job: no restart */
                if (!job->stopping) {
                    fprintf(stderr, "ddprun: received %s, forwarding it to the workers\n",
                            signal_name(sig));
                    char text[FAILURE_TEXT_MAX];
                    snprintf(text, sizeof text, "ddprun on node %d received %s", o->node_rank,
                             signal_name(sig));
                    publish_failure(job, text);
                    job->stopping = 1;
                    job->final = 1;
                    job->exit_code = 128 + sig;
                    job->kill_at = now_s() + o->grace_s;
                    signal_workers(job, sig);
                } else if (!job->killed) {
                    fprintf(stderr, "ddprun: received %s again, killing the workers\n",
                            signal_name(sig));
                    job->killed = 1;
                    signal_workers(job, SIGKILL);
                }
            }
        }
        while ((got = read(job->notify_pipe[0], sigs, sizeof sigs)) > 0) {
        }

        for (int i = 2; i < nfds; i++) {
            if (fds[i].revents) stream_read(owner[i], stream_of[i]);
        }
        reap(job);

        char remote[FAILURE_TEXT_MAX];
        int64_t exited = 0;
        int watcher_done = 0;
        pthread_mutex_lock(&job->lock);
        snprintf(remote, sizeof remote, "%s", job->remote_failure);
        exited = job->nodes_exited + job->nodes_dead;
        watcher_done = job->watcher_done;
        pthread_mutex_unlock(&job->lock);
        double now = now_s();
        /* Another node's failure or --timeout: a local failure already reaped is named first. */
        if (job->blame_until > 0 && (remote[0] || (deadline > 0 && now > deadline))) blame(job);
        if (remote[0] && !job->stopping) {
            fprintf(stderr, "ddprun: stopping the job: %s\n", remote);
            begin_stop(job, 1);
        }
        if (deadline > 0 && now > deadline && !job->stopping) {
            fprintf(stderr, "ddprun: the job ran past --timeout %g s\n", o->timeout_s);
            char text[FAILURE_TEXT_MAX];
            snprintf(text, sizeof text, "node %d ran past --timeout %g s", o->node_rank,
                     o->timeout_s);
            publish_failure(job, text);
            begin_stop(job, 1);
            job->final = 1;
        }
        if (job->stopping && !job->killed && job->running > 0 && now >= job->kill_at) {
            fprintf(stderr, "ddprun: %d worker%s still running after %g s, sending SIGKILL\n",
                    job->running, job->running == 1 ? "" : "s", o->grace_s);
            job->killed = 1;
            signal_workers(job, SIGKILL);
        }

        if (job->running > 0) continue;
        /* Every worker is reaped. Take what they left in the pipes, then finish. */
        if (drain_until == 0) {
            drain_until = now + 2.0;
            /* Anything a worker left behind in its process group goes with it. */
            if (job->stopping) signal_workers(job, SIGKILL);
        }
        if (streams_open(job) && now < drain_until) continue;
        if (!job->store) break;
        if (!store_usable(job)) break;
        if (!sent_exited) {
            int64_t count = mark_exited(job);
            sent_exited = 1;
            /* The count may already include a node that failed after our workers finished. */
            fetch_failure(job);
            if (o->node_rank != 0) break;
            /* Node 0 keeps the store up until the other nodes are done; after a failure, only
             * long enough for them to see job/failed and stop their workers. */
            linger_until = job->stopping ? now + o->grace_s + 5.0 : 0;
            pthread_mutex_lock(&job->lock);
            if (count > job->nodes_exited) job->nodes_exited = count;
            exited = job->nodes_exited + job->nodes_dead;
            pthread_mutex_unlock(&job->lock);
        }
        if (exited >= o->nnodes) break;
        if (remote[0] && linger_until == 0) linger_until = now + o->grace_s + 5.0;
        if (linger_until > 0 && now > linger_until) break;
        if (watcher_done || !job->watcher_running) break;
    }
    free(fds);
    free(owner);
    free(stream_of);
}

/* ---- the job's attempts: start, and after a failure (--max-restarts) start again ---------- */

/* Starts every worker of this node; a worker that cannot start fails the attempt. */
static void start_workers(job_t *job)
{
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (start_worker(job, w) != 0) {
            char text[FAILURE_TEXT_MAX];
            snprintf(text, sizeof text, "node %d could not start rank %d", job->opt.node_rank,
                     w->rank);
            fprintf(stderr, "ddprun: %s\n", text);
            publish_failure(job, text);
            begin_stop(job, 1);
            job->final = 1; /* it would fail the same way again */
            break;
        }
        job->running++;
    }
}

/* torchrun's rule: a failed attempt is retried while restarts are left; a job the user stopped
 * (a signal to ddprun) or that ran past --timeout is not. */
static int restart_wanted(const job_t *job)
{
    return job->stopping && job->exit_code != 0 && !job->final &&
           job->attempt < job->opt.max_restarts;
}

/* Resets the job for its next attempt. Every worker of the last one is reaped and its process
 * group killed (run_event_loop's end), so none can still write a checkpoint or reach the store.
 * The store is replaced by a fresh one: the last attempt's keys (group rendezvous, sequence
 * numbers) would otherwise meet the new workers. */
static int prepare_restart(job_t *job)
{
    job->attempt++;
    fprintf(stderr, "ddprun: restarting the job (restart %d of %d)\n", job->attempt,
            job->opt.max_restarts);
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        if (w->out.fd >= 0) close(w->out.fd);
        if (w->err.fd >= 0) close(w->err.fd);
        w->out.fd = w->err.fd = -1;
        w->out.len = w->err.len = 0;
        w->pid = 0;
        w->running = 0;
        w->status = 0;
        w->reaped = 0;
        if (w->log_fd >= 0) {
            char line[96];
            int n = snprintf(line, sizeof line, "=== ddprun: restart %d of %d ===\n",
                             job->attempt, job->opt.max_restarts);
            write_all(w->log_fd, line, (size_t)n);
        }
    }
    job->running = 0;
    job->reaped = 0;
    job->blame_until = 0;
    job->stopping = 0;
    job->killed = 0;
    job->kill_at = 0;
    job->exit_code = 0;
    ddp_store_server_stop(job->server);
    job->server = NULL;
    if (setup_store(job) != 0) {
        job->stopping = 1;
        job->exit_code = 1;
        return -1;
    }
    return 0;
}

/* --log-dir: DIR (made if missing) and DIR/rank<R>.log for each local worker, truncated. */
static int open_logs(job_t *job)
{
    const char *dir = job->opt.log_dir;
    if (!dir) {
        for (int i = 0; i < job->nworkers; i++) job->workers[i].log_fd = -1;
        return 0;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "ddprun: --log-dir: cannot create '%s': %s\n", dir, strerror(errno));
        return -1;
    }
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/rank%d.log", dir, w->rank);
        w->log_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0666);
        if (w->log_fd < 0) {
            fprintf(stderr, "ddprun: --log-dir: cannot open '%s': %s\n", path, strerror(errno));
            return -1;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    job_t job;
    memset(&job, 0, sizeof job);
    job.notify_pipe[0] = job.notify_pipe[1] = -1;
    pthread_mutex_init(&job.lock, NULL);
    parse_options(argc, argv, &job.opt);
    /* A bad DDP_* value would fail every worker's group creation (and ddprun's own reads of
     * DDP_TIMEOUT below): refuse once, before anything starts. */
    if (ddp_config_check() != DDP_OK) {
        fprintf(stderr, "ddprun: %s\n'ddprun --print-config' lists every variable and what it "
                        "accepts.\n",
                ddp_last_error());
        return 2;
    }
    start_watchdog(); /* before the store's threads: see start_watchdog */
    install_signal_handlers();

    if (setup_store(&job) != 0) {
        ddp_store_destroy(job.store);
        ddp_store_server_stop(job.server);
        return 1;
    }
    if (start_watcher(&job) != 0) {
        ddp_store_destroy(job.store);
        ddp_store_server_stop(job.server);
        return 1;
    }

    job.nworkers = job.opt.nproc;
    job.stdout_tty = isatty(STDOUT_FILENO);
    job.stderr_tty = isatty(STDERR_FILENO);
    job.workers = calloc((size_t)job.nworkers, sizeof *job.workers);
    if (job.workers && choose_cpus(&job) != 0) {
        free(job.workers);
        job.workers = NULL;
    }
    if (!job.workers) {
        fprintf(stderr, "ddprun: out of memory\n");
        return 1;
    }
    for (int i = 0; i < job.nworkers; i++) {
        worker_t *w = &job.workers[i];
        w->local_rank = i;
        w->rank = job.opt.node_rank * job.opt.nproc + i;
        w->prefix = job.opt.prefix;
        w->out = (stream_t){-1, 1, NULL, 0};
        w->err = (stream_t){-1, 2, NULL, 0};
        w->out.pending = malloc(LINE_MAX_BYTES);
        w->err.pending = malloc(LINE_MAX_BYTES);
        if (!w->out.pending || !w->err.pending) {
            fprintf(stderr, "ddprun: out of memory\n");
            return 1;
        }
    }
    if (open_logs(&job) != 0) return 1;
    workers_started = 1;
    job.deadline = job.opt.timeout_s > 0 ? now_s() + job.opt.timeout_s : 0;
    for (;;) {
        start_workers(&job);
        run_event_loop(&job);
        if (!restart_wanted(&job)) break;
        if (prepare_restart(&job) != 0) break;
    }
    stop_watcher(&job);
    int code = job.stopping ? job.exit_code : 0;
    if (!job.stopping) {
        char remote[FAILURE_TEXT_MAX];
        pthread_mutex_lock(&job.lock);
        snprintf(remote, sizeof remote, "%s", job.remote_failure);
        pthread_mutex_unlock(&job.lock);
        if (remote[0]) { /* our workers were done; another node failed afterwards */
            fprintf(stderr, "ddprun: the job failed elsewhere: %s\n", remote);
            code = 1;
        }
    }
    for (int i = 0; i < job.nworkers; i++) {
        if (job.workers[i].log_fd >= 0) close(job.workers[i].log_fd);
        free(job.workers[i].out.pending);
        free(job.workers[i].err.pending);
        if (job.workers[i].out.fd >= 0) close(job.workers[i].out.fd);
        if (job.workers[i].err.fd >= 0) close(job.workers[i].err.fd);
    }
    free(job.workers);
    free(job.cpus);
    ddp_store_destroy(job.store);
    ddp_store_server_stop(job.server);
    finish_watchdog(code != 0);
    return code;
}
