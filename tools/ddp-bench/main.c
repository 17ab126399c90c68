/* ddp-bench: command line and process group for the collective benchmarks.
 * Run under the launcher (`ddprun -n 2 ddp-bench -o allreduce -b 8 -e 256M -f 4`) or mpirun; the
 * group comes from the launcher's environment (ddp_group_create_from_env). Without a launcher it
 * runs alone (world size 1). Arguments are checked before any group exists, so a bad option fails
 * at once with exit code 2 and a message naming the option. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: ddprun -n N ddp-bench [options]\n"
            "       ddprun -n N ddp-bench -o reducer [reducer options]\n"
            "Times libddp collectives over a range of sizes, like nccl-tests.\n"
            "  -o, --op NAME          allreduce (default), broadcast, reduce_scatter, allgather,\n"
            "                         barrier, reduce, gather, scatter, alltoall, allgatherv,\n"
            "                         reduce_scatterv, alltoallv, allreduce_coalesced,\n"
            "                         broadcast_coalesced, sendrecv, or reducer (everything\n"
            "                         after `-o reducer` goes to the Reducer benchmark)\n"
            "  -b, --minbytes SIZE    smallest size in bytes, K/M/G suffixes (default 8)\n"
            "  -e, --maxbytes SIZE    largest size (default 256M)\n"
            "  -f, --stepfactor N     multiply the size by N each step (default 4)\n"
            "  -d, --datatype T       f32 (default), f64, f16, bf16, i32, i64, u8\n"
            "  -r, --redop OP         sum (default), avg, min, max, prod\n"
            "  -n, --iters N          iterations per timing round, at least (default 10)\n"
            "  -w, --warmup N         untimed warmup iterations per size (default 3)\n"
            "      --rounds N         timing rounds per size; the median is shown (default 5)\n"
            "      --min-ms MS        raise the iterations so a round lasts >= MS (default 10)\n"
            "      --root R           root of broadcast, reduce, gather, scatter (default 0)\n"
            "  -c, --check 0|1        count wrong elements against exact expected values\n"
            "      --inplace 0|1      in-place collectives (default 0; the five first only)\n"
            "      --segment 0|1      buffers from ddp_group_alloc_buffer, i.e. in the\n"
            "                         transport's memory (default 0: malloc)\n"
            "      --register 0|1     register the malloc'd buffers with\n"
            "                         ddp_group_register_memory before timing, unregister\n"
            "                         after (default 0; shm runs allreduce \"mapped\" then)\n"
            "      --json             one JSON object per size instead of the table\n"
            "      --test-corrupt 0|1 rank 0 spoils one output element before the check (to\n"
            "                         test that checking catches it)\n"
            "  -h, --help             this text\n"
            "SIZE is the whole buffer: the allreduce/broadcast buffer, the reduce_scatter input,\n"
            "the allgather output. time = per iteration, max over ranks, median over rounds;\n"
            "algbw = SIZE / time; busbw = algbw * 2(n-1)/n (allreduce), (n-1)/n (reduce_scatter,\n"
            "allgather), 1 (broadcast). reduce: SIZE is the buffer; gather/scatter/allgatherv:\n"
            "the gathered buffer; reduce_scatterv: the input; alltoall(v): each rank's send\n"
            "buffer (v forms: unequal counts, the largest block SIZE/n); coalesced: 4 buffers\n"
            "of SIZE/2, /4, /8 and the rest; sendrecv: one message, ranks 2k and 2k+1 exchange\n"
            "(send then recv on even ranks, recv then send on odd; time is one exchange).\n"
            "busbw = algbw for these. Exit: 0 ok, 1 failure or wrong elements, 2 bad option.\n");
}

/* Only rank 0 prints results and --help; before the group exists RANK (or OMPI's rank) says who
 * we are. */
static int launcher_rank(void)
{
    const char *v = getenv("RANK");
    if (!v) v = getenv("OMPI_COMM_WORLD_RANK");
    if (!v) v = getenv("PMI_RANK");
    return v ? atoi(v) : 0;
}

/* Every rank reports a bad option: under a launcher the first rank to exit gets the others
 * killed, so a message left to rank 0 alone could be lost. */
#define USAGE_ERROR(...)                                                                          \
    do {                                                                                          \
        fprintf(stderr, "ddp-bench: " __VA_ARGS__);                                               \
        fprintf(stderr, " (see ddp-bench --help)\n");                                            \
        return DDP_BENCH_EXIT_USAGE;                                                              \
    } while (0)

/* "8", "64K", "1M", "2G" (powers of 1024, optional trailing B) -> bytes. */
static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    if (!*text || *text == '-') return -1;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text) return -1;
    unsigned long long scale = 1;
    switch (*end) {
    case 'k': case 'K': scale = 1ULL << 10; end++; break;
    case 'm': case 'M': scale = 1ULL << 20; end++; break;
    case 'g': case 'G': scale = 1ULL << 30; end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return -1;
    if (v > ULLONG_MAX / scale || v * scale > (unsigned long long)SIZE_MAX) return -1;
    *out = (size_t)(v * scale);
    return 0;
}

static int parse_int(const char *text, long lo, long hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static int parse_double(const char *text, double lo, double hi, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}

/* Does argv[*i] name option `shortname`/`longname`? Sets *value to its argument, taken from
 * "--long=value" or the next word (advancing *i) and returns 1. Returns 0 when argv[*i] is another
 * option, or when it is this one but the value is missing (then *missing = 1). */
static int match(int argc, char **argv, int *i, const char *shortname, const char *longname,
                 const char **value, int *missing)
{
    const char *arg = argv[*i];
    size_t n = strlen(longname);
    if (strncmp(arg, longname, n) == 0 && arg[n] == '=') {
        *value = arg + n + 1;
        return 1;
    }
    if (strcmp(arg, longname) != 0 && !(shortname && strcmp(arg, shortname) == 0)) return 0;
    if (*i + 1 >= argc) {
        *missing = 1;
        return 0;
    }
    *value = argv[++*i];
    return 1;
}

static int parse_options(int argc, char **argv, ddp_bench_options_t *o)
{
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v = NULL;
        int missing = 0;
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            if (launcher_rank() == 0) usage(stdout);
            exit(0); /* a tool, not the library: --help ends the program */
        }
        if (!strcmp(arg, "--json")) {
            o->json = 1;
            continue;
        }
#define OPTION(s, l) match(argc, argv, &i, s, l, &v, &missing)
        if (OPTION("-o", "--op")) {
            int found = 0;
            for (int k = 0; k < DDP_BENCH_COLLECTIVE_COUNT; k++)
                if (!strcmp(v, ddp_bench_collective_name((ddp_bench_collective_t)k))) {
                    o->collective = (ddp_bench_collective_t)k;
                    found = 1;
                }
            if (!found)
                USAGE_ERROR("-o: unknown operation '%s' (expected allreduce, broadcast, "
                            "reduce_scatter, allgather, barrier, reduce, gather, scatter, "
                            "alltoall, allgatherv, reduce_scatterv, alltoallv, "
                            "allreduce_coalesced, broadcast_coalesced, sendrecv or reducer)", v);
        } else if (OPTION("-b", "--minbytes")) {
            if (parse_size(v, &o->min_bytes)) USAGE_ERROR("-b: bad size '%s'", v);
        } else if (OPTION("-e", "--maxbytes")) {
            if (parse_size(v, &o->max_bytes)) USAGE_ERROR("-e: bad size '%s'", v);
        } else if (OPTION("-f", "--stepfactor")) {
            int f;
            if (parse_int(v, 2, 1 << 20, &f)) USAGE_ERROR("-f: factor must be an integer >= 2, not '%s'", v);
            o->factor = (size_t)f;
        } else if (OPTION("-d", "--datatype")) {
            if (ddp_dtype_parse(v, &o->dtype) != DDP_OK)
                USAGE_ERROR("-d: unknown type '%s' (expected f32, f64, f16, bf16, i32, i64, u8)", v);
        } else if (OPTION("-r", "--redop")) {
            if (ddp_reduce_op_parse(v, &o->op) != DDP_OK)
                USAGE_ERROR("-r: unknown reduction '%s' (expected sum, avg, min, max, prod)", v);
        } else if (OPTION("-n", "--iters")) {
            if (parse_int(v, 1, 100000000, &o->iters)) USAGE_ERROR("-n: iterations must be >= 1, not '%s'", v);
        } else if (OPTION("-w", "--warmup")) {
            if (parse_int(v, 0, 100000000, &o->warmup)) USAGE_ERROR("-w: warmup must be >= 0, not '%s'", v);
        } else if (OPTION(NULL, "--rounds")) {
            if (parse_int(v, 1, 1000, &o->rounds)) USAGE_ERROR("--rounds: must be 1..1000, not '%s'", v);
        } else if (OPTION(NULL, "--min-ms")) {
            if (parse_double(v, 0, 1e6, &o->min_round_ms)) USAGE_ERROR("--min-ms: must be >= 0, not '%s'", v);
        } else if (OPTION(NULL, "--root")) {
            if (parse_int(v, 0, 1 << 20, &o->root)) USAGE_ERROR("--root: bad rank '%s'", v);
        } else if (OPTION("-c", "--check")) {
            if (parse_int(v, 0, 1, &o->check)) USAGE_ERROR("-c: expected 0 or 1, not '%s'", v);
        } else if (OPTION(NULL, "--inplace")) {
            if (parse_int(v, 0, 1, &o->inplace)) USAGE_ERROR("--inplace: expected 0 or 1, not '%s'", v);
        } else if (OPTION(NULL, "--segment")) {
            if (parse_int(v, 0, 1, &o->segment)) USAGE_ERROR("--segment: expected 0 or 1, not '%s'", v);
        } else if (OPTION(NULL, "--register")) {
            if (parse_int(v, 0, 1, &o->registered)) USAGE_ERROR("--register: expected 0 or 1, not '%s'", v);
        } else if (OPTION(NULL, "--test-corrupt")) {
            if (parse_int(v, 0, 1, &o->corrupt)) USAGE_ERROR("--test-corrupt: expected 0 or 1, not '%s'", v);
        } else if (missing) {
            USAGE_ERROR("option %s needs a value", arg);
        } else {
            USAGE_ERROR("unknown option '%s'", arg);
        }
#undef OPTION
    }
    if (o->min_bytes > o->max_bytes)
        USAGE_ERROR("-b %zu is larger than -e %zu", o->min_bytes, o->max_bytes);
    if (o->registered && o->segment)
        USAGE_ERROR("--register 1 registers malloc'd buffers; --segment 1 buffers are the "
                    "transport's already");
    return DDP_BENCH_EXIT_OK;
}

/* The launcher's group, or a group of one when no launcher variables exist. */
static int create_group(ddp_group_t **group, ddp_store_t **local_store)
{
    ddp_status_t s = ddp_group_create_from_env(NULL, group);
    if (s == DDP_OK) return 0;
    if (s != DDP_ERR_NOT_FOUND) {
        fprintf(stderr, "ddp-bench: rank %d: creating the group: %s: %s\n", launcher_rank(),
                ddp_status_string(s), ddp_last_error());
        return -1;
    }
    s = ddp_store_hash_create(local_store);
    if (s == DDP_OK) s = ddp_group_create(*local_store, 0, 1, NULL, group);
    if (s != DDP_OK) {
        fprintf(stderr, "ddp-bench: creating a group of one: %s: %s\n", ddp_status_string(s),
                ddp_last_error());
        ddp_store_destroy(*local_store);
        *local_store = NULL;
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    /* `-o reducer` hands the rest of the command line to the Reducer benchmark. */
    int reducer_at = 0;
    for (int i = 1; i < argc && !reducer_at; i++) {
        if (!strcmp(argv[i], "--op=reducer") ||
            ((!strcmp(argv[i], "-o") || !strcmp(argv[i], "--op")) && i + 1 < argc &&
             !strcmp(argv[i + 1], "reducer")))
            reducer_at = i;
    }
    if (reducer_at > 1)
        USAGE_ERROR("options before -o reducer (here '%s') are not read; put them after it",
                    argv[1]);
    /* `-o reducer --help` needs no group: print the reducer's options and stop. */
    for (int i = reducer_at + 1; reducer_at && i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            if (launcher_rank() == 0) ddp_bench_reducer_usage(stdout);
            return DDP_BENCH_EXIT_OK;
        }
    }

    ddp_bench_options_t options = {
        .collective = DDP_BENCH_ALLREDUCE,
        .min_bytes = 8,
        .max_bytes = 256u << 20,
        .factor = 4,
        .dtype = DDP_F32,
        .op = DDP_SUM,
        .iters = 10,
        .warmup = 3,
        .rounds = 5,
        .min_round_ms = 10.0,
        .root = 0,
    };
    if (reducer_at == 0) {
        int rc = parse_options(argc, argv, &options);
        if (rc != DDP_BENCH_EXIT_OK) return rc;
    }

    ddp_group_t *group = NULL;
    ddp_store_t *local_store = NULL;
    if (create_group(&group, &local_store) != 0) return DDP_BENCH_EXIT_FAILED;

    int rc;
    if (reducer_at) {
        int skip = !strcmp(argv[reducer_at], "--op=reducer") ? 1 : 2;
        rc = ddp_bench_reducer(group, argc - reducer_at - skip, argv + reducer_at + skip);
    } else if (options.root >= ddp_group_size(group)) {
        fprintf(stderr, "ddp-bench: --root %d is not a rank of this %d-rank job\n", options.root,
                ddp_group_size(group));
        rc = DDP_BENCH_EXIT_USAGE;
    } else if (options.inplace && options.collective > DDP_BENCH_BARRIER) {
        fprintf(stderr, "ddp-bench: --inplace 1 is for allreduce, broadcast, reduce_scatter and "
                        "allgather, not %s\n", ddp_bench_collective_name(options.collective));
        rc = DDP_BENCH_EXIT_USAGE;
    } else {
        rc = ddp_bench_collectives(group, &options);
    }
    ddp_group_destroy(group);
    ddp_store_destroy(local_store);
    return rc;
}
