/* Fuzz target for the TCP store server's handling of what clients send (src/store/tcp_server.c:
 * the pre-authentication reader, frame splitting, AUTH, every request, parked waits and their
 * wake-ups), through ddp__store_server_replay: the server's own functions on socket pairs, with
 * no thread and no listener. Input: one byte of flags (bit 0: two connections, bit 1: a server
 * without a token), two bytes of split point, then the bytes the client(s) send; the second
 * connection gets the part after the split point. The server must end every connection (a
 * connection it keeps forever is a hang) and never crash, whatever arrives. */
#include <stdint.h>

#include "fuzz_common.h"
#include "store/store_impl.h"

#define TOKEN "fuzz-token"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) return 0;
    int two = data[0] & 1, tokenless = (data[0] >> 1) & 1;
    size_t split = (size_t)(data[1] | data[2] << 8);
    data += 3;
    size -= 3;
    if (split > size) split = size;
    const uint8_t *streams[2] = {data, data + split};
    size_t lens[2] = {two ? split : size, size - split};
    size_t replied[2] = {0, 0};
    ddp_status_t s = ddp__store_server_replay(streams, lens, two ? 2 : 1, tokenless ? NULL : TOKEN,
                                              replied);
    FUZZ_MUST(s != DDP_ERR_TIMEOUT, "the server ends every connection");
    FUZZ_MUST(s == DDP_OK || s == DDP_ERR_SYSTEM || s == DDP_ERR_NO_MEMORY, "replay status");
    return 0;
}
