/* What the files of the derived collectives share (collectives.c and coll_*.c): the operation
 * record a task carries, the header ranks agree on, and the rows of the kinds. Each kind is one
 * function in collectives.c's table (gloo gives each collective its file; here each family has
 * one: coll_rooted.c, coll_vector.c, coll_coalesced.c, coll_p2p.c); coll_issue.c holds the
 * public calls. Group-private. */
#ifndef DDP_GROUP_COLLECTIVES_H
#define DDP_GROUP_COLLECTIVES_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/ddp.h"

typedef enum coll_kind {
    K_REDUCE = 1,
    K_GATHER,
    K_SCATTER,
    K_ALLTOALL,
    K_ALLGATHERV,
    K_REDUCE_SCATTERV,
    K_ALLTOALLV,
    K_ALLREDUCE_COALESCED,
    K_BROADCAST_COALESCED,
    K_SEND,
    K_RECV,
    K_REDUCE_SCATTER_APPLY,
    K_COUNT
} coll_kind_t;

/* What every rank must agree on; exchanged as bytes (one build, one byte order). */
typedef struct coll_header {
    uint32_t magic;
    int32_t kind, dtype, op, root, tag;
    uint64_t count;
    uint64_t counts_hash; /* FNV-1a of the count array (variable-count and coalesced kinds) */
    int32_t from, to;      /* send/recv: global ranks of sender and receiver */
} coll_header_t;

#define COLL_HEADER_MAGIC 0xddc011ecu

/* One operation, with copies of the caller's arrays (they need not outlive the call). */
typedef struct coll_args {
    coll_kind_t kind;
    const void *send;
    void *recv;
    size_t count;
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    int root; /* rooted kinds; peer for send/recv */
    int tag;
    size_t nbufs;
    void **bufs;         /* coalesced */
    size_t *counts;      /* coalesced: per buffer; v kinds: per rank (alltoallv: send counts) */
    size_t *displs;      /* v kinds: per rank, elements (alltoallv: send displacements) */
    size_t *rcounts;     /* alltoallv: receive counts */
    size_t *rdispls;     /* alltoallv: receive displacements */
    int *source;         /* recv from any source (root < 0): where the sender's rank goes */
    ddp_apply_fn apply;  /* reduce_scatter_apply */
    void *apply_arg;
} coll_args_t;

/* Runs one operation of its kind on the group's task thread. `h` is this rank's header (the
 * kind's runner agrees on it first, with any extra it needs). */
typedef ddp_status_t (*coll_run_fn)(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);

/* What the header and its description need of a kind: one row per kind, indexed by
 * coll_kind_t (coll_common.c). The kinds' functions are a table of their own (collectives.c). */
typedef struct coll_kind_info {
    const char *name;
    int has_op;
    int has_root;
    int hashes_counts; /* counts_hash covers a->counts: per buffer (coalesced) or per rank */
} coll_kind_info_t;

extern const coll_kind_info_t ddp__coll_kinds[K_COUNT];

/* The runners (in the families' files). */
ddp_status_t ddp__coll_run_reduce(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_gather(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_scatter(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_alltoall(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_allgatherv(ddp_group_t *g, const coll_args_t *a,
                                      const coll_header_t *h);
ddp_status_t ddp__coll_run_reduce_scatterv(ddp_group_t *g, const coll_args_t *a,
                                           const coll_header_t *h);
ddp_status_t ddp__coll_run_alltoallv(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_coalesced(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_p2p(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h);
ddp_status_t ddp__coll_run_reduce_scatter_apply(ddp_group_t *g, const coll_args_t *a,
                                                const coll_header_t *h);

/* ---- shared (coll_common.c) ---- */

/* This rank's header for `a`. */
coll_header_t ddp__coll_header_of(ddp_group_t *g, const coll_args_t *a);

/* "rank 0 called allreduce f32 ..." style text of a header. */
void ddp__coll_describe(const coll_header_t *h, char *buf, size_t size);

/* Breaks the group with a mismatch and returns it as this thread's error. */
ddp_status_t ddp__coll_fail_mismatch(ddp_group_t *g, const char *text);

/* Allgathers `mine` (header then `extra` bytes) into *all_out (world records, malloc'd; NULL:
 * not kept) and checks every header against rank 0's: DDP_ERR_MISMATCH on every rank when one
 * differs. */
ddp_status_t ddp__coll_agree(ddp_group_t *g, const coll_header_t *mine, const void *extra,
                             size_t extra_bytes, unsigned char **all_out);

/* A record holding `fields` (the issuing call names the ones its kind uses with a compound
 * literal; the rest are zero), or NULL (DDP_ERR_NO_MEMORY recorded). */
coll_args_t *ddp__coll_new_args(coll_args_t fields);
void ddp__coll_free_args(void *args);
/* A malloc'd copy of n sizes (at least one element), or NULL. */
size_t *ddp__coll_copy_sizes(const size_t *v, size_t n);

/* (collectives.c) Issues (work != NULL) or runs (work == NULL) `a` as a task of the group;
 * frees it either way. */
ddp_status_t ddp__coll_launch(ddp_group_t *g, coll_args_t *a, ddp_work_t **work);

#endif
