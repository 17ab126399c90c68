# Process groups and the shared-memory transport (src/group, src/transport/shm, src/core/reduce).
# The op x dtype x size matrix is split per world size, family and dtype set so each test stays
# short on a busy 2-core machine.
foreach(world 1 2 3 4)
  foreach(family allreduce reduce_scatter)
    foreach(dtypes f32,f64 f16,bf16 i32,i64,u8)
      ddp_add_test(NAME test_group_ops SOURCES test_group_ops.c ARGS ${world} ${family} ${dtypes}
                   TIMEOUT 120 LIBS m)
    endforeach()
  endforeach()
  foreach(family broadcast allgather)
    ddp_add_test(NAME test_group_ops SOURCES test_group_ops.c ARGS ${world} ${family} TIMEOUT 120
                 LIBS m)
  endforeach()
  ddp_add_test(NAME test_group_async SOURCES test_group_async.c ARGS ${world} TIMEOUT 110)
  ddp_add_test(NAME test_group_args SOURCES test_group_args.c ARGS ${world} TIMEOUT 60)
  foreach(mode mismatch timeout kill leave)
    ddp_add_test(NAME test_group_errors SOURCES test_group_errors.c ARGS ${world} ${mode} TIMEOUT 100)
  endforeach()
endforeach()
foreach(world 1 3)
  ddp_add_test(NAME test_group_env SOURCES test_group_env.c ARGS ${world} TIMEOUT 60)
endforeach()
ddp_add_test(NAME test_group_reduce SOURCES test_group_reduce.c TIMEOUT 60 LIBS m)
# Sleeping waiters are woken by a late arrival on every publishing path (blocking and async).
foreach(world 2 4)
  ddp_add_test(NAME test_shm_wakeup SOURCES test_shm_wakeup.c ARGS ${world} TIMEOUT 100)
endforeach()
# Splitting a parent that failed: DDP_ERR_ABORTED at once with the cause (mismatch, dead rank).
foreach(world 2 3)
  foreach(mode mismatch dead)
    ddp_add_test(NAME test_group_split_errors SOURCES test_group_split_errors.c
                 ARGS ${world} ${mode} TIMEOUT 100)
  endforeach()
endforeach()
# The collectives built from the five (src/group/collectives.c) and send/recv, on every transport
# reachable here: data against float64 references, point to point, mismatches and timeouts.
ddp_add_test(NAME test_group_coll SOURCES test_group_coll.c ARGS 1 self data TIMEOUT 300 LIBS m)
ddp_add_test(NAME test_group_coll SOURCES test_group_coll.c ARGS 1 self p2p TIMEOUT 60 LIBS m)
ddp_add_test(NAME test_group_coll SOURCES test_group_coll.c ARGS 1 self any TIMEOUT 60 LIBS m)
foreach(world 2 3 4)
  foreach(transport shm tcp hierarchical)
    foreach(part data p2p any errors)
      ddp_add_test(NAME test_group_coll SOURCES test_group_coll.c ARGS ${world} ${transport} ${part}
                   TIMEOUT 400 LIBS m)
    endforeach()
  endforeach()
endforeach()
# The shm allreduce's variants give the same bytes; the single-copy fallback; the tuner's choice
# is rank 0's on every rank (docs/shm-transport.md, "Single-copy allreduce", "Self-tuning").
foreach(world 1 2 3 4)
  ddp_add_test(NAME test_shm_tune SOURCES test_shm_tune.c ARGS ${world} variants TIMEOUT 300)
  ddp_add_test(NAME test_shm_tune SOURCES test_shm_tune.c ARGS ${world} collectives TIMEOUT 300)
endforeach()
# Registered user memory (ddp_group_register_memory): the "mapped" allreduce reads and writes
# the peers' malloc'd buffers in place, with the bytes of the usual path; anything less than every
# rank registered falls back; errors, fork, unregistering, a size class the tuner gave to one-shot,
# and a rank killed mid-series.
foreach(world 1 2 3 4)
  ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} variants TIMEOUT 300)
endforeach()
foreach(world 2 3)
  foreach(mode fallback tuned kill auto)
    ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} ${mode} TIMEOUT 200)
  endforeach()
  set_tests_properties(test_shm_map.${world}_auto PROPERTIES SKIP_RETURN_CODE 77)
endforeach()
foreach(world 1 2 3)
  ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} unregister TIMEOUT 200)
  # broadcast and allgather from registered memory ("mapped", read where it lies)
  ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} pulled TIMEOUT 300)
  # reduce_scatter_apply (ZeRO's fused step) from registered memory
  ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} apply TIMEOUT 200)
endforeach()
foreach(world 1 2)
  foreach(mode errors fork)
    ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} ${mode} TIMEOUT 200)
  endforeach()
endforeach()
# registered memory below the one-shot size: mapped from the measured thresholds on
foreach(world 2 4)
  ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS ${world} small TIMEOUT 200)
endforeach()
# registered memory taken away behind libddp's back, noticed without a system call per call
ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS 2 watch TIMEOUT 200)
# libddp giving up its own registrations while other threads write their pages (no collective)
ddp_add_test(NAME test_shm_map SOURCES test_shm_map.c ARGS 1 writers TIMEOUT 200)
set_tests_properties(test_shm_map.1_writers PROPERTIES SKIP_RETURN_CODE 77)
# The tuner's decisions reach the Chrome trace (every rank's; the files must parse as JSON and hold
# the instant event) and rank 0's log at info.
find_program(DDP_TRACE_JSON_PYTHON NAMES python3)
foreach(world 1 2 3 4)
  set(dir ${CMAKE_BINARY_DIR}/tests/shm-tune-trace-${world})
  set(check "")
  if(DDP_TRACE_JSON_PYTHON)
    set(check " && ${DDP_TRACE_JSON_PYTHON} -c \"import json,sys\nfor p in sys.argv[2:]:\n  e=[x for x in json.load(open(p))['traceEvents'] if x.get('cat')=='tune' and x['ph']=='i']\n  assert (len(e)>=1)==(int(sys.argv[1])>1), (p,e)\n  assert all(x['args']['variant']=='staged:plain' and x['args']['collective']=='allreduce' for x in e), e\nprint('parsed',len(sys.argv)-2,'traces')\" ${world} ${dir}/shm-tune.rank*.json")
  endif()
  add_test(NAME test_shm_tune.${world}_trace
           COMMAND sh -c "rm -rf ${dir} && mkdir -p ${dir} && $<TARGET_FILE:test_shm_tune> ${world} trace ${dir}${check}")
  set_tests_properties(test_shm_tune.${world}_trace PROPERTIES TIMEOUT 200
                       ENVIRONMENT "DDP_LOG_LEVEL=info")
endforeach()
foreach(world 2 3)
  foreach(mode fallback agree knobs)
    ddp_add_test(NAME test_shm_tune SOURCES test_shm_tune.c ARGS ${world} ${mode} TIMEOUT 200)
  endforeach()
endforeach()
# A rank killed in the middle of single-copy allreduces (its peers may be reading its memory with
# process_vm_readv when it dies): every other rank fails naming it.
foreach(world 2 3)
  set(name test_group_errors.${world}_kill_single_copy)
  add_test(NAME ${name} COMMAND test_group_errors ${world} kill)
  # DDP_SHM_MAP=on: buffers reused call after call would otherwise be registered and go mapped
  # (test_shm_map kills a rank there).
  set_tests_properties(${name} PROPERTIES TIMEOUT 100
                       ENVIRONMENT "DDP_SHM_CMA_BYTES=262144;DDP_SHM_MAP=on")
endforeach()
