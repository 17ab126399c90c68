// The config initializers from C++11: DDP_*_INIT (which in C++ calls ddp_*_init) and the
// ddp_*_init functions give every default, field by field, the same as the C designated
// initializers the library was compiled with. Compiled with -std=c++11 (tests/cxx.cmake).
#include <cstdio>
#include <cstring>

#include "ddp/ddp.h"
#ifdef DDP_TEST_HAVE_POWERSGD
#include "ddp/powersgd.h"
#endif

static int failures = 0;

#define EXPECT(cond)                                                                              \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);              \
            failures++;                                                                           \
        }                                                                                         \
    } while (0)

// Namespace-scope objects work too (dynamic initialization in C++).
static ddp_reducer_config_t global_reducer_config = DDP_REDUCER_CONFIG_INIT;

static void check_reducer(const ddp_reducer_config_t &c)
{
    EXPECT(c.bucket_cap_bytes == (size_t)25 << 20);
    EXPECT(c.first_bucket_bytes == (size_t)1 << 20);
    EXPECT(c.broadcast_bucket_bytes == (size_t)250 << 20);
    EXPECT(c.find_unused_parameters == 0);
    EXPECT(c.user_grads == 0);
    EXPECT(c.broadcast_buffers == 1);
    EXPECT(c.rebuild_buckets == 1);
    EXPECT(c.sync_at_create == 1);
    EXPECT(c.comm_hook == NULL);
    EXPECT(c.comm_hook_state == NULL);
    EXPECT(c.trace == NULL);
    EXPECT(c.piece_bytes == 0);
    EXPECT(c.comm_hook_averages == 0);
    EXPECT(c.bucket_layout == DDP_BUCKET_LAYOUT_DEFAULT);
    EXPECT(c.grad_memory == DDP_GRAD_MEMORY_BUCKETS);
    EXPECT(c.grad_block == NULL);
    EXPECT(c.grad_block_bytes == 0);
}

static void check_optim(const ddp_optim_config_t &c)
{
    EXPECT(c.kind == DDP_OPTIM_SGD);
    EXPECT(c.lr == 0.01);
    EXPECT(c.momentum == 0.0);
    EXPECT(c.nesterov == 0);
    EXPECT(c.beta1 == 0.9);
    EXPECT(c.beta2 == 0.999);
    EXPECT(c.eps == 1e-8);
    EXPECT(c.weight_decay == 0.0);
}

static void check_zero(const ddp_zero_config_t &c)
{
    EXPECT(c.stage == 1);
    check_optim(c.optim);
    EXPECT(c.bucket_cap_bytes == (size_t)25 << 20);
    EXPECT(c.overlap == 0);
}

static void check_fsdp(const ddp_fsdp_config_t &c)
{
    check_optim(c.optim);
    EXPECT(c.bucket_cap_bytes == (size_t)1 << 20);
    EXPECT(c.sync_params == 1);
    EXPECT(c.cache_buffers == 1);
}

int main()
{
    check_reducer(global_reducer_config);
    ddp_reducer_config_t rc = DDP_REDUCER_CONFIG_INIT;
    check_reducer(rc);
    std::memset(&rc, 0x5a, sizeof rc);
    ddp_reducer_config_init(&rc);
    check_reducer(rc);
    ddp_reducer_config_init(NULL); // ignored

    ddp_group_options_t go = DDP_GROUP_OPTIONS_INIT;
    EXPECT(go.timeout_ms == 0 && go.transport == NULL && go.name == NULL);
    std::memset(&go, 0x5a, sizeof go);
    ddp_group_options_init(&go);
    EXPECT(go.timeout_ms == 0 && go.transport == NULL && go.name == NULL);

    ddp_optim_config_t oc = DDP_OPTIM_CONFIG_INIT;
    check_optim(oc);
    std::memset(&oc, 0x5a, sizeof oc);
    ddp_optim_config_init(&oc);
    check_optim(oc);

    ddp_zero_config_t zc = DDP_ZERO_CONFIG_INIT;
    check_zero(zc);
    std::memset(&zc, 0x5a, sizeof zc);
    ddp_zero_config_init(&zc);
    check_zero(zc);

    ddp_fsdp_config_t fc = DDP_FSDP_CONFIG_INIT;
    check_fsdp(fc);
    std::memset(&fc, 0x5a, sizeof fc);
    ddp_fsdp_config_init(&fc);
    check_fsdp(fc);

#ifdef DDP_TEST_HAVE_POWERSGD
    ddp_powersgd_config_t pcs[2] = {DDP_POWERSGD_CONFIG_INIT, DDP_POWERSGD_CONFIG_INIT};
    std::memset(&pcs[1], 0x5a, sizeof pcs[1]);
    ddp_powersgd_config_init(&pcs[1]);
    for (int i = 0; i < 2; i++) {
        const ddp_powersgd_config_t &p = pcs[i];
        EXPECT(p.matrix_approximation_rank == 1);
        EXPECT(p.start_powersgd_iter == 1000);
        EXPECT(p.min_compression_rate == 2.0);
        EXPECT(p.use_error_feedback == 1);
        EXPECT(p.warm_start == 1);
        EXPECT(p.orthogonalization_epsilon == 0.0);
        EXPECT(p.random_seed == 0);
    }
#endif
    if (failures) return 1;
    std::printf("config initializers from C++11: ok\n");
    return 0;
}
