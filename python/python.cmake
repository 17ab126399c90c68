# The Python package's torch backend (python/libddp/csrc): built by `make` when a Python with
# torch and a C++ compiler are found, so neither users nor CI compile at import. The flags come
# from torch.utils.cpp_extension, as setup.py's build would use them. DDP_TORCH=OFF skips it;
# DDP_PYTHON names the interpreter (default: the first python3 that imports torch).
option(DDP_TORCH "Build the torch.distributed backend when torch is found" ON)
set(DDP_PYTHON "" CACHE FILEPATH "Python interpreter with torch for the torch backend and tests")

if(DDP_TORCH)
  if(NOT DDP_PYTHON)
    foreach(candidate python3 /usr/bin/python3)
      find_program(ddp_python_candidate NAMES ${candidate} NO_CACHE)
      if(ddp_python_candidate)
        execute_process(COMMAND ${ddp_python_candidate} -c "import torch"
                        RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
        if(rc EQUAL 0)
          set(DDP_PYTHON ${ddp_python_candidate} CACHE FILEPATH "" FORCE)
          break()
        endif()
      endif()
      unset(ddp_python_candidate)
    endforeach()
  endif()
  if(DDP_PYTHON)
    execute_process(
      COMMAND ${DDP_PYTHON} -c "
import sysconfig, torch
from torch.utils import cpp_extension as c
print(','.join(c.include_paths()))
print(sysconfig.get_paths()['include'])
print(','.join(c.library_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)"
      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_QUIET)
  endif()
  include(CheckLanguage)
  check_language(CXX)
  if(DDP_PYTHON AND rc EQUAL 0 AND CMAKE_CXX_COMPILER)
    enable_language(CXX)
    string(REPLACE "\n" ";" lines "${out}")
    list(GET lines 0 torch_includes)
    list(GET lines 1 python_include)
    list(GET lines 2 torch_libdirs)
    string(REPLACE "," ";" torch_libdirs "${torch_libdirs}")
    list(GET lines 3 torch_cxx11_abi)
    list(GET lines 4 DDP_TORCH_VERSION)
    string(REPLACE "," ";" torch_includes "${torch_includes}")
    if(NOT EXISTS ${python_include}/Python.h)
      message(STATUS "torch backend: not built (no Python.h in ${python_include}: install python3-dev)")
    else()
      add_library(ddp_torch MODULE ${PROJECT_SOURCE_DIR}/python/libddp/csrc/process_group_ddp.cpp)
      set_target_properties(ddp_torch PROPERTIES
        PREFIX "" OUTPUT_NAME _ddp_torch SUFFIX ".so"
        LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/python/libddp
        CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
        CXX_VISIBILITY_PRESET hidden
        # build/python/libddp/_ddp_torch.so finds build/libddp.so.
        BUILD_RPATH "$ORIGIN/../.." INSTALL_RPATH "$ORIGIN")
      target_include_directories(ddp_torch SYSTEM PRIVATE ${torch_includes} ${python_include})
      target_compile_definitions(ddp_torch PRIVATE TORCH_EXTENSION_NAME=_ddp_torch
        TORCH_API_INCLUDE_EXTENSION_H _GLIBCXX_USE_CXX11_ABI=${torch_cxx11_abi})
      # torch's headers do not build warning-free; the directory's C-only flags do not apply.
      set_property(TARGET ddp_torch PROPERTY COMPILE_OPTIONS -Wall -Wextra -Wno-unused-parameter)
      target_link_directories(ddp_torch PRIVATE ${torch_libdirs})
      target_link_libraries(ddp_torch PRIVATE ddp torch torch_cpu c10 torch_python)
      message(STATUS "torch backend: building for torch ${DDP_TORCH_VERSION} (${DDP_PYTHON})")
    endif()
  else()
    message(STATUS "torch backend: not built (no Python with torch, or no C++ compiler)")
  endif()
endif()
