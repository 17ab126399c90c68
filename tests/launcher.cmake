# The launcher: ddp_env_read (test_env) and ddprun end to end (test_launcher, which starts the real
# build/ddprun binary and uses itself as the worker program).
ddp_add_test(NAME test_env SOURCES test_env.c TIMEOUT 30)

# ddprun scenarios: only where ddprun itself is built (it needs the TCP store).
if(TARGET ddprun)
  foreach(scenario env multinode failure multinode-failure blame signals output tty options bind)
    ddp_add_test(NAME test_launcher SOURCES test_launcher.c ARGS ${scenario} TIMEOUT 90)
  endforeach()
  target_compile_definitions(test_launcher PRIVATE DDPRUN_PATH="$<TARGET_FILE:ddprun>")
  add_dependencies(test_launcher ddprun)
endif()

# ddprun's job options (--max-restarts, --nproc-per-node auto, --standalone, --log-dir,
# --version) with shell workers: tests/test_ddprun_jobs.sh.
if(TARGET ddprun)
  add_test(NAME test_ddprun_jobs
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_ddprun_jobs.sh $<TARGET_FILE:ddprun>)
  set_tests_properties(test_ddprun_jobs PROPERTIES TIMEOUT 90)
endif()

# ddp_group_create_from_env under srun's variables set by hand, one node: the store the first
# task hosts, shared memory, the secret file's rules (tests/netns/multihost.sh slurm: 2-3 hosts).
ddp_add_test(NAME test_slurm_env SOURCES test_slurm_env.c TIMEOUT 120)
