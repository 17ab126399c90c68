/* The shared-memory transport's table (the hierarchical transport uses it inside each host) and
 * its test hooks. Not installed. */
#ifndef DDP_TRANSPORT_SHM_H
#define DDP_TRANSPORT_SHM_H

#include <stdint.h>

#include "transport/transport.h"

extern const ddp__transport_ops_t ddp__transport_shm;

/* How long a sleeping waiter naps before it looks again on its own (0: 100 ms, which bounds how
 * late a deadline, an abort flag or a dead peer is noticed). tests/test_shm_wakeup sets it
 * beyond the group's timeout, so that a lost wake-up is a hang, not a delay. */
void ddp__shm_set_nap_ns(int64_t nap_ns);

/* Tests: groups created after this multiply this process's measurements of tuner variant v by
 * skew[v] (0: unchanged), so that ranks disagree about what is fastest; the variants that run
 * must still be the same on every rank (they are rank 0's decisions). */
void ddp__shm_set_tune_skew(const double *skew, int n);

#endif
