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
