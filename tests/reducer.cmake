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

foreach(case unused nosync rebuild sparse usergrads hook half dup_buffers large noinit)
  foreach(world 1 2 3 4)
    ddp_add_test(NAME test_reducer_features SOURCES test_reducer_features.c
                 ARGS ${case} ${world} TIMEOUT 90)
  endforeach()
endforeach()

foreach(spec mismatch:2 mismatch:3 local_create:2 local_create:4 twice:1 twice:3 unmarked:1
             unmarked:2 unmarked:4 prepare_twice:2 hook_mismatch:2 hook_mismatch:3 args:1 args:3
             peer_exit:2 peer_exit:3)
  string(REPLACE ":" ";" parts ${spec})
  ddp_add_test(NAME test_reducer_errors SOURCES test_reducer_errors.c ARGS ${parts} TIMEOUT 90)
endforeach()

foreach(world 1 2 3 4)
  ddp_add_test(NAME test_legacy SOURCES test_legacy.c ARGS ${world} TIMEOUT 90)
endforeach()
