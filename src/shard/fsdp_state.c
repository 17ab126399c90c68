/* FSDP checkpoints: each rank's blob of parameter runs and optimizer shard (loaded at the same
 * world size, or resharded from every blob of another), and the consolidated form (whole
 * parameters and ddp_optim's state format on one root). The object is fsdp.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/fsdp_internal.h"

/* ---- checkpoints ----------------------------------------------------------------------------
 * Sharded blob (native byte order):
 *   u64 magic "DDPFSDP1" | u32 version | u32 world | u32 rank | u32 dtype-free pad | u64 nparams |
 *   nparams x (u64 numel, u32 dtype, u32 unit, u64 first, u64 count) |
 *   each run's parameter values (count elements, padded to 8 bytes) |
 *   u64 optimizer bytes | the optimizer shard (ddp_optim's format) | u64 FNV-1a of all before. */
#define FSDP_MAGIC 0x3150445346504444ull /* "DDPFSDP1" read as little-endian */
#define FSDP_VERSION 1u
#define FSDP_HEADER 32u
#define FSDP_RECORD 32u


static size_t pad8(size_t n) { return (n + 7) & ~(size_t)7; }

static ddp__optim_view_t shard_view(const ddp_fsdp_t *f)
{
    return (ddp__optim_view_t){&f->setup, f->nparams, f->numel, f->dtype, f->runs,
                               (uint32_t)f->world, (uint32_t)f->rank};
}

static size_t values_bytes(const ddp_fsdp_t *f)
{
    size_t b = 0;
    for (size_t i = 0; i < f->nparams; i++)
        b += pad8(f->runs[i].count * ddp_dtype_size(f->dtype[i]));
    return b;
}

ddp_status_t ddp_fsdp_state_size(const ddp_fsdp_t *f, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp state size: fsdp is NULL");
    if (!bytes) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp state size: bytes is NULL");
    ddp__optim_view_t v = shard_view(f);
    *bytes = FSDP_HEADER + FSDP_RECORD * f->nparams + values_bytes(f) + 8 +
             ddp__optim_state_size(&v) + 8;
    return DDP_OK;
}

ddp_status_t ddp_fsdp_state_save(const ddp_fsdp_t *f, void *buf, size_t size)
{
    const char *who = "fsdp state save";
    ddp__clear_error(); /* status.h: no stale text after a success */
    size_t need;
    ddp_status_t s = ddp_fsdp_state_size(f, &need);
    if (s != DDP_OK) return s;
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    if (size < need)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: size is %zu bytes, the state needs %zu "
                          "(ddp_fsdp_state_size)", who, size, need);
    unsigned char *p = buf;
    memset(p, 0, need);
    uint64_t magic = FSDP_MAGIC, nparams = f->nparams;
    uint32_t head[4] = {FSDP_VERSION, (uint32_t)f->world, (uint32_t)f->rank, 0};
    memcpy(p, &magic, 8);
    memcpy(p + 8, head, 16);
    memcpy(p + 24, &nparams, 8);
    unsigned char *rec = p + FSDP_HEADER, *val = rec + FSDP_RECORD * f->nparams;
    for (size_t i = 0; i < f->nparams; i++, rec += FSDP_RECORD) {
        uint64_t numel = f->numel[i], first = f->runs[i].first, count = f->runs[i].count;
        uint32_t dt = (uint32_t)f->dtype[i], unit = (uint32_t)f->unit_of[i];
        memcpy(rec, &numel, 8);
        memcpy(rec + 8, &dt, 4);
        memcpy(rec + 12, &unit, 4);
        memcpy(rec + 16, &first, 8);
        memcpy(rec + 24, &count, 8);
        ddp__fsdp_unit_t *u = &f->units[f->unit_of[i]];
        size_t b = f->runs[i].count * u->es;
        if (b) memcpy(val, u->shard_data + f->shard_at[i] * u->es, b);
        val += pad8(b);
    }
    ddp__optim_view_t v = shard_view(f);
    uint64_t ob = ddp__optim_state_size(&v);
    memcpy(val, &ob, 8);
    s = ddp__optim_state_write(&v, val + 8, (size_t)ob, who);
    if (s != DDP_OK) return s;
    uint64_t sum = ddp__fnv1a(p, need - 8);
    memcpy(p + need - 8, &sum, 8);
    return DDP_OK;
}

/* A sharded blob checked against this object: its parameter records and where its values and
 * optimizer shard are. */
typedef struct parsed_blob {
    const unsigned char *records, *values, *optim;
    size_t optim_bytes;
    uint32_t world, rank;
} parsed_blob_t;

static void record_at(const parsed_blob_t *b, size_t i, uint64_t *first, uint64_t *count)
{
    memcpy(first, b->records + FSDP_RECORD * i + 16, 8);
    memcpy(count, b->records + FSDP_RECORD * i + 24, 8);
}

static ddp_status_t parse_blob(const ddp_fsdp_t *f, const void *buf, size_t size, size_t which,
                               parsed_blob_t *out, const char *who)
{
    const unsigned char *p = buf;
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu is NULL", who, which);
    if (size < FSDP_HEADER + 16)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu has %zu bytes, too few for an "
                          "FSDP state", who, which, size);
    uint64_t magic, nparams, sum;
    uint32_t head[4];
    memcpy(&magic, p, 8);
    memcpy(head, p + 8, 16);
    memcpy(&nparams, p + 24, 8);
    if (magic != FSDP_MAGIC)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu is not an FSDP state (bad "
                          "magic)", who, which);
    memcpy(&sum, p + size - 8, 8);
    if (ddp__fnv1a(p, size - 8) != sum)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu is corrupt or truncated "
                          "(checksum)", who, which);
    if (head[0] != FSDP_VERSION)
        return ddp__error(DDP_ERR_UNSUPPORTED, "%s: blob %zu has version %u, this libddp reads %u",
                          who, which, head[0], FSDP_VERSION);
    if (nparams != f->nparams)
        return ddp__error(DDP_ERR_MISMATCH, "%s: blob %zu has %llu parameters, this FSDP object "
                          "%zu", who, which, (unsigned long long)nparams, f->nparams);
    if ((size - FSDP_HEADER - 16) / FSDP_RECORD < f->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu is truncated in its records",
                          who, which);
    out->records = p + FSDP_HEADER;
    out->world = head[1];
    out->rank = head[2];
    size_t off = FSDP_HEADER + FSDP_RECORD * f->nparams;
    for (size_t i = 0; i < f->nparams; i++) {
        const unsigned char *r = out->records + FSDP_RECORD * i;
        uint64_t numel, first, count;
        uint32_t dt;
        memcpy(&numel, r, 8);
        memcpy(&dt, r + 8, 4);
        record_at(out, i, &first, &count);
        if (numel != f->numel[i] || dt != (uint32_t)f->dtype[i] || first > numel ||
            count > numel - first)
            return ddp__error(DDP_ERR_MISMATCH, "%s: blob %zu (rank %u of %u): parameter %zu "
                              "(%s) has numel %llu, dtype %s, run [%llu, +%llu); this object numel "
                              "%zu, dtype %s", who, which, out->rank, out->world, i,
                              ddp__fsdp_name(f, i),
                              (unsigned long long)numel, ddp_dtype_name((ddp_dtype_t)dt),
                              (unsigned long long)first, (unsigned long long)count, f->numel[i],
                              ddp_dtype_name(f->dtype[i]));
        size_t b = pad8((size_t)count * ddp_dtype_size(f->dtype[i]));
        if (b > size - 16 - off)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu is truncated in parameter "
                              "%zu's values", who, which, i);
        off += b;
    }
    out->values = p + FSDP_HEADER + FSDP_RECORD * f->nparams;
    uint64_t ob;
    memcpy(&ob, p + off, 8);
    if (ob != size - 16 - off)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: blob %zu has %zu bytes, its records "
                          "describe %llu", who, which, size, (unsigned long long)(off + 16 + ob));
    out->optim = p + off + 8;
    out->optim_bytes = (size_t)ob;
    return DDP_OK;
}

/* Loading replaces the shards: a gathered copy would be stale, gradients would belong to the
 * parameters before. */
static ddp_status_t check_idle(const ddp_fsdp_t *f, const char *who)
{
    for (size_t k = 0; k < f->nunits; k++) {
        if (f->units[k].state != DDP__FSDP_RELEASED)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s: unit %zu is gathered; release every "
                              "unit before loading", who, k);
        if (f->units[k].grad_full)
            return ddp__error(DDP_ERR_INVALID_USAGE, "%s: unit %zu holds gradients not reduced; "
                              "load between steps", who, k);
    }
    return DDP_OK;
}

/* The whole-parameter view (runs of numel elements, no arrays: only sizes are read). */
static ddp__optim_run_t *whole_runs(const ddp_fsdp_t *f)
{
    return ddp__optim_whole_runs(f->numel, f->nparams, "fsdp whole state");
}

ddp_status_t ddp_fsdp_state_load(ddp_fsdp_t *f, const void *const *blobs, const size_t *sizes,
                                 size_t nblobs)
{
    const char *who = "fsdp state load";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fsdp is NULL", who);
    if (nblobs == 0 || !blobs || !sizes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: no blobs (blobs %s, sizes %s, nblobs "
                          "%zu)", who, blobs ? "set" : "NULL", sizes ? "set" : "NULL", nblobs);
    ddp_status_t idle = check_idle(f, who);
    if (idle != DDP_OK) return idle;
    parsed_blob_t *pb = ddp__calloc(nblobs, sizeof *pb, "fsdp state load");
    if (!pb) return DDP_ERR_NO_MEMORY;
    ddp_status_t s = DDP_OK;
    unsigned char *merged = NULL;
    ddp__optim_run_t *wruns = NULL;
    for (size_t b = 0; b < nblobs && s == DDP_OK; b++)
        s = parse_blob(f, blobs[b], sizes[b], b, &pb[b], who);
    /* Every element this rank owns must come from exactly one blob. */
    for (size_t i = 0; i < f->nparams && s == DDP_OK; i++) {
        size_t lo = f->runs[i].first, hi = lo + f->runs[i].count, covered = 0;
        for (size_t b = 0; b < nblobs; b++) {
            uint64_t first, count;
            record_at(&pb[b], i, &first, &count);
            size_t a = first > lo ? (size_t)first : lo;
            size_t e = first + count < hi ? (size_t)(first + count) : hi;
            if (a < e) covered += e - a;
        }
        if (covered != hi - lo)
            s = ddp__error(DDP_ERR_MISMATCH, "%s: parameter %zu (%s): this rank owns elements "
                           "[%zu, %zu) but the blobs hold %zu of them%s", who, i,
                           ddp__fsdp_name(f, i), lo, hi, covered,
                           covered > hi - lo
                               ? " (blobs overlap)"
                               : "; pass this rank's own blob, or every blob of the saved run");
    }
    if (s != DDP_OK) goto out;
    /* The optimizer shard: one blob is read directly (it must cover this rank's runs); several
     * are merged into whole parameters first. */
    ddp__optim_view_t mine = shard_view(f);
    if (nblobs == 1) {
        s = ddp__optim_state_read(&mine, &f->setup, f->runs, pb[0].optim, pb[0].optim_bytes, who);
    } else {
        const void **ob = ddp__calloc(nblobs, sizeof *ob, "fsdp state load");
        size_t *os = ddp__calloc(nblobs, sizeof *os, "fsdp state load");
        wruns = whole_runs(f);
        ddp__optim_view_t whole = {&f->setup, f->nparams, f->numel, f->dtype, wruns, 1, 0};
        size_t wb = wruns ? ddp__optim_state_size(&whole) : 0;
        merged = wruns ? ddp__malloc(wb, "fsdp merged state") : NULL;
        if (!ob || !os || !merged) {
            s = DDP_ERR_NO_MEMORY;
        } else {
            for (size_t b = 0; b < nblobs; b++) {
                ob[b] = pb[b].optim;
                os[b] = pb[b].optim_bytes;
            }
            s = ddp__optim_state_merge(&whole, ob, os, nblobs, merged, wb, who);
            if (s == DDP_OK) s = ddp__optim_state_read(&mine, &f->setup, f->runs, merged, wb, who);
        }
        free(ob);
        free(os);
    }
    if (s != DDP_OK) goto out;
    /* Checked: the parameter values. */
    for (size_t b = 0; b < nblobs; b++) {
        const unsigned char *val = pb[b].values;
        for (size_t i = 0; i < f->nparams; i++) {
            uint64_t first, count;
            record_at(&pb[b], i, &first, &count);
            ddp__fsdp_unit_t *u = &f->units[f->unit_of[i]];
            size_t lo = f->runs[i].first, hi = lo + f->runs[i].count;
            size_t a = first > lo ? (size_t)first : lo;
            size_t e = first + count < hi ? (size_t)(first + count) : hi;
            if (a < e)
                memcpy(u->shard_data + (f->shard_at[i] + a - lo) * u->es,
                       val + (a - first) * u->es, (e - a) * u->es);
            val += pad8((size_t)count * u->es);
        }
    }
out:
    free(merged);
    free(wruns);
    free(pb);
    return s;
}

ddp_status_t ddp_fsdp_consolidated_optim_size(const ddp_fsdp_t *f, size_t *bytes)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp consolidated optim size: fsdp is "
                              "NULL");
    if (!bytes)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "fsdp consolidated optim size: bytes is "
                          "NULL");
    return ddp__optim_whole_state_size(&f->setup, f->nparams, f->numel, f->dtype, bytes);
}

ddp_status_t ddp_fsdp_consolidate(ddp_fsdp_t *f, int root, void *const *params, void *optim_buf,
                                  size_t optim_size)
{
    const char *who = "fsdp consolidate";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fsdp is NULL", who);
    if (root < 0 || root >= f->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: root is %d, expected 0..%d", who, root,
                          f->world - 1);
    /* A root without room still takes part in every collective, then fails alone. */
    ddp_status_t bad = DDP_OK;
    char text[DDP_ERROR_TEXT_MAX] = "";
    if (f->rank == root) {
        for (size_t i = 0; i < f->nparams && bad == DDP_OK; i++)
            if (f->numel[i] && (!params || !params[i])) {
                bad = DDP_ERR_INVALID_ARGUMENT;
                snprintf(text, sizeof text, "%s: root's params%s is NULL (parameter %zu, %s)",
                         who, params ? "[i]" : "", i, ddp__fsdp_name(f, i));
            }
    }
    for (size_t k = 0; k < f->nunits; k++) {
        ddp__fsdp_unit_t *u = &f->units[k];
        int was = u->state;
        ddp_status_t s = ddp__fsdp_gather_start(f, u, who);
        if (s == DDP_OK) s = ddp__fsdp_gather_finish(f, u, who);
        if (s != DDP_OK) return s;
        if (f->rank == root && bad == DDP_OK)
            for (size_t i = 0; i < f->nparams; i++)
                if (f->unit_of[i] == k && f->numel[i])
                    memcpy(params[i], u->full + f->offset[i] * u->es, f->numel[i] * u->es);
        if (was == DDP__FSDP_RELEASED) ddp__fsdp_drop_full(f, u);
    }
    ddp__optim_view_t mine = shard_view(f);
    ddp__optim_run_t *runs = whole_runs(f);
    if (!runs) return DDP_ERR_NO_MEMORY;
    ddp__optim_view_t whole = {&f->setup, f->nparams, f->numel, f->dtype, runs, 1, 0};
    ddp_status_t s = ddp__optim_state_consolidate(f->group, &mine, &whole, root,
                                                  f->rank == root ? optim_buf : NULL,
                                                  f->rank == root ? optim_size : 0, who,
                                                  "ddp_fsdp_consolidated_optim_size");
    free(runs);
    /* The root's own argument error first: it is what the caller must fix (the optimizer
     * buffer's check above may have failed only for the same reason). */
    if (bad != DDP_OK) return ddp__error(bad, "%s", text);
    return s;
}

ddp_status_t ddp_fsdp_load_consolidated(ddp_fsdp_t *f, const void *const *params,
                                        const void *optim_buf, size_t optim_size)
{
    const char *who = "fsdp load consolidated";
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!f) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: fsdp is NULL", who);
    ddp_status_t idle = check_idle(f, who);
    if (idle != DDP_OK) return idle;
    for (size_t i = 0; i < f->nparams; i++)
        if (f->numel[i] && (!params || !params[i]))
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: params%s is NULL (parameter %zu, "
                              "%s)", who, params ? "[i]" : "", i, ddp__fsdp_name(f, i));
    ddp_status_t s = DDP_OK;
    if (optim_buf) {
        ddp__optim_view_t mine = shard_view(f);
        s = ddp__optim_state_read(&mine, &f->setup, f->runs, optim_buf, optim_size, who);
        if (s != DDP_OK) return s;
    }
    for (size_t i = 0; i < f->nparams; i++) {
        ddp__optim_run_t *run = &f->runs[i];
        if (!run->count) continue;
        ddp__fsdp_unit_t *u = &f->units[f->unit_of[i]];
        unsigned char *dst = u->shard_data + f->shard_at[i] * u->es;
        memcpy(dst, (const unsigned char *)params[i] + run->first * u->es, run->count * u->es);
        /* Without an optimizer state the master copies follow the loaded values. */
        if (!optim_buf && run->master)
            for (size_t k = 0; k < run->count; k++) {
                uint16_t h;
                memcpy(&h, dst + 2 * k, 2);
                run->master[k] = f->dtype[i] == DDP_BF16 ? ddp_bf16_to_f32(h) : ddp_f16_to_f32(h);
            }
    }
    return DDP_OK;
}
