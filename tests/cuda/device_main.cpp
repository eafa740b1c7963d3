// SPDX-License-Identifier: Apache-2.0
// doctest's main for test bodies that need a GPU (the layer and pattern bodies of tests/emulation/
// compiled by nvcc): without a device the binary says so and reports the suite as skipped (exit
// code 77, "Skipped" in CTest), never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include "device_runner.hpp"

int main(int argc, char** argv) {
  if (test::no_device_for("the layer and pattern bodies were")) return test::skipped_exit_code;
  return test::run_doctest(argc, argv);
}
