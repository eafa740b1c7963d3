# SPDX-License-Identifier: Apache-2.0
# For `cmake -P` scripts: moecomm_require_arguments(<script name> <var>...) stops with an error naming
# the first -D<var>=... the caller left out or empty.
function(moecomm_require_arguments script)
  foreach(_var IN LISTS ARGN)
    if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
      message(FATAL_ERROR "${script}: -D${_var}=... is required")
    endif()
  endforeach()
endfunction()
