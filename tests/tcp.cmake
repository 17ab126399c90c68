# TCP transport and hierarchical allreduce: loopback tests of the ops tables in forked ranks, and
# a multi-host test over network namespaces (skipped when not root).
foreach(world 1 2 3 4)
  foreach(part a b c d)
    ddp_add_test(NAME test_tcp_transport SOURCES test_tcp_transport.c ARGS ${world} ${part}
                 TIMEOUT 240 LIBS m)
  endforeach()
endforeach()
foreach(mode mismatch timeout kill intruder ifname abort)
  foreach(world 2 3 4)
    ddp_add_test(NAME test_tcp_failures SOURCES test_tcp_failures.c ARGS ${world} ${mode} TIMEOUT 120
                 LIBS Threads::Threads)
  endforeach()
endforeach()
# Hierarchical: pretend hosts (rank r on host LAYOUT[r]); shared memory inside, TCP among leaders.
foreach(layout AB AAB ABAB AABBC)
  foreach(part a b)
    ddp_add_test(NAME test_tcp_hier SOURCES test_tcp_hier.c ARGS ${layout} ${part} TIMEOUT 200 LIBS m)
  endforeach()
endforeach()

# Multi-host over network namespaces (root only; SKIP otherwise): 2 and 3 hosts of 2 ranks each
# launched by ddprun (hierarchical), 2 hosts with DDP_HIERARCHICAL=0 (flat tcp), a host
# killed in the middle of a job, and 2 and 3 hosts started with srun's variables (no ddprun).
if(TARGET ddprun)
  add_executable(test_tcp_multihost_worker test_tcp_multihost_worker.c)
  target_link_libraries(test_tcp_multihost_worker PRIVATE ddp_test_harness m)
  set_target_properties(test_tcp_multihost_worker PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  foreach(run "2;check" "3;check" "2;flat" "2;kill" "2;slurm" "3;slurm")
    list(GET run 0 hosts)
    list(GET run 1 mode)
    add_test(NAME test_tcp_multihost.${hosts}hosts_${mode}
             COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/netns/multihost.sh $<TARGET_FILE:ddprun>
                     $<TARGET_FILE:test_tcp_multihost_worker> ${hosts} ${mode})
    set_tests_properties(test_tcp_multihost.${hosts}hosts_${mode} PROPERTIES
      SKIP_RETURN_CODE 77 TIMEOUT 300 RUN_SERIAL TRUE)
  endforeach()
endif()
