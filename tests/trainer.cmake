# The Fashion-MNIST trainer's tests: its parts on their own (model gradients, optimisers, sampler,
# IDX reader, checkpoints), then the program end to end under build/ddprun (test_trainer.sh).
if(ZLIB_FOUND AND FM_CBLAS_INCLUDE_DIR AND FM_OPENBLAS_LIBRARY)
  set(FM_SRC ${PROJECT_SOURCE_DIR}/examples/fashion-mnist)
  ddp_add_test(NAME test_trainer_units TIMEOUT 60
    SOURCES test_trainer_units.c ${FM_SRC}/data.c ${FM_SRC}/model.c ${FM_SRC}/optim.c
            ${FM_SRC}/checkpoint.c
    LIBS ZLIB::ZLIB ${FM_OPENBLAS_LIBRARY} m)
  target_include_directories(test_trainer_units PRIVATE ${FM_SRC} ${FM_CBLAS_INCLUDE_DIR})
  # One OpenBLAS thread, like the other trainer tests: its own worker threads are not
  # instrumented, so TSan reports races inside OpenBLAS that are not ours.
  set_tests_properties(test_trainer_units PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
endif()

if(TARGET fashion-mnist)
  if(TARGET ddprun)
    set(FM_DDPRUN $<TARGET_FILE:ddprun>)
  else()
    set(FM_DDPRUN "")
  endif()
  foreach(case worlds resume accumulate errors zero blocks progress optim restart metrics trace plot
               droplast)
    add_test(NAME test_trainer.${case}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_trainer.sh ${case}
              $<TARGET_FILE:fashion-mnist> "${FM_DDPRUN}")
    set_tests_properties(test_trainer.${case} PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77
      ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endforeach()
endif()
