// SPDX-License-Identifier: Apache-2.0
// CUDA instantiations of the same test bodies the host runs (ops, codec, router): nvcc compiles
// them in every CI run; they run where a GPU exists, and g++ builds the same file against the
// CUDA emulation (emulated.ops), where they run here. Without a device the binary reports the suite as skipped (exit
// code 77, which CTest shows as "Skipped"), never as passed.

#define DOCTEST_CONFIG_IMPLEMENT
#include "../collectives/expert_codec_cases.hpp"
#include "../rows/router_cases.hpp"

#include "device_runner.hpp"

#include <moecomm/moecomm.cuh>

#include <cstdio>

namespace test {

template <class T>
struct cuda_config {
  using backend = moecomm::cuda_backend;
  using value_type = T;
  static backend make_backend() { return backend{nullptr}; }
};

#define MOECOMM_TEST_ALL_TYPES cuda_config<float>, cuda_config<__half>, cuda_config<__nv_bfloat16>
#define MOECOMM_TEST_ONE_TYPE cuda_config<float>

}  // namespace test

#include "../rows/row_case_instantiations.hpp"

namespace test {

TEST_CASE_TEMPLATE_INVOKE(codec_sweep, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(codec_ties, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(codec_exact, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(codec_errors, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(codec_in_place, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_sweep, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_finite_differences, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_example, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_errors, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_unchecked, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(router_state_reuse, MOECOMM_TEST_ONE_TYPE);

}  // namespace test

int main(int argc, char** argv) {
  if (test::no_device_for("the CUDA test bodies were")) return test::skipped_exit_code;
  return test::run_doctest(argc, argv);
}
