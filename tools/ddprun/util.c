/* Small helpers ddprun's modules share: the monotonic clock, sleeping, signal names and random
 * tokens (the store's token, the job's DDPRUN_JOB_ID). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "ddprun.h"

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

const char *signal_name(int sig)
{
    const char *abbrev = sigabbrev_np(sig);
    static _Thread_local char name[32];
    snprintf(name, sizeof name, "SIG%s", abbrev ? abbrev : "?");
    return name;
}

void make_token(char *out, size_t size)
{
    unsigned char bytes[24];
    size_t got = 0;
    while (got < sizeof bytes) {
        ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
        if (n > 0) got += (size_t)n;
        else if (n < 0 && errno != EINTR) break;
    }
    if (got < sizeof bytes) {
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, bytes, sizeof bytes);
            if (n == (ssize_t)sizeof bytes) got = sizeof bytes;
            close(fd);
        }
    }
    if (got < sizeof bytes) {
        fprintf(stderr, "ddprun: cannot read random bytes for the store token\n");
        exit(1);
    }
    static const char hex[] = "0123456789abcdef";
    size_t k = 0;
    for (size_t j = 0; j < sizeof bytes && k + 2 < size; j++) {
        out[k++] = hex[bytes[j] >> 4];
        out[k++] = hex[bytes[j] & 15];
    }
    out[k] = '\0';
}
