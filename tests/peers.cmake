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
  endif()
endif()
