/* Model verification at ddp_reducer_create (sync_at_create): every rank states whether it could
 * build its reducer, its counts and the config that must agree, then every parameter's signature
 * (name, shape, dtype, sparsity) is compared with rank 0's, so all ranks report the same
 * difference. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

#define SIG_NAME 48
typedef struct signature {
    char name[SIG_NAME]; /* truncated; the hash covers the whole name */
    uint64_t name_hash;
    uint64_t numel;
    uint64_t rows; /* matrix view rows (0: a vector): c10d compares sizes, not only numel */
    uint32_t dtype;
    uint32_t sparse;
    uint64_t grad_offset; /* block modes: byte offset in the gradient block; else UINT64_MAX */
} signature_t;

static uint64_t hash_name(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void describe(const signature_t *s, char *out, size_t cap)
{
    char shape[64];
    if (s->rows)
        snprintf(shape, sizeof shape, "shape %llu x %llu", (unsigned long long)s->rows,
                 (unsigned long long)(s->numel / s->rows));
    else
        snprintf(shape, sizeof shape, "shape %llu", (unsigned long long)s->numel);
    char where[64] = "";
    if (s->grad_offset != UINT64_MAX)
        snprintf(where, sizeof where, ", gradient at byte %llu of the block",
                 (unsigned long long)s->grad_offset);
    snprintf(out, cap, "'%.*s' (%s, %llu elements, %s, %s%s)", SIG_NAME, s->name,
             ddp_dtype_name((ddp_dtype_t)s->dtype), (unsigned long long)s->numel, shape,
             s->sparse ? "sparse" : "dense", where);
}

static int same_signature(const signature_t *a, const signature_t *b)
{
    return a->name_hash == b->name_hash && a->numel == b->numel && a->rows == b->rows &&
           a->dtype == b->dtype && a->sparse == b->sparse && a->grad_offset == b->grad_offset &&
           memcmp(a->name, b->name, SIG_NAME) == 0;
}

/* Every rank's header: (status, nparams, nbuffers, piece_bytes, bucket_layout, grad_memory,
 * join). */
#define HEADER_FIELDS 7

/* The headers every rank gathered: the first rank that failed to create its reducer (this rank's
 * own error text, local_text, when it is this one), then the fields every rank must share with
 * rank 0. Sets *maxn to the most parameters any rank has. */
static ddp_status_t check_headers(const int64_t *headers, int world, int rank,
                                  const char *local_text, size_t *maxn)
{
    for (int q = 0; q < world; q++) {
        if (headers[HEADER_FIELDS * q] != DDP_OK) {
            ddp_status_t s = (ddp_status_t)headers[HEADER_FIELDS * q];
            if (q == rank) {
                ddp__set_error_text(local_text);
                return s;
            }
            return ddp__error(DDP_ERR_REMOTE,
                              "rank %d failed to create its reducer (%s); see that rank's error",
                              q, ddp_status_string(s));
        }
        size_t nq = (size_t)headers[HEADER_FIELDS * q + 1];
        if (nq > *maxn) *maxn = nq;
    }
    /* Header fields every rank must share, each with the text that names it. */
    static const struct {
        int field;
        const char *text; /* rank 0's value, the other rank, its value */
    } same_everywhere[] = {
        {3, "reducer config mismatch: rank 0 has piece_bytes %lld but rank %d has %lld (pieces "
            "must be the same on every rank)"},
        {4, "reducer config mismatch: rank 0 has bucket_layout %lld but rank %d has %lld (the "
            "bucket layout must be the same on every rank)"},
        {5, "reducer config mismatch: rank 0 has grad_memory %lld but rank %d has %lld (where "
            "gradients live must be the same on every rank)"},
        {6, "reducer config mismatch: rank 0 has join %lld but rank %d has %lld (uneven inputs "
            "must be enabled on every rank or none)"},
        {2, "model mismatch: rank 0 registers %lld buffers but rank %d registers %lld"},
    };
    for (int q = 1; q < world; q++) {
        for (size_t k = 0; k < sizeof same_everywhere / sizeof same_everywhere[0]; k++) {
            int f = same_everywhere[k].field;
            if (headers[HEADER_FIELDS * q + f] == headers[f]) continue;
            long long a = headers[f], b = headers[HEADER_FIELDS * q + f];
            return ddp__error(DDP_ERR_MISMATCH, same_everywhere[k].text, a, q, b);
        }
    }
    return DDP_OK;
}

/* This rank's signature records, one per parameter, into `mine`. */
static void fill_signatures(const rparam_t *params, size_t nparams, int grad_memory,
                            unsigned char *mine)
{
    for (size_t i = 0; i < nparams; i++) {
        signature_t s;
        memset(&s, 0, sizeof s);
        memcpy(s.name, params[i].name, strnlen(params[i].name, SIG_NAME));
        s.name_hash = hash_name(params[i].name);
        s.numel = params[i].numel;
        s.rows = params[i].rows;
        s.dtype = (uint32_t)params[i].dtype;
        s.sparse = (uint32_t)params[i].sparse;
        int in_block = grad_memory == DDP_GRAD_MEMORY_USER_BLOCK && !params[i].sparse &&
                       params[i].numel > 0;
        s.grad_offset = in_block ? (uint64_t)params[i].block_offset : UINT64_MAX;
        memcpy(mine + i * sizeof s, &s, sizeof s);
    }
}

/* Every rank's signatures (maxn records each, in `all`) against rank 0's: the first parameter
 * where a rank differs, or has none where the other has one. */
static ddp_status_t compare_signatures(const unsigned char *all, const int64_t *headers,
                                       int world, size_t maxn)
{
    size_t rec = sizeof(signature_t);
    size_t n0 = (size_t)headers[1];
    for (size_t i = 0; i < maxn; i++) {
        for (int q = 1; q < world; q++) {
            size_t nq = (size_t)headers[HEADER_FIELDS * q + 1];
            if (i >= n0 && i >= nq) continue;
            signature_t a, b;
            memcpy(&a, all + i * rec, rec);
            memcpy(&b, all + ((size_t)q * maxn + i) * rec, rec);
            char da[200], db[200];
            describe(&a, da, sizeof da);
            describe(&b, db, sizeof db);
            if (i >= n0 || i >= nq)
                return ddp__error(
                    DDP_ERR_MISMATCH,
                    "model mismatch at parameter %zu: rank 0 registers %zu parameters, rank %d "
                    "registers %zu (rank %d has %s there)",
                    i, n0, q, nq, i >= n0 ? q : 0, i >= n0 ? db : da);
            if (!same_signature(&a, &b))
                return ddp__error(DDP_ERR_MISMATCH,
                                  "model mismatch at parameter %zu: rank 0 has %s but rank %d "
                                  "has %s",
                                  i, da, q, db);
        }
    }
    return DDP_OK;
}

/* Collective. Every rank states whether it could build its reducer and how many parameters and
 * buffers it has; then every rank's per-parameter signatures are gathered and compared with rank
 * 0's on every rank, so all ranks report the same first difference. */
ddp_status_t ddp__reducer_verify_model(ddp_group_t *group, ddp_status_t local,
                                       const rparam_t *params, size_t nparams, size_t nbuffers,
                                       size_t piece_bytes, int bucket_layout, int grad_memory,
                                       int join)
{
    int world = ddp_group_size(group), rank = ddp_group_rank(group);
    char local_text[DDP_ERROR_TEXT_MAX];
    snprintf(local_text, sizeof local_text, "%s", ddp_last_error());
    int64_t header[HEADER_FIELDS] = {local, (int64_t)nparams, (int64_t)nbuffers,
                                     (int64_t)piece_bytes, bucket_layout, grad_memory, join};
    int64_t *headers = ddp__malloc((size_t)world * sizeof header, "model verification");
    if (!headers) return DDP_ERR_NO_MEMORY;
    ddp_status_t status = ddp_group_allgather(group, header, headers, HEADER_FIELDS, DDP_I64);
    if (status != DDP_OK) {
        free(headers);
        return ddp__error_context(status, "verifying the model across ranks");
    }
    if (local != DDP_OK) {
        free(headers);
        ddp__set_error_text(local_text);
        return local;
    }
    size_t maxn = 0;
    status = check_headers(headers, world, rank, local_text, &maxn);
    if (status != DDP_OK) {
        free(headers);
        return status;
    }

    size_t rec = sizeof(signature_t);
    unsigned char *mine = ddp__calloc(maxn ? maxn : 1, rec, "model verification");
    unsigned char *all = ddp__calloc((size_t)world * (maxn ? maxn : 1), rec, "model verification");
    if (!mine || !all) {
        free(mine);
        free(all);
        free(headers);
        return DDP_ERR_NO_MEMORY;
    }
    fill_signatures(params, nparams, grad_memory, mine);
    status = ddp_group_allgather(group, mine, all, maxn * rec, DDP_U8);
    if (status != DDP_OK) ddp__error_context(status, "verifying the model across ranks");
    else status = compare_signatures(all, headers, world, maxn);
    free(mine);
    free(all);
    free(headers);
    return status;
}
