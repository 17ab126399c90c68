/* File store: processes on one machine (or a shared filesystem with working fcntl locks) share an
 * append-only log of records in one file. Every operation takes an fcntl lock on the file (shared
 * to read, exclusive to append), reads the records appended since it last looked into a cached
 * table, and for writes appends one record. get/wait poll with a short exponential backoff. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/store_impl.h"

/* A record: 16-byte header (magic, op, key length, value length; little-endian u32 each), the key
 * bytes (no NUL), the value bytes. A delete record has no value. */
#define RECORD_MAGIC 0x53504444u /* "DDPS" */
#define RECORD_HEADER 16
enum { OP_SET = 1, OP_DELETE = 2 };

struct file_store {
    pthread_mutex_t mutex; /* threads sharing this handle share its fd and so its lock */
    int fd;
    pid_t pid;             /* the process that opened fd (see reopen_after_fork) */
    char *path;
    ddp__kv_table_t table; /* everything up to `parsed` */
    uint64_t parsed;       /* offset of the first record not yet applied */
};

static struct file_store *impl_of(ddp_store_t *store) { return store->impl; }

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Takes the file lock (F_RDLCK or F_WRLCK) on the whole file. Open-file-description locks, so two
 * handles in one process exclude each other too. Retries with backoff until the deadline; the lock
 * is only ever held for one short read or append. */
static ddp_status_t lock_file(struct file_store *fs, short type, int64_t deadline_ns)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
#ifdef F_OFD_SETLK
    const int cmd = F_OFD_SETLK;
#else
    const int cmd = F_SETLK;
#endif
    int64_t backoff_us = 10;
    for (;;) {
        if (fcntl(fs->fd, cmd, &fl) == 0) return DDP_OK;
        int err = errno;
        if (err != EAGAIN && err != EACCES && err != EINTR)
            return ddp__error_errno(DDP_ERR_SYSTEM, err, "file store %s: fcntl lock", fs->path);
        if (ddp__now_ns() >= deadline_ns)
            return ddp__error(DDP_ERR_TIMEOUT, "file store %s: timed out waiting for the file lock",
                              fs->path);
        ddp__sleep_us(backoff_us);
        if (backoff_us < 1000) backoff_us *= 2;
    }
}

static void unlock_file(struct file_store *fs)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
#ifdef F_OFD_SETLK
    (void)fcntl(fs->fd, F_OFD_SETLK, &fl);
#else
    (void)fcntl(fs->fd, F_SETLK, &fl);
#endif
}

static ddp_status_t read_exact(struct file_store *fs, uint8_t *buf, size_t len, uint64_t offset)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(fs->fd, buf + done, len - done, (off_t)(offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return ddp__error_errno(DDP_ERR_SYSTEM, errno, "file store %s: read at offset %llu",
                                    fs->path, (unsigned long long)(offset + done));
        }
        if (n == 0)
            return ddp__error(DDP_ERR_SYSTEM, "file store %s: file shrank while reading",
                              fs->path);
        done += (size_t)n;
    }
    return DDP_OK;
}

/* Applies the records appended since the last look. Call with the file lock held. When `writer`
 * (exclusive lock held) and the file ends with an incomplete record, that record was left by a
 * process that died while appending: it is cut off so the next append starts cleanly. */
static ddp_status_t refresh(struct file_store *fs, int writer)
{
    struct stat st;
    if (fstat(fs->fd, &st) != 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "file store %s: fstat", fs->path);
    uint64_t size = (uint64_t)st.st_size;
    if (size < fs->parsed) {
        /* Truncated behind our back (a torn tail cut by a writer, or the file was reset). */
        ddp__kv_free(&fs->table);
        fs->parsed = 0;
        if (ddp__kv_init(&fs->table) != DDP_OK) return DDP_ERR_NO_MEMORY;
    }
    if (size == fs->parsed) return DDP_OK;
    size_t tail = (size_t)(size - fs->parsed);
    uint8_t *buf = ddp__malloc(tail, "file store read buffer");
    if (!buf) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = read_exact(fs, buf, tail, fs->parsed);
    if (s != DDP_OK) goto free_buf;
    size_t pos = 0;
    while (tail - pos >= RECORD_HEADER) {
        const uint8_t *h = buf + pos;
        uint32_t magic = get_u32(h), op = get_u32(h + 4), klen = get_u32(h + 8),
                 vlen = get_u32(h + 12);
        if (magic != RECORD_MAGIC || (op != OP_SET && op != OP_DELETE) || klen > DDP_STORE_MAX_KEY ||
            vlen > DDP_STORE_MAX_VALUE || (op == OP_DELETE && vlen != 0)) {
            s = ddp__error(DDP_ERR_PROTOCOL,
                           "file store %s is corrupt at offset %llu (not a store record)",
                           fs->path, (unsigned long long)(fs->parsed + pos));
            goto free_buf;
        }
        size_t rec = RECORD_HEADER + (size_t)klen + (size_t)vlen;
        if (tail - pos < rec) break;
        char key[DDP_STORE_MAX_KEY + 1];
        memcpy(key, h + RECORD_HEADER, klen);
        key[klen] = 0;
        if (op == OP_SET) {
            s = ddp__kv_put(&fs->table, key, h + RECORD_HEADER + klen, vlen);
            if (s != DDP_OK) goto free_buf;
        } else {
            ddp__kv_remove(&fs->table, key);
        }
        pos += rec;
    }
    fs->parsed += pos;
    if (writer && pos < tail) {
        DDP_LOG(DDP_LOG_WARN, "file store %s: cutting a torn record of %zu bytes at offset %llu",
                fs->path, tail - pos, (unsigned long long)fs->parsed);
        if (ftruncate(fs->fd, (off_t)fs->parsed) != 0)
            s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "file store %s: truncate torn record",
                                 fs->path);
    }
free_buf:
    free(buf);
    return s;
}

/* Appends one record at the end (exclusive lock held, table refreshed) and applies it. */
static ddp_status_t append(struct file_store *fs, int op, const char *key, const void *value,
                           size_t len)
{
    size_t klen = strlen(key);
    size_t rec = RECORD_HEADER + klen + len;
    uint8_t *buf = ddp__malloc(rec, "file store record");
    if (!buf) return DDP_ERR_NO_MEMORY;
    put_u32(buf, RECORD_MAGIC);
    put_u32(buf + 4, (uint32_t)op);
    put_u32(buf + 8, (uint32_t)klen);
    put_u32(buf + 12, (uint32_t)len);
    memcpy(buf + RECORD_HEADER, key, klen);
    if (len) memcpy(buf + RECORD_HEADER + klen, value, len);
    size_t done = 0;
    ddp_status_t s = DDP_OK;
    while (done < rec) {
        ssize_t n = pwrite(fs->fd, buf + done, rec - done, (off_t)(fs->parsed + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            s = ddp__error_errno(DDP_ERR_SYSTEM, errno, "file store %s: append key '%s'",
                                 fs->path, key);
            /* Leave no torn record behind. */
            if (ftruncate(fs->fd, (off_t)fs->parsed) != 0) {
            }
            break;
        }
        done += (size_t)n;
    }
    free(buf);
    if (s != DDP_OK) return s;
    fs->parsed += rec;
    if (op == OP_SET) return ddp__kv_put(&fs->table, key, value, len);
    ddp__kv_remove(&fs->table, key);
    return DDP_OK;
}

/* A forked child shares its parent's open file description, and with it the parent's
 * open-file-description lock: the two would not exclude each other. So a handle used in a new
 * process first opens the file again for itself. The cached table stays valid. */
static ddp_status_t reopen_after_fork(struct file_store *fs)
{
    pid_t pid = getpid();
    if (fs->pid == pid) return DDP_OK;
    int fd = open(fs->path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return ddp__error_errno(DDP_ERR_SYSTEM, errno, "file store %s: reopen after fork",
                                fs->path);
    close(fs->fd); /* only this process's reference: the parent keeps its own */
    fs->fd = fd;
    fs->pid = pid;
    return DDP_OK;
}

/* Locks (mutex, then file), refreshes. On failure nothing stays locked. */
static ddp_status_t begin(ddp_store_t *store, int writer)
{
    struct file_store *fs = impl_of(store);
    pthread_mutex_lock(&fs->mutex);
    ddp_status_t s = reopen_after_fork(fs);
    if (s != DDP_OK) goto unlock_mutex;
    s = lock_file(fs, writer ? F_WRLCK : F_RDLCK,
                               ddp__deadline_precise_ns(atomic_load(&store->timeout_ms)));
    if (s != DDP_OK) goto unlock_mutex;
    s = refresh(fs, writer);
    if (s == DDP_OK) return DDP_OK;
    unlock_file(fs);
unlock_mutex:
    pthread_mutex_unlock(&fs->mutex);
    return s;
}

static void end(ddp_store_t *store)
{
    struct file_store *fs = impl_of(store);
    unlock_file(fs);
    pthread_mutex_unlock(&fs->mutex);
}

static ddp_status_t file_set(ddp_store_t *store, const char *key, const void *value, size_t len)
{
    ddp_status_t s = begin(store, 1);
    if (s != DDP_OK) return s;
    s = append(impl_of(store), OP_SET, key, value, len);
    end(store);
    return s;
}

/* Looks up keys under a shared lock; missing[i] = 1 for each missing one. Returns the number
 * missing, or a negative status. For a single key with `value` given, copies its value out. */
static int lookup(ddp_store_t *store, const char *const *keys, size_t nkeys,
                  unsigned char *missing, void **value, size_t *len, ddp_status_t *status)
{
    *status = begin(store, 0);
    if (*status != DDP_OK) return -1;
    struct file_store *fs = impl_of(store);
    int count = 0;
    for (size_t i = 0; i < nkeys; i++) {
        ddp__kv_entry_t *e = ddp__kv_find(&fs->table, keys[i]);
        if (missing) missing[i] = e == NULL;
        if (!e) {
            count++;
            continue;
        }
        if (value) {
            *value = ddp__store_copy_value(e->value, e->len);
            if (!*value) {
                *status = DDP_ERR_NO_MEMORY;
                count = -1;
                break;
            }
            *len = e->len;
        }
    }
    end(store);
    return count;
}

/* Polls until every key exists, backing off from 1 ms to 20 ms. */
static ddp_status_t poll_keys(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int timeout_ms, void **value, size_t *len)
{
    unsigned char *missing = ddp__calloc(nkeys, 1, "file store wait");
    if (!missing) return DDP_ERR_NO_MEMORY;
    int64_t deadline = ddp__deadline_precise_ns(timeout_ms);
    int64_t backoff_us = 1000;
    ddp_status_t s = DDP_OK;
    for (;;) {
        int n = lookup(store, keys, nkeys, missing, value, len, &s);
        if (n <= 0) break;
        int64_t now = ddp__now_ns();
        if (now >= deadline) {
            char list[DDP_ERROR_TEXT_MAX / 2];
            ddp__store_format_keys(list, sizeof list, keys, nkeys, missing);
            s = ddp__error(DDP_ERR_TIMEOUT,
                           "file store %s: timed out after %d ms waiting for %d missing key%s: %s",
                           impl_of(store)->path, timeout_ms, n, n == 1 ? "" : "s", list);
            break;
        }
        int64_t left_us = (deadline - now) / 1000;
        ddp__sleep_us(backoff_us < left_us ? backoff_us : left_us);
        if (backoff_us < 20000) backoff_us = backoff_us * 3 / 2;
    }
    free(missing);
    return s;
}

static ddp_status_t file_get(ddp_store_t *store, const char *key, int timeout_ms, void **value,
                             size_t *len)
{
    return poll_keys(store, &key, 1, timeout_ms, value, len);
}

static ddp_status_t file_wait(ddp_store_t *store, const char *const *keys, size_t nkeys,
                              int timeout_ms)
{
    return poll_keys(store, keys, nkeys, timeout_ms, NULL, NULL);
}

static ddp_status_t file_check(ddp_store_t *store, const char *const *keys, size_t nkeys,
                               int *all_exist)
{
    ddp_status_t s;
    int n = lookup(store, keys, nkeys, NULL, NULL, NULL, &s);
    if (n < 0) return s;
    *all_exist = n == 0;
    return DDP_OK;
}

static ddp_status_t file_add(ddp_store_t *store, const char *key, int64_t delta, int64_t *result)
{
    ddp_status_t s = begin(store, 1);
    if (s != DDP_OK) return s;
    struct file_store *fs = impl_of(store);
    ddp__kv_entry_t *e = ddp__kv_find(&fs->table, key);
    char text[32];
    size_t text_len = 0;
    s = ddp__store_add_text(key, e ? e->value : NULL, e ? e->len : 0, e != NULL, delta, text,
                            &text_len, result);
    if (s == DDP_OK) s = append(fs, OP_SET, key, text, text_len);
    end(store);
    return s;
}

static ddp_status_t file_compare_set(ddp_store_t *store, const char *key, const void *expected,
                                     size_t expected_len, const void *desired, size_t desired_len,
                                     void **current, size_t *current_len)
{
    ddp_status_t s = begin(store, 1);
    if (s != DDP_OK) return s;
    struct file_store *fs = impl_of(store);
    ddp__kv_entry_t *e = ddp__kv_find(&fs->table, key);
    if (ddp__store_cas_matches(e ? e->value : NULL, e ? e->len : 0, e != NULL, expected,
                               expected_len)) {
        s = append(fs, OP_SET, key, desired, desired_len);
        e = s == DDP_OK ? ddp__kv_find(&fs->table, key) : NULL;
    }
    if (s == DDP_OK) {
        *current = ddp__store_copy_value(e ? e->value : NULL, e ? e->len : 0);
        *current_len = e ? e->len : 0;
        if (!*current) s = DDP_ERR_NO_MEMORY;
    }
    end(store);
    return s;
}

static ddp_status_t file_remove(ddp_store_t *store, const char *key, int *deleted)
{
    ddp_status_t s = begin(store, 1);
    if (s != DDP_OK) return s;
    struct file_store *fs = impl_of(store);
    *deleted = ddp__kv_find(&fs->table, key) != NULL;
    if (*deleted) s = append(fs, OP_DELETE, key, NULL, 0);
    end(store);
    return s;
}

static ddp_status_t file_num_keys(ddp_store_t *store, int64_t *count)
{
    ddp_status_t s = begin(store, 0);
    if (s != DDP_OK) return s;
    *count = (int64_t)impl_of(store)->table.count;
    end(store);
    return DDP_OK;
}

static void file_destroy(ddp_store_t *store)
{
    struct file_store *fs = impl_of(store);
    if (!fs) return;
    close(fs->fd);
    ddp__kv_free(&fs->table);
    pthread_mutex_destroy(&fs->mutex);
    free(fs->path);
    free(fs);
}

static const ddp__store_ops_t file_ops = {
    .kind = "file",
    .set = file_set,
    .get = file_get,
    .add = file_add,
    .compare_set = file_compare_set,
    .check = file_check,
    .wait = file_wait,
    .remove = file_remove,
    .num_keys = file_num_keys,
    .destroy = file_destroy,
};

ddp_status_t ddp_store_file_create(const char *path, ddp_store_t **out)
{
    if (!path) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_file_create: path is NULL");
    if (!*path) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_file_create: path is empty");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "ddp_store_file_create: out is NULL");
    ddp__clear_error();
    int timeout_ms = 0;
    ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", &timeout_ms);
    if (s != DDP_OK) return ddp__error_context(s, "ddp_store_file_create");
    s = DDP_ERR_NO_MEMORY;
    struct file_store *fs = ddp__calloc(1, sizeof *fs, "file store");
    if (!fs) return s;
    fs->path = ddp__strdup(path, "file store path");
    if (!fs->path) goto free_fs;
    s = ddp__kv_init(&fs->table);
    if (s != DDP_OK) goto free_path;
    fs->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fs->fd < 0) {
        s = ddp__error_errno(errno == ENOENT ? DDP_ERR_NOT_FOUND : DDP_ERR_SYSTEM, errno,
                             "ddp_store_file_create: open %s", path);
        goto free_table;
    }
    fs->pid = getpid();
    pthread_mutex_init(&fs->mutex, NULL);
    ddp_store_t *store = ddp__store_new(&file_ops, fs, timeout_ms);
    if (!store) {
        s = DDP_ERR_NO_MEMORY;
        goto close_fd;
    }
    *out = store;
    return DDP_OK;
close_fd:
    pthread_mutex_destroy(&fs->mutex);
    close(fs->fd);
free_table:
    ddp__kv_free(&fs->table);
free_path:
    free(fs->path);
free_fs:
    free(fs);
    return s;
}
