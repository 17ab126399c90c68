# torch 2.x's torchrun starting libddp's users (tests/torchrun/torchrun.sh): a DDP script on
# backend "ddp" standalone and with --max-restarts, a libddp C program joining through torch's
# TCPStore, and two network-namespace hosts with c10d rendezvous (skipped without root). Once per
# torch >= 2 the backend was built for (Debian's torch 1.13 torchrun does not run here).
foreach(build ${DDP_TORCH_BUILDS})
  string(REPLACE "|" ";" build "${build}")
  list(GET build 0 py)
  list(GET build 1 version)
  if(version VERSION_LESS 2.0 OR NOT TARGET hello_ddp)
    continue()
  endif()
  foreach(case standalone restart cprogram 2hosts)
    add_test(NAME test_torchrun.${case}.torch${version}
             COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/torchrun/torchrun.sh ${py}
                     ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR} ${case})
    # ddp_python_test_env (tests/python.cmake): in a sanitized build the interpreters torchrun
    # starts must preload the sanitizer's runtime, as every Python test does; torchrun.sh hands
    # it to them alone, as DDP_TEST_PRELOAD (TSan's runtime crashes sh).
    string(REPLACE "LD_PRELOAD=" "DDP_TEST_PRELOAD=" torchrun_env "${ddp_python_test_env}")
    set_tests_properties(test_torchrun.${case}.torch${version} PROPERTIES TIMEOUT 400
                         LABELS python SKIP_RETURN_CODE 77
                         ENVIRONMENT "${torchrun_env}")
  endforeach()
endforeach()
