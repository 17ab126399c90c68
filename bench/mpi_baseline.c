/* mpi-baseline: the anchor for ddp-bench. The same sweeps, timing method, columns and JSON as
 * ddp-bench, but calling MPI directly (MPI_Allreduce, MPI_Bcast, MPI_Reduce_scatter_block,
 * MPI_Allgather, MPI_Alltoall, MPI_Barrier), so `ddp-bench` and `mpi-baseline` rows can be divided.
 * It uses only the MPI standard, so bench/peers.sh also builds it with Intel MPI's and MPICH's mpicc.
 * bf16: MPI has no bfloat16 type; it is moved as 16-bit words and reduced by a user-defined
 * MPI_Op (round to nearest even through float), as a user of MPI would have to write it.
 * Run: mpirun --allow-run-as-root --oversubscribe -np 2 build/mpi-baseline -o allreduce -b 8 -e 256M
 * Time per size: each rank's time per iteration, max over ranks, median over --rounds rounds;
 * iterations are raised so a round lasts >= --min-ms. AVG is MPI_SUM followed by a local divide
 * (MPI has no average), as a user of MPI would write it. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_BARRIER, OP_ALLTOALL };
static const char *const op_names[] = {"allreduce", "broadcast", "reduce_scatter", "allgather",
                                       "barrier", "alltoall"};
enum { N_OPS = 6 };
enum { T_F32, T_F64, T_I32, T_I64, T_BF16 };
static const char *const type_names[] = {"f32", "f64", "i32", "i64", "bf16"};
static const size_t type_sizes[] = {4, 8, 4, 8, 2};
enum { N_TYPES = 5 };
enum { R_SUM, R_AVG, R_MIN, R_MAX, R_PROD };
static const char *const redop_names[] = {"sum", "avg", "min", "max", "prod"};

typedef struct options {
    int op, type, redop;
    size_t min_bytes, max_bytes, factor;
    int iters, warmup, rounds, check, inplace, json, root, corrupt;
    double min_round_ms;
} options_t;

static int rank, world;

static void usage(void)
{
    printf("usage: mpirun -np N mpi-baseline [options]\n"
           "  -o allreduce|broadcast|reduce_scatter|allgather|alltoall|barrier (default allreduce)\n"
           "  -b SIZE, -e SIZE, -f N   sizes from -b to -e times N each step (K/M/G suffixes;\n"
           "                           defaults 8, 256M, 4); SIZE is the whole buffer as in ddp-bench\n"
           "                           (alltoall: each rank's send buffer)\n"
           "  -d f32|f64|i32|i64|bf16  element type (default f32; bf16 reduces by a user MPI_Op)\n"
           "  -r sum|avg|min|max|prod  reduction (default sum; avg = MPI_SUM then divide)\n"
           "  -n N  -w N               iterations per round (>=, default 10), warmup (default 3)\n"
           "  --rounds N  --min-ms MS  rounds per size (median shown, default 5), min round time\n"
           "  -c 0|1  --inplace 0|1  --root R  --json\n"
           "  --test-corrupt 0|1       rank 0 spoils one output element before the check\n");
}

static int fail_usage(const char *fmt, const char *arg)
{
    if (rank == 0) {
        fprintf(stderr, "mpi-baseline: ");
        fprintf(stderr, fmt, arg);
        fprintf(stderr, " (see mpi-baseline --help)\n");
    }
    return 2;
}

static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    errno = 0;
    if (!*text || *text == '-') return -1;
    unsigned long long v = strtoull(text, &end, 10), scale = 1;
    if (errno || end == text) return -1;
    if (*end == 'k' || *end == 'K') scale = 1ULL << 10, end++;
    else if (*end == 'm' || *end == 'M') scale = 1ULL << 20, end++;
    else if (*end == 'g' || *end == 'G') scale = 1ULL << 30, end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end || v > ULLONG_MAX / scale) return -1;
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

static int lookup(const char *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

static int parse_options(int argc, char **argv, options_t *o)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (rank == 0) usage();
            return -1;
        }
        if (!strcmp(a, "--json")) {
            o->json = 1;
            continue;
        }
        static const char *const with_value[] = {"-o", "-b", "-e", "-f", "-d", "-r", "-n", "-w",
                                                 "--rounds", "--min-ms", "-c", "--inplace",
                                                 "--root", "--test-corrupt"};
        if (lookup(a, with_value, (int)(sizeof with_value / sizeof with_value[0])) < 0)
            return fail_usage("unknown option '%s'", a);
        if (i + 1 >= argc) return fail_usage("option %s needs a value", a);
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "-o")) bad = (o->op = lookup(v, op_names, N_OPS)) < 0;
        else if (!strcmp(a, "-d")) {
            if (!strcmp(v, "f16"))
                return fail_usage("-d %s: MPI has no half-precision type to reduce", v);
            bad = (o->type = lookup(v, type_names, N_TYPES)) < 0;
        } else if (!strcmp(a, "-r")) bad = (o->redop = lookup(v, redop_names, 5)) < 0;
        else if (!strcmp(a, "-b")) bad = parse_size(v, &o->min_bytes);
        else if (!strcmp(a, "-e")) bad = parse_size(v, &o->max_bytes);
        else if (!strcmp(a, "-f")) {
            int f;
            bad = parse_int(v, 2, 1 << 20, &f);
            o->factor = (size_t)f;
        } else if (!strcmp(a, "-n")) bad = parse_int(v, 1, 100000000, &o->iters);
        else if (!strcmp(a, "-w")) bad = parse_int(v, 0, 100000000, &o->warmup);
        else if (!strcmp(a, "--rounds")) bad = parse_int(v, 1, 1000, &o->rounds);
        else if (!strcmp(a, "-c")) bad = parse_int(v, 0, 1, &o->check);
        else if (!strcmp(a, "--inplace")) bad = parse_int(v, 0, 1, &o->inplace);
        else if (!strcmp(a, "--test-corrupt")) bad = parse_int(v, 0, 1, &o->corrupt);
        else if (!strcmp(a, "--root")) bad = parse_int(v, 0, world - 1, &o->root);
        else if (!strcmp(a, "--min-ms")) {
            char *end = NULL;
            o->min_round_ms = strtod(v, &end);
            bad = end == v || *end || !(o->min_round_ms >= 0);
        }
        if (bad) {
            if (rank == 0) fprintf(stderr, "mpi-baseline: %s: bad value '%s'\n", a, v);
            return 2;
        }
    }
    if (o->min_bytes > o->max_bytes) return fail_usage("-b is larger than -e%s", "");
    if (o->op == OP_ALLTOALL && o->inplace) return fail_usage("alltoall runs out of place only%s", "");
    return 0;
}

/* ---- data and checks (same patterns as ddp-bench: small integers, exact results) ---------- */

static options_t opt;

/* bfloat16 is the top half of a float; rounding to nearest even keeps sums of the small
 * integers below exact. */
static float bf16_to_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static int bf16_redop; /* which reduction the user-defined bf16 MPI_Op applies */

static void bf16_reduce(void *in, void *inout, int *len, MPI_Datatype *type)
{
    (void)type;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) {
        float x = bf16_to_float(a[i]), y = bf16_to_float(b[i]), r;
        if (bf16_redop == R_MIN) r = x < y ? x : y;
        else if (bf16_redop == R_MAX) r = x > y ? x : y;
        else if (bf16_redop == R_PROD) r = x * y;
        else r = x + y;
        b[i] = float_to_bf16(r);
    }
}

static MPI_Op bf16_op = MPI_OP_NULL;

static MPI_Datatype mpi_type(void)
{
    switch (opt.type) {
    case T_BF16: return MPI_UINT16_T;
    case T_F32: return MPI_FLOAT;
    case T_F64: return MPI_DOUBLE;
    case T_I32: return MPI_INT32_T;
    default: return MPI_INT64_T;
    }
}

static MPI_Op mpi_op(void)
{
    if (opt.type == T_BF16) return bf16_op;
    switch (opt.redop) {
    case R_MIN: return MPI_MIN;
    case R_MAX: return MPI_MAX;
    case R_PROD: return MPI_PROD;
    default: return MPI_SUM;
    }
}

static double load(const void *buf, size_t i)
{
    switch (opt.type) {
    case T_BF16: return bf16_to_float(((const uint16_t *)buf)[i]);
    case T_F32: return ((const float *)buf)[i];
    case T_F64: return ((const double *)buf)[i];
    case T_I32: return ((const int32_t *)buf)[i];
    default: return (double)((const int64_t *)buf)[i];
    }
}

static void store(void *buf, size_t i, double v)
{
    switch (opt.type) {
    case T_BF16: ((uint16_t *)buf)[i] = float_to_bf16((float)v); break;
    case T_F32: ((float *)buf)[i] = (float)v; break;
    case T_F64: ((double *)buf)[i] = v; break;
    case T_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    default: ((int64_t *)buf)[i] = (int64_t)v; break;
    }
}

static double input_value(int r, size_t i)
{
    if (opt.redop == R_PROD) {
        static const double factors[] = {1, -1, 2, 1, -2, -1, 1};
        return factors[(i * 3 + (size_t)r) % 7];
    }
    return (double)((i * 7 + (size_t)r * 5) % 13) - 6.0;
}

static double expected_reduction(size_t i)
{
    double acc = input_value(0, i);
    for (int r = 1; r < world; r++) {
        double v = input_value(r, i);
        if (opt.redop == R_SUM || opt.redop == R_AVG) acc += v;
        else if (opt.redop == R_MIN) acc = v < acc ? v : acc;
        else if (opt.redop == R_MAX) acc = v > acc ? v : acc;
        else acc *= v;
    }
    if (opt.redop == R_AVG)
        acc = (opt.type == T_F32 || opt.type == T_F64 || opt.type == T_BF16) ? acc / world
                                                        : (double)((long long)acc / world);
    unsigned char tmp[8];
    store(tmp, 0, acc);
    return load(tmp, 0);
}

static int same(double got, double want)
{
    if (got == want) return 1;
    if (opt.redop != R_AVG || opt.type == T_I32 || opt.type == T_I64) return 0;
    double ulp = opt.type == T_BF16 ? 0x1p-8 : opt.type == T_F32 ? 0x1p-23 : 0x1p-52;
    return fabs(got - want) <= fabs(want) * ulp;
}

/* ---- one size ------------------------------------------------------------------------------ */

typedef struct plan {
    size_t count, total; /* per-call count (per rank for reduce_scatter/allgather), whole buffer */
    char *send, *recv;
} plan_t;

static char *send_buf, *recv_buf;
static size_t elem;

static plan_t plan_size(size_t bytes)
{
    plan_t p = {bytes / elem, bytes / elem, send_buf, recv_buf};
    if (opt.op == OP_REDUCE_SCATTER || opt.op == OP_ALLGATHER || opt.op == OP_ALLTOALL) {
        p.count = bytes / elem / (size_t)world; /* alltoall: one block, to or from one rank */
        p.total = p.count * (size_t)world;
    }
    if (opt.op == OP_BARRIER) p.count = p.total = 0;
    if (opt.inplace || opt.op == OP_BROADCAST) p.send = p.recv;
    return p;
}

static void divide_for_avg(char *buf, size_t n)
{
    if (opt.type == T_F32) {
        float *f = (float *)buf;
        float s = 1.0f / (float)world;
        for (size_t i = 0; i < n; i++) f[i] *= s;
    } else if (opt.type == T_F64) {
        double *d = (double *)buf;
        double s = 1.0 / world;
        for (size_t i = 0; i < n; i++) d[i] *= s;
    } else if (opt.type == T_BF16) {
        uint16_t *h = (uint16_t *)buf;
        for (size_t i = 0; i < n; i++) h[i] = float_to_bf16(bf16_to_float(h[i]) / (float)world);
    } else if (opt.type == T_I32) {
        int32_t *x = (int32_t *)buf;
        for (size_t i = 0; i < n; i++) x[i] /= world;
    } else {
        int64_t *x = (int64_t *)buf;
        for (size_t i = 0; i < n; i++) x[i] /= world;
    }
}

static int run_once(const plan_t *p)
{
    MPI_Datatype t = mpi_type();
    int count = (int)p->count;
    int in_place = p->send == p->recv;
    int rc = MPI_SUCCESS;
    switch (opt.op) {
    case OP_ALLREDUCE:
        rc = MPI_Allreduce(in_place ? MPI_IN_PLACE : p->send, p->recv, count, t, mpi_op(),
                           MPI_COMM_WORLD);
        if (opt.redop == R_AVG) divide_for_avg(p->recv, p->count);
        break;
    case OP_BROADCAST: rc = MPI_Bcast(p->recv, count, t, opt.root, MPI_COMM_WORLD); break;
    case OP_REDUCE_SCATTER:
        /* In place: MPI takes the whole input in recv and leaves block[rank] at its start. */
        rc = MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : p->send, p->recv, count, t,
                                      mpi_op(), MPI_COMM_WORLD);
        if (opt.redop == R_AVG) divide_for_avg(p->recv, p->count);
        break;
    case OP_ALLGATHER:
        rc = MPI_Allgather(in_place ? MPI_IN_PLACE : p->send, count, t, p->recv, count, t,
                           MPI_COMM_WORLD);
        break;
    case OP_ALLTOALL:
        rc = MPI_Alltoall(p->send, count, t, p->recv, count, t, MPI_COMM_WORLD);
        break;
    case OP_BARRIER: rc = MPI_Barrier(MPI_COMM_WORLD); break;
    }
    return rc == MPI_SUCCESS ? 0 : -1;
}

static void fill(const plan_t *p, int check)
{
    int reducing = opt.op == OP_ALLREDUCE || opt.op == OP_REDUCE_SCATTER;
    if (!check && opt.inplace && reducing && (opt.redop == R_SUM || opt.redop == R_PROD)) {
        for (size_t i = 0; i < p->total; i++) store(p->recv, i, opt.redop == R_SUM ? 0.0 : 1.0);
        return;
    }
    switch (opt.op) {
    case OP_ALLREDUCE:
    case OP_REDUCE_SCATTER:
        for (size_t i = 0; i < p->total; i++) store(p->send, i, input_value(rank, i));
        if (p->send != p->recv) memset(p->recv, 0xff, p->total * elem);
        break;
    case OP_BROADCAST:
        for (size_t i = 0; i < p->total; i++)
            store(p->recv, i, rank == opt.root ? input_value(rank, i) : 100.0);
        break;
    case OP_ALLGATHER: {
        memset(p->recv, 0xff, p->total * elem);
        char *mine = opt.inplace ? p->recv + (size_t)rank * p->count * elem : p->send;
        for (size_t j = 0; j < p->count; j++)
            store(mine, j, input_value(rank, (size_t)rank * p->count + j));
        break;
    }
    case OP_ALLTOALL: /* block j of the send buffer goes to rank j */
        for (size_t i = 0; i < p->total; i++) store(p->send, i, input_value(rank, i));
        memset(p->recv, 0xff, p->total * elem);
        break;
    }
}

static long long count_wrong(const plan_t *p)
{
    long long wrong = 0;
    switch (opt.op) {
    case OP_ALLREDUCE:
        for (size_t i = 0; i < p->count; i++) wrong += !same(load(p->recv, i), expected_reduction(i));
        break;
    case OP_REDUCE_SCATTER:
        for (size_t j = 0; j < p->count; j++)
            wrong += !same(load(p->recv, j), expected_reduction((size_t)rank * p->count + j));
        break;
    case OP_BROADCAST:
        for (size_t i = 0; i < p->count; i++) wrong += load(p->recv, i) != input_value(opt.root, i);
        break;
    case OP_ALLGATHER:
        for (size_t i = 0; i < p->total; i++)
            wrong += load(p->recv, i) != input_value((int)(i / p->count), i);
        break;
    case OP_ALLTOALL: /* block j came from rank j: its block number `rank` */
        for (size_t i = 0; i < p->total; i++)
            wrong += load(p->recv, i) !=
                     input_value((int)(i / p->count), (size_t)rank * p->count + i % p->count);
        break;
    }
    return wrong;
}

static int timed_round(const plan_t *p, long iters, double *us)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (long k = 0; k < iters; k++)
        if (run_once(p)) return -1;
    double t = (MPI_Wtime() - start) * 1e6 / (double)iters;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *us = t;
    return 0;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int measure_and_print(size_t bytes, double *busbw_out)
{
    plan_t p = plan_size(bytes);
    long long wrong = -1;
    fill(&p, 0);
    for (int k = 0; k < opt.warmup; k++)
        if (run_once(&p)) return -1;
    if (opt.check) {
        fill(&p, 1);
        if (run_once(&p)) return -1;
        if (opt.corrupt && rank == 0 && p.total > 0) /* proves the check catches a wrong result */
            store(p.recv, 0, load(p.recv, 0) + 1.0);
        wrong = count_wrong(&p);
        MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        fill(&p, 0);
    }
    double per_iter;
    if (timed_round(&p, opt.iters, &per_iter)) return -1;
    long iters = opt.iters;
    if (per_iter * (double)iters < opt.min_round_ms * 1000.0) {
        double want = opt.min_round_ms * 1000.0 / (per_iter > 0.01 ? per_iter : 0.01);
        iters = want > 1e7 ? 10000000L : (long)ceil(want);
    }
    double rounds[1000];
    for (int k = 0; k < opt.rounds; k++)
        if (timed_round(&p, iters, &rounds[k])) return -1;
    qsort(rounds, (size_t)opt.rounds, sizeof rounds[0], compare_doubles);
    int n = opt.rounds;
    double time_us = n % 2 ? rounds[n / 2] : 0.5 * (rounds[n / 2 - 1] + rounds[n / 2]);

    size_t nbytes = p.total * elem;
    double w = world;
    double factor = opt.op == OP_ALLREDUCE ? 2 * (w - 1) / w
                    : (opt.op == OP_REDUCE_SCATTER || opt.op == OP_ALLGATHER) ? (w - 1) / w
                                                                               : 1.0;
    double algbw = time_us > 0 ? (double)nbytes / time_us / 1e3 : 0;
    *busbw_out = algbw * factor;
    int reducing = opt.op == OP_ALLREDUCE || opt.op == OP_REDUCE_SCATTER;
    if (rank == 0) {
        char wtext[32];
        if (opt.json) {
            if (wrong < 0) snprintf(wtext, sizeof wtext, "null");
            else snprintf(wtext, sizeof wtext, "%lld", wrong);
            printf("{\"op\":\"%s\",\"dtype\":\"%s\",\"redop\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
                   "\"time_us\":%.4f,\"algbw\":%.6g,\"busbw\":%.6g,\"wrong\":%s,\"world_size\":%d,"
                   "\"inplace\":%d,\"segment\":0,\"transport\":\"mpi\",\"iters\":%ld,\"rounds\":%d,"
                   "\"time_us_min\":%.4f,\"time_us_max\":%.4f}\n",
                   op_names[opt.op], type_names[opt.type], reducing ? redop_names[opt.redop] : "none",
                   nbytes, p.total, time_us, algbw, algbw * factor, wtext, world, opt.inplace,
                   iters, n, rounds[0], rounds[n - 1]);
        } else {
            if (wrong < 0) snprintf(wtext, sizeof wtext, "N/A");
            else snprintf(wtext, sizeof wtext, "%lld", wrong);
            printf("  %12zu %12zu %6s %6s %12.2f %12.2f %12.2f %8s\n", nbytes, p.total,
                   type_names[opt.type], reducing ? redop_names[opt.redop] : "none", time_us,
                   algbw, algbw * factor, wtext);
        }
        fflush(stdout);
    }
    return wrong > 0 ? 1 : 0;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    opt = (options_t){.op = OP_ALLREDUCE, .type = T_F32, .redop = R_SUM, .min_bytes = 8,
                      .max_bytes = 256u << 20, .factor = 4, .iters = 10, .warmup = 3,
                      .rounds = 5, .min_round_ms = 10.0};
    int rc = parse_options(argc, argv, &opt);
    if (rc != 0) {
        MPI_Finalize();
        return rc < 0 ? 0 : rc;
    }
    if (opt.type == T_BF16) {
        bf16_redop = opt.redop;
        MPI_Op_create(bf16_reduce, 1, &bf16_op); /* commutative, as MPI_SUM */
    }
    elem = type_sizes[opt.type];
    size_t cap = opt.op == OP_BARRIER ? 4096 : (opt.max_bytes + 4095) / 4096 * 4096;
    if (cap == 0) cap = 4096;
    if (opt.max_bytes / elem > (size_t)INT_MAX) {
        if (rank == 0) fprintf(stderr, "mpi-baseline: -e: more than INT_MAX elements\n");
        MPI_Finalize();
        return 2;
    }
    send_buf = aligned_alloc(4096, cap);
    recv_buf = aligned_alloc(4096, cap);
    if (!send_buf || !recv_buf) {
        fprintf(stderr, "mpi-baseline: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(send_buf, 0, cap);
    memset(recv_buf, 0, cap);

    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    char *nl = strchr(version, '\n');
    if (nl) *nl = 0;
    nl = strchr(version, ',');
    if (nl) *nl = 0;
    if (rank == 0 && !opt.json) {
        printf("# mpi-baseline %s: %d ranks, %s, %s\n", op_names[opt.op], world, version,
               opt.inplace ? "in place" : "out of place");
        printf("# time: per iteration, max over ranks, median of %d rounds of >= %d iterations "
               "and >= %g ms; warmup %d; check %s\n#\n",
               opt.rounds, opt.iters, opt.min_round_ms, opt.warmup, opt.check ? "on" : "off");
        printf("# %12s %12s %6s %6s %12s %12s %12s %8s\n", "size", "count", "type", "redop",
               "time(us)", "algbw(GB/s)", "busbw(GB/s)", "wrong");
    }
    double sum = 0;
    int rows = 0, status = 0;
    for (size_t bytes = opt.op == OP_BARRIER ? 0 : opt.min_bytes;;) {
        double busbw = 0;
        int r = measure_and_print(bytes, &busbw);
        if (r < 0) {
            fprintf(stderr, "mpi-baseline: rank %d: %s failed at %zu bytes\n", rank,
                    op_names[opt.op], bytes);
            status = 1;
            break;
        }
        if (r > 0) status = 1;
        sum += busbw;
        rows++;
        if (opt.op == OP_BARRIER || bytes == 0 || bytes > opt.max_bytes / opt.factor) break;
        bytes *= opt.factor;
    }
    if (rank == 0 && !opt.json) printf("# Avg bus bandwidth    : %.3f GB/s\n", rows ? sum / rows : 0);
    free(send_buf);
    free(recv_buf);
    if (bf16_op != MPI_OP_NULL) MPI_Op_free(&bf16_op);
    MPI_Finalize();
    return status;
}
