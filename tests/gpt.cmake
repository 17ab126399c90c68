# The GPT trainer's tests: the model's gradients against finite differences and against PyTorch
# (tests/gpt_torch_check.py, skipped without torch), then the program under build/ddprun
# (tests/test_gpt.sh: 1-4 ranks agree step by step).
if(TARGET gpt_model)
  add_executable(test_gpt_grad test_gpt_grad.c)
  target_link_libraries(test_gpt_grad PRIVATE gpt_model)
  set_target_properties(test_gpt_grad PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME test_gpt.finite_differences COMMAND test_gpt_grad fd)
  set_tests_properties(test_gpt.finite_differences PROPERTIES TIMEOUT 60
    ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  find_program(GPT_TORCH_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
  if(GPT_TORCH_PYTHON)
    add_test(NAME test_gpt.torch
      COMMAND ${GPT_TORCH_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/gpt_torch_check.py
              $<TARGET_FILE:test_gpt_grad>)
    set_tests_properties(test_gpt.torch PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77
      ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
endif()

if(TARGET gpt AND TARGET ddprun)
  foreach(case worlds accumulate resume blocks errors bench progress zero3 zero3resume)
    # zero3 runs the trainer 14 times (5 s here; 90 s under TSan on the loaded 2-core machine)
    set(timeout 120)
    if(case STREQUAL "zero3")
      set(timeout 300)
    endif()
    add_test(NAME test_gpt.${case}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_gpt.sh ${case} $<TARGET_FILE:gpt>
              $<TARGET_FILE:ddprun>)
    set_tests_properties(test_gpt.${case} PROPERTIES TIMEOUT ${timeout} SKIP_RETURN_CODE 77
      ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endforeach()
  # bench/gpt_vs_pytorch.sh end to end on a tiny model: 6 runs, 4 of them PyTorch (spawned ranks).
  # Not in sanitized builds: it checks the script's plumbing, and the torch backend would load a
  # sanitized libddp into an interpreter without the sanitizer's runtime (tests/python.cmake
  # preloads it for the tests that are about the backend).
  if(NOT DDP_SANITIZE AND NOT DDP_TSAN)
    add_test(NAME test_gpt.compare
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_gpt.sh compare $<TARGET_FILE:gpt>
              $<TARGET_FILE:ddprun>)
    set_tests_properties(test_gpt.compare PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
      LABELS python ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
    # bench/zero3_vs_fsdp2.sh end to end on a tiny model (11 PyTorch runs, 2 of them at 4 ranks:
    # 4-8 minutes on the loaded 2-core machine, hence the timeout and the label "extra": make
    # test-extra, which .ci/run runs, not make test), once per interpreter whose torch (>= 2.4:
    # FSDP2) the backend is built for (python/python.cmake).
    foreach(build ${DDP_TORCH_BUILDS})
      string(REPLACE "|" ";" build "${build}")
      list(GET build 0 py)
      list(GET build 1 version)
      if(version VERSION_GREATER_EQUAL 2.4)
        add_test(NAME test_gpt.fsdp2.torch${version}
          COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_gpt.sh fsdp2 $<TARGET_FILE:gpt>
                  $<TARGET_FILE:ddprun>)
        set_tests_properties(test_gpt.fsdp2.torch${version} PROPERTIES TIMEOUT 1500
          SKIP_RETURN_CODE 77 LABELS "python;extra" ENVIRONMENT "OPENBLAS_NUM_THREADS=1;PY=${py}")
      endif()
    endforeach()
  endif()
endif()
