# ddp-trace: `ddp-trace merge OUT IN...` joins the per-rank Chrome traces of a job into one file
# with a track per rank (Perfetto). Static, like ddprun: it needs only ddp_version().
add_executable(ddp-trace ${CMAKE_CURRENT_LIST_DIR}/ddp-trace.c)
target_link_libraries(ddp-trace PRIVATE ddp_static)
install(TARGETS ddp-trace RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
