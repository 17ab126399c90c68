# The MPI transport is a module: libddp.so and libddp.a carry no MPI, and a libddp.so without
# its module beside it answers transport "mpi" with DDP_ERR_UNSUPPORTED naming what to install.
# Runs whether or not MPI was found (the text is the same).
set(DDP_MODULE_TEST_FLAGS "")
if(DDP_SANITIZE)
  set(DDP_MODULE_TEST_FLAGS "-fsanitize=address,undefined -fno-omit-frame-pointer")
elseif(DDP_TSAN)
  set(DDP_MODULE_TEST_FLAGS "-fsanitize=thread -fno-omit-frame-pointer")
endif()
add_test(NAME test_module.mpi
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_module.sh ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR}
          ${CMAKE_C_COMPILER} ${CMAKE_INSTALL_FULL_LIBDIR} "${DDP_MODULE_TEST_FLAGS}")
set_tests_properties(test_module.mpi PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 LABELS mpi
                     ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
