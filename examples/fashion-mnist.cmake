# build/fashion-mnist: the data-parallel Fashion-MNIST trainer. Needs zlib (the dataset is
# gzipped) and a CBLAS (OpenBLAS: libopenblas-dev). Without them the target is skipped with a
# message instead of failing the whole build.
find_package(ZLIB QUIET)
find_path(FM_CBLAS_INCLUDE_DIR cblas.h
  PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas
        /usr/include/x86_64-linux-gnu /usr/include)
find_library(FM_OPENBLAS_LIBRARY NAMES openblas)

if(NOT ZLIB_FOUND)
  message(STATUS "fashion-mnist: SKIPPED, zlib not found (apt-get install zlib1g-dev)")
elseif(NOT FM_CBLAS_INCLUDE_DIR OR NOT FM_OPENBLAS_LIBRARY)
  message(STATUS "fashion-mnist: SKIPPED, OpenBLAS/CBLAS not found (apt-get install libopenblas-dev)")
else()
  include(CheckFunctionExists)
  include(CMakePushCheckState)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_LIBRARIES ${FM_OPENBLAS_LIBRARY})
  set(CMAKE_REQUIRED_QUIET ON)
  check_function_exists(openblas_set_num_threads FM_OPENBLAS_SET_THREADS)
  check_function_exists(openblas_get_corename FM_OPENBLAS_CORENAME)
  cmake_pop_check_state()

  add_executable(fashion-mnist
    ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/main.c
    ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/data.c
    ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/model.c
    ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/optim.c
    ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/checkpoint.c
    ${PROJECT_SOURCE_DIR}/examples/openblas_kernels.c)
  target_include_directories(fashion-mnist PRIVATE ${FM_CBLAS_INCLUDE_DIR}
                                                   ${PROJECT_SOURCE_DIR}/examples)
  # The shared library, as a user's program would: it holds every store and transport, whereas a
  # static link drops the ones libddp references only weakly (TCP store, TCP/MPI transports).
  target_link_libraries(fashion-mnist PRIVATE ddp ZLIB::ZLIB ${FM_OPENBLAS_LIBRARY} m)
  if(FM_OPENBLAS_SET_THREADS)
    target_compile_definitions(fashion-mnist PRIVATE FM_HAVE_OPENBLAS_THREADS=1)
  endif()
  # Restart with OpenBLAS's own kernels for the CPU when it fell back to SSE3 ones
  # (examples/openblas_kernels.c).
  if(FM_OPENBLAS_CORENAME)
    target_compile_definitions(fashion-mnist PRIVATE EXAMPLE_HAVE_OPENBLAS_CORENAME=1)
  endif()
  # --hook powersgd needs libddp_powersgd (src/hooks/powersgd.cmake, built when CBLAS is found).
  if(TARGET ddp_powersgd)
    target_link_libraries(fashion-mnist PRIVATE ddp_powersgd)
    target_compile_definitions(fashion-mnist PRIVATE FM_HAVE_POWERSGD=1)
  endif()
  # build/optim-bandwidth (bench/optim_bandwidth.c): the trainer's optimizer step (its own float
  # Adam, libddp's, a pure stream of the same bytes) on one process and on every CPU at once, the
  # memory bus's bound on the step every rank repeats (bench/demo_scaling.sh; docs/benchmarks.md).
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    add_executable(optim-bandwidth ${PROJECT_SOURCE_DIR}/bench/optim_bandwidth.c
      ${PROJECT_SOURCE_DIR}/examples/fashion-mnist/optim.c)
    target_include_directories(optim-bandwidth PRIVATE ${PROJECT_SOURCE_DIR}/examples/fashion-mnist)
    target_link_libraries(optim-bandwidth PRIVATE ddp m Threads::Threads)
  endif()
  # Installed beside ddprun: it is the demo a user runs (`ddprun -n 2 fashion-mnist`).
  install(TARGETS fashion-mnist RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  message(STATUS "fashion-mnist: building with ${FM_OPENBLAS_LIBRARY}")
endif()
