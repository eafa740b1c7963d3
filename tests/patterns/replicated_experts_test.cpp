// SPDX-License-Identifier: Apache-2.0
// Replicated experts (patterns/replicated_experts.hpp) over 8 in-process ranks: for contiguous,
// cyclic and load-aware placements, with FineMoE's exact split and FlexMoE's even one, on uniform,
// Zipf 1.2 and Zipf 8 routing and a rank without tokens, the layer's output, input gradient and
// routing-weight gradient equal plain expert parallelism's bit for bit, and every replica's
// gradient equals the plain owner's (dyadic payloads: exact sums); FineMoE's split reaches the
// min-max bound, and no rank computes more rows than it.

#include "replicated_cases.hpp"

#include <moecomm/comm/inproc.hpp>

namespace test {

template <class Split>
void check_replicated_equals_plain(shadow_case const& c, moecomm::replica_placement const& placement) {
  CAPTURE(Split::name);
  CAPTURE(c.zipf);
  auto const in = make_shadow_inputs<float>(c);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) { check_replicated_on_rank<Split>(comm, c, in, placement); });
}

shadow_case const uniform{8, 4, 16, 2, 8, {64, 64, 64, 64, 64, 64, 64, 64}, 0.0, true};
shadow_case const zipf{8, 4, 16, 2, 8, {80, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};  // rank 2 has no tokens
shadow_case const extreme{8, 4, 16, 1, 8, {50, 50, 50, 50, 50, 50, 50, 50}, 8.0, true};

TEST_CASE("replicated experts: every placement and split equals plain expert parallelism bit for bit (8 ranks)") {
  std::vector<double> hot;
  for (std::int32_t e = 0; e < 16; ++e) hot.push_back(1.0 / std::pow(e + 1.0, 1.2));
  moecomm::replica_placement const placements[] = {
      moecomm::replica_placement::contiguous(16, 8),
      moecomm::replica_placement::cyclic(8, 4, 2),  // 16 experts, 2 replicas each
      moecomm::replica_placement::from_loads(8, 4, hot, 5),
  };
  for (moecomm::replica_placement const& p : placements)
    for (shadow_case const& c : {uniform, zipf, extreme}) {
      check_replicated_equals_plain<moecomm::finemoe_split>(c, p);
      check_replicated_equals_plain<moecomm::even_split>(c, p);
    }
}

}  // namespace test
