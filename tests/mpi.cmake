# MPI transport tests: programs started by mpirun with 1-4 processes (registered only when the
# MPI transport is built). They link libddp_mpi.a beside libddp.a and register it before main
# (mpi_register.c), as a static user does; test_mpi_trainer runs the shared libddp, which loads
# libddp_mpi.so. OMPI_* variables let OpenMPI run as root in a container, on shared
# memory only, and oversubscribe the 2 cores.
if(DDP_HAVE_MPI)
  set(DDP_MPIRUN ${MPIEXEC_EXECUTABLE})
  if(NOT DDP_MPIRUN)
    find_program(DDP_MPIRUN NAMES mpirun mpiexec)
  endif()
  set(DDP_MPI_TEST_ENV
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
    OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_plm=isolated)
  if(DDP_SANITIZE)
    # Open MPI itself leaks at MPI_Finalize (every frame of the reports is inside libmpi/PMIx),
    # which LeakSanitizer turns into a failed test; the sanitizers' other checks stay on.
    list(APPEND DDP_MPI_TEST_ENV ASAN_OPTIONS=detect_leaks=0)
  elseif(DDP_TSAN)
    # Reports from inside Open MPI's own (uninstrumented) libraries: tests/tsan_openmpi.supp.
    # The largest history, so that the earlier access's stack (the one inside Open MPI) can be
    # restored: a report whose previous stack is lost matches no suppression (seen once in
    # test_mpi_isolation.interleave_allreduceexchange.np3, 28 Nov 2026).
    list(APPEND DDP_MPI_TEST_ENV
         "TSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tsan_openmpi.supp:history_size=7")
  endif()

  # ddp_add_mpi_test(NAME name SOURCES a.c ... NP n ... [TIMEOUT s] [ENV k=v ...] [ARGS ...])
  # registers name[.args].np<n> for every n, each started as `mpirun -np n program ARGS`.
  function(ddp_add_mpi_test)
    cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;NP;ENV;ARGS" ${ARGN})
    if(NOT TARGET ${T_NAME})
      add_executable(${T_NAME} ${T_SOURCES} mpi_register.c)
      target_link_libraries(${T_NAME} PRIVATE ddp_test_harness ddp_mpi_static MPI::MPI_C)
      set_target_properties(${T_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
    endif()
    if(NOT T_TIMEOUT)
      set(T_TIMEOUT 120)
    endif()
    set(suffix "")
    if(T_ARGS)
      string(REPLACE ";" "_" suffix "${T_ARGS}")
      string(REGEX REPLACE "[^A-Za-z0-9_=.]" "" suffix "${suffix}")
      set(suffix ".${suffix}")
    endif()
    foreach(np ${T_NP})
      set(test_name ${T_NAME}${suffix}.np${np})
      add_test(NAME ${test_name}
               COMMAND ${DDP_MPIRUN} --oversubscribe -np ${np} $<TARGET_FILE:${T_NAME}> ${T_ARGS})
      set_tests_properties(${test_name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS mpi
                           ENVIRONMENT "${DDP_MPI_TEST_ENV};${T_ENV}")
    endforeach()
  endfunction()

  # Every op x dtype x size with 1-3 ranks; with 4 ranks on 2 cores the 1 MiB+3 size is left out
  # (oversubscribed MPI polling makes it slow; 3 ranks cover the odd, non-power-of-two case).
  ddp_add_mpi_test(NAME test_mpi_transport SOURCES test_mpi_transport.c NP 1 2 3 TIMEOUT 300)
  ddp_add_mpi_test(NAME test_mpi_transport SOURCES test_mpi_transport.c NP 4 TIMEOUT 300
                   ARGS --no-large)
  # Groups above 8 ranks exchange fingerprints with one MPI_Iallreduce instead of point to
  # point: the same checks with that exchange forced.
  ddp_add_mpi_test(NAME test_mpi_transport SOURCES test_mpi_transport.c NP 2 3 TIMEOUT 300
                   ARGS --no-large --allreduce-exchange)
  # The group API over MPI in an application that initialised MPI itself.
  ddp_add_mpi_test(NAME test_mpi_group SOURCES test_mpi_group.c NP 1 2 3 4 TIMEOUT 120)
  ddp_add_mpi_test(NAME test_mpi_group SOURCES test_mpi_group.c NP 2 TIMEOUT 60 ARGS --funneled)
  ddp_add_mpi_test(NAME test_mpi_group SOURCES test_mpi_group.c NP 3 TIMEOUT 120 ARGS --serialized)
  # The collectives built from the five (src/group/collectives.c) and send/recv over MPI:
  # test_group_coll's rank bodies under mpirun (pairs for send/recv are MPI communicators of two).
  ddp_add_mpi_test(NAME test_mpi_coll SOURCES test_mpi_coll.c NP 1 2 3 4 TIMEOUT 300 ARGS data)
  ddp_add_mpi_test(NAME test_mpi_coll SOURCES test_mpi_coll.c NP 2 3 4 TIMEOUT 300 ARGS p2p)
  ddp_add_mpi_test(NAME test_mpi_coll SOURCES test_mpi_coll.c NP 2 3 4 TIMEOUT 120 ARGS any)
  # Every error case in one run: each case's groups follow the previous case's failed ones.
  ddp_add_mpi_test(NAME test_mpi_coll SOURCES test_mpi_coll.c NP 2 3 4 TIMEOUT 120 ARGS errors)
  # The Reducer's equivalence with one process, over the MPI transport (BATCH 24: 1-4 ranks).
  ddp_add_mpi_test(NAME test_mpi_reducer SOURCES test_mpi_reducer.c NP 1 2 3 4 TIMEOUT 120)

  # ddp_group_create_from_env under mpirun with neither ddprun nor MASTER_ADDR: a store-less
  # group over MPI (and its splits); without mpirun and MASTER_ADDR the text names MASTER_ADDR.
  ddp_add_mpi_test(NAME test_mpi_env SOURCES test_mpi_env.c NP 1 2 3 TIMEOUT 120)
  ddp_add_test(NAME test_mpi_env SOURCES test_mpi_env.c mpi_register.c LIBS ddp_mpi_static ARGS --no-launcher TIMEOUT 60 LABELS mpi)

  # Unchanged programs under plain mpirun (shared libddp, which loads libddp_mpi.so for the
  # rendezvous only): hello_ddp and ddp-bench must get shared memory, and say so.
  if(TARGET hello_ddp)
    foreach(np 2 3)
      add_test(NAME test_mpi_launch.hello.np${np}
               COMMAND sh -c "out=$(\"$0\" --oversubscribe -np ${np} \"$1\" 2>&1) || { echo \"$out\"; exit 1; }; echo \"$out\"; echo \"$out\" | grep -q '^hello_ddp: transport shm$' && echo \"$out\" | grep -q '^hello_ddp: ${np} ranks, w ='"
                       ${DDP_MPIRUN} $<TARGET_FILE:hello_ddp>)
      set_tests_properties(test_mpi_launch.hello.np${np} PROPERTIES TIMEOUT 120 LABELS mpi
                           ENVIRONMENT "${DDP_MPI_TEST_ENV}")
    endforeach()
  endif()
  if(TARGET ddp-bench)
    add_test(NAME test_mpi_launch.bench.np2
             COMMAND sh -c "out=$(\"$0\" --oversubscribe -np 2 \"$1\" -b 8 -e 64K -f 32 -c 1 2>&1) || { echo \"$out\"; exit 1; }; echo \"$out\"; echo \"$out\" | grep -q '2 ranks, transport shm' && echo \"$out\" | grep -q 'Wrong elements *: 0'"
                     ${DDP_MPIRUN} $<TARGET_FILE:ddp-bench>)
    set_tests_properties(test_mpi_launch.bench.np2 PROPERTIES TIMEOUT 120 LABELS mpi
                         ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endif()

  # The same across 2 network-namespace hosts (root only; SKIP otherwise): hierarchical.
  if(TARGET hello_ddp)
    add_test(NAME test_mpi_launch.netns.2hosts
             COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/netns/mpirun.sh ${DDP_MPIRUN}
                     $<TARGET_FILE:hello_ddp> 2)
    set_tests_properties(test_mpi_launch.netns.2hosts PROPERTIES TIMEOUT 180 LABELS mpi
                         SKIP_RETURN_CODE 77 RUN_SERIAL TRUE ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endif()

  # Processes not started by mpirun (the harness forks them): singleton MPI must be refused.
  ddp_add_test(NAME test_mpi_singleton SOURCES test_mpi_singleton.c mpi_register.c
               LIBS ddp_mpi_static MPI::MPI_C TIMEOUT 60
               LABELS mpi)

  # The trainer under mpirun over the MPI transport must end bit for bit where the same run
  # under ddprun over shared memory ends (2 ranks: a sum of two is the same bytes in any order;
  # small buckets so that several allreduces, inline and not, run per step). The store comes
  # from ddprun -n 1, which runs mpirun with its own RANK/WORLD_SIZE removed.
  if(TARGET fashion-mnist AND TARGET ddprun)
    set(script ${CMAKE_CURRENT_BINARY_DIR}/test_mpi_trainer.sh)
    file(WRITE ${script} [=[
#!/bin/sh
# usage: test_mpi_trainer.sh DDPRUN MPIRUN FASHION_MNIST
set -u
ddprun=$1 mpirun=$2 fm=$3
args="--max-steps 12 --hidden 256 --subset 4096 --bucket-mb 0.25 --print-checksum --no-eval"
shm_out=$("$ddprun" -n 2 --no-prefix env OPENBLAS_NUM_THREADS=1 DDP_TRANSPORT=shm "$fm" $args 2>&1)
mpi_out=$("$ddprun" -n 1 --no-prefix sh -c 'unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK; exec "$@"' sh \
      env OPENBLAS_NUM_THREADS=1 DDP_TRANSPORT=mpi "$mpirun" --oversubscribe -np 2 "$fm" $args 2>&1)
# Plain mpirun, no store and no transport named: the trainer must get shared memory (its rank
# 0's store address carried by MPI) and end exactly where the ddprun run ends.
def_out=$(env OPENBLAS_NUM_THREADS=1 "$mpirun" --oversubscribe -np 2 "$fm" $args 2>&1)
echo "$def_out" | grep -q '2 ranks (shm)' || { echo "$def_out"; echo "the plain mpirun run is not 2 ranks over shm"; exit 1; }
echo "$shm_out" | grep -q '2 ranks (shm)' || { echo "$shm_out"; echo "the first run is not 2 ranks over shm"; exit 1; }
echo "$mpi_out" | grep -q '2 ranks (mpi)' || { echo "$mpi_out"; echo "the second run is not 2 ranks over mpi"; exit 1; }
# The progress bar ends its lines with \r, so a checksum line may follow one on the same line.
shm=$(echo "$shm_out" | grep -o 'checksum rank=0 .*')
mpi=$(echo "$mpi_out" | grep -o 'checksum rank=[0-9]* .*')
[ "$(echo "$mpi" | wc -l)" = 2 ] || { echo "$mpi_out"; echo "the mpi run did not print 2 checksums"; exit 1; }
echo "shm: $shm"
echo "mpi: $mpi"
[ -n "$shm" ] || { echo "the shm run gave no checksum"; exit 1; }
[ "$(echo "$mpi" | sort -u | sed 's/rank=[0-9]*/rank=R/' | sort -u | wc -l)" = 1 ] || { echo "mpi ranks differ"; exit 1; }
[ "$(echo "$mpi" | grep 'rank=0')" = "$shm" ] || { echo "mpi and shm runs differ"; exit 1; }
def=$(echo "$def_out" | grep -o 'checksum rank=0 .*')
echo "mpirun default: $def"
[ "$def" = "$shm" ] || { echo "the plain mpirun run differs from the ddprun run"; exit 1; }
echo "identical"
]=])
    add_test(NAME test_mpi_trainer.np2
             COMMAND sh ${script} $<TARGET_FILE:ddprun> ${DDP_MPIRUN} $<TARGET_FILE:fashion-mnist>)
    set_tests_properties(test_mpi_trainer.np2 PROPERTIES TIMEOUT 180 LABELS mpi
                         ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endif()

  # A measurement, not a test (bench/compare_mpi.sh runs it): the transport's cost over a bare
  # MPI_Iallreduce, and the fingerprint exchange's share of it.
  add_executable(test_mpi_fingerprint_cost test_mpi_fingerprint_cost.c mpi_register.c)
  target_link_libraries(test_mpi_fingerprint_cost PRIVATE ddp_test_harness ddp_mpi_static
                                                          MPI::MPI_C)
  set_target_properties(test_mpi_fingerprint_cost PROPERTIES
                        RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
endif()

if(DDP_HAVE_MPI)
  # Every rank agrees on every outcome over MPI: a late rank, and a rank stopped at random.
  ddp_add_mpi_test(NAME test_mpi_agreement SOURCES test_mpi_agreement.c NP 2 3 ARGS late
                   TIMEOUT 120)
  ddp_add_mpi_test(NAME test_mpi_agreement SOURCES test_mpi_agreement.c NP 2 3 ARGS stop
                   TIMEOUT 120)
  # Groups over the same processes never take each other's messages: a group made after a
  # failed one (late rank, mismatch), and a parent with two splits in flight together.
  ddp_add_mpi_test(NAME test_mpi_isolation SOURCES test_mpi_isolation.c NP 2 3 4 ARGS stale
                   TIMEOUT 180)
  ddp_add_mpi_test(NAME test_mpi_isolation SOURCES test_mpi_isolation.c NP 2 3 4 ARGS interleave
                   TIMEOUT 180)
  ddp_add_mpi_test(NAME test_mpi_isolation SOURCES test_mpi_isolation.c NP 3 TIMEOUT 180
                   ARGS stale --allreduce-exchange)
  ddp_add_mpi_test(NAME test_mpi_isolation SOURCES test_mpi_isolation.c NP 3 TIMEOUT 180
                   ARGS interleave --allreduce-exchange)
endif()
