# Rendezvous stores: one-process semantics and validation for every store, many processes (or
# threads) hammering each store at world sizes 1-4, and the TCP server under hostile clients.
ddp_add_test(NAME test_store_api SOURCES test_store_api.c TIMEOUT 60 LABELS store)
foreach(kind file tcp hash)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_store_multi SOURCES test_store_multi.c ARGS ${kind} ${world}
                 TIMEOUT 120 LABELS store)
  endforeach()
endforeach()

ddp_add_test(NAME test_store_tcp_abuse SOURCES test_store_tcp_abuse.c TIMEOUT 90 LABELS store)
# Connections that never authenticate: their memory, lock-out of honest clients under a low
# descriptor limit, the authentication deadline, and a client retrying after it is evicted.
foreach(case memory lockout lockout_emfile deadline evicted)
  ddp_add_test(NAME test_store_tcp_preauth SOURCES test_store_tcp_preauth.c ARGS ${case}
               TIMEOUT 60 LABELS store)
endforeach()
# The callback store: shared semantics through forwarding callbacks, and groups at world sizes
# 1-4 whose rendezvous runs only through callbacks (what the PyTorch backend relies on).
ddp_add_test(NAME test_store_callback SOURCES test_store_callback.c TIMEOUT 120 LABELS store)
