/* Coalesced broadcast from rank 0, after c10d's broadcast_coalesced: used at create (parameters
 * and buffers, 250 MiB chunks) and at every prepare (buffers).
 *
 * Many small tensors would each pay a collective's latency, so tensors of one dtype are packed in
 * order into a flat staging chunk of at most bucket_bytes, the chunk is broadcast, and non-root
 * ranks unpack it. Two staging chunks alternate so that packing/unpacking one overlaps the
 * broadcast of the other (at most two in flight). A tensor larger than a chunk is broadcast
 * alone, in place. */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "reducer/reducer_internal.h"

typedef struct in_flight {
    ddp_work_t *work;
    unsigned char *staging; /* NULL: an in-place broadcast of one tensor */
    size_t first, end;      /* members: positions in the grouped order */
} in_flight_t;

typedef struct coalescer {
    ddp_group_t *group;
    int rank;
    const ddp__tensor_ref_t *tensors;
    size_t *grouped; /* tensor indices grouped by dtype, each group in the given order */
    in_flight_t slots[2];
    size_t head, count; /* FIFO of at most two */
    size_t issued;      /* items issued so far: item k uses staging[k % 2] */
    unsigned char *staging[2];
    ddp_status_t first_error;
    char error_text[DDP_ERROR_TEXT_MAX];
} coalescer_t;

static void note_error(coalescer_t *c, ddp_status_t status)
{
    if (status == DDP_OK || c->first_error != DDP_OK) return;
    c->first_error = status;
    snprintf(c->error_text, sizeof c->error_text, "%s", ddp_last_error());
}

static void complete_oldest(coalescer_t *c)
{
    in_flight_t *f = &c->slots[c->head];
    ddp_status_t status = ddp_work_wait(f->work);
    note_error(c, status);
    ddp_work_free(f->work);
    f->work = NULL;
    if (status == DDP_OK && f->staging && c->rank != 0) {
        size_t offset = 0;
        for (size_t k = f->first; k < f->end; k++) {
            const ddp__tensor_ref_t *t = &c->tensors[c->grouped[k]];
            size_t bytes = t->numel * ddp_dtype_size(t->dtype);
            memcpy(t->data, f->staging + offset, bytes);
            offset += bytes;
        }
    }
    c->head ^= 1;
    c->count--;
}

/* Issues one item: members [first, end) packed into the next staging chunk, or (staged = 0) the
 * single tensor at `first` in place. */
static void issue(coalescer_t *c, size_t first, size_t end, int staged)
{
    if (c->first_error != DDP_OK) return;
    if (c->count == 2) complete_oldest(c);
    if (c->first_error != DDP_OK) return;
    unsigned char *staging = staged ? c->staging[c->issued % 2] : NULL;
    const ddp__tensor_ref_t *head = &c->tensors[c->grouped[first]];
    void *buf = head->data;
    size_t count = head->numel;
    if (staged) {
        size_t offset = 0;
        for (size_t k = first; k < end; k++) {
            const ddp__tensor_ref_t *t = &c->tensors[c->grouped[k]];
            size_t bytes = t->numel * ddp_dtype_size(t->dtype);
            if (c->rank == 0) memcpy(staging + offset, t->data, bytes);
            offset += bytes;
        }
        buf = staging;
        count = offset / ddp_dtype_size(head->dtype);
    }
    ddp_work_t *work = NULL;
    ddp_status_t status = ddp_group_broadcast_async(c->group, buf, count, head->dtype, 0, &work);
    if (status != DDP_OK) {
        note_error(c, status);
        return;
    }
    in_flight_t *f = &c->slots[(c->head + c->count) % 2];
    f->work = work;
    f->staging = staging;
    f->first = first;
    f->end = end;
    c->count++;
    c->issued++;
}

ddp_status_t ddp__broadcast_coalesced(ddp_group_t *group, const ddp__tensor_ref_t *tensors,
                                      size_t ntensors, size_t bucket_bytes)
{
    if (ntensors == 0) return DDP_OK;
    if (bucket_bytes == 0) bucket_bytes = 1;
    coalescer_t c;
    memset(&c, 0, sizeof c);
    c.group = group;
    c.rank = ddp_group_rank(group);
    c.tensors = tensors;
    c.grouped = ddp__malloc(ntensors * sizeof(size_t), "broadcast order");
    if (!c.grouped) return DDP_ERR_NO_MEMORY;

    /* Group by dtype (order kept within a dtype), skip empty tensors, and size the staging
     * chunks: no larger than the largest run that can actually be coalesced. */
    size_t n = 0, coalescible = 0;
    for (int d = 0; d < DDP_DTYPE_COUNT; d++) {
        for (size_t i = 0; i < ntensors; i++) {
            if ((int)tensors[i].dtype != d || tensors[i].numel == 0) continue;
            c.grouped[n++] = i;
            size_t bytes = tensors[i].numel * ddp_dtype_size(tensors[i].dtype);
            if (bytes <= bucket_bytes) coalescible += bytes;
        }
    }
    size_t staging_bytes = coalescible < bucket_bytes ? coalescible : bucket_bytes;
    if (staging_bytes > 0) {
        for (int s = 0; s < 2; s++) {
            c.staging[s] = ddp__malloc(staging_bytes, "broadcast staging");
            if (!c.staging[s]) {
                free(c.staging[0]);
                free(c.grouped);
                return DDP_ERR_NO_MEMORY;
            }
        }
    }

    size_t first = 0, bytes = 0;
    for (size_t k = 0; k < n; k++) {
        const ddp__tensor_ref_t *t = &tensors[c.grouped[k]];
        size_t tb = t->numel * ddp_dtype_size(t->dtype);
        int dtype_changes = k > first && tensors[c.grouped[first]].dtype != t->dtype;
        if (k > first && (dtype_changes || bytes + tb > bucket_bytes || tb > bucket_bytes)) {
            issue(&c, first, k, 1);
            first = k;
            bytes = 0;
        }
        if (tb > bucket_bytes) {
            issue(&c, k, k + 1, 0);
            first = k + 1;
            continue;
        }
        bytes += tb;
    }
    if (first < n) issue(&c, first, n, 1);
    while (c.count > 0) complete_oldest(&c);

    free(c.staging[0]);
    free(c.staging[1]);
    free(c.grouped);
    if (c.first_error != DDP_OK) {
        ddp__set_error_text(c.error_text);
        return ddp__error_context(c.first_error, "broadcast of parameters/buffers from rank 0");
    }
    return DDP_OK;
}
