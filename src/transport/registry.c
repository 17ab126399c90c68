/* The registry: maps a transport's name to its table of functions, from the one list in
 * src/core/transports.h.
 *
 * BUILTIN transports are referenced strongly (a weak reference would not pull their objects out
 * of the static library). A MODULE transport (mpi) is never linked into libddp: its table is
 * either registered by a program that linked the module statically (ddp_mpi_register ->
 * ddp__transport_register), or loaded at run time from libddp_<name>.so, looked for next to
 * libddp.so itself (found with dladdr; this also serves the build tree) and then in the
 * install libdir (DDP_INSTALL_LIBDIR, from CMake). A libddp linked statically into a program
 * never loads a module: the module links libddp.so, whose second copy of the core (a second
 * last-error slot, a second registry) would be silently wrong. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/transports.h"
#include "transport/transport.h"

#define DECLARE_BUILTIN(name) extern const ddp__transport_ops_t ddp__transport_##name;
#define DECLARE_MODULE(name)
#define DECLARE(name, reach, help) DECLARE_##reach(name)
DDP_TRANSPORT_LIST(DECLARE)

#ifndef DDP_INSTALL_LIBDIR
#define DDP_INSTALL_LIBDIR "/usr/local/lib"
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

/* Modules' tables once registered or loaded (never unloaded: MPI keeps atexit handlers and
 * threads). Guarded by modules_lock, since groups may be created from several threads. */
static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;
static const ddp__transport_ops_t *modules[ENTRIES];

static int entry_index(const char *name)
{
    for (size_t i = 0; i < ENTRIES; i++)
        if (strcmp(entries[i].name, name) == 0) return (int)i;
    return -1;
}

ddp_status_t ddp__transport_register(const ddp__transport_ops_t *ops)
{
    int i = ops && ops->name ? entry_index(ops->name) : -1;
    if (i < 0 || entries[i].builtin)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "ddp__transport_register: '%s' is not a module transport of this libddp",
                          ops && ops->name ? ops->name : "(null)");
    pthread_mutex_lock(&modules_lock);
    modules[i] = ops;
    pthread_mutex_unlock(&modules_lock);
    return DDP_OK;
}

/* What a missing module's user should install, by module. */
static const char *module_remedy(const char *name)
{
    if (strcmp(name, "mpi") == 0)
        return "install a libddp built with MPI (configured with Open MPI's development files "
               "and -DDDP_WITH_MPI=ON), which puts libddp_mpi.so beside libddp.so, and Open "
               "MPI's runtime (Debian/Ubuntu: apt-get install libopenmpi3)";
    return "install a libddp built with it";
}

/* Loads libddp_<name>.so and returns its table, recording why not on failure. Called with
 * modules_lock held. */
static const ddp__transport_ops_t *load_module(const char *name, ddp_status_t *status)
{
    char file[64], symbol[96];
    snprintf(file, sizeof file, "libddp_%s.so", name);
    snprintf(symbol, sizeof symbol, "ddp__transport_%s", name);

    /* Where this code lives: libddp.so, or a program or library that linked libddp.a. */
    Dl_info self;
    if (!dladdr((const void *)&ddp__transport_find, &self) || !self.dli_fname) {
        *status = ddp__error(DDP_ERR_UNSUPPORTED,
                             "transport '%s': cannot tell where libddp was loaded from (dladdr "
                             "failed), so its module %s cannot be found; %s",
                             name, file, module_remedy(name));
        return NULL;
    }
    const char *base = strrchr(self.dli_fname, '/');
    base = base ? base + 1 : self.dli_fname;
    if (strncmp(base, "libddp.so", 9) != 0) {
        *status = ddp__error(
            DDP_ERR_UNSUPPORTED,
            "transport '%s' is a module, and libddp is linked statically into %s, which never "
            "loads one: link libddp_%s.a as well (pkg-config --static --libs ddp-%s) and call "
            "ddp_%s_register() (ddp/%s.h) before creating a group",
            name, self.dli_fname, name, name, name, name);
        return NULL;
    }

    char dirs[2][1024];
    size_t dir_len = (size_t)(base - self.dli_fname);
    if (dir_len == 0)
        snprintf(dirs[0], sizeof dirs[0], ".");
    else
        snprintf(dirs[0], sizeof dirs[0], "%.*s", (int)(dir_len - 1), self.dli_fname);
    snprintf(dirs[1], sizeof dirs[1], "%s", DDP_INSTALL_LIBDIR);
    int ndirs = strcmp(dirs[0], dirs[1]) == 0 ? 1 : 2;

    char searched[2200] = "";
    size_t off = 0;
    for (int d = 0; d < ndirs; d++) {
        char path[1100];
        snprintf(path, sizeof path, "%s/%s", dirs[d], file);
        if (off < sizeof searched)
            off += (size_t)snprintf(searched + off, sizeof searched - off, "%s%s",
                                    d ? ", " : "", path);
        if (access(path, F_OK) != 0) continue;
        /* RTLD_GLOBAL: Open MPI loads components of its own that expect libmpi's symbols to be
         * global (as mpi4py does for the same reason). */
        void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
        if (!handle) {
            const char *why = dlerror();
            *status = ddp__error(DDP_ERR_UNSUPPORTED,
                                 "transport '%s': cannot load its module %s: %s; %s", name, path,
                                 why ? why : "unknown error", module_remedy(name));
            return NULL;
        }
        const ddp__transport_ops_t *ops = (const ddp__transport_ops_t *)dlsym(handle, symbol);
        if (!ops || !ops->name || strcmp(ops->name, name) != 0) {
            *status = ddp__error(DDP_ERR_UNSUPPORTED,
                                 "transport '%s': %s has no table %s (a module of another "
                                 "libddp?); %s",
                                 name, path, symbol, module_remedy(name));
            return NULL;
        }
        DDP_LOG(DDP_LOG_INFO, "transport '%s' loaded from %s", name, path);
        *status = DDP_OK;
        return ops;
    }
    *status = ddp__error(DDP_ERR_UNSUPPORTED,
                         "transport '%s' needs the module %s, which is not installed (searched "
                         "%s): %s",
                         name, file, searched, module_remedy(name));
    return NULL;
}

/* A module's table: registered, or loaded now. */
static const ddp__transport_ops_t *module_ops(int i, ddp_status_t *status)
{
    pthread_mutex_lock(&modules_lock);
    const ddp__transport_ops_t *ops = modules[i];
    if (ops)
        *status = DDP_OK;
    else
        ops = modules[i] = load_module(entries[i].name, status);
    pthread_mutex_unlock(&modules_lock);
    return ops;
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
        return module_ops((int)i, status);
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
