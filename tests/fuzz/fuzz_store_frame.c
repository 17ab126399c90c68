/* Fuzz target for the TCP store's frame codec (src/store/tcp_frame.c): splits the input into
 * frames under both size limits, decodes every complete one, and checks that a decoded request
 * re-encodes to exactly the bytes it came from (the encoding is canonical). Built for libFuzzer
 * with clang (target fuzz_store_frame); with -DDDP_FUZZ_STANDALONE it gets a main() that replays
 * the seed corpus plus deterministic mutations of it, which ctest runs with any compiler. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/tcp_frame.h"

static void must(int cond, const char *what)
{
    if (!cond) {
        fprintf(stderr, "fuzz_store_frame: invariant broken: %s\n", what);
        abort();
    }
}

static void one_payload(const uint8_t *payload, size_t len)
{
    ddp__store_request_t req;
    char reason[128];
    if (ddp__store_request_decode(payload, len, &req, reason, sizeof reason) != 0) {
        must(reason[0] != 0, "a rejected request has a reason");
        ddp__store_request_free(&req);
        return;
    }
    for (uint32_t i = 0; i < req.nkeys; i++) must(strlen(req.keys[i]) <= DDP_STORE_MAX_KEY, "key length");
    must(req.value_len <= DDP_STORE_MAX_VALUE, "value length");
    must(req.expected_len <= DDP_STORE_MAX_VALUE, "expected length");
    ddp__bytes_t b = {0};
    ddp__store_request_encode(&b, &req);
    must(!b.failed, "encoding allocates");
    must(b.len == len + DDP__STORE_FRAME_HEADER, "re-encoded length");
    must(ddp__load_u32(b.data) == len, "re-encoded prefix");
    must(memcmp(b.data + DDP__STORE_FRAME_HEADER, payload, len) == 0, "re-encoded bytes");
    ddp__bytes_free(&b);
    ddp__store_request_free(&req);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The input as a stream of frames, the way the server consumes a connection's bytes. */
    for (int authenticated = 0; authenticated < 2; authenticated++) {
        size_t limit = authenticated ? DDP__STORE_MAX_FRAME : DDP__STORE_MAX_AUTH_FRAME;
        size_t off = 0;
        for (;;) {
            size_t payload_len = 0;
            const char *why = NULL;
            int r = ddp__store_frame_split(data + off, size - off, limit, &payload_len, &why);
            if (r == DDP__FRAME_BAD) {
                must(why != NULL, "a bad frame has a reason");
                break;
            }
            if (r == DDP__FRAME_NEED_MORE) break;
            must(payload_len >= 1 && payload_len <= limit, "payload within the limit");
            must(DDP__STORE_FRAME_HEADER + payload_len <= size - off, "frame within the input");
            one_payload(data + off + DDP__STORE_FRAME_HEADER, payload_len);
            off += DDP__STORE_FRAME_HEADER + payload_len;
        }
    }
    /* The input as one payload. */
    one_payload(data, size);
    return 0;
}

#ifdef DDP_FUZZ_STANDALONE
#include <dirent.h>

static uint64_t next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Replays each seed, then mutates seeds (byte flips, truncations, splices, length-field
 * rewrites) a fixed number of times with a fixed seed, so a failure reproduces. */
int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : DDP_FUZZ_CORPUS_DIR;
    long iterations = argc > 2 ? atol(argv[2]) : 200000;
    DIR *d = opendir(dir);
    if (!d) {
        perror(dir);
        return 1;
    }
    uint8_t *seeds[256];
    size_t lens[256];
    int nseeds = 0;
    struct dirent *e;
    while ((e = readdir(d)) && nseeds < 256) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        uint8_t *buf = malloc(1 << 16);
        size_t n = fread(buf, 1, 1 << 16, f);
        fclose(f);
        seeds[nseeds] = buf;
        lens[nseeds++] = n;
        LLVMFuzzerTestOneInput(buf, n);
    }
    closedir(d);
    if (nseeds == 0) {
        fprintf(stderr, "no seeds in %s\n", dir);
        return 1;
    }
    uint64_t rng = 42;
    uint8_t *work = malloc(1 << 17);
    for (long it = 0; it < iterations; it++) {
        int a = (int)(next(&rng) % (uint64_t)nseeds);
        size_t n = lens[a];
        memcpy(work, seeds[a], n);
        int edits = 1 + (int)(next(&rng) % 4);
        for (int k = 0; k < edits; k++) {
            uint64_t r = next(&rng);
            switch (r % 5) {
            case 0: /* flip a byte */
                if (n) work[(r >> 8) % n] ^= (uint8_t)(1 + (r >> 32) % 255);
                break;
            case 1: /* truncate */
                if (n) n = (size_t)((r >> 8) % n);
                break;
            case 2: { /* append part of another seed */
                int b = (int)((r >> 8) % (uint64_t)nseeds);
                size_t take = lens[b] < 512 ? lens[b] : 512;
                if (n + take < (1 << 17)) {
                    memcpy(work + n, seeds[b], take);
                    n += take;
                }
                break;
            }
            case 3: /* rewrite a 4-byte field with an interesting length */
                if (n >= 4) {
                    static const uint32_t v[] = {0, 1, 2, 3, 4, 5, 0x7fffffff, 0xffffffff,
                                                 DDP_STORE_MAX_KEY, DDP_STORE_MAX_KEY + 1,
                                                 DDP__STORE_MAX_AUTH_FRAME,
                                                 DDP__STORE_MAX_AUTH_FRAME + 1};
                    size_t at = (size_t)((r >> 8) % (n - 3));
                    uint32_t x = v[(r >> 40) % (sizeof v / sizeof v[0])];
                    work[at] = (uint8_t)(x >> 24);
                    work[at + 1] = (uint8_t)(x >> 16);
                    work[at + 2] = (uint8_t)(x >> 8);
                    work[at + 3] = (uint8_t)x;
                }
                break;
            default: /* insert random bytes */
                for (int j = 0; j < 8 && n < (1 << 17); j++) work[n++] = (uint8_t)next(&rng);
                break;
            }
        }
        LLVMFuzzerTestOneInput(work, n);
    }
    printf("fuzz_store_frame: %d seeds, %ld mutated inputs: ok\n", nseeds, iterations);
    for (int i = 0; i < nseeds; i++) free(seeds[i]);
    free(work);
    return 0;
}
#endif
