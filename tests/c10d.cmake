# PyTorch's conventions: the c10d TCPStore client against a real torch.distributed.TCPStore, and a
# plain torch script under ddprun (which must leave MASTER_ADDR/MASTER_PORT free for torch).
# Registered only where a python3 with torch exists (Debian: python3-torch): without one there
# is nothing real to test against, and a skipped test would pass without testing anything.
set(DDP_PYTHON_WITH_TORCH /usr/bin/python3 CACHE FILEPATH "a python3 that imports torch")
execute_process(COMMAND ${DDP_PYTHON_WITH_TORCH} -c "import torch.distributed"
                RESULT_VARIABLE ddp_torch_missing OUTPUT_QUIET ERROR_QUIET)
if(ddp_torch_missing EQUAL 0)
  foreach(case ops group recognise restart)
    ddp_add_test(NAME test_store_c10d SOURCES test_store_c10d.c ARGS ${case} TIMEOUT 120
                 LABELS store)
  endforeach()
  # The same against torch 2.x's TCPStore (another wire protocol: VALIDATE first, query types
  # moved by one), with its libuv server (the default) and its other one.
  foreach(build ${DDP_TORCH_BUILDS})
    string(REPLACE "|" ";" build "${build}")
    list(GET build 0 py)
    list(GET build 1 version)
    if(version VERSION_LESS 2.0)
      continue()
    endif()
    foreach(case ops group recognise restart)
      add_test(NAME test_store_c10d.${case}.torch${version} COMMAND test_store_c10d ${case})
      set_tests_properties(test_store_c10d.${case}.torch${version} PROPERTIES TIMEOUT 120
                           LABELS store ENVIRONMENT "C10D_PYTHON=${py}")
    endforeach()
    add_test(NAME test_store_c10d.ops.torch${version}.nolibuv COMMAND test_store_c10d ops)
    set_tests_properties(test_store_c10d.ops.torch${version}.nolibuv PROPERTIES TIMEOUT 120
                         LABELS store ENVIRONMENT "C10D_PYTHON=${py};C10D_USE_LIBUV=0")
  endforeach()
  target_compile_definitions(test_store_c10d PRIVATE
    PYTHON_WITH_TORCH="${DDP_PYTHON_WITH_TORCH}"
    C10D_HOST_SCRIPT="${CMAKE_CURRENT_SOURCE_DIR}/c10d_store_host.py")
  if(TARGET ddprun)
    # Two ranks of torch's gloo allreduce under ddprun; the script asserts the sum itself.
    add_test(NAME test_ddprun_torch
             COMMAND sh -c "out=$(\"$0\" -n 2 \"$1\" \"$2\" 2>&1) || { echo \"$out\"; exit 1; }; echo \"$out\"; [ $(echo \"$out\" | grep -c 'torch_allreduce: rank [01] of 2 sum 3') = 2 ]"
                     $<TARGET_FILE:ddprun> ${DDP_PYTHON_WITH_TORCH}
                     ${CMAKE_CURRENT_SOURCE_DIR}/torch_allreduce.py)
    set_tests_properties(test_ddprun_torch PROPERTIES TIMEOUT 120)
  endif()
else()
  message(STATUS "${DDP_PYTHON_WITH_TORCH} has no torch: c10d store and torch-under-ddprun tests not registered")
endif()
