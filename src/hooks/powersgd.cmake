# libddp_powersgd: the PowerSGD communication hook (include/ddp/powersgd.h). Kept out of libddp
# because it needs CBLAS for its matrix products; built only when a CBLAS (OpenBLAS) is found.
#   ddp_powersgd        shared, links libddp (shared): for programs that link ddp
#   ddp_powersgd_static static, links ddp_static: for in-tree tests that link ddp_static
# Never mix the two families in one program: libddp would be there twice, with two error slots.
option(DDP_WITH_POWERSGD "Build libddp_powersgd (the PowerSGD hook) when a CBLAS is found" ON)
find_path(DDP_CBLAS_INCLUDE_DIR cblas.h
  PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas
        /usr/include/x86_64-linux-gnu /usr/include)
find_library(DDP_CBLAS_LIBRARY NAMES openblas cblas)

set(DDP_HAVE_POWERSGD OFF)
if(NOT DDP_WITH_POWERSGD)
  message(STATUS "libddp: PowerSGD hook SKIPPED (DDP_WITH_POWERSGD=OFF)")
elseif(NOT DDP_CBLAS_INCLUDE_DIR OR NOT DDP_CBLAS_LIBRARY)
  message(STATUS "libddp: PowerSGD hook SKIPPED, no CBLAS found (apt-get install libopenblas-dev)")
else()
  set(DDP_HAVE_POWERSGD ON)
  include(CheckFunctionExists)
  include(CMakePushCheckState)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_LIBRARIES ${DDP_CBLAS_LIBRARY})
  set(CMAKE_REQUIRED_QUIET ON)
  check_function_exists(openblas_set_num_threads DDP_POWERSGD_OPENBLAS_THREADS)
  cmake_pop_check_state()

  file(GLOB DDP_POWERSGD_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/hooks/powersgd/*.c)
  add_library(ddp_powersgd SHARED ${DDP_POWERSGD_SOURCES})
  add_library(ddp_powersgd_static STATIC ${DDP_POWERSGD_SOURCES})
  set_target_properties(ddp_powersgd_static PROPERTIES OUTPUT_NAME ddp_powersgd)
  set_target_properties(ddp_powersgd PROPERTIES VERSION ${PROJECT_VERSION}
                                                SOVERSION ${PROJECT_VERSION_MAJOR}
                                                INSTALL_RPATH "$ORIGIN")
  foreach(t ddp_powersgd ddp_powersgd_static)
    set_target_properties(${t} PROPERTIES POSITION_INDEPENDENT_CODE ON C_VISIBILITY_PRESET hidden)
    target_compile_definitions(${t} PRIVATE DDP_BUILDING_LIBRARY)
    if(DDP_POWERSGD_OPENBLAS_THREADS)
      target_compile_definitions(${t} PRIVATE DDP_POWERSGD_OPENBLAS_THREADS=1)
    endif()
    target_include_directories(${t} PRIVATE ${DDP_CBLAS_INCLUDE_DIR})
    target_link_libraries(${t} PRIVATE ${DDP_CBLAS_LIBRARY} m)
  endforeach()
  target_link_libraries(ddp_powersgd PUBLIC ddp)
  target_link_libraries(ddp_powersgd_static PUBLIC ddp_static)
  add_library(ddp::ddp_powersgd ALIAS ddp_powersgd)
  install(TARGETS ddp_powersgd ddp_powersgd_static EXPORT ddpTargets
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  # ddp_powersgd.pc beside ddp.pc: `pkg-config --cflags --libs ddp_powersgd` (it requires ddp).
  get_filename_component(DDP_PC_CBLAS_DIR ${DDP_CBLAS_LIBRARY} DIRECTORY)
  get_filename_component(DDP_PC_CBLAS_NAME ${DDP_CBLAS_LIBRARY} NAME_WE)
  string(REGEX REPLACE "^lib" "" DDP_PC_CBLAS_NAME ${DDP_PC_CBLAS_NAME})
  set(DDP_PC_POWERSGD_LIBS_PRIVATE "-L${DDP_PC_CBLAS_DIR} -l${DDP_PC_CBLAS_NAME} -lm")
  file(RELATIVE_PATH DDP_PC_TO_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
  ddp_pkg_config(ddp_powersgd ${PROJECT_SOURCE_DIR}/cmake/ddp_powersgd.pc.in)
  message(STATUS "libddp: PowerSGD hook (libddp_powersgd) with ${DDP_CBLAS_LIBRARY}")
endif()
