/* Creating MPI transport groups (mpi_private.h): the world ranks exchanged through the store (or
 * MPI_COMM_WORLD in rank order without one), the group's private communicator, and splitting a
 * group into subgroups without a store. */
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "core/reduce.h"
#include "transport/mpi/mpi_private.h"

/* ---- creation ------------------------------------------------------------------------------ */

/* Polls a communicator-creating request until timeout_ms passes. */
ddp_status_t ddp__mpi_wait_setup(MPI_Request *req, int timeout_ms, const char *what)
{
    int64_t deadline = ddp__now_ns() + (int64_t)timeout_ms * 1000000;
    for (unsigned long spins = 1;; spins++) {
        int done = 0;
        ddp__mpi_enter_mpi();
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) return ddp__mpi_error(rc, what);
        if (done) return DDP_OK;
        if (ddp__now_ns() > deadline) {
            pthread_mutex_lock(&ddp__mpi_init_lock);
            ddp__mpi_leaked_requests++;
            pthread_mutex_unlock(&ddp__mpi_init_lock);
            return ddp__error(DDP_ERR_TIMEOUT,
                              "%s: not every process of MPI_COMM_WORLD joined within %d ms", what,
                              timeout_ms);
        }
        if (spins > YIELD_AFTER) sched_yield();
    }
}

static uint32_t name_hash(const char *name)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 16777619u;
    return h;
}

/* The tag MPI_Comm_create_group uses for its own messages on the parent communicator, from the
 * group's name, in 0..32767 (MPI_TAG_UB is at least that) but never one of the transport's
 * tags: a member that finished the creation may already send the parent's next fingerprint
 * record (EXCHANGE_TAG) to a member still inside it, which must not take it for its own. */
static int creation_tag(const char *name)
{
    int tag = (int)(name_hash(name) & 0x7fff);
    if (tag == ABORT_TAG || tag == EXCHANGE_TAG) tag ^= 0x4000;
    return tag;
}

/* Learns, through the store, which MPI_COMM_WORLD rank holds each group rank: map[r]. */
static ddp_status_t exchange_world_ranks(ddp_store_t *store, const char *group_name, int rank,
                                         int world, int timeout_ms, int world_rank, int world_size,
                                         int *map)
{
    char key[DDP_STORE_MAX_KEY];
    char value[64];
    snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, rank);
    int len = snprintf(value, sizeof value, "%d %d", world_rank, world_size);
    ddp_status_t status = ddp_store_set(store, key, value, (size_t)len);
    if (status != DDP_OK)
        return ddp__error_context(status, "MPI transport: publishing rank %d's MPI rank", rank);
    /* Wait for everyone within timeout_ms (the store's text names the missing keys, i.e. ranks),
     * then read. */
    char **keys = ddp__calloc((size_t)world, sizeof *keys, "MPI transport keys");
    if (!keys) return DDP_ERR_NO_MEMORY;
    for (int r = 0; r < world && status == DDP_OK; r++) {
        snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, r);
        keys[r] = ddp__strdup(key, "MPI transport key");
        if (!keys[r]) status = DDP_ERR_NO_MEMORY;
    }
    if (status == DDP_OK) status = ddp_store_wait(store, (const char *const *)keys, (size_t)world,
                                                  timeout_ms);
    for (int r = 0; r < world; r++) free(keys[r]);
    free(keys);
    if (status != DDP_OK)
        return ddp__error_context(status,
                                  "MPI transport: rank %d waiting for the others' MPI ranks", rank);
    for (int r = 0; r < world; r++) {
        snprintf(key, sizeof key, "%s/mpi/world_rank/%d", group_name, r);
        void *got = NULL;
        size_t got_len = 0;
        status = ddp_store_get(store, key, &got, &got_len);
        if (status != DDP_OK)
            return ddp__error_context(status, "MPI transport: waiting for rank %d's MPI rank", r);
        int their_rank = -1, their_size = -1;
        int parsed = sscanf((const char *)got, "%d %d", &their_rank, &their_size);
        ddp_free(got);
        if (parsed != 2 || their_rank < 0 || their_rank >= their_size)
            return ddp__error(DDP_ERR_PROTOCOL, "MPI transport: malformed value under key '%s'",
                              key);
        if (their_size != world_size)
            return ddp__error(DDP_ERR_MISMATCH,
                              "MPI transport: rank %d sees an MPI_COMM_WORLD of %d processes but "
                              "rank %d sees %d: the ranks were not started by one mpirun",
                              rank, world_size, r, their_size);
        map[r] = their_rank;
        for (int q = 0; q < r; q++) {
            if (map[q] == their_rank)
                return ddp__error(DDP_ERR_MISMATCH,
                                  "MPI transport: ranks %d and %d are both MPI_COMM_WORLD rank "
                                  "%d (of %d): the ranks were not started by one mpirun",
                                  q, r, their_rank, world_size);
        }
    }
    return DDP_OK;
}

/* Finishes a state whose communicator was just made: errors return, a name for MPI tools, and
 * the communicator's rank and size must be the group's. Frees the communicator on failure. */
ddp_status_t ddp__mpi_adopt_comm(mpi_state_t *s, const char *group_name, int rank, int world,
                               int timeout_ms)
{
    ddp__mpi_enter_mpi();
    MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
    char comm_name[MPI_MAX_OBJECT_NAME];
    snprintf(comm_name, sizeof comm_name, "libddp:%s", group_name);
    MPI_Comm_set_name(s->comm, comm_name);
    int comm_rank = -1, comm_size = -1;
    MPI_Comm_rank(s->comm, &comm_rank);
    MPI_Comm_size(s->comm, &comm_size);
    ddp__mpi_leave_mpi();
    if (comm_rank != rank || comm_size != world) {
        ddp__mpi_enter_mpi();
        MPI_Comm_free(&s->comm);
        ddp__mpi_leave_mpi();
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "MPI transport: rank %d of world size %d was given, but the group's "
                          "communicator says rank %d of %d",
                          rank, world, comm_rank, comm_size);
    }
    s->timeout_ms = timeout_ms;
    if (world > 1) {
        /* Rank 0 draws the group's notice id; every rank learns it before any notice can be sent
         * (see notice_id). Polled, so a rank that never comes cannot hang creation. */
        static _Atomic uint64_t groups_made;
        /* On the heap: a broadcast given up at the timeout may still write it later (leaked). */
        uint64_t *id = ddp__calloc(1, sizeof *id, "the group's notice id");
        if (!id) {
            ddp__mpi_enter_mpi();
            MPI_Comm_free(&s->comm);
            ddp__mpi_leave_mpi();
            return DDP_ERR_NO_MEMORY;
        }
        if (rank == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            *id = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^
                  (atomic_fetch_add(&groups_made, 1) + 1) * 0x9e3779b97f4a7c15ULL;
        }
        MPI_Request req;
        ddp__mpi_enter_mpi();
        int rc = MPI_Ibcast(id, 1, MPI_UINT64_T, 0, s->comm, &req);
        ddp__mpi_leave_mpi();
        ddp_status_t status = rc == MPI_SUCCESS
                                  ? ddp__mpi_wait_setup(&req, timeout_ms, "agreeing on the group's notice id")
                                  : ddp__mpi_error(rc, "MPI transport: MPI_Ibcast (notice id)");
        if (status != DDP_OK) {
            /* After a timeout the broadcast may still arrive: keep the communicator, as destroy
             * does for a failed group, so that its context id is not handed on with it. */
            if (rc != MPI_SUCCESS) {
                ddp__mpi_enter_mpi();
                MPI_Comm_free(&s->comm);
                ddp__mpi_leave_mpi();
                free(id);
            }
            return status;
        }
        s->notice_id = *id;
        free(id);
    }
    if (world > 1 && world <= ddp__mpi_p2p_max_world) {
        s->records = ddp__calloc((size_t)world, sizeof *s->records, "MPI transport records");
        s->xreqs = ddp__calloc(2 * (size_t)world, sizeof *s->xreqs, "MPI transport requests");
        s->last_seq = ddp__calloc((size_t)world, sizeof *s->last_seq, "MPI transport sequence");
        if (!s->records || !s->xreqs || !s->last_seq) {
            free(s->records);
            free(s->xreqs);
            free(s->last_seq);
            ddp__mpi_enter_mpi();
            MPI_Comm_free(&s->comm);
            ddp__mpi_leave_mpi();
            return DDP_ERR_NO_MEMORY;
        }
        for (int i = 0; i < 2 * world; i++) s->xreqs[i] = MPI_REQUEST_NULL;
    }
    pthread_mutex_lock(&ddp__mpi_init_lock);
    ddp__mpi_live_states++;
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    return DDP_OK;
}

ddp_status_t ddp__mpi_create(ddp_store_t *store, const char *group_name, int rank, int world,
                               int timeout_ms, void **state)
{
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: state is NULL");
    if (world < 1)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: world size %d", world);
    if (rank < 0 || rank >= world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: rank %d outside 0..%d", rank,
                          world - 1);
    /* The group resolves its timeout (its options, else DDP_TIMEOUT) and hands it down: a
     * transport reads no configuration of its own. */
    if (timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI transport: timeout_ms %d is negative",
                          timeout_ms);
    if (!group_name) group_name = "default";

    ddp_status_t status = ddp__mpi_ensure_mpi();
    if (status != DDP_OK) return status;
    /* The fused record's MPI type and op, made once under the same lock as MPI's initialisation
     * (here rather than in ddp__mpi_ensure_mpi, so that the runtime does not call back into the
     * record exchange; every state is made here or split from one made here). */
    pthread_mutex_lock(&ddp__mpi_init_lock);
    status = ddp__mpi_ensure_fused();
    pthread_mutex_unlock(&ddp__mpi_init_lock);
    if (status != DDP_OK) return status;
    int world_rank = 0, world_size = 0;
    ddp__mpi_enter_mpi();
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    ddp__mpi_leave_mpi();

    mpi_state_t *s = ddp__calloc(1, sizeof *s, "MPI transport state");
    if (!s) return DDP_ERR_NO_MEMORY;
    s->comm = MPI_COMM_NULL;
    s->rank = rank;
    s->world = world;
    snprintf(s->name, sizeof s->name, "%s", group_name);
    int *map = NULL;

    if (!store) {
        /* Without a store the only group we can build is MPI_COMM_WORLD itself. */
        if (rank != world_rank || world != world_size) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "MPI transport: rank %d of world size %d was given, but "
                                "MPI_COMM_WORLD says rank %d of %d (without a store a group must "
                                "span MPI_COMM_WORLD in its rank order)",
                                rank, world, world_rank, world_size);
            goto fail_state;
        }
    } else {
        if (world > world_size) {
            status = ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                "MPI transport: world size %d was given, but MPI_COMM_WORLD has "
                                "only %d processes (rank %d is MPI rank %d): were the ranks "
                                "started by one mpirun?",
                                world, world_size, rank, world_rank);
            goto fail_state;
        }
        map = ddp__malloc((size_t)world * sizeof *map, "MPI transport rank map");
        if (!map) {
            status = DDP_ERR_NO_MEMORY;
            goto fail_state;
        }
        status = exchange_world_ranks(store, group_name, rank, world, timeout_ms, world_rank,
                                      world_size, map);
        if (status != DDP_OK) goto fail_map;
    }

    int identity = world == world_size;
    for (int r = 0; map && identity && r < world; r++) identity = map[r] == r;
    if (identity) {
        /* Every process of MPI_COMM_WORLD is in the group, in order: a non-blocking duplicate,
         * polled so that a process that never comes cannot hang us. */
        MPI_Request req;
        ddp__mpi_enter_mpi();
        int rc = MPI_Comm_idup(MPI_COMM_WORLD, &s->comm, &req);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) {
            status = ddp__mpi_error(rc, "MPI transport: MPI_Comm_idup(MPI_COMM_WORLD)");
            goto fail_map;
        }
        status = ddp__mpi_wait_setup(&req, timeout_ms, "MPI transport: MPI_Comm_idup(MPI_COMM_WORLD)");
        if (status != DDP_OK) goto fail_map; /* the communicator is leaked with the request */
    } else {
        /* A subset or a reordering: MPI_Comm_create_group is collective over the members only.
         * It blocks, but every member has just shown through the store that it is here. */
        MPI_Group world_group, group;
        ddp__mpi_enter_mpi();
        MPI_Comm_group(MPI_COMM_WORLD, &world_group);
        int rc = MPI_Group_incl(world_group, world, map, &group);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, creation_tag(group_name), &s->comm);
            MPI_Group_free(&group);
        }
        MPI_Group_free(&world_group);
        ddp__mpi_leave_mpi();
        if (rc != MPI_SUCCESS) {
            status = ddp__mpi_error(rc, "MPI transport: MPI_Comm_create_group");
            goto fail_map;
        }
    }
    free(map);
    map = NULL;
    status = ddp__mpi_adopt_comm(s, group_name, rank, world, timeout_ms);
    if (status != DDP_OK) goto fail_state;
    DDP_LOG(DDP_LOG_INFO, "MPI transport: group '%s' rank %d/%d is MPI_COMM_WORLD rank %d (%s)",
            group_name, rank, world, world_rank, ddp__mpi_thread_level_name(ddp__mpi_provided_level));
    *state = s;
    return DDP_OK;

fail_map:
    free(map);
fail_state:
    free(s);
    return status;
}

ddp_status_t ddp__mpi_split(void *parent, const int *ranks, int nranks, const char *name,
                            void **state)
{
    mpi_state_t *p = parent;
    if (!p) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: parent is NULL");
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: state is NULL");
    if (!name || !*name) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: name is empty");
    if (!ranks) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: ranks is NULL");
    if (nranks < 1 || nranks > p->world)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "MPI split: nranks %d outside 1..%d", nranks,
                          p->world);
    int me = -1;
    for (int i = 0; i < nranks; i++) {
        if (ranks[i] < 0 || ranks[i] >= p->world)
            return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                              "MPI split: ranks[%d] = %d outside 0..%d", i, ranks[i], p->world - 1);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                                  "MPI split: rank %d listed twice (ranks[%d] and ranks[%d])",
                                  ranks[i], j, i);
        if (ranks[i] == p->rank) me = i;
    }
    if (p->broken)
        return ddp__error(DDP_ERR_ABORTED, "MPI split: parent group '%s' is broken: %s", p->name,
                          p->broken_reason);
    if (me < 0) {
        *state = NULL; /* not a member: MPI_Comm_create_group involves the members only */
        return DDP_OK;
    }
    mpi_state_t *s = ddp__calloc(1, sizeof *s, "MPI transport state");
    if (!s) return DDP_ERR_NO_MEMORY;
    s->comm = MPI_COMM_NULL;
    s->rank = me;
    s->world = nranks;
    snprintf(s->name, sizeof s->name, "%s", name);
    MPI_Group parent_group, group;
    ddp__mpi_enter_mpi();
    MPI_Comm_group(p->comm, &parent_group);
    int rc = MPI_Group_incl(parent_group, nranks, ranks, &group);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Comm_create_group(p->comm, group, creation_tag(name), &s->comm);
        MPI_Group_free(&group);
    }
    MPI_Group_free(&parent_group);
    ddp__mpi_leave_mpi();
    ddp_status_t status;
    if (rc != MPI_SUCCESS) {
        status = ddp__mpi_error(rc, "MPI split: MPI_Comm_create_group");
    } else {
        status = ddp__mpi_adopt_comm(s, name, me, nranks, p->timeout_ms);
    }
    if (status != DDP_OK) {
        free(s);
        return status;
    }
    *state = s;
    return DDP_OK;
}

