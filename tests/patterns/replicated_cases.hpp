// SPDX-License-Identifier: Apache-2.0
#pragma once
// Replicated experts' per-rank check, shared by the in-process (replicated_experts_test.cpp), MPI
// and simulated tests: plain expert parallelism first, then the replicated layer on the same
// inputs, compared bit for bit, every replica's gradient against the plain owner's.

#include "shadow_cases.hpp"

#include <moecomm/patterns/replicated_experts.hpp>

#include <algorithm>
#include <cmath>

namespace test {

// scale_bias_experts whose slot l holds the parameters of expert `placement.expert_at(rank, l)`.
inline scale_bias_experts<float> slot_experts(moecomm::replica_placement const& p, std::int32_t rank, std::int64_t hidden) {
  scale_bias_experts<float> experts(rank, p.slots_per_rank(), hidden, true);
  for (std::int32_t l = 0; l < p.slots_per_rank(); ++l) {
    std::int32_t const e = std::max(p.expert_at(rank, l), 0);
    for (std::int64_t i = 0; i < 2 * hidden; ++i)
      experts.params[static_cast<std::size_t>(l * 2 * hidden + i)] = parameter_value(e, i, true);
  }
  return experts;
}

// One forward and backward of `layer` on rank `me`'s inputs, into NaN-poisoned outputs.
template <class Layer, class Experts>
layer_result<float> replicated_step(Layer& layer, std::int32_t me, shadow_case const& c, shadow_inputs<float> const& in, Experts& experts) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  layer_result<float> got{poisoned<float>(r.tokens * c.hidden), poisoned<float>(r.tokens * c.hidden),
                          poisoned<float>(r.tokens * r.top_k), {}};
  layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden},
                {got.out.data(), r.tokens, c.hidden}, experts);
  layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.d_x.data(), r.tokens, c.hidden},
                 got.d_w, experts);
  return got;
}

// One rank of any world: plain EP, then the replicated layer with `Split` on `placement` (its slots
// exchanged with `Algorithm`; a deduplicated one regroups sums, exact on these dyadic payloads), on
// nodes grouped in domains of `nodes_per_domain` (0: one domain).
template <class Split, class Comm, class Backend = moecomm::host_backend, class Algorithm = moecomm::flat>
void check_replicated_on_rank(Comm& comm, shadow_case const& c, shadow_inputs<float> const& in,
                              moecomm::replica_placement const& placement, Backend const& be = Backend{},
                              Algorithm const& algorithm = {}, std::int32_t nodes_per_domain = 0) {
  std::int32_t const me = comm.rank(), E = c.experts, L = E / c.ranks, R = c.ranks;
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node, nodes_per_domain));
  moecomm::expert_parallel_layer<float, Backend, Comm> plain(be, groups, E, c.hidden);
  layer_result<float> const want = run_step(plain, me, c, in);
  // Every rank's plain gradients and rows, to find each replica's owner's.
  std::int64_t const n = static_cast<std::int64_t>(want.grads.size());
  std::vector<float> owners(static_cast<std::size_t>(n * R));
  comm.allgather(want.grads.data(), owners.data(), n * std::int64_t(sizeof(float)));
  std::int64_t const rows = plain.dispatch_state().received_rows();
  std::vector<std::int64_t> plain_rows(static_cast<std::size_t>(R));
  comm.allgather(&rows, plain_rows.data(), sizeof rows);
  std::int64_t const plain_busiest = *std::max_element(plain_rows.begin(), plain_rows.end());

  moecomm::replicated_expert_layer<float, Backend, Comm, Split, moecomm::weighted, moecomm::static_placement, Algorithm> layer(
      be, groups, placement, c.hidden, {}, {}, {}, moecomm::replica_gradients::summed_here, algorithm);
  auto experts = slot_experts(placement, me, c.hidden);
  layer_result<float> const got = replicated_step(layer, me, c, in, experts);
  CAPTURE(me);
  check_bitwise(got.out, want.out, c.hidden, "replicated layer output vs plain");
  check_bitwise(got.d_x, want.d_x, c.hidden, "replicated input gradient vs plain");
  check_bitwise(got.d_w, want.d_w, 1, "replicated routing-weight gradient vs plain");
  for (std::int32_t l = 0; l < placement.slots_per_rank(); ++l) {  // each replica: its expert's whole gradient
    std::int32_t const e = placement.expert_at(me, l);
    if (e < 0) continue;
    auto const owner = owners.begin() + (e / L) * n + (e % L) * 2 * c.hidden;
    std::vector<float> const expected(owner, owner + 2 * c.hidden);
    std::vector<float> const slot(experts.grads.begin() + l * 2 * c.hidden, experts.grads.begin() + (l + 1) * 2 * c.hidden);
    CAPTURE(l);
    CAPTURE(e);
    check_bitwise(slot, expected, 2 * c.hidden, "replica gradient vs plain owner's");
  }
  // The rows that arrived are the ones the assignment gave this rank: the relabel follows the split.
  auto const& report = layer.report();
  CHECK(layer.dispatch_state().received_rows() == report.rank_rows[static_cast<std::size_t>(me)]);
  std::int64_t busiest = 0;
  for (std::int64_t rows_of_rank : report.rank_rows) busiest = std::max(busiest, rows_of_rank);
  CHECK(report.busiest_rank_rows == busiest);
  if constexpr (std::is_same_v<Split, moecomm::finemoe_split>) CHECK(busiest <= plain_busiest);
  if constexpr (std::is_same_v<Split, moecomm::domain_split>) CHECK(report.exchange.inter_domain_bytes == 0);  // tokens stay home
}

// An optimizer state whose slot l holds its expert's identity values (`state_value(e, i)`).
struct identity_state {
  std::int64_t count;
  std::vector<float> values;
  [[nodiscard]] std::int64_t state_count() const { return count; }
  float* state(std::int32_t l) { return values.data() + l * count; }
};
inline float state_value(std::int32_t e, std::int64_t i) { return parameter_value(e, i + 1000, true); }

// One rank of any world: the replicated layer on `from`, one step, its replicas moved to `to`
// (parameters and an optimizer state), another step; both steps equal plain EP's bit for bit, and
// after the move every slot holds its expert's parameters and state.
template <class Comm, class Backend = moecomm::host_backend>
void check_moved_replicas_on_rank(Comm& comm, shadow_case const& c, shadow_inputs<float> const& in, moecomm::replica_placement const& from,
                                  moecomm::replica_placement const& to, Backend const& be = Backend{}) {
  std::int32_t const me = comm.rank();
  std::int64_t const n = 2 * c.hidden;
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node));
  moecomm::expert_parallel_layer<float, Backend, Comm> plain(be, groups, c.experts, c.hidden);
  layer_result<float> const want = run_step(plain, me, c, in);
  moecomm::replicated_expert_layer<float, Backend, Comm> layer(be, groups, from, c.hidden);
  auto experts = slot_experts(from, me, c.hidden);
  identity_state state{n, std::vector<float>(static_cast<std::size_t>(from.slots_per_rank() * n))};
  for (std::int32_t l = 0; l < from.slots_per_rank(); ++l)
    for (std::int64_t i = 0; i < n; ++i) state.state(l)[i] = state_value(std::max(from.expert_at(me, l), 0), i);
  for (int step = 0; step < 2; ++step) {
    CAPTURE(me);
    CAPTURE(step);
    if (step == 1) {
      (void)layer.move_replicas(to, experts, state);
      for (std::int32_t l = 0; l < to.slots_per_rank(); ++l) {
        std::int32_t const e = to.expert_at(me, l);
        if (e < 0) continue;
        for (std::int64_t i = 0; i < n; ++i) {
          REQUIRE(experts.parameters(l)[i] == parameter_value(e, i, true));
          REQUIRE(state.state(l)[i] == state_value(e, i));
        }
      }
    }
    layer_result<float> const got = replicated_step(layer, me, c, in, experts);
    check_bitwise(got.out, want.out, c.hidden, "replicated output vs plain, before and after the move");
    check_bitwise(got.d_x, want.d_x, c.hidden, "replicated input gradient vs plain, before and after the move");
  }
}

}  // namespace test
