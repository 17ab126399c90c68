/* The TCP transport's receive low-water mark (SO_RCVLOWAT while a data frame's payload is
 * awaited): results stay exact for frames shorter and longer than the mark, and after every
 * collective every TCP socket of the process is back at the default mark of 1 byte, which the
 * fingerprint exchange (64-byte frames) needs: a barrier with a short deadline must not time out.
 *
 *   test_tcp_lowat WORLD */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "core/internal.h"
#include "harness.h"
#include "transport/tcp/tcp.h"

static uint64_t seq;

static ddp_status_t run(void *state, ddp__collective_kind_t kind, const void *send, void *recv,
                        size_t count, int root, int64_t deadline_s)
{
    ddp__collective_t c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.seq = ++seq;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = DDP_F32;
    c.op = DDP_SUM;
    c.root = root;
    c.deadline_ns = ddp__now_ns() + deadline_s * 1000000000LL;
    return ddp__transport_tcp.run(state, &c);
}

/* Number of TCP stream sockets of this process whose SO_RCVLOWAT is not 1; *seen gets how many
 * stream sockets were looked at. */
static int sockets_with_raised_mark(int *seen)
{
    int raised = 0;
    *seen = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        int type = 0, mark = 0;
        socklen_t len = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
        len = sizeof mark;
        if (getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, &len) != 0) continue;
        (*seen)++;
        if (mark != 1) raised++;
    }
    closedir(d);
    return raised;
}

static int rank_main(int rank, int world, ddp_store_t *store, void *arg)
{
    (void)arg;
    void *state = NULL;
    CHECK_OK(ddp__transport_tcp.create(store, "lowat", rank, world, 60000, &state));
    /* Sizes in f32 elements: 0, 1, odd, prime, and large ones spanning many 512 KiB frames (the
     * mark is capped at 512 KiB, so a frame is awaited in several marks). */
    static const size_t sizes[] = {0, 1, 7, 65537, (1u << 20) + 3, (3u << 20) + 1};
    /* Chunk sizes: frames smaller than any useful mark, odd, and larger than the cap. */
    static const size_t chunks[] = {64, 100003, 512 * 1024, 4u << 20};
    size_t maxn = sizes[sizeof sizes / sizeof sizes[0] - 1];
    float *in = malloc(maxn * sizeof *in), *out = malloc(maxn * sizeof *out);
    CHECK(in && out);
    ddp__tcp_set_small_threshold(0); /* the ring, with its data frames, from 1 element on */
    for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
        ddp__tcp_set_chunk_bytes(chunks[k]);
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            size_t n = sizes[s];
            if (chunks[k] == 64 && n > 70000) continue; /* 64-byte frames: keep the run short */
            for (size_t i = 0; i < n; i++) in[i] = (float)((size_t)rank + 1 + i % 13);
            memset(out, 0xff, n * sizeof *out);
            CHECK_OK(run(state, DDP__ALLREDUCE, in, out, n, 0, 60));
            /* Sum over ranks of (r + 1 + i % 13): exact in f32 for these small integers. */
            for (size_t i = 0; i < n; i++) {
                float want = (float)((size_t)world * (world + 1) / 2 + (size_t)world * (i % 13));
                CHECK_MSG(out[i] == want, "chunk %zu size %zu: element %zu is %g, want %g",
                          chunks[k], n, i, (double)out[i], (double)want);
                if (out[i] != want) break;
            }
            int seen = 0, raised = sockets_with_raised_mark(&seen);
            CHECK_MSG(raised == 0, "chunk %zu size %zu: %d of %d TCP sockets left with "
                      "SO_RCVLOWAT != 1", chunks[k], n, raised, seen);
            CHECK_MSG(world == 1 || seen >= world - 1, "only %d TCP sockets found", seen);
            /* A barrier is the fingerprint exchange alone: small frames, short deadline. */
            CHECK_OK(run(state, DDP__BARRIER, NULL, NULL, 0, 0, 10));
        }
        /* The broadcast chain, from the last rank, uses the same exchange. */
        size_t n = (1u << 20) + 3;
        for (size_t i = 0; i < n; i++) out[i] = rank == world - 1 ? (float)(i % 251) : -1.0f;
        CHECK_OK(run(state, DDP__BROADCAST, NULL, out, n, world - 1, 60));
        for (size_t i = 0; i < n; i += 997)
            CHECK_MSG(out[i] == (float)(i % 251), "broadcast element %zu", i);
        int seen = 0;
        CHECK(sockets_with_raised_mark(&seen) == 0);
        CHECK_OK(run(state, DDP__BARRIER, NULL, NULL, 0, 0, 10));
    }
    ddp__tcp_set_chunk_bytes(512 * 1024);
    ddp__tcp_set_small_threshold(64 * 1024);
    if (rank == 0)
        printf("world %d: allreduce exact for every size x chunk, every socket back at "
               "SO_RCVLOWAT 1 after each collective, %llu collectives\n", world,
               (unsigned long long)seq);
    free(in);
    free(out);
    ddp__transport_tcp.destroy(state);
    return 0;
}

int main(int argc, char **argv)
{
    int world = argc > 1 ? atoi(argv[1]) : 2;
    if (world < 1 || world > 8) {
        fprintf(stderr, "usage: test_tcp_lowat WORLD (1..8)\n");
        return 2;
    }
    setenv("DDP_STORE_TOKEN", "test-token-lowat", 1);
    return ddp_test_run_ranks(world, 120, rank_main, NULL);
}
