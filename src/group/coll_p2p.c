/* Point-to-point messages (collectives.h): send, recv and recv from any source, each a
 * collective of two in the pair group the two ranks share (made through the store on first use),
 * after a header exchange that turns a mismatched pair into DDP_ERR_MISMATCH on both sides. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "group/checks.h"
#include "group/collectives.h"
#include "group/group_private.h"

/* Breaks the group with the calling thread's error `s` (with `text`) and returns it. */
static ddp_status_t fail_with(ddp_group_t *g, ddp_status_t s, const char *text)
{
    ddp__group_fail(g, s, text, 1);
    return ddp__error(s, "%s", text);
}

/* Both ends' headers through the pair: a pair that is not one send and one recv of the same
 * dtype, count and tag is a mismatch on both sides (*settled = 1: the group is broken and the
 * error recorded; otherwise a failure is the pair's, for the caller to report). */
static ddp_status_t agree_pair(ddp_group_t *g, ddp_group_t *pair, const coll_args_t *a,
                               const coll_header_t *h, int peer, int *settled)
{
    *settled = 0;
    int rank = ddp_group_rank(g);
    coll_header_t mine = *h;
    mine.tag = a->tag;
    mine.from = a->kind == K_SEND ? rank : peer;
    mine.to = a->kind == K_SEND ? peer : rank;
    coll_header_t both[2];
    ddp_status_t s = ddp_group_allgather(pair, &mine, both, sizeof mine, DDP_U8);
    if (s != DDP_OK) return s;
    if (both[0].kind == both[1].kind || both[0].dtype != both[1].dtype ||
        both[0].count != both[1].count || both[0].tag != both[1].tag ||
        both[0].magic != COLL_HEADER_MAGIC || both[1].magic != COLL_HEADER_MAGIC) {
        char d0[256], d1[256], text[700];
        ddp__coll_describe(&both[0], d0, sizeof d0);
        ddp__coll_describe(&both[1], d1, sizeof d1);
        int lo = rank < peer ? rank : peer, hi = rank < peer ? peer : rank;
        snprintf(text, sizeof text,
                 "point-to-point mismatch (seen on rank %d): rank %d called %s but rank %d "
                 "called %s",
                 rank, lo, d0, hi, d1);
        /* Both sides of the pair know; the parent's other ranks learn through its abort. */
        ddp__group_fail(pair, DDP_ERR_MISMATCH, text, 0);
        *settled = 1;
        return fail_with(g, DDP_ERR_MISMATCH, text);
    }
    return DDP_OK;
}

ddp_status_t ddp__coll_run_p2p(ddp_group_t *g, const coll_args_t *a, const coll_header_t *h)
{
    int rank = ddp_group_rank(g);
    int peer = a->root;
    ddp_group_t *pair = NULL;
    ddp_status_t s = DDP_OK;
    /* From any source: the peer whose announced sends to this rank outnumber the recvs from it
     * has its next message to this rank waiting (group.c); the recv is then a named one. */
    if (peer < 0) s = ddp__group_p2p_any_source(g, a->tag, &peer);
    /* Announced before the pair is made: a first message's pair needs the receiver, which
     * learns of it from the announcement. */
    if (s == DDP_OK) s = ddp__group_p2p_count(g, peer, a->kind == K_SEND);
    if (s == DDP_OK) s = ddp__group_pair(g, peer, &pair);
    if (s == DDP_OK && a->source) *a->source = peer;
    if (s != DDP_OK) {
        char text[DDP_ERROR_TEXT_MAX];
        snprintf(text, sizeof text, "%s", ddp_last_error());
        return fail_with(g, s, text);
    }
    int settled = 0;
    s = agree_pair(g, pair, a, h, peer, &settled);
    if (settled) return s;
    int sender_in_pair = (a->kind == K_SEND) == (rank < peer) ? 0 : 1;
    if (s == DDP_OK)
        s = ddp_group_broadcast(pair, a->kind == K_SEND ? (void *)a->send : a->recv, a->count,
                                a->dtype, sender_in_pair);
    if (s != DDP_OK) {
        /* The pair's text numbers its ranks 0 and 1: say who they are. */
        char text[DDP_ERROR_TEXT_MAX];
        int lo = rank < peer ? rank : peer, hi = rank < peer ? peer : rank;
        snprintf(text, sizeof text,
                 "%s %s rank %d (tag %d) failed on rank %d (in its pair group rank 0 is "
                 "rank %d, rank 1 is rank %d): %s",
                 ddp__coll_kinds[a->kind].name, a->kind == K_SEND ? "to" : "from", peer, a->tag,
                 rank, lo, hi, ddp_last_error());
        return fail_with(g, s, text);
    }
    return DDP_OK;
}
