# The MPI transport (src/transport/mpi/), built when MPI is found, never into libddp itself:
#   ddp_mpi         libddp_mpi.so, a module (no soname) that libddp loads with dlopen when
#                   transport "mpi" is asked for; it links libddp.so and MPI, and resolves the
#                   core's internal functions (DDP_MODULE_API) from libddp.so, so there is one
#                   copy of the core's state (the last-error text the user reads)
#   ddp_mpi_static  libddp_mpi.a, for programs that link libddp.a: they call ddp_mpi_register()
#                   (include/ddp/mpi.h), since a static libddp never loads a module
# Never mix the two families in one program: libddp would be there twice, with two error slots.
set(DDP_HAVE_MPI OFF)
if(DDP_WITH_MPI)
  find_package(MPI COMPONENTS C QUIET)
  if(MPI_C_FOUND)
    file(GLOB DDP_MPI_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/transport/mpi/*.c)
    if(DDP_MPI_SOURCES)
      set(DDP_HAVE_MPI ON)
    endif()
  endif()
endif()

if(DDP_HAVE_MPI)
  add_library(ddp_mpi MODULE ${DDP_MPI_SOURCES})
  add_library(ddp_mpi_static STATIC ${DDP_MPI_SOURCES})
  set_target_properties(ddp_mpi_static PROPERTIES OUTPUT_NAME ddp_mpi)
  foreach(t ddp_mpi ddp_mpi_static)
    set_target_properties(${t} PROPERTIES POSITION_INDEPENDENT_CODE ON C_VISIBILITY_PRESET hidden)
    target_compile_definitions(${t} PRIVATE DDP_BUILDING_LIBRARY)
    target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  endforeach()
  # The module finds libddp.so.0 beside itself (build tree and install libdir alike); when
  # libddp loads it, that libddp is already loaded. --no-undefined: every core symbol it uses
  # must be exported by libddp.so (DDP_MODULE_API), or the build fails here, not at dlopen.
  target_link_libraries(ddp_mpi PRIVATE ddp MPI::MPI_C)
  set_target_properties(ddp_mpi PROPERTIES BUILD_RPATH "$ORIGIN" INSTALL_RPATH "$ORIGIN")
  if(NOT DDP_SANITIZE AND NOT DDP_TSAN)
    target_link_options(ddp_mpi PRIVATE -Wl,--no-undefined)
  endif()
  target_link_libraries(ddp_mpi_static PUBLIC ddp_static MPI::MPI_C)
  target_include_directories(ddp_mpi_static PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  add_library(ddp::ddp_mpi_static ALIAS ddp_mpi_static)

  install(TARGETS ddp_mpi LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(TARGETS ddp_mpi_static EXPORT ddpMpiTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT ddpMpiTargets NAMESPACE ddp:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ddp)

  # ddp-mpi.pc: for static programs (the shared libddp finds its module by itself).
  set(DDP_PC_MPI_LIBS "")
  foreach(lib ${MPI_C_LIBRARIES})
    string(APPEND DDP_PC_MPI_LIBS " ${lib}")
  endforeach()
  string(STRIP "${DDP_PC_MPI_LIBS}" DDP_PC_MPI_LIBS)
  set(DDP_PC_MPI_CFLAGS "")
  foreach(dir ${MPI_C_INCLUDE_DIRS})
    string(APPEND DDP_PC_MPI_CFLAGS " -I${dir}")
  endforeach()
  file(RELATIVE_PATH DDP_PC_TO_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
  ddp_pkg_config(ddp-mpi ${PROJECT_SOURCE_DIR}/cmake/ddp-mpi.pc.in)
endif()
message(STATUS "libddp: MPI transport module (libddp_mpi) ${DDP_HAVE_MPI}")
