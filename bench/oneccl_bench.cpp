// oneccl-bench: oneCCL's anchor for bench/peers.sh (issue #27). The same sweep, timing method and
// JSON lines as ddp-bench and mpi-baseline, calling oneCCL's host API (ccl::allreduce, broadcast,
// allgather, reduce_scatter, alltoall on host memory). C++: the wheel's C header (oneapi/ccl.h, its
// v2 API) itself includes C++ headers and marks parts not implemented; ccl.hpp is the API. MPI (the
// Intel MPI that oneCCL's wheel depends on) only starts the ranks and passes the key-value store
// address; every timed call is oneCCL's. bench/peers.sh builds it with that MPI's mpicxx:
//   mpicxx -O2 -std=c++17 bench/oneccl_bench.cpp -lccl ...; mpirun -np 2 oneccl-bench -o allreduce
// Time per size: each rank's time per iteration, max over ranks, median over --rounds rounds;
// iterations raised so a round lasts >= --min-ms. Before timing, one call on known data is
// checked element by element ("wrong" = elements that differ, summed over ranks).
#include <mpi.h>

#include <oneapi/ccl.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

const char *const op_names[] = {"allreduce", "broadcast", "reduce_scatter", "allgather", "alltoall"};
enum { OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_ALLTOALL, N_OPS };

struct options {
    int op = OP_ALLREDUCE;
    bool bf16 = false;
    size_t min_bytes = 8, max_bytes = 256u << 20, factor = 4;
    int iters = 10, warmup = 3, rounds = 5, check = 1, corrupt = 0;
    double min_round_ms = 10;
};

int rank_, world_;
options opt;

bool parse_size(const char *text, size_t *out)
{
    char *end = nullptr;
    if (!*text || *text == '-') return false;
    unsigned long long v = strtoull(text, &end, 10), scale = 1;
    if (end == text) return false;
    if (*end == 'k' || *end == 'K') scale = 1ULL << 10, end++;
    else if (*end == 'm' || *end == 'M') scale = 1ULL << 20, end++;
    else if (*end == 'g' || *end == 'G') scale = 1ULL << 30, end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return false;
    *out = (size_t)(v * scale);
    return true;
}

bool parse_int(const char *text, long lo, long hi, int *out)
{
    char *end = nullptr;
    long v = strtol(text, &end, 10);
    if (end == text || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

// Returns 0 to run, 1 for --help, 2 for a bad option (rank 0 says which).
int parse_options(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            if (rank_ == 0)
                printf("usage: mpirun -np N oneccl-bench [-o allreduce|broadcast|reduce_scatter|"
                       "allgather|alltoall]\n  [-d f32|bf16] [-b SIZE] [-e SIZE] [-f N] [-n ITERS] "
                       "[-w WARMUP] [--rounds N] [--min-ms MS] [-c 0|1] [--json]\n  [--test-corrupt 1: rank 0 "
                       "spoils one output element before the check]\n"
                       "SIZE is the whole buffer as in ddp-bench (alltoall: each rank's send "
                       "buffer); output is JSON lines, as ddp-bench --json.\n");
            return 1;
        }
        if (a == "--json") continue; // the only output format
        if (i + 1 >= argc) {
            if (rank_ == 0) fprintf(stderr, "oneccl-bench: option %s needs a value\n", a.c_str());
            return 2;
        }
        const char *v = argv[++i];
        bool ok = true;
        if (a == "-o") {
            ok = false;
            for (int k = 0; k < N_OPS; k++)
                if (!strcmp(v, op_names[k])) opt.op = k, ok = true;
        } else if (a == "-d") {
            ok = !strcmp(v, "f32") || !strcmp(v, "bf16");
            opt.bf16 = !strcmp(v, "bf16");
        } else if (a == "-b") ok = parse_size(v, &opt.min_bytes);
        else if (a == "-e") ok = parse_size(v, &opt.max_bytes);
        else if (a == "-f") {
            int f = 0;
            ok = parse_int(v, 2, 1 << 20, &f);
            opt.factor = (size_t)f;
        } else if (a == "-n") ok = parse_int(v, 1, 100000000, &opt.iters);
        else if (a == "-w") ok = parse_int(v, 0, 100000000, &opt.warmup);
        else if (a == "--rounds") ok = parse_int(v, 1, 1000, &opt.rounds);
        else if (a == "-c") ok = parse_int(v, 0, 1, &opt.check);
        else if (a == "--test-corrupt") ok = parse_int(v, 0, 1, &opt.corrupt);
        else if (a == "--min-ms") {
            char *end = nullptr;
            opt.min_round_ms = strtod(v, &end);
            ok = end != v && !*end && opt.min_round_ms >= 0;
        } else {
            if (rank_ == 0) fprintf(stderr, "oneccl-bench: unknown option '%s'\n", a.c_str());
            return 2;
        }
        if (!ok) {
            if (rank_ == 0) fprintf(stderr, "oneccl-bench: %s: bad value '%s'\n", a.c_str(), v);
            return 2;
        }
    }
    if (opt.min_bytes > opt.max_bytes) {
        if (rank_ == 0) fprintf(stderr, "oneccl-bench: -b is larger than -e\n");
        return 2;
    }
    return 0;
}

// Element values: small integers, so f32 and bf16 sums over 4 ranks are exact.
double input_value(int r, size_t i) { return (double)((i * 7 + (size_t)r * 5) % 13) - 6.0; }

double expected_sum(size_t i)
{
    double acc = 0;
    for (int r = 0; r < world_; r++) acc += input_value(r, i);
    return acc;
}

float bf16_to_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t float_to_bf16(float f) // exact for the small integers used here
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

size_t elem() { return opt.bf16 ? 2 : 4; }

double load(const char *buf, size_t i)
{
    if (opt.bf16) return bf16_to_float(((const uint16_t *)buf)[i]);
    return ((const float *)buf)[i];
}

void store(char *buf, size_t i, double v)
{
    if (opt.bf16) ((uint16_t *)buf)[i] = float_to_bf16((float)v);
    else ((float *)buf)[i] = (float)v;
}

struct plan {
    size_t count, total; // per-call count (per rank block for the scattering ones), whole buffer
};

plan plan_size(size_t bytes)
{
    plan p{bytes / elem(), bytes / elem()};
    if (opt.op == OP_REDUCE_SCATTER || opt.op == OP_ALLGATHER || opt.op == OP_ALLTOALL) {
        p.count = bytes / elem() / (size_t)world_;
        p.total = p.count * (size_t)world_;
    }
    return p;
}

char *send_buf, *recv_buf;

void run_once(const plan &p, const ccl::communicator &comm)
{
    ccl::datatype t = opt.bf16 ? ccl::datatype::bfloat16 : ccl::datatype::float32;
    switch (opt.op) {
    case OP_ALLREDUCE:
        ccl::allreduce(send_buf, recv_buf, p.count, t, ccl::reduction::sum, comm).wait();
        break;
    case OP_BROADCAST: ccl::broadcast(recv_buf, p.count, t, 0, comm).wait(); break;
    case OP_REDUCE_SCATTER:
        ccl::reduce_scatter(send_buf, recv_buf, p.count, t, ccl::reduction::sum, comm).wait();
        break;
    case OP_ALLGATHER: ccl::allgather(send_buf, recv_buf, p.count, t, comm).wait(); break;
    case OP_ALLTOALL: ccl::alltoall(send_buf, recv_buf, p.count, t, comm).wait(); break;
    }
}

void fill(const plan &p)
{
    memset(recv_buf, 0xff, p.total * elem());
    switch (opt.op) {
    case OP_ALLREDUCE:
    case OP_REDUCE_SCATTER:
    case OP_ALLTOALL:
        for (size_t i = 0; i < p.total; i++) store(send_buf, i, input_value(rank_, i));
        break;
    case OP_BROADCAST:
        for (size_t i = 0; i < p.total; i++) store(recv_buf, i, rank_ == 0 ? input_value(0, i) : 100.0);
        break;
    case OP_ALLGATHER:
        for (size_t j = 0; j < p.count; j++)
            store(send_buf, j, input_value(rank_, (size_t)rank_ * p.count + j));
        break;
    }
}

long long count_wrong(const plan &p)
{
    long long wrong = 0;
    size_t c = p.count;
    switch (opt.op) {
    case OP_ALLREDUCE:
        for (size_t i = 0; i < c; i++) wrong += load(recv_buf, i) != expected_sum(i);
        break;
    case OP_REDUCE_SCATTER:
        for (size_t j = 0; j < c; j++)
            wrong += load(recv_buf, j) != expected_sum((size_t)rank_ * c + j);
        break;
    case OP_BROADCAST:
        for (size_t i = 0; i < c; i++) wrong += load(recv_buf, i) != input_value(0, i);
        break;
    case OP_ALLGATHER:
        for (size_t i = 0; i < p.total; i++) wrong += load(recv_buf, i) != input_value((int)(i / c), i);
        break;
    case OP_ALLTOALL:
        for (size_t i = 0; i < p.total; i++)
            wrong += load(recv_buf, i) != input_value((int)(i / c), (size_t)rank_ * c + i % c);
        break;
    }
    return wrong;
}

double timed_round(const plan &p, long iters, const ccl::communicator &comm)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (long k = 0; k < iters; k++) run_once(p, comm);
    double t = (MPI_Wtime() - start) * 1e6 / (double)iters;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return t;
}

long long measure_and_print(size_t bytes, const ccl::communicator &comm)
{
    plan p = plan_size(bytes);
    long long wrong = -1;
    if (opt.check) {
        fill(p);
        run_once(p, comm);
        if (opt.corrupt && rank_ == 0) store(recv_buf, 0, load(recv_buf, 0) + 1.0); // proves the check
        wrong = count_wrong(p);
        MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    }
    for (int k = 0; k < opt.warmup; k++) run_once(p, comm);
    double per_iter = timed_round(p, opt.iters, comm);
    long iters = opt.iters;
    if (per_iter * (double)iters < opt.min_round_ms * 1000.0) {
        double want = opt.min_round_ms * 1000.0 / (per_iter > 0.01 ? per_iter : 0.01);
        iters = want > 1e7 ? 10000000L : (long)std::ceil(want);
    }
    // Every rank must agree on the iteration count: rank 0's decides.
    MPI_Bcast(&iters, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    std::vector<double> rounds;
    for (int k = 0; k < opt.rounds; k++) rounds.push_back(timed_round(p, iters, comm));
    std::sort(rounds.begin(), rounds.end());
    size_t n = rounds.size();
    double time_us = n % 2 ? rounds[n / 2] : 0.5 * (rounds[n / 2 - 1] + rounds[n / 2]);
    size_t nbytes = p.total * elem();
    double w = world_;
    double factor = opt.op == OP_ALLREDUCE ? 2 * (w - 1) / w
                    : (opt.op == OP_REDUCE_SCATTER || opt.op == OP_ALLGATHER) ? (w - 1) / w
                                                                               : 1.0;
    double algbw = time_us > 0 ? (double)nbytes / time_us / 1e3 : 0;
    bool reducing = opt.op == OP_ALLREDUCE || opt.op == OP_REDUCE_SCATTER;
    if (rank_ == 0) {
        char wtext[32];
        if (wrong < 0) snprintf(wtext, sizeof wtext, "null");
        else snprintf(wtext, sizeof wtext, "%lld", wrong);
        printf("{\"op\":\"%s\",\"dtype\":\"%s\",\"redop\":\"%s\",\"bytes\":%zu,\"count\":%zu,"
               "\"time_us\":%.4f,\"algbw\":%.6g,\"busbw\":%.6g,\"wrong\":%s,\"world_size\":%d,"
               "\"inplace\":0,\"segment\":0,\"transport\":\"oneccl\",\"iters\":%ld,\"rounds\":%zu,"
               "\"time_us_min\":%.4f,\"time_us_max\":%.4f}\n",
               op_names[opt.op], opt.bf16 ? "bf16" : "f32", reducing ? "sum" : "none", nbytes,
               p.total, time_us, algbw, algbw * factor, wtext, world_, iters, n, rounds[0],
               rounds[n - 1]);
        fflush(stdout);
    }
    return wrong;
}

} // namespace

int main(int argc, char **argv)
{
    ccl::init();
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    int rc = parse_options(argc, argv);
    if (rc) {
        MPI_Finalize();
        return rc == 1 ? 0 : 2;
    }
    int status = 0;
    try {
        ccl::shared_ptr_class<ccl::kvs> kvs;
        ccl::kvs::address_type address;
        if (rank_ == 0) {
            kvs = ccl::create_main_kvs();
            address = kvs->get_address();
        }
        MPI_Bcast(address.data(), (int)address.size(), MPI_BYTE, 0, MPI_COMM_WORLD);
        if (rank_ != 0) kvs = ccl::create_kvs(address);
        auto comm = ccl::create_communicator(world_, rank_, kvs);
        size_t cap = (opt.max_bytes + 4095) / 4096 * 4096;
        if (cap == 0) cap = 4096;
        send_buf = (char *)aligned_alloc(4096, cap);
        recv_buf = (char *)aligned_alloc(4096, cap);
        if (!send_buf || !recv_buf) {
            fprintf(stderr, "oneccl-bench: rank %d: out of memory\n", rank_);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        memset(send_buf, 0, cap);
        memset(recv_buf, 0, cap);
        for (size_t bytes = opt.min_bytes;;) {
            if (plan_size(bytes).count > 0 && measure_and_print(bytes, comm) > 0) status = 1;
            if (bytes == 0 || bytes > opt.max_bytes / opt.factor) break;
            bytes *= opt.factor;
        }
        free(send_buf);
        free(recv_buf);
    } catch (const std::exception &e) {
        fprintf(stderr, "oneccl-bench: rank %d: %s failed: %s\n", rank_, op_names[opt.op], e.what());
        status = 1;
    }
    MPI_Finalize();
    return status;
}
