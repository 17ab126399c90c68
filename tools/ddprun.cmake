# ddprun, the launcher: build/ddprun, from the modules in tools/ddprun/ (ddprun.h lists them). It
# links the static library so it runs from the build tree without LD_LIBRARY_PATH; it hosts and
# joins the TCP store (ddp_store_server_start, ddp_store_tcp_connect), which every build of the
# library has.
file(GLOB DDPRUN_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/ddprun/*.c)
add_executable(ddprun ${DDPRUN_SOURCES})
target_link_libraries(ddprun PRIVATE ddp_static)
install(TARGETS ddprun RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
