# Anchors for the benchmarks: build/memcpy-probe (single-core memcpy bandwidth, the memory-speed
# bound), build/switch-probe (see below) and, when MPI is found, build/mpi-baseline (the same
# sweeps as ddp-bench over plain MPI).
# bench/compare_collectives.sh runs them side by side with ddp-bench.
add_executable(memcpy-probe ${PROJECT_SOURCE_DIR}/bench/memcpy_probe.c)
target_link_libraries(memcpy-probe PRIVATE m)
# build/switch-probe: the cost of one CPU switching between two processes, the floor of a small
# collective when there are more ranks than cores; --across: a cache line's round trip between two
# cores, the floor when every rank has its own; --across --bytes N: N freshly written bytes handed
# from one core's cache to the other's, the floor of a copy through a stage.
add_executable(switch-probe ${PROJECT_SOURCE_DIR}/bench/switch_probe.c)
# build/cma-probe: the parts of a 2-rank single-copy allreduce (process_vm_readv, memcpy alone and
# on both cores at once) timed apart, to find what limits it (docs/shm-transport.md).
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  add_executable(cma-probe ${PROJECT_SOURCE_DIR}/bench/cma_probe.c)
  # "reduce streamed" times the library's own streamed reduction kernel.
  target_link_libraries(cma-probe PRIVATE ddp_internal m)
endif()
find_package(MPI COMPONENTS C QUIET)
if(MPI_C_FOUND)
  add_executable(mpi-baseline ${PROJECT_SOURCE_DIR}/bench/mpi_baseline.c)
  target_link_libraries(mpi-baseline PRIVATE MPI::MPI_C m)
else()
  message(STATUS "libddp: MPI not found, bench/mpi_baseline.c is not built")
endif()
# build/optim-kernels-bench: the optimizer kernels' ns per element against the scalar loop they
# replaced (tests/optim_reference.h), interleaved (run by hand; results in docs/sharding.md).
add_executable(optim-kernels-bench ${PROJECT_SOURCE_DIR}/bench/optim_kernels.c)
target_include_directories(optim-kernels-bench PRIVATE ${PROJECT_SOURCE_DIR}/tests)
target_link_libraries(optim-kernels-bench PRIVATE ddp_internal m)
# build/stacked-overlap: a trainer laid out like llm.c (stacked (L, ...) tensors in one gradient
# block, reported by rows layer by layer) and how much of its gradient averaging overlaps
# backward; bench/stacked_ab.sh runs it against a build of the old launch order (docs/benchmarks.md).
add_executable(stacked-overlap ${PROJECT_SOURCE_DIR}/bench/stacked_overlap.c)
target_link_libraries(stacked-overlap PRIVATE ddp m)
