/* Chrome trace writer: a JSON array of complete events ("ph":"X"), one per span. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"

struct ddp_trace {
    FILE *file;
    int pid;
    int first;
    pthread_mutex_t lock;
};

ddp_status_t ddp_trace_open(const char *path, int pid, ddp_trace_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!path) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "path is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "out is NULL");
    ddp_trace_t *t = ddp__calloc(1, sizeof *t, "trace");
    if (!t) return DDP_ERR_NO_MEMORY;
    t->file = fopen(path, "w");
    if (!t->file) {
        free(t);
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "cannot open trace file '%s'", path);
    }
    t->pid = pid;
    t->first = 1;
    pthread_mutex_init(&t->lock, NULL);
    fputs("{\"traceEvents\":[\n", t->file);
    *out = t;
    return DDP_OK;
}

static void write_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* Opens the next event of the file, up to its name and category (default "ddp"); the caller
 * holds trace->lock and writes the rest of the event. */
static void begin_event(ddp_trace_t *trace, const char *name, const char *category)
{
    if (!trace->first) fputs(",\n", trace->file);
    trace->first = 0;
    fputs("{\"name\":", trace->file);
    write_string(trace->file, name);
    fputs(",\"cat\":", trace->file);
    write_string(trace->file, category ? category : "ddp");
}

ddp_status_t ddp_trace_span(ddp_trace_t *trace, const char *name, const char *category, int tid,
                            double start_us, double end_us)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!trace) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "trace is NULL");
    if (!name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "name is NULL");
    /* "nan" or "inf" would make the whole file invalid JSON. */
    if (!isfinite(start_us))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "start_us is %g, not a finite time", start_us);
    if (!isfinite(end_us))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "end_us is %g, not a finite time", end_us);
    if (end_us < start_us) end_us = start_us;
    pthread_mutex_lock(&trace->lock);
    begin_event(trace, name, category);
    fprintf(trace->file, ",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}",
            trace->pid, tid, start_us, end_us - start_us);
    pthread_mutex_unlock(&trace->lock);
    return DDP_OK;
}

ddp_status_t ddp_trace_instant(ddp_trace_t *trace, const char *name, const char *category,
                               int tid, double ts_us, const char *const *args, int nargs)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!trace) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "trace is NULL");
    if (!name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "name is NULL");
    if (!isfinite(ts_us))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ts_us is %g, not a finite time", ts_us);
    if (nargs < 0 || (nargs > 0 && !args))
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "nargs is %d with args %s", nargs,
                          args ? "given" : "NULL");
    for (int i = 0; i < 2 * nargs; i++)
        if (!args[i])
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "args[%d] (the %s of argument %d) is NULL",
                              i, i % 2 ? "value" : "key", i / 2);
    pthread_mutex_lock(&trace->lock);
    begin_event(trace, name, category);
    fprintf(trace->file, ",\"ph\":\"i\",\"s\":\"p\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", trace->pid,
            tid, ts_us);
    if (nargs > 0) {
        fputs(",\"args\":{", trace->file);
        for (int i = 0; i < nargs; i++) {
            if (i) fputc(',', trace->file);
            write_string(trace->file, args[2 * i]);
            fputc(':', trace->file);
            write_string(trace->file, args[2 * i + 1]);
        }
        fputc('}', trace->file);
    }
    fputc('}', trace->file);
    pthread_mutex_unlock(&trace->lock);
    return DDP_OK;
}

ddp_status_t ddp_trace_name_lane(ddp_trace_t *trace, int tid, const char *name)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!trace) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "trace is NULL");
    if (!name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "name is NULL");
    pthread_mutex_lock(&trace->lock);
    if (!trace->first) fputs(",\n", trace->file);
    trace->first = 0;
    fprintf(trace->file, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":",
            trace->pid, tid);
    write_string(trace->file, name);
    fputs("}}", trace->file);
    pthread_mutex_unlock(&trace->lock);
    return DDP_OK;
}

ddp_status_t ddp_trace_close(ddp_trace_t *trace)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!trace) return DDP_OK;
    fputs("\n],\"displayTimeUnit\":\"ms\"}\n", trace->file);
    int bad = ferror(trace->file);
    int rc = fclose(trace->file);
    pthread_mutex_destroy(&trace->lock);
    free(trace);
    if (bad || rc != 0) return ddp__error(DDP_ERR_SYSTEM, "writing the trace file failed");
    return DDP_OK;
}
