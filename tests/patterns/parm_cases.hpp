// SPDX-License-Identifier: Apache-2.0
#pragma once
// Bodies of the Parm layer tests, generic over the communicator and back-end (in-process and
// simulated ranks run the same checks).
//
// Every MP group holds its own tokens and routing (the same on each of its ranks); experts are
// test MLPs sliced over the ESP group. The oracle is single-process and unsliced: each slot's row
// through its whole expert, combined in slot order (oracle.hpp); the parameter gradient of every
// expert over every token of its data-parallel replica that reaches it. Values are dyadic, so every
// fp32 sum is exact and the comparisons are bit for bit; bf16 rows with sliced experts are within a
// derived bound of the oracle (check_parm_near_oracle).

#include "../support/oracle.hpp"
#include "../support/sliced_mlp.hpp"
#include "../support/test_support.hpp"
#include "shadow_cases.hpp"

#include <moecomm/patterns/parm.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace test {

struct parm_case {
  moecomm::parallel_sizes sizes;
  std::int64_t tokens = 37;
  std::int32_t experts = 8, top_k = 2;
  double capacity_factor = 0;  // 0: dropless
  double zipf = 0;             // 0: hashed uniform routing; s > 0: Zipf(s) expert popularity
};

// The routing and rows of MP group `group` (every rank of the group builds the same). Valid slots
// weigh 1/8 to 4/8, so every weighted sum stays exact.
inline oracle::routing parm_routing(std::int32_t group, parm_case const& c) {
  auto slot_hash = [&](std::int64_t t, std::int32_t k) {
    return static_cast<std::uint32_t>(hashed((std::uint64_t(group) << 40) ^ std::uint64_t(t * 8 + k)));
  };
  auto weight = [](std::uint32_t z) { return static_cast<float>(1 + (z >> 8) % 4) / 8.0f; };
  if (c.zipf > 0) {
    // Expert e drawn with probability ∝ 1/(e+1)^s, distinct within a token, 1 slot in 8 masked
    // (its NaN weight must never be read): the hot experts overload their EP ranks.
    oracle::routing r = make_routing({c.tokens, c.top_k, c.experts, 0.125, false, c.zipf, 0x9a7e0000u + std::uint32_t(group)});
    for (std::int64_t t = 0; t < c.tokens; ++t)
      for (std::int32_t k = 0; k < c.top_k; ++k)
        if (r.at(t, k) >= 0) r.w[static_cast<std::size_t>(t * c.top_k + k)] = weight(slot_hash(t, k));
    return r;
  }
  oracle::routing r;
  r.tokens = c.tokens;
  r.top_k = c.top_k;
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int32_t k = 0; k < c.top_k; ++k) {
      std::uint32_t const z = slot_hash(t, k);
      r.idx.push_back(static_cast<std::int32_t>(z % static_cast<std::uint32_t>(c.experts + 1)) - 1);  // -1: masked
      r.w.push_back(weight(z));
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

// This rank's slices of its local experts (rank `at` of a Parm layer over `c`'s groups), gradients zero.
template <class T>
sliced_mlp_experts<T> parm_rank_experts(moecomm::parallel_coordinates const& at, parm_case const& c) {
  std::int32_t const locals = c.experts / c.sizes.expert;
  sliced_mlp_experts<T> initial{parm_hidden, parm_inner, at.esp, c.sizes.expert_slicing, {}, {}};
  for (std::int32_t l = 0; l < locals; ++l) {
    std::vector<float> const s = slice_parameters(whole_expert_parameters(at.ep * locals + l), parm_hidden, parm_inner, at.esp,
                                                  c.sizes.expert_slicing);
    initial.params.insert(initial.params.end(), s.begin(), s.end());
  }
  initial.grads.assign(initial.params.size(), 0.0f);
  return initial;
}

// One forward and backward of `Schedule` on this rank, in the back-end's memory (experts as its kernels).
template <class T, class Schedule, class Capacity, class Backend, class Comm>
parm_result<T> run_parm_step(Backend const& be, moecomm::parallel_groups<Comm>& groups, parm_case const& c, Schedule schedule,
                             Capacity capacity) {
  auto const at = groups.coordinates();
  std::int32_t const group = at.dp * c.sizes.expert + at.ep;
  oracle::routing const r = parm_routing(group, c);
  std::vector<T> const x = parm_rows<T>(group, 0, c.tokens, parm_hidden), d_out = parm_rows<T>(group, 1, c.tokens, parm_hidden);
  backend_sliced_mlp_experts<T, Backend> experts(be, parm_rank_experts<T>(at, c));
  moecomm::parm_layer<T, Backend, Comm, Schedule, Capacity> layer(be, groups, c.experts, parm_hidden, schedule, capacity);
  auto const idx = upload(be, r.idx);
  auto const w = upload(be, r.w);
  auto const dx_in = upload(be, x), dy_in = upload(be, d_out);
  auto out = upload(be, poisoned<T>(c.tokens * parm_hidden)), d_x = upload(be, poisoned<T>(c.tokens * parm_hidden));
  auto d_weights = upload(be, std::vector<float>(static_cast<std::size_t>(c.tokens * c.top_k), std::nanf("")));
  moecomm::routing_view const routing{idx.data(), w.data(), c.tokens, c.top_k};
  layer.forward(routing, {dx_in.data(), c.tokens, parm_hidden}, {out.data(), c.tokens, parm_hidden}, experts);
  layer.backward({dy_in.data(), c.tokens, parm_hidden}, moecomm::matrix_view<T>{d_x.data(), c.tokens, parm_hidden},
                 moecomm::array_view<float>{d_weights.data(), c.tokens * c.top_k}, experts);
  parm_result<T> res;
  res.out = download(be, out.data(), c.tokens * parm_hidden);
  res.d_x = download(be, d_x.data(), c.tokens * parm_hidden);
  res.d_weights = download(be, d_weights.data(), c.tokens * c.top_k);
  res.grads = experts.gradients_on_host();
  res.report = layer.report();
  return res;
}

// Per element, a bound on the sum of |partials| that the expert slices add into it, whatever the
// slicing: the bf16 tolerance of check_parm_near_oracle is relative to it.
struct parm_magnitudes {
  std::vector<float> out, d_x, d_weights;
};

// One row through the unsliced expert `p` with |W2|, |b2|, |W1| and |output gradient g| under the
// same ReLU mask: y_abs[h] >= sum over slices of |slice output[h]|, dx_abs[i] >= sum over slices of
// |slice input gradient[i]|.
template <class T>
void expert_magnitudes(float const* p, T const* x, T const* g, float* y_abs, float* dx_abs) {
  constexpr std::int64_t H = parm_hidden, F = parm_inner;
  float const* const w2 = p + H * F + F;
  float const* const b2 = w2 + F * H;
  float pre[F];
  sliced_mlp_experts<T>{H, F, 0, 1, {}, {}}.hidden_layer(p, x, pre);
  for (std::int64_t h = 0; h < H; ++h) {
    y_abs[h] = std::fabs(b2[h]);
    for (std::int64_t j = 0; j < F; ++j) y_abs[h] += std::max(pre[j], 0.0f) * std::fabs(w2[j * H + h]);
  }
  std::fill(dx_abs, dx_abs + H, 0.0f);
  for (std::int64_t j = 0; j < F; ++j) {
    if (pre[j] <= 0.0f) continue;
    float d_pre = 0.0f;
    for (std::int64_t h = 0; h < H; ++h) d_pre += std::fabs(oracle::f32(g[h])) * std::fabs(w2[j * H + h]);
    for (std::int64_t i = 0; i < H; ++i) dx_abs[i] += d_pre * std::fabs(p[i * F + j]);
  }
}

// The oracle of one rank's results (its MP group's tokens; its experts' slices' gradients), and,
// when `magnitudes` is given, theirs.
template <class T>
parm_result<T> parm_oracle(moecomm::parallel_coordinates const& at, parm_case const& c, parm_magnitudes* magnitudes = nullptr) {
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
    if (magnitudes == nullptr) continue;
    std::vector<float> y_abs(in.size()), dx_abs(in.size()), d_out_abs(d_out.size());
    for (std::int32_t e = 0; e < E; ++e)
      for (std::int64_t row = m.expert_offsets[static_cast<std::size_t>(e)]; row < m.expert_offsets[static_cast<std::size_t>(e) + 1]; ++row)
        expert_magnitudes(whole[static_cast<std::size_t>(e)].params.data(), in.data() + row * parm_hidden, d_y.data() + row * parm_hidden,
                          y_abs.data() + row * parm_hidden, dx_abs.data() + row * parm_hidden);
    for (std::size_t i = 0; i < d_out.size(); ++i) d_out_abs[i] = std::fabs(oracle::f32(d_out[i]));
    magnitudes->out = oracle::unpermute(y_abs, parm_hidden, r, m, true);  // weights are positive
    magnitudes->d_x = oracle::unpermute(dx_abs, parm_hidden, r, m, false);
    magnitudes->d_weights = oracle::weight_grad(y_abs, d_out_abs, parm_hidden, r, m);
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

// |got - want| <= 2^-8 (3 m + r |want|) (1 + 2^-6) for every element (check_parm_near_oracle).
template <class V>
void check_within_bf16_bound(std::vector<V> const& got, std::vector<V> const& want, std::vector<float> const& magnitude, double r,
                             char const* what) {
  REQUIRE(got.size() == want.size());
  REQUIRE(magnitude.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    double const g = oracle::f32(got[i]), w = oracle::f32(want[i]);
    double const bound = std::ldexp(3.0 * magnitude[i] + r * std::fabs(w), -8) * (1.0 + std::ldexp(1.0, -6));
    if (!(std::fabs(g - w) <= bound)) {
      FAIL_CHECK(std::string(what), ": element ", i, " is ", g, ", the oracle's ", w, ", beyond the bf16 bound ", bound);
      return;
    }
  }
}

// deepspeed_mp against the unsliced oracle (the other schedules are compared with deepspeed_mp).
// Bit for bit in fp32, and in bf16 with ESP = 1: the roundings are the oracle's. Parameter
// gradients: bit for bit in any case (exact fp32 sums of the same rows). bf16 with ESP > 1 rounds
// twice where the oracle rounds once: each slice rounds its partial a_g (output, or input gradient)
// to bf16, the ESP sum S = sum bf16(a_g) is formed in fp32 and rounded to bf16; the oracle rounds
// A = sum a_g. With u = 2^-8 (bf16's unit roundoff) and M >= sum |a_g| (parm_magnitudes):
//   |y' - y| <= u sum |a_g| + u |S| + u |A| <= 3u M (1 + u)
// per slot; the combine adds slots with weights w_k > 0 and rounds to bf16 on both sides, so
//   |out' - out| <= 3u sum_k w_k M_k + 2u |out|   (d_x likewise, w_k = 1),
//   |d_w' - d_w| <= 3u sum_h M_h |d_out_h|        (fp32 dot product, no bf16 rounding of its own),
// up to O(u^2) terms and fp32 roundings, which the factor 1 + 2^-6 covers. The bound does not grow
// with ESP (M bounds the partials, however many). It is at most about 5u M (|out| <= M), so an error
// of 2 % of M fails: a slice missing, b2 added by every slice, a wrong row or weight. The largest
// error seen is about half the bound.
template <class T>
void check_parm_near_oracle(parm_result<T> const& got, parm_result<T> const& want, parm_magnitudes const* magnitudes) {
  if (magnitudes == nullptr) {
    check_parm_result(got, want, "deepspeed_mp");
    return;
  }
  check_within_bf16_bound(got.out, want.out, magnitudes->out, 2, "out");
  check_within_bf16_bound(got.d_x, want.d_x, magnitudes->d_x, 2, "d_x");
  check_within_bf16_bound(got.d_weights, want.d_weights, magnitudes->d_weights, 0, "d_weights");
  CHECK(got.grads == want.grads);
}

// `grads` summed in ascending rank over the ranks of this rank's MP group that hold its slice (MP
// index congruent modulo ESP), as a trainer's expert-data-parallel reduction would; from the
// world's rank arithmetic, not the layer's groups.
template <class Comm>
std::vector<float> sum_over_slice_peers(moecomm::parallel_groups<Comm>& groups, std::vector<float> const& grads) {
  Comm& world = groups.world();
  std::int32_t const M = groups.sizes().model, G = groups.sizes().expert_slicing, me = world.rank();
  std::size_t const n = grads.size();
  std::vector<float> all(n * static_cast<std::size_t>(world.size()));
  allgather_host(world, grads.data(), all.data(), static_cast<std::int64_t>(n * sizeof(float)));
  std::vector<float> sum(n, 0.0f);
  for (std::int32_t r = 0; r < world.size(); ++r) {
    if (r / M != me / M || (r % M) % G != (me % M) % G) continue;
    for (std::size_t i = 0; i < n; ++i) sum[i] += all[static_cast<std::size_t>(r) * n + i];
  }
  return sum;
}

// One rank: deepspeed_mp against the oracle, every other schedule against deepspeed_mp bit for bit
// (so, in fp32, every schedule equals the oracle bit for bit), and the rows per rank that PauseMP saves.
template <class T, class Capacity, class Backend, class Comm>
void check_parm_schedules_on_rank(Backend const& be, Comm& world, parm_case const& c, Capacity capacity) {
  moecomm::parallel_groups<Comm> groups(world, c.sizes);
  parm_magnitudes magnitudes;
  bool const bounded = !std::is_same_v<T, float> && c.sizes.expert_slicing > 1;
  parm_result<T> const want = parm_oracle<T>(groups.coordinates(), c, bounded ? &magnitudes : nullptr);
  auto const base = run_parm_step<T>(be, groups, c, moecomm::deepspeed_mp{}, capacity);
  check_parm_near_oracle(base, want, bounded ? &magnitudes : nullptr);
  auto const s1 = run_parm_step<T>(be, groups, c, moecomm::parm_s1{}, capacity);
  check_parm_result(s1, base, "parm_s1");
  for (std::int32_t pieces : {1, 2, 7}) {
    CAPTURE(pieces);
    auto const s2 = run_parm_step<T>(be, groups, c, moecomm::parm_s2{pieces}, capacity);
    check_parm_result(s2, base, "parm_s2");
    CHECK(s2.report.rows_computed == s1.report.rows_computed);
  }
  // Gradients left to the trainer: the same rows, and each rank keeps its tokens' share, which its
  // MP peers holding the same slice sum (ascending rank) to the baseline's gradient.
  auto const share = run_parm_step<T>(be, groups, c, moecomm::parm_s2{3, moecomm::replica_gradients::left_to_trainer}, capacity);
  parm_result<T> summed = share;
  summed.grads = sum_over_slice_peers(groups, share.grads);
  check_parm_result(summed, base, "parm_s2 with gradients left to the trainer");
  std::int64_t const mp = c.sizes.model, slices = c.sizes.expert_slicing;
  if constexpr (!moecomm::detail::is_dropless_v<Capacity>) {
    if (capacity.pad_to_capacity) {  // E·C rows each in the baseline; PauseMP moves a share of ⌈C / MP⌉ rows of each block
      std::int64_t const C = base.report.capacity, share = (C + mp - 1) / mp;
      CHECK(base.report.rows_dispatched == c.experts * C);
      CHECK(base.report.rows_computed == c.experts * C);
      CHECK(s1.report.rows_dispatched == c.experts * share);
      CHECK(s1.report.rows_computed == slices * c.experts * share);
      return;
    }
  }
  // PauseMP: the MP group's rows are dispatched once, not MP times; slices compute MP / ESP fewer.
  std::int64_t base_rows[2] = {base.report.rows_dispatched, base.report.rows_computed};
  std::int64_t paused_rows[2] = {s1.report.rows_dispatched, s1.report.rows_computed};
  Comm& everyone = groups.world();
  std::int64_t sums[4] = {0, 0, 0, 0};
  std::vector<std::int64_t> all(static_cast<std::size_t>(4 * everyone.size()));
  std::int64_t const mine[4] = {base_rows[0], base_rows[1], paused_rows[0], paused_rows[1]};
  allgather_host(everyone, mine, all.data(), sizeof(mine));
  for (std::size_t i = 0; i < all.size(); ++i) sums[i % 4] += all[i];
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
      p.kernel_launch_seconds = 0;
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
    allgather_host(world, &mine, all.data(), sizeof mine);
    CHECK(std::count(all.begin(), all.end(), mine) == world.size());
  }
}

}  // namespace test
