// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the `main` of a CUDA test binary needs: without a device the binary says so and reports the
// suite as skipped (exit code 77, "Skipped" in CTest), never as passed. Include after defining
// DOCTEST_CONFIG_IMPLEMENT.

#include <doctest/doctest.h>

#include <moecomm/backend/cuda.cuh>

#include <cstdio>

namespace test {

inline constexpr int skipped_exit_code = 77;

// True, after saying that `what` was compiled but not run, when this machine has no CUDA device.
inline bool no_device_for(char const* what) {
  if (moecomm::cuda_device_available()) return false;
  std::printf("SKIPPED: no CUDA device on this machine; %s compiled but not run\n", what);
  return true;
}

inline int run_doctest(int argc, char** argv) {
  doctest::Context context(argc, argv);
  return context.run();
}

}  // namespace test
