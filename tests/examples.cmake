# The README's example on 1-4 ranks, and installing libddp for a program outside the tree.
if(TARGET hello_ddp AND TARGET ddprun)
  add_test(NAME test_examples.hello
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_examples.sh hello $<TARGET_FILE:ddprun>
            $<TARGET_FILE:hello_ddp>)
  set_tests_properties(test_examples.hello PROPERTIES TIMEOUT 120)
endif()
# A sanitized libddp needs a consumer built with the same sanitizer (ASan's runtime must come
# first, TSan's must see every thread): the consumer gets the flags the tree was built with.
set(DDP_CONSUMER_FLAGS "")
if(DDP_SANITIZE)
  set(DDP_CONSUMER_FLAGS "-fsanitize=address,undefined -fno-omit-frame-pointer")
elseif(DDP_TSAN)
  set(DDP_CONSUMER_FLAGS "-fsanitize=thread -fno-omit-frame-pointer")
endif()
add_test(NAME test_examples.install
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_examples.sh install ${PROJECT_SOURCE_DIR}
          ${PROJECT_BINARY_DIR} "${DDP_CONSUMER_FLAGS}")
set_tests_properties(test_examples.install PROPERTIES TIMEOUT 300)
# `make install` from a fresh build directory: the libraries and installed programs only.
add_test(NAME test_examples.make_install
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/test_examples.sh make-install ${PROJECT_SOURCE_DIR})
set_tests_properties(test_examples.make_install PROPERTIES TIMEOUT 600)
