# SPDX-License-Identifier: Apache-2.0
# FindNCCL: locates nccl.h and libnccl and defines the imported target NCCL::nccl.
# Hints: NCCL_ROOT, CUDAToolkit_ROOT (the CUDA toolkit may ship NCCL in its own folders). NCCL_ROOT
# may be the folder of the Python wheel nvidia-nccl-cu* (include/nccl.h, lib/libnccl.so.2 and no
# libnccl.so): the library is then found by its versioned name.
include(FindPackageHandleStandardArgs)
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR} /usr/local/cuda)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints}
             PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_major REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_minor REGEX "^#define NCCL_MINOR +[0-9]+")
  string(REGEX REPLACE "[^0-9]" "" _nccl_major "${_nccl_major}")
  string(REGEX REPLACE "[^0-9]" "" _nccl_minor "${_nccl_minor}")
  set(NCCL_VERSION "${_nccl_major}.${_nccl_minor}")
endif()
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
