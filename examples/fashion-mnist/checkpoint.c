/* Checkpoints: everything needed to continue a run so that it ends bitwise identical to a run
 * that was never interrupted. Layout (native byte order, this machine's floats):
 *   "FMNISTCK" | u32 version | u32 header bytes | fm_hyper_t fields | fm_progress_t fields |
 *   u64 optimizer steps | u64 numel[6] | parameters |
 *   optimizer: state1 | [state2]   or, with libddp's optimizer, u64 bytes | its state blob |
 *   u64 hook ranks | per rank: u64 bytes | its PowerSGD state | u32 crc32
 * The permutation of an epoch is a function of (seed, epoch), so seed + progress is the RNG state.
 * Saving never leaves a torn file: temp file, fsync, rename, fsync of the directory. A save that is
 * killed leaves its temp file behind; the next save or load of the same checkpoint removes it. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "trainer.h"

#define MAGIC "FMNISTCK"
#define VERSION 3u /* 2: the comm hook joined the settings that must match; 3: libddp's
                      * optimizer state, schedules, clipping, bf16, PowerSGD state */
#define HYPER_FIELDS 19

typedef struct {
    unsigned char *data;
    size_t len, cap;
} buf_t;

static int put(buf_t *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        unsigned char *d = realloc(b->data, cap);
        if (!d) return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

static int put_u64(buf_t *b, uint64_t v) { return put(b, &v, sizeof v); }
static int put_f64(buf_t *b, double v) { return put(b, &v, sizeof v); }

static int put_hyper(buf_t *b, const fm_hyper_t *h)
{
    return put_u64(b, h->hidden) | put_u64(b, h->batch) | put_u64(b, h->accumulate) |
           put_u64(b, h->subset) | put_u64(b, h->seed) | put_u64(b, h->optim) |
           put_u64(b, h->hook) | put_f64(b, h->lr) | put_f64(b, h->momentum) | put_f64(b, h->weight_decay) |
           put_f64(b, h->beta1) | put_f64(b, h->beta2) | put_f64(b, h->eps) |
           put_u64(b, h->library_optim) | put_u64(b, h->lr_schedule) |
           put_u64(b, h->warmup_steps) | put_u64(b, h->schedule_steps) |
           put_f64(b, h->clip_grad) | put_u64(b, h->param_bf16);
}

void fm_extra_free(fm_extra_t *extra)
{
    if (!extra) return;
    free(extra->optim_state);
    for (uint64_t r = 0; r < extra->hook_ranks && extra->hook_state; r++)
        free(extra->hook_state[r]);
    free(extra->hook_state);
    free(extra->hook_state_bytes);
    memset(extra, 0, sizeof *extra);
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Removes PATH.tmp.<pid> files whose writer is gone: a save killed between creating its temp
 * file and renaming it. A writer holds an exclusive flock on its temp file while it writes, so a
 * temp file is removed only when (1) no process with its pid is alive here (a live one may be
 * writing; a pid reused by an unrelated process only keeps a stale file, never loses a live one)
 * and (2) nobody holds its lock - a writer on another host or in another container sharing the
 * directory has a pid that means nothing here, but its lock still does. Our own pid counts as
 * gone: this process writes no temp file now, so one with its pid is from a dead process whose pid
 * it inherited. Other files of the directory, other checkpoints' temps included, are left alone.
 * Failures are ignored: a stale temp file wastes space, it does not make a checkpoint wrong. */
static void remove_stale_temporaries(const char *path)
{
    char dir_buf[4096], base_buf[4096];
    snprintf(dir_buf, sizeof dir_buf, "%s", path);
    snprintf(base_buf, sizeof base_buf, "%s", path);
    const char *dir = dirname(dir_buf), *base = basename(base_buf);
    size_t base_len = strlen(base);
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *name = e->d_name;
        if (strncmp(name, base, base_len) != 0 || strncmp(name + base_len, ".tmp.", 5) != 0)
            continue;
        const char *digits = name + base_len + 5;
        if (*digits < '1' || *digits > '9') continue;
        char *end;
        errno = 0;
        long pid = strtol(digits, &end, 10);
        if (*end != '\0' || errno != 0 || pid <= 0 || (long)(pid_t)pid != pid) continue;
        if (pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno != ESRCH)) continue;
        char file[8192];
        snprintf(file, sizeof file, "%s/%s", dir, name);
        int fd = open(file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) unlink(file);
        close(fd);
    }
    closedir(d);
}

int fm_checkpoint_save(const char *path, const fm_hyper_t *hyper, const fm_progress_t *progress,
                       const fm_mlp_t *model, const fm_optim_t *opt, const fm_extra_t *extra,
                       char *err, size_t errlen)
{
    buf_t b = {0};
    int rc = -1, fd = -1;
    char tmp[4096];
    uint32_t version = VERSION,
             header = 8 + 4 + 4 + HYPER_FIELDS * 8 + 6 * 8 + 8 + FM_NPARAMS * 8;
    int bad = put(&b, MAGIC, 8) | put(&b, &version, 4) | put(&b, &header, 4) | put_hyper(&b, hyper);
    bad |= put_u64(&b, progress->epoch) | put_u64(&b, progress->step_in_epoch) |
           put_u64(&b, progress->global_step) | put_f64(&b, progress->loss_sum) |
           put_u64(&b, progress->loss_count) | put_f64(&b, progress->last_epoch_loss) |
           put_u64(&b, opt->steps);
    for (int k = 0; k < FM_NPARAMS; k++) bad |= put_u64(&b, model->numel[k]);
    for (int k = 0; k < FM_NPARAMS; k++)
        bad |= put(&b, model->params[k], model->numel[k] * sizeof(float));
    if (hyper->library_optim) {
        bad |= put_u64(&b, extra->optim_state_bytes) |
               put(&b, extra->optim_state, extra->optim_state_bytes);
    } else {
        for (int k = 0; k < FM_NPARAMS; k++)
            bad |= put(&b, opt->state1[k], model->numel[k] * sizeof(float));
        if (opt->kind == FM_OPTIM_ADAM)
            for (int k = 0; k < FM_NPARAMS; k++)
                bad |= put(&b, opt->state2[k], model->numel[k] * sizeof(float));
    }
    uint64_t hook_ranks = extra ? extra->hook_ranks : 0;
    bad |= put_u64(&b, hook_ranks);
    for (uint64_t r = 0; r < hook_ranks; r++)
        bad |= put_u64(&b, extra->hook_state_bytes[r]) |
               put(&b, extra->hook_state[r], extra->hook_state_bytes[r]);
    uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
    /* zlib's crc32 takes an unsigned length: feed it in pieces below 1 GiB. */
    for (size_t off = 0; off < b.len; off += 1u << 30) {
        size_t n = b.len - off < (1u << 30) ? b.len - off : (1u << 30);
        crc = (uint32_t)crc32(crc, b.data + off, (unsigned)n);
    }
    bad |= put(&b, &crc, 4);
    if (bad) {
        snprintf(err, errlen, "out of memory building checkpoint %s", path);
        goto out;
    }

    remove_stale_temporaries(path);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    /* Held until the file is renamed or we die: tells remove_stale_temporaries a writer is here. */
    if (flock(fd, LOCK_EX) != 0) {
        snprintf(err, errlen, "cannot lock %s: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    if (write_all(fd, b.data, b.len) || fsync(fd)) {
        snprintf(err, errlen, "cannot write %s: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    if (close(fd)) {
        fd = -1;
        snprintf(err, errlen, "cannot close %s: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    fd = -1;
    if (rename(tmp, path)) {
        snprintf(err, errlen, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        goto out_unlink;
    }
    /* The rename is durable only once the directory entry is. */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    rc = 0;
    goto out;
out_unlink:
    if (fd >= 0) close(fd);
    fd = -1;
    unlink(tmp);
out:
    if (fd >= 0) close(fd);
    free(b.data);
    return rc;
}

typedef struct {
    const unsigned char *p;
    size_t left;
} reader_t;

static int get(reader_t *r, void *out, size_t n)
{
    if (r->left < n) return -1;
    memcpy(out, r->p, n);
    r->p += n;
    r->left -= n;
    return 0;
}

static int check_u64(const char *path, const char *name, uint64_t saved, uint64_t now, char *err,
                     size_t errlen)
{
    if (saved == now) return 0;
    snprintf(err, errlen,
             "checkpoint %s was written with %s %llu but this run uses %s %llu; resume with the "
             "same setting",
             path, name, (unsigned long long)saved, name, (unsigned long long)now);
    return -1;
}

static int check_f64(const char *path, const char *name, double saved, double now, char *err,
                     size_t errlen)
{
    if (saved == now) return 0;
    snprintf(err, errlen,
             "checkpoint %s was written with %s %.17g but this run uses %s %.17g; resume with the "
             "same setting",
             path, name, saved, name, now);
    return -1;
}

/* Walks a length-prefixed blob at *pos (u64 bytes, then the bytes): its start, or -1 when the
 * file ends first. */
static int skip_blob(const unsigned char *data, size_t len, size_t *pos, size_t *start,
                     uint64_t *bytes)
{
    if (len - *pos < 8) return -1;
    memcpy(bytes, data + *pos, 8);
    *pos += 8;
    if (*bytes > len - *pos) return -1;
    *start = *pos;
    *pos += (size_t)*bytes;
    return 0;
}

static void *copy_of(const unsigned char *p, size_t n)
{
    void *c = malloc(n ? n : 1);
    if (c && n) memcpy(c, p, n);
    return c;
}

int fm_checkpoint_load(const char *path, const fm_hyper_t *hyper, fm_progress_t *progress,
                       fm_mlp_t *model, fm_optim_t *opt, fm_extra_t *extra, char *err,
                       size_t errlen)
{
    int rc = -1;
    unsigned char *data = NULL;
    remove_stale_temporaries(path);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open checkpoint %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) || st.st_size < 0) {
        snprintf(err, errlen, "cannot stat checkpoint %s: %s", path, strerror(errno));
        goto out;
    }
    size_t len = (size_t)st.st_size;
    data = malloc(len ? len : 1);
    if (!data) {
        snprintf(err, errlen, "out of memory reading checkpoint %s (%zu bytes)", path, len);
        goto out;
    }
    if (fread(data, 1, len, f) != len) {
        snprintf(err, errlen, "cannot read checkpoint %s: %s", path,
                 ferror(f) ? strerror(errno) : "short read");
        goto out;
    }
    if (len < 16 || memcmp(data, MAGIC, 8) != 0) {
        snprintf(err, errlen, "%s is not a fashion-mnist checkpoint (bad magic or %zu bytes)",
                 path, len);
        goto out;
    }
    uint32_t version, header;
    memcpy(&version, data + 8, 4);
    memcpy(&header, data + 12, 4);
    if (version != VERSION) {
        snprintf(err, errlen, "checkpoint %s has version %u, this trainer reads version %u", path,
                 version, VERSION);
        goto out;
    }
    if (len < (size_t)header + 4) {
        snprintf(err, errlen, "checkpoint %s is truncated (%zu bytes, header alone is %u)", path,
                 len, header);
        goto out;
    }
    /* Shapes first, so a checkpoint of another size says so rather than "bad checksum". */
    reader_t r = {data + 16, len - 16};
    fm_hyper_t h = {0};
    fm_progress_t pr = {0};
    uint64_t steps = 0, numel[FM_NPARAMS] = {0};
    int bad = get(&r, &h.hidden, 8) | get(&r, &h.batch, 8) | get(&r, &h.accumulate, 8) |
              get(&r, &h.subset, 8) | get(&r, &h.seed, 8) | get(&r, &h.optim, 8) |
              get(&r, &h.hook, 8) | get(&r, &h.lr, 8) | get(&r, &h.momentum, 8) | get(&r, &h.weight_decay, 8) |
              get(&r, &h.beta1, 8) | get(&r, &h.beta2, 8) | get(&r, &h.eps, 8) |
              get(&r, &h.library_optim, 8) | get(&r, &h.lr_schedule, 8) |
              get(&r, &h.warmup_steps, 8) | get(&r, &h.schedule_steps, 8) |
              get(&r, &h.clip_grad, 8) | get(&r, &h.param_bf16, 8);
    bad |= get(&r, &pr.epoch, 8) | get(&r, &pr.step_in_epoch, 8) | get(&r, &pr.global_step, 8) |
           get(&r, &pr.loss_sum, 8) | get(&r, &pr.loss_count, 8) | get(&r, &pr.last_epoch_loss, 8) |
           get(&r, &steps, 8);
    for (int k = 0; k < FM_NPARAMS; k++) bad |= get(&r, &numel[k], 8);
    if (bad) {
        snprintf(err, errlen, "checkpoint %s is truncated in its header", path);
        goto out;
    }
    if (check_u64(path, "--hidden", h.hidden, hyper->hidden, err, errlen) ||
        check_u64(path, "--optim (0 sgd, 1 adam, 2 adamw)", h.optim, hyper->optim, err,
                  errlen) ||
        check_u64(path, "--hook (0 allreduce, 1 fp16, 2 bf16, 3 powersgd)", h.hook, hyper->hook,
                  err, errlen) ||
        check_u64(path, "optimizer (0: the trainer's own; 1: libddp's, for --zero, --optim "
                  "adamw, --clip-grad or --param-dtype bf16)", h.library_optim,
                  hyper->library_optim, err, errlen) ||
        check_u64(path, "--lr-schedule (0 constant, 1 cosine, 2 linear)", h.lr_schedule,
                  hyper->lr_schedule, err, errlen) ||
        check_u64(path, "--warmup-steps", h.warmup_steps, hyper->warmup_steps, err, errlen) ||
        check_u64(path, "schedule length (--epochs x steps per epoch)", h.schedule_steps,
                  hyper->schedule_steps, err, errlen) ||
        check_f64(path, "--clip-grad", h.clip_grad, hyper->clip_grad, err, errlen) ||
        check_u64(path, "--param-dtype (0 f32, 1 bf16)", h.param_bf16, hyper->param_bf16, err,
                  errlen) ||
        check_u64(path, "--batch", h.batch, hyper->batch, err, errlen) ||
        check_u64(path, "--accumulate", h.accumulate, hyper->accumulate, err, errlen) ||
        check_u64(path, "--subset", h.subset, hyper->subset, err, errlen) ||
        check_u64(path, "--seed", h.seed, hyper->seed, err, errlen) ||
        check_f64(path, "--lr", h.lr, hyper->lr, err, errlen) ||
        check_f64(path, "--momentum", h.momentum, hyper->momentum, err, errlen) ||
        check_f64(path, "--wd", h.weight_decay, hyper->weight_decay, err, errlen) ||
        check_f64(path, "--beta1", h.beta1, hyper->beta1, err, errlen) ||
        check_f64(path, "--beta2", h.beta2, hyper->beta2, err, errlen) ||
        check_f64(path, "--eps", h.eps, hyper->eps, err, errlen))
        goto out;
    size_t body = 0;
    for (int k = 0; k < FM_NPARAMS; k++) {
        if (numel[k] != model->numel[k]) {
            snprintf(err, errlen, "checkpoint %s: parameter %s has %llu elements, the model %zu",
                     path, fm_param_names[k], (unsigned long long)numel[k], model->numel[k]);
            goto out;
        }
        body += numel[k] * sizeof(float) *
                (h.library_optim ? 1 : opt->kind == FM_OPTIM_ADAM ? 3 : 2);
    }
    /* The length-prefixed parts: walk them to learn the size, before trusting any content. */
    size_t pos = 16 + (len - 16 - r.left) + body, optim_at = 0, hook_at = 0;
    uint64_t optim_bytes = 0, hook_ranks = 0;
    int walk_bad = pos > len;
    if (!walk_bad && h.library_optim)
        walk_bad = skip_blob(data, len, &pos, &optim_at, &optim_bytes);
    if (!walk_bad && len - pos >= 8) {
        memcpy(&hook_ranks, data + pos, 8);
        pos += 8;
        hook_at = pos;
        for (uint64_t k = 0; k < hook_ranks && !walk_bad; k++) {
            size_t start;
            uint64_t bytes;
            walk_bad = skip_blob(data, len, &pos, &start, &bytes);
        }
    } else {
        walk_bad = 1;
    }
    size_t expect = walk_bad ? len + 1 : pos + 4;
    if (len != expect) {
        snprintf(err, errlen, "checkpoint %s is %s: %zu bytes, expected %zu", path,
                 len < expect ? "truncated" : "too long (corrupt)", len, expect);
        goto out;
    }
    uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0), saved;
    for (size_t off = 0; off < len - 4; off += 1u << 30) {
        size_t n = len - 4 - off < (1u << 30) ? len - 4 - off : (1u << 30);
        crc = (uint32_t)crc32(crc, data + off, (unsigned)n);
    }
    memcpy(&saved, data + len - 4, 4);
    if (crc != saved) {
        snprintf(err, errlen, "checkpoint %s is corrupt: checksum 0x%08x, stored 0x%08x", path,
                 crc, saved);
        goto out;
    }
    if ((h.library_optim || hook_ranks) && !extra) {
        snprintf(err, errlen, "checkpoint %s holds libddp optimizer or hook state this caller "
                 "cannot take", path);
        goto out;
    }
    fm_extra_t ex = {0};
    if (h.library_optim) {
        ex.optim_state = copy_of(data + optim_at, (size_t)optim_bytes);
        ex.optim_state_bytes = (size_t)optim_bytes;
        if (!ex.optim_state) goto no_memory;
    }
    if (hook_ranks) {
        ex.hook_state = calloc((size_t)hook_ranks, sizeof *ex.hook_state);
        ex.hook_state_bytes = calloc((size_t)hook_ranks, sizeof *ex.hook_state_bytes);
        ex.hook_ranks = hook_ranks;
        if (!ex.hook_state || !ex.hook_state_bytes) goto no_memory;
        size_t at = hook_at;
        for (uint64_t k = 0; k < hook_ranks; k++) {
            size_t start = 0;
            uint64_t bytes = 0;
            skip_blob(data, len, &at, &start, &bytes);
            ex.hook_state[k] = copy_of(data + start, (size_t)bytes);
            ex.hook_state_bytes[k] = (size_t)bytes;
            if (!ex.hook_state[k]) goto no_memory;
        }
    }
    for (int k = 0; k < FM_NPARAMS; k++) get(&r, model->params[k], numel[k] * sizeof(float));
    if (!h.library_optim) {
        for (int k = 0; k < FM_NPARAMS; k++) get(&r, opt->state1[k], numel[k] * sizeof(float));
        if (opt->kind == FM_OPTIM_ADAM)
            for (int k = 0; k < FM_NPARAMS; k++)
                get(&r, opt->state2[k], numel[k] * sizeof(float));
        opt->steps = steps;
    }
    if (extra) *extra = ex;
    *progress = pr;
    rc = 0;
    goto out;
no_memory:
    fm_extra_free(&ex);
    snprintf(err, errlen, "out of memory reading checkpoint %s", path);
out:
    free(data);
    fclose(f);
    return rc;
}
