# Sharding tests: the reduce-scatter bucketer (against direct reduce-scatters) and the ZeRO
# optimizer (stages 1 and 2, stage 1 in chunks, SGD and Adam, overlap) against plain data-parallel training, world
# sizes 1-4.
ddp_add_test(NAME test_shard_bucketer SOURCES test_shard_bucketer.c ARGS args TIMEOUT 60)
foreach(world 1 2 3 4)
  ddp_add_test(NAME test_shard_bucketer SOURCES test_shard_bucketer.c ARGS ${world} TIMEOUT 120)
endforeach()

ddp_add_test(NAME test_zero SOURCES test_zero.c ARGS args TIMEOUT 60)
foreach(spec 1:2 1:3 2:2 2:4)
  string(REPLACE ":" ";" parts ${spec})
  ddp_add_test(NAME test_zero SOURCES test_zero.c ARGS mismatch ${parts} TIMEOUT 60)
endforeach()
foreach(world 1 2 3 4)
  foreach(mode stage1 stage1chunks stage2 stage2ready stage2fused stage2fusedready overlap)
    foreach(optim sgd adam)
      ddp_add_test(NAME test_zero SOURCES test_zero.c ARGS ${mode} ${optim} ${world} f32
                   TIMEOUT 120)
    endforeach()
  endforeach()
endforeach()
foreach(mode stage1 stage1chunks stage2 stage2fused overlap)
  ddp_add_test(NAME test_zero SOURCES test_zero.c ARGS ${mode} nesterov 3 f64 TIMEOUT 120)
  ddp_add_test(NAME test_zero SOURCES test_zero.c ARGS ${mode} adam 4 f64 TIMEOUT 120)
endforeach()

# zero-bench: ZeRO's memory and step time against plain data parallelism (run by hand; results
# in docs/sharding.md). The test only runs it small, to keep it building and working.
ddp_add_test(NAME zero_bench SOURCES zero_bench.c
             ARGS --world 2 --hidden 24 --iters 2 --work 0 TIMEOUT 120)

# The optimizers against PyTorch (tests/optim_torch_reference.py writes torch.optim's results;
# the test replays them through ddp_optim and ddp_zero). Needs a Python with torch (the first
# found by python/python.cmake, which `make test` installs where it can): without one the test
# is skipped and says why.
if(NOT DDP_TORCH_PYTHON)
  if(DDP_TORCH_BUILDS)
    list(GET DDP_TORCH_BUILDS 0 first_torch_build)
    string(REPLACE "|" ";" first_torch_build "${first_torch_build}")
    list(GET first_torch_build 0 DDP_TORCH_PYTHON)
  elseif(EXISTS /usr/bin/python3)
    set(DDP_TORCH_PYTHON /usr/bin/python3)
  else()
    set(DDP_TORCH_PYTHON python3)
  endif()
endif()
set(DDP_TORCH_PYTHON ${DDP_TORCH_PYTHON} CACHE STRING "Python with torch for test_optim_torch")
set(DDP_OPTIM_REF ${CMAKE_CURRENT_SOURCE_DIR}/optim_torch_reference.py)
# Named by case only (the Python and script paths are arguments, not part of the test's name).
add_executable(test_optim_torch test_optim_torch.c)
target_link_libraries(test_optim_torch PRIVATE ddp_test_harness)
set_target_properties(test_optim_torch PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
add_test(NAME test_optim_torch.plain
         COMMAND test_optim_torch plain ${DDP_TORCH_PYTHON} ${DDP_OPTIM_REF})
set_tests_properties(test_optim_torch.plain PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
foreach(spec 1:1 1:2 1:3 2:1 2:2 2:3)
  string(REPLACE ":" ";" parts ${spec})
  string(REPLACE ":" "_" tag ${spec})
  add_test(NAME test_optim_torch.zero_${tag}
           COMMAND test_optim_torch zero ${parts} ${DDP_TORCH_PYTHON} ${DDP_OPTIM_REF})
  set_tests_properties(test_optim_torch.zero_${tag} PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endforeach()

# Optimizer state save/load: resumed runs bitwise equal to uninterrupted ones (plain; ZeRO 1/2 at
# worlds 1-3 from shards and from the consolidated state), damaged or mismatching states refused.
ddp_add_test(NAME test_optim_state SOURCES test_optim_state.c ARGS plain TIMEOUT 60)
foreach(spec 1:1 1:2 1:3 2:1 2:2 2:3)
  string(REPLACE ":" ";" parts ${spec})
  ddp_add_test(NAME test_optim_state SOURCES test_optim_state.c ARGS zero ${parts} TIMEOUT 120)
endforeach()

# The vectorised optimizer kernels against a scalar copy of the loop they replaced, bit for bit,
# over every option combination and dtype. The reference is compiled as the kernels are, without
# FMA contraction: clang contracts a * b + c by default (-ffp-contract=on), and where FMA is
# available (DDP_NATIVE on any recent x86-64) the reference then rounds once where the kernels
# round twice, and the test fails with correct kernels (tried: clang -march=native on a Zen 3).
ddp_add_test(NAME test_optim_kernels SOURCES test_optim_kernels.c TIMEOUT 120)
set_source_files_properties(test_optim_kernels.c PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
