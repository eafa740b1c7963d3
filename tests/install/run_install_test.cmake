# SPDX-License-Identifier: Apache-2.0
# cmake -P script behind the host.install.* tests.
#   MODE=find_package      cmake --install MOECOMM_BINARY_DIR into WORK_DIR/prefix, then build the
#                          consumer with CMAKE_PREFIX_PATH=WORK_DIR/prefix and run it.
#   MODE=add_subdirectory  build the consumer with add_subdirectory(MOECOMM_SOURCE_DIR) and run it.
# Other inputs: CONSUMER_SOURCE_DIR, CONSUMER_GENERATOR, CONSUMER_MAKE_PROGRAM, CONSUMER_CXX_COMPILER,
# CONSUMER_CONFIG (may be empty), CONSUMER_CUDAToolkit_ROOT (optional).
cmake_minimum_required(VERSION 3.25)

foreach(_var IN ITEMS MODE MOECOMM_SOURCE_DIR MOECOMM_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR CONSUMER_GENERATOR
                      CONSUMER_CXX_COMPILER)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_install_test.cmake: -D${_var}=... is required")
  endif()
endforeach()

function(run_step what)
  message(STATUS "---- ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc COMMAND_ECHO STDOUT)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${what} failed: ${_rc}")
  endif()
endfunction()

set(_prefix "${WORK_DIR}/prefix")
set(_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(_config_args)
if(NOT "${CONSUMER_CONFIG}" STREQUAL "")
  set(_config_args --config "${CONSUMER_CONFIG}")
endif()

set(_consumer_args -G "${CONSUMER_GENERATOR}" "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}"
                   "-DMOECOMM_CONSUMER_MODE=${MODE}")
if(CONSUMER_MAKE_PROGRAM)
  list(APPEND _consumer_args "-DCMAKE_MAKE_PROGRAM=${CONSUMER_MAKE_PROGRAM}")
endif()
if(NOT "${CONSUMER_CONFIG}" STREQUAL "")
  list(APPEND _consumer_args "-DCMAKE_BUILD_TYPE=${CONSUMER_CONFIG}")
endif()
if(CONSUMER_CUDAToolkit_ROOT)
  list(APPEND _consumer_args "-DCUDAToolkit_ROOT=${CONSUMER_CUDAToolkit_ROOT}")
endif()

if(MODE STREQUAL "find_package")
  run_step("install ${MOECOMM_BINARY_DIR}" ${CMAKE_COMMAND} --install "${MOECOMM_BINARY_DIR}" --prefix "${_prefix}"
           ${_config_args})
  list(APPEND _consumer_args "-DCMAKE_PREFIX_PATH=${_prefix}")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND _consumer_args "-DMOECOMM_SOURCE_DIR=${MOECOMM_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run_install_test.cmake: MODE must be find_package or add_subdirectory, not '${MODE}'")
endif()

run_step("configure the consumer" ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${_build}" ${_consumer_args})

if(MODE STREQUAL "find_package")
  # The package must come from the prefix just installed, not from some other moecomm on the system.
  file(STRINGS "${_build}/CMakeCache.txt" _dir_line REGEX "^moecomm_DIR:")
  string(REGEX REPLACE "^moecomm_DIR:[A-Z]+=" "" _found_dir "${_dir_line}")
  file(REAL_PATH "${_found_dir}" _found_dir)
  file(REAL_PATH "${_prefix}" _real_prefix)
  string(FIND "${_found_dir}/" "${_real_prefix}/" _at)
  if(NOT _at EQUAL 0)
    message(FATAL_ERROR "find_package(moecomm) used ${_found_dir}, not the package installed in ${_real_prefix}")
  endif()
endif()

run_step("build the consumer" ${CMAKE_COMMAND} --build "${_build}" ${_config_args})
run_step("run the consumer" "${_build}/bin/moecomm_consumer")
