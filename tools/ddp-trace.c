/* ddp-trace: tools for the Chrome traces libddp writes (ddp_trace_open, the trainer's --trace).
 * `ddp-trace merge OUT IN...` joins the per-rank files of one job into one JSON trace that
 * Perfetto (ui.perfetto.dev) or chrome://tracing loads, one process track per rank, named
 * "rank R" and sorted by rank, so a slow rank or a late bucket shows at a glance.
 *
 * The per-rank files hold complete events ("ph":"X") stamped with CLOCK_MONOTONIC microseconds
 * (ddp_time_us), one clock for every process of a machine: the merged timeline is exact on one
 * host. Across hosts the clocks differ by the hosts' boot times, so each host's ranks would need
 * shifting; merge does not guess. A rank killed mid-run leaves its file without the closing
 * bracket (and perhaps half an event): merge keeps its complete events and says so. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

static const char usage_text[] =
    "usage: ddp-trace merge OUT IN...\n"
    "       ddp-trace --version | --help\n"
    "\n"
    "merge: joins the Chrome traces IN... (one per rank: the trainer's --trace t.json writes\n"
    "t.rank0.json, t.rank1.json, ...) into OUT, one JSON trace Perfetto and chrome://tracing\n"
    "load, with one process track per rank (the pid each file's events carry, named \"rank R\").\n"
    "Timestamps are kept: ranks of one machine share the clock. A file cut short by a rank that\n"
    "died contributes its complete events, with a warning.\n"
    "\n"
    "exit status: 0 success, 1 an input or the output could not be used, 2 bad usage\n";

/* One input file's bytes. */
typedef struct input {
    const char *path;
    char *text;
    size_t len;
} input_t;

static int read_file(const char *path, input_t *in)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "ddp-trace: cannot open '%s': %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (len < cap) break;
        char *bigger = realloc(buf, cap * 2);
        if (!bigger) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = bigger;
        cap *= 2;
    }
    if (buf) buf[len] = '\0'; /* len < cap here: the text is a C string for strstr */
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        fprintf(stderr, "ddp-trace: cannot read '%s': %s\n", path,
                buf ? "read error" : "out of memory");
        free(buf);
        return -1;
    }
    in->path = path;
    in->text = buf;
    in->len = len;
    return 0;
}

static size_t skip_space(const char *s, size_t i, size_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++;
    return i;
}

/* The end (one past the closing brace) of the JSON object starting at s[i] == '{', or 0 when the
 * text ends first. Strings are skipped with their escapes, so braces inside names do not count. */
static size_t object_end(const char *s, size_t i, size_t n)
{
    int depth = 0, in_string = 0;
    for (; i < n; i++) {
        char c = s[i];
        if (in_string) {
            if (c == '\\') i++;
            else if (c == '"') in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (--depth == 0) return i + 1;
        }
    }
    return 0;
}

/* The value of "pid" in one event object, or -1. The writer puts it as "pid":N. */
static long event_pid(const char *obj, size_t len)
{
    static const char key[] = "\"pid\":";
    for (size_t i = 0; i + sizeof key - 1 < len; i++) {
        if (memcmp(obj + i, key, sizeof key - 1) == 0) {
            char *end;
            long v = strtol(obj + i + sizeof key - 1, &end, 10);
            return end == obj + i + sizeof key - 1 ? -1 : v;
        }
    }
    return -1;
}

typedef struct pids {
    long *v;
    size_t n, cap;
} pids_t;

static int note_pid(pids_t *p, long pid)
{
    for (size_t i = 0; i < p->n; i++)
        if (p->v[i] == pid) return 0;
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 16;
        long *v = realloc(p->v, cap * sizeof *v);
        if (!v) return -1;
        p->v = v;
        p->cap = cap;
    }
    p->v[p->n++] = pid;
    return 0;
}

/* Copies the events of one input into out; returns the number of events or -1. */
static long copy_events(const input_t *in, FILE *out, int *first, pids_t *pids)
{
    const char *s = in->text;
    size_t n = in->len, i = skip_space(s, 0, n);
    /* libddp writes the object form, {"traceEvents":[...],...}; the bare array is accepted too. */
    if (i < n && s[i] == '{') {
        const char *key = strstr(s, "\"traceEvents\"");
        i = key ? skip_space(s, (size_t)(key - s) + strlen("\"traceEvents\""), n) : n;
        if (i < n && s[i] == ':') i = skip_space(s, i + 1, n);
    }
    if (i >= n || s[i] != '[') {
        fprintf(stderr, "ddp-trace: '%s' is not a Chrome trace (a JSON array of events)\n",
                in->path);
        return -1;
    }
    i++;
    long events = 0;
    int closed = 0;
    for (;;) {
        i = skip_space(s, i, n);
        if (i < n && s[i] == ',') i = skip_space(s, i + 1, n);
        if (i >= n) break;
        if (s[i] == ']') {
            closed = 1;
            break;
        }
        if (s[i] != '{') {
            fprintf(stderr, "ddp-trace: '%s': unexpected '%c' at byte %zu (expected an event)\n",
                    in->path, s[i], i);
            return -1;
        }
        size_t end = object_end(s, i, n);
        if (end == 0) break; /* half an event: the writer died mid-line */
        long pid = event_pid(s + i, end - i);
        if (pid >= 0 && note_pid(pids, pid) != 0) {
            fprintf(stderr, "ddp-trace: out of memory\n");
            return -1;
        }
        fputs(*first ? "\n" : ",\n", out);
        fwrite(s + i, 1, end - i, out);
        *first = 0;
        events++;
        i = end;
    }
    if (!closed)
        fprintf(stderr,
                "ddp-trace: warning: '%s' ends without its closing ']' (its process died or is "
                "still writing); its %ld complete events are kept\n",
                in->path, events);
    return events;
}

static int merge(const char *out_path, int nin, char **in_paths)
{
    FILE *out = fopen(out_path, "w");
    if (!out) {
        fprintf(stderr, "ddp-trace: cannot write '%s': %s\n", out_path, strerror(errno));
        return 1;
    }
    int rc = 0, first = 1;
    pids_t pids = {0};
    long total = 0;
    fputs("{\"traceEvents\":[", out);
    for (int k = 0; k < nin && rc == 0; k++) {
        input_t in;
        if (read_file(in_paths[k], &in) != 0) {
            rc = 1;
            break;
        }
        long events = copy_events(&in, out, &first, &pids);
        free(in.text);
        if (events < 0) rc = 1;
        else total += events;
    }
    /* One named, ordered process track per rank. */
    for (size_t k = 0; k < pids.n && rc == 0; k++) {
        fprintf(out,
                "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%ld,\"args\":{\"name\":\"rank "
                "%ld\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%ld,\"args\":{"
                "\"sort_index\":%ld}}",
                first ? "\n" : ",\n", pids.v[k], pids.v[k], pids.v[k], pids.v[k]);
        first = 0;
    }
    fputs("\n],\"displayTimeUnit\":\"ms\"}\n", out);
    if (fclose(out) != 0 && rc == 0) {
        fprintf(stderr, "ddp-trace: writing '%s' failed: %s\n", out_path, strerror(errno));
        rc = 1;
    }
    if (rc == 0)
        printf("ddp-trace: merged %d file%s, %ld events, %zu rank%s into %s\n", nin,
               nin == 1 ? "" : "s", total, pids.n, pids.n == 1 ? "" : "s", out_path);
    else
        remove(out_path);
    free(pids.v);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        fputs(usage_text, stdout);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "--version")) {
        printf("ddp-trace (libddp) %s\n", ddp_version());
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "merge") != 0) {
        fprintf(stderr, "ddp-trace: %s\n%s", argc < 2 ? "no command" : "unknown command",
                usage_text);
        return 2;
    }
    if (argc < 4) {
        fprintf(stderr, "ddp-trace merge: needs OUT and at least one IN\n%s", usage_text);
        return 2;
    }
    for (int k = 3; k < argc; k++) {
        if (!strcmp(argv[k], argv[2])) {
            fprintf(stderr, "ddp-trace merge: OUT '%s' is also an input\n", argv[2]);
            return 2;
        }
    }
    return merge(argv[2], argc - 3, argv + 3);
}
