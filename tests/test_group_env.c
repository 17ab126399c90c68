/* ddp_group_create_from_env: ranks started with the launcher's variables (RANK, WORLD_SIZE,
 * MASTER_ADDR, MASTER_PORT, DDP_STORE_TOKEN) find the TCP store, form the group and own the store.
 * Usage: test_group_env <world> */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static int rank_main(int rank, int world, int port)
{
    char v[32];
    snprintf(v, sizeof v, "%d", rank);
    setenv("RANK", v, 1);
    snprintf(v, sizeof v, "%d", world);
    setenv("WORLD_SIZE", v, 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("MASTER_PORT", v, 1);
    setenv("DDP_STORE_TOKEN", "group-env-test", 1);
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.timeout_ms = 20000;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create_from_env(&o, &g));
    CHECK(ddp_group_rank(g) == rank && ddp_group_size(g) == world);
    int64_t x = rank + 1;
    CHECK_OK(ddp_group_allreduce(g, &x, &x, 1, DDP_I64, DDP_SUM));
    CHECK(x == (int64_t)world * (world + 1) / 2);
    ddp_group_destroy(g); /* also closes the store it opened */
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    /* No launcher variables at all: a clear error, not a crash. */
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    ddp_group_t *g = NULL;
    CHECK(ddp_group_create_from_env(NULL, &g) != DDP_OK && g == NULL);
    CHECK_STATUS(ddp_group_create_from_env(NULL, NULL), DDP_ERR_INVALID_ARGUMENT);

    /* Fork the ranks before the server thread exists (forking a threaded process can leave a
     * lock held in the child); they read the port from a pipe. */
    int fds[2];
    CHECK(pipe(fds) == 0);
    fflush(stdout);
    pid_t pids[8];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            close(fds[1]);
            int port = 0;
            if (read(fds[0], &port, sizeof port) != (ssize_t)sizeof port) _exit(3);
            _exit(rank_main(r, world, port));
        }
    }
    close(fds[0]);
    ddp_store_server_t *server = NULL;
    CHECK_OK(ddp_store_server_start("127.0.0.1", 0, "group-env-test", &server));
    int port = ddp_store_server_port(server);
    for (int r = 0; r < world; r++) CHECK(write(fds[1], &port, sizeof port) == (ssize_t)sizeof port);
    close(fds[1]);
    int failed = 0;
    for (int r = 0; r < world; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            fprintf(stderr, "rank %d failed (status %d)\n", r, status);
            failed = 1;
        }
    }
    ddp_store_server_stop(server);
    if (!failed) printf("test_group_env world=%d: ok\n", world);
    return failed;
}
