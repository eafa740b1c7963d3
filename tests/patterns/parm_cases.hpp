// SPDX-License-Identifier: Apache-2.0
#pragma once
// Bodies of the Parm layer tests, generic over the communicator and back-end (in-process and
// simulated ranks run the same checks).
//
// Every MP group holds its own tokens and routing (the same on each of its ranks); experts are
// test MLPs sliced over the ESP group. The oracle is single-process and unsliced: each slot's row
// through its whole expert, combined in slot order (oracle.hpp); the parameter gradient of every
// expert over every token of its data-parallel replica that reaches it. Values are dyadic, so every
// sum is exact and the comparisons are bit for bit.

#include "../support/oracle.hpp"
#include "../support/sliced_mlp.hpp"
#include "../support/test_support.hpp"
#include "shadow_cases.hpp"

#include <moecomm/patterns/parm.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace test {

struct parm_case {
  moecomm::parallel_sizes sizes;
  std::int64_t tokens = 37;
  std::int32_t experts = 8, top_k = 2;
  double capacity_factor = 0;  // 0: dropless
};

// The routing and rows of MP group `group` (every rank of the group builds the same).
inline oracle::routing parm_routing(std::int32_t group, parm_case const& c) {
  oracle::routing r;
  r.tokens = c.tokens;
  r.top_k = c.top_k;
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int32_t k = 0; k < c.top_k; ++k) {
      auto const z = static_cast<std::uint32_t>(hashed((std::uint64_t(group) << 40) ^ std::uint64_t(t * 8 + k)));
      r.idx.push_back(static_cast<std::int32_t>(z % static_cast<std::uint32_t>(c.experts + 1)) - 1);  // -1: masked
      r.w.push_back(static_cast<float>(1 + (z >> 8) % 4) / 8.0f);
    }
  return r;
}
template <class T>
std::vector<T> parm_rows(std::int32_t group, std::int32_t salt, std::int64_t tokens, std::int64_t hidden) {
  std::vector<T> x(static_cast<std::size_t>(tokens * hidden));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = oracle::from32<T>(dyadic(static_cast<std::uint32_t>(hashed((std::uint64_t(group * 4 + salt) << 36) ^ i))));
  return x;
}

constexpr std::int64_t parm_hidden = 4, parm_inner = 8;

inline std::vector<float> whole_expert_parameters(std::int32_t e) {
  sliced_mlp_experts<float> shape{parm_hidden, parm_inner, 0, 1, {}, {}};
  std::vector<float> p(static_cast<std::size_t>(shape.parameter_count()));
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = parameter_value(e, static_cast<std::int64_t>(i), true) / 4.0f;
  return p;
}

// What one rank's layer produced for one step.
template <class T>
struct parm_result {
  std::vector<T> out, d_x;
  std::vector<float> d_weights, grads;
  moecomm::parm_report report;
};

// One forward and backward of `Schedule` on this rank.
template <class T, class Schedule, class Capacity, class Backend, class Comm>
parm_result<T> run_parm_step(Backend const& be, moecomm::parallel_groups<Comm>& groups, parm_case const& c, Schedule schedule,
                             Capacity capacity) {
  auto const at = groups.coordinates();
  std::int32_t const group = at.dp * c.sizes.expert + at.ep, locals = c.experts / c.sizes.expert;
  oracle::routing const r = parm_routing(group, c);
  std::vector<T> const x = parm_rows<T>(group, 0, c.tokens, parm_hidden), d_out = parm_rows<T>(group, 1, c.tokens, parm_hidden);
  sliced_mlp_experts<T> experts{parm_hidden, parm_inner, at.esp, c.sizes.expert_slicing, {}, {}};
  for (std::int32_t l = 0; l < locals; ++l) {
    std::vector<float> const s = slice_parameters(whole_expert_parameters(at.ep * locals + l), parm_hidden, parm_inner, at.esp,
                                                  c.sizes.expert_slicing);
    experts.params.insert(experts.params.end(), s.begin(), s.end());
  }
  experts.grads.assign(experts.params.size(), 0.0f);
  moecomm::parm_layer<T, Backend, Comm, Schedule, Capacity> layer(be, groups, c.experts, parm_hidden, schedule, capacity);
  parm_result<T> res;
  res.out = poisoned<T>(c.tokens * parm_hidden);
  res.d_x = poisoned<T>(c.tokens * parm_hidden);
  res.d_weights.assign(static_cast<std::size_t>(c.tokens * c.top_k), std::nanf(""));
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), c.tokens, c.top_k};
  layer.forward(routing, {x.data(), c.tokens, parm_hidden}, {res.out.data(), c.tokens, parm_hidden}, experts);
  layer.backward({d_out.data(), c.tokens, parm_hidden}, moecomm::matrix_view<T>{res.d_x.data(), c.tokens, parm_hidden},
                 moecomm::array_view<float>{res.d_weights.data(), c.tokens * c.top_k}, experts);
  res.grads = experts.grads;
  res.report = layer.report();
  return res;
}

// The oracle of one rank's results (its MP group's tokens; its experts' slices' gradients).
template <class T>
parm_result<T> parm_oracle(moecomm::parallel_coordinates const& at, parm_case const& c) {
  std::int32_t const E = c.experts, EP = c.sizes.expert, locals = E / EP, G = c.sizes.expert_slicing;
  auto kept_routing = [&](std::int32_t group) {
    oracle::routing r = parm_routing(group, c);
    if (c.capacity_factor > 0) r = oracle::drop_to_capacity(r, E, oracle::capacity(c.tokens, c.top_k, E, c.capacity_factor),
                                                            oracle::drop_rule::position);
    return r;
  };
  std::vector<sliced_mlp_experts<T>> whole;
  for (std::int32_t e = 0; e < E; ++e) {
    whole.push_back({parm_hidden, parm_inner, 0, 1, whole_expert_parameters(e), {}});
    whole.back().grads.assign(whole.back().params.size(), 0.0f);
  }
  parm_result<T> want;
  for (std::int32_t ep = 0; ep < EP; ++ep) {  // every MP group of this data-parallel replica
    std::int32_t const group = at.dp * EP + ep;
    oracle::routing const r = kept_routing(group);
    std::vector<T> const x = parm_rows<T>(group, 0, c.tokens, parm_hidden), d_out = parm_rows<T>(group, 1, c.tokens, parm_hidden);
    oracle::row_map const m = oracle::permute_map(r, E);
    std::vector<T> const in = oracle::permute(x, parm_hidden, m);
    std::vector<T> y(in.size()), d_in(in.size());
    std::vector<T> const d_y = oracle::unpermute_backward(d_out, parm_hidden, r, m, true);
    for (std::int32_t e = 0; e < E; ++e) {
      std::int64_t const b = m.expert_offsets[static_cast<std::size_t>(e)], n = m.expert_offsets[static_cast<std::size_t>(e) + 1] - b;
      auto& ex = whole[static_cast<std::size_t>(e)];
      ex.forward(ex.params.data(), {in.data() + b * parm_hidden, n, parm_hidden}, {y.data() + b * parm_hidden, n, parm_hidden});
      ex.backward(ex.params.data(), {in.data() + b * parm_hidden, n, parm_hidden}, {d_y.data() + b * parm_hidden, n, parm_hidden},
                  {d_in.data() + b * parm_hidden, n, parm_hidden}, ex.grads.data());
    }
    if (ep != at.ep) continue;
    want.out = oracle::unpermute(y, parm_hidden, r, m, true);
    want.d_x = oracle::unpermute(d_in, parm_hidden, r, m, false);
    want.d_weights = oracle::weight_grad(y, d_out, parm_hidden, r, m);
  }
  for (std::int32_t l = 0; l < locals; ++l) {
    std::vector<float> s = slice_parameters(whole[static_cast<std::size_t>(at.ep * locals + l)].grads, parm_hidden, parm_inner, at.esp, G);
    if (at.esp != 0) std::fill(s.end() - parm_hidden, s.end(), 0.0f);  // b2's gradient belongs to slice 0
    want.grads.insert(want.grads.end(), s.begin(), s.end());
  }
  return want;
}

template <class T>
void check_parm_result(parm_result<T> const& got, parm_result<T> const& want, char const* schedule) {
  CAPTURE(schedule);
  check_bitwise(got.out, want.out, parm_hidden, "out");
  check_bitwise(got.d_x, want.d_x, parm_hidden, "d_x");
  CHECK(got.d_weights == want.d_weights);
  CHECK(got.grads == want.grads);
}

// One rank: every schedule against the oracle, and the rows per rank that PauseMP saves.
template <class T, class Capacity, class Backend, class Comm>
void check_parm_schedules_on_rank(Backend const& be, Comm& world, parm_case const& c, Capacity capacity) {
  moecomm::parallel_groups<Comm> groups(world, c.sizes);
  parm_result<T> const want = parm_oracle<T>(groups.coordinates(), c);
  auto const base = run_parm_step<T>(be, groups, c, moecomm::deepspeed_mp{}, capacity);
  check_parm_result(base, want, "deepspeed_mp");
  auto const s1 = run_parm_step<T>(be, groups, c, moecomm::parm_s1{}, capacity);
  check_parm_result(s1, want, "parm_s1");
  for (std::int32_t pieces : {1, 2, 7}) {
    CAPTURE(pieces);
    auto const s2 = run_parm_step<T>(be, groups, c, moecomm::parm_s2{pieces}, capacity);
    check_parm_result(s2, want, "parm_s2");
    CHECK(s2.report.rows_computed == s1.report.rows_computed);
  }
  // PauseMP: the MP group's rows are dispatched once, not MP times; slices compute MP / ESP fewer.
  std::int64_t base_rows[2] = {base.report.rows_dispatched, base.report.rows_computed};
  std::int64_t paused_rows[2] = {s1.report.rows_dispatched, s1.report.rows_computed};
  Comm& everyone = groups.world();
  std::int64_t sums[4] = {0, 0, 0, 0};
  std::vector<std::int64_t> all(static_cast<std::size_t>(4 * everyone.size()));
  std::int64_t const mine[4] = {base_rows[0], base_rows[1], paused_rows[0], paused_rows[1]};
  everyone.allgather(mine, all.data(), sizeof(mine));
  for (std::size_t i = 0; i < all.size(); ++i) sums[i % 4] += all[i];
  std::int64_t const mp = c.sizes.model, slices = c.sizes.expert_slicing;
  CHECK(sums[0] == mp * sums[2]);
  CHECK(sums[1] * slices == mp * sums[3]);
}

}  // namespace test

namespace test {

// `parm_auto` runs what its model picks, the same on every rank, with the oracle's results: under
// a model where one collective costs a second it runs S1; where collectives cost almost nothing
// fixed, copies are free and no port is shared, S2 whenever both pipelined stages move rows (EP > 1 and ESP > 1), and
// S1 otherwise (pipelining one stage only adds fixed costs).
template <class Capacity, class Backend, class Comm>
void check_parm_auto_on_rank(Backend const& be, Comm& world, parm_case const& c, Capacity capacity) {
  moecomm::parallel_groups<Comm> groups(world, c.sizes);
  parm_result<float> const want = parm_oracle<float>(groups.coordinates(), c);
  for (bool const overlap_pays : {false, true}) {
    CAPTURE(overlap_pays);
    moecomm::parm_cost_params p;
    p.intra.alpha_seconds = p.inter.alpha_seconds = overlap_pays ? 1e-15 : 1.0;
    if (overlap_pays) {
      p.copy_bytes_per_second = 1e30;
      p.shared_port_bytes_per_second = 0;  // the stages do not contend
    }
    moecomm::parm_auto const policy{moecomm::parm_cost_model(p), parm_inner, 3};
    auto const got = run_parm_step<float>(be, groups, c, policy, capacity);
    check_parm_result(got, want, "parm_auto");
    moecomm::parm_report const& r = got.report;
    CHECK(r.automatic);
    bool const priced = r.shape.tokens > 0;
    bool const s2 = overlap_pays && priced && c.sizes.expert > 1 && c.sizes.expert_slicing > 1;
    CHECK(std::string(r.schedule) == (s2 ? "parm_s2" : "parm_s1"));
    CHECK(r.pieces == (s2 ? 3 : 1));
    if (priced) {  // the report's predictions are the model's for the agreed shape
      CHECK(r.shape.tokens == c.tokens);
      CHECK(r.shape.top_k == c.top_k);
      CHECK(r.choice.s1.step_total == policy.model.predict_s1(r.shape).step_total);
      CHECK(r.choice.s2.step_total == policy.model.predict_s2(r.shape).step_total);
    }
    std::int32_t const mine = r.pieces;  // every rank runs the same schedule
    std::vector<std::int32_t> all(static_cast<std::size_t>(world.size()));
    world.allgather(&mine, all.data(), sizeof mine);
    CHECK(std::count(all.begin(), all.end(), mine) == world.size());
  }
}

}  // namespace test
