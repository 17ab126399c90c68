/* Status names and the thread-local last-error text behind ddp_last_error(). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

static _Thread_local char last_error[DDP_ERROR_TEXT_MAX];

#define DDP_STRINGIFY_(x) #x
#define DDP_STRINGIFY(x) DDP_STRINGIFY_(x)

const char *ddp_version(void)
{
    return DDP_STRINGIFY(DDP_VERSION_MAJOR) "." DDP_STRINGIFY(DDP_VERSION_MINOR) "." DDP_STRINGIFY(
        DDP_VERSION_PATCH);
}

const char *ddp_status_string(ddp_status_t status)
{
    switch (status) {
    case DDP_OK: return "DDP_OK";
    case DDP_ERR_INVALID_ARGUMENT: return "DDP_ERR_INVALID_ARGUMENT";
    case DDP_ERR_INVALID_USAGE: return "DDP_ERR_INVALID_USAGE";
    case DDP_ERR_TIMEOUT: return "DDP_ERR_TIMEOUT";
    case DDP_ERR_MISMATCH: return "DDP_ERR_MISMATCH";
    case DDP_ERR_REMOTE: return "DDP_ERR_REMOTE";
    case DDP_ERR_SYSTEM: return "DDP_ERR_SYSTEM";
    case DDP_ERR_NO_MEMORY: return "DDP_ERR_NO_MEMORY";
    case DDP_ERR_UNSUPPORTED: return "DDP_ERR_UNSUPPORTED";
    case DDP_ERR_NOT_FOUND: return "DDP_ERR_NOT_FOUND";
    case DDP_ERR_PROTOCOL: return "DDP_ERR_PROTOCOL";
    case DDP_ERR_ABORTED: return "DDP_ERR_ABORTED";
    }
    return "DDP_ERR_UNKNOWN";
}

const char *ddp_last_error(void) { return last_error; }

void ddp_free(void *ptr) { free(ptr); }

void ddp__clear_error(void) { last_error[0] = '\0'; }

void ddp__set_error_text(const char *text)
{
    snprintf(last_error, sizeof last_error, "%s", text ? text : "");
}

static ddp_status_t record(ddp_status_t status, int errnum, const char *fmt, va_list ap)
{
    char text[DDP_ERROR_TEXT_MAX];
    vsnprintf(text, sizeof text, fmt, ap);
    if (errnum != 0) {
        snprintf(last_error, sizeof last_error, "%s: %s", text, strerror(errnum));
    } else {
        memcpy(last_error, text, sizeof last_error);
    }
    DDP_LOG(DDP_LOG_DEBUG, "%s: %s", ddp_status_string(status), last_error);
    return status;
}

ddp_status_t ddp__error(ddp_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(status, 0, fmt, ap);
    va_end(ap);
    return status;
}

ddp_status_t ddp__error_errno(ddp_status_t status, int errnum, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(status, errnum, fmt, ap);
    va_end(ap);
    return status;
}

ddp_status_t ddp__error_context(ddp_status_t status, const char *fmt, ...)
{
    char prefix[DDP_ERROR_TEXT_MAX];
    char old[DDP_ERROR_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, last_error, sizeof old);
    snprintf(last_error, sizeof last_error, "%s: %s", prefix, old);
    return status;
}

void *ddp__malloc(size_t bytes, const char *what)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) ddp__error(DDP_ERR_NO_MEMORY, "out of memory allocating %zu bytes for %s", bytes, what);
    return p;
}

void *ddp__calloc(size_t n, size_t size, const char *what)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) ddp__error(DDP_ERR_NO_MEMORY, "out of memory allocating %zu x %zu bytes for %s", n, size, what);
    return p;
}

char *ddp__strdup(const char *s, const char *what)
{
    size_t n = strlen(s) + 1;
    char *p = ddp__malloc(n, what);
    if (p) memcpy(p, s, n);
    return p;
}
