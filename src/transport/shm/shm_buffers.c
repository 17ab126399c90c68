/* Memory of the shared-memory transport: the memfds a segment lives in (rank 0 creates one,
 * the others open it through /proc), segment buffers (ddp_group_alloc_buffer: one memfd with a
 * region per rank, so that allreduces on them can go the zero-copy way), finding them, and
 * registering user memory (for registered memory and for single copy). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "transport/shm/shm_internal.h"

/* ---- memfds ------------------------------------------------------------------------------- */

/* Opens the memfd another rank published (d, parsed by shm_desc.c) and maps it. */
ddp_status_t ddp__shm_memfd_attach(const ddp__shm_desc_t *d, size_t expected_bytes, char **base,
                                   const char *what)
{
    if (d->total != (unsigned long long)expected_bytes)
        return ddp__error(DDP_ERR_MISMATCH, "shm: %s has %llu bytes but this rank expects %zu",
                          what, d->total, expected_bytes);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", d->pid, d->fd);
    int mfd = open(path, O_RDWR | O_CLOEXEC);
    if (mfd < 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "shm: opening %s (%s of rank 0)", path, what);
    struct stat st;
    if (fstat(mfd, &st) != 0 || (size_t)st.st_size != expected_bytes) {
        close(mfd);
        return ddp__error(DDP_ERR_PROTOCOL, "shm: %s at %s has the wrong size", what, path);
    }
    void *p = mmap(NULL, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    int err = errno;
    close(mfd);
    if (p == MAP_FAILED) return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: mapping %s", what);
    *base = p;
    return DDP_OK;
}

/* Rank 0: an anonymous shared file of `bytes` bytes, mapped; *fd stays open for the others. */
ddp_status_t ddp__shm_memfd_create(size_t bytes, const char *name, int *fd, char **base)
{
    int mfd = memfd_create(name, MFD_CLOEXEC);
    if (mfd < 0) return ddp__error_errno(DDP_ERR_SYSTEM, errno, "shm: memfd_create");
    if (ftruncate(mfd, (off_t)bytes) != 0) {
        int err = errno;
        close(mfd);
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: sizing the segment to %zu bytes", bytes);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        close(mfd);
        return ddp__error_errno(DDP_ERR_SYSTEM, err, "shm: mapping %zu bytes", bytes);
    }
    *fd = mfd;
    *base = p;
    return DDP_OK;
}

/* ---- segment buffers ---------------------------------------------------------------------- */

/* Rank 0's half of alloc_buffer: creates the buffer's memfd, publishes it under `key`, waits
 * until every rank has mapped it and compares the sizes they asked for, publishes the verdict
 * (which peers wait for, so that every rank fails alike) and drops the descriptor. */
static ddp_status_t publish_buffer(shm_state_t *S, shm_buffer_t *b, size_t bytes, const char *key)
{
    ddp_status_t s;
    s = ddp__shm_memfd_create(b->total, "ddp-shm-buffer", &b->fd, &b->base);
    if (s != DDP_OK) return s;
    char value[128];
    /* The 4th field, the size asked for, lets each peer compare its own (regions round up
     * to pages, so the totals alone would not tell 64 from 128 bytes). */
    snprintf(value, sizeof value, "%d %d %zu %zu", (int)getpid(), b->fd, b->total, bytes);
    s = ddp_store_set(S->store, key, value, strlen(value));
    if (s != DDP_OK) return s;
    /* Wait until every rank has mapped it, then drop the descriptor. */
    char **keys = calloc((size_t)S->world, sizeof *keys);
    char *keybuf = calloc((size_t)S->world, 720);
    if (!keys || !keybuf) {
        free(keys);
        free(keybuf);
        s = ddp__error(DDP_ERR_NO_MEMORY, "shm: alloc_buffer keys");
        return s;
    }
    int nk = 0;
    for (int r = 1; r < S->world; r++) {
        keys[nk] = keybuf + (size_t)nk * 720;
        snprintf(keys[nk], 720, "%s/attached/%d", key, r);
        nk++;
    }
    s = nk ? ddp_store_wait(S->store, (const char *const *)keys, (size_t)nk, S->timeout_ms)
           : DDP_OK;
    /* Each peer answered with the size it asked for: compare them all, then publish the
     * verdict, which peers asking for rank 0's size wait for (so every rank fails alike). */
    char verdict[256] = "ok";
    for (int i = 0; s == DDP_OK && i < nk; i++) {
        void *v = NULL;
        size_t len = 0;
        s = ddp_store_get(S->store, keys[i], &v, &len);
        if (s != DDP_OK) break;
        unsigned long long peer_bytes = 0;
        int parsed = ddp__shm_size_parse(v, len, &peer_bytes) == 0;
        ddp_free(v);
        if (parsed && peer_bytes != (unsigned long long)bytes && strcmp(verdict, "ok") == 0)
            snprintf(verdict, sizeof verdict,
                     "alloc_buffer %lld: rank 0 asked for %zu bytes but rank %d asked for "
                     "%llu bytes (every rank must ask for the same size in the same order)",
                     (long long)b->id, bytes, i + 1, peer_bytes);
    }
    free(keys);
    free(keybuf);
    if (s != DDP_OK) {
        ddp__error_context(s, "shm: alloc_buffer %lld waiting for every rank to attach",
                           (long long)b->id);
        return s;
    }
    char vkey[760];
    snprintf(vkey, sizeof vkey, "%s/verdict", key);
    s = ddp_store_set(S->store, vkey, verdict, strlen(verdict));
    if (s != DDP_OK) return s;
    if (strcmp(verdict, "ok") != 0) {
        s = ddp__error(DDP_ERR_MISMATCH, "%s", verdict);
        return s;
    }
    close(b->fd);
    b->fd = -1;
    return DDP_OK;
}

/* A peer's half of alloc_buffer: maps rank 0's buffer, answers with the size it asked for (also
 * when it differs, so rank 0 need not time out), then waits for rank 0's verdict. */
static ddp_status_t attach_buffer(shm_state_t *S, shm_buffer_t *b, size_t bytes, const char *key)
{
    ddp_status_t s;
    const char *keys[1] = {key};
    s = ddp_store_wait(S->store, keys, 1, S->timeout_ms);
    if (s != DDP_OK) {
        ddp__error_context(s, "shm: alloc_buffer %lld waiting for rank 0", (long long)b->id);
        return s;
    }
    void *v = NULL;
    size_t len = 0;
    s = ddp_store_get(S->store, key, &v, &len);
    if (s != DDP_OK) return s;
    ddp__shm_desc_t desc = {0};
    int parsed = ddp__shm_desc_parse(v, len, 4, &desc) == 0;
    int same = parsed && desc.asked == (unsigned long long)bytes;
    unsigned long long bytes0 = desc.asked;
    s = same ? ddp__shm_memfd_attach(&desc, b->total, &b->base, "the segment buffer") : DDP_OK;
    ddp_free(v);
    if (s != DDP_OK) {
        ddp__error_context(s, "alloc_buffer: every rank must ask for the same size in the same "
                              "order (rank %d asked for %zu bytes)",
                           S->rank, bytes);
        return s;
    }
    /* Answer with the size asked for, also when it differs, so rank 0 need not time out. */
    char akey[760], avalue[32];
    snprintf(akey, sizeof akey, "%s/attached/%d", key, S->rank);
    snprintf(avalue, sizeof avalue, "%zu", bytes);
    s = ddp_store_set(S->store, akey, avalue, strlen(avalue));
    if (s != DDP_OK) return s;
    if (!parsed) {
        s = ddp__error(DDP_ERR_PROTOCOL, "alloc_buffer %lld: malformed description of rank "
                       "0's buffer (\"pid fd total asked\" expected)", (long long)b->id);
        return s;
    }
    if (!same) {
        s = ddp__error(DDP_ERR_MISMATCH,
                       "alloc_buffer %lld: rank %d asked for %zu bytes but rank 0 asked for "
                       "%llu bytes (every rank must ask for the same size in the same order)",
                       (long long)b->id, S->rank, bytes, bytes0);
        return s;
    }
    /* Rank 0 compared every rank's size: another peer may differ although this one does
     * not. */
    char vkey[760];
    snprintf(vkey, sizeof vkey, "%s/verdict", key);
    const char *vkeys[1] = {vkey};
    s = ddp_store_wait(S->store, vkeys, 1, S->timeout_ms);
    if (s != DDP_OK) {
        ddp__error_context(s, "shm: alloc_buffer %lld waiting for rank 0's size check",
                           (long long)b->id);
        return s;
    }
    s = ddp_store_get(S->store, vkey, &v, &len);
    if (s != DDP_OK) return s;
    if (len != 2 || memcmp(v, "ok", 2) != 0) {
        s = ddp__error(DDP_ERR_MISMATCH, "%.*s", (int)len, (const char *)v);
        ddp_free(v);
        return s;
    }
    ddp_free(v);
    return DDP_OK;
}

ddp_status_t ddp__shm_alloc_buffer(void *state, size_t bytes, void **out)
{
    shm_state_t *S = state;
    shm_buffer_t *b = ddp__calloc(1, sizeof *b, "a segment buffer record");
    if (!b) return DDP_ERR_NO_MEMORY;
    b->fd = -1;
    b->region = round_up(bytes ? bytes : 1, PAGE);
    b->total = b->region * (size_t)S->world;
    b->id = S->next_buffer_id++;
    char key[700];
    snprintf(key, sizeof key, "%s/buffer/%lld", S->prefix, (long long)b->id);
    ddp_status_t s =
        S->rank == 0 ? publish_buffer(S, b, bytes, key) : attach_buffer(S, b, bytes, key);
    if (s != DDP_OK) goto fail;
    pthread_mutex_lock(&S->buffers_mu);
    b->next = S->buffers;
    S->buffers = b;
    pthread_mutex_unlock(&S->buffers_mu);
    *out = b->base + (size_t)S->rank * b->region;
    return DDP_OK;
fail:
    if (b->base) munmap(b->base, b->total);
    if (b->fd >= 0) close(b->fd);
    free(b);
    return s;
}


ddp_status_t ddp__shm_free_buffer(void *state, void *buffer)
{
    shm_state_t *S = state;
    pthread_mutex_lock(&S->buffers_mu);
    shm_buffer_t **link = &S->buffers;
    while (*link && (*link)->base + (size_t)S->rank * (*link)->region != (char *)buffer)
        link = &(*link)->next;
    shm_buffer_t *b = *link;
    if (b) *link = b->next;
    pthread_mutex_unlock(&S->buffers_mu);
    if (!b)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "free_buffer: %p was not returned by ddp_group_alloc_buffer on this group",
                          buffer);
    munmap(b->base, b->total);
    if (b->fd >= 0) close(b->fd);
    free(b);
    return DDP_OK;
}


void ddp__shm_advise_cold_results(void *state, void *buffer)
{
    size_t offset = 0;
    shm_buffer_t *b = ddp__shm_find_buffer(state, buffer, 1, &offset);
    if (b) atomic_store_explicit(&b->cold_results, 1, memory_order_relaxed);
}

/* Registration is the process's (shm_map.h): every shm group of the process may use it. With
 * DDP_SHM_MAP=off on this group's rank, memory is left alone. */
ddp_status_t ddp__shm_register_memory(void *state, void *ptr, size_t bytes)
{
    shm_state_t *S = state;
    if (!S->map_wanted) {
        DDP_LOG(DDP_LOG_INFO, "shm: DDP_SHM_MAP=off: %zu bytes at %p left unregistered", bytes,
                ptr);
        return DDP_OK;
    }
    return ddp__shm_map_register(ptr, bytes);
}

ddp_status_t ddp__shm_unregister_memory(void *state, void *ptr)
{
    shm_state_t *S = state;
    return S->map_wanted ? ddp__shm_map_unregister(ptr) : DDP_OK;
}

/* Unmaps and frees every segment buffer of this rank (the group is being destroyed). */
void ddp__shm_buffers_release(shm_state_t *S)
{
    shm_buffer_t *b = S->buffers;
    while (b) {
        shm_buffer_t *next = b->next;
        munmap(b->base, b->total);
        if (b->fd >= 0) close(b->fd);
        free(b);
        b = next;
    }
    S->buffers = NULL;
}

/* The segment buffer holding [p, p + bytes) in this rank's region, with its offset. */
shm_buffer_t *ddp__shm_find_buffer(shm_state_t *S, const void *p, size_t bytes, size_t *offset)
{
    shm_buffer_t *found = NULL;
    pthread_mutex_lock(&S->buffers_mu);
    for (shm_buffer_t *b = S->buffers; b; b = b->next) {
        const char *mine = b->base + (size_t)S->rank * b->region;
        if ((const char *)p >= mine && (const char *)p + bytes <= mine + b->region) {
            *offset = (size_t)((const char *)p - mine);
            found = b;
            break;
        }
    }
    pthread_mutex_unlock(&S->buffers_mu);
    return found;
}

/* Publishes where this rank's buffer is for a single-copy collective (peers read it after the
 * first phase, until the last) and registers it for huge pages (not segment buffers). */
void ddp__shm_cma_publish(shm_state_t *S, const void *buffer, size_t bytes)
{
    S->ranks[S->rank].cma_send = (uint64_t)(uintptr_t)buffer;
    size_t offset;
    if (bytes && !ddp__shm_find_buffer(S, buffer, bytes, &offset))
        S->untimed_ns += ddp__shm_cma_register(&S->cma, buffer, bytes);
}

