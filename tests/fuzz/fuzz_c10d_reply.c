/* Fuzz target for the c10d TCPStore client's reading of replies (src/store/c10d_client.c): the
 * client runs a script of requests on a socket pair whose other end has been given the input's
 * bytes as the server's answers (then closed), through ddp__store_c10d_adopt. Input: one byte n
 * (the script's length, n % 16), n bytes each choosing a request, then the server's bytes. Every
 * call must return DDP_OK or an error with a message - no crash, no hang, no allocation beyond
 * the protocol's bounds (a value of at most DDP_STORE_MAX_VALUE). */
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "store/c10d.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Runs request `op` (0..8); returns its status. Values returned are checked and freed. */
static ddp_status_t one(ddp_store_t *store, int op)
{
    static const char *const two[2] = {"a", "b"};
    void *v = NULL;
    size_t len = 0;
    int64_t n = 0;
    int flag = 0;
    ddp_status_t s = DDP_OK;
    switch (op) {
    case 0:
        s = ddp_store_set(store, "a", "1", 1);
        break;
    case 1:
        s = ddp_store_get(store, "a", &v, &len);
        if (s == DDP_OK) {
            FUZZ_MUST(len <= DDP_STORE_MAX_VALUE, "a value within the bound");
            FUZZ_MUST(((char *)v)[len] == 0, "a value is NUL-terminated");
        }
        break;
    case 2:
        s = ddp_store_add(store, "n", 3, &n);
        break;
    case 3:
        s = ddp_store_compare_set(store, "a", "1", 1, "2", 1, &v, &len);
        if (s == DDP_OK) FUZZ_MUST(len <= DDP_STORE_MAX_VALUE, "a value within the bound");
        break;
    case 4:
        s = ddp_store_check(store, two, 2, &flag);
        if (s == DDP_OK) FUZZ_MUST(flag == 0 || flag == 1, "check answers yes or no");
        break;
    case 5:
        s = ddp_store_wait(store, two, 2, 50);
        break;
    case 6:
        s = ddp_store_delete(store, "a", &flag);
        break;
    case 7:
        s = ddp_store_num_keys(store, &n);
        break;
    default:
        s = ddp_store_get(store, "b", &v, &len);
        if (s == DDP_OK) FUZZ_MUST(len <= DDP_STORE_MAX_VALUE, "a value within the bound");
        break;
    }
    ddp_free(v);
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    size_t nops = data[0] % 16;
    if (size < 1 + nops) return 0;
    const uint8_t *ops = data + 1;
    const uint8_t *reply = data + 1 + nops;
    size_t reply_len = size - 1 - nops;
    int sv[2];
    FUZZ_MUST(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
    /* The whole answer fits the socket buffer (inputs are at most a few KiB; the bigger ones are
     * cut, as a server closing early would). */
    int buf = 1 << 20;
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    size_t put = 0;
    while (put < reply_len) {
        ssize_t n = send(sv[1], reply + put, reply_len - put, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n <= 0) break;
        put += (size_t)n;
    }
    shutdown(sv[1], SHUT_WR);
    ddp_store_t *store = NULL;
    ddp_status_t s = ddp__store_c10d_adopt(sv[0], 2000, &store);
    FUZZ_MUST(s == DDP_OK, "adopting the connection");
    for (size_t i = 0; i < nops; i++) {
        s = one(store, ops[i] % 9);
        if (s != DDP_OK) {
            FUZZ_FAILED_WELL(s);
            /* The server's side is closed after its last byte: nothing may wait for more. */
            FUZZ_MUST(s != DDP_ERR_TIMEOUT, "no wait on a closed connection");
            break;
        }
    }
    ddp_store_destroy(store);
    close(sv[1]);
    return 0;
}
