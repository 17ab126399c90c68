/* fp16/bf16 communication hooks: a bucket is rounded to half precision, allreduced on the half
 * dtype (the group sums half values in f32 and rounds once) and widened back, all in one task on
 * the group's progress thread. Also ddp_hook_error, the error helper for hook writers. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/half.h"
#include "core/internal.h"
#include "ddp/hooks.h"

/* One per bucket index: the half copy of that bucket and what the task needs to know. A bucket's
 * next reduction starts only after the previous one completed (the reducer finalizes in
 * between), so the slot is never used twice at once; buckets in flight together use different
 * slots. The slot array is reallocated on the caller's thread while tasks run, which is safe
 * because a task holds its slot's address, never the array. */
typedef struct half_slot {
    uint16_t *wire;
    size_t capacity; /* elements */
    void *data;      /* the bucket being reduced */
    size_t numel;
    ddp_dtype_t dtype;
    ddp_dtype_t wire_dtype;
} half_slot_t;

struct ddp_half_hook_state {
    ddp_dtype_t wire_dtype;
    half_slot_t **slots;
    size_t nslots;
    ddp_hook_stats_t stats;
};

ddp_status_t ddp_hook_error(ddp_status_t status, const char *fmt, ...)
{
    char text[DDP_ERROR_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    text[0] = '\0';
    /* Not `fmt ? fmt : ""`: clang's -Wformat-zero-length rejects the empty format. */
    if (fmt) vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    /* DDP_OK only sets the text (not logged as an error): libraries of hooks outside libddp,
     * which cannot reach ddp__clear_error, call ddp_hook_error(DDP_OK, "%s", "") on entry so a
     * success leaves no stale text (status.h). */
    if (status == DDP_OK) {
        ddp__set_error_text(text);
        return DDP_OK;
    }
    return ddp__error(status, "%s", text);
}

ddp_status_t ddp_half_hook_state_create(ddp_dtype_t wire_dtype, ddp_half_hook_state_t **out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "half hook state: out is NULL");
    if (wire_dtype != DDP_F16 && wire_dtype != DDP_BF16)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "half hook state: wire_dtype is %s (%d), expected f16 or bf16",
                          ddp_dtype_name(wire_dtype), (int)wire_dtype);
    ddp_half_hook_state_t *s = ddp__calloc(1, sizeof *s, "half hook state");
    if (!s) return DDP_ERR_NO_MEMORY;
    s->wire_dtype = wire_dtype;
    *out = s;
    return DDP_OK;
}

void ddp_half_hook_state_destroy(ddp_half_hook_state_t *state)
{
    if (!state) return;
    for (size_t i = 0; i < state->nslots; i++) {
        if (state->slots[i]) free(state->slots[i]->wire);
        free(state->slots[i]);
    }
    free(state->slots);
    free(state);
}

ddp_status_t ddp_half_hook_stats(const ddp_half_hook_state_t *state, ddp_hook_stats_t *out)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    if (!state) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "half hook stats: state is NULL");
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "half hook stats: out is NULL");
    *out = state->stats;
    return DDP_OK;
}

static uint16_t to_half(ddp_dtype_t wire, float x)
{
    return wire == DDP_F16 ? ddp_f32_to_f16(x) : ddp_f32_to_bf16(x);
}

static float from_half(ddp_dtype_t wire, uint16_t h)
{
    return wire == DDP_F16 ? ddp_f16_to_f32(h) : ddp_bf16_to_f32(h);
}

/* On the progress thread: round, allreduce inline, widen. An f64 bucket is first rounded to f32
 * (half precision is far coarser, so this adds no visible error). */
static ddp_status_t half_task(ddp_group_t *group, void *arg)
{
    half_slot_t *slot = arg;
    size_t n = slot->numel;
    if (slot->dtype == DDP_F32) {
        ddp__f32_to_half(slot->wire_dtype, slot->data, slot->wire, n);
    } else {
        const double *src = slot->data;
        for (size_t i = 0; i < n; i++) slot->wire[i] = to_half(slot->wire_dtype, (float)src[i]);
    }
    ddp_status_t s = ddp_group_allreduce(group, slot->wire, slot->wire, n, slot->wire_dtype,
                                         DDP_SUM);
    if (s != DDP_OK) return s;
    if (slot->dtype == DDP_F32) {
        ddp__half_to_f32(slot->wire_dtype, slot->wire, slot->data, n);
    } else {
        double *dst = slot->data;
        for (size_t i = 0; i < n; i++) dst[i] = from_half(slot->wire_dtype, slot->wire[i]);
    }
    return DDP_OK;
}

static ddp_status_t slot_for(ddp_half_hook_state_t *st, size_t index, size_t numel,
                             half_slot_t **out)
{
    if (index >= st->nslots) {
        size_t n = index + 1;
        half_slot_t **grown = realloc(st->slots, n * sizeof *grown);
        if (!grown)
            return ddp__error(DDP_ERR_NO_MEMORY, "half hook: out of memory for bucket %zu",
                              index);
        for (size_t i = st->nslots; i < n; i++) grown[i] = NULL;
        st->slots = grown;
        st->nslots = n;
    }
    half_slot_t *slot = st->slots[index];
    if (!slot) {
        slot = ddp__calloc(1, sizeof *slot, "half hook bucket slot");
        if (!slot) return DDP_ERR_NO_MEMORY;
        st->slots[index] = slot;
    }
    if (slot->capacity < numel) {
        /* Bucket layouts change once (the reducer's rebuild); grow to the new size. */
        uint16_t *wire = malloc(numel * sizeof *wire);
        if (!wire)
            return ddp__error(DDP_ERR_NO_MEMORY,
                              "half hook: out of memory for the %zu-element half copy of "
                              "bucket %zu",
                              numel, index);
        free(slot->wire);
        slot->wire = wire;
        slot->capacity = numel;
    }
    *out = slot;
    return DDP_OK;
}

static ddp_status_t half_hook(ddp_dtype_t wire, const char *name, void *state,
                              ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                              ddp_work_t **work)
{
    ddp_half_hook_state_t *st = state;
    if (!st)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s hook: state is NULL (create it with ddp_half_hook_state_create)",
                          name);
    if (st->wire_dtype != wire)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s hook: state was created for %s, not %s", name,
                          ddp_dtype_name(st->wire_dtype), ddp_dtype_name(wire));
    if (!group) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s hook: group is NULL", name);
    if (!bucket) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s hook: bucket is NULL", name);
    if (!work) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s hook: work is NULL", name);
    if (bucket->numel > 0 && !bucket->data)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s hook: bucket %zu has %zu elements but "
                          "no data", name, bucket->index, bucket->numel);
    size_t esize = ddp_dtype_size(bucket->dtype);
    if (esize == 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s hook: bucket %zu has dtype %d, which is not a ddp_dtype_t", name,
                          bucket->index, (int)bucket->dtype);
    if (bucket->numel > SIZE_MAX / esize)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s hook: bucket %zu: numel %zu of %s overflows a byte count", name,
                          bucket->index, bucket->numel, ddp_dtype_name(bucket->dtype));
    if (bucket->dtype == DDP_F16 || bucket->dtype == DDP_BF16) {
        /* Already half precision: nothing to compress. */
        st->stats.buckets++;
        st->stats.numel += bucket->numel;
        st->stats.bytes_before += bucket->numel * esize;
        st->stats.bytes_after += bucket->numel * esize;
        return ddp_group_allreduce_async(group, bucket->data, bucket->data, bucket->numel,
                                         bucket->dtype, DDP_SUM, work);
    }
    if (bucket->dtype != DDP_F32 && bucket->dtype != DDP_F64)
        return ddp__error(DDP_ERR_UNSUPPORTED,
                          "%s hook: bucket %zu has dtype %s; only f32, f64, f16 and bf16 "
                          "gradients can be reduced",
                          name, bucket->index, ddp_dtype_name(bucket->dtype));
    half_slot_t *slot = NULL;
    ddp_status_t s = slot_for(st, bucket->index, bucket->numel, &slot);
    if (s != DDP_OK) return s;
    slot->data = bucket->data;
    slot->numel = bucket->numel;
    slot->dtype = bucket->dtype;
    slot->wire_dtype = wire;
    s = ddp_group_submit(group, half_task, slot, work);
    if (s != DDP_OK) return s;
    st->stats.buckets++;
    st->stats.numel += bucket->numel;
    st->stats.bytes_before += bucket->numel * esize;
    st->stats.bytes_after += bucket->numel * sizeof(uint16_t);
    return DDP_OK;
}

ddp_status_t ddp_hook_fp16(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                           ddp_work_t **work)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    return half_hook(DDP_F16, "fp16", state, group, bucket, work);
}

ddp_status_t ddp_hook_bf16(void *state, ddp_group_t *group, const ddp_comm_bucket_t *bucket,
                           ddp_work_t **work)
{
    ddp__clear_error(); /* status.h: no stale text after a success */
    return half_hook(DDP_BF16, "bf16", state, group, bucket, work);
}
