// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test bodies for the dispatch layout.

#include "../support/test_support.hpp"

namespace test {

template <class Backend>
void check_layout(Backend const& be, moecomm::dispatch_layout<Backend> const& got, oracle::layout const& want) {
  CHECK(download(be, got.tokens_per_expert(), got.num_experts()) == want.tokens_per_expert);
  CHECK(download(be, got.tokens_per_rank(), got.num_ranks()) == want.tokens_per_rank);
  CHECK(download(be, got.tokens_per_node(), got.num_nodes()) == want.tokens_per_node);
  CHECK(download(be, got.slots_per_rank(), got.num_ranks()) == want.slots_per_rank);
  CHECK(download_flags(be, got.is_token_in_rank(), got.num_tokens() * got.num_ranks()) == want.is_token_in_rank);
}

TEST_CASE_TEMPLATE_DEFINE("dispatch layout equals the oracle", Config, layout_sweep) {
  auto const be = Config::make_backend();
  struct shape { int32_t experts, ranks, ranks_per_node; };
  for (shape const s : {shape{1, 1, 1}, shape{7, 7, 7}, shape{16, 4, 2}, shape{16, 8, 4}, shape{16, 16, 1}})
    for (int64_t tokens : {0, 1, 7, 2039})
      for (int32_t top_k : {1, 2, 8}) {
        if (top_k > s.experts) continue;
        routing_spec const spec{tokens, top_k, s.experts, 0.2, true, 0.8, static_cast<std::uint32_t>(tokens + top_k)};
        CAPTURE(describe(spec));
        CAPTURE(s.ranks);
        CAPTURE(s.ranks_per_node);
        auto const r = make_routing(spec);
        device_routing<typename Config::backend> const routing(be, r);
        auto const layout = moecomm::make_dispatch_layout(be, routing.view, moecomm::contiguous_placement(s.experts, s.ranks),
                                                          s.ranks_per_node);
        check_layout(be, layout, oracle::dispatch_layout(r, s.experts, s.ranks, s.ranks_per_node));
      }
}

TEST_CASE_TEMPLATE_DEFINE("dispatch layout reproduces semantics example L1", Config, layout_example) {
  auto const be = Config::make_backend();
  oracle::routing r{{0, 1, 3, -1, 2, 0, 1, 3}, {1, 1, 1, 1, 1, 1, 1, 1}, 4, 2};
  device_routing<typename Config::backend> const routing(be, r);
  auto const layout = moecomm::make_dispatch_layout(be, routing.view, moecomm::contiguous_placement(4, 2));
  // Literal values from reference/semantics.md §3, Example L1.
  oracle::layout want{{2, 2, 1, 2}, {3, 3}, {4}, {4, 3}, {true, false, false, true, true, true, true, true}};
  check_layout(be, layout, want);
}

}  // namespace test
