/* ddprun's command line: the options, their checks and --help (ddprun.h's options_t). A bad
 * option is a message and exit status 2 before anything starts. */
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddprun.h"

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

void parse_options(int argc, char **argv, options_t *o)
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

