# The fuzz targets (tests/fuzz/, docs/fuzzing.md): one per input libddp reads from outside.
#   test_fuzz_<name> (ctest, any compiler): the target's LLVMFuzzerTestOneInput driven by
#     fuzz/fuzz_main.c over its seed corpus (fuzz/corpus/<name>/), every regression input
#     (fuzz/regressions/<name>/) and a fixed number of deterministic mutations of them.
#   fuzz_<name> (with -DDDP_FUZZ=ON and clang: `make fuzz`): the libFuzzer binary, everything
#     instrumented; tests/fuzz/run.sh runs each for a bounded time.
set(DDP_FUZZ_SRC ${CMAKE_CURRENT_SOURCE_DIR}/fuzz)
set(DDP_FUZZ_TARGETS "" CACHE INTERNAL "")
add_custom_target(ddp_fuzzers)

# ddp_fuzz_target(name MUTATIONS n [SOURCES extra.c ...] [LIBS ...] [INCLUDES ...])
function(ddp_fuzz_target NAME)
  cmake_parse_arguments(F "" "MUTATIONS" "SOURCES;LIBS;INCLUDES" ${ARGN})
  set(replay test_fuzz_${NAME})
  add_executable(${replay} ${DDP_FUZZ_SRC}/fuzz_${NAME}.c ${DDP_FUZZ_SRC}/fuzz_main.c ${F_SOURCES})
  target_link_libraries(${replay} PRIVATE ddp_test_harness ${F_LIBS})
  target_include_directories(${replay} PRIVATE ${DDP_FUZZ_SRC} ${F_INCLUDES})
  set_target_properties(${replay} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${replay} COMMAND ${replay} ${DDP_FUZZ_SRC}/corpus/${NAME}
                                  ${DDP_FUZZ_SRC}/regressions/${NAME} -mutations ${F_MUTATIONS})
  set_tests_properties(${replay} PROPERTIES TIMEOUT 300 LABELS fuzz)
  if(DDP_FUZZ)
    add_executable(fuzz_${NAME} ${DDP_FUZZ_SRC}/fuzz_${NAME}.c ${F_SOURCES})
    target_link_libraries(fuzz_${NAME} PRIVATE ddp_test_harness ${F_LIBS})
    target_include_directories(fuzz_${NAME} PRIVATE ${DDP_FUZZ_SRC} ${F_INCLUDES})
    target_link_options(fuzz_${NAME} PRIVATE -fsanitize=fuzzer)
    set_target_properties(fuzz_${NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/fuzz)
    add_dependencies(ddp_fuzzers fuzz_${NAME})
  endif()
  set(DDP_FUZZ_TARGETS ${DDP_FUZZ_TARGETS} ${NAME} CACHE INTERNAL "")
endfunction()

ddp_fuzz_target(store_frame MUTATIONS 200000)
ddp_fuzz_target(store_server MUTATIONS 3000)
ddp_fuzz_target(c10d_reply MUTATIONS 3000)
ddp_fuzz_target(tcp_hello MUTATIONS 100000)
ddp_fuzz_target(shm_desc MUTATIONS 100000)
ddp_fuzz_target(env MUTATIONS 5000)
ddp_fuzz_target(optim_state MUTATIONS 5000)
if(TARGET ddp_powersgd_static)
  ddp_fuzz_target(powersgd_state MUTATIONS 5000 LIBS ddp_powersgd_static)
endif()
if(TARGET fashion-mnist)
  set(FM_SRC ${PROJECT_SOURCE_DIR}/examples/fashion-mnist)
  ddp_fuzz_target(fm_checkpoint MUTATIONS 2000
    SOURCES ${FM_SRC}/checkpoint.c ${FM_SRC}/model.c ${FM_SRC}/optim.c ${FM_SRC}/data.c
    LIBS ZLIB::ZLIB ${FM_OPENBLAS_LIBRARY} m INCLUDES ${FM_SRC} ${FM_CBLAS_INCLUDE_DIR})
endif()
if(TARGET gpt_model)
  ddp_fuzz_target(gpt_checkpoint MUTATIONS 2000
    SOURCES ${PROJECT_SOURCE_DIR}/examples/gpt/checkpoint.c LIBS gpt_model)
endif()

# The seed generator (tests/fuzz/make_seeds.sh runs it): needs every part it records.
if(TARGET ddp_powersgd_static AND TARGET fashion-mnist AND TARGET gpt_model)
  add_executable(fuzz_make_seeds ${DDP_FUZZ_SRC}/make_seeds.c ${FM_SRC}/checkpoint.c
                 ${FM_SRC}/model.c ${FM_SRC}/optim.c ${FM_SRC}/data.c ${PROJECT_SOURCE_DIR}/examples/gpt/checkpoint.c)
  target_link_libraries(fuzz_make_seeds PRIVATE ddp_test_harness ddp_powersgd_static gpt_model
                        ZLIB::ZLIB ${FM_OPENBLAS_LIBRARY} m)
  target_include_directories(fuzz_make_seeds PRIVATE ${DDP_FUZZ_SRC} ${FM_SRC}
                             ${FM_CBLAS_INCLUDE_DIR})
  set_target_properties(fuzz_make_seeds PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
endif()
