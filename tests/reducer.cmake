# Reducer tests: bucket assignment (no group), the Reducer over real rank processes (world sizes
# 1-4), its errors on every rank, and legacy mode against the Reducer.
ddp_add_test(NAME test_bucket_assignment SOURCES test_bucket_assignment.c TIMEOUT 60)

foreach(world 1 2 3 4)
  foreach(dtype f32 f64)
    ddp_add_test(NAME test_reducer_equivalence SOURCES test_reducer_equivalence.c
                 ARGS ${world} ${dtype} small TIMEOUT 90)
  endforeach()
endforeach()
ddp_add_test(NAME test_reducer_equivalence SOURCES test_reducer_equivalence.c
             ARGS 3 f32 default TIMEOUT 90)

foreach(case unused nosync rebuild sparse usergrads hook half dup_buffers large noinit empty
             layout)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_reducer_features SOURCES test_reducer_features.c
                 ARGS ${case} ${world} TIMEOUT 90)
  endforeach()
endforeach()

foreach(spec mismatch:2 mismatch:3 local_create:2 local_create:4 twice:1 twice:3 unmarked:1
             unmarked:2 unmarked:4 prepare_twice:2 hook_mismatch:2 hook_mismatch:3 args:1 args:3
             peer_exit:2 peer_exit:3 stale_text:1 stale_text:2 stale_text:3 late_finalize:2
             late_finalize:3)
  string(REPLACE ":" ";" parts ${spec})
  ddp_add_test(NAME test_reducer_errors SOURCES test_reducer_errors.c ARGS ${parts} TIMEOUT 90)
endforeach()

foreach(world 1 2 3 4)
  ddp_add_test(NAME test_legacy SOURCES test_legacy.c ARGS ${world} TIMEOUT 90)
endforeach()

# `ddp-bench -o reducer` runs end to end (small iteration counts; no timing is asserted), alone and
# under the launcher, and rejects a bad option with exit code 2.
if(TARGET ddp-bench)
  add_test(NAME bench_reducer_smoke
           COMMAND ddp-bench -o reducer --preset resnet50 -n 2 -w 0 --compute-us 10 --json)
  set_tests_properties(bench_reducer_smoke PROPERTIES TIMEOUT 120
                       PASS_REGULAR_EXPRESSION "\"exposed_over_comm\":")
  add_test(NAME bench_reducer_bad_option COMMAND ddp-bench -o reducer --preset nope)
  set_tests_properties(bench_reducer_bad_option PROPERTIES TIMEOUT 60 WILL_FAIL TRUE)
  if(TARGET ddprun)
    add_test(NAME bench_reducer_smoke_ddprun
             COMMAND ddprun -n 2 $<TARGET_FILE:ddp-bench> -o reducer --preset mlp -n 2 -w 0
                     --compute-ratio 1)
    set_tests_properties(bench_reducer_smoke_ddprun PROPERTIES TIMEOUT 120
                         PASS_REGULAR_EXPRESSION "# median: backward")
  endif()
endif()

# Row readiness and piece-wise launch: row-block marking is bitwise equal to whole-tensor marking.
# (11 s for equal at 3 ranks on the quiet 2-core machine, 65 s with a TSan suite beside it: the
# ranks get 240 s, the test 300.)
foreach(case equal errors unused nosync hook piece0 early)
  foreach(world 1 2 3 4)
    foreach(dtype f32 f64)
      ddp_add_test(NAME test_reducer_rows SOURCES test_reducer_rows.c
                   ARGS ${case} ${world} ${dtype} TIMEOUT 300)
    endforeach()
  endforeach()
endforeach()

# Gradient block modes: pointers computed once from the caller's block (or libddp's) stay valid
# through the rebuild; results equal a float64 reference and are bitwise equal across ranks.
set(block_libs "")
set(block_defs "")
if(TARGET ddp_powersgd_static)
  set(block_libs ddp_powersgd_static)
endif()
foreach(case user shm alloc rows)
  foreach(world 1 2 3 4)
    foreach(dtype f32 f64)
      ddp_add_test(NAME test_reducer_block SOURCES test_reducer_block.c
                   ARGS ${case} ${world} ${dtype} LIBS ${block_libs} TIMEOUT 90)
    endforeach()
  endforeach()
endforeach()
foreach(case late unused hook errors stale)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_reducer_block SOURCES test_reducer_block.c ARGS ${case} ${world}
                 LIBS ${block_libs} TIMEOUT 90)
  endforeach()
endforeach()
if(TARGET ddp_powersgd_static)
  target_compile_definitions(test_reducer_block PRIVATE TEST_WITH_POWERSGD)
endif()

# Uneven inputs (config.join, ddp_reducer_join): ranks with different iteration counts, against a
# float64 reference of the average over the ranks with data, in every gradient memory and hook
# combination the join supports; refusals.
foreach(case plain early unused block fp16 nosync)
  foreach(world 2 3 4)
    ddp_add_test(NAME test_reducer_join SOURCES test_reducer_join.c ARGS ${case} ${world}
                 TIMEOUT 90)
  endforeach()
endforeach()
foreach(world 1 2 3)
  ddp_add_test(NAME test_reducer_join SOURCES test_reducer_join.c ARGS refuse ${world} TIMEOUT 90)
endforeach()
foreach(world 2 3)
  ddp_add_test(NAME test_reducer_join SOURCES test_reducer_join.c ARGS error ${world} TIMEOUT 90)
endforeach()

# llm.c's layout: stacked (L, ...) tensors in one gradient block, reported by rows layer by layer
# from the top. After the rebuild their reductions start during backward (asserted by counting
# grad_ready calls, not by time), whatever the bucket limits or the order a layer's rows are
# marked in; results against a float64 reference, bitwise equal across ranks.
foreach(case scaled blockorder default)
  foreach(world 1 2 3)
    ddp_add_test(NAME test_reducer_stacked SOURCES test_reducer_stacked.c ARGS ${case} ${world}
                 TIMEOUT 90)
  endforeach()
endforeach()
