/* Fuzz target for the descriptions shm ranks read from the store (src/transport/shm/shm_desc.c):
 * rank 0's "pid fd bytes" of the group segment, "pid fd total asked" of a segment buffer, and a
 * peer's answer with its size. Whatever the text, the parse either fails or yields numbers in
 * their ranges that print back to a text parsing to the same numbers. */
#include <limits.h>
#include <stdint.h>

#include "fuzz_common.h"
#include "transport/shm/shm_desc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    for (int fields = 3; fields <= 4; fields++) {
        ddp__shm_desc_t d;
        if (ddp__shm_desc_parse(text, size, fields, &d) != 0) continue;
        FUZZ_MUST(d.pid >= 1 && d.fd >= 0, "pid and fd in range");
        FUZZ_MUST(d.total <= SIZE_MAX && d.asked <= SIZE_MAX, "sizes in range");
        char again[128];
        int n = fields == 3 ? snprintf(again, sizeof again, "%d %d %llu", d.pid, d.fd, d.total)
                            : snprintf(again, sizeof again, "%d %d %llu %llu", d.pid, d.fd,
                                       d.total, d.asked);
        ddp__shm_desc_t e;
        FUZZ_MUST(ddp__shm_desc_parse(again, (size_t)n, fields, &e) == 0 && e.pid == d.pid &&
                      e.fd == d.fd && e.total == d.total && e.asked == d.asked,
                  "a parsed description prints back to itself");
    }
    unsigned long long v;
    if (ddp__shm_size_parse(text, size, &v) == 0) FUZZ_MUST(v <= SIZE_MAX, "size in range");
    return 0;
}
