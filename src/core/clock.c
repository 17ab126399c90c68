/* Clocks, deadlines and sleeping: the one set every layer uses (stores, transports, the group),
 * so that "now", "how long is left" and "nap" mean the same everywhere. */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "core/internal.h"

static int64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t ddp__now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

int64_t ddp__coarse_now_ns(void) { return clock_ns(CLOCK_MONOTONIC_COARSE); }

int64_t ddp__deadline_ns(int timeout_ms)
{
    /* The coarse clock lags the precise one by up to a tick and the tick's own lateness (6.9
     * ms measured with 4 ms ticks): two resolutions of slack keep a deadline from coming early
     * (it may come that much late instead). */
    static _Atomic int64_t slack_ns = -1;
    int64_t slack = atomic_load_explicit(&slack_ns, memory_order_relaxed);
    if (slack < 0) {
        struct timespec res;
        slack = clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0
                    ? 2 * ((int64_t)res.tv_sec * 1000000000LL + res.tv_nsec)
                    : 20000000LL;
        atomic_store_explicit(&slack_ns, slack, memory_order_relaxed);
    }
    return ddp__coarse_now_ns() + (int64_t)timeout_ms * 1000000LL + slack;
}

struct timespec ddp__timespec_in(int clock, int64_t ns)
{
    struct timespec ts;
    clock_gettime((clockid_t)clock, &ts);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec += (long)(ns % 1000000000LL);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

int64_t ddp__deadline_precise_ns(int64_t timeout_ms)
{
    return ddp__now_ns() + timeout_ms * 1000000LL;
}

double ddp__now_us(void) { return (double)ddp__now_ns() / 1000.0; }

double ddp_time_us(void) { return ddp__now_us(); }

int ddp__ms_left(int64_t deadline_ns, int cap_ms)
{
    int64_t left = deadline_ns - ddp__now_ns();
    if (left <= 0) return 0;
    int64_t ms = (left + 999999) / 1000000; /* round up: never report 0 while time is left */
    return ms > cap_ms ? cap_ms : (int)ms;
}

void ddp__sleep_us(int64_t us)
{
    if (us <= 0) return;
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
