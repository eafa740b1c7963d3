// SPDX-License-Identifier: Apache-2.0
// The layer as a trainer calls it: the short construction form (only the policies that differ, in
// any order, Comm deduced), errors that name the caller's own argument before any communication,
// outputs declined with `not_needed`, no partial outputs after a failed backward, and a layer that
// is reusable, with bit-identical results, after an invalid argument.

#include "layer_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/layer_policies.hpp>

#include <chrono>
#include <stdexcept>

namespace test {

using moecomm::host_backend;
using moecomm::inproc_communicator;
using drop = moecomm::capacity<moecomm::drop_by_position>;

// The short form names only what differs, in any order; the type is the full positional one.
static_assert(std::is_same_v<moecomm::expert_parallel_layer_of<float, host_backend, inproc_communicator>,
                             moecomm::expert_parallel_layer<float, host_backend, inproc_communicator>>);
static_assert(std::is_same_v<moecomm::expert_parallel_layer_of<float, host_backend, inproc_communicator,
                                                               moecomm::fastermoe_shadowing<>, moecomm::hierarchical_2d>,
                             moecomm::expert_parallel_layer<float, host_backend, inproc_communicator, moecomm::dropless,
                                                            moecomm::hierarchical_2d, moecomm::weighted,
                                                            moecomm::fastermoe_shadowing<>>>);
static_assert(std::is_same_v<moecomm::expert_parallel_layer_of<float, host_backend, inproc_communicator,
                                                               moecomm::unweighted, drop, moecomm::pairwise>,
                             moecomm::expert_parallel_layer<float, host_backend, inproc_communicator, drop,
                                                            moecomm::pairwise, moecomm::unweighted>>);

TEST_CASE("make_expert_parallel_layer: policies by value in any order, equal to the positional form") {
  layer_case const c{4, 2, 8, 2, 16, {30, 1, 0, 57}, 1.2};
  drop const capacity{1.0, 0, true, {}};
  auto const in = make_layer_inputs<float>(c, capacity, oracle::drop_rule::position, true);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](inproc_communicator comm) {
    moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
    auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden,
                                                            moecomm::hierarchical_2d{}, capacity);
    static_assert(std::is_same_v<decltype(layer), moecomm::expert_parallel_layer<float, host_backend, inproc_communicator,
                                                                                  drop, moecomm::hierarchical_2d>>);
    check_layer_step(layer, comm.rank(), c, in);  // the capacity value (pad_to_capacity) reached the layer
  });
}

// One rank's buffers for a step with `tokens` tokens.
struct step_buffers {
  std::vector<float> out, d_x, d_w;
  step_buffers(int64_t tokens, int64_t hidden, int32_t top_k)
      : out(poisoned<float>(tokens * hidden)), d_x(poisoned<float>(tokens * hidden)), d_w(poisoned<float>(tokens * top_k)) {}
};

// A small case on 2 in-process ranks: `body(groups, rank, its routing, x, d_out, the oracle's
// result, buffers, experts)` on each.
template <class Body>
void on_two_ranks(Body&& body) {
  layer_case const c{2, 2, 4, 2, 8, {5, 3}, 0.0};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    auto const& r = in.routing[me];
    moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(2, 2));
    step_buffers b(r.tokens, c.hidden, r.top_k);
    body(groups, me, r, moecomm::matrix_view<float const>{in.x[me].data(), r.tokens, c.hidden},
         moecomm::matrix_view<float const>{in.d_out[me].data(), r.tokens, c.hidden}, in.want[me], b, scale_experts<float>{me * 2});
  });
}
constexpr int32_t two_rank_experts = 4;
constexpr int64_t two_rank_hidden = 8;

TEST_CASE("the layer names the caller's argument and the call, before any communication") {
  on_two_ranks([](auto& groups, int32_t, auto const& r, auto x, auto d_out, auto const& want, step_buffers& b, auto const& experts) {
    int64_t const T = r.tokens, H = two_rank_hidden;
    auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, H);
    moecomm::routing_view const routing{r.idx.data(), r.w.data(), T, r.top_k};
    auto const untouched = b.d_w;

    check_error([&] { layer.backward(d_out, moecomm::matrix_view<float>{b.d_x.data(), T, H}, b.d_w, experts); },
                moecomm::status::invalid_usage, {"moecomm::expert_parallel_layer::backward", "without a successful forward"});
    check_error([&] { layer.forward(routing, {x.data, T, H / 2}, {b.out.data(), T, H}, experts); },
                moecomm::status::invalid_argument,
                {"moecomm::expert_parallel_layer::forward", "argument 'x' has hidden = 4, the layer's hidden = 8"});
    check_error([&] { layer.forward(routing, {x.data, T - 1, H}, {b.out.data(), T, H}, experts); },
                moecomm::status::invalid_argument, {"argument 'x' has ", " rows; needs at least "});
    check_error([&] { layer.forward(routing, x, {b.out.data(), T, H + 1}, experts); }, moecomm::status::invalid_argument,
                {"argument 'out' has hidden = 9, the layer's hidden = 8"});
    layer.forward(routing, x, {b.out.data(), T, H}, experts);
    check_bitwise(b.out, want.out, H, "output after the rejected calls");
    // The trainer's mistake that once overflowed the heap: a routing-weight gradient of T floats.
    check_error([&] { layer.backward(d_out, {b.d_x.data(), T, H}, moecomm::array_view<float>{b.d_w.data(), T}, experts); },
                moecomm::status::invalid_argument,
                {"moecomm::expert_parallel_layer::backward", "argument 'd_weights' has ",
                 "needs at least " + std::to_string(T * r.top_k)});
    check_error([&] { layer.backward(d_out, moecomm::matrix_view<float>{}, b.d_w, experts); },
                moecomm::status::invalid_argument, {"argument 'd_x' has 0 rows; needs at least"});
    check_error([&] { layer.backward({d_out.data, T, H + 2}, {b.d_x.data(), T, H}, b.d_w, experts); },
                moecomm::status::invalid_argument, {"argument 'd_out' has hidden = 10, the layer's hidden = 8"});
    check_bitwise(b.d_w, untouched, 1, "d_weights after the rejected calls");
    check_bitwise(b.d_x, poisoned<float>(T * H), H, "d_x after the rejected calls");
    // Still usable, and bit for bit right.
    layer.backward(d_out, {b.d_x.data(), T, H}, b.d_w, experts);
    check_bitwise(b.d_x, want.d_x, H, "input gradient after the rejected calls");
  });
}

TEST_CASE("outputs a trainer does not need are declined with not_needed; the others are unchanged") {
  layer_case const c{4, 2, 8, 2, 16, {30, 1, 0, 57}, 1.2};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    auto const& r = in.routing[me];
    int64_t const T = r.tokens, H = c.hidden;
    moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(4, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, H, moecomm::pairwise{2});
    scale_experts<float> const experts{me * 2};
    step_buffers b(T, H, r.top_k);
    moecomm::matrix_view<float const> const d_out{in.d_out[me].data(), T, H};
    for (int step = 0; step < 3; ++step) {  // every combination on one layer: d_x only, d_w only, neither
      layer.forward({r.idx.data(), r.w.data(), T, r.top_k}, {in.x[me].data(), T, H}, {b.out.data(), T, H}, experts);
      b.d_x = poisoned<float>(T * H);
      b.d_w = poisoned<float>(T * r.top_k);
      if (step == 0) layer.backward(d_out, {b.d_x.data(), T, H}, moecomm::not_needed, experts);
      if (step == 1) layer.backward(d_out, moecomm::not_needed, b.d_w, experts);
      if (step == 2) layer.backward(d_out, moecomm::not_needed, moecomm::not_needed, experts);
      check_bitwise(b.d_x, step == 0 ? in.want[me].d_x : poisoned<float>(T * H), H, "d_x");
      if (step == 1)
        for (std::size_t i = 0; i < b.d_w.size(); ++i)
          REQUIRE(std::fabs(b.d_w[i] - in.want[me].d_w[i]) <= 1e-5f * std::fabs(in.want[me].d_w[i]) + 1e-6f * float(H));
      else
        check_bitwise(b.d_w, poisoned<float>(T * r.top_k), 1, "declined d_weights");
    }
  });
}

// An expert that fails in its backward on one rank: every rank ends with an error, and no rank's
// d_x or d_weights holds a partial result.
struct failing_backward_experts : scale_experts<float> {
  bool fail;
  using scale_experts<float>::operator();
  void operator()(int32_t l, moecomm::matrix_view<float const> in, moecomm::matrix_view<float const> d_out,
                  moecomm::matrix_view<float> d_in) const {
    if (fail) throw std::runtime_error("expert backward failed");
    scale_experts<float>::operator()(l, in, d_out, d_in);
  }
};

TEST_CASE("a backward that fails leaves d_x and d_weights untouched on every rank") {
  layer_case const c{4, 2, 8, 2, 16, {30, 9, 4, 57}, 0.0};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  for (bool pipelined : {false, true}) {
    CAPTURE(pipelined);
    std::vector<step_buffers> b;
    for (int32_t me = 0; me < 4; ++me) b.emplace_back(in.routing[me].tokens, c.hidden, 2);
    moecomm::inproc_world const world(4, std::chrono::seconds(30));
    auto step = [&](inproc_communicator comm, auto& layer) {
      int32_t const me = comm.rank();
      auto const& r = in.routing[me];
      int64_t const T = r.tokens, H = c.hidden;
      failing_backward_experts const experts{{me * 2}, me == 2};
      layer.forward({r.idx.data(), r.w.data(), T, r.top_k}, {in.x[me].data(), T, H}, {b[me].out.data(), T, H}, experts);
      layer.backward({in.d_out[me].data(), T, H}, {b[me].d_x.data(), T, H}, b[me].d_w, experts);
    };
    CHECK_THROWS_AS(world.run([&](inproc_communicator comm) {
      moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(4, 2));
      if (pipelined) {
        auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden,
                                                                moecomm::smart_schedule{2});
        step(comm, layer);
      } else {
        auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden);
        step(comm, layer);
      }
    }),
                    std::exception);
    for (int32_t me = 0; me < 4; ++me) {
      CAPTURE(me);
      check_bitwise(b[me].d_x, poisoned<float>(in.routing[me].tokens * c.hidden), c.hidden, "d_x after a failed backward");
      check_bitwise(b[me].d_w, poisoned<float>(in.routing[me].tokens * 2), 1, "d_weights after a failed backward");
    }
  }
}

TEST_CASE("after an invalid argument on every rank the same layer gives bit-identical results") {
  layer_case const c{4, 2, 8, 2, 16, {30, 1, 0, 57}, 1.2};
  drop const capacity{1.0, 0, false, {}};
  auto const in = make_layer_inputs<float>(c, capacity, oracle::drop_rule::position, true);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](inproc_communicator comm) {
    moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(4, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden, capacity,
                                                            moecomm::hierarchical_2d{});
    int32_t const me = comm.rank();
    auto const& r = in.routing[me];
    for (int retry = 0; retry < 20; ++retry) {
      std::vector<float> short_w(static_cast<std::size_t>(r.tokens));
      step_buffers b(r.tokens, c.hidden, r.top_k);
      scale_experts<float> const experts{me * 2};
      CHECK_THROWS_AS(layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[me].data(), r.tokens, c.hidden - 1},
                                    {b.out.data(), r.tokens, c.hidden}, experts),
                      moecomm::error);
      check_layer_step(layer, me, c, in);
    }
  });
}

// What differs between ranks is refused on every rank with one error naming it.
TEST_CASE("ranks that pass different exchange algorithms are refused at construction, naming both algorithms") {
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](inproc_communicator comm) {
    moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(2, 2));
    auto make = [&](auto algorithm) { (void)moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, 4, 8, algorithm); };
    std::vector<std::string> const names = {"moecomm::dispatcher: ranks disagree on the exchange algorithm: rank 0 has 'flat', "
                                            "but rank 1 has 'dedup_per_rank<pairwise>'"};
    if (comm.rank() == 0) check_error([&] { make(moecomm::flat{}); }, moecomm::status::invalid_usage, names);
    else check_error([&] { make(moecomm::dedup_per_rank<moecomm::pairwise>{}); }, moecomm::status::invalid_usage, names);
  });
}

TEST_CASE("a deduplicated exchange refuses a top_k that differs per rank, naming both ranks; flat accepts it") {
  on_two_ranks([](auto& groups, int32_t me, auto const& r, auto x, auto, auto const& want, step_buffers& b, auto const& experts) {
    // Rank 1 routes each token to its first expert only.
    std::vector<int32_t> idx;
    std::vector<float> w;
    for (int64_t t = 0; t < r.tokens; ++t) {
      idx.push_back(r.idx[static_cast<std::size_t>(t * r.top_k)]);
      w.push_back(r.w[static_cast<std::size_t>(t * r.top_k)]);
    }
    moecomm::routing_view const routing = me == 0 ? moecomm::routing_view{r.idx.data(), r.w.data(), r.tokens, r.top_k}
                                                  : moecomm::routing_view{idx.data(), w.data(), r.tokens, 1};
    moecomm::matrix_view<float> const out{b.out.data(), r.tokens, two_rank_hidden};
    auto dedup = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, two_rank_hidden,
                                                            moecomm::dedup_per_rank<>{});
    check_error([&] { dedup.forward(routing, x, out, experts); }, moecomm::status::invalid_usage,
                {"moecomm::dispatcher::route: rank 0 routes with routing.top_k = 2, but rank 1 with routing.top_k = 1: the "
                 "deduplicated exchange (dedup_per_rank<flat>) needs the same top_k on every rank"});
    auto flat = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, two_rank_hidden);
    flat.set_training(false);
    flat.forward(routing, x, out, experts);
    if (me == 0) check_bitwise(b.out, want.out, two_rank_hidden, "flat output beside a peer with another top_k");
  });
}

TEST_CASE("two layers called in another order on one rank fail at their first collective on every rank, naming both layers") {
  on_two_ranks([](auto& groups, int32_t me, auto const& r, auto x, auto, auto const&, step_buffers& b, auto const& experts) {
    auto first = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, two_rank_hidden);
    auto second = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, two_rank_hidden);
    CHECK(first.layer_number() == 1);
    CHECK(second.layer_number() == 2);
    auto& called = me == 0 ? first : second;  // rank 1 calls the second layer first
    check_error([&] { called.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, x, {b.out.data(), r.tokens, two_rank_hidden}, experts); },
                moecomm::status::invalid_usage,
                {"ranks are in different calls: world rank 0 is in expert_parallel_layer::forward of layer 1 (step 1), but world "
                 "rank 1 is in expert_parallel_layer::forward of layer 2 (step 1)"});
  });
}

TEST_CASE("reserve between a forward and its backward is refused, naming the step; the backward then runs") {
  on_two_ranks([](auto& groups, int32_t, auto const& r, auto x, auto d_out, auto const& want, step_buffers& b, auto const& experts) {
    auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, two_rank_experts, two_rank_hidden);
    layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, x, {b.out.data(), r.tokens, two_rank_hidden}, experts);
    check_error([&] { layer.reserve(moecomm::step_bounds{64, 2}); }, moecomm::status::invalid_usage,
                {"moecomm::expert_parallel_layer::reserve: called between step 1's forward and its backward"});
    layer.backward(d_out, {b.d_x.data(), r.tokens, two_rank_hidden}, b.d_w, experts);
    check_bitwise(b.d_x, want.d_x, two_rank_hidden, "input gradient after the refused reserve");
    layer.reserve(moecomm::step_bounds{64, 2});  // after the backward: allowed
  });
}

}  // namespace test
