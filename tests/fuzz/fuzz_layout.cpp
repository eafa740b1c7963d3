// SPDX-License-Identifier: Apache-2.0
// Fuzz target: contiguous_placement and make_dispatch_layout (with and without nodes, checked and
// unchecked). Valid routings must give the oracle's counts and token-to-rank flags exactly (ids
// out of range count nowhere in unchecked mode); bad ids or NaN weights with the scan on, a bad
// placement (E % R != 0, non-positive sizes), a ranks_per_node that does not divide R, and
// negative, overflowing or null routing arguments must be rejected with a moecomm::error.
//
// CTest runs 10000 runs with seed 1 (host.fuzz.layout). Long run, >= 10^6 runs (about 1.5 minutes):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=$RANDOM OMP_WAIT_POLICY=passive build/host/tests/fuzz/moecomm_fuzz_layout

#include "fuzz_driver.hpp"

#include <algorithm>

namespace {

using namespace fuzz;

bool one_case(run& r) {
  auto const be = any_backend(r);
  int32_t ranks = static_cast<int32_t>(1 + r.size(8, 63));
  int32_t experts = ranks * static_cast<int32_t>(1 + r.size(4, 7));
  std::vector<int32_t> divisors;
  for (int32_t g = 1; g <= ranks; ++g)
    if (ranks % g == 0) divisors.push_back(g);
  int32_t ranks_per_node = divisors[static_cast<std::size_t>(r.uniform(0, static_cast<int64_t>(divisors.size()) - 1))];
  int32_t const top_k = static_cast<int32_t>(r.uniform(1, std::min(experts, 8)));
  int64_t const tokens = r.size(64, 3000);
  moecomm::routing_checks const checks{r.chance(0.7), r.chance(0.2)};
  bool const hostile = r.chance(0.3);
  bool const one_node = r.chance(0.3);  // the overload without ranks_per_node
  r.note("E=", experts, " R=", ranks, " G=", ranks_per_node, " one_node=", one_node, " K=", top_k, " T=", tokens,
         " scan=", checks.scan_values, " strict=", checks.reject_duplicates, " hostile=", hostile);
  routing_faults faults;
  auto const routing = random_routing(r, tokens, top_k, experts, hostile, faults);
  moecomm::routing_view view = view_of(routing, r.chance(0.9));

  std::string why_placement, why_layout = scan_rejection(checks, faults, view.topk_weights != nullptr);
  if (hostile && r.chance(0.5)) {
    switch (r.uniform(0, 2)) {
      case 0:
        if (ranks > 1 && r.chance(0.5)) {
          experts += 1;  // then E % R != 0
        } else {
          (r.chance(0.5) ? experts : ranks) = r.pick<int32_t>({0, -1, std::numeric_limits<int32_t>::min()});
        }
        why_placement = moecomm::detail::concat("E = ", experts, ", R = ", ranks);
        break;
      case 1:
        if (!one_node) {
          ranks_per_node = r.pick<int32_t>({0, -1, std::numeric_limits<int32_t>::min(), ranks + 1});
          why_layout = "ranks_per_node = " + std::to_string(ranks_per_node);
        }
        break;
      default:
        if (auto why = spoil_routing_shape(r, view, experts); !why.empty()) why_layout = why;
        break;
    }
  }
  r.note("E'=", experts, " R'=", ranks, " G'=", ranks_per_node, " T'=", view.num_tokens, " K'=", view.top_k);
  if (!why_placement.empty()) {
    expect_rejected([&] { moecomm::contiguous_placement(experts, ranks); }, "moecomm::contiguous_placement:",
                    why_placement);
    return false;
  }
  moecomm::contiguous_placement const placement(experts, ranks);
  auto const build = [&] {
    return one_node ? moecomm::make_dispatch_layout(be, view, placement, checks)
                    : moecomm::make_dispatch_layout(be, view, placement, ranks_per_node, checks);
  };
  if (!why_layout.empty()) {
    expect_rejected(build, "moecomm::make_dispatch_layout:", why_layout);
    return false;
  }
  auto const layout = build();
  auto const want = oracle::dispatch_layout(routing, experts, ranks, one_node ? ranks : ranks_per_node);
  expect(layout.num_nodes() == static_cast<int32_t>(want.tokens_per_node.size()), "num_nodes differs");
  expect(host_copy(layout.tokens_per_expert(), experts) == want.tokens_per_expert, "tokens_per_expert differs");
  expect(host_copy(layout.tokens_per_rank(), ranks) == want.tokens_per_rank, "tokens_per_rank differs");
  expect(host_copy(layout.tokens_per_node(), layout.num_nodes()) == want.tokens_per_node, "tokens_per_node differs");
  expect(host_copy(layout.slots_per_rank(), ranks) == want.slots_per_rank, "slots_per_rank differs");
  bool const* flags = layout.is_token_in_rank();
  expect(std::vector<bool>(flags, flags + tokens * ranks) == want.is_token_in_rank, "is_token_in_rank differs");
  return true;
}

}  // namespace

int main() { return fuzz::main_loop("fuzz_layout", 10000, one_case); }
