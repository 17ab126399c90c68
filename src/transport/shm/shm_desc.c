/* Strict parsers of the descriptions shm ranks publish in the store (shm_desc.h): fixed fields,
 * bounded values, no sscanf (whose %d on an out-of-range number is undefined). */
#include <limits.h>
#include <stdint.h>

#include "transport/shm/shm_desc.h"

/* One unsigned decimal number at text[*at ..), at most max; advances *at past it. */
static int number(const char *text, size_t len, size_t *at, unsigned long long max,
                  unsigned long long *out)
{
    size_t i = *at;
    unsigned long long v = 0;
    if (i >= len || text[i] < '0' || text[i] > '9') return -1;
    for (; i < len && text[i] >= '0' && text[i] <= '9'; i++) {
        unsigned d = (unsigned)(text[i] - '0');
        if (v > (max - d) / 10) return -1;
        v = v * 10 + d;
    }
    *at = i;
    *out = v;
    return 0;
}

static size_t text_length(const char *text, size_t len)
{
    size_t n = 0;
    while (n < len && text[n] != 0) n++;
    return n;
}

int ddp__shm_desc_parse(const char *text, size_t len, int fields, ddp__shm_desc_t *out)
{
    if (!text || (fields != 3 && fields != 4)) return -1;
    len = text_length(text, len);
    unsigned long long v[4] = {0, 0, 0, 0};
    const unsigned long long max[4] = {INT_MAX, INT_MAX, SIZE_MAX, SIZE_MAX};
    size_t at = 0;
    for (int f = 0; f < fields; f++) {
        if (f > 0) {
            if (at >= len || text[at] != ' ') return -1;
            at++;
        }
        if (number(text, len, &at, max[f], &v[f]) != 0) return -1;
    }
    if (at != len || v[0] < 1) return -1;
    out->pid = (int)v[0];
    out->fd = (int)v[1];
    out->total = v[2];
    out->asked = v[3];
    return 0;
}

int ddp__shm_size_parse(const char *text, size_t len, unsigned long long *out)
{
    if (!text) return -1;
    len = text_length(text, len);
    size_t at = 0;
    unsigned long long v = 0;
    if (number(text, len, &at, SIZE_MAX, &v) != 0 || at != len) return -1;
    *out = v;
    return 0;
}
