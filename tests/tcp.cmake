# TCP transport and hierarchical allreduce: loopback tests of the ops tables in forked ranks, and
# a multi-host test over network namespaces (skipped when not root).
foreach(world 1 2 3 4)
  foreach(part a b c)
    ddp_add_test(NAME test_tcp_transport SOURCES test_tcp_transport.c ARGS ${world} ${part}
                 TIMEOUT 240 LIBS m)
  endforeach()
endforeach()
foreach(mode mismatch timeout kill intruder)
  foreach(world 2 3 4)
    ddp_add_test(NAME test_tcp_failures SOURCES test_tcp_failures.c ARGS ${world} ${mode} TIMEOUT 120)
  endforeach()
endforeach()
# Hierarchical: pretend hosts (rank r on host LAYOUT[r]); shared memory inside, TCP among leaders.
foreach(layout AB AAB ABAB AABBC)
  ddp_add_test(NAME test_tcp_hier SOURCES test_tcp_hier.c ARGS ${layout} TIMEOUT 200 LIBS m)
endforeach()
