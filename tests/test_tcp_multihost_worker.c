/* Worker of the multi-host test (tests/netns/multihost.sh starts it through ddprun on every pretend
 * host, each a network namespace with its own hostname).
 *   check-slurm: (no ddprun: srun's variables by hand) only the group from the environment.
 *   check: the hierarchical transport driven directly over the job's TCP store, then a process
 *          group from the launcher's environment (which must have chosen "hierarchical" when
 *          the group's registry knows it); every collective x dtype x size against the float64
 *          reference; prints "HASH <rank> <hex>" of every output so the script can compare
 *          ranks, and "TRANSPORT <name>".
 *   check-flat: the same with DDP_HIERARCHICAL=0 set by the script: the group must be "tcp".
 *   kill:  allreduces in a loop through the group; prints "LOOPING" once, and "DETECTED ..."
 *          when a collective fails (the script kills another host meanwhile).
 * Usage: test_tcp_multihost_worker check|check-flat|kill */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "transport/transport.h"
#include "harness.h"
#include "test_tcp_common.h"
#include "transport/hier/hier.h"

typedef ddp_status_t (*runner_fn)(void *ctx, ddp__collective_kind_t kind, const void *send,
                                  void *recv, size_t count, ddp_dtype_t dt, ddp_reduce_op_t op,
                                  int root);

typedef struct direct {
    void *state;
    uint64_t seq;
} direct_t;

static ddp_status_t run_direct(void *ctx, ddp__collective_kind_t kind, const void *send,
                               void *recv, size_t count, ddp_dtype_t dt, ddp_reduce_op_t op,
                               int root)
{
    direct_t *d = ctx;
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.seq = ++d->seq;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dt;
    c.op = op;
    c.root = root;
    c.deadline_ns = ddp__now_ns() + 60LL * 1000000000LL;
    return ddp__transport_hierarchical.run(d->state, &c);
}

static ddp_status_t run_group(void *ctx, ddp__collective_kind_t kind, const void *send,
                              void *recv, size_t count, ddp_dtype_t dt, ddp_reduce_op_t op,
                              int root)
{
    ddp_group_t *g = ctx;
    switch (kind) {
    case DDP__ALLREDUCE: return ddp_group_allreduce(g, send, recv, count, dt, op);
    case DDP__BROADCAST: return ddp_group_broadcast(g, recv, count, dt, root);
    case DDP__REDUCE_SCATTER: return ddp_group_reduce_scatter(g, send, recv, count, dt, op);
    case DDP__ALLGATHER: return ddp_group_allgather(g, send, recv, count, dt);
    default: return ddp_group_barrier(g);
    }
}

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ULL + 7; }

/* Every collective on every dtype and size; returns a hash of all outputs. */
static uint64_t exercise(runner_fn run, void *ctx, int rank, int world)
{
    static const size_t sizes[] = {0, 1, 7, 4099, (1u << 20) + 3};
    static const ddp_dtype_t dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16,
                                         DDP_I32, DDP_I64, DDP_U8};
    uint64_t h = 1469598103934665603ULL;
    unsigned salt = 1;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            ddp_dtype_t dt = dtypes[d];
            size_t count = sizes[k], es = ddp_dtype_size(dt);
            int large = count > 5000;
            size_t total = count * (size_t)world;
            char *a = malloc(total * es + 8), *b = malloc(total * es + 8);
            CHECK(a && b);
            ddp_reduce_op_t ops[2] = {DDP_SUM, large ? DDP_MAX : (ddp_reduce_op_t)(salt % 5)};
            for (int o = 0; o < 2; o++) {
                unsigned s = salt++;
                for (size_t i = 0; i < count; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, rank, i, s));
                CHECK_OK(run(ctx, DDP__ALLREDUCE, a, b, count, dt, ops[o], 0));
                for (size_t i = 0; i < count; i += large ? 97 : 1) {
                    double want = tcp_test_reference(dt, ops[o], world, i, s);
                    CHECK_MSG(fabs(ddp_test_get(dt, b, i) - want) <= tcp_test_tolerance(dt),
                              "rank %d allreduce %s %s count %zu element %zu: %.9g vs %.9g", rank,
                              ddp_reduce_op_name(ops[o]), ddp_dtype_name(dt), count, i,
                              ddp_test_get(dt, b, i), want);
                }
                h = mix(h, tcp_test_hash(b, count * es));
            }
            unsigned s = salt++;
            int root = (int)(s % (unsigned)world);
            for (size_t i = 0; i < count; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, rank, i, s));
            CHECK_OK(run(ctx, DDP__BROADCAST, a, a, count, dt, 0, root));
            for (size_t i = 0; i < count; i += large ? 97 : 1)
                CHECK_MSG(ddp_test_get(dt, a, i) == tcp_test_value(dt, root, i, s),
                          "rank %d broadcast element %zu", rank, i);
            h = mix(h, tcp_test_hash(a, count * es));
            if (large) { /* keep the job short: gather and scatter on the smaller sizes */
                free(a);
                free(b);
                continue;
            }
            s = salt++;
            for (size_t i = 0; i < count; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, rank, i, s));
            CHECK_OK(run(ctx, DDP__ALLGATHER, a, b, count, dt, 0, 0));
            for (int r = 0; r < world; r++)
                for (size_t i = 0; i < count; i++)
                    CHECK_MSG(ddp_test_get(dt, b, (size_t)r * count + i) == tcp_test_value(dt, r, i, s),
                              "rank %d allgather block %d element %zu", rank, r, i);
            h = mix(h, tcp_test_hash(b, total * es));
            s = salt++;
            for (size_t i = 0; i < total; i++) ddp_test_put(dt, a, i, tcp_test_value(dt, rank, i, s));
            CHECK_OK(run(ctx, DDP__REDUCE_SCATTER, a, b, count, dt, DDP_SUM, 0));
            for (size_t i = 0; i < count; i++) {
                double want = tcp_test_reference(dt, DDP_SUM, world, count * (size_t)rank + i, s);
                CHECK_MSG(fabs(ddp_test_get(dt, b, i) - want) <= tcp_test_tolerance(dt),
                          "rank %d reduce_scatter element %zu", rank, i);
            }
            free(a);
            free(b);
        }
    }
    CHECK_OK(run(ctx, DDP__BARRIER, NULL, NULL, 0, DDP_F32, 0, 0));
    return h;
}

static int check_mode(const ddp_env_t *env, const char *expect, int with_direct)
{
    /* 1. The hierarchical transport itself, over the job's store (when a launcher named one:
     *    under srun the store is found by the group itself). */
    ddp_store_t *store = NULL;
    if (with_direct) {
        CHECK_OK(ddp_store_tcp_connect(env->master_addr, env->master_port, env->token, 30000,
                                       &store));
        direct_t d = {NULL, 0};
        CHECK_OK(ddp__transport_hierarchical.create(store, "multihost-direct", env->rank,
                                                    env->world_size, 60000, &d.state));
        uint64_t hd = exercise(run_direct, &d, env->rank, env->world_size);
        printf("HASH direct %d %016llx\n", env->rank, (unsigned long long)hd);
        ddp__transport_hierarchical.destroy(d.state);
    }

    /* 2. A process group from the launcher's environment. */
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(NULL, &g));
    const char *name = ddp_group_transport(g);
    printf("TRANSPORT %d %s\n", env->rank, name);
    ddp_status_t known;
    if (ddp__transport_find(expect, &known))
        CHECK_MSG(strcmp(name, expect) == 0, "ranks on several hosts, but the group chose '%s' "
                  "instead of '%s'", name, expect);
    else
        printf("NOTE the group's registry does not know '%s'; the group ran on '%s'\n", expect,
               name);
    uint64_t hg = exercise(run_group, g, env->rank, env->world_size);
    printf("HASH group %d %016llx\n", env->rank, (unsigned long long)hg);
    ddp_group_destroy(g);
    ddp_store_destroy(store);
    return 0;
}

static int kill_mode(const ddp_env_t *env)
{
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(NULL, &g));
    size_t count = 1u << 18;
    float *buf = malloc(count * sizeof *buf);
    CHECK(buf);
    int64_t until = ddp__now_ns() + 90LL * 1000000000LL;
    int iterations = 0;
    while (ddp__now_ns() < until) {
        for (size_t i = 0; i < count; i++) buf[i] = (float)(env->rank + (int)(i % 3));
        ddp_status_t s = ddp_group_allreduce(g, buf, buf, count, DDP_F32, DDP_SUM);
        if (s != DDP_OK) {
            printf("DETECTED rank %d after %d allreduces: %s: %s\n", env->rank, iterations,
                   ddp_status_string(s), ddp_last_error());
            fflush(stdout);
            ddp_group_destroy(g);
            free(buf);
            return 0;
        }
        if (iterations++ == 0) {
            printf("LOOPING rank %d on %s\n", env->rank, ddp_group_transport(g));
            fflush(stdout);
        }
    }
    printf("UNDETECTED rank %d: no failure within 90 s\n", env->rank);
    return 1;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "check";
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    if (strcmp(mode, "kill") == 0) return kill_mode(&env);
    /* check-flat: the script set DDP_HIERARCHICAL=0, so the group must use flat tcp.
     * check-slurm: started with srun's variables only: the group alone, which must find its
     * store (hosted by the first node's first task) and choose hierarchical. */
    if (strcmp(mode, "check-slurm") == 0) {
        CHECK_MSG(strcmp(env.source, "slurm") == 0, "launcher '%s', not slurm", env.source);
        return check_mode(&env, "hierarchical", 0);
    }
    return check_mode(&env, strcmp(mode, "check-flat") == 0 ? "tcp" : "hierarchical", 1);
}
