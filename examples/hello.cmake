# build/hello_ddp: the smallest complete training loop (README's example), linked like a user's
# program against the shared library.
add_executable(hello_ddp ${PROJECT_SOURCE_DIR}/examples/hello_ddp.c)
target_link_libraries(hello_ddp PRIVATE ddp)
