// SPDX-License-Identifier: Apache-2.0
// Fuzz target: validate_routing and make_permute_plan (unpadded and padded to a capacity, with the
// value scan, strict mode, or unchecked). Valid routings must give the oracle's row map exactly;
// bad ones (ids out of range, NaN weights, duplicates in strict mode, too small a capacity,
// negative or overflowing sizes, a null topk_idx) must be rejected with a moecomm::error.
//
// CTest runs 20000 runs with seed 1 (host.fuzz.plan). Long run, >= 10^6 runs (about 2 minutes):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=$RANDOM OMP_WAIT_POLICY=passive build/host/tests/fuzz/moecomm_fuzz_plan

#include "fuzz_driver.hpp"

#include <algorithm>

namespace {

using namespace fuzz;

// The oracle's row map with every expert block padded to `capacity` rows (semantics §9): expert
// e's rows move to [e C, e C + n_e), and the tail of each block is padding (token and slot -1).
oracle::row_map padded_map(oracle::row_map const& m, int32_t experts, int64_t capacity) {
  oracle::row_map p;
  p.token_of.assign(static_cast<std::size_t>(experts * capacity), -1);
  p.slot_of.assign(static_cast<std::size_t>(experts * capacity), -1);
  std::vector<int32_t> moved(static_cast<std::size_t>(m.rows()));
  for (int32_t e = 0; e <= experts; ++e) p.expert_offsets.push_back(static_cast<int32_t>(e * capacity));
  for (int32_t e = 0; e < experts; ++e)
    for (int32_t row = m.expert_offsets[static_cast<std::size_t>(e)]; row < m.expert_offsets[static_cast<std::size_t>(e) + 1];
         ++row) {
      auto const to = static_cast<std::size_t>(e * capacity + row - m.expert_offsets[static_cast<std::size_t>(e)]);
      moved[static_cast<std::size_t>(row)] = static_cast<int32_t>(to);
      p.token_of[to] = m.token_of[static_cast<std::size_t>(row)];
      p.slot_of[to] = m.slot_of[static_cast<std::size_t>(row)];
    }
  for (int32_t row : m.row_of) p.row_of.push_back(row < 0 ? -1 : moved[static_cast<std::size_t>(row)]);
  return p;
}

bool one_case(run& r) {
  auto const be = any_backend(r);
  int32_t experts = static_cast<int32_t>(1 + r.size(16, 299));
  int32_t const top_k = static_cast<int32_t>(r.uniform(1, std::min(experts, 8)));
  int64_t const tokens = r.size(64, 3000);
  moecomm::routing_checks const checks{r.chance(0.7), r.chance(0.2)};
  bool const hostile = r.chance(0.3);
  r.note("E=", experts, " K=", top_k, " T=", tokens, " scan=", checks.scan_values, " strict=", checks.reject_duplicates,
         " hostile=", hostile);
  routing_faults faults;
  auto const routing = random_routing(r, tokens, top_k, experts, hostile, faults);
  auto const m = oracle::permute_map(routing, experts);
  int64_t max_count = 0;
  for (int32_t e = 0; e < experts; ++e)
    max_count = std::max<int64_t>(max_count, m.expert_offsets[static_cast<std::size_t>(e) + 1] -
                                                 m.expert_offsets[static_cast<std::size_t>(e)]);
  int64_t capacity = r.chance(0.3) ? std::max<int64_t>(1, max_count + r.uniform(0, 3)) : 0;
  moecomm::routing_view view = view_of(routing, r.chance(0.9));

  // Why the call must be rejected: by the routing checks, or by the plan's own checks.
  std::string why_routing = scan_rejection(checks, faults, view.topk_weights != nullptr), why_plan;
  if (hostile && r.chance(0.5)) {
    switch (r.uniform(0, 3)) {
      case 0:
        experts = r.pick<int32_t>({0, -1, std::numeric_limits<int32_t>::min(), int32_max});
        (experts == int32_max ? why_plan : why_routing) = "num_experts = " + std::to_string(experts);
        break;
      case 1:
        capacity = r.pick<int64_t>({-1, std::numeric_limits<int64_t>::min(), int64_max, 1'000'000'000'000'000'000,
                                    int64_t{1} << 40, int64_t{int32_max} / experts + 1});
        why_plan = "padded_capacity = " + std::to_string(capacity);
        break;
      case 2:
        if (max_count >= 2) {
          capacity = max_count - 1;
          why_plan = "an expert with more slots than padded_capacity";
        }
        break;
      default:
        if (auto why = spoil_routing_shape(r, view, experts); !why.empty()) why_routing = why;
        break;
    }
  }
  r.note("C=", capacity, " E'=", experts, " T'=", view.num_tokens, " K'=", view.top_k);

  if (why_plan.empty() && r.chance(0.2)) {  // validate_routing on its own (it knows nothing of the plan's limits)
    auto const validate = [&] { moecomm::validate_routing(be, view, experts, checks); };
    if (!why_routing.empty()) {
      expect_rejected(validate, "moecomm::validate_routing:", why_routing);
      return false;
    }
    validate();
    return true;
  }
  auto const build = [&] { return moecomm::make_permute_plan(be, view, experts, checks, capacity); };
  if (!why_routing.empty() || !why_plan.empty()) {
    expect_rejected(build, "moecomm::make_permute_plan:", why_routing + why_plan);
    return false;
  }
  auto const plan = build();
  auto const want = capacity > 0 ? padded_map(m, experts, capacity) : m;
  expect(plan.num_rows() == want.rows(), moecomm::detail::concat("num_rows ", plan.num_rows(), ", oracle ", want.rows()));
  expect(host_copy(plan.row_of(), tokens * top_k) == want.row_of, "row_of differs from the oracle");
  expect(host_copy(plan.token_of(), want.rows()) == want.token_of, "token_of differs from the oracle");
  expect(host_copy(plan.slot_of(), want.rows()) == want.slot_of, "slot_of differs from the oracle");
  expect(host_copy(plan.expert_offsets(), int64_t{experts} + 1) == want.expert_offsets,
         "expert_offsets differ from the oracle");
  int64_t out_of_range = 0;
  for (int32_t e : routing.idx) out_of_range += (e < -1 || e >= experts) ? 1 : 0;
  expect(plan.num_invalid_slots() == (checks.scan_values ? 0 : out_of_range), "num_invalid_slots differs");
  return true;
}

}  // namespace

int main() { return fuzz::main_loop("fuzz_plan", 20000, one_case); }
