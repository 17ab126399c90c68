# ddp-bench: nccl-tests-style benchmark of the process group's collectives (and, through
# bench_reducer.c, of the Reducer). Built as build/ddp-bench from every tools/ddp-bench/*.c.
# While the library is being written, it is built only once src/group/ defines every group call
# it uses, so that nobody's build breaks on a link error meanwhile.
set(DDP_BENCH_NEEDS create create_from_env destroy rank size transport allreduce broadcast
    reduce_scatter allgather barrier alloc_buffer free_buffer)
file(GLOB_RECURSE DDP_BENCH_GROUP_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/group/*.c)
set(DDP_BENCH_DEFINED "")
foreach(f ${DDP_BENCH_GROUP_SOURCES})
  file(STRINGS ${f} hits REGEX "^[A-Za-z_ *]*ddp_group_[a-z_]+\\(")
  list(APPEND DDP_BENCH_DEFINED ${hits})
endforeach()
set(DDP_BENCH_MISSING "")
foreach(fn ${DDP_BENCH_NEEDS})
  if(NOT DDP_BENCH_DEFINED MATCHES "[ *]ddp_group_${fn}\\(")
    list(APPEND DDP_BENCH_MISSING ddp_group_${fn})
  endif()
endforeach()
if(DDP_BENCH_MISSING)
  message(STATUS "ddp-bench: not built until src/group defines ${DDP_BENCH_MISSING}")
else()
  file(GLOB DDP_BENCH_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tools/ddp-bench/*.c)
  add_executable(ddp-bench ${DDP_BENCH_SOURCES})
  target_link_libraries(ddp-bench PRIVATE ddp_static ddp_internal m)
  # --hook powersgd:R needs libddp_powersgd (src/hooks/powersgd.cmake, built when CBLAS is found).
  if(TARGET ddp_powersgd_static)
    target_link_libraries(ddp-bench PRIVATE ddp_powersgd_static)
    target_compile_definitions(ddp-bench PRIVATE DDP_BENCH_HAVE_POWERSGD=1)
  endif()
endif()
