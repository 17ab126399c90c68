# ddp-bench: nccl-tests-style benchmark of the process group's collectives (and, through
# bench_reducer.c, of the Reducer). Built as build/ddp-bench from every tools/ddp-bench/*.c.
# It uses only the public API (include/ddp), so it links the static library and nothing else.
file(GLOB DDP_BENCH_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tools/ddp-bench/*.c)
add_executable(ddp-bench ${DDP_BENCH_SOURCES})
target_link_libraries(ddp-bench PRIVATE ddp_static m)
# --hook powersgd:R needs libddp_powersgd (src/hooks/powersgd.cmake, built when CBLAS is found).
if(TARGET ddp_powersgd_static)
  target_link_libraries(ddp-bench PRIVATE ddp_powersgd_static)
  target_compile_definitions(ddp-bench PRIVATE DDP_BENCH_HAVE_POWERSGD=1)
endif()
