// SPDX-License-Identifier: Apache-2.0
#pragma once
// The plain expert-parallel layer against a single-process oracle that applies the same experts to
// the same tokens: output and input gradient bit for bit (the combine order is fixed), weight
// gradient within fp32 tolerance (a dot product whose order differs from the oracle's). The rank
// body is generic over the communicator, so in-process ranks and MPI processes run the same check.

#include "../support/test_support.hpp"

#include <moecomm/patterns/expert_parallel.hpp>

#include <atomic>
#include <stdexcept>
#include <vector>

namespace test {

// The experts: global expert e scales its rows by (e + 1); its backward scales gradients the same way.
template <class T>
T scaled(T v, int32_t expert) {
  return oracle::from32<T>(oracle::f32(v) * static_cast<float>(expert + 1));
}

template <class T>
struct scale_experts {
  int32_t first_expert;  // global id of local expert 0
  void operator()(int32_t l, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    for (int64_t i = 0; i < in.rows * in.hidden; ++i) out.data[i] = scaled(in.data[i], first_expert + l);
  }
  void operator()(int32_t l, moecomm::matrix_view<T const>, moecomm::matrix_view<T const> d_out, moecomm::matrix_view<T> d_in) const {
    for (int64_t i = 0; i < d_out.rows * d_out.hidden; ++i) d_in.data[i] = scaled(d_out.data[i], first_expert + l);
  }
};

// scale_experts with the grouped form too (patterns/experts.hpp): one call per block of rows cut
// among the local experts, which the layer then prefers; it counts the grouped calls.
template <class T>
struct grouped_scale_experts : scale_experts<T> {
  explicit grouped_scale_experts(int32_t first) : scale_experts<T>{first} {}
  mutable int64_t grouped_calls = 0;
  template <class Backend>
  void forward_grouped(moecomm::grouped_rows<T> const& rows, Backend const&) const {
    ++grouped_calls;
    for (int64_t l = 0; l + 1 < rows.offsets.size; ++l)
      for (int64_t i = rows.offsets.data[l] * rows.in.hidden; i < rows.offsets.data[l + 1] * rows.in.hidden; ++i)
        rows.out.data[i] = scaled(rows.in.data[i], this->first_expert + static_cast<int32_t>(l));
  }
  template <class Backend>
  void backward_grouped(moecomm::grouped_gradient_rows<T> const& rows, Backend const&) const {
    ++grouped_calls;
    for (int64_t l = 0; l + 1 < rows.offsets.size; ++l)
      for (int64_t i = rows.offsets.data[l] * rows.d_out.hidden; i < rows.offsets.data[l + 1] * rows.d_out.hidden; ++i)
        rows.d_in.data[i] = scaled(rows.d_out.data[i], this->first_expert + static_cast<int32_t>(l));
  }
};

// What the layer must produce on one rank, computed without the library.
template <class T>
struct expected_rank {
  std::vector<T> out, d_x;
  std::vector<float> d_w;
  int64_t dropped = 0;
};

// `dedup_ranks` > 0: the exchange is deduplicated over that many ranks (semantics §10a), so the
// combine and the input gradient sum per expert rank first; `dedup_per_node` > 0 as well: per node
// (of that many consecutive ranks) on the relay, then at the source.
template <class T>
expected_rank<T> layer_oracle(oracle::routing const& kept, int64_t valid_slots, std::vector<T> const& x,
                              std::vector<T> const& d_out, int64_t hidden, int32_t experts, int32_t dedup_ranks = 0,
                              int32_t dedup_per_node = 0) {
  auto const m = oracle::permute_map(kept, experts);
  std::vector<std::vector<int32_t>> levels;
  if (dedup_per_node > 0) levels.emplace_back(kept.idx.size(), -1);
  if (dedup_ranks > 0) levels.emplace_back(kept.idx.size(), -1);
  for (std::size_t i = 0; i < kept.idx.size(); ++i) {
    if (dedup_ranks == 0 || kept.idx[i] < 0) continue;
    int32_t const rank = kept.idx[i] / (experts / dedup_ranks);
    levels.back()[i] = rank;
    if (dedup_per_node > 0) levels.front()[i] = rank / dedup_per_node;
  }
  auto combine = [&](std::vector<T> const& rows, bool weighted) {
    return dedup_ranks > 0 ? oracle::grouped_unpermute(rows, hidden, kept, m, weighted, levels)
                           : oracle::unpermute(rows, hidden, kept, m, weighted);
  };
  std::vector<T> y;  // expert outputs in permuted order
  for (int64_t row = 0; row < m.rows(); ++row) {
    int32_t const t = m.token_of[static_cast<std::size_t>(row)];
    int32_t const e = kept.at(t, m.slot_of[static_cast<std::size_t>(row)]);
    for (int64_t h = 0; h < hidden; ++h) y.push_back(scaled(x[static_cast<std::size_t>(t * hidden + h)], e));
  }
  expected_rank<T> want;
  want.out = combine(y, true);
  auto d_y = oracle::unpermute_backward(d_out, hidden, kept, m, true);
  for (int64_t row = 0; row < m.rows(); ++row) {
    int32_t const e = kept.at(m.token_of[static_cast<std::size_t>(row)], m.slot_of[static_cast<std::size_t>(row)]);
    for (int64_t h = 0; h < hidden; ++h) d_y[static_cast<std::size_t>(row * hidden + h)] = scaled(d_y[static_cast<std::size_t>(row * hidden + h)], e);
  }
  want.d_x = combine(d_y, false);
  want.d_w = oracle::weight_grad(y, d_out, hidden, kept, m);
  want.dropped = valid_slots - m.rows();
  return want;
}

template <class Capacity>
double capacity_factor(Capacity const& c) {
  if constexpr (moecomm::detail::is_dropless_v<Capacity> || moecomm::detail::is_receiver_budget_v<Capacity>) return 1.0;
  else return c.factor;
}
template <class Capacity>
int64_t budget(Capacity const& c) {
  if constexpr (moecomm::detail::is_receiver_budget_v<Capacity>) return c.rows_per_rank; else return 0;
}
template <class Capacity>
std::uint64_t random_seed(Capacity const& c) {
  if constexpr (std::is_same_v<Capacity, moecomm::capacity<moecomm::drop_random>>) return c.rule.seed; else return 0;
}

struct layer_case {
  int32_t ranks, per_node, experts, top_k;
  int64_t hidden;
  std::vector<int64_t> tokens;  // per rank
  double zipf;
};

// Every rank's inputs and the oracle's answers (computed identically on every rank).
template <class T>
struct layer_inputs {
  std::vector<oracle::routing> routing;
  std::vector<std::vector<T>> x, d_out;
  std::vector<expected_rank<T>> want;
};

// The order in which an exchange's combine adds a token's expert rows (semantics §10a).
enum class sum_order { plain, per_rank, per_node };
template <class Algorithm>
constexpr sum_order sum_order_of() {
  if constexpr (std::is_same_v<Algorithm, moecomm::dedup_per_node>) return sum_order::per_node;
  else return moecomm::detail::is_dedup_v<Algorithm> ? sum_order::per_rank : sum_order::plain;
}

template <class T, class Capacity>
layer_inputs<T> make_layer_inputs(layer_case const& c, Capacity const& capacity, oracle::drop_rule rule, bool drops,
                                  sum_order order = sum_order::plain) {
  layer_inputs<T> in;
  auto const ranks = static_cast<std::size_t>(c.ranks);
  in.routing.resize(ranks);
  in.x.resize(ranks);
  in.d_out.resize(ranks);
  in.want.resize(ranks);
  int64_t cap = 0, first_token = 0;
  std::vector<int64_t> first(ranks);
  for (int32_t r = 0; r < c.ranks; ++r) {
    in.routing[r] = make_routing({c.tokens[r], c.top_k, c.experts, 0.1, true, c.zipf, static_cast<std::uint32_t>(100 + r)});
    in.x[r] = finite_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(200 + r));
    in.d_out[r] = finite_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(300 + r));
    cap = std::max(cap, oracle::capacity(c.tokens[r], c.top_k, c.experts, drops ? capacity_factor(capacity) : 1.0));
    first[r] = first_token;
    first_token += c.tokens[r];
  }
  std::vector<oracle::routing> kept = in.routing;
  if (rule == oracle::drop_rule::receiver_budget) kept = oracle::drop_to_receiver_budget(in.routing, c.experts, budget(capacity));
  else if (drops)
    for (int32_t r = 0; r < c.ranks; ++r)
      kept[r] = oracle::drop_to_capacity(in.routing[r], c.experts, cap, rule, random_seed(capacity), 0, first[r]);
  for (int32_t r = 0; r < c.ranks; ++r) {
    int64_t valid = 0;
    for (int32_t e : in.routing[r].idx) valid += e >= 0 ? 1 : 0;
    in.want[r] = layer_oracle(kept[r], valid, in.x[r], in.d_out[r], c.hidden, c.experts, order == sum_order::plain ? 0 : c.ranks,
                              order == sum_order::per_node ? c.per_node : 0);
  }
  return in;
}

// One step of `layer` on rank `me`: forward and backward, compared with the oracle.
template <class T, class Experts = scale_experts<T>, class Layer>
void check_layer_step(Layer& layer, int32_t me, layer_case const& c, layer_inputs<T> const& in) {
  Experts const experts{me * (c.experts / c.ranks)};
  auto const& r = in.routing[me];
  int64_t const tokens = r.tokens;
  moecomm::routing_view const view{r.idx.data(), r.w.data(), tokens, r.top_k};
  auto out = poisoned<T>(tokens * c.hidden);
  layer.forward(view, {in.x[me].data(), tokens, c.hidden}, {out.data(), tokens, c.hidden}, experts);
  check_bitwise(out, in.want[me].out, c.hidden, "layer output");
  CHECK(layer.dispatch_state().report().dropped_slots == in.want[me].dropped);
  auto d_x = poisoned<T>(tokens * c.hidden);
  auto d_w = poisoned<float>(tokens * r.top_k);
  layer.backward({in.d_out[me].data(), tokens, c.hidden}, {d_x.data(), tokens, c.hidden}, d_w, experts);
  check_bitwise(d_x, in.want[me].d_x, c.hidden, "input gradient");
  for (std::size_t i = 0; i < d_w.size(); ++i)
    REQUIRE_MESSAGE(std::fabs(d_w[i] - in.want[me].d_w[i]) <= 1e-5f * std::fabs(in.want[me].d_w[i]) + 1e-6f * float(c.hidden),
                    "rank ", me, " d_weights[", i, "] = ", d_w[i], ", oracle ", in.want[me].d_w[i]);
}

// One rank's part of a fresh layer's step, on back-end `be`.
template <class T, class Capacity, class Algorithm, class Comm, class Backend = moecomm::host_backend>
void check_layer_on_rank(Comm& comm, layer_case const& c, layer_inputs<T> const& in, Capacity const& capacity,
                         Algorithm const& algorithm, Backend const& be = Backend{}) {
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node));
  moecomm::expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm> layer(be, groups, c.experts, c.hidden, capacity,
                                                                              algorithm);
  check_layer_step(layer, comm.rank(), c, in);
}

// The capacity policies, each checked by `run(capacity, rule, drops)`.
template <class F>
void for_each_capacity(F&& run) {
  using namespace moecomm;
  run(dropless{}, oracle::drop_rule::position, false);
  run(capacity<drop_by_position>{1.0, 0, false, {}}, oracle::drop_rule::position, true);
  run(capacity<drop_by_probability>{0.5, 0, true, {}}, oracle::drop_rule::probability, true);
  run(capacity<drop_random>{0.75, 0, false, {42, 0}}, oracle::drop_rule::random, true);
  run(receiver_budget{40}, oracle::drop_rule::receiver_budget, true);
}

// The failing-expert case: 4 ranks (2 x 2), E = 8, H = 16. One rank's forward, in any world, on any
// back-end: rank 2's expert throws; a rank that stops with `aborted` is counted in `stopped`.
inline layer_case const throwing_expert_case{4, 2, 8, 2, 16, {20, 20, 20, 20}, 0.0};

template <class Algorithm, class Backend, class Comm>
void forward_with_a_throwing_expert(Comm& comm, Backend const& be, Algorithm const& algorithm, layer_inputs<float> const& in,
                                    std::atomic<int>& stopped) {
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(4, 2));
  moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, Algorithm> layer(be, groups, 8, 16, {}, algorithm);
  auto const& r = in.routing[comm.rank()];
  std::vector<float> out(static_cast<std::size_t>(r.tokens * 16));
  auto experts = [&](int32_t l, moecomm::matrix_view<float const> a, moecomm::matrix_view<float> b) {
    if (comm.rank() == 2) throw std::runtime_error("expert 5 ran out of memory");
    scale_experts<float>{comm.rank() * 2}(l, a, b);
  };
  try {
    layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[comm.rank()].data(), r.tokens, 16},
                  {out.data(), r.tokens, 16}, experts);
  } catch (moecomm::error const& e) {
    if (e.code() == moecomm::status::aborted) ++stopped;
    throw;
  }
}

}  // namespace test
