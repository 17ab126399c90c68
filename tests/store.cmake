# Rendezvous stores: one-process semantics and validation for every store, many processes (or
# threads) hammering each store at world sizes 1-4, and the TCP server under hostile clients.
ddp_add_test(NAME test_store_api SOURCES test_store_api.c TIMEOUT 60 LABELS store)
foreach(kind file tcp hash)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_store_multi SOURCES test_store_multi.c ARGS ${kind} ${world}
                 TIMEOUT 120 LABELS store)
  endforeach()
endforeach()

# The TCP frame codec's fuzz target (tests/fuzz/fuzz_store_frame.c). Under ctest with any compiler:
# the seed corpus replayed plus 200k deterministic mutations. With clang: a libFuzzer binary
# (instrumenting only the codec, which depends on nothing else), and a short run of it in ctest.
ddp_add_test(NAME test_store_fuzz_corpus SOURCES fuzz/fuzz_store_frame.c TIMEOUT 120 LABELS store)
target_compile_definitions(test_store_fuzz_corpus PRIVATE DDP_FUZZ_STANDALONE
  DDP_FUZZ_CORPUS_DIR="${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus")
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  add_executable(fuzz_store_frame fuzz/fuzz_store_frame.c ${PROJECT_SOURCE_DIR}/src/store/tcp_frame.c)
  target_include_directories(fuzz_store_frame PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(fuzz_store_frame PRIVATE -fsanitize=fuzzer,address,undefined -g -O1)
  target_link_options(fuzz_store_frame PRIVATE -fsanitize=fuzzer,address,undefined)
  set_target_properties(fuzz_store_frame PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/fuzz-store-corpus)
  add_test(NAME test_store_fuzz_libfuzzer
           COMMAND fuzz_store_frame -runs=100000 -max_len=8192
                   ${CMAKE_BINARY_DIR}/fuzz-store-corpus ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus)
  set_tests_properties(test_store_fuzz_libfuzzer PROPERTIES TIMEOUT 120 LABELS store)
endif()
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
