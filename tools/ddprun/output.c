/* The workers' output: each line a worker writes reaches ddprun's stdout or stderr in one write
 * with "[rank] " in front (lines of different ranks never mix), and with --log-dir the rank's
 * log file too. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ddprun.h"

/* Our stdout/stderr whose reader went away (`ddprun ... | head`), by descriptor. */
static int output_closed[3];

/* Writes everything, retrying on EINTR and on a non-blocking descriptor that is full. */
void write_all(int fd, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n > 0) {
            data += n;
            len -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && errno == EAGAIN) {
            struct pollfd p = {fd, POLLOUT, 0};
            poll(&p, 1, 100);
        } else {
            if (n < 0 && errno == EPIPE && fd >= 0 && fd < 3) output_closed[fd] = 1;
            return; /* the reader went away: drop the output */
        }
    }
}

/* Writes "[rank] <line>\n" in one write, so lines of different workers never mix; with
 * --log-dir, the line without the prefix goes to the rank's log file too. */
static void emit_line(const worker_t *w, stream_t *s)
{
    char prefix[32] = "";
    int plen = w->prefix ? snprintf(prefix, sizeof prefix, "[%d] ", w->rank) : 0;
    char *buf = malloc((size_t)plen + s->len + 1);
    if (buf) {
        memcpy(buf, prefix, (size_t)plen);
        memcpy(buf + plen, s->pending, s->len);
        buf[(size_t)plen + s->len] = '\n';
        write_all(s->target, buf, (size_t)plen + s->len + 1);
        if (w->log_fd >= 0) write_all(w->log_fd, buf + plen, s->len + 1);
        free(buf);
    }
    s->len = 0;
}

/* Adds bytes of the current line; a line longer than LINE_MAX_BYTES is split into several. */
static void stream_append(const worker_t *w, stream_t *s, const char *data, size_t len)
{
    while (len > 0) {
        if (s->len == LINE_MAX_BYTES) emit_line(w, s);
        size_t take = LINE_MAX_BYTES - s->len;
        if (take > len) take = len;
        memcpy(s->pending + s->len, data, take);
        s->len += take;
        data += take;
        len -= take;
    }
}

/* Reads what the worker wrote; emits every complete line with its rank in front. */
void stream_read(const worker_t *w, stream_t *s)
{
    if (output_closed[s->target]) {
        /* Nobody reads our side any more: close theirs too, so the worker gets SIGPIPE as it
         * would writing straight into the closed pipe. */
        close(s->fd);
        s->fd = -1;
        s->len = 0;
        return;
    }
    char chunk[16384];
    ssize_t n = read(s->fd, chunk, sizeof chunk);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) { /* EOF (or an error): flush a partial last line and stop watching */
        if (s->len > 0) emit_line(w, s);
        close(s->fd);
        s->fd = -1;
        return;
    }
    size_t start = 0;
    for (size_t k = 0; k < (size_t)n; k++) {
        if (chunk[k] != '\n') continue;
        stream_append(w, s, chunk + start, k - start);
        emit_line(w, s);
        start = k + 1;
    }
    stream_append(w, s, chunk + start, (size_t)n - start);
}

/* --log-dir: DIR (made if missing) and DIR/rank<R>.log for each local worker, truncated. */
int open_logs(job_t *job)
{
    const char *dir = job->opt.log_dir;
    if (!dir) {
        for (int i = 0; i < job->nworkers; i++) job->workers[i].log_fd = -1;
        return 0;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "ddprun: --log-dir: cannot create '%s': %s\n", dir, strerror(errno));
        return -1;
    }
    for (int i = 0; i < job->nworkers; i++) {
        worker_t *w = &job->workers[i];
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/rank%d.log", dir, w->rank);
        w->log_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0666);
        if (w->log_fd < 0) {
            fprintf(stderr, "ddprun: --log-dir: cannot open '%s': %s\n", path, strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* Whether any worker's output pipe is still open. */
int streams_open(const job_t *job)
{
    for (int i = 0; i < job->nworkers; i++) {
        if (job->workers[i].out.fd >= 0 || job->workers[i].err.fd >= 0) return 1;
    }
    return 0;
}
