# The house rule of docs/architecture.md: every include and call goes down a layer
# (tools/check_layers.sh). The script runs on the real tree, and on copies of src/ with one
# violation planted each, to show that each of its checks fires.
add_test(NAME test_layers COMMAND sh ${PROJECT_SOURCE_DIR}/tools/check_layers.sh)
set_tests_properties(test_layers PROPERTIES PASS_REGULAR_EXPRESSION "OK: every include and call goes down")

# ddp_layers_violation(NAME FILE LINE EXPECTED): appends LINE to src/FILE in a copy of the
# tree (tests/layers_planted.sh); the check must print EXPECTED.
function(ddp_layers_violation name file line expected)
  add_test(NAME test_layers.${name}
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/layers_planted.sh ${PROJECT_SOURCE_DIR} ${file} "${line}")
  set_tests_properties(test_layers.${name} PROPERTIES PASS_REGULAR_EXPRESSION "${expected}")
endfunction()

ddp_layers_violation(core_includes_group core/socket.c "#include \"group/group_internal.h\""
  "FAIL: an include goes up a layer")
ddp_layers_violation(store_includes_transport store/tcp_client.c
  "#include \"transport/transport.h\"" "FAIL: an include goes up a layer")
ddp_layers_violation(transport_includes_sibling transport/shm/shm.c "#include \"transport/tcp/tcp.h\""
  "FAIL: a transport includes another transport's header")
ddp_layers_violation(transport_calls_group transport/tcp/tcp_socket.c
  "static int f(void *g) { return ddp_group_size(g) }" "FAIL: transports call the group layer")
ddp_layers_violation(core_declares_upper core/reduce.h "void ddp__tcp_listen(void)"
  "FAIL: core declares functions of layers above")
ddp_layers_violation(transport_names_sibling transport/tcp/tcp_ring.c
  "static const void *planted = &ddp__transport_shm;" "FAIL: a transport names another transport")
ddp_layers_violation(call_circle core/dtype.c
  "void ddp__planted_up(void) { ddp__reducer_rebuild(0); }"
  "FAIL: two files in src/ call each other")
ddp_layers_violation(include_circle core/internal.h "#include \"core/reduce.h\""
  "FAIL: two headers in src/ include each other")
ddp_layers_violation(transport_reads_env transport/mpi/mpi_create.c
  "static const char *planted(void) { return getenv(\"DDP_TIMEOUT\"); }"
  "FAIL: configuration read below the group")

# The length rules of docs/architecture.md (tools/check_lengths.py): no file in src/ or tools/
# over 800 lines, no function over 120 lines without a "long because" comment at its top. The
# check runs on the real tree, and on copies with a violation planted (tests/lengths_planted.sh).
find_program(DDP_LENGTHS_PYTHON NAMES python3)
if(DDP_LENGTHS_PYTHON)
  add_test(NAME test_lengths COMMAND ${DDP_LENGTHS_PYTHON} ${PROJECT_SOURCE_DIR}/tools/check_lengths.py
    ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_lengths PROPERTIES PASS_REGULAR_EXPRESSION
    "OK: no file over 800 lines and no function over 120 lines without a reason")
  foreach(planted long_file long_function long_reason)
    add_test(NAME test_lengths.${planted}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/lengths_planted.sh ${PROJECT_SOURCE_DIR} ${planted})
  endforeach()
  set_tests_properties(test_lengths.long_file PROPERTIES PASS_REGULAR_EXPRESSION
    "FAIL: src/core/status.c has [0-9]+ lines \\(more than 800\\)")
  set_tests_properties(test_lengths.long_function PROPERTIES PASS_REGULAR_EXPRESSION
    "FAIL: src/core/status.c:[0-9]+ ddp__planted_long has 125 lines")
  set_tests_properties(test_lengths.long_reason PROPERTIES PASS_REGULAR_EXPRESSION
    "ddp__planted_long: 125 lines \\(says why it is long\\)")
endif()
