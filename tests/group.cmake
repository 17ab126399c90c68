# Process groups and the shared-memory transport (src/group, src/transport/shm, src/core/reduce).
foreach(world 1 2 3 4)
  foreach(family allreduce broadcast reduce_scatter allgather)
    ddp_add_test(NAME test_group_ops SOURCES test_group_ops.c ARGS ${world} ${family} TIMEOUT 120
                 LIBS m)
  endforeach()
endforeach()
