# SPDX-License-Identifier: Apache-2.0
# The NCCL communicator's test, included by tests/CMakeLists.txt inside if(MOECOMM_ENABLE_CUDA).
# One process, one thread and one communicator per visible device; skipped (exit code 77, shown
# by CTest as "Skipped") where there is no device.
if(MOECOMM_ENABLE_NCCL)
  find_package(Threads REQUIRED)
  add_executable(moecomm_nccl_tests ${CMAKE_CURRENT_LIST_DIR}/nccl_test.cu)
  target_link_libraries(moecomm_nccl_tests PRIVATE moecomm::nccl doctest::doctest Threads::Threads)
  add_test(NAME cuda.nccl COMMAND moecomm_nccl_tests)
  set_tests_properties(cuda.nccl PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
