/* The one list of transports a process group can be asked for. Selection in the group
 * (src/transport/registry.c looks names up in it), the accepted values and help of DDP_TRANSPORT
 * (src/core/config.c, printed by `ddprun --print-config`) and the docs all come from here, so
 * they cannot disagree. It lives in core because the config table (core) must name the choices;
 * it is data only: names, how each is reached, a line of help.
 *
 * X(name, reach, help):
 *   name   what DDP_TRANSPORT and ddp_group_options_t.transport say; the transport's ops table is
 *          `ddp__transport_<name>` in src/transport/<folder>/
 *   reach  BUILTIN: linked into libddp. MODULE: a library of its own, libddp_<name>.so, that
 *          src/transport/registry.c loads at run time when the transport is asked for (so its
 *          dependency stays out of libddp's ldd)
 *   help   one line for --print-config
 * "self" (a world of one rank) and "auto" are not in the list: self is never asked for, and auto
 * is the choice among these. */
#ifndef DDP_CORE_TRANSPORTS_H
#define DDP_CORE_TRANSPORTS_H

#define DDP_TRANSPORT_LIST(X)                                                                      \
    X(shm, BUILTIN, "one host, shared memory")                                                     \
    X(tcp, BUILTIN, "sockets, any hosts")                                                          \
    X(mpi, MODULE, "MPI, when built; no store needed under mpirun"      )                          \
    X(hierarchical, BUILTIN, "shm inside each host, tcp among host leaders")

/* "auto|shm|tcp|..." and "; shm: ...; tcp: ..." as string literals, for the config table. */
#define DDP__TRANSPORT_CHOICE_(name, reach, help) "|" #name
#define DDP__TRANSPORT_HELP_(name, reach, help) "; " #name ": " help
#define DDP_TRANSPORT_CHOICES "auto" DDP_TRANSPORT_LIST(DDP__TRANSPORT_CHOICE_)
#define DDP_TRANSPORT_HELP DDP_TRANSPORT_LIST(DDP__TRANSPORT_HELP_)

#endif
