// SPDX-License-Identifier: Apache-2.0
// A downstream program of the host core (moecomm::moecomm): builds a permute plan on the host and
// checks the row count. The core must carry no back-end: CUDA, NCCL and MPI come with their own targets.
#include <moecomm/moecomm.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>

int main() {
  std::printf("moecomm %d.%d.%d (consumer mode: %s)\n", MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR,
              MOECOMM_VERSION_PATCH, MOECOMM_CONSUMER_MODE);
#if defined(MOECOMM_ENABLE_CUDA) || defined(MOECOMM_ENABLE_NCCL) || defined(MOECOMM_ENABLE_MPI)
  std::fprintf(stderr, "moecomm_consumer: moecomm::moecomm carries a back-end's definition\n");
  int failures = 1;
#else
  int failures = 0;
#endif
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
