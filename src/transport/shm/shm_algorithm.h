/* The ways the shared-memory transport runs a collective: one list for the chooser (shm_choose.c),
 * the tuner (shm_tune.c) and ddp_group_algorithm's answer. The tuner's candidates come first, in
 * the order its tables, its published updates and the tests' ddp__shm_set_tune_skew index them;
 * the ways it never picks (they follow from the size or from where every rank's buffers are)
 * come after DDP__SHM_VARIANTS. */
#ifndef DDP_TRANSPORT_SHM_ALGORITHM_H
#define DDP_TRANSPORT_SHM_ALGORITHM_H

/* The staged allreduce has two knobs, the stores that write the stage and the round size, each
 * tuned: four algorithms. Long rounds are DDP_SHM_ALLREDUCE_ROUND_BYTES (1 MiB), short ones
 * DDP_SHM_ROUND_BYTES (256 KiB). The names in quotes are what ddp_group_algorithm says. */
typedef enum {
    /* "staged:nt": the stage written with non-temporal stores, long rounds */
    DDP__SHM_ALG_STAGED_NT,
    DDP__SHM_ALG_STAGED_PLAIN, /* "staged:plain": plain stores, short (L2-sized) rounds */
    DDP__SHM_ALG_ONESHOT,      /* "one-shot": every rank stages everything, reduces everything */
    DDP__SHM_ALG_CMA,          /* "single-copy": peers' buffers read with process_vm_readv */
    /* "rounds": broadcast, allgather, reduce_scatter through the stage */
    DDP__SHM_ALG_ROUNDS,
    DDP__SHM_ALG_STAGED_NT_SHORT,   /* "staged:nt:short": non-temporal stores, short rounds */
    DDP__SHM_ALG_STAGED_PLAIN_LONG, /* "staged:plain:long": plain stores, long rounds */
    DDP__SHM_VARIANTS,              /* the tuner's candidates are the values below this */
    /* "mailbox": the data rides in the first phase's line with the fingerprint */
    DDP__SHM_ALG_MAILBOX = DDP__SHM_VARIANTS,
    DDP__SHM_ALG_ZERO_COPY, /* "zero-copy": segment buffers at the same offsets on every rank */
    DDP__SHM_ALG_MAPPED,    /* "mapped": registered memory on every rank, views of it agreed */
    DDP__SHM_ALG_BARRIER,   /* "barrier" */
    DDP__SHM_ALGORITHMS
} ddp__shm_algorithm_t;

/* Whether a staged algorithm writes its stage with non-temporal stores, and uses long rounds. */
static inline int ddp__shm_algorithm_streams(int a)
{
    return a == DDP__SHM_ALG_STAGED_NT || a == DDP__SHM_ALG_STAGED_NT_SHORT;
}
static inline int ddp__shm_algorithm_long_rounds(int a)
{
    return a == DDP__SHM_ALG_STAGED_NT || a == DDP__SHM_ALG_STAGED_PLAIN_LONG;
}

/* The name ddp_group_algorithm and the tuner's log and trace use; "none" for anything else
 * (-1: no collective yet). */
const char *ddp__shm_algorithm_name(int algorithm);

#endif
