/* ddprun's main: options, the watchdog and signals, the store, the workers' slots and logs, then
 * the agent's attempts, and the exit status (ddprun.h lists the modules). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddprun.h"

int main(int argc, char **argv)
{
    job_t job;
    memset(&job, 0, sizeof job);
    job.watch.notify_pipe[0] = job.watch.notify_pipe[1] = -1;
    pthread_mutex_init(&job.watch.lock, NULL);
    parse_options(argc, argv, &job.opt);
    /* A bad DDP_* value would fail every worker's group creation (and ddprun's own reads of
     * DDP_TIMEOUT below): refuse once, before anything starts. */
    if (ddp_config_check() != DDP_OK) {
        fprintf(stderr, "ddprun: %s\n'ddprun --print-config' lists every variable and what it "
                        "accepts.\n",
                ddp_last_error());
        return 2;
    }
    start_watchdog(); /* before the store's threads: see start_watchdog */
    install_signal_handlers();

    if (setup_store(&job) != 0) {
        ddp_store_destroy(job.store);
        ddp_store_server_stop(job.server);
        return 1;
    }
    if (start_watcher(&job) != 0) {
        ddp_store_destroy(job.store);
        ddp_store_server_stop(job.server);
        return 1;
    }

    job.nworkers = job.opt.nproc;
    job.stdout_tty = isatty(STDOUT_FILENO);
    job.stderr_tty = isatty(STDERR_FILENO);
    job.workers = calloc((size_t)job.nworkers, sizeof *job.workers);
    if (job.workers && choose_cpus(&job) != 0) {
        free(job.workers);
        job.workers = NULL;
    }
    if (!job.workers) {
        fprintf(stderr, "ddprun: out of memory\n");
        return 1;
    }
    for (int i = 0; i < job.nworkers; i++) {
        worker_t *w = &job.workers[i];
        w->local_rank = i;
        w->rank = job.opt.node_rank * job.opt.nproc + i;
        w->prefix = job.opt.prefix;
        w->out = (stream_t){-1, 1, NULL, 0};
        w->err = (stream_t){-1, 2, NULL, 0};
        w->out.pending = malloc(LINE_MAX_BYTES);
        w->err.pending = malloc(LINE_MAX_BYTES);
        if (!w->out.pending || !w->err.pending) {
            fprintf(stderr, "ddprun: out of memory\n");
            return 1;
        }
    }
    if (open_logs(&job) != 0) return 1;
    mark_workers_started();
    job.deadline = job.opt.timeout_s > 0 ? now_s() + job.opt.timeout_s : 0;
    run_agent(&job);
    stop_watcher(&job);
    int code = job.stopping ? job.exit_code : 0;
    if (!job.stopping) {
        remote_view_t view;
        watcher_view(&job, &view);
        if (view.failure[0]) { /* our workers were done; another node failed afterwards */
            fprintf(stderr, "ddprun: the job failed elsewhere: %s\n", view.failure);
            code = 1;
        }
    }
    for (int i = 0; i < job.nworkers; i++) {
        if (job.workers[i].log_fd >= 0) close(job.workers[i].log_fd);
        free(job.workers[i].out.pending);
        free(job.workers[i].err.pending);
        if (job.workers[i].out.fd >= 0) close(job.workers[i].out.fd);
        if (job.workers[i].err.fd >= 0) close(job.workers[i].err.fd);
    }
    free(job.workers);
    free(job.cpus);
    ddp_store_destroy(job.store);
    ddp_store_server_stop(job.server);
    finish_watchdog(code != 0);
    return code;
}
