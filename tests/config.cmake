# The DDP_* variables: a bad value is an error at the call that reads it (group and store
# creation, ddprun), naming the variable and the value; valid values keep their meaning.
foreach(part group shm store)
  ddp_add_test(NAME test_config SOURCES test_config.c ARGS ${part} TIMEOUT 120)
endforeach()
if(TARGET ddprun)
  ddp_add_test(NAME test_config SOURCES test_config.c ARGS ddprun TIMEOUT 120)
  target_compile_definitions(test_config PRIVATE DDPRUN_PATH="$<TARGET_FILE:ddprun>")
  add_dependencies(test_config ddprun)
endif()
