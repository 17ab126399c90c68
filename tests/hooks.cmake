# Comm hook tests: fp16/bf16 through a real Reducer (world sizes 1-4, f32 and f64 gradients) and
# their argument checks; PowerSGD (when libddp_powersgd is built) through the Reducer and by
# direct hook calls. PowerSGD tests link the static family (ddp_powersgd_static -> ddp_static),
# like every test, so libddp is in the program once.
ddp_add_test(NAME test_hooks_half SOURCES test_hooks_half.c ARGS args TIMEOUT 60)
foreach(world 1 2 3 4)
  foreach(wire fp16 bf16)
    ddp_add_test(NAME test_hooks_half SOURCES test_hooks_half.c ARGS ${wire} f32 ${world}
                 TIMEOUT 120)
  endforeach()
endforeach()
ddp_add_test(NAME test_hooks_half SOURCES test_hooks_half.c ARGS fp16 f64 3 TIMEOUT 120)
ddp_add_test(NAME test_hooks_half SOURCES test_hooks_half.c ARGS bf16 f64 2 TIMEOUT 120)

if(TARGET ddp_powersgd_static)
  ddp_add_test(NAME test_hooks_powersgd SOURCES test_hooks_powersgd.c ARGS unit 1
               LIBS ddp_powersgd_static TIMEOUT 60)
  foreach(world 1 2 3 4)
    foreach(case exact_f32 exact_f64 feedback stats start_iter cold_start resume)
      ddp_add_test(NAME test_hooks_powersgd SOURCES test_hooks_powersgd.c ARGS ${case} ${world}
                   LIBS ddp_powersgd_static TIMEOUT 120)
    endforeach()
  endforeach()
endif()
