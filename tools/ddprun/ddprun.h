/* ddprun, the launcher: the one header its modules share. Starts N local worker processes of a
 * data-parallel job with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), hosts the
 * TCP rendezvous store on node 0, prefixes each worker's output lines with its rank, and tears
 * the whole job down - on every node - as soon as one worker fails, so no rank is left blocked
 * in a collective.
 *
 * The modules, as torchrun's agent splits the same job:
 *   options.c    the command line (options_t) and --help
 *   spawn.c      a worker's environment, CPU binding, fork/exec, signals to ddprun and workers
 *   output.c     the workers' output: rank-prefixed lines, --log-dir files
 *   watchdog.c   a forked process that kills what is left of the job if ddprun dies
 *   multinode.c  the store (hosted on node 0), the rendezvous of nodes, the watcher thread
 *                and the key job/failed
 *   agent.c      the agent: start the workers, monitor them (the event loop), blame the
 *                culprit of a failure, stop, and restart (--max-restarts)
 *   util.c       clock, sleeping, signal names, random tokens
 *   main.c       main: the order of those steps
 * One thread runs the agent's event loop over the workers' output pipes and a self-pipe fed by
 * signal handlers; in multi-node jobs a second thread watches the store for another node's
 * failure. */
#ifndef DDPRUN_H
#define DDPRUN_H

#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ddp/ddp.h"

#define MAX_LOCAL_WORKERS 1024
#define LINE_MAX_BYTES (64 * 1024)
#define WATCH_INTERVAL_MS 200
#define STORE_CALL_TIMEOUT_MS 5000
#define FAILURE_TEXT_MAX 512
/* How long a first failure that may be a consequence (a non-zero exit) waits for a more likely
 * cause to be reaped before ddprun names a rank; see agent.c's choose_culprit. */
#define BLAME_WINDOW_S 1.0

/* ---- options (options.c) ------------------------------------------------------------------- */

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

/* Parses argv into *o; on a bad option prints why and exits 2 (it runs before anything starts). */
void parse_options(int argc, char **argv, options_t *o);

/* ---- workers, their output, the job -------------------------------------------------------- */

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

/* The store watcher's state (multinode.c): the thread, the pipe it wakes the agent through, and
 * what it learnt, under its lock; the agent reads the latter with watcher_view. */
typedef struct watcher_state {
    pthread_t thread;
    int running;        /* the thread was started and not joined yet */
    int notify_pipe[2]; /* a byte: the watcher learnt something (the agent polls [0]) */
    pthread_mutex_t lock;
    char remote_failure[FAILURE_TEXT_MAX]; /* guarded by lock */
    int stop;                              /* guarded by lock: asked to end */
    int done;                              /* guarded by lock: ended (asked, or the store lost) */
    int64_t nodes_exited;                  /* guarded by lock */
    int nodes_dead;                        /* guarded by lock: node 0 gave up on them */
} watcher_state_t;

typedef struct job {
    options_t opt;
    /* the rendezvous (multinode.c's setup_store) */
    const char *master_addr;
    int master_port;  /* our store's (DDP_STORE_PORT) */
    int torch_port;   /* free for torch's own store (MASTER_PORT), as torchrun leaves it */
    char token[128];
    ddp_store_t *store;         /* multi-node only: this node's client of the store */
    ddp_store_server_t *server; /* node 0: the store it hosts */
    watcher_state_t watch;      /* multi-node only */
    /* the workers (spawn.c, output.c) */
    worker_t *workers;
    int nworkers;
    int *cpus; /* worker i runs on cpus[i % ncpus]; NULL: not bound */
    int ncpus;
    int running;
    int stdout_tty;       /* ddprun's stdout is a terminal: rank 0 gets it (writes_directly) */
    int stderr_tty;       /* the same for stderr */
    int reaped;           /* workers reaped so far */
    /* how an attempt ends (agent.c) */
    double blame_until;   /* > 0: a worker failed; name the culprit by then at the latest */
    int stopping;         /* teardown started */
    int killed;           /* SIGKILL already sent */
    double kill_at;       /* when to escalate to SIGKILL */
    int exit_code;
    int final;            /* stopped by a signal to ddprun or --timeout: never restarted */
    /* restarts (agent.c) */
    int attempt;          /* 0, then 1.. after each --max-restarts restart */
    double deadline;      /* --timeout: when the whole job (every attempt) must end; 0: never */
} job_t;

/* ---- util.c -------------------------------------------------------------------------------- */

/* Seconds on the monotonic clock. */
double now_s(void);
/* Sleeps ms milliseconds, through EINTR. */
void sleep_ms(int ms);
/* "SIGTERM" for SIGTERM (a per-thread buffer). */
const char *signal_name(int sig);
/* size-1 random hex digits (at most 48) into out; exits 1 when no random bytes can be had. */
void make_token(char *out, size_t size);

/* ---- spawn.c ------------------------------------------------------------------------------- */

/* Installs the handlers of the signals ddprun forwards (SIGINT, SIGTERM, SIGHUP) and ignores
 * SIGPIPE. A handler only writes the signal number into a pipe the event loop reads
 * (signal_fd); before workers_started() it exits 128+N at once. Exits 1 without a pipe. */
void install_signal_handlers(void);
/* The read end of the signal pipe: one byte per signal received. */
int signal_fd(void);
/* From now on a signal is forwarded to the workers rather than ending ddprun at once. */
void mark_workers_started(void);
/* Blocks (block = 1, the old mask into *old) or restores (block = 0) the forwarded signals in
 * the calling thread: threads created in between never run the handlers. */
void block_forwarded_signals(int block, sigset_t *old);
/* Fills job->cpus for --bind (none when the workers should not be pinned); -1 out of memory. */
int choose_cpus(job_t *job);
/* Forks and execs worker w with its environment, output pipes and CPU; -1 (with a message)
 * when it could not be started. */
int start_worker(job_t *job, worker_t *w);
/* Sends sig to every worker and its process group. */
void signal_workers(job_t *job, int sig);

/* ---- output.c ------------------------------------------------------------------------------ */

/* Writes everything to fd, retrying on EINTR and while a non-blocking fd is full; output to a
 * reader that went away is dropped (and remembered for stream_read). */
void write_all(int fd, const char *data, size_t len);
/* Reads what the worker wrote on s; emits every complete line with its rank in front. */
void stream_read(const worker_t *w, stream_t *s);
/* Whether any worker's output pipe is still open. */
int streams_open(const job_t *job);
/* --log-dir: makes DIR and opens DIR/rank<R>.log for each worker (log_fd = -1 without it);
 * -1 with a message on failure. */
int open_logs(job_t *job);

/* ---- watchdog.c ---------------------------------------------------------------------------- */

/* Forks the watchdog (before any thread) and draws this run's DDPRUN_JOB_ID. */
void start_watchdog(void);
/* This run's DDPRUN_JOB_ID (48 hex digits), the mark the watchdog looks for. */
const char *watchdog_job_id(void);
/* Tells the watchdog a worker's process group (pid) to sweep. */
void watchdog_send(int32_t message);
/* At exit: stands the watchdog down after a good end, else lets it sweep the job and waits. */
void finish_watchdog(int job_failed);

/* ---- multinode.c --------------------------------------------------------------------------- */

/* Hosts the store (node 0) and, with more than one node, joins it and agrees on the job's shape
 * with the other nodes; -1 with a message on failure. */
int setup_store(job_t *job);
/* Opens the notify pipe and, with a store, starts the watcher thread; -1 on failure. */
int start_watcher(job_t *job);
void stop_watcher(job_t *job);
/* The store is there and reachable. */
int store_usable(job_t *job);
/* Sets job/failed to text unless another node set it first (every node then stops). */
void publish_failure(job_t *job, const char *text);
/* Reads job/failed into job->remote_failure when some node has set it. */
ddp_status_t fetch_failure(job_t *job);
/* Counts this node out (job/exited) so node 0 stops waiting for it; returns the new count. */
int64_t mark_exited(job_t *job);

/* What the watcher thread has learnt, copied under the lock (the agent reads it once per turn). */
typedef struct remote_view {
    char failure[FAILURE_TEXT_MAX]; /* job/failed, or the store lost; "" while none */
    int64_t exited;                 /* nodes counted out, or given up on by node 0 */
    int watcher_done;               /* the watcher ended (stopped, or the store is lost) */
} remote_view_t;
void watcher_view(job_t *job, remote_view_t *v);
/* Node 0's own count of finished nodes (mark_exited's) when it is ahead of the watcher's; returns
 * the nodes counted out or given up on. */
int64_t watcher_count_exited(job_t *job, int64_t count);

/* ---- agent.c ------------------------------------------------------------------------------- */

/* Runs the job's attempts: starts the workers, monitors them until every one is reaped (and,
 * on node 0, the other nodes are done), and starts again after a failure while --max-restarts
 * allows. The outcome is in job->stopping and job->exit_code. */
void run_agent(job_t *job);

#endif
