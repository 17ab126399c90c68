# The Python package's torch backend (python/libddp/csrc): built by `make` for every Python with
# torch that is found, so neither users nor CI compile at import. One source serves torch 1.13
# (c10d::ProcessGroup) and torch 2.x (c10d::Backend); each build goes to
# build/python/libddp/_ddp_torch-torch<major>.<minor>.so, and libddp.torch loads the one of the
# torch it runs under. The flags come from torch.utils.cpp_extension, as setup.py's build would
# use them.
#
# DDP_TORCH=OFF skips the backend. DDP_PYTHON names the interpreter of the Python tests (default:
# the first of python3, /usr/bin/python3 that imports torch, else the first python3);
# DDP_TORCH_PYTHONS lists the interpreters the backend is built and tested for (default: each of
# python3 and /usr/bin/python3 that imports torch, one per torch version: python3 on PATH carries
# torch 2.x from PyPI here, Debian's /usr/bin/python3 torch 1.13).
option(DDP_TORCH "Build the torch.distributed backend when torch is found" ON)
set(DDP_PYTHON "" CACHE FILEPATH "Python interpreter for the Python tests")
set(DDP_TORCH_PYTHONS "" CACHE STRING "Interpreters to build and test the torch backend for")

# torch's version (major.minor) under `python`, or "" when it does not import torch.
function(ddp_torch_version python out)
  execute_process(COMMAND ${python} -c
                  "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE v OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET)
  if(rc EQUAL 0)
    set(${out} "${v}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

set(DDP_TORCH_BUILDS "")  # "python;version" pairs built below, for tests/python.cmake
if(DDP_TORCH)
  set(candidates ${DDP_TORCH_PYTHONS})
  if(NOT candidates)
    foreach(name python3 /usr/bin/python3)
      find_program(ddp_python_candidate NAMES ${name} NO_CACHE)
      if(ddp_python_candidate)
        list(APPEND candidates ${ddp_python_candidate})
      endif()
      unset(ddp_python_candidate)
    endforeach()
  endif()
  include(CheckLanguage)
  check_language(CXX)
  set(seen_versions "")
  foreach(py ${candidates})
    if(DDP_TSAN)
      # The Python tests preload TSan's runtime, which crashes shells, and a pyenv `python3` is a
      # shell script: name the interpreter itself.
      execute_process(COMMAND ${py} -c "import sys; print(sys.executable)"
                      OUTPUT_VARIABLE real_py OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE rc ERROR_QUIET)
      if(rc EQUAL 0 AND EXISTS "${real_py}")
        set(py "${real_py}")
      endif()
    endif()
    ddp_torch_version(${py} version)
    if(NOT version OR version IN_LIST seen_versions)
      continue()
    endif()
    if(NOT DDP_PYTHON)
      set(DDP_PYTHON ${py} CACHE FILEPATH "" FORCE)
    endif()
    execute_process(
      COMMAND ${py} -c "
import sysconfig, torch
from torch.utils import cpp_extension as c
print(','.join(c.include_paths()))
print(sysconfig.get_paths()['include'])
print(','.join(c.library_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)"
      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_QUIET)
    if(NOT rc EQUAL 0 OR NOT CMAKE_CXX_COMPILER)
      message(STATUS "torch backend for ${py}: not built (torch's build flags unavailable, or no C++ compiler)")
      continue()
    endif()
    enable_language(CXX)
    string(REPLACE "\n" ";" lines "${out}")
    list(GET lines 0 torch_includes)
    list(GET lines 1 python_include)
    list(GET lines 2 torch_libdirs)
    list(GET lines 3 torch_cxx11_abi)
    list(GET lines 4 full_version)
    string(REPLACE "," ";" torch_libdirs "${torch_libdirs}")
    string(REPLACE "," ";" torch_includes "${torch_includes}")
    if(NOT EXISTS ${python_include}/Python.h)
      message(STATUS "torch backend for ${py}: not built (no Python.h in ${python_include}: install python3-dev)")
      continue()
    endif()
    list(APPEND seen_versions ${version})
    string(REPLACE "." "_" tag "${version}")
    set(target ddp_torch_${tag})
    # torch 2.x's headers need C++20 (2.13's do; older 2.x build with it as well); 1.13's C++17.
    if(version VERSION_LESS 2.0)
      set(cxx_standard 17)
    else()
      set(cxx_standard 20)
    endif()
    add_library(${target} MODULE ${PROJECT_SOURCE_DIR}/python/libddp/csrc/process_group_ddp.cpp)
    set_target_properties(${target} PROPERTIES
      PREFIX "" OUTPUT_NAME _ddp_torch-torch${version} SUFFIX ".so"
      LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/python/libddp
      CXX_STANDARD ${cxx_standard} CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
      CXX_VISIBILITY_PRESET hidden
      # build/python/libddp/_ddp_torch-*.so finds build/libddp.so.
      BUILD_RPATH "$ORIGIN/../.." INSTALL_RPATH "$ORIGIN")
    target_include_directories(${target} SYSTEM PRIVATE ${torch_includes} ${python_include})
    target_compile_definitions(${target} PRIVATE TORCH_EXTENSION_NAME=_ddp_torch
      TORCH_API_INCLUDE_EXTENSION_H _GLIBCXX_USE_CXX11_ABI=${torch_cxx11_abi})
    # torch's headers do not build warning-free; the directory's C-only flags do not apply.
    set_property(TARGET ${target} PROPERTY COMPILE_OPTIONS -Wall -Wextra -Wno-unused-parameter)
    target_link_directories(${target} PRIVATE ${torch_libdirs})
    target_link_libraries(${target} PRIVATE ddp torch torch_cpu c10 torch_python)
    list(APPEND DDP_TORCH_BUILDS "${py}|${version}")
    message(STATUS "torch backend: building for torch ${full_version} (${py})")
  endforeach()
  if(NOT DDP_TORCH_BUILDS)
    message(STATUS "torch backend: not built (no Python with torch, or no C++ compiler)")
  endif()
endif()
if(NOT DDP_PYTHON)
  find_program(ddp_python_default NAMES python3)
  if(ddp_python_default)
    set(DDP_PYTHON ${ddp_python_default} CACHE FILEPATH "" FORCE)
  endif()
endif()
