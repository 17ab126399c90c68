# ddp-bench smoke test: runs the benchmark under ddprun with checking on (wrong = 0 on every size,
# a spoiled element is caught) and checks that bad options exit 2 naming the option. Needs both
# programs, so it exists only when the launcher and the benchmark are part of the build.
if(TARGET ddp-bench AND TARGET ddprun)
  # 13 s normally; 119 s under ASan and 118 s under TSan alone, over 180 s beside other work.
  set(ddp_bench_timeout 180)
  if(DDP_SANITIZE OR DDP_TSAN)
    set(ddp_bench_timeout 600)
  endif()
  ddp_add_test(NAME test_bench SOURCES test_bench.c TIMEOUT ${ddp_bench_timeout})
  target_compile_definitions(test_bench PRIVATE
    DDPRUN_PATH="$<TARGET_FILE:ddprun>" DDP_BENCH_PATH="$<TARGET_FILE:ddp-bench>")
  add_dependencies(test_bench ddprun ddp-bench)
endif()
# The benchmark anchors: switch-probe reports a positive per-switch time as JSON after both of
# its processes finished, and refuses a bad count with exit status 2.
if(TARGET switch-probe)
  add_test(NAME test_switch_probe
    COMMAND sh -c "out=$($<TARGET_FILE:switch-probe> -n 2000 --rounds 3 --json) || exit 1; \
echo \"$out\"; echo \"$out\" | grep -Eq '\"switch_us\":[0-9]*[1-9][0-9]*\\.|\"switch_us\":0\\.[0-9]*[1-9]' || exit 1; \
$<TARGET_FILE:switch-probe> -n x 2>/dev/null; test $? -eq 2")
  set_tests_properties(test_switch_probe PROPERTIES TIMEOUT 60)
endif()
# The comparison scripts' plots (bench/plot_*.sh, gnuplot) drawn from the committed results.
add_test(NAME test_bench_plots
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_bench_plots.sh ${PROJECT_SOURCE_DIR})
set_tests_properties(test_bench_plots PROPERTIES TIMEOUT 60 SKIP_RETURN_CODE 77)
