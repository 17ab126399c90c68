# The README's example on 1-4 ranks, and installing libddp for a program outside the tree.
if(TARGET hello_ddp AND TARGET ddprun)
  add_test(NAME test_examples.hello
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_examples.sh hello $<TARGET_FILE:ddprun>
            $<TARGET_FILE:hello_ddp>)
  set_tests_properties(test_examples.hello PROPERTIES TIMEOUT 120)
endif()
add_test(NAME test_examples.install
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_examples.sh install ${PROJECT_SOURCE_DIR}
          ${PROJECT_BINARY_DIR})
set_tests_properties(test_examples.install PROPERTIES TIMEOUT 300)
