// SPDX-License-Identifier: Apache-2.0
// Replicated experts (patterns/replicated_experts.hpp) over 8 in-process ranks: for contiguous,
// cyclic and load-aware placements, with FineMoE's exact split and FlexMoE's even one, on uniform,
// Zipf 1.2 and Zipf 8 routing and a rank without tokens, the layer's output, input gradient and
// routing-weight gradient equal plain expert parallelism's bit for bit, and every replica's
// gradient equals the plain owner's (dyadic payloads: exact sums); FineMoE's split reaches the
// min-max bound, and no rank computes more rows than it.

#include "shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/replicated_experts.hpp>

namespace test {

// scale_bias_experts whose slot l holds the parameters of expert `placement.expert_at(rank, l)`.
scale_bias_experts<float> slot_experts(moecomm::replica_placement const& p, std::int32_t rank, std::int64_t hidden) {
  scale_bias_experts<float> experts(rank, p.slots_per_rank(), hidden, true);
  for (std::int32_t l = 0; l < p.slots_per_rank(); ++l) {
    std::int32_t const e = std::max(p.expert_at(rank, l), 0);
    for (std::int64_t i = 0; i < 2 * hidden; ++i)
      experts.params[static_cast<std::size_t>(l * 2 * hidden + i)] = parameter_value(e, i, true);
  }
  return experts;
}

template <class Split>
void check_replicated_equals_plain(shadow_case const& c, moecomm::replica_placement const& placement) {
  CAPTURE(Split::name);
  CAPTURE(c.zipf);
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  std::int32_t const E = c.experts, L = E / c.ranks;
  std::vector<std::vector<float>> plain_grads(static_cast<std::size_t>(c.ranks));
  std::vector<layer_result<float>> want(static_cast<std::size_t>(c.ranks));
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(60));
  std::vector<std::int64_t> plain_rows(static_cast<std::size_t>(c.ranks));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(c.ranks, c.per_node));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t> plain(moecomm::host_backend{}, groups, E, c.hidden);
    want[static_cast<std::size_t>(comm.rank())] = run_step(plain, comm.rank(), c, in);
    plain_rows[static_cast<std::size_t>(comm.rank())] = plain.dispatch_state().received_rows();
  });
  std::int64_t const plain_busiest = *std::max_element(plain_rows.begin(), plain_rows.end());
  world.run([&](comm_t comm) {
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(c.ranks, c.per_node));
    moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t, Split> layer(moecomm::host_backend{}, groups, placement,
                                                                                       c.hidden);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    auto experts = slot_experts(placement, me, c.hidden);
    layer_result<float> got{poisoned<float>(r.tokens * c.hidden), poisoned<float>(r.tokens * c.hidden),
                            poisoned<float>(r.tokens * r.top_k), {}};
    layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden},
                  {got.out.data(), r.tokens, c.hidden}, experts);
    layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.d_x.data(), r.tokens, c.hidden},
                   got.d_w, experts);
    layer_result<float> const& w = want[static_cast<std::size_t>(me)];
    CAPTURE(me);
    check_bitwise(got.out, w.out, c.hidden, "replicated layer output vs plain");
    check_bitwise(got.d_x, w.d_x, c.hidden, "replicated input gradient vs plain");
    check_bitwise(got.d_w, w.d_w, 1, "replicated routing-weight gradient vs plain");
    for (std::int32_t l = 0; l < placement.slots_per_rank(); ++l) {  // each replica: its expert's whole gradient
      std::int32_t const e = placement.expert_at(me, l);
      if (e < 0) continue;
      auto const& owner = want[static_cast<std::size_t>(e / L)].grads;
      std::vector<float> const expected(owner.begin() + (e % L) * 2 * c.hidden, owner.begin() + (e % L + 1) * 2 * c.hidden);
      std::vector<float> const slot(experts.grads.begin() + l * 2 * c.hidden, experts.grads.begin() + (l + 1) * 2 * c.hidden);
      CAPTURE(l);
      CAPTURE(e);
      check_bitwise(slot, expected, 2 * c.hidden, "replica gradient vs plain owner's");
    }
    // The rows that arrived are the ones the assignment gave this rank: the relabel follows the split.
    auto const& report = layer.report();
    CHECK(layer.dispatch_state().received_rows() == report.rank_rows[static_cast<std::size_t>(me)]);
    std::int64_t busiest = 0;
    for (std::int64_t rows : report.rank_rows) busiest = std::max(busiest, rows);
    CHECK(report.busiest_rank_rows == busiest);
    if constexpr (std::is_same_v<Split, moecomm::finemoe_split>) CHECK(busiest <= plain_busiest);
  });
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
