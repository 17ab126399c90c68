# TCP transport and hierarchical allreduce: loopback tests of the ops tables in forked ranks, and
# a multi-host test over network namespaces (skipped when not root).
foreach(world 1 2 3 4)
  foreach(part a b c)
    ddp_add_test(NAME test_tcp_transport SOURCES test_tcp_transport.c ARGS ${world} ${part}
                 TIMEOUT 240 LIBS m)
  endforeach()
endforeach()
