# bench/peers.sh's decisions (bench/test_peers.sh): mpi-baseline's results for the five collectives
# in f32 and bf16 on 2 and 3 ranks, its --test-corrupt check, and peers_summary.py's choice of the
# best peer (never a wrong result). Needs Open MPI's mpirun and python3.
if(TARGET mpi-baseline AND MPIEXEC_EXECUTABLE)
  find_program(DDP_PYTHON3 python3)
  if(DDP_PYTHON3)
    add_test(NAME test_peers
      COMMAND sh ${PROJECT_SOURCE_DIR}/bench/test_peers.sh ${PROJECT_SOURCE_DIR}
              $<TARGET_FILE:mpi-baseline> ${MPIEXEC_EXECUTABLE})
    set_tests_properties(test_peers PROPERTIES TIMEOUT 300)
    # mpi-baseline is built with the sanitizers like everything else, and Open MPI's own leaks at
    # MPI_Finalize and races inside it are not libddp's (as for tests/mpi.cmake's tests).
    if(DDP_SANITIZE)
      set_tests_properties(test_peers PROPERTIES ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
    elseif(DDP_TSAN)
      set_tests_properties(test_peers PROPERTIES ENVIRONMENT
        "TSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tsan_openmpi.supp")
    endif()
  endif()
endif()
