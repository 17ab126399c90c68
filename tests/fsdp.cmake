# FSDP (ZeRO-3, include/ddp/fsdp.h): a sharded MLP trained with gather/prefetch/release per unit
# against the unsharded optimizer at worlds 1-4 (SGD, Adam + amsgrad + clipping, AdamW, f32/f64/
# bf16, with and without no_sync), sharded and consolidated checkpoints resharded between world
# sizes, and argument/usage errors.
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS args TIMEOUT 60)
foreach(world 2 3)
  ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS mismatch ${world} TIMEOUT 60)
endforeach()
foreach(world 1 2 3 4)
  foreach(optim sgd adamw)
    ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train ${optim} ${world} f32 sync
                 TIMEOUT 120)
  endforeach()
endforeach()
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train adam 3 f32 nosync TIMEOUT 120)
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train adamw 2 f64 nosync TIMEOUT 120)
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train adam 4 f64 sync TIMEOUT 120)
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train adamw 2 bf16 sync TIMEOUT 120)
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS train sgd 3 bf16 nosync TIMEOUT 120)
foreach(spec 2:2 3:3 2:1 2:4 1:3 3:2 4:3)
  string(REPLACE ":" ";" parts ${spec})
  ddp_add_test(NAME test_fsdp SOURCES test_fsdp.c ARGS ckpt ${parts} TIMEOUT 120)
endforeach()
# The same over the TCP transport: every FSDP collective goes through the group.
foreach(args "train;adamw;3;f32;sync" "ckpt;2;3")
  string(REPLACE ";" "_" tag "${args}")
  add_test(NAME test_fsdp.tcp_${tag} COMMAND test_fsdp ${args})
  set_tests_properties(test_fsdp.tcp_${tag} PROPERTIES TIMEOUT 120 ENVIRONMENT DDP_TRANSPORT=tcp)
endforeach()
