# build/gpt: the data-parallel GPT trainer (examples/gpt/). Needs a CBLAS (OpenBLAS:
# libopenblas-dev), found as for the Fashion-MNIST trainer; without it the target is skipped with
# a message. Its data (the `fortunes` package) is read at run time.
find_path(GPT_CBLAS_INCLUDE_DIR cblas.h
  PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas
        /usr/include/x86_64-linux-gnu /usr/include)
find_library(GPT_OPENBLAS_LIBRARY NAMES openblas)

if(NOT GPT_CBLAS_INCLUDE_DIR OR NOT GPT_OPENBLAS_LIBRARY)
  message(STATUS "gpt: SKIPPED, OpenBLAS/CBLAS not found (apt-get install libopenblas-dev)")
else()
  include(CheckFunctionExists)
  include(CMakePushCheckState)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_LIBRARIES ${GPT_OPENBLAS_LIBRARY})
  set(CMAKE_REQUIRED_QUIET ON)
  check_function_exists(openblas_set_num_threads GPT_OPENBLAS_SET_THREADS)
  check_function_exists(openblas_get_corename GPT_OPENBLAS_CORENAME)
  cmake_pop_check_state()

  # The model and data on their own, shared by the trainer and tests/test_gpt_grad.
  add_library(gpt_model STATIC ${PROJECT_SOURCE_DIR}/examples/gpt/model.c
                               ${PROJECT_SOURCE_DIR}/examples/gpt/data.c)
  target_include_directories(gpt_model PUBLIC ${PROJECT_SOURCE_DIR}/examples/gpt
                                       PRIVATE ${GPT_CBLAS_INCLUDE_DIR})
  target_link_libraries(gpt_model PUBLIC ${GPT_OPENBLAS_LIBRARY} m)
  # The GELU kernels clamp with comparisons; under the default -ftrapping-math GCC may not turn
  # those into vector selects (a compare could raise an FP flag the scalar code would not), and
  # the loops stay scalar. Nothing here reads FP exception flags, and the flag changes no result.
  if(CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(gpt_model PRIVATE -fno-trapping-math)
  endif()

  add_executable(gpt ${PROJECT_SOURCE_DIR}/examples/gpt/main.c
                     ${PROJECT_SOURCE_DIR}/examples/gpt/checkpoint.c
                     ${PROJECT_SOURCE_DIR}/examples/openblas_kernels.c)
  target_include_directories(gpt PRIVATE ${PROJECT_SOURCE_DIR}/examples)
  # The shared library, as a user's program would (see examples/fashion-mnist.cmake).
  target_link_libraries(gpt PRIVATE ddp gpt_model)
  if(GPT_OPENBLAS_SET_THREADS)
    target_compile_definitions(gpt PRIVATE GPT_HAVE_OPENBLAS_THREADS=1)
  endif()
  # As the Fashion-MNIST trainer: OpenBLAS's kernels for the CPU (examples/openblas_kernels.c).
  if(GPT_OPENBLAS_CORENAME)
    target_compile_definitions(gpt PRIVATE EXAMPLE_HAVE_OPENBLAS_CORENAME=1)
  endif()
  install(TARGETS gpt RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  message(STATUS "gpt: building with ${GPT_OPENBLAS_LIBRARY}")
endif()
