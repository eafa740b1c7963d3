// SPDX-License-Identifier: Apache-2.0
// doctest's main for test bodies that need a GPU (the layer and pattern bodies of tests/emulation/
// compiled by nvcc): without a device the binary says so and reports the suite as skipped (exit
// code 77, "Skipped" in CTest), never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <moecomm/backend/cuda.cuh>

#include <cstdio>

int main(int argc, char** argv) {
  constexpr int skipped = 77;
  if (!moecomm::cuda_device_available()) {
    std::printf("SKIPPED: no CUDA device on this machine; the layer and pattern bodies were compiled but not run\n");
    return skipped;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
