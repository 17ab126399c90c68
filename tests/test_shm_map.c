/* Registered user memory on shm (ddp_group_register_memory, the "mapped" allreduce; issue #18):
 * malloc'd buffers registered on every rank are reduced in place in each other's memory, with
 * the same bytes as the other paths; anything less than every rank registered falls back.
 *
 *   variants    registered malloc'd buffers at ptr % 4096 = 0, 16, 4092 (the same on every rank,
 *               and a different one per rank), 64 KiB, 1 MiB + 12 B and 8 MiB + 4 B, f32 sum,
 *               f16 sum, bf16 sum, f64 max, i32 avg, in place and not: "mapped" ran, the bytes
 *               equal the same call on unregistered copies (the usual path) made right after,
 *               f32 sums equal a rank-order sum computed here, every rank has the same bytes,
 *               and the bytes around the buffers are untouched. A sub-range of a registered
 *               block is mapped too. World 1: registration works, whatever algorithm runs.
 *   fallback    only rank 1 registers: nobody runs "mapped", results correct; then every rank
 *               registers the same buffers: "mapped". DDP_SHM_MAP=off on rank 1 only: its
 *               memory is left alone and nobody runs "mapped".
 *   unregister  the bytes after unregistering are those before; the pages are private again;
 *               later allreduces are not "mapped" and correct; registering again maps again;
 *               one rank unregistering makes everyone fall back; 40 register/unregister cycles
 *               (more than any table of registrations) all map; registering other memory while
 *               a mapped allreduce runs leaves it mapped and correct.
 *   errors      NULL / 0 / overlapping ranges, unknown pointers (DDP_ERR_INVALID_ARGUMENT), a
 *               read-only mapping, a MAP_SHARED file mapping, a range with no whole page
 *               (DDP_ERR_UNSUPPORTED), too many registrations (UNSUPPORTED if refused at all):
 *               each with a message, nothing changed, the group still works. On tcp both calls
 *               succeed and do nothing.
 *   fork        after registering, a forked child gets a private copy: it sees the parent's
 *               pre-fork bytes, its writes do not reach the parent nor the parent's its own;
 *               the same for a registered mapping mremap grew (no longer the export).
 *   tuned       the tuner settled on one-shot at 64 KiB, then the buffers are registered: from
 *               the second registered call on, every call is mapped.
 *   kill        a rank SIGKILLs itself inside a series of 64 MiB mapped allreduces: the others
 *               fail with an error naming it within the timeout, and no segment is left behind.
 *   auto        DDP_SHM_MAP=auto (the default; every other mode pins "on"): a malloc'd buffer is
 *               registered by libddp the second time it comes (mapped from then on), a freed
 *               one and temporaries stay correct, out of place too, a forked child's writes stay
 *               its own, a caller's registration takes an automatic one over, and peers drop
 *               their views of a registration whose memory was unmapped. Exit 77 (skipped)
 *               where libddp cannot register by itself (sanitizers' malloc, old kernels).
 *   pulled      broadcast, allgather, alltoall and reduce_scatter from sources registered on
 *               every rank (issue #27): "mapped" from the first call, the right bytes (reduce-
 *               scatter: those of the usual path) at page offsets 0, 16, 4092 and one per rank,
 *               64 KiB and 1 MiB (8 MiB at the per-rank offsets), f32/bf16/f64, in place and
 *               not, every root, guards and an out-of-place input untouched; rank 1
 *               unregistered: nobody mapped, right bytes; registered again: mapped again within
 *               64 calls and from then on.
 *   apply       reduce_scatter_apply with send and recv registered on every rank: "mapped"
 *               from the first call, the bytes of reduce_scatter + the function + allgather,
 *               the function given this rank's block in order, at the offsets above, in place
 *               and not; rank 1 unregistered, small and empty calls: the usual path.
 *   writers     (world 1) libddp gives up a registration of its own, 400 times, while another
 *               thread writes into its pages: every one of those writes remains; a child
 *               forked after gets those pages private.
 *   watch       registered memory taken away behind libddp's back (munmap, munmap by another
 *               thread, mmap MAP_FIXED over it, mremap away, free) and private memory at the
 *               same address (malloc's for free): the next allreduce is correct and not
 *               "mapped"; where the kernel can watch (a userfaultfd probe of its own),
 *               registrations are watched, ten mapped calls ask the kernel at most once, and
 *               the watch heard of each change when it returned; a forked child's own
 *               registration is watched by a watch of its own; a process whose main thread
 *               registers and calls pthread_exit exits; unregistering and registering again,
 *               three times.
 *   small       registered buffers below the one-shot size (issue #27): allreduce from 2 KiB a
 *               rank to 16 KiB (f32 sum, bf16 sum, f64 max; whole pages, and edges at offset
 *               16) "mapped" from the second call, with the bytes of an unregistered call;
 *               half that size not; broadcast, allgather, alltoall and reduce_scatter (f32,
 *               bf16) mapped from 8 KiB at 2 ranks (8 KiB a rank at more), not at half that;
 *               DDP_SHM_ONESHOT_BYTES set keeps one-shot up to it; DDP_SHM_MAP=auto maps a
 *               page-aligned buffer of the smallest size from its third call.
 * Usage: test_shm_map <world> variants|fallback|unregister|errors|fork|tuned|auto|kill|pulled|
 *        apply|writers|watch|small */
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "transport/shm/shm.h"
#include "transport/shm/shm_map.h"
#include "transport/shm/shm_watch.h"

#define PAGE 4096

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static int is_mapped(ddp_group_t *g) { return strcmp(ddp_group_algorithm(g), "mapped") == 0; }

/* Every rank's value through an allgather: they must all be equal. */
static void check_same_everywhere(ddp_group_t *g, uint64_t v, const char *what, int k)
{
    int world = ddp_group_size(g);
    int64_t all[64], mine = (int64_t)v;
    CHECK(world <= 64);
    CHECK_OK(ddp_group_allgather(g, &mine, all, 1, DDP_I64));
    for (int r = 0; r < world; r++)
        CHECK_MSG(all[r] == mine, "%s of case %d: rank %d has %llx, rank %d %llx", what, k, r,
                  (unsigned long long)all[r], ddp_group_rank(g), (unsigned long long)mine);
}

/* Whether the page holding `addr` is mapped from a memfd, from /proc/self/maps (registered pages
 * are, in place; private anonymous memory has no path). */
static int page_is_memfd(const void *addr)
{
    FILE *f = fopen("/proc/self/maps", "r");
    CHECK(f);
    char line[1024];
    int found = -1;
    uintptr_t a = (uintptr_t)addr;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo = 0, hi = 0;
        if (sscanf(line, "%lx-%lx", &lo, &hi) != 2) continue;
        if (a >= lo && a < hi) {
            found = strstr(line, "memfd:") != NULL;
            break;
        }
    }
    fclose(f);
    CHECK_MSG(found >= 0, "%p is not mapped at all", addr);
    return found;
}

static ddp_group_t *make_group(int rank, int world, ddp_store_t *store, const char *name,
                               const char *transport, int timeout_ms)
{
    ddp_group_options_t options;
    ddp_group_options_init(&options);
    options.name = name;
    options.transport = transport;
    options.timeout_ms = timeout_ms;
    ddp_group_t *g = NULL;
    CHECK_OK(ddp_group_create(store, rank, world, &options, &g));
    return g;
}

/* A malloc'd buffer `at` = offset bytes past a page boundary, with 64 guard bytes (0xA5) on both
 * sides that no collective may touch. */
typedef struct user_buf {
    char *base, *at;
    size_t bytes;
} user_buf_t;

static user_buf_t buf_alloc(size_t offset, size_t bytes)
{
    user_buf_t b = {NULL, NULL, bytes};
    size_t total = (PAGE + offset + bytes + PAGE + PAGE - 1) / PAGE * PAGE;
    b.base = aligned_alloc(PAGE, total);
    CHECK(b.base);
    b.at = b.base + PAGE + offset;
    memset(b.at - 64, 0xA5, 64);
    memset(b.at + bytes, 0xA5, 64);
    return b;
}

static void buf_check_guards(const user_buf_t *b, const char *what, int k)
{
    for (int i = 0; i < 64; i++) {
        CHECK_MSG((unsigned char)b->at[-1 - i] == 0xA5, "%s of case %d: byte %d before it changed",
                  what, k, i + 1);
        CHECK_MSG((unsigned char)b->at[b->bytes + (size_t)i] == 0xA5,
                  "%s of case %d: byte %d past its end changed", what, k, i);
    }
}

/* ---- variants ------------------------------------------------------------------------------ */

typedef struct {
    ddp_dtype_t dtype;
    ddp_reduce_op_t op;
    const char *name;
} type_t;

static const type_t types[] = {{DDP_F32, DDP_SUM, "f32 sum"},
                               {DDP_F16, DDP_SUM, "f16 sum"},
                               {DDP_BF16, DDP_SUM, "bf16 sum"},
                               {DDP_F64, DDP_MAX, "f64 max"},
                               {DDP_I32, DDP_AVG, "i32 avg"}};
#define NTYPES ((int)(sizeof types / sizeof *types))

static const size_t offsets[3] = {0, 16, 4092};
static const size_t sizes[3] = {64u << 10, (1u << 20) + 12, (8u << 20) + 4};

/* f32 sums: every element equals the rank-order sum of the inputs. */
static void check_f32_sum(const float *got, size_t count, int world, int k, const char *what)
{
    for (size_t i = 0; i < count; i++) {
        float want = ddp_test_input_f32(0, i, k);
        for (int r = 1; r < world; r++) want += ddp_test_input_f32(r, i, k);
        CHECK_MSG(memcmp(&got[i], &want, sizeof want) == 0,
                  "%s, case %d, element %zu: %.9g, want %.9g", what, k, i, got[i], want);
    }
}

/* One allreduce on registered buffers of this rank (send at offset `send_off`, recv at
 * `recv_off`; in place: recv only), then the same call on unregistered copies: the same bytes,
 * "mapped" for the first (world > 1), not for the second. */
static void run_case(ddp_group_t *g, const type_t *t, size_t bytes_wanted, size_t send_off,
                     size_t recv_off, int inplace, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(t->dtype);
    size_t count = (bytes_wanted + es - 1) / es, bytes = count * es;
    send_off -= send_off % es; /* element-aligned, as C requires */
    recv_off -= recv_off % es;
    char what[160];
    snprintf(what, sizeof what, "%s, %zu bytes, offsets %zu/%zu, %s", t->name, bytes, send_off,
             recv_off, inplace ? "in place" : "out of place");

    user_buf_t recv = buf_alloc(recv_off, bytes), send = {0};
    if (!inplace) send = buf_alloc(send_off, bytes);
    char *input = inplace ? recv.at : send.at;
    ddp_test_fill(input, t->dtype, rank, count, k);
    if (!inplace) memset(recv.at, 0x5A, bytes);
    /* The unregistered copies, filled the same way. */
    user_buf_t plain = buf_alloc(recv_off, bytes), plain_send = {0};
    if (!inplace) plain_send = buf_alloc(send_off, bytes);
    memcpy(inplace ? plain.at : plain_send.at, input, bytes);
    if (!inplace) memset(plain.at, 0x5A, bytes);

    CHECK_OK(ddp_group_register_memory(g, recv.at, bytes));
    if (!inplace) CHECK_OK(ddp_group_register_memory(g, send.at, bytes));
    /* Registration keeps the bytes. */
    CHECK_MSG(memcmp(input, inplace ? plain.at : plain_send.at, bytes) == 0,
              "%s: registering changed the input", what);

    CHECK_OK(ddp_group_allreduce(g, input, recv.at, count, t->dtype, t->op));
    if (world > 1)
        CHECK_MSG(is_mapped(g), "%s, case %d: registered on every rank, yet ran %s", what, k,
                  ddp_group_algorithm(g));
    CHECK_OK(ddp_group_allreduce(g, inplace ? plain.at : plain_send.at, plain.at, count,
                                 t->dtype, t->op));
    CHECK_MSG(!is_mapped(g), "%s, case %d: unregistered buffers ran \"mapped\"", what, k);

    buf_check_guards(&recv, what, k);
    buf_check_guards(&plain, what, k);
    if (!inplace) {
        buf_check_guards(&send, what, k);
        /* Out of place, the input stays as it was. */
        CHECK_MSG(memcmp(send.at, plain_send.at, bytes) == 0, "%s, case %d: the input changed",
                  what, k);
    }
    if (memcmp(recv.at, plain.at, bytes) != 0) {
        size_t i = 0;
        while (i < bytes && recv.at[i] == plain.at[i]) i++;
        CHECK_MSG(0, "%s, case %d: mapped differs from the usual path first at byte %zu of %zu",
                  what, k, i, bytes);
    }
    if (t->dtype == DDP_F32 && t->op == DDP_SUM)
        check_f32_sum((const float *)recv.at, count, world, k, what);
    check_same_everywhere(g, hash_bytes(recv.at, bytes), what, k);

    CHECK_OK(ddp_group_unregister_memory(g, recv.at));
    if (!inplace) CHECK_OK(ddp_group_unregister_memory(g, send.at));
    /* Unregistering keeps the result. */
    CHECK_MSG(memcmp(recv.at, plain.at, bytes) == 0, "%s: unregistering changed the result", what);
    free(recv.base);
    free(plain.base);
    if (!inplace) {
        free(send.base);
        free(plain_send.base);
    }
}

/* A sub-range of one registered block (in place, and out of place between two parts of it). */
static void run_subrange(ddp_group_t *g, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    const size_t block_count = 2u << 20, off = 1000, count = 300000;
    float *block = malloc(block_count * sizeof(float)), *plain = malloc(block_count * sizeof(float));
    CHECK(block && plain);
    memset(block, 0, block_count * sizeof(float));
    CHECK_OK(ddp_group_register_memory(g, block, block_count * sizeof(float)));
    for (int inplace = 1; inplace >= 0; inplace--, k++) {
        float *send = block + off, *recv = inplace ? send : block + 1000003;
        ddp_test_fill(send, DDP_F32, rank, count, k);
        memcpy(plain, block, block_count * sizeof(float));
        CHECK_OK(ddp_group_allreduce(g, send, recv, count, DDP_F32, DDP_SUM));
        if (world > 1)
            CHECK_MSG(is_mapped(g), "sub-range of a registered block (in place %d) ran %s",
                      inplace, ddp_group_algorithm(g));
        check_f32_sum(recv, count, world, k, inplace ? "sub-range in place" : "sub-range");
        /* Nothing else of the block changed. */
        size_t r0 = (size_t)(recv - block);
        CHECK(memcmp(block, plain, r0 * sizeof(float)) == 0);
        CHECK(memcmp(recv + count, plain + r0 + count,
                     (block_count - r0 - count) * sizeof(float)) == 0);
        check_same_everywhere(g, hash_bytes(recv, count * sizeof(float)), "sub-range", k);
    }
    CHECK_OK(ddp_group_unregister_memory(g, block));
    free(block);
    free(plain);
}

static int rank_variants(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "variants", NULL, 0);
    int k = 0;
    /* Offset patterns 0-2: the same offset on every rank; 3: each rank its own. */
    for (int pattern = 0; pattern < 4; pattern++) {
        size_t off = pattern < 3 ? offsets[pattern] : offsets[rank % 3];
        size_t send_off = pattern < 3 ? off : offsets[(rank + 1) % 3];
        for (int s = 0; s < 3; s++)
            for (int t = 0; t < NTYPES; t++)
                for (int inplace = 0; inplace < 2; inplace++)
                    run_case(g, &types[t], sizes[s], send_off, off, inplace, k++);
    }
    run_subrange(g, k);
    ddp_group_destroy(g);
    return 0;
}

/* ---- pulled: broadcast and allgather from registered memory -------------------------------- */

static const type_t pull_types[] = {{DDP_F32, DDP_SUM, "f32"}, {DDP_BF16, DDP_SUM, "bf16"},
                                    {DDP_F64, DDP_SUM, "f64"}};

/* One broadcast (kind 0, root `root`) or allgather (kind 1) of `count` elements per rank from
 * registered buffers at `off` bytes past a page (in place: the allgather's send is this rank's
 * block of recv; the broadcast is always in place). Checks the bytes against each rank's input,
 * the guards, an out-of-place send unchanged; returns whether "mapped" ran (the same on every
 * rank). `reg`: register this rank's buffers. */
static int pull_case(ddp_group_t *g, int kind, const type_t *t, size_t count, size_t off,
                     int inplace, int root, int reg, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(t->dtype), bytes = count * es;
    size_t total = kind ? bytes * (size_t)world : bytes;
    off -= off % es;
    char what[160];
    snprintf(what, sizeof what, "%s %s, %zu elements per rank, offset %zu, %s%s",
             kind ? "allgather" : "broadcast", t->name, count, off,
             inplace ? "in place" : "out of place", reg ? "" : ", this rank unregistered");
    user_buf_t recv = buf_alloc(off, total), send = {0};
    char *want = malloc(total), *in = malloc(bytes);
    CHECK(want && in);
    if (kind == 0) {
        ddp_test_fill(want, t->dtype, root, count, k);
        ddp_test_fill(recv.at, t->dtype, rank, count, k); /* the root's is the input */
    } else {
        for (int r = 0; r < world; r++)
            ddp_test_fill(want + (size_t)r * bytes, t->dtype, r, count, k);
        memset(recv.at, 0x5A, total);
        if (!inplace) send = buf_alloc((off + 64) % PAGE, bytes);
        ddp_test_fill(inplace ? recv.at + (size_t)rank * bytes : send.at, t->dtype, rank, count, k);
        memcpy(in, inplace ? recv.at + (size_t)rank * bytes : send.at, bytes);
    }
    if (reg) {
        CHECK_OK(ddp_group_register_memory(g, recv.at, total));
        if (send.at) CHECK_OK(ddp_group_register_memory(g, send.at, bytes));
    }
    if (kind == 0)
        CHECK_OK(ddp_group_broadcast(g, recv.at, count, t->dtype, root));
    else
        CHECK_OK(ddp_group_allgather(g, inplace ? recv.at + (size_t)rank * bytes : send.at,
                                     recv.at, count, t->dtype));
    int mapped = is_mapped(g);
    if (memcmp(recv.at, want, total) != 0) {
        size_t i = 0;
        while (i < total && recv.at[i] == want[i]) i++;
        CHECK_MSG(0, "%s, case %d (%s): wrong from byte %zu of %zu", what, k,
                  ddp_group_algorithm(g), i, total);
    }
    buf_check_guards(&recv, what, k);
    if (send.at) {
        buf_check_guards(&send, what, k);
        CHECK_MSG(memcmp(send.at, in, bytes) == 0, "%s, case %d: the input changed", what, k);
    }
    check_same_everywhere(g, (uint64_t)mapped, what, k);
    if (reg) {
        CHECK_OK(ddp_group_unregister_memory(g, recv.at));
        if (send.at) CHECK_OK(ddp_group_unregister_memory(g, send.at));
    }
    free(recv.base);
    if (send.base) free(send.base);
    free(want);
    free(in);
    return mapped;
}

/* One alltoall of `count` elements per block from a registered send at `off` bytes past a page
 * into an unregistered recv: block k of recv is rank k's block `rank`; guards and send intact.
 * Returns whether "mapped" ran (the same on every rank). */
static int alltoall_case(ddp_group_t *g, const type_t *t, size_t count, size_t off, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(t->dtype), block = count * es, total = block * (size_t)world;
    off -= off % es;
    user_buf_t send = buf_alloc(off, total), recv = buf_alloc((off + 128) % PAGE, total);
    char *want = malloc(total), *in = malloc(total);
    CHECK(want && in);
    for (int j = 0; j < world; j++) {
        ddp_test_fill(send.at + (size_t)j * block, t->dtype, rank * world + j, count, k);
        ddp_test_fill(want + (size_t)j * block, t->dtype, j * world + rank, count, k);
    }
    memcpy(in, send.at, total);
    memset(recv.at, 0x5A, total);
    CHECK_OK(ddp_group_register_memory(g, send.at, total));
    CHECK_OK(ddp_group_alltoall(g, send.at, recv.at, count, t->dtype));
    int mapped = is_mapped(g);
    char what[96];
    snprintf(what, sizeof what, "alltoall %s, %zu per block, offset %zu", t->name, count, off);
    CHECK_MSG(memcmp(recv.at, want, total) == 0, "%s, case %d (%s): wrong bytes", what, k,
              ddp_group_algorithm(g));
    CHECK_MSG(memcmp(send.at, in, total) == 0, "%s, case %d: the input changed", what, k);
    buf_check_guards(&send, what, k);
    buf_check_guards(&recv, what, k);
    check_same_everywhere(g, (uint64_t)mapped, what, k);
    CHECK_OK(ddp_group_unregister_memory(g, send.at));
    free(send.base);
    free(recv.base);
    free(want);
    free(in);
    return mapped;
}

/* One reduce-scatter (sum) of `count` elements per block from a registered send at `off` bytes
 * past a page (in place: recv is this rank's block of it), then the same call on unregistered
 * copies: the same bytes, send intact out of place, guards intact. Returns whether the first
 * went "mapped" (the same on every rank); the second must not. */
static int reduce_scatter_case(ddp_group_t *g, const type_t *t, size_t count, size_t off,
                               int inplace, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(t->dtype), block = count * es, total = block * (size_t)world;
    off -= off % es;
    user_buf_t send = buf_alloc(off, total), recv = {0};
    user_buf_t plain = buf_alloc(off, total), plain_recv = {0};
    ddp_test_fill(send.at, t->dtype, rank, count * (size_t)world, k);
    memcpy(plain.at, send.at, total);
    if (!inplace) {
        recv = buf_alloc((off + 128) % PAGE, block);
        plain_recv = buf_alloc((off + 128) % PAGE, block);
        memset(recv.at, 0x5A, block);
        memset(plain_recv.at, 0x5A, block);
    }
    char *out = inplace ? send.at + (size_t)rank * block : recv.at;
    char *plain_out = inplace ? plain.at + (size_t)rank * block : plain_recv.at;
    CHECK_OK(ddp_group_register_memory(g, send.at, total));
    CHECK_OK(ddp_group_reduce_scatter(g, send.at, out, count, t->dtype, DDP_SUM));
    int mapped = is_mapped(g);
    char what[112];
    snprintf(what, sizeof what, "reduce_scatter %s, %zu per block, offset %zu, %s", t->name,
             count, off, inplace ? "in place" : "out of place");
    CHECK_OK(ddp_group_reduce_scatter(g, plain.at, plain_out, count, t->dtype, DDP_SUM));
    CHECK_MSG(!is_mapped(g), "%s, case %d: unregistered buffers ran \"mapped\"", what, k);
    CHECK_MSG(memcmp(out, plain_out, block) == 0, "%s, case %d: mapped differs from the usual "
              "path", what, k);
    if (!inplace) {
        CHECK_MSG(memcmp(send.at, plain.at, total) == 0, "%s, case %d: the input changed", what,
                  k);
        buf_check_guards(&recv, what, k);
    }
    buf_check_guards(&send, what, k);
    check_same_everywhere(g, (uint64_t)mapped, what, k);
    CHECK_OK(ddp_group_unregister_memory(g, send.at));
    free(send.base);
    free(plain.base);
    if (!inplace) {
        free(recv.base);
        free(plain_recv.base);
    }
    return mapped;
}

/* Registered on every rank: "mapped" from the first call, right bytes, at page offsets 0, 16
 * and 4092 (edges staged) and one per rank, 64 KiB (the smallest that may go mapped) to 8 MiB,
 * in place and not, every root. Rank 1 unregistered: nobody goes mapped, right bytes; registered
 * again everywhere: mapped again within the calls of one retry period, and from then on. */
static int rank_pulled(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "pulled", NULL, 0);
    static const size_t bytes_per_rank[3] = {64u << 10, (1u << 20) + 8, (8u << 20) + 16};
    int k = 0;
    for (int pattern = 0; pattern < 4; pattern++) {
        size_t off = pattern < 3 ? offsets[pattern] : offsets[rank % 3];
        for (int s = 0; s < 3; s++)
            for (int t = 0; t < 3; t++) {
                /* 8 MiB (streamed copies) once per dtype: the sanitizers' builds are slow */
                if (s == 2 && pattern != 3) continue;
                const type_t *ty = &pull_types[t];
                size_t count = bytes_per_rank[s] / ddp_dtype_size(ty->dtype);
                for (int inplace = 0; inplace < 2; inplace++) {
                    int m = pull_case(g, 1, ty, count, off, inplace, 0, 1, k++);
                    CHECK_MSG(world == 1 || m, "allgather, case %d: registered everywhere, yet "
                              "ran %s", k - 1, ddp_group_algorithm(g));
                }
                for (int inplace = 0; inplace < 2; inplace++)
                    CHECK_MSG(world == 1 || reduce_scatter_case(g, ty, count, off, inplace, k++),
                              "reduce_scatter, case %d: registered everywhere, yet ran %s", k - 1,
                              ddp_group_algorithm(g));
                CHECK_MSG(world == 1 || alltoall_case(g, ty, count, off, k++),
                          "alltoall, case %d: registered everywhere, yet ran %s", k - 1,
                          ddp_group_algorithm(g));
                int root = (pattern + s) % world;
                int m = pull_case(g, 0, ty, count * (size_t)world, off, 1, root, 1, k++);
                CHECK_MSG(world == 1 || m, "broadcast from %d, case %d: registered everywhere, "
                          "yet ran %s", root, k - 1, ddp_group_algorithm(g));
            }
    }
    if (world > 1) {
        /* Rank 1 unregistered: the usual way, every rank. */
        for (int i = 0; i < 3; i++) {
            CHECK_MSG(!pull_case(g, 1, &pull_types[0], 65536, 16, i % 2, 0, rank != 1, k++),
                      "allgather: rank 1 unregistered, yet mapped");
            CHECK_MSG(!pull_case(g, 0, &pull_types[0], 65536, 16, 1, world - 1, rank != 1, k++),
                      "broadcast: rank 1 unregistered, yet mapped");
        }
        /* Registered everywhere again: mapped again by the 64th call, and every call after. */
        int first = -1;
        for (int call = 0; call < 70; call++) {
            int m = pull_case(g, 1, &pull_types[0], 65536, 16, 0, 0, 1, k++);
            if (m && first < 0) first = call;
            CHECK_MSG(!(first >= 0 && !m), "allgather call %d after registering again ran %s, "
                      "having gone mapped at call %d", call, ddp_group_algorithm(g), first);
        }
        CHECK_MSG(first >= 0, "registered again: 70 allgathers, none mapped");
    }
    ddp_group_destroy(g);
    return 0;
}

/* ---- apply: reduce_scatter_apply from registered memory ------------------------------------ */

/* The function: out = old / 2 + reduced (as an optimizer reads its parameter and writes the new
 * one), recording the pieces it was given so that the test can check they tile this rank's
 * block in order. */
typedef struct apply_log {
    ddp_dtype_t dtype;
    char *recv;
    size_t next, calls; /* the element the next piece must start at; pieces so far */
    int out_of_order;
} apply_log_t;

static void halve_and_add(void *arg, size_t first, void *values, size_t n)
{
    apply_log_t *log = arg;
    if (first != log->next) log->out_of_order = 1;
    log->next = first + n;
    log->calls++;
    for (size_t i = 0; i < n; i++) {
        if (log->dtype == DDP_F32) {
            float *r = (float *)log->recv + first + i;
            *r = *r / 2 + ((float *)values)[i];
        } else {
            double *r = (double *)log->recv + first + i;
            *r = *r / 2 + ((double *)values)[i];
        }
    }
}

/* One reduce_scatter_apply (sum, count elements per block) from send into recv, both at `off`
 * bytes past a page (recv at another offset) or in place, registered on this rank if `reg`.
 * Against the usual path on unregistered copies (reduce_scatter, the same function, allgather):
 * the same bytes on every rank, pieces in order covering exactly this rank's block, guards and
 * an out-of-place send untouched. Returns whether "mapped" ran (the same on every rank). */
static int apply_case(ddp_group_t *g, const type_t *t, size_t count, size_t off, int inplace,
                      int reg, int k)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    size_t es = ddp_dtype_size(t->dtype), block = count * es, total = block * (size_t)world;
    off -= off % es;
    char what[160];
    snprintf(what, sizeof what, "reduce_scatter_apply %s, %zu per block, offset %zu, %s%s",
             t->name, count, off, inplace ? "in place" : "out of place",
             reg ? "" : ", this rank unregistered");
    user_buf_t send = buf_alloc(off, total), recv = {0};
    if (!inplace) recv = buf_alloc((off + 200) % PAGE, total);
    char *out = inplace ? send.at : recv.at;
    ddp_test_fill(send.at, t->dtype, rank, count * (size_t)world, k);
    if (!inplace) ddp_test_fill(recv.at, t->dtype, 1000, count * (size_t)world, k);
    /* The expected bytes: the usual path on copies. */
    char *in = malloc(total), *want = malloc(total), *reduced = malloc(block ? block : 1);
    CHECK(in && want && reduced);
    memcpy(in, send.at, total);
    memcpy(want, out, total);
    CHECK_OK(ddp_group_reduce_scatter(g, in, reduced, count, t->dtype, DDP_SUM));
    apply_log_t plain = {t->dtype, want, (size_t)rank * count, 0, 0};
    if (count) halve_and_add(&plain, (size_t)rank * count, reduced, count);
    CHECK_OK(ddp_group_allgather(g, want + (size_t)rank * block, want, count, t->dtype));
    if (reg) {
        CHECK_OK(ddp_group_register_memory(g, send.at, total));
        if (!inplace) CHECK_OK(ddp_group_register_memory(g, recv.at, total));
    }
    apply_log_t log = {t->dtype, out, (size_t)rank * count, 0, 0};
    CHECK_OK(ddp_group_reduce_scatter_apply(g, send.at, out, count, t->dtype, DDP_SUM,
                                            halve_and_add, &log));
    int mapped = is_mapped(g);
    CHECK_MSG(!log.out_of_order && log.next == (size_t)(rank + 1) * count &&
                  (count == 0 || log.calls > 0),
              "%s, case %d: the pieces did not tile this rank's block in order (%zu calls, "
              "ended at %zu)", what, k, log.calls, log.next);
    if (memcmp(out, want, total) != 0) {
        size_t i = 0;
        while (i < total && out[i] == want[i]) i++;
        CHECK_MSG(0, "%s, case %d (%s): wrong from byte %zu of %zu (element %zu)", what, k,
                  ddp_group_algorithm(g), i, total, i / es);
    }
    if (!inplace) {
        CHECK_MSG(memcmp(send.at, in, total) == 0, "%s, case %d: the input changed", what, k);
        buf_check_guards(&recv, what, k);
    }
    buf_check_guards(&send, what, k);
    check_same_everywhere(g, (uint64_t)mapped, what, k);
    if (reg) {
        CHECK_OK(ddp_group_unregister_memory(g, send.at));
        if (!inplace) CHECK_OK(ddp_group_unregister_memory(g, recv.at));
    }
    free(send.base);
    if (recv.base) free(recv.base);
    free(in);
    free(want);
    free(reduced);
    return mapped;
}

/* Registered everywhere: "mapped" from the first call and the usual path's bytes, at page
 * offsets 0, 16, 4092 and one per rank (edges of send and recv through the stages), 64 KiB to
 * 8 MiB, f32 and f64, in place and not. Rank 1 unregistered: nobody mapped, the same bytes.
 * Below 64 KiB and on one rank: the usual path. */
static int rank_apply(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "apply", NULL, 0);
    static const size_t totals[3] = {64u << 10, (1u << 20) + 24, (8u << 20) + 48};
    static const type_t types[2] = {{DDP_F32, DDP_SUM, "f32"}, {DDP_F64, DDP_SUM, "f64"}};
    int k = 0;
    for (int pattern = 0; pattern < 4; pattern++) {
        size_t off = pattern < 3 ? offsets[pattern] : offsets[rank % 3];
        for (int s = 0; s < 3; s++)
            for (int t = 0; t < 2; t++) {
                if (s == 2 && pattern != 3) continue; /* 8 MiB once per dtype */
                size_t elements = totals[s] / ddp_dtype_size(types[t].dtype);
                size_t count = (elements + (size_t)world - 1) / (size_t)world;
                for (int inplace = 0; inplace < 2; inplace++) {
                    int m = apply_case(g, &types[t], count, off, inplace, 1, k++);
                    CHECK_MSG(world == 1 || m, "case %d: registered everywhere, yet ran %s",
                              k - 1, ddp_group_algorithm(g));
                }
            }
    }
    for (int i = 0; i < 4; i++) {
        /* Small (never mapped), empty, and rank 1 unregistered. */
        CHECK_MSG(!apply_case(g, &types[i % 2], 100 + (size_t)i, 16, i % 2, 0, k++),
                  "case %d: 100 elements ran mapped", k - 1);
        CHECK(!apply_case(g, &types[0], 0, 0, 0, 0, k++));
        if (world > 1)
            CHECK_MSG(!apply_case(g, &types[i % 2], 65536, 4092, i % 2, rank != 1, k++),
                      "case %d: rank 1 unregistered, yet mapped", k - 1);
    }
    ddp_group_destroy(g);
    return 0;
}

/* ---- fallback ------------------------------------------------------------------------------ */

/* What the last sum_and_check ran (ddp_group_algorithm), for messages. */
static const char *last_algorithm = "none";

/* In place f32 sum of `count` elements at buf (this rank's input of case k); checks the result
 * and that every rank agrees on whether "mapped" ran; returns 1 if it did. */
static int sum_and_check(ddp_group_t *g, float *buf, size_t count, int k, const char *what)
{
    int rank = ddp_group_rank(g), world = ddp_group_size(g);
    ddp_test_fill(buf, DDP_F32, rank, count, k);
    CHECK_OK(ddp_group_allreduce(g, buf, buf, count, DDP_F32, DDP_SUM));
    last_algorithm = ddp_group_algorithm(g);
    int mapped = !strcmp(last_algorithm, "mapped");
    check_f32_sum(buf, count, world, k, what);
    check_same_everywhere(g, (uint64_t)mapped, "whether mapped ran", k);
    return mapped;
}

static int rank_fallback(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    static const size_t counts[3] = {16384, 262147, (2u << 20) + 1};
    float *bufs[3];
    for (int c = 0; c < 3; c++) {
        bufs[c] = malloc(counts[c] * sizeof(float));
        CHECK(bufs[c]);
    }
    ddp_group_t *g = make_group(rank, world, store, "fallback", NULL, 0);
    int k = 0;
    /* Only rank 1 registers. */
    if (rank == 1)
        for (int c = 0; c < 3; c++)
            CHECK_OK(ddp_group_register_memory(g, bufs[c], counts[c] * sizeof(float)));
    for (int round = 0; round < 2; round++)
        for (int c = 0; c < 3; c++, k++)
            CHECK_MSG(!sum_and_check(g, bufs[c], counts[c], k, "only rank 1 registered"),
                      "only rank 1 registered, yet %zu floats ran mapped", counts[c]);
    /* Now every rank (rank 1's registrations stay). */
    if (rank != 1)
        for (int c = 0; c < 3; c++)
            CHECK_OK(ddp_group_register_memory(g, bufs[c], counts[c] * sizeof(float)));
    for (int round = 0; round < 2; round++)
        for (int c = 0; c < 3; c++, k++)
            CHECK_MSG(sum_and_check(g, bufs[c], counts[c], k, "all registered"),
                      "every rank registered, yet %zu floats ran %s", counts[c],
                      last_algorithm);
    for (int c = 0; c < 3; c++) CHECK_OK(ddp_group_unregister_memory(g, bufs[c]));
    ddp_group_destroy(g);

    /* DDP_SHM_MAP=off on rank 1 only: its registration leaves the memory alone, and then
     * nobody may read it in place. */
    if (rank == 1) setenv("DDP_SHM_MAP", "off", 1);
    g = make_group(rank, world, store, "map-off", NULL, 0);
    for (int c = 0; c < 3; c++) {
        CHECK_OK(ddp_group_register_memory(g, bufs[c], counts[c] * sizeof(float)));
        /* The first whole page of the buffer. */
        char *page = (char *)(((uintptr_t)bufs[c] + PAGE - 1) / PAGE * PAGE);
        if (rank == 1)
            CHECK_MSG(!page_is_memfd(page), "DDP_SHM_MAP=off, yet registering moved the pages");
        else
            CHECK_MSG(page_is_memfd(page), "registered pages are not on a memfd");
    }
    for (int round = 0; round < 2; round++)
        for (int c = 0; c < 3; c++, k++)
            CHECK_MSG(!sum_and_check(g, bufs[c], counts[c], k, "DDP_SHM_MAP=off on rank 1"),
                      "DDP_SHM_MAP=off on rank 1, yet %zu floats ran mapped", counts[c]);
    for (int c = 0; c < 3; c++) {
        ddp_status_t s = ddp_group_unregister_memory(g, bufs[c]);
        /* Rank 1's register call did nothing: its unregister may say so or succeed. */
        if (rank == 1)
            CHECK_MSG(s == DDP_OK || s == DDP_ERR_INVALID_ARGUMENT,
                      "unregister with DDP_SHM_MAP=off returned %s", ddp_status_string(s));
        else
            CHECK_OK(s);
    }
    ddp_group_destroy(g);
    setenv("DDP_SHM_MAP", "on", 1);
    for (int c = 0; c < 3; c++) free(bufs[c]);
    return 0;
}

/* ---- unregister ---------------------------------------------------------------------------- */

static int rank_unregister(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "unregister", NULL, 0);
    const size_t count = (1u << 18) + 3; /* 1 MiB + 12 B */
    const size_t bytes = count * sizeof(float);
    user_buf_t b = buf_alloc(16, bytes);
    float *buf = (float *)b.at;
    char *page = (char *)(((uintptr_t)b.at + PAGE - 1) / PAGE * PAGE);
    char *before = malloc(bytes);
    CHECK(before);
    int k = 0;

    CHECK_OK(ddp_group_register_memory(g, buf, bytes));
    if (world > 1) CHECK_MSG(page_is_memfd(page), "registered pages are not on a memfd");
    int mapped = sum_and_check(g, buf, count, k++, "registered");
    CHECK_MSG(world == 1 || mapped, "registered on every rank, yet ran %s", last_algorithm);
    memcpy(before, buf, bytes);
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    CHECK_MSG(memcmp(before, buf, bytes) == 0, "unregistering changed the bytes");
    CHECK_MSG(!page_is_memfd(page), "unregistered pages are still on a memfd");
    buf_check_guards(&b, "unregistered buffer", k);
    /* Private again: written here, reduced the usual way. */
    for (int i = 0; i < 3; i++)
        CHECK_MSG(!sum_and_check(g, buf, count, k++, "after unregistering"),
                  "unregistered on every rank, yet ran mapped");

    /* Registered again: mapped again. */
    uint64_t h = hash_bytes(buf, bytes);
    CHECK_OK(ddp_group_register_memory(g, buf, bytes));
    CHECK_MSG(hash_bytes(buf, bytes) == h, "registering again changed the bytes");
    mapped = sum_and_check(g, buf, count, k++, "registered again");
    CHECK_MSG(world == 1 || mapped, "registered again, yet ran %s", last_algorithm);

    /* Rank 0 alone unregisters: everybody falls back. */
    if (world > 1) {
        if (rank == 0) CHECK_OK(ddp_group_unregister_memory(g, buf));
        CHECK_MSG(!sum_and_check(g, buf, count, k++, "rank 0 unregistered"),
                  "rank 0 unregistered, yet ran mapped");
        if (rank != 0) CHECK_OK(ddp_group_unregister_memory(g, buf));
    } else {
        CHECK_OK(ddp_group_unregister_memory(g, buf));
    }
    buf_check_guards(&b, "buffer", k);

    /* Many cycles, more than a table of registrations holds: a slot comes back each time. Two
     * blocks alternate so that views of a block replaced by another are not reused stale. */
    user_buf_t other = buf_alloc(4092, bytes);
    for (int cycle = 0; cycle < 40; cycle++) {
        float *p = cycle % 2 ? (float *)other.at : buf;
        size_t n = cycle % 3 ? count : 16411;
        CHECK_OK(ddp_group_register_memory(g, p, n * sizeof(float)));
        mapped = sum_and_check(g, p, n, k++, "register/unregister cycle");
        CHECK_MSG(world == 1 || mapped, "cycle %d: registered, yet ran %s", cycle,
                  last_algorithm);
        memcpy(before, p, n * sizeof(float));
        CHECK_OK(ddp_group_unregister_memory(g, p));
        CHECK_MSG(memcmp(before, p, n * sizeof(float)) == 0, "cycle %d: unregistering changed "
                  "the bytes", cycle);
    }
    buf_check_guards(&other, "other buffer", k);

    /* Other memory registered and unregistered while a mapped allreduce runs (the calls are not
     * collective; the progress thread may be inside the allreduce meanwhile). */
    CHECK_OK(ddp_group_register_memory(g, buf, bytes));
    ddp_test_fill(buf, DDP_F32, rank, count, k);
    ddp_work_t *w = NULL;
    CHECK_OK(ddp_group_allreduce_async(g, buf, buf, count, DDP_F32, DDP_SUM, &w));
    for (int i = 0; i < 4; i++) {
        CHECK_OK(ddp_group_register_memory(g, other.at, bytes));
        CHECK_OK(ddp_group_unregister_memory(g, other.at));
    }
    CHECK_OK(ddp_work_wait(w));
    ddp_work_free(w);
    CHECK_MSG(world == 1 || is_mapped(g), "registering other memory meanwhile: ran %s",
              ddp_group_algorithm(g));
    check_f32_sum(buf, count, world, k++, "registering other memory meanwhile");
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    free(other.base);
    free(b.base);
    free(before);
    ddp_group_destroy(g);
    return 0;
}

/* ---- errors -------------------------------------------------------------------------------- */

#define CHECK_REFUSED(expr, want)                                                                  \
    do {                                                                                           \
        CHECK_STATUS(expr, want);                                                                  \
        CHECK_MSG(ddp_last_error()[0] != '\0', "%s: no error message", #expr);                    \
    } while (0)

/* The group still reduces correctly (and the registered buffer `reg`, if any, maps). */
static void check_group_works(ddp_group_t *g, float *reg, size_t count, int k)
{
    float *buf = malloc(65536 * sizeof(float));
    CHECK(buf);
    sum_and_check(g, buf, 65536, k, "after errors");
    free(buf);
    if (reg) {
        int mapped = sum_and_check(g, reg, count, k + 1, "registered, after errors");
        CHECK_MSG(ddp_group_size(g) == 1 || mapped,
                  "a registration that survived refused calls no longer maps (ran %s)",
                  last_algorithm);
    }
}

static int rank_errors(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "errors", NULL, 0);
    int shm = !strcmp(ddp_group_transport(g), "shm");
    CHECK_MSG(world == 1 || shm, "world %d runs on %s, not shm", world, ddp_group_transport(g));
    const size_t count = 1u << 18; /* 1 MiB */
    float *block = aligned_alloc(PAGE, 4 * count * sizeof(float));
    CHECK(block);
    ddp_test_fill(block, DDP_F32, rank, 4 * count, 99);
    uint64_t h = hash_bytes(block, 4 * count * sizeof(float));

    /* On every transport: NULL and 0. */
    CHECK_REFUSED(ddp_group_register_memory(g, NULL, 4096), DDP_ERR_INVALID_ARGUMENT);
    CHECK_REFUSED(ddp_group_register_memory(g, block, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_REFUSED(ddp_group_unregister_memory(g, NULL), DDP_ERR_INVALID_ARGUMENT);
    CHECK(hash_bytes(block, 4 * count * sizeof(float)) == h);

    if (shm) {
        float *reg = block + count; /* [1, 2) MiB of the block, registered below */
        size_t reg_bytes = count * sizeof(float);
        CHECK_OK(ddp_group_register_memory(g, reg, reg_bytes));
        /* Overlaps: inside, across the start, across the end, around it; the same range. */
        CHECK_REFUSED(ddp_group_register_memory(g, reg + 1024, 4096), DDP_ERR_INVALID_ARGUMENT);
        CHECK_REFUSED(ddp_group_register_memory(g, block + count / 2, reg_bytes),
                      DDP_ERR_INVALID_ARGUMENT);
        CHECK_REFUSED(ddp_group_register_memory(g, reg + count / 2, reg_bytes),
                      DDP_ERR_INVALID_ARGUMENT);
        CHECK_REFUSED(ddp_group_register_memory(g, block, 3 * reg_bytes),
                      DDP_ERR_INVALID_ARGUMENT);
        CHECK_REFUSED(ddp_group_register_memory(g, reg, reg_bytes), DDP_ERR_INVALID_ARGUMENT);
        /* Unknown pointers: never registered, inside a registration, freed memory's address. */
        CHECK_REFUSED(ddp_group_unregister_memory(g, block), DDP_ERR_INVALID_ARGUMENT);
        CHECK_REFUSED(ddp_group_unregister_memory(g, reg + 1), DDP_ERR_INVALID_ARGUMENT);
        int on_stack = 0;
        CHECK_REFUSED(ddp_group_unregister_memory(g, &on_stack), DDP_ERR_INVALID_ARGUMENT);
        CHECK(hash_bytes(block, 4 * count * sizeof(float)) == h);

        /* No whole page inside: within one page, and across a page boundary. */
        char *third = (char *)(block + 3 * count); /* page-aligned, unregistered */
        CHECK_REFUSED(ddp_group_register_memory(g, third + 100, 3000), DDP_ERR_UNSUPPORTED);
        CHECK_REFUSED(ddp_group_register_memory(g, third + 100, PAGE), DDP_ERR_UNSUPPORTED);
        CHECK_REFUSED(ddp_group_register_memory(g, third + PAGE - 8, PAGE + 7),
                      DDP_ERR_UNSUPPORTED);
        CHECK(!page_is_memfd(third));
        /* Byte-disjoint neighbours of a registration are not overlaps: [0, 6000) of the last
         * quarter registers its first page, [6000, 20000) pages 2-3. */
        CHECK_OK(ddp_group_register_memory(g, third, 6000));
        CHECK_OK(ddp_group_register_memory(g, third + 6000, 14000));
        CHECK_OK(ddp_group_unregister_memory(g, third + 6000));
        CHECK_OK(ddp_group_unregister_memory(g, third));
        CHECK(hash_bytes(block, 4 * count * sizeof(float)) == h);

        /* Read-only private anonymous memory. */
        size_t map_bytes = 16 * PAGE;
        char *ro = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(ro != MAP_FAILED);
        memset(ro, 0x3C, map_bytes);
        CHECK(mprotect(ro, map_bytes, PROT_READ) == 0);
        CHECK_REFUSED(ddp_group_register_memory(g, ro, map_bytes), DDP_ERR_UNSUPPORTED);
        for (size_t i = 0; i < map_bytes; i++)
            CHECK_MSG((unsigned char)ro[i] == 0x3C, "a refused registration changed byte %zu", i);
        CHECK(!page_is_memfd(ro));
        CHECK_REFUSED(ddp_group_unregister_memory(g, ro), DDP_ERR_INVALID_ARGUMENT);
        CHECK(munmap(ro, map_bytes) == 0);

        /* A MAP_SHARED mapping of a temporary file: still the file's after the refusal. */
        const char *dir = ddp_test_tmpdir();
        CHECK(dir);
        char path[600];
        snprintf(path, sizeof path, "%s/mapped-file", dir);
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        CHECK(fd >= 0 && ftruncate(fd, (off_t)map_bytes) == 0);
        char *file = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        CHECK(file != MAP_FAILED);
        memset(file, 0x4B, map_bytes);
        CHECK_REFUSED(ddp_group_register_memory(g, file, map_bytes), DDP_ERR_UNSUPPORTED);
        file[5 * PAGE + 1] = 0x11; /* written through the mapping, read through the file */
        unsigned char got[2] = {0, 0};
        CHECK(pread(fd, got, 2, 5 * PAGE) == 2);
        CHECK_MSG(got[0] == 0x4B && got[1] == 0x11,
                  "after a refused registration the mapping no longer writes the file");
        CHECK(munmap(file, map_bytes) == 0);
        close(fd);
        unlink(path);
        rmdir(dir);

        /* Too many registrations: refused (if at all) with UNSUPPORTED, the memory intact. */
        enum { MANY = 80 };
        char *many = aligned_alloc(PAGE, (size_t)MANY * 2 * PAGE);
        CHECK(many);
        memset(many, 0x77, (size_t)MANY * 2 * PAGE);
        int registered = 0, accepted[MANY];
        for (int i = 0; i < MANY; i++) {
            ddp_status_t s = ddp_group_register_memory(g, many + (size_t)i * 2 * PAGE, PAGE);
            accepted[i] = s == DDP_OK;
            registered += accepted[i];
            if (s != DDP_OK) {
                CHECK_STATUS(s, DDP_ERR_UNSUPPORTED);
                CHECK_MSG(ddp_last_error()[0] != '\0', "too many registrations: no message");
                CHECK(!page_is_memfd(many + (size_t)i * 2 * PAGE));
            }
        }
        for (size_t i = 0; i < (size_t)MANY * 2 * PAGE; i++)
            CHECK_MSG((unsigned char)many[i] == 0x77, "registrations changed byte %zu", i);
        for (int i = 0; i < MANY; i++)
            if (accepted[i]) CHECK_OK(ddp_group_unregister_memory(g, many + (size_t)i * 2 * PAGE));
            else CHECK_REFUSED(ddp_group_unregister_memory(g, many + (size_t)i * 2 * PAGE),
                               DDP_ERR_INVALID_ARGUMENT);
        if (rank == 0)
            printf("test_shm_map: %d of %d one-page registrations accepted\n", registered, MANY);
        free(many);

        check_group_works(g, reg, count, 1);
        CHECK_OK(ddp_group_unregister_memory(g, reg));
        CHECK_REFUSED(ddp_group_unregister_memory(g, reg), DDP_ERR_INVALID_ARGUMENT);
    } else {
        /* World 1: registration works, whatever it does. */
        CHECK_OK(ddp_group_register_memory(g, block, count * sizeof(float)));
        CHECK(hash_bytes(block, 4 * count * sizeof(float)) == h);
        check_group_works(g, block, count, 1);
        CHECK_OK(ddp_group_unregister_memory(g, block));
    }
    ddp_group_destroy(g);

    /* On tcp both calls succeed and do nothing, whatever the memory. */
    if (world > 1) {
        g = make_group(rank, world, store, "errors-tcp", "tcp", 0);
        CHECK(!strcmp(ddp_group_transport(g), "tcp"));
        float *buf = block + count;
        CHECK_OK(ddp_group_register_memory(g, buf, count * sizeof(float)));
        CHECK(!page_is_memfd(buf + 2048));
        CHECK_OK(ddp_group_register_memory(g, buf + 7, 10)); /* overlapping: nothing to overlap */
        int mapped = sum_and_check(g, buf, count, 3, "tcp, registered");
        CHECK_MSG(!mapped, "tcp ran mapped");
        CHECK_OK(ddp_group_unregister_memory(g, buf));
        CHECK_OK(ddp_group_unregister_memory(g, block)); /* never registered: nothing to do */
        ddp_group_destroy(g);
    }
    free(block);
    return 0;
}

/* ---- fork ---------------------------------------------------------------------------------- */

enum { CHILD_OK = 0, CHILD_NOT_PARENT_BYTES = 3, CHILD_SAW_PARENT_WRITE = 4, CHILD_PIPE = 5 };

static int rank_fork(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "fork", NULL, 0);
    const size_t count = (1u << 20) + 5;
    const size_t bytes = count * sizeof(float);
    user_buf_t b = buf_alloc(16, bytes);
    float *buf = (float *)b.at;
    CHECK_OK(ddp_group_register_memory(g, buf, bytes));
    int mapped = sum_and_check(g, buf, count, 0, "before fork");
    CHECK_MSG(world == 1 || mapped, "registered, yet ran %s", last_algorithm);
    uint64_t pre = hash_bytes(buf, bytes);

    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* The child touches only its memory and the pipes (the group's threads are gone). Each
         * side closes the ends it does not use, so that either dying ends the other's read. */
        close(to_child[1]);
        close(to_parent[0]);
        char c = 0;
        int rc = CHILD_OK;
        if (hash_bytes(buf, bytes) != pre) rc = CHILD_NOT_PARENT_BYTES;
        memset(buf, 0xC7, bytes);
        if (write(to_parent[1], "w", 1) != 1) _exit(CHILD_PIPE);
        if (read(to_child[0], &c, 1) != 1) _exit(CHILD_PIPE); /* the parent wrote its own */
        for (size_t i = 0; i < bytes && rc == CHILD_OK; i++)
            if ((unsigned char)b.at[i] != 0xC7) rc = CHILD_SAW_PARENT_WRITE;
        _exit(rc);
    }
    close(to_child[0]);
    close(to_parent[1]);
    char c = 0;
    CHECK(read(to_parent[0], &c, 1) == 1); /* the child has written its whole buffer */
    CHECK_MSG(hash_bytes(buf, bytes) == pre, "the child's writes reached the parent's buffer");
    memset(buf, 0x2D, bytes);
    CHECK(write(to_child[1], "p", 1) == 1);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK_MSG(WIFEXITED(status), "the child died (status %d)", status);
    CHECK_MSG(WEXITSTATUS(status) != CHILD_NOT_PARENT_BYTES,
              "the child did not see the parent's bytes of before the fork");
    CHECK_MSG(WEXITSTATUS(status) != CHILD_SAW_PARENT_WRITE,
              "the parent's writes after the fork reached the child");
    CHECK_MSG(WEXITSTATUS(status) == CHILD_OK, "the child exited %d", WEXITSTATUS(status));
    for (size_t i = 0; i < bytes; i++)
        CHECK_MSG((unsigned char)b.at[i] == 0x2D, "the parent's own write was lost at byte %zu", i);
    /* The parent's registration goes on working. */
    mapped = sum_and_check(g, buf, count, 1, "after fork");
    CHECK_MSG(world == 1 || mapped, "after fork, ran %s", last_algorithm);
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    buf_check_guards(&b, "forked buffer", 1);
    free(b.base);
    close(to_child[1]);
    close(to_parent[0]);
    /* A registered mapping its owner grew with mremap (moving it if it must): its pages are on
     * the memfd still but no longer the export. A child forked before anything noticed gets
     * them private too. (glibc's realloc cannot do this to a registered chunk: its mremap of
     * the whole chunk fails across the header's page, which stays private, and it copies.) */
    const size_t rbytes = (size_t)64 << 20;
    if (world == 1) { /* a group of one shares nothing: registering leaves the pages alone */
        ddp_group_destroy(g);
        return 0;
    }
    char *m = mmap(NULL, rbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    memset(m, 0x11, rbytes);
    CHECK_OK(ddp_group_register_memory(g, m, rbytes));
    char *grown = mremap(m, rbytes, 2 * rbytes, MREMAP_MAYMOVE);
    CHECK(grown != MAP_FAILED);
    memset(grown + rbytes, 0x22, rbytes);
    CHECK_MSG(page_is_memfd(grown + rbytes - PAGE), "mremap gave registered pages back to private "
                                                    "memory");
    const uint64_t grown_hash = hash_bytes(grown, 2 * rbytes);
    pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        memset(grown, 0x5B, 2 * rbytes);
        _exit(0);
    }
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_MSG(hash_bytes(grown, 2 * rbytes) == grown_hash,
              "a forked child's writes reached a registered mapping that mremap grew");
    /* Unregistering it now says it moved, and forgets it. */
    ddp_status_t s = ddp_group_unregister_memory(g, m);
    CHECK_MSG(s == DDP_ERR_INVALID_ARGUMENT, "unregistering a mapping mremap grew returned %s",
              ddp_status_string(s));
    CHECK(munmap(grown, 2 * rbytes) == 0);
    ddp_group_destroy(g);
    return 0;
}

/* ---- watch --------------------------------------------------------------------------------- */

/* Whether this kernel lets a process watch shared memory as shm_watch.c does (userfaultfd, unmap
 * and remap events, write-protect mode on a memfd mapping), asked here independently. */
static int kernel_can_watch(void)
{
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0 && errno == EINVAL) fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return 0;
    struct uffdio_api api = {.api = UFFD_API,
                             .features = UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMAP |
                                         UFFD_FEATURE_WP_HUGETLBFS_SHMEM};
    int ok = ioctl(fd, UFFDIO_API, &api) == 0;
    int mfd = ok ? memfd_create("watch-probe", MFD_CLOEXEC) : -1;
    void *m = MAP_FAILED;
    if (mfd >= 0 && ftruncate(mfd, PAGE) == 0)
        m = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    if (m != MAP_FAILED) {
        struct uffdio_register reg = {.range = {.start = (uintptr_t)m, .len = PAGE},
                                      .mode = UFFDIO_REGISTER_MODE_WP};
        ok = ioctl(fd, UFFDIO_REGISTER, &reg) == 0;
        /* Unregistered first: nothing reads this descriptor's reports. */
        if (ok) ioctl(fd, UFFDIO_UNREGISTER, &reg.range);
        munmap(m, PAGE);
    } else {
        ok = 0;
    }
    if (mfd >= 0) close(mfd);
    close(fd);
    return ok;
}

static void *unmap_elsewhere(void *m)
{
    return (void *)(intptr_t)munmap(m, (size_t)4 << 20);
}

/* Registered mappings of their own, then taken away behind libddp's back in each way a process
 * can, and private memory mapped at the same address: the next allreduce there is correct and
 * not "mapped" (the registration is found gone). Where the kernel can watch (kernel_can_watch),
 * the registrations are watched, ten mapped calls ask the kernel at most once (the first), and
 * the watch has heard of each change by the time the call that made it returned. */
static int rank_watch(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "watch", NULL, 0);
    const size_t bytes = (size_t)4 << 20, count = bytes / sizeof(float);
    const int can = kernel_can_watch();
    if (rank == 0)
        printf("test_shm_map watch: this kernel %s watch registered memory\n",
               can ? "can" : "cannot");
    /* glibc's malloc (not a sanitizer's, which keeps freed memory in quarantine) maps a 4 MiB
     * chunk of its own and unmaps it when freed, the threshold held where it is. */
    const int glibc = ddp__shm_map_auto_available();
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    const char *ways[] = {"munmap", "munmap by another thread", "mmap MAP_FIXED over it",
                          "mremap away", "free and malloc"};
    int k = 0;
    for (int way = 0; way < 5; way++) {
        float *m = way == 4 ? malloc(bytes)
                            : mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(m && m != MAP_FAILED);
        CHECK_OK(ddp_group_register_memory(g, m, bytes));
        CHECK_MSG(ddp__shm_map_watched((char *)m + PAGE) == can, "the registration is %swatched",
                  can ? "not " : "");
        /* A report of the way before may still be being taken (the epoch odd, never trusted):
         * the first of the ten calls below would then not be trusted either. */
        for (int wait = 0; wait < 1000 && (ddp__shm_watch_epoch() & 1); wait++) usleep(1000);
        const uint64_t checks = ddp__shm_map_kernel_checks();
        for (int call = 0; call < 10; call++)
            CHECK_MSG(sum_and_check(g, m, count, k++, "registered"), "registered, ran %s",
                      last_algorithm);
        const uint64_t asked = ddp__shm_map_kernel_checks() - checks;
        CHECK_MSG(!can || asked <= 1, "ten calls on a watched registration asked the kernel %llu "
                                      "times",
                  (unsigned long long)asked);
        const uint64_t heard = ddp__shm_watch_epoch();
        void *moved = NULL;
        if (way == 4) {
            /* glibc unmaps a chunk this large when it is freed; the next one of the same size
             * is most likely mapped at the same address, and must not be taken for it. */
            free(m);
            float *again = malloc(bytes);
            CHECK(again);
            CHECK_MSG(!can || !glibc || ddp__shm_watch_epoch() != heard,
                      "free: the watch did not hear of it");
            int mapped = sum_and_check(g, again, count, k++, ways[way]);
            CHECK_MSG(again != m || !mapped, "free and malloc at the same address: ran %s",
                      last_algorithm);
            free(again);
            continue;
        }
        if (way == 0) {
            CHECK(munmap(m, bytes) == 0);
        } else if (way == 1) {
            pthread_t t;
            void *rc = NULL;
            CHECK(pthread_create(&t, NULL, unmap_elsewhere, m) == 0);
            CHECK(pthread_join(t, &rc) == 0 && rc == NULL);
        } else if (way == 3) {
            moved = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            CHECK(moved != MAP_FAILED);
            CHECK(mremap(m, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, moved) == moved);
        }
        /* Private memory at the same address (over the registration itself for way 2). */
        void *again = mmap(m, bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | (way == 2 ? MAP_FIXED : MAP_FIXED_NOREPLACE),
                           -1, 0);
        CHECK_MSG(again == m, "%s: no private memory at the same address", ways[way]);
        CHECK_MSG(!can || ddp__shm_watch_epoch() != heard, "%s: the watch did not hear of it",
                  ways[way]);
        CHECK_MSG(!page_is_memfd((char *)m + PAGE), "%s: still a memfd", ways[way]);
        CHECK_MSG(!sum_and_check(g, m, count, k++, ways[way]), "%s, then private memory at the "
                                                                "same address: ran %s",
                  ways[way], last_algorithm);
        CHECK(munmap(m, bytes) == 0);
        if (moved) CHECK(munmap(moved, bytes) == 0);
    }
    /* A child forked now has no watch of the parent's; registering there opens its own, which
     * hears the child's munmap. (Not under TSan, which refuses to start a thread in a child of
     * a multi-threaded process.) */
#ifndef UNDER_TSAN
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int rc = 0;
        void *c = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (c == MAP_FAILED || ddp__shm_map_register(c, bytes) != DDP_OK) _exit(3);
        if (ddp__shm_map_watched(c) != can) rc = 4;
        const uint64_t before = ddp__shm_watch_epoch();
        if (munmap(c, bytes) != 0) rc = 3;
        if (can && ddp__shm_watch_epoch() == before) rc = 5;
        _exit(rc);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status));
    CHECK_MSG(WEXITSTATUS(status) != 4, "a forked child's registration is %swatched",
              can ? "not " : "");
    CHECK_MSG(WEXITSTATUS(status) != 5, "a forked child's watch did not hear its munmap");
    CHECK_MSG(WEXITSTATUS(status) == 0, "the forked child exited %d", WEXITSTATUS(status));
    /* A process whose main thread registers memory and then calls pthread_exit still exits:
     * the watch's thread ends once it is the last one (within about a second). */
    pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        void *c = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (c == MAP_FAILED || ddp__shm_map_register(c, bytes) != DDP_OK) _exit(3);
        pthread_exit(NULL);
    }
    int exited = 0;
    for (int wait = 0; wait < 200 && !exited; wait++) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        CHECK(w >= 0);
        if (w == pid) exited = 1;
        else usleep(50000);
    }
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    CHECK_MSG(exited, "a process whose main thread called pthread_exit after registering memory "
                      "was still there 10 s later");
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "that process ended with status %d",
              status);
#endif
    /* Unregistering moves the pages back (the watch hears that too); registering the same
     * memory again is watched and mapped again. */
    float *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    for (int round = 0; round < 3; round++) {
        CHECK_OK(ddp_group_register_memory(g, m, bytes));
        CHECK_MSG(ddp__shm_map_watched(m) == can, "registered again: %swatched", can ? "not " : "");
        CHECK_MSG(sum_and_check(g, m, count, k++, "registered again"), "ran %s", last_algorithm);
        CHECK_OK(ddp_group_unregister_memory(g, m));
        CHECK_MSG(!sum_and_check(g, m, count, k++, "unregistered"), "ran %s", last_algorithm);
    }
    CHECK(munmap(m, bytes) == 0);
    ddp_group_destroy(g);
    return 0;
}

/* ---- tuned --------------------------------------------------------------------------------- */

/* The tuner settled on one-shot for a size class (rank 0's clock says it is a million times
 * faster), then the buffers of that size are registered: the class goes the mapped way. The
 * first registered call may still run one-shot (the tuner's pick, which bypasses the mapped path:
 * that call is what tells every rank the class is registered); every later one must be mapped. */
static int rank_tuned(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    double skew[4] = {1, 1, rank == 0 ? 1e-6 : 1.0, 1};
    ddp__shm_set_tune_skew(skew, 4);
    setenv("DDP_SHM_TUNE", "online", 1);
    ddp_group_t *g = make_group(rank, world, store, "tuned", NULL, 0);
    const size_t count = 16384; /* 64 KiB: one-shot is a candidate */
    float *buf = malloc(count * sizeof(float));
    CHECK(buf);
    int k = 0;
    for (int call = 0; call < 40; call++) sum_and_check(g, buf, count, k++, "tuning");
    CHECK_MSG(!strcmp(last_algorithm, "one-shot"), "the tuner settled on %s, not one-shot",
              last_algorithm);
    CHECK_OK(ddp_group_register_memory(g, buf, count * sizeof(float)));
    for (int call = 0; call < 20; call++) {
        int mapped = sum_and_check(g, buf, count, k++, "registered after tuning");
        if (call == 0 && rank == 0)
            printf("test_shm_map: the first registered call after the tuner chose one-shot ran "
                   "%s\n", last_algorithm);
        CHECK_MSG(mapped || (call == 0 && !strcmp(last_algorithm, "one-shot")),
                  "registered call %d after the tuner chose one-shot ran %s", call, last_algorithm);
    }
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    free(buf);
    ddp_group_destroy(g);
    return 0;
}

/* Mappings of registered memory in this process (its own registrations and peers' views). */
static int count_registered_mappings(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    CHECK(f);
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f)) n += strstr(line, "memfd:ddp-registered") != NULL;
    fclose(f);
    return n;
}

/* ---- auto ---------------------------------------------------------------------------------- */

/* Three sums in a 4 MiB mapping of its own, unmapped after: whether the last ran mapped. */
static int sum_own_mapping(ddp_group_t *g, int *k, const char *what)
{
    const size_t mcount = (4u << 20) / sizeof(float);
    float *m = mmap(NULL, mcount * sizeof(float), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    int mapped = 0;
    for (int call = 0; call < 3; call++) mapped = sum_and_check(g, m, mcount, (*k)++, what);
    CHECK(munmap(m, mcount * sizeof(float)) == 0);
    return mapped;
}

/* DDP_SHM_MAP=auto (the default): libddp registers by itself a malloc'd buffer that comes back.
 * The first call of a buffer is not mapped, the next ones are; a buffer freed and another
 * allocated (likely at the same address) is reduced correctly (the stale registration is
 * noticed); temporaries allocated and freed every call stay correct; a child forked after it
 * writes privately; a registration by the caller takes the automatic one over. Skipped (77)
 * where automatic registration cannot run (malloc not glibc's, as under ASan/TSan, or a kernel
 * without PROCMAP_QUERY). */
static int rank_auto(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    setenv("DDP_SHM_MAP", "auto", 1);
    ddp_group_t *g = make_group(rank, world, store, "auto", NULL, 0);
    const size_t count = (1u << 20) + 3;
    const size_t bytes = count * sizeof(float);
    int k = 100;
    float *buf = malloc(bytes);
    CHECK(buf);
    int mapped = sum_and_check(g, buf, count, k++, "first call");
    CHECK_MSG(!mapped, "the first call of a buffer ran mapped");
    for (int call = 0; call < 4; call++) {
        mapped = sum_and_check(g, buf, count, k++, "auto, again");
        CHECK_MSG(mapped, "call %d of the same buffer ran %s", call + 2, last_algorithm);
    }
    CHECK_MSG(page_is_memfd((char *)buf + PAGE), "the buffer's pages are not on a memfd");
    /* Freed and allocated again: correct whatever runs. */
    free(buf);
    buf = malloc(bytes);
    CHECK(buf);
    for (int call = 0; call < 4; call++) sum_and_check(g, buf, count, k++, "new buffer");
    /* Temporaries: a new buffer every call. */
    for (int call = 0; call < 6; call++) {
        float *t = malloc(bytes + (size_t)call * 64);
        CHECK(t);
        sum_and_check(g, t, count, k++, "temporary");
        free(t);
    }
    /* Out of place, both buffers automatic. */
    float *out = malloc(bytes), *in = malloc(bytes);
    CHECK(out && in);
    for (int call = 0; call < 3; call++) {
        ddp_test_fill(in, DDP_F32, rank, count, k);
        CHECK_OK(ddp_group_allreduce(g, in, out, count, DDP_F32, DDP_SUM));
        check_f32_sum(out, count, world, k++, "auto out of place");
    }
    CHECK_MSG(is_mapped(g), "out of place, third call ran %s", ddp_group_algorithm(g));
    /* A fork: the child's writes stay its own. */
    uint64_t pre = hash_bytes(out, bytes);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        memset(out, 0x5B, bytes);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_MSG(hash_bytes(out, bytes) == pre, "a forked child's writes reached the parent");
    /* The caller registers what libddp registered: it takes it over. */
    CHECK_OK(ddp_group_register_memory(g, buf, bytes));
    mapped = sum_and_check(g, buf, count, k++, "taken over");
    CHECK_MSG(mapped, "after taking over, ran %s", last_algorithm);
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    CHECK_MSG(!page_is_memfd((char *)buf + PAGE), "unregistered pages are still on a memfd");
    free(buf);
    free(in);
    free(out);
    /* A buffer that is a mapping of its own, registered automatically, then unmapped: a few calls
     * on another buffer later, the process maps no more registered memory than the live
     * registrations of all ranks (its own, and its views of its peers'), i.e. no view of memory
     * freed elsewhere keeps it alive. */
    float *last = malloc(bytes);
    CHECK(last);
    for (int call = 0; call < 2; call++) sum_and_check(g, last, count, k++, "before the unmap");
    CHECK_MSG(sum_own_mapping(g, &k, "own mapping"), "a buffer of its own mapping ran %s",
              last_algorithm);
    /* Calls on a buffer registered before (no registration follows that would notice), spread
     * over more than the 50 ms at which the owner looks for registrations that went away. */
    for (int call = 0; call < 4; call++) {
        sum_and_check(g, last, count, k++, "after the unmap");
        usleep(30000);
    }
    uint32_t gens[DDP__SHM_MAP_SLOTS];
    ddp__shm_map_live(gens);
    int64_t live = 0, all[64];
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) live += gens[i] != 0;
    CHECK_OK(ddp_group_allgather(g, &live, all, 1, DDP_I64));
    int64_t total = 0;
    for (int r = 0; r < world; r++) total += all[r];
    int mappings = count_registered_mappings();
    CHECK_MSG(mappings <= total, "%d mappings of registered memory, %lld live registrations",
              mappings, (long long)total);
    free(last);
    /* More small buffers than the table has slots, each seen twice by the automatic
     * registration (registered, until the table is full), then a large buffer in collectives: it
     * takes a small one's slot. */
    enum { SMALL = DDP__SHM_MAP_SLOTS + 8 };
    const size_t sbytes = 64 << 10;
    void *small[SMALL];
    for (int i = 0; i < SMALL; i++) {
        small[i] = malloc(sbytes);
        CHECK(small[i]);
        for (int seen = 0; seen < 2; seen++) ddp__shm_map_auto(small[i], sbytes);
    }
    ddp__shm_map_live(gens);
    live = 0;
    for (int i = 0; i < DDP__SHM_MAP_SLOTS; i++) live += gens[i] != 0;
    CHECK_MSG(live == DDP__SHM_MAP_SLOTS, "%lld of %d slots taken by the small buffers",
              (long long)live, DDP__SHM_MAP_SLOTS);
    /* (A mapping of its own: it overlaps no registration of a buffer freed before.) */
    CHECK_MSG(sum_own_mapping(g, &k, "large"),
              "a large buffer after a table full of small ones ran %s", last_algorithm);
    for (int i = 0; i < SMALL; i++) free(small[i]);
    ddp_group_destroy(g);
    return 0;
}

/* ---- small: registered memory below the one-shot size ------------------------------------- */

/* Three in-place allreduces of `bytes` on a registered buffer at `off` bytes past a page, each
 * checked against the same call on an unregistered copy (not "mapped"): same bytes everywhere,
 * guards intact. Returns whether the last two ran "mapped" (the first may not: there its size
 * class learns that every rank registered), the same on every rank. */
static int small_allreduce(ddp_group_t *g, const type_t *t, size_t bytes, size_t off, int *k)
{
    int rank = ddp_group_rank(g);
    size_t es = ddp_dtype_size(t->dtype), count = bytes / es;
    char what[112];
    snprintf(what, sizeof what, "allreduce %s, %zu bytes at offset %zu", t->name, bytes, off);
    user_buf_t reg = buf_alloc(off, bytes), plain = buf_alloc(off, bytes);
    CHECK_OK(ddp_group_register_memory(g, reg.at, bytes));
    int mapped = 1;
    for (int call = 0; call < 3; call++, (*k)++) {
        ddp_test_fill(reg.at, t->dtype, rank, count, *k);
        memcpy(plain.at, reg.at, bytes);
        CHECK_OK(ddp_group_allreduce(g, reg.at, reg.at, count, t->dtype, t->op));
        last_algorithm = ddp_group_algorithm(g);
        const char *alg = last_algorithm;
        if (call) mapped &= !strcmp(alg, "mapped");
        CHECK_OK(ddp_group_allreduce(g, plain.at, plain.at, count, t->dtype, t->op));
        CHECK_MSG(!is_mapped(g), "%s, case %d: unregistered, yet mapped", what, *k);
        CHECK_MSG(memcmp(reg.at, plain.at, bytes) == 0,
                  "%s, case %d: %s differs from the unregistered call (%s)", what, *k, alg,
                  ddp_group_algorithm(g));
        if (t->dtype == DDP_F32 && t->op == DDP_SUM)
            check_f32_sum((const float *)reg.at, count, ddp_group_size(g), *k, what);
        buf_check_guards(&reg, what, *k);
        check_same_everywhere(g, hash_bytes(reg.at, bytes), what, *k);
    }
    check_same_everywhere(g, (uint64_t)mapped, what, *k);
    CHECK_OK(ddp_group_unregister_memory(g, reg.at));
    free(reg.base);
    free(plain.base);
    return mapped;
}

static int rank_small(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    ddp_group_t *g = make_group(rank, world, store, "small", NULL, 0);
    /* shm_choose.c's MAPPED_ALLREDUCE_MIN_PER_RANK, ddp__shm_pull_min in shm_internal.h. */
    const size_t allreduce_min = (size_t)world * 2048;
    const size_t pull_min = world == 2 ? 8192 : (size_t)world * 8192;
    int k = 0;
    if (world > 1) {
        /* Allreduce, from the smallest size that goes mapped to the one-shot size. */
        const type_t *ts[3] = {&types[0], &types[2], &types[3]};
        const size_t extra[3] = {0, allreduce_min / 2, (16u << 10) - allreduce_min};
        for (int t = 0; t < 3; t++)
            for (int e = 0; e < 3; e++) {
                size_t bytes = allreduce_min + extra[e];
                CHECK_MSG(small_allreduce(g, ts[t], bytes, 0, &k),
                          "allreduce %s of %zu registered bytes: not mapped (%s)",
                          ts[t]->name, bytes, last_algorithm);
            }
        /* Edges outside the whole pages, through the stage. */
        CHECK_MSG(small_allreduce(g, &types[0], 16u << 10, 16, &k),
                  "allreduce of 16 KiB at offset 16: not mapped (%s)", last_algorithm);
        /* Below the size: one-shot. */
        if (allreduce_min / 2 >= PAGE)
            CHECK_MSG(!small_allreduce(g, &types[0], allreduce_min / 2, 0, &k),
                      "allreduce of %zu registered bytes ran mapped", allreduce_min / 2);
        /* The others (in place, page-aligned: a small block has no whole page of its own). */
        for (int t = 0; t < 2; t++) {
            const type_t *ty = &pull_types[t];
            const size_t es = ddp_dtype_size(ty->dtype);
            for (int below = 0; below < 2; below++) {
                const size_t total = below ? pull_min / 2 : pull_min;
                const size_t block = total / (size_t)world / es;
                const int want = !below;
                CHECK_MSG(pull_case(g, 1, ty, block, 0, 1, 0, 1, k++) == want,
                          "allgather %s of %zu bytes: mapped %d", ty->name, total, !want);
                CHECK_MSG(pull_case(g, 0, ty, total / es, 0, 1, world - 1, 1, k++) == want,
                          "broadcast %s of %zu bytes: mapped %d", ty->name, total, !want);
                CHECK_MSG(alltoall_case(g, ty, block, 0, k++) == want,
                          "alltoall %s of %zu bytes: mapped %d", ty->name, total, !want);
                CHECK_MSG(reduce_scatter_case(g, ty, block, 0, 0, k++) == want,
                          "reduce_scatter %s of %zu bytes: mapped %d", ty->name, total, !want);
            }
        }
    }
    ddp_group_destroy(g);
    if (world > 1) {
        /* DDP_SHM_ONESHOT_BYTES set: one-shot exactly up to it, registered or not. */
        setenv("DDP_SHM_ONESHOT_BYTES", "16384", 1);
        g = make_group(rank, world, store, "small-oneshot", NULL, 0);
        unsetenv("DDP_SHM_ONESHOT_BYTES");
        CHECK_MSG(!small_allreduce(g, &types[0], 16u << 10, 0, &k),
                  "DDP_SHM_ONESHOT_BYTES=16384, yet 16 KiB ran mapped");
        ddp_group_destroy(g);
    }
    if (world > 1 && ddp__shm_map_auto_available()) {
        /* DDP_SHM_MAP=auto (the default): a page-aligned malloc'd buffer of the smallest size,
         * mapped from its third call (registered at the second, its class told there). */
        setenv("DDP_SHM_MAP", "auto", 1);
        g = make_group(rank, world, store, "small-auto", NULL, 0);
        const size_t count = allreduce_min / sizeof(float);
        float *buf = aligned_alloc(PAGE, allreduce_min);
        CHECK(buf);
        for (int call = 0; call < 5; call++) {
            int mapped = sum_and_check(g, buf, count, k++, "auto, small");
            CHECK_MSG(call < 2 || mapped, "auto, %zu bytes: call %d ran %s", allreduce_min,
                      call + 1, last_algorithm);
        }
        free(buf);
        ddp_group_destroy(g);
    }
    return 0;
}

/* ---- writers ------------------------------------------------------------------------------- */

/* A thread writing a generation number into every word of a range, then reading them all back:
 * a word that reads an older generation is a write lost (the pages were replaced under it). */
typedef struct writer {
    uint64_t *words;
    size_t n;
    pthread_t thread;
    atomic_int stop;
    atomic_long passes, lost;
    uint64_t last; /* the generation written last */
} writer_t;

static void *write_and_check(void *arg)
{
    writer_t *w = arg;
    volatile uint64_t *words = w->words;
    uint64_t gen = 0;
    while (!atomic_load(&w->stop)) {
        gen++;
        for (size_t i = 0; i < w->n; i++) words[i] = gen;
        for (size_t i = 0; i < w->n; i++)
            if (words[i] != gen) {
                atomic_fetch_add(&w->lost, 1);
                break;
            }
        atomic_fetch_add(&w->passes, 1);
    }
    w->last = gen;
    return NULL;
}

static void writer_start(writer_t *w, void *at, size_t bytes)
{
    memset(w, 0, sizeof *w);
    w->words = at;
    w->n = bytes / sizeof(uint64_t);
    CHECK(pthread_create(&w->thread, NULL, write_and_check, w) == 0);
    while (atomic_load(&w->passes) < 2) sched_yield();
}

/* Stops the writer; returns the writes it lost; checks its last generation is what remains. */
static long writer_stop(writer_t *w)
{
    atomic_store(&w->stop, 1);
    CHECK(pthread_join(w->thread, NULL) == 0);
    for (size_t i = 0; i < w->n; i++)
        CHECK_MSG(w->words[i] == w->last, "word %zu holds generation %llu after the writer's "
                  "last, %llu", i, (unsigned long long)w->words[i],
                  (unsigned long long)w->last);
    return atomic_load(&w->lost);
}

/* DDP_SHM_MAP=auto gives up a registration of its own while another thread writes into its pages
 * (a gradient accumulated while the progress thread reduces another bucket, or a freed buffer's
 * pages that malloc gave to other objects). Two ways it happens, alternately, 400 times: a new
 * buffer overlaps an automatic registration (the heap reused a freed buffer's memory), or a
 * larger buffer takes the place of the smallest when the table is full. Every write the other
 * thread made must remain: pages given back by copying them elsewhere would lose those made
 * between the copy and the move. World-independent (no collective): run with world 1. */
static int rank_writers(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)rank, (void)world, (void)store, (void)arg;
    setenv("DDP_SHM_MAP", "auto", 1);
    enum { ROUNDS = 400, FILL = DDP__SHM_MAP_SLOTS - 1 };
    const size_t small = 48 << 10, big = 256 << 10, stride = 512 << 10;
    const size_t total = (size_t)(ROUNDS + FILL) * stride;
    char *r = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(r != MAP_FAILED);
    /* All slots but one taken by larger automatic registrations. */
    for (int i = 0; i < FILL; i++) {
        char *at = r + (size_t)(ROUNDS + i) * stride;
        CHECK(!ddp__shm_map_auto(at, big) && ddp__shm_map_auto(at, big));
    }
    long lost = 0;
    for (int round = 0; round < ROUNDS; round++) {
        char *a = r + (size_t)round * stride;
        CHECK_MSG(!ddp__shm_map_auto(a, small) && ddp__shm_map_auto(a, small),
                  "round %d: 48 KiB at %p not registered on its second call", round, (void *)a);
        writer_t w;
        /* Overlap: a buffer from a's second quarter on; the writer keeps to the first, which
         * the new registration leaves out. Eviction: a buffer elsewhere, larger than a (the
         * smallest registration): a's slot goes to it; the writer writes all of a. */
        int overlap = round % 2 == 0;
        char *b = overlap ? a + small / 4 : a + stride / 2;
        size_t b_bytes = overlap ? small * 2 : 128 << 10;
        writer_start(&w, a, overlap ? small / 4 : small);
        CHECK(!ddp__shm_map_auto(b, b_bytes));
        CHECK_MSG(ddp__shm_map_auto(b, b_bytes), "round %d: the %s buffer not registered", round,
                  overlap ? "overlapping" : "larger");
        lost += writer_stop(&w);
        /* The slot back for the next round. */
        CHECK_OK(ddp__shm_map_register(b, b_bytes));
        CHECK_OK(ddp__shm_map_unregister(b));
    }
    CHECK_MSG(lost == 0, "%ld writes of another thread lost in %d rounds", lost, ROUNDS);
    /* Given-up pages stay on their memfds (round 0's first quarter, round 1's whole buffer); a
     * forked child gets them private: its writes do not reach this process. */
    char *given_up[2] = {r, r + stride};
    uint64_t before[2];
    for (int i = 0; i < 2; i++) {
        CHECK_MSG(page_is_memfd(given_up[i]), "round %d's given-up pages are not on a memfd", i);
        before[i] = hash_bytes(given_up[i], small / 4);
    }
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        for (int i = 0; i < 2; i++) memset(given_up[i], 0x5B, small / 4);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < 2; i++)
        CHECK_MSG(hash_bytes(given_up[i], small / 4) == before[i],
                  "a forked child's writes to given-up pages reached the parent (round %d)", i);
    CHECK(munmap(r, total) == 0);
    return 0;
}

/* ---- kill ---------------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

enum { KILL_TIMEOUT_MS = 30000 };

static int kill_rank(int rank, int world, const char *store_path)
{
    ddp_store_t *store = NULL;
    CHECK_OK(ddp_store_file_create(store_path, &store));
    ddp_group_t *g = make_group(rank, world, store, "kill", NULL, KILL_TIMEOUT_MS);
    const size_t n = 16u << 20; /* 64 MiB of f32 */
    float *buf = malloc(n * sizeof(float));
    CHECK(buf);
    memset(buf, 0, n * sizeof(float));
    CHECK_OK(ddp_group_register_memory(g, buf, n * sizeof(float)));
    /* One mapped allreduce on every rank first: the views exist, the series is mapped. */
    CHECK_OK(ddp_group_allreduce(g, buf, buf, n, DDP_F32, DDP_SUM));
    CHECK_MSG(is_mapped(g), "rank %d: registered, yet ran %s", rank, ddp_group_algorithm(g));
    int victim = world - 1;
    if (rank == victim) {
        /* A queue far longer than the sleep: the progress thread is inside (or between) mapped
         * allreduces of the series when the process dies. */
        for (int k = 0; k < 100; k++) {
            ddp_work_t *w = NULL;
            CHECK_OK(ddp_group_allreduce_async(g, buf, buf, n, DDP_F32, DDP_SUM, &w));
            ddp_work_free(w);
        }
        usleep(60 * 1000);
        raise(SIGKILL);
    }
    double start = now_s();
    ddp_status_t s = DDP_OK;
    int done = 0;
    for (; done < 200 && s == DDP_OK; done++) {
        s = ddp_group_allreduce(g, buf, buf, n, DDP_F32, DDP_SUM);
        CHECK_MSG(s != DDP_OK || is_mapped(g), "rank %d: call %d of the series ran %s", rank,
                  done, ddp_group_algorithm(g));
    }
    double took = now_s() - start;
    CHECK_MSG(s != DDP_OK, "rank %d: 200 allreduces succeeded without rank %d", rank, victim);
    fprintf(stderr, "rank %d: call %d failed after %.2f s: %s: %s\n", rank, done, took,
            ddp_status_string(s), ddp_last_error());
    CHECK_MSG(took < KILL_TIMEOUT_MS / 1000.0 + 10.0, "rank %d: the error took %.1f s", rank, took);
    char who[32];
    snprintf(who, sizeof who, "rank %d", victim);
    CHECK_ERROR_MENTIONS(who);
    CHECK_STATUS(ddp_group_barrier(g), DDP_ERR_ABORTED);
    /* Unregistering works on a broken group too. */
    CHECK_OK(ddp_group_unregister_memory(g, buf));
    ddp_group_destroy(g);
    ddp_store_destroy(store);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    const char *mode = argc > 2 ? argv[2] : "variants";
    setenv("DDP_TRANSPORT", "auto", 1);
    /* Registration by the caller only: with the default (auto) the buffers these modes reuse
     * unregistered would be registered by libddp and go mapped; the auto mode tests that. */
    setenv("DDP_SHM_MAP", "on", 1);
    int rc;
    if (!strcmp(mode, "kill")) {
        rc = ddp_test_run_victim(world, kill_rank);
    } else {
        ddp_test_rank_fn fn = !strcmp(mode, "variants")     ? rank_variants
                              : !strcmp(mode, "fallback")   ? rank_fallback
                              : !strcmp(mode, "unregister") ? rank_unregister
                              : !strcmp(mode, "errors")     ? rank_errors
                              : !strcmp(mode, "fork")       ? rank_fork
                              : !strcmp(mode, "tuned")      ? rank_tuned
                              : !strcmp(mode, "auto")       ? rank_auto
                              : !strcmp(mode, "pulled")     ? rank_pulled
                              : !strcmp(mode, "apply")      ? rank_apply
                              : !strcmp(mode, "writers")    ? rank_writers
                              : !strcmp(mode, "watch")      ? rank_watch
                              : !strcmp(mode, "small")      ? rank_small
                                                            : NULL;
        if (!fn || world < 1 ||
            ((fn == rank_fallback || fn == rank_tuned || fn == rank_auto || fn == rank_watch) &&
             world < 2)) {
            fprintf(stderr, "usage: test_shm_map <world> variants|fallback|unregister|errors|"
                            "fork|tuned|auto|kill|pulled|apply|writers|watch|small (fallback, "
                            "tuned, auto, watch: world >= 2)\n");
            return 2;
        }
        if ((fn == rank_auto || fn == rank_writers) && !ddp__shm_map_auto_available()) {
            printf("test_shm_map: skipped: libddp cannot register by itself here (malloc is not "
                   "glibc's, as under a sanitizer, or the kernel has no PROCMAP_QUERY)\n");
            return 77;
        }
        rc = ddp_test_run_ranks(world, 280, fn, NULL);
    }
    if (rc == 0) printf("test_shm_map world=%d %s: ok\n", world, mode);
    return rc;
}
