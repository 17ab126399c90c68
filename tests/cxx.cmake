# The public headers from C++11: a C++ translation unit uses every config initializer
# (DDP_*_INIT and ddp_*_init) and checks the defaults. Skipped when there is no C++ compiler.
include(CheckLanguage)
check_language(CXX)
if(CMAKE_CXX_COMPILER)
  enable_language(CXX)
  add_executable(test_config_init_cxx test_config_init_cxx.cc)
  set_target_properties(test_config_init_cxx PROPERTIES
    CXX_STANDARD 11 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  # The directory's warning flags include C-only ones (-Wstrict-prototypes): keep the rest.
  get_property(ddp_cxx_options DIRECTORY PROPERTY COMPILE_OPTIONS)
  list(REMOVE_ITEM ddp_cxx_options -Wstrict-prototypes)
  set_property(TARGET test_config_init_cxx PROPERTY COMPILE_OPTIONS ${ddp_cxx_options})
  target_link_libraries(test_config_init_cxx PRIVATE ddp_static)
  if(TARGET ddp_powersgd_static)
    target_link_libraries(test_config_init_cxx PRIVATE ddp_powersgd_static)
    target_compile_definitions(test_config_init_cxx PRIVATE DDP_TEST_HAVE_POWERSGD=1)
  endif()
  add_test(NAME test_config_init_cxx COMMAND test_config_init_cxx)
  set_tests_properties(test_config_init_cxx PROPERTIES TIMEOUT 60)
else()
  message(STATUS "test_config_init_cxx: no C++ compiler, not built")
endif()
