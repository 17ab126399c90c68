# ddp-bench: nccl-tests-style benchmark of the process group's collectives (and, through
# bench_reducer.c, of the Reducer). Built as build/ddp-bench from every tools/ddp-bench/*.c.
# It uses only the public API (include/ddp), so it links the shared library, which loads the MPI
# transport module (libddp_mpi.so) when DDP_TRANSPORT=mpi asks for it (bench/compare_mpi.sh).
file(GLOB DDP_BENCH_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tools/ddp-bench/*.c)
add_executable(ddp-bench ${DDP_BENCH_SOURCES})
target_link_libraries(ddp-bench PRIVATE ddp m)
# --hook powersgd:R needs libddp_powersgd (src/hooks/powersgd.cmake, built when CBLAS is found).
if(TARGET ddp_powersgd)
  target_link_libraries(ddp-bench PRIVATE ddp_powersgd)
  target_compile_definitions(ddp-bench PRIVATE DDP_BENCH_HAVE_POWERSGD=1)
endif()
install(TARGETS ddp-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
