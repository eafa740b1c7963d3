// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer over in-process ranks equals a single-process oracle that applies
// the same experts to the same tokens, bit for bit (the combine order is fixed): output, input
// gradient and weight gradient (the last within fp32 tolerance: a dot product whose order differs
// from the oracle's), for every capacity policy and all-to-all algorithm, over 1, 2, 4 and 8 ranks.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/expert_parallel.hpp>

namespace test {

using moecomm::inproc_communicator;

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

// What the layer must produce on one rank, computed without the library.
template <class T>
struct expected_rank {
  std::vector<T> out, d_x;
  std::vector<float> d_w;
  int64_t dropped = 0;
};

template <class T>
expected_rank<T> layer_oracle(oracle::routing const& kept, int64_t valid_slots, std::vector<T> const& x,
                              std::vector<T> const& d_out, int64_t hidden, int32_t experts) {
  auto const m = oracle::permute_map(kept, experts);
  std::vector<T> y;  // expert outputs in permuted order
  for (int64_t row = 0; row < m.rows(); ++row) {
    int32_t const t = m.token_of[static_cast<std::size_t>(row)];
    int32_t const e = kept.at(t, m.slot_of[static_cast<std::size_t>(row)]);
    for (int64_t h = 0; h < hidden; ++h) y.push_back(scaled(x[static_cast<std::size_t>(t * hidden + h)], e));
  }
  expected_rank<T> want;
  want.out = oracle::unpermute(y, hidden, kept, m, true);
  auto d_y = oracle::unpermute_backward(d_out, hidden, kept, m, true);
  for (int64_t row = 0; row < m.rows(); ++row) {
    int32_t const e = kept.at(m.token_of[static_cast<std::size_t>(row)], m.slot_of[static_cast<std::size_t>(row)]);
    for (int64_t h = 0; h < hidden; ++h) d_y[static_cast<std::size_t>(row * hidden + h)] = scaled(d_y[static_cast<std::size_t>(row * hidden + h)], e);
  }
  want.d_x = oracle::unpermute(d_y, hidden, kept, m, false);
  want.d_w = oracle::weight_grad(y, d_out, hidden, kept, m);
  want.dropped = valid_slots - m.rows();
  return want;
}

template <class Capacity>
double capacity_factor(Capacity const& c) { if constexpr (moecomm::detail::is_dropless_v<Capacity>) return 1.0; else return c.factor; }
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

template <class T, class Capacity, class Algorithm>
void check_layer(layer_case const& c, Capacity const& capacity, Algorithm const& algorithm, oracle::drop_rule rule,
                 bool drops) {
  CAPTURE(c.ranks);
  CAPTURE(c.per_node);
  CAPTURE(Algorithm::name);
  CAPTURE(Capacity::name);
  // Per-rank inputs and the oracle's answers.
  std::vector<oracle::routing> routing(static_cast<std::size_t>(c.ranks));
  std::vector<std::vector<T>> x(routing.size()), d_out(routing.size());
  int64_t cap = 0, first_token = 0;
  std::vector<int64_t> first(routing.size());
  for (int32_t r = 0; r < c.ranks; ++r) {
    routing[r] = make_routing({c.tokens[r], c.top_k, c.experts, 0.1, true, c.zipf, static_cast<std::uint32_t>(100 + r)});
    x[r] = finite_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(200 + r));
    d_out[r] = finite_rows<T>(c.tokens[r], c.hidden, static_cast<std::uint32_t>(300 + r));
    cap = std::max(cap, oracle::capacity(c.tokens[r], c.top_k, c.experts, drops ? capacity_factor(capacity) : 1.0));
    first[r] = first_token;
    first_token += c.tokens[r];
  }
  std::vector<expected_rank<T>> want(routing.size());
  for (int32_t r = 0; r < c.ranks; ++r) {
    int64_t valid = 0;
    for (int32_t e : routing[r].idx) valid += e >= 0 ? 1 : 0;
    auto const kept = drops ? oracle::drop_to_capacity(routing[r], c.experts, cap, rule, random_seed(capacity), 0, first[r]) : routing[r];
    want[r] = layer_oracle(kept, valid, x[r], d_out[r], c.hidden, c.experts);
  }

  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  moecomm::topology const topo(c.ranks, c.per_node);
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    moecomm::host_backend const be;
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    moecomm::expert_parallel_layer<T, moecomm::host_backend, inproc_communicator, Capacity, Algorithm> layer(
        be, groups, c.experts, c.hidden, capacity, algorithm);
    scale_experts<T> const experts{me * (c.experts / c.ranks)};
    auto const& r = routing[me];
    int64_t const tokens = r.tokens;
    moecomm::routing_view const view{r.idx.data(), r.w.data(), tokens, r.top_k};
    auto out = poisoned<T>(tokens * c.hidden);
    layer.forward(view, {x[me].data(), tokens, c.hidden}, {out.data(), tokens, c.hidden}, experts);
    check_bitwise(out, want[me].out, c.hidden, "layer output");
    CHECK(layer.dispatch_state().report().dropped_slots == want[me].dropped);
    auto d_x = poisoned<T>(tokens * c.hidden);
    auto d_w = poisoned<float>(tokens * r.top_k);
    layer.backward({d_out[me].data(), tokens, c.hidden}, {d_x.data(), tokens, c.hidden}, d_w.data(), experts);
    check_bitwise(d_x, want[me].d_x, c.hidden, "input gradient");
    for (std::size_t i = 0; i < d_w.size(); ++i)
      REQUIRE_MESSAGE(std::fabs(d_w[i] - want[me].d_w[i]) <= 1e-5f * std::fabs(want[me].d_w[i]) + 1e-6f * float(c.hidden),
                      "rank ", me, " d_weights[", i, "] = ", d_w[i], ", oracle ", want[me].d_w[i]);
  });
}

template <class T, class Algorithm>
void check_all_capacities(layer_case const& c, Algorithm const& algorithm) {
  using namespace moecomm;
  check_layer<T>(c, dropless{}, algorithm, oracle::drop_rule::position, false);
  check_layer<T>(c, capacity<drop_by_position>{1.0, 0, false, {}}, algorithm, oracle::drop_rule::position, true);
  check_layer<T>(c, capacity<drop_by_probability>{0.5, 0, true, {}}, algorithm, oracle::drop_rule::probability, true);
  check_layer<T>(c, capacity<drop_random>{0.75, 0, false, {42, 0}}, algorithm, oracle::drop_rule::random, true);
}

TEST_CASE("the expert-parallel layer equals the single-process oracle") {
  // Ranks hold different token counts, one of them none.
  for (layer_case const& c : {layer_case{1, 1, 4, 2, 16, {37}, 0.0},
                              layer_case{2, 2, 4, 2, 16, {40, 0}, 1.2},
                              layer_case{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0},
                              layer_case{8, 4, 16, 4, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_all_capacities<float>(c, moecomm::flat{});
    check_all_capacities<float>(c, moecomm::hierarchical_2d{});
    check_all_capacities<float>(c, moecomm::pairwise{1});
  }
}

TEST_CASE("the layer handles bf16 rows, an expert nobody uses and all tokens on one expert") {
  layer_case const skewed{8, 4, 16, 1, 16, {50, 50, 50, 50, 50, 50, 50, 50}, 8.0};  // Zipf 8: almost all to expert 0
  check_all_capacities<__nv_bfloat16>(skewed, moecomm::hierarchical_2d{});
  check_all_capacities<__nv_bfloat16>(skewed, moecomm::flat{});
}

}  // namespace test
