# SPDX-License-Identifier: Apache-2.0
# cmake -P script behind the host.install.* tests.
#   MODE=install           cmake --install MOECOMM_BINARY_DIR into PREFIX (the other tests' fixture).
#   MODE=find_package      build the consumer with CMAKE_PREFIX_PATH=PREFIX and run it.
#   MODE=add_subdirectory  build the consumer with add_subdirectory(MOECOMM_SOURCE_DIR) and run it.
# Consumer inputs: CONSUMER_SOURCE_DIR, WORK_DIR (its build folder's parent), CONSUMER_GENERATOR,
# CONSUMER_MAKE_PROGRAM, CONSUMER_CXX_COMPILER, CONSUMER_CONFIG (may be empty), and optionally
#   CONSUMER_COMPONENT     core (default), mpi or cuda: which consumer program (consumer/CMakeLists.txt)
#   CONSUMER_ARGS          more -D arguments for its configure step, separated by |
#   CONSUMER_RUN           OFF to build the consumer without running it (default ON)
#   EXPECT_CONFIGURE_ERROR the configure step must fail with output containing this text
cmake_minimum_required(VERSION 3.25)

function(require)
  foreach(_var IN LISTS ARGN)
    if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
      message(FATAL_ERROR "run_install_test.cmake: -D${_var}=... is required")
    endif()
  endforeach()
endfunction()
require(MODE MOECOMM_SOURCE_DIR MOECOMM_BINARY_DIR PREFIX)

function(run_step what)
  message(STATUS "---- ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc COMMAND_ECHO STDOUT)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${what} failed: ${_rc}")
  endif()
endfunction()

set(_config_args)
if(NOT "${CONSUMER_CONFIG}" STREQUAL "")
  set(_config_args --config "${CONSUMER_CONFIG}")
endif()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run_step("install ${MOECOMM_BINARY_DIR}" ${CMAKE_COMMAND} --install "${MOECOMM_BINARY_DIR}" --prefix "${PREFIX}"
           ${_config_args})
  return()
endif()

require(CONSUMER_SOURCE_DIR WORK_DIR CONSUMER_GENERATOR CONSUMER_CXX_COMPILER)
if(NOT CONSUMER_COMPONENT)
  set(CONSUMER_COMPONENT core)
endif()
set(_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(_consumer_args -G "${CONSUMER_GENERATOR}" "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}"
                   "-DMOECOMM_CONSUMER_MODE=${MODE}" "-DMOECOMM_CONSUMER_COMPONENT=${CONSUMER_COMPONENT}")
if(CONSUMER_MAKE_PROGRAM)
  list(APPEND _consumer_args "-DCMAKE_MAKE_PROGRAM=${CONSUMER_MAKE_PROGRAM}")
endif()
if(NOT "${CONSUMER_CONFIG}" STREQUAL "")
  list(APPEND _consumer_args "-DCMAKE_BUILD_TYPE=${CONSUMER_CONFIG}")
endif()
if(CONSUMER_ARGS)
  string(REPLACE "|" ";" _extra "${CONSUMER_ARGS}")
  list(APPEND _consumer_args ${_extra})
endif()

if(MODE STREQUAL "find_package")
  list(APPEND _consumer_args "-DCMAKE_PREFIX_PATH=${PREFIX}")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND _consumer_args "-DMOECOMM_SOURCE_DIR=${MOECOMM_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run_install_test.cmake: MODE must be install, find_package or add_subdirectory, not '${MODE}'")
endif()

set(_configure ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${_build}" ${_consumer_args})
if(DEFINED EXPECT_CONFIGURE_ERROR)
  message(STATUS "---- configure the consumer, which must fail with: ${EXPECT_CONFIGURE_ERROR}")
  execute_process(COMMAND ${_configure} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  string(REGEX REPLACE "[ \t\r\n]+" " " _flat "${_out}")  # CMake wraps long messages
  string(FIND "${_flat}" "${EXPECT_CONFIGURE_ERROR}" _at)
  if(_rc EQUAL 0 OR _at EQUAL -1)
    message(FATAL_ERROR "configuring the consumer should have failed with '${EXPECT_CONFIGURE_ERROR}' (exit ${_rc}):\n${_out}")
  endif()
  message(STATUS "failed as expected")
  return()
endif()
run_step("configure the consumer" ${_configure})

if(MODE STREQUAL "find_package")
  # The package must come from the prefix just installed, not from some other moecomm on the system.
  file(STRINGS "${_build}/CMakeCache.txt" _dir_line REGEX "^moecomm_DIR:")
  string(REGEX REPLACE "^moecomm_DIR:[A-Z]+=" "" _found_dir "${_dir_line}")
  file(REAL_PATH "${_found_dir}" _found_dir)
  file(REAL_PATH "${PREFIX}" _real_prefix)
  string(FIND "${_found_dir}/" "${_real_prefix}/" _at)
  if(NOT _at EQUAL 0)
    message(FATAL_ERROR "find_package(moecomm) used ${_found_dir}, not the package installed in ${_real_prefix}")
  endif()
endif()

run_step("build the consumer" ${CMAKE_COMMAND} --build "${_build}" ${_config_args})
if(NOT DEFINED CONSUMER_RUN OR CONSUMER_RUN)
  run_step("run the consumer" "${_build}/bin/moecomm_consumer")
endif()
