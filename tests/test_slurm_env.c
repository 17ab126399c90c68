/* ddp_group_create_from_env under srun, with Slurm's variables set by hand (no Slurm here): 3
 * tasks on one node meet at the store the first task hosts (port from the job and step ids,
 * secret from $HOME/.ddp/store-secret, created 0600) and run over shared memory; with
 * DDP_STORE_TOKEN exported no secret file is made; a secret file others can read is refused,
 * naming the fix; a port another process holds fails the host at once and the others within
 * their timeout; and the derived ports stay in their range. (tests/netns/multihost.sh slurm
 * runs the same on 2 and 3 network-namespace hosts, where the group is hierarchical.) */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/internal.h"
#include "group/rendezvous.h"
#include "harness.h"

static void set_slurm(int rank, int world, long long job)
{
    char text[64];
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    unsetenv("DDP_STORE_ADDR");
    unsetenv("DDP_STORE_PORT");
    unsetenv("DDP_TRANSPORT");
    snprintf(text, sizeof text, "%d", rank);
    setenv("SLURM_PROCID", text, 1);
    setenv("SLURM_LOCALID", text, 1);
    snprintf(text, sizeof text, "%d", world);
    setenv("SLURM_NTASKS", text, 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", text, 1);
    setenv("SLURM_NODEID", "0", 1);
    setenv("SLURM_STEP_NODELIST", "localhost", 1);
    snprintf(text, sizeof text, "%lld", job);
    setenv("SLURM_JOB_ID", text, 1);
    setenv("SLURM_STEP_ID", "0", 1);
}

static int task(int rank, int world, long long job)
{
    set_slurm(rank, world, job);
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(NULL, &g));
    CHECK_MSG(strcmp(ddp_group_transport(g), "shm") == 0, "transport %s", ddp_group_transport(g));
    CHECK(ddp_group_rank(g) == rank && ddp_group_size(g) == world);
    double x[257];
    for (int i = 0; i < 257; i++) x[i] = rank * 1000.0 + i;
    CHECK_OK(ddp_group_allreduce(g, x, x, 257, DDP_F64, DDP_SUM));
    for (int i = 0; i < 257; i++) CHECK(x[i] == 1000.0 * world * (world - 1) / 2 + world * i);
    ddp_group_destroy(g);
    return 0;
}

/* A task whose job's port is held by someone else: the host must fail at once naming the port
 * and the way out, the others within their timeout (DDP_TIMEOUT=4), never hang. */
static int blocked_task(int rank, int world, long long job)
{
    set_slurm(rank, world, job);
    setenv("DDP_TIMEOUT", "4", 1);
    double t0 = (double)ddp__now_ns() * 1e-9;
    ddp_group_t *g = NULL;
    ddp_status_t s = ddp_group_create_from_env(NULL, &g);
    double took = (double)ddp__now_ns() * 1e-9 - t0;
    CHECK_MSG(s != DDP_OK && g == NULL, "rank %d created a group on a port another holds", rank);
    if (rank == 0) {
        CHECK_ERROR_MENTIONS("DDP_STORE_PORT");
        CHECK_ERROR_MENTIONS("SLURM_JOB_ID");
        CHECK_MSG(took < 2, "the host failed after %.1f s", took);
    } else {
        CHECK_MSG(took < 15, "rank %d failed after %.1f s", rank, took);
    }
    printf("port taken: rank %d failed after %.1f s: %s\n", rank, took, ddp_last_error());
    fflush(stdout);
    return 0;
}

static void run_tasks_with(int world, long long job, int (*fn)(int, int, long long))
{
    pid_t pids[8];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(60);
            _exit(fn(r, world, job));
        }
    }
    for (int r = 0; r < world; r++) {
        int status = 0;
        CHECK(waitpid(pids[r], &status, 0) == pids[r]);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "task %d failed (status %d)", r,
                  status);
    }
}

static void run_tasks(int world, long long job) { run_tasks_with(world, job, task); }

int main(void)
{
    char home[600], other[600];
    CHECK(ddp_test_tmpdir());
    snprintf(home, sizeof home, "%s", ddp_test_tmpdir());
    setenv("HOME", home, 1);
    unsetenv("DDP_STORE_TOKEN");
    /* A job id of our own: tests side by side must not derive the same port. */
    long long job = 100000 + (long long)getpid();

    run_tasks(3, job);
    char secret[700];
    CHECK(strlen(home) > 0);
    snprintf(secret, sizeof secret, "%s/.ddp/store-secret", home);
    struct stat st;
    CHECK_MSG(stat(secret, &st) == 0, "no secret file at %s", secret);
    CHECK_MSG((st.st_mode & 0777) == 0600, "the secret has mode %o", st.st_mode & 0777);
    printf("3 tasks under srun's variables over shm, secret %s 0600: ok\n", secret);
    fflush(stdout); /* before the next forks */

    /* The same file serves the next step; a step of another job meets at another port. */
    run_tasks(2, job + 1);

    /* An exported token is used as is: no file needed (HOME elsewhere, empty). */
    snprintf(other, sizeof other, "%s", ddp_test_tmpdir());
    setenv("HOME", other, 1);
    setenv("DDP_STORE_TOKEN", "exported-token-for-this-job", 1);
    run_tasks(2, job + 2);
    char none[700];
    snprintf(none, sizeof none, "%s/.ddp/store-secret", other);
    CHECK_MSG(stat(none, &st) != 0, "a secret file was made though DDP_STORE_TOKEN was set");
    unsetenv("DDP_STORE_TOKEN");

    /* A secret others can read is refused at once, with the fix. */
    setenv("HOME", home, 1);
    CHECK(chmod(secret, 0644) == 0);
    set_slurm(1, 2, job + 3);
    ddp_group_t *g = NULL;
    CHECK_STATUS(ddp_group_create_from_env(NULL, &g), DDP_ERR_INVALID_USAGE);
    CHECK_ERROR_MENTIONS("chmod 600");
    CHECK_ERROR_MENTIONS("store-secret");

    /* Without the node list the task cannot know the host, and says which variable. */
    CHECK(chmod(secret, 0600) == 0);
    unsetenv("SLURM_STEP_NODELIST");
    CHECK_STATUS(ddp_group_create_from_env(NULL, &g), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("SLURM_STEP_NODELIST");

    /* Another process holds the port this job's step derives. */
    int blocker = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons((uint16_t)ddp__slurm_store_port(job + 4, 0));
    CHECK_MSG(bind(blocker, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(blocker, 8) == 0,
              "cannot hold port %d for the test", ntohs(sa.sin_port));
    setenv("SLURM_STEP_NODELIST", "localhost", 1);
    run_tasks_with(2, job + 4, blocked_task);
    close(blocker);

    /* Ports: in range, and different for neighbouring jobs and steps. */
    int seen_equal = 0;
    for (long long j = 1; j < 2000; j++) {
        int p = ddp__slurm_store_port(j, 0);
        CHECK(p >= 10000 && p <= 32767);
        seen_equal += p == ddp__slurm_store_port(j + 1, 0) || p == ddp__slurm_store_port(j, 1);
    }
    CHECK_MSG(seen_equal <= 1, "%d neighbouring job/step ids share a port", seen_equal);
    printf("test_slurm_env: ok\n");
    return 0;
}
