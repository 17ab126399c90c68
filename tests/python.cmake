# The Python package through pytest (python/tests): the NumPy API always when the interpreter
# has numpy and pytest, the torch backend when it was built (python/python.cmake). Each test
# file is one ctest test; `ctest -R test_python` runs them.
if(DDP_PYTHON)
  execute_process(COMMAND ${DDP_PYTHON} -c "import numpy, pytest"
                  RESULT_VARIABLE ddp_python_test_rc OUTPUT_QUIET ERROR_QUIET)
  if(ddp_python_test_rc EQUAL 0)
    set(ddp_python_test_env
      "PYTHONPATH=${PROJECT_SOURCE_DIR}/python"
      "LIBDDP_BUILD_DIR=${PROJECT_BINARY_DIR}"
      "PYTHONDONTWRITEBYTECODE=1")
    add_test(NAME test_python_numpy
             COMMAND ${DDP_PYTHON} -m pytest -q -p no:cacheprovider
                     ${PROJECT_SOURCE_DIR}/python/tests/test_numpy.py)
    set_tests_properties(test_python_numpy PROPERTIES TIMEOUT 300 LABELS python
                         ENVIRONMENT "${ddp_python_test_env}")
    if(TARGET ddp_torch)
      add_test(NAME test_python_torch_backend
               COMMAND ${DDP_PYTHON} -m pytest -q -p no:cacheprovider -p no:warnings
                       ${PROJECT_SOURCE_DIR}/python/tests/test_torch_backend.py)
      set_tests_properties(test_python_torch_backend PROPERTIES TIMEOUT 900 LABELS python
                           ENVIRONMENT "${ddp_python_test_env}")
    endif()
  else()
    message(STATUS "Python tests: not registered (${DDP_PYTHON} lacks numpy or pytest)")
  endif()
endif()

# pip install ./python into a fresh venv, then the installed copy runs (compiles the backend:
# a few minutes on a loaded machine).
if(TARGET ddp_torch)
  add_test(NAME test_python_pip_install
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/test_python_pip.sh ${DDP_PYTHON}
                   ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  set_tests_properties(test_python_pip_install PROPERTIES TIMEOUT 900 LABELS python)
endif()
