/* ddp_env_read: the torchrun/ddprun, Open MPI and PMI variable sets, and an error naming the
 * variable and its value for every missing, malformed or inconsistent one. */
#include <string.h>

#include "core/internal.h"
#include "harness.h"

static const char *const all_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "DDP_STORE_TOKEN", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "DDP_STORE_ADDR", "DDP_STORE_PORT", "GROUP_RANK", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
};

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof all_vars / sizeof all_vars[0]; i++) unsetenv(all_vars[i]);
}

static void set_torchrun(const char *rank, const char *world, const char *local_rank,
                         const char *local_world)
{
    clear_env();
    if (rank) setenv("RANK", rank, 1);
    if (world) setenv("WORLD_SIZE", world, 1);
    if (local_rank) setenv("LOCAL_RANK", local_rank, 1);
    if (local_world) setenv("LOCAL_WORLD_SIZE", local_world, 1);
}

/* ddp_env_read must fail with `want`, mention every needle, and leave *out untouched. */
static void expect_error(ddp_status_t want, const char *needle1, const char *needle2)
{
    ddp_env_t env;
    memset(&env, 0x5a, sizeof env);
    CHECK_STATUS(ddp_env_read(&env), want);
    CHECK_ERROR_MENTIONS(needle1);
    if (needle2) CHECK_ERROR_MENTIONS(needle2);
    CHECK(env.rank == 0x5a5a5a5a);
}

static void test_torchrun(void)
{
    /* Every rank of a 2-node x 3-per-node job reads back what the launcher set. */
    for (int node = 0; node < 2; node++) {
        for (int i = 0; i < 3; i++) {
            char rank[16], local[16];
            snprintf(rank, sizeof rank, "%d", node * 3 + i);
            snprintf(local, sizeof local, "%d", i);
            set_torchrun(rank, "6", local, "3");
            setenv("MASTER_ADDR", "10.1.2.3", 1);
            setenv("MASTER_PORT", "29500", 1);
            setenv("DDP_STORE_TOKEN", "s3cret", 1);
            ddp_env_t env;
            CHECK_OK(ddp_env_read(&env));
            CHECK(env.rank == node * 3 + i && env.world_size == 6);
            CHECK(env.local_rank == i && env.local_world_size == 3);
            CHECK(strcmp(env.master_addr, "10.1.2.3") == 0 && env.master_port == 29500);
            CHECK(strcmp(env.token, "s3cret") == 0);
            CHECK(strcmp(env.source, "torchrun") == 0);
        }
    }

    /* World size 1, no rendezvous address: a single process run by hand. */
    set_torchrun("0", "1", NULL, NULL);
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.rank == 0 && env.world_size == 1 && env.local_rank == 0 && env.local_world_size == 1);
    CHECK(env.master_addr[0] == '\0' && env.master_port == 0 && env.token[0] == '\0');

    /* Only the global pair: one host is assumed. */
    set_torchrun("2", "3", NULL, NULL);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.local_rank == 2 && env.local_world_size == 3);

    /* Largest port, '+' sign accepted. */
    set_torchrun("+1", "2", "1", "2");
    setenv("MASTER_ADDR", "localhost", 1);
    setenv("MASTER_PORT", "65535", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.rank == 1 && env.master_port == 65535);
}

static void test_torchrun_errors(void)
{
    set_torchrun("0", NULL, "0", "1");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE", "not set");

    set_torchrun(NULL, "4", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "RANK is not set", "WORLD_SIZE=4");

    set_torchrun(NULL, NULL, "1", NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE is not set", "torchrun");

    set_torchrun("4", "4", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "RANK=4", "WORLD_SIZE=4");

    set_torchrun("7", "3", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "RANK=7", "WORLD_SIZE=3");

    set_torchrun("0", "0", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE=0", NULL);

    set_torchrun("-1", "4", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "RANK='-1'", "non-negative integer");

    set_torchrun("one", "4", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "RANK='one'", NULL);

    set_torchrun("1", "4x", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE='4x'", NULL);

    set_torchrun("1", "", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE=''", NULL);

    set_torchrun("1", "99999999999999999999", NULL, NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "WORLD_SIZE='99999999999999999999'", "too large");

    set_torchrun("1", "4", "2", "2");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2");

    set_torchrun("1", "4", "0", "5");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "LOCAL_WORLD_SIZE=5", "WORLD_SIZE=4");

    set_torchrun("1", "4", "1", NULL);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "LOCAL_WORLD_SIZE is not set", "LOCAL_RANK=1");

    set_torchrun("1", "4", NULL, "2");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "LOCAL_RANK is not set", NULL);

    set_torchrun("1", "4", "x", "2");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "LOCAL_RANK='x'", NULL);

    /* Rendezvous address and port. */
    const char *bad_ports[] = {"http", "0", "65536", "-5", "80 ", "123456789012"};
    for (size_t i = 0; i < sizeof bad_ports / sizeof bad_ports[0]; i++) {
        set_torchrun("0", "2", NULL, NULL);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", bad_ports[i], 1);
        char needle[64];
        snprintf(needle, sizeof needle, "MASTER_PORT='%s'", bad_ports[i]);
        expect_error(DDP_ERR_INVALID_ARGUMENT, needle, NULL);
    }
    set_torchrun("0", "2", NULL, NULL);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "MASTER_PORT is not set", "MASTER_ADDR='127.0.0.1'");

    set_torchrun("0", "2", NULL, NULL);
    setenv("MASTER_PORT", "1234", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is not set", "MASTER_PORT=1234");

    set_torchrun("0", "2", NULL, NULL);
    setenv("MASTER_ADDR", "", 1);
    setenv("MASTER_PORT", "1234", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR is empty", NULL);

    char long_text[400];
    memset(long_text, 'a', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = '\0';
    set_torchrun("0", "2", NULL, NULL);
    setenv("MASTER_ADDR", long_text, 1);
    setenv("MASTER_PORT", "1234", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "MASTER_ADDR", "at most 255");

    set_torchrun("0", "2", NULL, NULL);
    setenv("DDP_STORE_TOKEN", long_text, 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_TOKEN", "at most 127");
}

static void test_openmpi(void)
{
    clear_env();
    setenv("OMPI_COMM_WORLD_RANK", "3", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "5", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.rank == 3 && env.world_size == 5 && env.local_rank == 1 && env.local_world_size == 2);
    CHECK(strcmp(env.source, "openmpi") == 0);
    CHECK(env.master_addr[0] == '\0' && env.master_port == 0);

    /* A TCP store exported by hand next to mpirun's variables. */
    setenv("MASTER_ADDR", "node0", 1);
    setenv("MASTER_PORT", "4000", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.master_addr, "node0") == 0 && env.master_port == 4000);

    /* torchrun's variables win over mpirun's when both exist (ddprun started under mpirun). */
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.source, "torchrun") == 0 && env.world_size == 1);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");

    setenv("OMPI_COMM_WORLD_RANK", "5", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "OMPI_COMM_WORLD_RANK=5", "OMPI_COMM_WORLD_SIZE=5");
    setenv("OMPI_COMM_WORLD_RANK", "3", 1);
    unsetenv("OMPI_COMM_WORLD_SIZE");
    expect_error(DDP_ERR_INVALID_ARGUMENT, "OMPI_COMM_WORLD_SIZE", "not set");
}

static void test_pmi(void)
{
    clear_env();
    setenv("PMI_RANK", "2", 1);
    setenv("PMI_SIZE", "3", 1);
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.rank == 2 && env.world_size == 3 && env.local_rank == 2 && env.local_world_size == 3);
    CHECK(strcmp(env.source, "pmi") == 0);

    setenv("MPI_LOCALRANKID", "0", 1);
    setenv("MPI_LOCALNRANKS", "1", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.rank == 2 && env.local_rank == 0 && env.local_world_size == 1);

    setenv("PMI_SIZE", "abc", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "PMI_SIZE='abc'", NULL);
}

static void test_nothing_set(void)
{
    clear_env();
    expect_error(DDP_ERR_NOT_FOUND, "RANK", "OMPI_COMM_WORLD_RANK");
    CHECK_ERROR_MENTIONS("PMI_RANK");
    /* The rendezvous pair alone does not say where this rank is. */
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29500", 1);
    expect_error(DDP_ERR_NOT_FOUND, "WORLD_SIZE", NULL);

    CHECK_STATUS(ddp_env_read(NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("out");
}

/* ddprun's own pair wins over MASTER_*, which it leaves to torch (and which then need not be
 * valid for libddp); MASTER_* alone is still read, for torchrun. */
static void test_store_pairs(void)
{
    set_torchrun("1", "2", NULL, NULL);
    setenv("DDP_STORE_ADDR", "10.0.0.9", 1);
    setenv("DDP_STORE_PORT", "4100", 1);
    setenv("MASTER_ADDR", "10.0.0.9", 1);
    setenv("MASTER_PORT", "not-for-libddp", 1);
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.master_addr, "10.0.0.9") == 0 && env.master_port == 4100);
    CHECK(strcmp(env.store_source, "DDP_STORE_ADDR") == 0);
    unsetenv("DDP_STORE_ADDR");
    unsetenv("DDP_STORE_PORT");
    setenv("MASTER_PORT", "29500", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.master_port == 29500 && strcmp(env.store_source, "MASTER_ADDR") == 0);
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.store_source == NULL && env.master_addr[0] == '\0');
    setenv("DDP_STORE_PORT", "4100", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_ADDR is not set", "DDP_STORE_PORT=4100");
    setenv("DDP_STORE_ADDR", "h", 1);
    setenv("DDP_STORE_PORT", "70000", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_PORT='70000'", NULL);
}

/* srun's variables: rank, size, node, tasks on this node from the compressed per-node list,
 * node list, job and step; mpirun's win inside an allocation. */
static void test_slurm(void)
{
    clear_env();
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_NTASKS", "8", 1);
    setenv("SLURM_LOCALID", "0", 1);
    setenv("SLURM_NODEID", "2", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "3(x2),1,1", 1); /* nodes 0,1: 3 tasks; 2: 1; 3: 1 */
    setenv("SLURM_STEP_NODELIST", "node[01-03],gpu7", 1);
    setenv("SLURM_JOB_ID", "123456", 1);
    setenv("SLURM_STEP_ID", "2", 1);
    ddp_env_t env;
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.source, "slurm") == 0);
    CHECK(env.rank == 5 && env.world_size == 8 && env.local_rank == 0);
    CHECK_MSG(env.local_world_size == 1, "local world %d", env.local_world_size);
    CHECK(env.node_rank == 2 && env.job_id == 123456 && env.step_id == 2);
    CHECK(strcmp(env.nodelist, "node[01-03],gpu7") == 0);
    CHECK(env.store_source == NULL);
    setenv("SLURM_NODEID", "1", 1);
    setenv("SLURM_LOCALID", "2", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.local_world_size == 3 && env.local_rank == 2);

    /* A step smaller than the job. */
    setenv("SLURM_STEP_NUM_TASKS", "6", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(env.world_size == 6);
    setenv("SLURM_STEP_NUM_TASKS", "4", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "SLURM_STEP_NUM_TASKS=4", "SLURM_PROCID=5");
    unsetenv("SLURM_STEP_NUM_TASKS");

    setenv("SLURM_LOCALID", "3", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "SLURM_STEP_TASKS_PER_NODE='3(x2),1,1'",
                 "SLURM_LOCALID=3");
    setenv("SLURM_LOCALID", "0", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "3(2)", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "SLURM_STEP_TASKS_PER_NODE='3(2)'", "2(x3),1");
    setenv("SLURM_STEP_TASKS_PER_NODE", "3", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "no entry for SLURM_NODEID=1", NULL);
    setenv("SLURM_STEP_TASKS_PER_NODE", "3(x2),1,1", 1);
    setenv("SLURM_STEP_NODELIST", "node[03-01]", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "SLURM_STEP_NODELIST", "[03-01]");
    setenv("SLURM_STEP_NODELIST", "node[01-03],gpu7", 1);
    setenv("SLURM_JOB_ID", "12x", 1);
    expect_error(DDP_ERR_INVALID_ARGUMENT, "SLURM_JOB_ID='12x'", NULL);
    setenv("SLURM_JOB_ID", "123456", 1);

    /* Open MPI's mpirun inside the allocation: its variables win. */
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    CHECK_OK(ddp_env_read(&env));
    CHECK(strcmp(env.source, "openmpi") == 0 && env.world_size == 2);
    clear_env();
    /* The batch script's own environment (SLURM_NTASKS, no SLURM_PROCID) is no launcher. */
    setenv("SLURM_NTASKS", "8", 1);
    expect_error(DDP_ERR_NOT_FOUND, "SLURM_PROCID", NULL);
    clear_env();
}

static void expect_hosts(const char *list, int count, const char *const *hosts)
{
    int n = -1;
    char host[64];
    for (int i = 0; i < count; i++) {
        CHECK_OK(ddp_env_hostlist_host(list, i, host, sizeof host, &n));
        CHECK_MSG(n == count, "'%s' has %d hosts, expected %d", list, n, count);
        CHECK_MSG(strcmp(host, hosts[i]) == 0, "host %d of '%s' is '%s', expected '%s'", i, list,
                  host, hosts[i]);
    }
    CHECK_STATUS(ddp_env_hostlist_host(list, count, host, sizeof host, &n), DDP_ERR_INVALID_ARGUMENT);
}

static void test_hostlist(void)
{
    const char *a[] = {"node01", "node02", "node03", "node04", "node07", "gpu3"};
    expect_hosts("node[01-04,07],gpu3", 6, a);
    const char *b[] = {"localhost"};
    expect_hosts("localhost", 1, b);
    const char *c[] = {"rack1-n9", "rack1-n10", "rack2-n9", "rack2-n10"};
    expect_hosts("rack[1-2]-n[9-10]", 4, c);
    const char *d[] = {"a", "b098", "b099", "b100", "c5"};
    expect_hosts("a,b[098-100],c[5]", 5, d);
    const char *e[] = {"x7y", "x8y"};
    expect_hosts("x[7,8]y", 2, e);

    const char *bad[] = {"node[01-", "node]01[", "node[]", "node[4-2]", "a,,b", "", "n[1,]",
                         "n[a-b]"};
    char host[64];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_MSG(ddp_env_hostlist_host(bad[i], 0, host, sizeof host, NULL) ==
                      DDP_ERR_INVALID_ARGUMENT,
                  "'%s' was accepted", bad[i]);
        CHECK_MSG(strlen(ddp_last_error()) > 0, "no text for '%s'", bad[i]);
    }
    /* Far more hosts than exist anywhere is refused rather than overflowing. */
    CHECK_STATUS(ddp_env_hostlist_host("n[0-99999999]x[0-99999999]", 0, host, sizeof host, NULL),
                 DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("too many");
}

static void test_config_table_lists_launcher_variables(void)
{
    const ddp_env_var_t *table = NULL;
    size_t n = ddp_env_vars(&table);
    for (size_t v = 0; v < sizeof all_vars / sizeof all_vars[0]; v++) {
        int found = 0;
        for (size_t i = 0; i < n; i++) found |= strcmp(table[i].name, all_vars[v]) == 0;
        CHECK_MSG(found, "%s is read by ddp_env_read but missing from the config table",
                  all_vars[v]);
    }
}

int main(void)
{
    test_torchrun();
    test_torchrun_errors();
    test_openmpi();
    test_pmi();
    test_nothing_set();
    test_store_pairs();
    test_slurm();
    test_hostlist();
    test_config_table_lists_launcher_variables();
    printf("test_env: ok\n");
    return 0;
}
