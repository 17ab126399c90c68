/* Self-tuning of the shared-memory allreduce: which variant each size class uses, chosen by
 * measurement. Agreement without a message of its own: the variant of a call is a function of
 * data every rank holds identically (the class's call count, its incumbent, the mode), and the
 * incumbent changes only when rank 0 publishes an update in the mailbox line of a collective's
 * first phase, which every rank applies at that same collective (shm_agree.c). So every rank
 * runs the same variant for the same call, whatever its own clock says; results are bitwise
 * identical across variants anyway (same kernel, same rank order). */
#include <stdio.h>
#include <string.h>

#include "core/internal.h"
#include "transport/shm/shm_tune.h"

/* The first PROBE_CALLS_PER_VARIANT calls of a class per candidate try each candidate, in runs of
 * consecutive calls (the probe); then, online, the last TRIAL_CALLS calls of every TRIAL_PERIOD
 * try one other candidate, so that a
 * change of the machine's state (two vCPUs moving between separate and shared caches) is
 * followed within a few periods. A trial of a variant 2x slower costs 1/32 of the calls 2x. */
#define PROBE_CALLS_PER_VARIANT DDP__SHM_TUNE_WINDOW
#define TRIAL_PERIOD 32u
/* A variant's speed depends on the one before it (the stage lines it finds in the peers' caches
 * or in memory): the first call after a switch is not recorded, so every sample is of a variant
 * running after itself. Measured: probing in turn (nt, plain, nt, ...) picked plain stores at
 * 2-8 MiB while nt was 25-40 % faster run after run. */
#define TRIAL_CALLS 2u
/* A challenger replaces the incumbent only when clearly faster: measurements on a shared
 * machine jitter by 10 % from call to call. */
#define SWITCH_MARGIN 0.9

static const char *const kind_names[DDP__SHM_TUNE_KINDS] = {"allreduce", "broadcast", "allgather",
                                                            "reduce_scatter", "alltoall",
                                                            "reduce_scatter_apply"};

int ddp__shm_tune_key(int kind, size_t bytes)
{
    int log2 = 0;
    while (log2 < 63 && ((size_t)1 << (log2 + 1)) <= bytes) log2++;
    int cls = log2 - 6;
    if (cls < 0) cls = 0;
    if (cls >= DDP__SHM_TUNE_CLASSES) cls = DDP__SHM_TUNE_CLASSES - 1;
    return kind * DDP__SHM_TUNE_CLASSES + cls;
}

static int count_bits(unsigned x)
{
    int n = 0;
    for (; x; x &= x - 1) n++;
    return n;
}

/* The k-th set bit of `set` (k < count_bits(set)). */
static int nth_bit(unsigned set, int k)
{
    for (int v = 0; v < DDP__SHM_VARIANTS; v++)
        if (set & (1u << v) && k-- == 0) return v;
    return -1;
}

int ddp__shm_tune_pick(ddp__shm_tune_t *t, int cls, unsigned candidates, int fallback)
{
    int n = count_bits(candidates);
    if (t->mode == DDP__SHM_TUNE_OFF || n <= 1) return n == 1 ? nth_bit(candidates, 0) : fallback;
    uint32_t call = t->calls[cls]++;
    if (call < (uint32_t)(PROBE_CALLS_PER_VARIANT * n))
        return nth_bit(candidates, (int)(call / PROBE_CALLS_PER_VARIANT));
    int incumbent = t->current[cls] ? t->current[cls] - 1 : fallback;
    if (!(candidates & (1u << incumbent))) incumbent = nth_bit(candidates, 0);
    if (t->mode == DDP__SHM_TUNE_ONLINE && call % TRIAL_PERIOD >= TRIAL_PERIOD - TRIAL_CALLS) {
        unsigned others = candidates & ~(1u << incumbent);
        return nth_bit(others, (int)((call / TRIAL_PERIOD) % (uint32_t)count_bits(others)));
    }
    return incumbent;
}

/* The median of a variant's last measurements (the lowest while it has only two). */
static double estimate(const ddp__shm_tune_t *t, int cls, int v)
{
    const float *w = t->window[cls][v];
    uint32_t n = t->samples[cls][v] < DDP__SHM_TUNE_WINDOW ? t->samples[cls][v]
                                                           : DDP__SHM_TUNE_WINDOW;
    if (n == 1) return w[0];
    if (n == 2) return w[0] < w[1] ? w[0] : w[1];
    double a = w[0], b = w[1], c = w[2];
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

void ddp__shm_tune_record(ddp__shm_tune_t *t, int cls, int variant, unsigned candidates,
                          size_t bytes, int64_t ns)
{
    if (t->mode == DDP__SHM_TUNE_OFF || variant < 0 || variant >= DDP__SHM_VARIANTS || !bytes)
        return;
    int after_itself = t->previous[cls] == variant + 1;
    t->previous[cls] = (uint8_t)(variant + 1);
    if (!after_itself) return;
    double x = (double)ns / (double)bytes * (t->skew[variant] > 0 ? t->skew[variant] : 1.0);
    t->window[cls][variant][t->samples[cls][variant]++ % DDP__SHM_TUNE_WINDOW] = (float)x;
    int n = count_bits(candidates);
    uint32_t probe_calls = (uint32_t)(PROBE_CALLS_PER_VARIANT * n);
    if (n <= 1 || t->calls[cls] < probe_calls) return;
    /* Decide at the end of the probe and after each trial, not on every sample of the incumbent:
     * its own noise would otherwise flip the choice against stale challengers. */
    int incumbent = t->current[cls] ? t->current[cls] - 1 : -1;
    if (t->calls[cls] != probe_calls && variant == incumbent) return;
    int best = -1;
    for (int v = 0; v < DDP__SHM_VARIANTS; v++)
        if (candidates & (1u << v) && t->samples[cls][v] &&
            (best < 0 || estimate(t, cls, v) < estimate(t, cls, best)))
            best = v;
    if (best < 0 || best == incumbent) return;
    if (incumbent >= 0 && t->samples[cls][incumbent] &&
        !(estimate(t, cls, best) < SWITCH_MARGIN * estimate(t, cls, incumbent)))
        return;
    t->pending = (uint16_t)(1 + cls * DDP__SHM_VARIANTS + best);
}

uint16_t ddp__shm_tune_take_update(ddp__shm_tune_t *t)
{
    uint16_t u = t->pending;
    t->pending = 0;
    return u;
}

/* "64 KiB", "1 MiB": the bounds of a size class, which are powers of two. */
static void power_text(size_t bytes, char *buf, size_t size)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
        bytes /= 1024;
        u++;
    }
    snprintf(buf, size, "%zu %s", bytes, units[u]);
}

int ddp__shm_tune_apply(ddp__shm_tune_t *t, uint16_t update, ddp_trace_t *trace)
{
    if (!update) return 0;
    int cls = (update - 1) / DDP__SHM_VARIANTS, variant = (update - 1) % DDP__SHM_VARIANTS;
    if (cls >= DDP__SHM_TUNE_KEYS || t->current[cls] == variant + 1) return 0;
    int before = t->current[cls] ? t->current[cls] - 1 : -1;
    t->current[cls] = (uint8_t)(variant + 1);
    const int size_class = cls % DDP__SHM_TUNE_CLASSES;
    const char *kind = kind_names[cls / DDP__SHM_TUNE_CLASSES];
    const char *new_name = ddp__shm_algorithm_name(variant);
    const char *old_name = before >= 0 ? ddp__shm_algorithm_name(before) : "the default";
    /* Only rank 0's estimates decided; the other ranks' are their own clocks' and say nothing. */
    char new_cost[32] = "", old_cost[32] = "";
    if (t->rank == 0) {
        snprintf(new_cost, sizeof new_cost, "%.3g",
                 t->samples[cls][variant] ? estimate(t, cls, variant) : 0.0);
        if (before >= 0)
            snprintf(old_cost, sizeof old_cost, "%.3g",
                     t->samples[cls][before] ? estimate(t, cls, before) : 0.0);
        DDP_LOG(DDP_LOG_INFO,
                "shm tune: %s %zu-%zu bytes: %s (%s ns/B on rank 0) replaces %s%s%s%s", kind,
                (size_t)64 << size_class, ((size_t)128 << size_class) - 1,
                new_name, new_cost, old_name, before >= 0 ? " (" : "", old_cost,
                before >= 0 ? " ns/B)" : "");
    }
    if (trace) {
        char lo[32], hi[32], name[160], calls[16];
        power_text((size_t)64 << size_class, lo, sizeof lo);
        power_text((size_t)128 << size_class, hi, sizeof hi);
        snprintf(name, sizeof name, "shm tune: %s [%s, %s): %s", kind, lo, hi, new_name);
        snprintf(calls, sizeof calls, "%u", (unsigned)t->calls[cls]);
        char bytes_text[48];
        snprintf(bytes_text, sizeof bytes_text, "%zu-%zu", (size_t)64 << size_class,
                 ((size_t)128 << size_class) - 1);
        const char *args[16] = {"collective", kind,     "bytes",      bytes_text,
                                "variant",    new_name, "replaces", old_name,
                                "calls of the class", calls};
        int nargs = 5;
        if (t->rank == 0) {
            args[2 * nargs] = "ns per byte on rank 0";
            args[2 * nargs + 1] = new_cost;
            nargs++;
            if (before >= 0) {
                args[2 * nargs] = "replaced ns per byte on rank 0";
                args[2 * nargs + 1] = old_cost;
                nargs++;
            }
        }
        (void)ddp_trace_instant(trace, name, "tune", 0, ddp__now_us(), args, nargs);
    }
    return 1;
}
