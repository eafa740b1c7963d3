// SPDX-License-Identifier: Apache-2.0
// Fuzz target: permute, unpermute (weighted and unweighted), permute_backward and
// unpermute_backward on random plans (masked slots, duplicates, and out-of-range ids in
// unchecked mode, which count as masked). Valid calls must equal the oracle bit for bit (the
// weight gradient within fp32 tolerance) and leave rows past the result poisoned; calls with a
// buffer one row short, a null buffer, overlapping buffers, mismatched or overflowing row widths,
// or missing weights must be rejected with a moecomm::error and write nothing.
//
// CTest runs 10000 runs with seed 1 (host.fuzz.permute). Long run, >= 10^6 runs (about 5 minutes):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=$RANDOM OMP_WAIT_POLICY=passive build/host/tests/fuzz/moecomm_fuzz_permute

#include "fuzz_driver.hpp"

#include <algorithm>
#include <cmath>

namespace {

using namespace fuzz;
using moecomm::matrix_view;

bool one_case(run& r) {
  auto const be = any_backend(r);
  int32_t const experts = static_cast<int32_t>(1 + r.size(16, 299));
  int32_t const top_k = static_cast<int32_t>(r.uniform(1, std::min(experts, 8)));
  int64_t const tokens = r.size(32, 3000);
  int64_t const hidden = r.chance(0.02) ? 0 : r.uniform(1, 70);
  bool const bad_ids = r.chance(0.2);  // out-of-range ids, accepted by an unchecked plan as masked
  r.note("E=", experts, " K=", top_k, " T=", tokens, " H=", hidden, " bad_ids=", bad_ids);
  routing_faults faults;
  auto const routing = random_routing(r, tokens, top_k, experts, bad_ids, faults);
  bool const with_weights = r.chance(0.9);
  auto const plan = moecomm::make_permute_plan(be, view_of(routing, with_weights), experts,
                                               bad_ids ? moecomm::unchecked_routing : moecomm::routing_checks{});
  auto const map = oracle::permute_map(routing, experts);
  int64_t const rows = map.rows(), slots = tokens * top_k;

  int const op = static_cast<int>(r.uniform(0, 4));
  fault const f = random_fault(r);
  bool const weighted = r.chance(0.5);  // for the unpermute family
  char const* const op_names[] = {"permute", "permute+weights", "unpermute", "permute_backward", "unpermute_backward"};
  r.note("op=", op_names[op], " weights=", with_weights, " weighted=", weighted);
  bool const needs_weights = tokens > 0 && !with_weights;
  std::vector<float> weights_out(static_cast<std::size_t>(std::max(rows, slots) + 2), poison());
  std::vector<float> const d_permuted_w = finite_values(r, rows);
  bool const want_dw = r.chance(0.5);

  if (op == 0 || op == 1) {  // permute: x [T] -> out [P], optionally the permuted weights [P]
    auto m = make_matrices(r, f, tokens, rows, hidden);
    float* const out_w = op == 1 ? weights_out.data() : nullptr;
    bool const short_w = out_w != nullptr && rows > 0 && r.chance(0.1);  // a view one element short
    moecomm::array_view<float> const out_w_view{out_w, short_w ? rows - 1 : static_cast<int64_t>(weights_out.size())};
    if (m.why.empty() && out_w != nullptr && needs_weights) m.why = "out_weights without routing weights";
    if (m.why.empty() && short_w) m.why = "out_weights one element short";
    auto const call = [&] {
      if (out_w != nullptr) moecomm::permute(be, plan, m.in_view, m.out_view, out_w_view);
      else moecomm::permute(be, plan, m.in_view, m.out_view);
    };
    if (!m.why.empty()) return rejected(call, "moecomm::permute:", m, weights_out);
    call();
    expect_bitwise(m.out, oracle::permute(rows_of(m.in_view), hidden, map), "permute");
    expect_untouched(m.out, static_cast<std::size_t>(rows * hidden), "permute past P");
    if (out_w != nullptr) {
      std::vector<float> want;
      for (int64_t row = 0; row < rows; ++row)
        want.push_back(routing.weight(map.token_of[static_cast<std::size_t>(row)], map.slot_of[static_cast<std::size_t>(row)]));
      expect_bitwise(weights_out, want, "permuted weights");
      expect_untouched(weights_out, static_cast<std::size_t>(rows), "permuted weights past P");
    }
    return true;
  }
  if (op == 2) {  // unpermute: y [P] -> out [T]
    auto m = make_matrices(r, f, rows, tokens, hidden);
    if (m.why.empty() && weighted && needs_weights) m.why = "a weighted combine without routing weights";
    auto const call = [&] {
      if (weighted) moecomm::unpermute<moecomm::weighted>(be, plan, m.in_view, m.out_view);
      else moecomm::unpermute<moecomm::unweighted>(be, plan, m.in_view, m.out_view);
    };
    if (!m.why.empty()) return rejected(call, "moecomm::unpermute:", m, weights_out);
    call();
    expect_bitwise(m.out, oracle::unpermute(rows_of(m.in_view), hidden, routing, map, weighted), "unpermute");
    expect_untouched(m.out, static_cast<std::size_t>(tokens * hidden), "unpermute past T");
    return true;
  }
  if (op == 3) {  // permute_backward: d_out [P] -> d_x [T], optionally d_weights [T K] from d_out_weights [P]
    auto m = make_matrices(r, f, rows, tokens, hidden);
    bool const drop_dpw = want_dw && r.chance(0.2);
    float const* const dpw = want_dw && !drop_dpw ? d_permuted_w.data() : nullptr;
    float* const dw = want_dw ? weights_out.data() : nullptr;
    bool const short_dw = want_dw && slots > 0 && r.chance(0.1);  // a view one element short
    moecomm::array_view<float const> const dpw_view{dpw, dpw != nullptr ? rows : 0};
    moecomm::array_view<float> const dw_view{dw, short_dw ? slots - 1 : static_cast<int64_t>(weights_out.size())};
    if (m.why.empty() && drop_dpw && rows > 0) m.why = "d_weights without d_out_weights";
    if (m.why.empty() && short_dw) m.why = "d_weights one element short";
    auto const call = [&] {
      if (dw != nullptr) moecomm::permute_backward(be, plan, m.in_view, dpw_view, m.out_view, dw_view);
      else moecomm::permute_backward(be, plan, m.in_view, m.out_view);
    };
    if (!m.why.empty()) return rejected(call, "moecomm::permute_backward:", m, weights_out);
    call();
    expect_bitwise(m.out, oracle::unpermute(rows_of(m.in_view), hidden, routing, map, false), "permute_backward d_x");
    if (dw != nullptr) {
      std::vector<float> want;
      for (int32_t row : map.row_of) want.push_back(row < 0 ? 0.0f : d_permuted_w[static_cast<std::size_t>(row)]);
      expect_bitwise(weights_out, want, "permute_backward d_weights");
      expect_untouched(weights_out, static_cast<std::size_t>(slots), "d_weights past T K");
    }
    return true;
  }
  // unpermute_backward: d_out [T] -> d_y [P]; weighted, optionally d_weights [T K] from the forward's y [P]
  auto m = make_matrices(r, f, tokens, rows, hidden);
  auto const y = finite_values(r, rows * hidden);
  bool const dw_wanted = want_dw && weighted;  // an unweighted combine has no weight-gradient overload
  float* const dw = dw_wanted ? weights_out.data() : nullptr;
  bool const short_dw = dw_wanted && slots > 0 && r.chance(0.1);  // a view one element short
  matrix_view<float const> const y_view{dw_wanted ? y.data() : nullptr, dw_wanted ? rows : 0, hidden};
  moecomm::array_view<float> const dw_view{dw, short_dw ? slots - 1 : static_cast<int64_t>(weights_out.size())};
  if (m.why.empty() && weighted && needs_weights) m.why = "a weighted gradient without routing weights";
  if (m.why.empty() && short_dw) m.why = "d_weights one element short";
  auto const call = [&] {
    if (dw != nullptr) moecomm::unpermute_backward(be, plan, m.in_view, y_view, m.out_view, dw_view);
    else if (weighted) moecomm::unpermute_backward<moecomm::weighted>(be, plan, m.in_view, m.out_view);
    else moecomm::unpermute_backward<moecomm::unweighted>(be, plan, m.in_view, m.out_view);
  };
  if (!m.why.empty()) return rejected(call, "moecomm::unpermute_backward:", m, weights_out);
  call();
  expect_bitwise(m.out, oracle::unpermute_backward(rows_of(m.in_view), hidden, routing, map, weighted),
                 "unpermute_backward d_y");
  expect_untouched(m.out, static_cast<std::size_t>(rows * hidden), "d_y past P");
  if (dw != nullptr) {
    auto const want = oracle::weight_grad(y, rows_of(m.in_view), hidden, routing, map);
    for (std::size_t i = 0; i < want.size(); ++i)
      if (!(std::fabs(weights_out[i] - want[i]) <= 1e-5f * std::fabs(want[i]) + 1e-6f * static_cast<float>(hidden)))
        throw mismatch(moecomm::detail::concat("unpermute_backward d_weights[", i, "] = ", weights_out[i], ", oracle ",
                                               want[i]));
    expect_untouched(weights_out, want.size(), "d_weights past T K");
  }
  return true;
}

}  // namespace

int main() { return fuzz::main_loop("fuzz_permute", 10000, one_case); }
