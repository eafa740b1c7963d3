// SPDX-License-Identifier: Apache-2.0
#pragma once
// HybridEP's per-rank check, shared by the in-process (hybridep_test.cpp) and MPI tests.

#include "shadow_cases.hpp"

#include <moecomm/patterns/hybridep.hpp>

namespace test {

struct hybridep_case {
  shadow_case layer;
  std::int32_t nodes_per_domain;
};

// One rank: HybridEP against plain EP on the same inputs, and its pair counts (the file comment of
// hybridep_test.cpp). Any communicator; `in` the same on every rank.
template <class Capacity, class Comm>
void check_hybridep_on_rank(Comm& comm, hybridep_case const& h, shadow_inputs<float> const& in, moecomm::hybridep policy,
                            bool background, Capacity const& capacity) {
  using comm_t = Comm;
  shadow_case const& c = h.layer;
  std::int32_t const expert_domain = policy.expert_domain;
  bool const across = policy.spread == moecomm::expert_domain_spread::across_data_centres;
  {
    moecomm::topology const topo(c.ranks, c.per_node, h.nodes_per_domain);
    moecomm::exchange_groups<comm_t> groups(comm, topo);
    std::int32_t const me = comm.rank(), R = c.ranks, S = expert_domain;
    moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t, Capacity> plain(moecomm::host_backend{}, groups, c.experts, c.hidden, capacity);
    auto const want = run_step(plain, me, c, in);

    moecomm::hybridep_layer<float, moecomm::host_backend, comm_t, Capacity> layer(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                                                   policy, capacity);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    scale_bias_experts<float> experts(me, c.experts / R, c.hidden, c.exact);
    layer_result<float> got{poisoned<float>(r.tokens * c.hidden), poisoned<float>(r.tokens * c.hidden),
                            poisoned<float>(r.tokens * r.top_k), {}};
    if (background) layer.begin_expert_gather(experts);
    layer.forward(view, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.out.data(), r.tokens, c.hidden},
                  experts);
    moecomm::hybridep_report const forward = layer.report();
    layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.d_x.data(), r.tokens, c.hidden},
                   got.d_w, experts);
    got.grads = experts.grads;
    check_same_result(got, want, me, c);
    CHECK(layer.dispatch_state().report().dropped_slots == plain.dispatch_state().report().dropped_slots);

    // Pair counts: the dispatch and the combine each message every same-offset peer once (the
    // routing is uniform and dense enough to reach every expert from every rank), the gather
    // every expert-domain peer once, and the backward adds one reduce-scatter to the same peers.
    CHECK(forward.expert_domain == S);
    CHECK(forward.gathered_experts == std::int64_t{S} * (c.experts / R));
    CHECK(forward.exchange.messages() == 2 * (R / S - 1));
    CHECK(forward.expert_gather.messages() == S - 1);
    CHECK(layer.report().expert_gather.messages() == 2 * (S - 1));
    // A second step counts its own messages, not the first step's too.
    if (background) layer.begin_expert_gather(experts);
    layer.forward(view, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {got.out.data(), r.tokens, c.hidden},
                  experts);
    CHECK(layer.report().expert_gather.messages() == S - 1);
    CHECK(layer.report().exchange.messages() == 2 * (R / S - 1));
    std::int32_t const D = topo.num_domains();
    if (!across) {
      CHECK(forward.expert_gather.inter_domain_messages == 0);  // parameters stay in their data centre
      if (S == topo.ranks_per_domain())                          // its experts are all here: tokens only leave it
        CHECK(forward.exchange.intra_messages + forward.exchange.inter_messages == 0);
    } else if (S % D == 0) {  // an expert domain spans every data centre: tokens stay in theirs
      CHECK(forward.exchange.inter_domain_messages == 0);
      CHECK(forward.expert_gather.inter_domain_messages == (D - 1) * (S / D));
    }
    CHECK(layer.same_offset().size() == R / S);
    CHECK(layer.expert_domain().size() == S);
  }
}

}  // namespace test
