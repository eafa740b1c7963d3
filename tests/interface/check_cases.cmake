# SPDX-License-Identifier: Apache-2.0
# cmake -P script behind host.interface.experts_diagnostics.
#   -DCXX_COMPILER=<path>     the C++ compiler
#   -DINCLUDE_DIRS=<a|b|...>  moecomm's include directories, separated by |
#   -DCASES_DIR=<dir>         *.cpp cases, each with `// expect: compiles` or `// expect-error: <text>`
#                             as its second line
# Each case is compiled with -std=c++17 -fsyntax-only -Wall -Wextra -Werror. A compile-fail case
# passes only when the compiler fails with exactly one `error:` line and that line contains <text>
# (one clear diagnostic, no cascade); a positive case only when it compiles without a diagnostic.
# Every case is run; the failures are listed together.
cmake_minimum_required(VERSION 3.25)

include("${CMAKE_CURRENT_LIST_DIR}/../support/require_arguments.cmake")
moecomm_require_arguments(check_cases.cmake CXX_COMPILER INCLUDE_DIRS CASES_DIR)

string(REPLACE "|" ";" _include_dirs "${INCLUDE_DIRS}")
list(TRANSFORM _include_dirs PREPEND "-I")
file(GLOB _cases "${CASES_DIR}/*.cpp")
list(SORT _cases)
if(NOT _cases)
  message(FATAL_ERROR "check_cases.cmake: no *.cpp cases in ${CASES_DIR}")
endif()

set(_failures "")
foreach(_case IN LISTS _cases)
  get_filename_component(_name "${_case}" NAME)
  file(STRINGS "${_case}" _expect LIMIT_COUNT 2)
  list(GET _expect 1 _expect)
  execute_process(COMMAND "${CXX_COMPILER}" -std=c++17 -fsyntax-only -Wall -Wextra -Werror ${_include_dirs} "${_case}"
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  string(REGEX MATCHALL "[^\n]*error:[^\n]*" _errors "${_out}")
  list(LENGTH _errors _error_count)
  if(_expect STREQUAL "// expect: compiles")
    if(NOT _rc EQUAL 0 OR NOT _out STREQUAL "")
      string(APPEND _failures "${_name}: expected to compile cleanly, but:\n${_out}\n")
    endif()
  elseif(_expect MATCHES "^// expect-error: (.+)$")
    set(_text "${CMAKE_MATCH_1}")
    if(_rc EQUAL 0)
      string(APPEND _failures "${_name}: expected a compile error containing '${_text}', but it compiled\n")
    elseif(NOT _error_count EQUAL 1)
      string(APPEND _failures "${_name}: expected exactly one error, got ${_error_count}:\n${_out}\n")
    else()
      string(FIND "${_errors}" "${_text}" _at)
      if(_at EQUAL -1)
        string(APPEND _failures "${_name}: the error does not contain '${_text}':\n${_errors}\n")
      endif()
    endif()
  else()
    string(APPEND _failures "${_name}: line 2 must be `// expect: compiles` or `// expect-error: <text>`\n")
  endif()
  message(STATUS "${_name}: ${_expect}")
endforeach()

if(NOT _failures STREQUAL "")
  message(FATAL_ERROR "experts interface diagnostics:\n${_failures}")
endif()
list(LENGTH _cases _count)
message(STATUS "all ${_count} cases behave as expected")
