/* ddp-bench: collective benchmarks in the style of nccl-tests (size sweeps, algbw/busbw, checks).
 * main.c parses the command line and creates the process group; bench_collectives.c times the
 * group's collectives; bench_reducer.c (owned by the Reducer's author) times the Reducer. */
#ifndef DDP_BENCH_H
#define DDP_BENCH_H

#include <stddef.h>
#include <stdio.h>

#include "ddp/ddp.h"

/* Exit codes of the tool. */
enum { DDP_BENCH_EXIT_OK = 0, DDP_BENCH_EXIT_FAILED = 1, DDP_BENCH_EXIT_USAGE = 2 };

typedef enum ddp_bench_collective {
    DDP_BENCH_ALLREDUCE = 0,
    DDP_BENCH_BROADCAST,
    DDP_BENCH_REDUCE_SCATTER,
    DDP_BENCH_ALLGATHER,
    DDP_BENCH_BARRIER,
    DDP_BENCH_REDUCE,
    DDP_BENCH_GATHER,
    DDP_BENCH_SCATTER,
    DDP_BENCH_ALLTOALL,
    DDP_BENCH_ALLGATHERV,
    DDP_BENCH_REDUCE_SCATTERV,
    DDP_BENCH_ALLTOALLV,
    DDP_BENCH_ALLREDUCE_COALESCED,
    DDP_BENCH_BROADCAST_COALESCED,
    DDP_BENCH_SENDRECV,
} ddp_bench_collective_t;

/* How many collectives there are (outside the enum, so that switches need not handle it). */
enum { DDP_BENCH_COLLECTIVE_COUNT = DDP_BENCH_SENDRECV + 1 };

/* Everything `ddp-bench -o <collective>` was asked to do (see usage() in main.c). */
typedef struct ddp_bench_options {
    ddp_bench_collective_t collective;
    size_t min_bytes;     /* -b */
    size_t max_bytes;     /* -e */
    size_t factor;        /* -f: each size is the previous one times this (>= 2) */
    ddp_dtype_t dtype;    /* -d */
    ddp_reduce_op_t op;   /* -r */
    int iters;            /* -n: at least this many iterations per timing round */
    int warmup;           /* -w: untimed iterations per size */
    int rounds;           /* --rounds: timing rounds per size; the median is reported */
    double min_round_ms;  /* --min-ms: iterations are scaled up so a round lasts this long */
    int root;             /* --root: broadcast root */
    int check;            /* -c: count wrong elements */
    int inplace;          /* --inplace */
    int segment;          /* --segment: buffers from ddp_group_alloc_buffer */
    int registered;       /* --register: malloc'd buffers registered (ddp_group_register_memory) */
    int json;             /* --json: one JSON object per size instead of the table */
    int corrupt;          /* --test-corrupt: rank 0 spoils one checked element (tests the check) */
} ddp_bench_options_t;

/* Name as written after -o ("allreduce", ...); "invalid" for anything else. Defined in
 * bench_collectives.c, beside the code that runs them: main.c only calls down into the
 * benchmarks, and nothing calls back up into main.c. */
const char *ddp_bench_collective_name(ddp_bench_collective_t collective);

/* Runs the sweep on every rank of `group` (rank 0 prints). Returns an exit code: 0, or 1 when a
 * collective failed or, with checking on, any element was wrong. */
int ddp_bench_collectives(ddp_group_t *group, const ddp_bench_options_t *options);

/* `ddp-bench -o reducer ...`: benchmarks the Reducer. argv[0] .. argv[argc - 1] are the
 * arguments that followed `-o reducer` on the command line (argv[0] is NOT a program name;
 * argv[argc] is NULL). Called on every rank with the launcher's group; returns the process exit
 * code (0 success, 1 failure, 2 bad arguments). */
int ddp_bench_reducer(ddp_group_t *group, int argc, char **argv);

/* The help text of `ddp-bench -o reducer` (what -h/--help after it prints). */
void ddp_bench_reducer_usage(FILE *out);

#endif
