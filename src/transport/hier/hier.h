/* The hierarchical transport (shared memory inside each host, TCP among one leader per host) and
 * its test hooks. Not installed. */
#ifndef DDP_TRANSPORT_HIER_H
#define DDP_TRANSPORT_HIER_H

#include "transport/transport.h"

extern const ddp__transport_ops_t ddp__transport_hierarchical;

/* Test hook: pretend this process runs on host `identity` (NULL: the real hostname and boot id),
 * so that one machine can play several hosts. Process-wide; set before create. */
void ddp__hier_set_host_identity(const char *identity);

/* Test hook: the transport used among the ranks of one host (NULL: shared memory). */
void ddp__hier_set_local_transport(const ddp__transport_ops_t *ops);

#endif
