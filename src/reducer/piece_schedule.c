/* The Reducer's piece schedule, decided once at the rebuild from rank 0's recording iteration:
 * the order in which each bucket's pieces launch, or with stacked tensors where pieces are cut
 * and one launch order across all buckets (broadcast, so every rank issues the same
 * collectives). Also sizes the launch log for the buckets and pieces that result. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reducer/reducer_internal.h"

/* Collective, at the rebuild (with pieces): each bucket's pieces are launched from now on in the
 * order rank 0's became complete in the recording iteration (the last row mark touching a piece
 * completes it; ties keep index order), broadcast so that every rank issues the same
 * collectives. */
typedef struct piece_key {
    size_t key, index;
} piece_key_t;

static int compare_piece_keys(const void *a, const void *b)
{
    const piece_key_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index ? 1 : 0;
}

ddp_status_t ddp__reducer_order_pieces(ddp_reducer_t *r)
{
    size_t total = 0, most = 0;
    for (size_t b = 0; b < r->nbuckets; b++) {
        total += r->buckets[b].npieces;
        if (r->buckets[b].npieces > most) most = r->buckets[b].npieces;
    }
    if (total == 0) return DDP_OK;
    int64_t *order = ddp__calloc(total, sizeof(int64_t), "rebuild");
    size_t *keys = ddp__calloc(total, sizeof(size_t), "rebuild");
    piece_key_t *sorted = ddp__malloc(most * sizeof *sorted, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!order || !keys || !sorted) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    if (r->rank == r->rebuild_root) {
        size_t *first = ddp__malloc(r->nbuckets * sizeof(size_t), "rebuild");
        if (!first) {
            status = DDP_ERR_NO_MEMORY;
            goto done;
        }
        for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
            first[b] = at;
            at += r->buckets[b].npieces;
        }
        /* Marks are in completion order, so the last one touching a piece sets its key. */
        for (size_t f = 0; f < r->nfinals; f++) {
            const rparam_t *p = &r->params[r->finals[f].param];
            bucket_t *k = &r->buckets[p->bucket];
            if (!k->npieces || r->finals[f].begin == r->finals[f].end) continue;
            size_t lo = p->offset + r->finals[f].begin, hi = p->offset + r->finals[f].end;
            size_t step = k->pieces[0].numel;
            for (size_t i = lo / step; i < k->npieces && k->pieces[i].begin < hi; i++)
                keys[first[k->index] + i] = f + 1;
        }
        for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
            bucket_t *k = &r->buckets[b];
            for (size_t i = 0; i < k->npieces; i++) {
                sorted[i].key = keys[at + i];
                sorted[i].index = i;
            }
            qsort(sorted, k->npieces, sizeof *sorted, compare_piece_keys);
            for (size_t i = 0; i < k->npieces; i++) order[at + i] = (int64_t)sorted[i].index;
            at += k->npieces;
        }
        free(first);
    }
    status = ddp_group_broadcast(r->group, order, total, DDP_I64, r->rebuild_root);
    if (status != DDP_OK) {
        ddp__error_context(status, "rebuilding buckets (broadcast of rank %d's piece order)",
                           r->rebuild_root);
        goto done;
    }
    for (size_t b = 0, at = 0; b < r->nbuckets; b++) {
        bucket_t *k = &r->buckets[b];
        unsigned char *seen = (unsigned char *)keys; /* reused: at least npieces bytes */
        memset(seen, 0, k->npieces);
        for (size_t i = 0; i < k->npieces; i++) {
            int64_t v = order[at + i];
            if (v < 0 || (size_t)v >= k->npieces || seen[v]) {
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank 0's piece order of bucket %zu is "
                                    "not a permutation",
                                    b);
                goto done;
            }
            seen[v] = 1;
            k->piece_order[i] = (size_t)v;
        }
        at += k->npieces;
    }
done:
    free(order);
    free(keys);
    free(sorted);
    return status;
}

/* ---- stacked tensors: pieces along rank 0's row ranges, one launch order for all buckets ----
 *
 * llm.c keeps each kind of weight of all L layers in one (L, ...) tensor, and its backward makes
 * layer l's rows of every such tensor final at once, from the last layer down. Bucket by bucket,
 * a bucket holding any stacked tensor is complete only when layer 0 is, so nothing after it
 * could start before the end of backward, whatever its own pieces' order. So at the rebuild,
 * rank 0's recording iteration (every row range in the order it became final) decides, for
 * every bucket with pieces:
 *   - where its pieces are cut: at the boundaries of the row ranges marked (a segment is one
 *     range of one call), a segment larger than piece_bytes split into equal parts.
 *     Neighbouring segments share a piece, up to piece_bytes, when they became final one right
 *     after the other among the bucket's segments (a matrix's consecutive row blocks, whole
 *     tensors in arrival order: what fixed-size pieces would have merged anyway, and each
 *     piece is one more collective), or when both are small (under piece_bytes / 16: a layer's
 *     rows of a stacked bias cost less as part of one piece than as a collective of their
 *     own). Two layers of one stacked tensor are not consecutive when the bucket holds other
 *     tensors' rows of the layers between, so they stay apart;
 *   - when each piece is launched: every piece, and every bucket without pieces (sparse, empty),
 *     gets the position at which its last element became final, and all of them go in one
 *     schedule sorted by it (ties in bucket, then piece, order).
 * Launching stays strict, in the schedule's order instead of bucket after bucket, and the
 * schedule is broadcast from rank 0, so every rank issues the same collectives in the same order.
 * Which element each collective reduces is fixed as before, so results are bitwise those of
 * whole buckets. Bucket boundaries no longer hold anything back: a 1 MiB first bucket of
 * layer 0's rows only delays those rows. */

typedef struct segment {
    size_t lo, hi; /* element range in the bucket */
    size_t key;    /* 1 + position in rank 0's recording; later than all for a gap */
    size_t rank;   /* its place among the bucket's segments sorted by key */
} segment_t;

static int compare_segments_by_lo(const void *a, const void *b)
{
    const segment_t *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

/* A segment's key and place, sorted to rank the segments (qsort has no context argument, and
 * two reducers may rebuild on two threads at once: no global to point into the segments). */
typedef struct segment_ref {
    size_t key, lo, index;
} segment_ref_t;

static int compare_segment_refs(const void *a, const void *b)
{
    const segment_ref_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

static size_t units_of(const bucket_t *k) { return k->npieces ? k->npieces : 1; }

ddp_status_t ddp__reducer_size_launch_log(ddp_reducer_t *r)
{
    size_t n = 0;
    for (size_t b = 0; b < r->nbuckets; b++) n += units_of(&r->buckets[b]);
    if (n <= r->launch_cap && r->launch_log) return DDP_OK;
    launch_record_t *log = ddp__calloc(n ? n : 1, sizeof *log, "reducer");
    ddp_reduction_stats_t *st = ddp__calloc(n ? n : 1, sizeof *st, "reducer");
    if (!log || !st) {
        free(log);
        free(st);
        return DDP_ERR_NO_MEMORY;
    }
    free(r->launch_log);
    free(r->reduction_stats);
    r->launch_log = log;
    r->reduction_stats = st;
    r->launch_cap = n;
    r->have_stats = 0;
    return DDP_OK;
}

/* Rank 0: bucket k's segments (sorted by lo, gaps filled, ranked) cut into pieces: their first
 * elements into begins and their keys into keys; returns how many. */
static size_t cut_pieces(segment_t *segs, size_t n, size_t step, int64_t *begins, size_t *keys)
{
    size_t small = step / 16 ? step / 16 : 1, count = 0;
    int open = 0;
    size_t cur_n = 0, cur_key = 0, cur_rank = 0;
    for (size_t i = 0; i < n; i++) {
        const segment_t *g = &segs[i];
        size_t len = g->hi - g->lo;
        int next = g->rank == cur_rank + 1 || g->rank + 1 == cur_rank;
        if (open && cur_n + len <= step &&
            (next || (cur_n < small && len < small))) {
            cur_n += len;
            if (g->key > cur_key) cur_key = g->key;
            cur_rank = g->rank;
            continue;
        }
        if (open) keys[count++] = cur_key;
        size_t parts = (len + step - 1) / step;
        for (size_t j = 0; j < parts; j++) {
            begins[count] = (int64_t)(g->lo + len * j / parts);
            if (j + 1 < parts) keys[count++] = g->key;
        }
        open = 1;
        cur_n = g->hi - (size_t)begins[count];
        cur_key = g->key;
        cur_rank = g->rank;
    }
    if (open) keys[count++] = cur_key;
    return count;
}

typedef struct unit_key {
    size_t key, unit;
} unit_key_t;

static int compare_unit_keys(const void *a, const void *b)
{
    const unit_key_t *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->unit < y->unit ? -1 : x->unit > y->unit ? 1 : 0;
}

/* Rank 0: fills counts (pieces per bucket, 0 for buckets without), and returns the payload:
 * every bucket's piece begins, then the schedule as unit numbers (bucket b's units are numbered
 * after those of the buckets before it). */
static ddp_status_t plan_schedule(ddp_reducer_t *r, int64_t *counts, int64_t **payload,
                                  size_t *payload_len)
{
    size_t nb = r->nbuckets, nf = r->nfinals, np = r->nparams;
    ddp_status_t status = DDP_OK;
    size_t *complete_key = ddp__calloc(np ? np : 1, sizeof(size_t), "rebuild");
    size_t *seg_count = ddp__calloc(nb ? nb : 1, sizeof(size_t), "rebuild");
    size_t *seg_first = ddp__calloc(nb + 1, sizeof(size_t), "rebuild");
    segment_t *segs = ddp__malloc((nf ? nf : 1) * sizeof *segs, "rebuild");
    segment_t *filled = NULL;
    segment_ref_t *refs = NULL;
    size_t *keys = NULL;
    int64_t *begins = NULL, *out = NULL;
    unit_key_t *units = NULL;
    if (!complete_key || !seg_count || !seg_first || !segs) goto no_memory;
    /* Segments by bucket; completion events give pieceless buckets their keys. */
    for (size_t f = 0; f < nf; f++) {
        const rparam_t *p = &r->params[r->finals[f].param];
        if (r->finals[f].begin == r->finals[f].end) {
            complete_key[r->finals[f].param] = f + 1;
            continue;
        }
        if (r->buckets[p->bucket].npieces) seg_count[p->bucket]++;
    }
    for (size_t b = 0; b < nb; b++) seg_first[b + 1] = seg_first[b] + seg_count[b];
    memset(seg_count, 0, nb * sizeof(size_t));
    for (size_t f = 0; f < nf; f++) {
        const rparam_t *p = &r->params[r->finals[f].param];
        if (r->finals[f].begin == r->finals[f].end || !r->buckets[p->bucket].npieces) continue;
        segment_t *g = &segs[seg_first[p->bucket] + seg_count[p->bucket]++];
        g->lo = p->offset + r->finals[f].begin;
        g->hi = p->offset + r->finals[f].end;
        g->key = f + 1;
    }
    size_t most = 0;
    for (size_t b = 0; b < nb; b++)
        if (seg_count[b] > most) most = seg_count[b];
    /* At most 2n + 1 segments once gaps are filled; pieces: at most one per element. */
    filled = ddp__malloc((2 * most + 1) * sizeof *filled, "rebuild");
    refs = ddp__malloc((2 * most + 1) * sizeof *refs, "rebuild");
    size_t cap_pieces = 0;
    for (size_t b = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (!k->npieces) continue;
        size_t step = k->pieces[0].numel; /* the grid's: piece_bytes in elements */
        cap_pieces += 2 * seg_count[b] + 1 + k->numel / step + 1;
    }
    begins = ddp__malloc((cap_pieces ? cap_pieces : 1) * sizeof *begins, "rebuild");
    keys = ddp__malloc((cap_pieces ? cap_pieces : 1) * sizeof *keys, "rebuild");
    if (!filled || !refs || !begins || !keys) goto no_memory;
    size_t npieces_all = 0, nunits = 0;
    for (size_t b = 0; b < nb; b++) {
        bucket_t *k = &r->buckets[b];
        counts[b] = 0;
        if (!k->npieces) {
            nunits++;
            continue;
        }
        segment_t *g = segs + seg_first[b];
        size_t n = seg_count[b], m = 0, pos = 0;
        qsort(g, n, sizeof *g, compare_segments_by_lo);
        for (size_t i = 0; i < n; i++) {
            size_t lo = g[i].lo < pos ? pos : g[i].lo; /* overlaps cannot happen: be safe */
            if (g[i].hi <= lo) continue;
            if (lo > pos) filled[m++] = (segment_t){pos, lo, (size_t)-1, 0};
            filled[m++] = (segment_t){lo, g[i].hi, g[i].key, 0};
            pos = g[i].hi;
        }
        if (pos < k->numel) filled[m++] = (segment_t){pos, k->numel, (size_t)-1, 0};
        for (size_t i = 0; i < m; i++) refs[i] = (segment_ref_t){filled[i].key, filled[i].lo, i};
        qsort(refs, m, sizeof *refs, compare_segment_refs);
        for (size_t i = 0; i < m; i++) filled[refs[i].index].rank = i;
        size_t step = k->pieces[0].numel;
        size_t c = cut_pieces(filled, m, step, begins + npieces_all, keys + npieces_all);
        counts[b] = (int64_t)c;
        npieces_all += c;
        nunits += c;
    }
    units = ddp__malloc((nunits ? nunits : 1) * sizeof *units, "rebuild");
    out = ddp__malloc((npieces_all + nunits + 1) * sizeof *out, "rebuild");
    if (!units || !out) goto no_memory;
    for (size_t b = 0, u = 0, at = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (!counts[b]) {
            size_t key = 0;
            for (size_t j = 0; j < k->nparams; j++)
                if (complete_key[k->params[j]] > key) key = complete_key[k->params[j]];
            units[u] = (unit_key_t){key, u};
            u++;
            continue;
        }
        for (size_t i = 0; i < (size_t)counts[b]; i++, u++, at++)
            units[u] = (unit_key_t){keys[at], u};
    }
    qsort(units, nunits, sizeof *units, compare_unit_keys);
    memcpy(out, begins, npieces_all * sizeof *out);
    for (size_t u = 0; u < nunits; u++) out[npieces_all + u] = (int64_t)units[u].unit;
    *payload = out;
    *payload_len = npieces_all + nunits;
    out = NULL;
    goto done;
no_memory:
    status = DDP_ERR_NO_MEMORY;
done:
    free(complete_key);
    free(seg_count);
    free(seg_first);
    free(segs);
    free(filled);
    free(refs);
    free(keys);
    free(begins);
    free(units);
    free(out);
    return status;
}

/* Every rank: checks rank 0's plan and installs it (new pieces, each bucket's piece order, the
 * schedule). */
static ddp_status_t install_schedule(ddp_reducer_t *r, const int64_t *counts,
                                     const int64_t *payload, size_t npieces_all, size_t nunits)
{
    size_t nb = r->nbuckets;
    launch_unit_t *schedule = ddp__malloc((nunits ? nunits : 1) * sizeof *schedule, "rebuild");
    launch_unit_t *unit_of = ddp__malloc((nunits ? nunits : 1) * sizeof *unit_of, "rebuild");
    unsigned char *seen = ddp__calloc(nunits ? nunits : 1, 1, "rebuild");
    piece_t **pieces = ddp__calloc(nb ? nb : 1, sizeof *pieces, "rebuild");
    size_t **orders = ddp__calloc(nb ? nb : 1, sizeof *orders, "rebuild");
    ddp_status_t status = DDP_OK;
    if (!schedule || !unit_of || !seen || !pieces || !orders) {
        status = DDP_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t b = 0, u = 0, at = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        size_t c = (size_t)counts[b];
        if (!k->npieces) {
            unit_of[u++] = (launch_unit_t){b, DDP__WHOLE};
            continue;
        }
        pieces[b] = ddp__calloc(c, sizeof(piece_t), "rebuild");
        orders[b] = ddp__malloc(c * sizeof(size_t), "rebuild");
        if (!pieces[b] || !orders[b]) {
            status = DDP_ERR_NO_MEMORY;
            goto done;
        }
        for (size_t i = 0; i < c; i++, u++, at++) {
            size_t begin = (size_t)payload[at];
            size_t end = i + 1 < c ? (size_t)payload[at + 1] : k->numel;
            if ((i == 0 && begin != 0) || payload[at] < 0 || end <= begin || end > k->numel) {
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank %d's pieces of bucket %zu do not "
                                    "cover it in order (piece %zu)",
                                    r->rebuild_root, b, i);
                goto done;
            }
            piece_t *q = &pieces[b][i];
            q->bucket = &r->buckets[b];
            q->index = i;
            q->begin = begin;
            q->numel = end - begin;
            unit_of[u] = (launch_unit_t){b, i};
        }
    }
    for (size_t b = 0; b < nb; b++) r->buckets[b].next_piece = 0;
    for (size_t j = 0; j < nunits; j++) {
        int64_t v = payload[npieces_all + j];
        if (v < 0 || (size_t)v >= nunits || seen[v]) {
            status = ddp__error(DDP_ERR_PROTOCOL,
                                "rebuilding buckets: rank %d's launch schedule is not a "
                                "permutation (entry %zu)",
                                r->rebuild_root, j);
            goto done;
        }
        seen[v] = 1;
        schedule[j] = unit_of[v];
        launch_unit_t x = schedule[j];
        if (x.piece != DDP__WHOLE) orders[x.bucket][r->buckets[x.bucket].next_piece++] = x.piece;
    }
    for (size_t b = 0; b < nb; b++) {
        bucket_t *k = &r->buckets[b];
        k->next_piece = 0;
        if (!k->npieces) continue;
        free(k->pieces);
        free(k->piece_order);
        k->pieces = pieces[b];
        k->piece_order = orders[b];
        k->npieces = (size_t)counts[b];
        pieces[b] = NULL;
        orders[b] = NULL;
    }
    free(r->schedule);
    r->schedule = schedule;
    r->nschedule = nunits;
    r->next_unit = 0;
    schedule = NULL;
done:
    for (size_t b = 0; b < nb && pieces && orders; b++) {
        free(pieces[b]);
        free(orders[b]);
    }
    free(pieces);
    free(orders);
    free(schedule);
    free(unit_of);
    free(seen);
    return status;
}

/* Collective, at the rebuild (with pieces): rank 0 (rebuild_root) plans the pieces and the
 * schedule from its recording, broadcasts them in two steps (the counts, then the begins and
 * the schedule), and every rank installs them. */
ddp_status_t ddp__reducer_schedule_pieces(ddp_reducer_t *r)
{
    size_t nb = r->nbuckets, any = 0;
    for (size_t b = 0; b < nb; b++) any += r->buckets[b].npieces;
    if (any == 0) return DDP_OK;
    int64_t *counts = ddp__calloc(nb, sizeof(int64_t), "rebuild");
    int64_t *payload = NULL;
    size_t len = 0;
    ddp_status_t status = counts ? DDP_OK : DDP_ERR_NO_MEMORY;
    /* A failure to plan on rank 0 must not leave the others waiting in the broadcast: it sends
     * -1 counts, and every rank fails. */
    if (status == DDP_OK && r->rank == r->rebuild_root) {
        status = plan_schedule(r, counts, &payload, &len);
        if (status != DDP_OK)
            for (size_t b = 0; b < nb; b++) counts[b] = -1;
    }
    if (!counts) goto done;
    ddp_status_t s = ddp_group_broadcast(r->group, counts, nb, DDP_I64, r->rebuild_root);
    if (s != DDP_OK) {
        status = ddp__error_context(s, "rebuilding buckets (broadcast of rank %d's pieces)",
                                    r->rebuild_root);
        goto done;
    }
    size_t npieces_all = 0, nunits = 0;
    for (size_t b = 0; b < nb; b++) {
        const bucket_t *k = &r->buckets[b];
        if (counts[b] < 0 || (k->npieces && (counts[b] == 0 || (size_t)counts[b] > k->numel)) ||
            (!k->npieces && counts[b] != 0)) {
            if (status == DDP_OK)
                status = ddp__error(DDP_ERR_PROTOCOL,
                                    "rebuilding buckets: rank %d could not plan the pieces of "
                                    "bucket %zu (count %lld)",
                                    r->rebuild_root, b, (long long)counts[b]);
            goto done;
        }
        npieces_all += (size_t)counts[b];
        nunits += k->npieces ? (size_t)counts[b] : 1;
    }
    if (r->rank != r->rebuild_root) {
        len = npieces_all + nunits;
        payload = ddp__malloc((len ? len : 1) * sizeof *payload, "rebuild");
        if (!payload) {
            status = DDP_ERR_NO_MEMORY; /* the peers then wait until the timeout */
            goto done;
        }
    }
    s = ddp_group_broadcast(r->group, payload, len, DDP_I64, r->rebuild_root);
    if (s != DDP_OK) {
        status = ddp__error_context(s, "rebuilding buckets (broadcast of rank %d's schedule)",
                                    r->rebuild_root);
        goto done;
    }
    status = install_schedule(r, counts, payload, npieces_all, nunits);
done:
    free(counts);
    free(payload);
    return status;
}

/* Whether the rebuild plans pieces and their schedule from rank 0's record (buckets with pieces:
 * piece_bytes > 0 and the default hook). */
int ddp__reducer_schedules_pieces(const ddp_reducer_t *r)
{
    return DDP__READINESS_SCHEDULE && r->config.piece_bytes > 0 && !r->config.comm_hook;
}