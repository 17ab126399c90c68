# The Python package through pytest (python/tests): the NumPy API always when the interpreter
# has numpy and pytest, the torch backend when it was built (python/python.cmake). Each test
# file is one ctest test; `ctest -R test_python` runs them.
set(ddp_python_test_env
  "PYTHONPATH=${PROJECT_SOURCE_DIR}/python"
  "LIBDDP_BUILD_DIR=${PROJECT_BINARY_DIR}"
  "PYTHONDONTWRITEBYTECODE=1")
# A sanitized libddp inside an interpreter that is not: the sanitizer's runtime must be
# loaded first (ASan refuses otherwise), so the tests preload it; CPython's own allocations
# at exit are not libddp's leaks.
set(ddp_sanitizer_runtimes "")
if(DDP_SANITIZE)
  set(ddp_sanitizer_runtimes libasan.so libubsan.so)
  list(APPEND ddp_python_test_env "ASAN_OPTIONS=detect_leaks=0")
elseif(DDP_TSAN)
  set(ddp_sanitizer_runtimes libtsan.so)
  list(APPEND ddp_python_test_env
       "TSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tsan_torch.supp")
endif()
set(ddp_preload "")
foreach(rt ${ddp_sanitizer_runtimes})
  execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=${rt}
                  OUTPUT_VARIABLE rt_path OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${rt_path}" OR NOT EXISTS "${rt_path}")
    message(FATAL_ERROR "Python tests in a sanitized build: ${CMAKE_C_COMPILER} does not name "
                        "its ${rt} (-print-file-name gave '${rt_path}'); build with gcc")
  endif()
  string(APPEND ddp_preload " ${rt_path}")
endforeach()
if(ddp_preload)
  string(STRIP "${ddp_preload}" ddp_preload)
  list(APPEND ddp_python_test_env "LD_PRELOAD=${ddp_preload}")
endif()

if(DDP_PYTHON)
  execute_process(COMMAND ${DDP_PYTHON} -c "import numpy, pytest"
                  RESULT_VARIABLE ddp_python_test_rc OUTPUT_QUIET ERROR_QUIET)
  if(ddp_python_test_rc EQUAL 0)
    add_test(NAME test_python_numpy
             COMMAND ${DDP_PYTHON} -m pytest -q -p no:cacheprovider
                     ${PROJECT_SOURCE_DIR}/python/tests/test_numpy.py)
    set_tests_properties(test_python_numpy PROPERTIES TIMEOUT 300 LABELS python
                         ENVIRONMENT "${ddp_python_test_env}")
  else()
    message(STATUS "Python tests: not registered (${DDP_PYTHON} lacks numpy or pytest)")
  endif()
endif()

# The torch backend's tests, once per torch it was built for (python/python.cmake):
# test_python_torch_backend.torch<major.minor> under the interpreter that carries that torch.
foreach(build ${DDP_TORCH_BUILDS})
  string(REPLACE "|" ";" build "${build}")
  list(GET build 0 py)
  list(GET build 1 version)
  execute_process(COMMAND ${py} -c "import numpy, pytest"
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(STATUS "torch ${version} backend tests: not registered (${py} lacks numpy or pytest)")
    continue()
  endif()
  add_test(NAME test_python_torch_backend.torch${version}
           COMMAND ${py} -m pytest -q -p no:cacheprovider -p no:warnings
                   ${PROJECT_SOURCE_DIR}/python/tests/test_torch_backend.py)
  set_tests_properties(test_python_torch_backend.torch${version} PROPERTIES TIMEOUT 900
                       LABELS python ENVIRONMENT "${ddp_python_test_env}")
  # What PyTorch 2 users run on "ddp" (FSDP2, DTensor on a 2-D mesh, distributed checkpoint,
  # ZeRO overlapped with DDP, torch.compile), against gloo: torch 2 builds only (the file skips
  # itself below 2.6 too).
  if(version VERSION_GREATER_EQUAL 2)
    add_test(NAME test_python_torch2_users.torch${version}
             COMMAND ${py} -m pytest -q -p no:cacheprovider -p no:warnings
                     ${PROJECT_SOURCE_DIR}/python/tests/test_torch2_users.py)
    set_tests_properties(test_python_torch2_users.torch${version} PROPERTIES TIMEOUT 900
                         LABELS python ENVIRONMENT "${ddp_python_test_env}")
    # FSDP2 at 2 and 4 ranks in all four pairings of reshard_after_forward and precision (make
    # test runs two of them at each size).
    add_test(NAME test_python_torch2_users_fsdp_all.torch${version}
             COMMAND ${py} -m pytest -q -p no:cacheprovider -p no:warnings
                     ${PROJECT_SOURCE_DIR}/python/tests/test_torch2_users.py -k fsdp2_matches_gloo)
    set_tests_properties(test_python_torch2_users_fsdp_all.torch${version} PROPERTIES TIMEOUT 1200
                         LABELS "python;extra"
                         ENVIRONMENT "${ddp_python_test_env};LIBDDP_TEST_EXTRA=1")
    # Lightning (Trainer and Fabric) and DeepSpeed (ZeRO 1-3) against gloo: these need their
    # PyPI packages (tools/test_setup.sh), and skip (77) naming what to install without them.
    foreach(user "lightning|pytorch_lightning|pytorch-lightning==2.6.6"
                 "deepspeed|deepspeed|deepspeed==0.19.8")
      string(REPLACE "|" ";" user "${user}")
      list(GET user 0 name)
      list(GET user 1 module)
      list(GET user 2 requirement)
      add_test(NAME test_python_torch2_${name}.torch${version}
               COMMAND sh ${PROJECT_SOURCE_DIR}/python/tests/run_if_importable.sh ${py} ${module}
                       ${requirement} ${PROJECT_SOURCE_DIR}/python/tests/test_torch2_${name}.py)
      # Through sh: the sanitizer runtime goes as DDP_TEST_PRELOAD, which the script preloads
      # for the interpreter only. Label extra: 25 s each of make test's 15 minutes (ctest took
      # 859-929 s); .ci/run runs them through make test-extra.
      string(REPLACE "LD_PRELOAD=" "DDP_TEST_PRELOAD=" user_env "${ddp_python_test_env}")
      set_tests_properties(test_python_torch2_${name}.torch${version} PROPERTIES TIMEOUT 600
                           LABELS "python;extra" SKIP_RETURN_CODE 77
                           ENVIRONMENT "${user_env}")
    endforeach()
  endif()
  # pip install ./python into a fresh venv, then the installed copy runs (compiles the backend:
  # a few minutes on a loaded machine). Not in sanitized builds: it checks the packaging, which
  # a sanitizer does not look at, and the wheel it builds links the sanitized libddp.
  if(NOT DDP_SANITIZE AND NOT DDP_TSAN)
    add_test(NAME test_python_pip_install.torch${version}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/test_python_pip.sh ${py}
                     ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
    # It compiles the backend against torch's headers (minutes on 2 cores): `make test` runs it
    # for the torch of DDP_PYTHON, the others carry the label "extra", which make test leaves
    # to `make test-extra` (.ci/run runs both).
    if(py STREQUAL DDP_PYTHON)
      set(labels python)
    else()
      set(labels "python;extra")
    endif()
    set_tests_properties(test_python_pip_install.torch${version} PROPERTIES TIMEOUT 900
                         LABELS "${labels}")
  endif()
endforeach()

# PyTorch's own distributed suite (torch/testing/_internal/distributed/distributed_test.py)
# against backend "ddp", tests/torch_suite/. In `make test`: a fast selection (fast.txt, a few
# dozen representative tests) per torch build at world size 2. `make torch-suite`: the whole
# suite, every torch build, world sizes 2 and 3, gloo as the baseline (docs/pytorch.md).
set(ddp_torch_suite_builds "")
set(ddp_torch_suite_targets ddp)
foreach(build ${DDP_TORCH_BUILDS})
  list(APPEND ddp_torch_suite_builds --build "${build}")
  string(REPLACE "|" ";" build "${build}")
  list(GET build 0 py)
  list(GET build 1 version)
  string(REPLACE "." "_" tag "${version}")
  list(APPEND ddp_torch_suite_targets ddp_torch_${tag})
  execute_process(COMMAND ${py} -c "import expecttest"
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(STATUS "torch ${version} suite selection: not registered (${py} lacks expecttest, "
                   "which torch.testing needs)")
    continue()
  endif()
  add_test(NAME test_python_torch_suite.torch${version}
           COMMAND ${py} ${CMAKE_CURRENT_SOURCE_DIR}/torch_suite/run_suite.py --backend ddp
                   --world-size 2 --tests-from ${CMAKE_CURRENT_SOURCE_DIR}/torch_suite/fast.txt)
  set_tests_properties(test_python_torch_suite.torch${version} PROPERTIES TIMEOUT 600
                       LABELS python ENVIRONMENT "${ddp_python_test_env}")
endforeach()
if(DDP_TORCH_BUILDS)
  list(GET DDP_TORCH_BUILDS 0 first_torch_build)
  string(REPLACE "|" ";" first_torch_build "${first_torch_build}")
  list(GET first_torch_build 0 first_torch_python)
  add_custom_target(torch-suite
    COMMAND ${CMAKE_COMMAND} -E env ${ddp_python_test_env}
            ${first_torch_python} ${CMAKE_CURRENT_SOURCE_DIR}/torch_suite/run_all.py
            ${ddp_torch_suite_builds} --out ${PROJECT_BINARY_DIR}/torch-suite
    DEPENDS ${ddp_torch_suite_targets}
    USES_TERMINAL VERBATIM
    COMMENT "torch's distributed suite against ddp and gloo (about half an hour)")
endif()
