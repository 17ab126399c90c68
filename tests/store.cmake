# Rendezvous stores: one-process semantics and validation for every store, many processes (or
# threads) hammering each store at world sizes 1-4, and the TCP server under hostile clients.
ddp_add_test(NAME test_store_api SOURCES test_store_api.c TIMEOUT 60 LABELS store)
foreach(kind file tcp hash)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_store_multi SOURCES test_store_multi.c ARGS ${kind} ${world}
                 TIMEOUT 120 LABELS store)
  endforeach()
endforeach()
