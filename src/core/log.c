/* The log: one line per message to stderr, only when DDP_LOG_LEVEL asks for it (the library
 * never prints otherwise). Every layer logs through DDP_LOG (core/internal.h). */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

int ddp__log_level(void)
{
    static _Atomic int cached = -1;
    int level = cached;
    if (level >= 0) return level;
    const char *v = getenv("DDP_LOG_LEVEL");
    level = DDP_LOG_NONE;
    if (v) {
        if (!strcmp(v, "error")) level = DDP_LOG_ERROR;
        else if (!strcmp(v, "warn")) level = DDP_LOG_WARN;
        else if (!strcmp(v, "info")) level = DDP_LOG_INFO;
        else if (!strcmp(v, "debug")) level = DDP_LOG_DEBUG;
    }
    cached = level;
    return level;
}

void ddp__log(int level, const char *fmt, ...)
{
    static const char *const names[] = {"", "error", "warn", "info", "debug"};
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[libddp %s] %s\n", names[level < 0 || level > 4 ? 0 : level], line);
}
