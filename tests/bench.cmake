# ddp-bench smoke test: runs the benchmark under ddprun with checking on (wrong = 0 on every size,
# a spoiled element is caught) and checks that bad options exit 2 naming the option. Needs both
# programs, so it exists only when the launcher and the benchmark are part of the build.
if(TARGET ddp-bench AND TARGET ddprun)
  ddp_add_test(NAME test_bench SOURCES test_bench.c TIMEOUT 180)
  target_compile_definitions(test_bench PRIVATE
    DDPRUN_PATH="$<TARGET_FILE:ddprun>" DDP_BENCH_PATH="$<TARGET_FILE:ddp-bench>")
  add_dependencies(test_bench ddprun ddp-bench)
endif()
