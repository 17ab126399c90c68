/* The optimizer's saved-state format, shared by the plain optimizer and ZeRO (whose shards
 * are blobs of the same format, and whose consolidation merges them into a whole one): writing,
 * parsing and checking against the reader's parameters, reading into runs, and merging. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "shard/shard_internal.h"

/* ---- the saved state --------------------------------------------------------------------------
 * Layout (native byte order):
 *   u64 magic "DDPOPTST" | u32 version | u32 kind | u32 state arrays | u32 amsgrad |
 *   u32 world | u32 rank | u64 nparams | u64 ngroups | f64 lr[ngroups] |
 *   nparams x (u64 numel, u32 dtype, u32 group, u64 first, u64 count, u64 steps) |
 *   per parameter: [f32 master[count] (f16/bf16)] then each state array [count] (f32; f64 for
 *   f64 parameters) | u64 FNV-1a of everything before. */
#define STATE_MAGIC 0x545354504f505444ull /* "DDPOPTST" read as little-endian */
#define STATE_VERSION 1u
#define STATE_HEADER 48u
#define STATE_RECORD 40u

typedef struct state_record {
    uint64_t numel;
    uint32_t dtype, group;
    uint64_t first, count, steps;
} state_record_t;


/* Bytes of one run's arrays in the blob. */
static size_t run_blob_bytes(int nstates, ddp_dtype_t dtype, uint64_t count)
{
    size_t b = (size_t)nstates * (size_t)count * ddp_dtype_size(ddp__optim_state_dtype(dtype));
    if (ddp__optim_is_half(dtype)) b += (size_t)count * sizeof(float);
    return b;
}

size_t ddp__optim_state_size(const ddp__optim_view_t *v)
{
    int k = ddp__optim_states_needed(&v->setup->base);
    size_t bytes = STATE_HEADER + 8 * v->setup->ngroups + STATE_RECORD * v->nparams + 8;
    for (size_t i = 0; i < v->nparams; i++)
        bytes += run_blob_bytes(k, v->dtype[i], v->runs[i].count);
    return bytes;
}

static unsigned char *put(unsigned char *p, const void *x, size_t n)
{
    if (n) memcpy(p, x, n);
    return p + n;
}

ddp_status_t ddp__optim_state_write(const ddp__optim_view_t *v, void *buf, size_t size,
                                    const char *who)
{
    size_t need = ddp__optim_state_size(v);
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    if (size < need)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: size is %zu bytes, the state needs %zu",
                          who, size, need);
    const ddp__optim_setup_t *st = v->setup;
    uint64_t magic = STATE_MAGIC, nparams = v->nparams, ngroups = st->ngroups;
    uint32_t head[6] = {STATE_VERSION, (uint32_t)st->base.kind,
                        (uint32_t)ddp__optim_states_needed(&st->base), (uint32_t)!!st->base.amsgrad,
                        v->world, v->rank};
    unsigned char *p = buf;
    p = put(p, &magic, 8);
    p = put(p, head, sizeof head);
    p = put(p, &nparams, 8);
    p = put(p, &ngroups, 8);
    for (size_t g = 0; g < st->ngroups; g++) p = put(p, &st->group[g].lr, 8);
    for (size_t i = 0; i < v->nparams; i++) {
        uint64_t rec[5] = {v->numel[i], 0, v->runs[i].first, v->runs[i].count, v->runs[i].steps};
        uint32_t dg[2] = {(uint32_t)v->dtype[i], st->param_group[i]};
        memcpy(&rec[1], dg, 8);
        p = put(p, rec, sizeof rec);
    }
    int k = ddp__optim_states_needed(&st->base);
    for (size_t i = 0; i < v->nparams; i++) {
        const ddp__optim_run_t *r = &v->runs[i];
        size_t bytes = r->count * ddp_dtype_size(ddp__optim_state_dtype(v->dtype[i]));
        if (ddp__optim_is_half(v->dtype[i])) p = put(p, r->master, r->count * sizeof(float));
        const void *arrays[3] = {r->m, r->v, r->vmax};
        for (int j = 0; j < k; j++) p = put(p, arrays[j], bytes);
    }
    uint64_t sum = ddp__fnv1a(buf, (size_t)(p - (unsigned char *)buf));
    put(p, &sum, 8);
    return DDP_OK;
}

/* A checked blob: its records and where each parameter's arrays start. */
typedef struct parsed {
    uint32_t kind, nstates, amsgrad, world, rank;
    uint64_t nparams, ngroups;
    const unsigned char *lrs;
    const unsigned char *records;
    size_t *data_offset; /* per parameter, malloc'd */
} parsed_t;

static void get_record(const parsed_t *ps, size_t i, state_record_t *r)
{
    const unsigned char *p = ps->records + STATE_RECORD * i;
    memcpy(&r->numel, p, 8);
    memcpy(&r->dtype, p + 8, 4);
    memcpy(&r->group, p + 12, 4);
    memcpy(&r->first, p + 16, 8);
    memcpy(&r->count, p + 24, 8);
    memcpy(&r->steps, p + 32, 8);
}

/* Checks the blob against the optimizer in `v` (kind, arrays, parameters, groups) and its own
 * consistency (sizes, checksum). */
static ddp_status_t parse_blob(const ddp__optim_view_t *v, const void *buf, size_t size,
                               parsed_t *ps, const char *who)
{
    memset(ps, 0, sizeof *ps);
    if (!buf) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: buf is NULL", who);
    const unsigned char *b = buf;
    uint64_t magic;
    uint32_t version;
    if (size < STATE_HEADER + 8)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: %zu bytes are too few for an optimizer "
                          "state (the header alone is %u)", who, size, STATE_HEADER + 8);
    memcpy(&magic, b, 8);
    if (magic != STATE_MAGIC)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: not an optimizer state (bad magic)",
                          who);
    memcpy(&version, b + 8, 4);
    if (version != STATE_VERSION)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: optimizer state version %u, this "
                          "library reads version %u", who, version, STATE_VERSION);
    memcpy(&ps->kind, b + 12, 4);
    memcpy(&ps->nstates, b + 16, 4);
    memcpy(&ps->amsgrad, b + 20, 4);
    memcpy(&ps->world, b + 24, 4);
    memcpy(&ps->rank, b + 28, 4);
    memcpy(&ps->nparams, b + 32, 8);
    memcpy(&ps->ngroups, b + 40, 8);
    uint64_t sum, stored;
    memcpy(&stored, b + size - 8, 8);
    sum = ddp__fnv1a(b, size - 8);
    if (sum != stored)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the optimizer state is corrupt or "
                          "truncated (checksum %016llx, stored %016llx, %zu bytes)", who,
                          (unsigned long long)sum, (unsigned long long)stored, size);
    const ddp__optim_setup_t *st = v->setup;
    if (ps->kind != (uint32_t)st->base.kind || ps->amsgrad != (uint32_t)!!st->base.amsgrad ||
        ps->nstates != (uint32_t)ddp__optim_states_needed(&st->base))
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state was saved by optimizer kind %u with "
                          "%u state arrays (amsgrad %u); this one is kind %d with %d (amsgrad "
                          "%d)", who, ps->kind, ps->nstates, ps->amsgrad, (int)st->base.kind,
                          ddp__optim_states_needed(&st->base), !!st->base.amsgrad);
    if (ps->nparams != v->nparams)
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state has %llu parameters, the optimizer "
                          "%zu", who, (unsigned long long)ps->nparams, v->nparams);
    if (ps->ngroups != st->ngroups)
        return ddp__error(DDP_ERR_MISMATCH, "%s: the state has %llu parameter groups, the "
                          "optimizer %zu", who, (unsigned long long)ps->ngroups, st->ngroups);
    size_t fixed = STATE_HEADER + 8 * (size_t)ps->ngroups;
    if (size - 8 < fixed || (size - 8 - fixed) / STATE_RECORD < v->nparams)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated in its "
                          "parameter records", who);
    ps->lrs = b + STATE_HEADER;
    ps->records = b + fixed;
    ps->data_offset = ddp__malloc((v->nparams ? v->nparams : 1) * sizeof *ps->data_offset,
                                  "optimizer state load");
    if (!ps->data_offset) return DDP_ERR_NO_MEMORY;
    size_t off = fixed + STATE_RECORD * v->nparams;
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(ps, i, &r);
        const char *what = NULL;
        if (r.numel != v->numel[i]) what = "numel";
        else if (r.dtype != (uint32_t)v->dtype[i]) what = "dtype";
        else if (r.group != st->param_group[i]) what = "group";
        else if (r.first > r.numel || r.count > r.numel - r.first) what = "run";
        if (what) {
            free(ps->data_offset);
            ps->data_offset = NULL;
            return ddp__error(DDP_ERR_MISMATCH, "%s: parameter %zu: the state has numel %llu, "
                              "dtype %s, group %u, run [%llu, +%llu); the optimizer numel %zu, "
                              "dtype %s, group %u (the %s differs)", who, i,
                              (unsigned long long)r.numel,
                              ddp_dtype_name((ddp_dtype_t)r.dtype), r.group,
                              (unsigned long long)r.first, (unsigned long long)r.count,
                              v->numel[i], ddp_dtype_name(v->dtype[i]),
                              (unsigned)st->param_group[i], what);
        }
        ps->data_offset[i] = off;
        size_t bytes = run_blob_bytes((int)ps->nstates, v->dtype[i], r.count);
        if (bytes > size - 8 - off) {
            free(ps->data_offset);
            ps->data_offset = NULL;
            return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state is truncated in "
                              "parameter %zu's arrays", who, i);
        }
        off += bytes;
    }
    if (off != size - 8) {
        free(ps->data_offset);
        ps->data_offset = NULL;
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: the state has %zu bytes, its records "
                          "describe %zu", who, size, off + 8);
    }
    return DDP_OK;
}

/* Copies elements [first, first + count) of parameter i's arrays from a parsed blob (whose run
 * covers them) into dst's arrays at element dst_at. */
static void copy_arrays(const parsed_t *ps, const unsigned char *blob, size_t i,
                        ddp_dtype_t dtype, size_t first, size_t count, ddp__optim_run_t *dst,
                        size_t dst_at)
{
    state_record_t r;
    get_record(ps, i, &r);
    size_t es = ddp_dtype_size(ddp__optim_state_dtype(dtype)), skip = first - (size_t)r.first;
    const unsigned char *src = blob + ps->data_offset[i];
    if (ddp__optim_is_half(dtype)) {
        memcpy(dst->master + dst_at, src + skip * sizeof(float), count * sizeof(float));
        src += r.count * sizeof(float);
    }
    void *arrays[3] = {dst->m, dst->v, dst->vmax};
    for (uint32_t j = 0; j < ps->nstates; j++) {
        memcpy((unsigned char *)arrays[j] + dst_at * es, src + skip * es, count * es);
        src += r.count * es;
    }
}

ddp_status_t ddp__optim_state_read(const ddp__optim_view_t *v, ddp__optim_setup_t *st,
                                   ddp__optim_run_t *runs, const void *buf, size_t size,
                                   const char *who)
{
    parsed_t ps;
    ddp_status_t s = parse_blob(v, buf, size, &ps, who);
    if (s != DDP_OK) return s;
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(&ps, i, &r);
        const ddp__optim_run_t *run = &runs[i];
        if (run->count && (run->first < r.first || run->first + run->count > r.first + r.count)) {
            free(ps.data_offset);
            return ddp__error(DDP_ERR_MISMATCH,
                              "%s: parameter %zu: this optimizer updates elements [%zu, %zu) but "
                              "the state (rank %u of %u) holds [%llu, %llu); load this rank's "
                              "own shard or a consolidated state",
                              who, i, run->first, run->first + run->count, ps.rank, ps.world,
                              (unsigned long long)r.first,
                              (unsigned long long)(r.first + r.count));
        }
    }
    /* Checked: now change things. */
    for (size_t i = 0; i < v->nparams; i++) {
        state_record_t r;
        get_record(&ps, i, &r);
        runs[i].steps = r.steps;
        if (runs[i].count)
            copy_arrays(&ps, buf, i, v->dtype[i], runs[i].first, runs[i].count, &runs[i], 0);
    }
    for (size_t g = 0; g < st->ngroups; g++) memcpy(&st->group[g].lr, ps.lrs + 8 * g, 8);
    free(ps.data_offset);
    return DDP_OK;
}

ddp_status_t ddp__optim_state_merge(const ddp__optim_view_t *whole, const void *const *blobs,
                                    const size_t *sizes, size_t nblobs, void *out, size_t size,
                                    const char *who)
{
    /* The whole view's runs describe the result (first 0, count numel); their arrays are
     * allocated here, filled from the shards, and written out. */
    size_t n = whole->nparams;
    ddp__optim_run_t *runs = ddp__calloc(n ? n : 1, sizeof *runs, "optimizer state merge");
    parsed_t *ps = ddp__calloc(nblobs ? nblobs : 1, sizeof *ps, "optimizer state merge");
    ddp_status_t s = DDP_OK;
    size_t parsed = 0;
    if (!runs || !ps) {
        s = DDP_ERR_NO_MEMORY;
        goto out;
    }
    for (; parsed < nblobs; parsed++) {
        s = parse_blob(whole, blobs[parsed], sizes[parsed], &ps[parsed], who);
        if (s != DDP_OK) goto out;
    }
    for (size_t i = 0; i < n && s == DDP_OK; i++) {
        runs[i].count = whole->numel[i];
        s = ddp__optim_run_alloc(&runs[i], &whole->setup->base, whole->dtype[i], NULL);
        if (s != DDP_OK) break;
        /* A half parameter's master was not initialised from data: every element must come
         * from some shard, which the coverage check below makes sure of. */
        size_t covered = 0;
        for (size_t b = 0; b < nblobs; b++) {
            state_record_t r;
            get_record(&ps[b], i, &r);
            /* Shards of one partition are disjoint; overlapping ones would count twice. */
            for (size_t c = 0; c < b && r.count; c++) {
                state_record_t o;
                get_record(&ps[c], i, &o);
                if (o.count && r.first < o.first + o.count && o.first < r.first + r.count) {
                    s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: parameter %zu: shards %zu and "
                                   "%zu both hold elements of [%llu, %llu)", who, i, c, b,
                                   (unsigned long long)r.first,
                                   (unsigned long long)(r.first + r.count));
                    goto out;
                }
            }
            if (r.steps > runs[i].steps) runs[i].steps = r.steps;
            if (r.count == 0) continue;
            copy_arrays(&ps[b], blobs[b], i, whole->dtype[i], (size_t)r.first, (size_t)r.count,
                        &runs[i], (size_t)r.first);
            covered += (size_t)r.count;
        }
        if (covered != whole->numel[i])
            s = ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: parameter %zu: the shards hold %zu of "
                           "its %zu elements", who, i, covered, whole->numel[i]);
    }
    if (s == DDP_OK) {
        ddp__optim_view_t v = *whole;
        v.runs = runs;
        s = ddp__optim_state_write(&v, out, size, who);
    }
out:
    for (size_t b = 0; b < parsed && ps; b++) free(ps[b].data_offset);
    if (runs)
        for (size_t i = 0; i < n; i++) ddp__optim_run_free(&runs[i]);
    free(runs);
    free(ps);
    return s;
}

ddp__optim_run_t *ddp__optim_whole_runs(const size_t *numel, size_t nparams, const char *what)
{
    ddp__optim_run_t *runs = ddp__calloc(nparams ? nparams : 1, sizeof *runs, what);
    if (runs)
        for (size_t i = 0; i < nparams; i++) runs[i].count = numel[i];
    return runs;
}

ddp_status_t ddp__optim_whole_state_size(const ddp__optim_setup_t *setup, size_t nparams,
                                         const size_t *numel, const ddp_dtype_t *dtype,
                                         size_t *bytes)
{
    ddp__optim_run_t *runs = ddp__optim_whole_runs(numel, nparams, "consolidated state");
    if (!runs) return DDP_ERR_NO_MEMORY;
    ddp__optim_view_t v = {setup, nparams, numel, dtype, runs, 1, 0};
    *bytes = ddp__optim_state_size(&v);
    free(runs);
    return DDP_OK;
}
