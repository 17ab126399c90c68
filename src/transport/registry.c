/* The registry: maps a transport's name to its table of functions, from the one list in
 * src/core/transports.h.
 *
 * BUILTIN transports are referenced strongly (a weak reference would not pull their objects out
 * of the static library). A MODULE transport is linked in only when CMake built it into libddp
 * (DDP_HAVE_<NAME>); otherwise it is reported as DDP_ERR_UNSUPPORTED, so a build without it
 * still links. */
#include <stdio.h>
#include <string.h>

#include "core/internal.h"
#include "core/transports.h"
#include "transport/transport.h"

#define DECLARE_BUILTIN(name) extern const ddp__transport_ops_t ddp__transport_##name;
#define DECLARE_MODULE(name)
#define DECLARE(name, reach, help) DECLARE_##reach(name)
DDP_TRANSPORT_LIST(DECLARE)

#if defined(DDP_HAVE_MPI)
extern const ddp__transport_ops_t ddp__transport_mpi;
#endif

typedef struct entry {
    const char *name;
    const ddp__transport_ops_t *builtin; /* NULL for a module */
} entry_t;

#define ENTRY_BUILTIN(name) {#name, &ddp__transport_##name},
#define ENTRY_MODULE(name) {#name, NULL},
#define ENTRY(name, reach, help) ENTRY_##reach(name)
static const entry_t entries[] = {DDP_TRANSPORT_LIST(ENTRY)};
#define ENTRIES (sizeof entries / sizeof entries[0])

/* A module's table: linked in when this build has it. */
static const ddp__transport_ops_t *module_ops(const char *name, ddp_status_t *status)
{
#if defined(DDP_HAVE_MPI)
    if (strcmp(name, "mpi") == 0) {
        *status = DDP_OK;
        return &ddp__transport_mpi;
    }
#endif
    *status = ddp__error(DDP_ERR_UNSUPPORTED,
                         "transport '%s' is not built into this libddp%s", name,
                         strcmp(name, "mpi") == 0
                             ? " (it needs MPI at configure time and -DDDP_WITH_MPI=ON)"
                             : "");
    return NULL;
}

int ddp__transport_known(const char *name)
{
    if (strcmp(name, "auto") == 0) return 1;
    for (size_t i = 0; i < ENTRIES; i++)
        if (strcmp(entries[i].name, name) == 0) return 1;
    return 0;
}

const ddp__transport_ops_t *ddp__transport_find(const char *name, ddp_status_t *status)
{
    if (strcmp(name, "self") == 0) {
        *status = DDP_OK;
        return &ddp__transport_self;
    }
    for (size_t i = 0; i < ENTRIES; i++) {
        if (strcmp(entries[i].name, name) != 0) continue;
        if (entries[i].builtin) {
            *status = DDP_OK;
            return entries[i].builtin;
        }
        return module_ops(name, status);
    }
    char known[256] = "";
    size_t off = 0;
    for (size_t i = 0; i < ENTRIES && off < sizeof known; i++)
        off += (size_t)snprintf(known + off, sizeof known - off, "%s%s",
                                i == 0 ? "" : i + 1 == ENTRIES ? " or " : ", ", entries[i].name);
    *status = ddp__error(DDP_ERR_INVALID_ARGUMENT, "transport '%s' is unknown (expected auto, %s)",
                         name, known);
    return NULL;
}

const ddp__transport_ops_t *ddp__transport_storeless(ddp_status_t *status)
{
    char why[DDP_ERROR_TEXT_MAX] = "";
    for (size_t i = 0; i < ENTRIES; i++) {
        ddp_status_t s;
        const ddp__transport_ops_t *ops = ddp__transport_find(entries[i].name, &s);
        if (ops && ops->storeless) {
            ddp__clear_error();
            *status = DDP_OK;
            return ops;
        }
        /* Keep the first reason a transport could not be reached (a module not built or not
         * installed): it is the one to fix. */
        if (!ops && !why[0]) snprintf(why, sizeof why, "%s", ddp_last_error());
    }
    *status = ddp__error(DDP_ERR_UNSUPPORTED,
                         "no transport of this libddp can connect ranks without a store%s%s",
                         why[0] ? ": " : "", why);
    return NULL;
}
