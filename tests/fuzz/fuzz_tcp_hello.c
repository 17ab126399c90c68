/* Fuzz target for the TCP transport's acceptor (src/transport/tcp/tcp_socket.c): the hello a
 * connecting stranger sends before it is authenticated, checked by ddp__tcp_hello_check as the
 * acceptor's read loop feeds it - first the fixed header, then exactly the bytes it announces.
 * The acceptor is rank 2 of 4 in group "fuzz-group" with token "fuzz-token", rank 0 already
 * connected. A hello is accepted only when it is exactly what ddp__tcp_hello_encode makes for
 * rank 1; the bytes the check asks for never exceed the largest hello. */
#include <stddef.h>
#include <stdint.h>

#include "fuzz_common.h"
#include "transport/tcp/tcp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char token[] = "fuzz-token", group[] = "fuzz-group";
    ddp__tcp_conn_t conns[4] = {{.fd = 7}, {.fd = -1}, {.fd = -1}, {.fd = -1}};
    /* As the acceptor reads: only what the check asks for, from a buffer of the largest size. */
    char buf[DDP_TCP_MAX_HELLO];
    size_t have = 0;
    for (;;) {
        size_t need = 0;
        int from = -1;
        const char *why = NULL;
        int r = ddp__tcp_hello_check(buf, have, token, group, 2, 4, conns, &need, &from, &why);
        if (r < 0) {
            FUZZ_MUST(why && why[0], "a refused hello has a reason");
            break;
        }
        if (r > 0) {
            char want[DDP_TCP_MAX_HELLO];
            size_t want_len = ddp__tcp_hello_encode(want, 1, 2, 4, token, group);
            FUZZ_MUST(from == 1, "only rank 1 may connect");
            FUZZ_MUST(have == want_len, "an accepted hello is complete");
            size_t reserved = offsetof(ddp__tcp_hello_t, reserved), after = sizeof(ddp__tcp_hello_t);
            FUZZ_MUST(memcmp(buf, want, reserved) == 0 &&
                          memcmp(buf + after, want + after, have - after) == 0,
                      "an accepted hello is rank 1's (but for the reserved word)");
            break;
        }
        FUZZ_MUST(need > have && need <= DDP_TCP_MAX_HELLO, "the bytes asked for fit the buffer");
        size_t take = need - have;
        if (take > size - have) take = size - have;
        if (take == 0) break; /* the stranger stopped sending */
        memcpy(buf + have, data + have, take);
        have += take;
    }
    return 0;
}
