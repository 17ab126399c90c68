# Every rank agrees on every outcome (docs/shm-transport.md, "Agreement"): a late rank fails where
# its peers gave up, and a rank stopped at a random moment makes every rank fail at the same
# collective. On each transport that runs on one host.
foreach(transport shm tcp hierarchical)
  foreach(world 2 3)
    foreach(mode late stop)
      ddp_add_test(NAME test_agreement SOURCES test_agreement.c ARGS ${transport} ${world} ${mode}
                   TIMEOUT 120)
    endforeach()
  endforeach()
endforeach()
# The rank that stopped is the one named, also when others waited for it through a ring.
foreach(transport shm tcp)
  foreach(world 3 4)
    ddp_add_test(NAME test_agreement SOURCES test_agreement.c ARGS ${transport} ${world} blame
                 TIMEOUT 120)
  endforeach()
endforeach()
# The same on shm with the single-copy allreduce (process_vm_readv between phases) for the large
# size class: DDP_SHM_CMA_BYTES set explicitly makes every allreduce from 256 KiB up single copy.
foreach(world 2 3)
  foreach(mode late stop)
    set(name test_agreement.shm_${world}_${mode}_single_copy)
    add_test(NAME ${name} COMMAND test_agreement shm ${world} ${mode})
    set_tests_properties(${name} PROPERTIES TIMEOUT 120 ENVIRONMENT "DDP_SHM_CMA_BYTES=262144")
  endforeach()
endforeach()
