// SPDX-License-Identifier: Apache-2.0
// Fuzz target: expert_capacity and drop_to_capacity, the capacity step on one rank. Valid calls
// (any factor >= 0, min_capacity >= 0; every rule; masked, duplicate and tied slots) must keep
// exactly the oracle's slots (oracle::capacity, oracle::drop_to_capacity) and report the kept and
// dropped counts; NaN, infinite or negative factors, negative minima, overflowing capacities,
// a negative C, a kept_topk_idx one element short, and drop_by_probability without weights must be
// rejected with a moecomm::error before anything is written.
//
// CTest runs 10000 runs with seed 1 (host.fuzz.capacity). Long run, >= 10^6 runs (about 3.5 minutes):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=$RANDOM OMP_WAIT_POLICY=passive build/host/tests/fuzz/moecomm_fuzz_capacity

#include "fuzz_driver.hpp"

#include <moecomm/rows/capacity.hpp>

#include <cmath>

namespace {

using namespace fuzz;

bool one_case(run& r) {
  auto const be = any_backend(r);
  int32_t const experts = static_cast<int32_t>(r.uniform(1, 64));
  int32_t const top_k = static_cast<int32_t>(r.uniform(1, std::min(experts, 8)));
  int64_t const tokens = r.size(64, 2000);
  routing_faults faults;  // valid ids only: the scan's rejections are fuzz_plan's
  auto routing = random_routing(r, tokens, top_k, experts, false, faults);
  if (r.chance(0.3))  // ties: few distinct weights
    for (float& w : routing.w) w = std::isnan(w) ? w : std::round(w * 4.0f) / 4.0f;
  moecomm::routing_view const view = view_of(routing, r.chance(0.9));
  int const rule = static_cast<int>(r.uniform(0, 2));
  double factor = r.pick({0.0, 0.25, 0.5, 1.0, 1.25, 2.0, 8.0});
  int64_t min_capacity = r.pick<int64_t>({0, 0, 1, 3, 100});
  std::string why;
  if (r.chance(0.1)) {
    switch (r.uniform(0, 2)) {
      case 0: factor = r.pick({std::nan(""), HUGE_VAL, -HUGE_VAL, -1.0}); why = "factor " + std::to_string(factor); break;
      case 1: min_capacity = r.pick<int64_t>({-1, std::numeric_limits<int64_t>::min()}); why = "negative min_capacity"; break;
      default: factor = 1e30; why = "a capacity beyond int64"; break;
    }
  }
  r.note("E=", experts, " K=", top_k, " T=", tokens, " rule=", rule, " factor=", factor, " min=", min_capacity,
         " weights=", view.topk_weights != nullptr);
  if (!why.empty()) {
    if (why == "a capacity beyond int64" && tokens == 0) return true;  // 0 tokens: C = 0 whatever the factor
    expect_rejected([&] { (void)moecomm::expert_capacity(tokens, top_k, experts, factor, min_capacity); },
                    "moecomm::expert_capacity:", why);
    return false;
  }
  int64_t const c = moecomm::expert_capacity(tokens, top_k, experts, factor, min_capacity);
  expect(c == std::max(oracle::capacity(tokens, top_k, experts, factor), min_capacity), "expert_capacity differs");

  auto const plan = moecomm::make_permute_plan(be, view, experts);
  int64_t const slots = tokens * top_k;
  bool const short_out = slots > 0 && r.chance(0.05);
  std::vector<int32_t> kept(static_cast<std::size_t>(slots + 1), 12345);
  moecomm::array_view<int32_t> const kept_view{kept.data(), short_out ? slots - 1 : slots};
  int64_t const capacity = r.chance(0.05) ? -1 : c;
  std::uint64_t const seed = r.rng();
  int64_t const first_token = r.uniform(0, 1 << 20);
  moecomm::workspace<moecomm::host_backend> scratch;
  auto const call = [&] {
    if (rule == 0) return moecomm::drop_to_capacity(be, plan, capacity, kept_view, scratch, moecomm::drop_by_position{});
    if (rule == 1) return moecomm::drop_to_capacity(be, plan, capacity, kept_view, scratch, moecomm::drop_by_probability{});
    return moecomm::drop_to_capacity(be, plan, capacity, kept_view, scratch, moecomm::drop_random{seed, 3}, first_token);
  };
  std::string const bad = short_out ? "kept_topk_idx one element short"
                          : capacity < 0 ? "a negative capacity"
                          : rule == 1 && tokens > 0 && view.topk_weights == nullptr ? "drop_by_probability without weights"
                                                                                    : "";
  if (!bad.empty()) {
    expect_rejected(call, "moecomm::drop_to_capacity:", bad);
    expect(std::all_of(kept.begin(), kept.end(), [](int32_t v) { return v == 12345; }), "written before the error");
    return false;
  }
  moecomm::capacity_result const result = call();
  oracle::drop_rule const rules[] = {oracle::drop_rule::position, oracle::drop_rule::probability, oracle::drop_rule::random};
  auto const want = oracle::drop_to_capacity(routing, experts, c, rules[rule], seed, 3, first_token);
  kept.resize(static_cast<std::size_t>(slots));
  expect(kept == want.idx, "kept_topk_idx differs from the oracle");
  int64_t valid = 0, survivors = 0;
  for (std::size_t i = 0; i < want.idx.size(); ++i) {
    valid += routing.idx[i] >= 0 ? 1 : 0;
    survivors += want.idx[i] >= 0 ? 1 : 0;
  }
  expect(result.kept_slots == survivors && result.dropped_slots == valid - survivors, "kept/dropped counts differ");
  return true;
}

}  // namespace

int main() { return fuzz::main_loop("fuzz_capacity", 10000, one_case); }
