/* The variable-count collectives (collectives.h): allgatherv, reduce_scatterv and alltoallv.
 * Unequal counts are padded to the largest block so that one allgather or reduce_scatter of
 * the transports moves them; alltoallv's count matrix is checked whole on every rank. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

/* The per-rank counts of a variable-count collective: sets *max to the largest, and says whether
 * every rank's count is rank 0's (with at_even_displs, also at displacement r * count: the plain
 * collective's layout), so that the plain collective can move them unpadded. */
static int uniform_counts(const coll_args_t *a, int world, int at_even_displs, size_t *max)
{
    int uniform = 1;
    for (int r = 0; r < world; r++) {
        if (a->counts[r] > *max) *max = a->counts[r];
        if (a->counts[r] != a->counts[0]) uniform = 0;
        if (at_even_displs && a->displs[r] != (size_t)r * a->counts[0]) uniform = 0;
    }
    return uniform;
}

ddp_status_t ddp__coll_run_allgatherv(ddp_group_t *g, const coll_args_t *a,
                                      const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(a->dtype);
    size_t max = 0;
    if (uniform_counts(a, world, 1, &max))
        return ddp_group_allgather(g, a->send, a->recv, a->counts[0], a->dtype);
    /* Unequal counts: every block padded to the largest, one allgather, then unpacked. */
    ddp_status_t s = DDP_ERR_NO_MEMORY;
    void *tmp = ddp__scratch(max, es, 1);
    void *tmp2 = tmp ? ddp__scratch(max, es, (size_t)world) : NULL;
    if (tmp && tmp2) {
        memset(tmp, 0, max * es);
        if (a->counts[rank]) memcpy(tmp, a->send, a->counts[rank] * es);
        s = ddp_group_allgather(g, tmp, tmp2, max, a->dtype);
        if (s == DDP_OK)
            for (int r = 0; r < world; r++)
                if (a->counts[r])
                    memmove((char *)a->recv + a->displs[r] * es,
                            (char *)tmp2 + (size_t)r * max * es, a->counts[r] * es);
    }
    free(tmp);
    free(tmp2);
    return s;
}

ddp_status_t ddp__coll_run_reduce_scatterv(ddp_group_t *g, const coll_args_t *a,
                                           const coll_header_t *h)
{
    TRY(ddp__coll_agree(g, h, NULL, 0, NULL));
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(a->dtype);
    size_t max = 0;
    if (uniform_counts(a, world, 0, &max))
        return ddp_group_reduce_scatter(g, a->send, a->recv, a->counts[0], a->dtype, a->op);
    /* Unequal counts: every rank's block padded to the largest, one reduce_scatter. */
    ddp_status_t s = DDP_ERR_NO_MEMORY;
    void *tmp = ddp__scratch(max, es, (size_t)world);
    void *tmp2 = tmp ? ddp__scratch(max, es, 1) : NULL;
    if (tmp && tmp2) {
        memset(tmp, 0, max * es * (size_t)world);
        size_t off = 0;
        for (int r = 0; r < world; r++) {
            if (a->counts[r])
                memcpy((char *)tmp + (size_t)r * max * es, (const char *)a->send + off * es,
                       a->counts[r] * es);
            off += a->counts[r];
        }
        s = ddp_group_reduce_scatter(g, tmp, tmp2, max, a->dtype, a->op);
        if (s == DDP_OK && a->counts[rank]) memcpy(a->recv, tmp2, a->counts[rank] * es);
    }
    free(tmp);
    free(tmp2);
    return s;
}

/* Every rank's send and receive counts go to every rank with the header, so every rank checks
 * the whole matrix (rank i's receive count from j must be j's send count to i) and reaches the
 * same verdict. Returns the matrix (world rows of send counts then receive counts) in *out. */
static ddp_status_t agree_matrix(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h,
                                 uint64_t **out)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t row = 2 * (size_t)world * sizeof(uint64_t);
    uint64_t *mine = ddp__malloc(row, "alltoallv counts");
    if (!mine) return DDP_ERR_NO_MEMORY;
    for (int j = 0; j < world; j++) {
        mine[j] = a->counts[j];
        mine[world + j] = a->rcounts[j];
    }
    unsigned char *all = NULL;
    ddp_status_t s = ddp__coll_agree(g, h, mine, row, &all);
    free(mine);
    if (s != DDP_OK) return s;
    size_t rec = sizeof(coll_header_t) + row;
    uint64_t *S = ddp__malloc(row * (size_t)world, "alltoallv count matrix");
    if (!S) {
        free(all);
        return DDP_ERR_NO_MEMORY;
    }
    for (int i = 0; i < world; i++)
        memcpy(S + (size_t)i * 2 * world, all + (size_t)i * rec + sizeof(coll_header_t), row);
    free(all);
    for (int i = 0; i < world; i++)
        for (int j = 0; j < world; j++) {
            uint64_t expects = S[(size_t)i * 2 * world + (size_t)world + (size_t)j];
            uint64_t sends = S[(size_t)j * 2 * world + (size_t)i];
            if (expects != sends) {
                char text[400];
                snprintf(text, sizeof text,
                         "alltoallv mismatch (seen on rank %d): rank %d expects %llu elements "
                         "from rank %d, which sends it %llu",
                         rank, i, (unsigned long long)expects, j, (unsigned long long)sends);
                free(S);
                return ddp__coll_fail_mismatch(g, text);
            }
        }
    *out = S;
    return DDP_OK;
}

ddp_status_t ddp__coll_run_alltoallv(ddp_group_t *g, const coll_args_t *a,
                                     const coll_header_t *h)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(a->dtype);
    uint64_t *S = NULL;
    TRY(agree_matrix(g, a, h, &S));
#define SEND_COUNT(i, j) S[(size_t)(i) * 2 * world + (size_t)(j)]
    /* Each rank packs what it sends, in destination order, padded to the largest total. */
    size_t max = 0;
    for (int i = 0; i < world; i++) {
        size_t t = 0;
        for (int j = 0; j < world; j++) t += SEND_COUNT(i, j);
        if (t > max) max = t;
    }
    ddp_status_t s = DDP_ERR_NO_MEMORY;
    void *tmp = ddp__scratch(max, es, 1);
    void *tmp2 = tmp ? ddp__scratch(max, es, (size_t)world) : NULL;
    if (tmp && tmp2) {
        memset(tmp, 0, max * es);
        size_t off = 0;
        for (int j = 0; j < world; j++) {
            if (a->counts[j])
                memcpy((char *)tmp + off * es, (const char *)a->send + a->displs[j] * es,
                       a->counts[j] * es);
            off += a->counts[j];
        }
        s = ddp_group_allgather(g, tmp, tmp2, max, a->dtype);
        if (s == DDP_OK)
            for (int j = 0; j < world; j++) {
                size_t at = 0;
                for (int k = 0; k < rank; k++) at += SEND_COUNT(j, k);
                if (a->rcounts[j])
                    memcpy((char *)a->recv + a->rdispls[j] * es,
                           (char *)tmp2 + ((size_t)j * max + at) * es, a->rcounts[j] * es);
            }
    }
#undef SEND_COUNT
    free(tmp);
    free(tmp2);
    free(S);
    return s;
}
