// SPDX-License-Identifier: Apache-2.0
// A downstream program: builds a permute plan on the host and checks the row count. It also checks
// that the back-ends the package config reports match the definitions moecomm::moecomm carries.
#include <moecomm/moecomm.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>

namespace {

int check_feature(char const* name, int reported_by_cmake, int defined_on_target) {
  std::printf("  MOECOMM_ENABLE_%s: package config %s, compile definition %s\n", name,
              reported_by_cmake ? "ON" : "OFF", defined_on_target ? "present" : "absent");
  if (reported_by_cmake != defined_on_target) {
    std::fprintf(stderr, "moecomm_consumer: MOECOMM_ENABLE_%s disagrees between CMake and the target\n", name);
    return 1;
  }
  return 0;
}

}  // namespace

int main() {
  std::printf("moecomm %d.%d.%d (consumer mode: %s)\n", MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR,
              MOECOMM_VERSION_PATCH, MOECOMM_CONSUMER_MODE);
#if defined(MOECOMM_ENABLE_CUDA)
  int const target_cuda = 1;
#else
  int const target_cuda = 0;
#endif
  int failures = 0;
  failures += check_feature("CUDA", MOECOMM_CONSUMER_PKG_CUDA, target_cuda);
  failures += check_feature("NCCL", MOECOMM_CONSUMER_PKG_NCCL, MOECOMM_HAS_NCCL());
  failures += check_feature("MPI", MOECOMM_CONSUMER_PKG_MPI, MOECOMM_HAS_MPI());

  try {
    moecomm::host_backend be;
    std::int32_t const idx[] = {0, 1, 1, 0};  // T = 2 tokens, K = 2 slots, E = 2 experts
    moecomm::routing_view routing{idx, nullptr, 2, 2};
    auto plan = moecomm::make_permute_plan(be, routing, 2);
    std::printf("permute plan: %lld rows\n", static_cast<long long>(plan.num_rows()));
    if (plan.num_rows() != 4) {
      std::fprintf(stderr, "moecomm_consumer: expected 4 rows, got %lld\n", static_cast<long long>(plan.num_rows()));
      ++failures;
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moecomm_consumer: %s\n", e.what());
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}
