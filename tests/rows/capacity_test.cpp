// SPDX-License-Identifier: Apache-2.0
// Capacity policies on their worked examples (semantics §7, §8): the capacity formula's evaluation
// order, Example D1 for both deterministic drop rules, and Philox against Random123's known answers.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/dispatch/dispatcher.hpp>

#include <cmath>
#include <limits>

namespace test {

TEST_CASE("capacity is ceil((T*K / E) * cf), division first, in double") {
  CHECK(moecomm::expert_capacity(25, 2, 5, 1.1, 0) == 11);  // cf*T*K/E would give 12
  CHECK(moecomm::expert_capacity(4, 2, 3, 1.0, 0) == 3);
  CHECK(moecomm::expert_capacity(4, 2, 3, 0.5, 0) == 2);
  CHECK(moecomm::expert_capacity(4, 2, 3, 0.5, 5) == 5);  // min_capacity
  CHECK(moecomm::expert_capacity(0, 2, 3, 1.0, 0) == 0);
  CHECK(moecomm::expert_capacity(7, 1, 16, 0.0, 3) == 3);  // factor 0: a fixed capacity
}

// The factors that once made the cast undefined and silently dropped every slot (capacity became
// min_capacity = 0), and the other values no capacity can come from.
TEST_CASE("expert_capacity rejects factors and minima that give no defined capacity") {
  double const inf = std::numeric_limits<double>::infinity();
  for (double factor : {std::nan(""), inf, -inf, -0.5}) {
    CAPTURE(factor);
    check_error([&] { (void)moecomm::expert_capacity(64, 2, 16, factor, 0); }, moecomm::status::invalid_argument,
                {"moecomm::expert_capacity", "capacity factor = ", "must be a finite number >= 0"});
  }
  check_error([&] { (void)moecomm::expert_capacity(64, 2, 16, 1e18, 0); }, moecomm::status::invalid_argument,
              {"capacity factor = 1e+18 gives a capacity of 8e+18 rows per expert, at or beyond the limit of 2^62"});
  check_error([&] { (void)moecomm::expert_capacity(64, 2, 16, 1.0, -1); }, moecomm::status::invalid_argument,
              {"min_capacity = -1 must be >= 0"});
  check_error([&] { (void)moecomm::expert_capacity(std::int64_t{1} << 62, 4, 16, 1.0, 0); },
              moecomm::status::invalid_argument, {"num_tokens * top_k = 4611686018427387904 * 4 overflows int64"});
}

// The same inputs through the dispatcher: every rank fails before the capacity is agreed, so no
// rank waits for another.
TEST_CASE("a layer's capacity policy is validated on every rank before any exchange") {
  using policy = moecomm::capacity<moecomm::drop_by_position>;
  std::vector<int32_t> const idx{2, 0, 1, -1, 0, 2, 1, 0};
  std::vector<float> const w(8, .5f);
  for (policy const bad : {policy{std::nan("")}, policy{-1.0}, policy{1.0, -3}}) {
    moecomm::inproc_world const world(2, std::chrono::seconds(5));
    CHECK_THROWS_WITH_AS(world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(2, 2));
      moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, policy> d(moecomm::host_backend{}, groups,
                                                                                         4, bad);
      d.route({idx.data(), w.data(), 4, 2});
    }),
                         doctest::Contains("moecomm::dispatcher::route: capacity."), moecomm::error);
  }
}

// The fuzzing report's crash through a layer's policy: with pad_to_capacity, C * E wrapped, the
// size check passed and a null pointer was written; with zero tokens received_rows() was negative.
// Now the agreed C (the same on every rank) is refused by the padded plan on every rank, so no rank
// waits for another; a factor of 1e18 with zero tokens is a capacity of 0.
TEST_CASE("a padded capacity whose rows overflow is invalid_argument on every rank, with and without tokens") {
  using policy = moecomm::capacity<moecomm::drop_by_position>;
  constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
  struct hostile {
    policy p;
    std::int64_t tokens;
    char const* message;  // "" when the call is valid
  };
  hostile const cases[] = {
      {{1.0, int64_max, true, {}}, 4, "padded_capacity * num_experts = 9223372036854775807 * 16 overflows int64"},
      {{1.0, int64_max, true, {}}, 0, "padded_capacity * num_experts = 9223372036854775807 * 16 overflows int64"},
      {{1e18, 0, true, {}}, 4, "padded_capacity * num_experts = 8000000000000000000 exceeds int32 (2^31 - 1)"},
      {{1e18, 0, true, {}}, 64, "capacity factor = 1e+18 gives a capacity of 8e+18 rows per expert, at or beyond the limit of 2^62"},
      {{1e18, 0, true, {}}, 0, ""},
  };
  for (hostile const& h : cases) {
    CAPTURE(h.p.factor);
    CAPTURE(h.p.min_capacity);
    CAPTURE(h.tokens);
    std::vector<int32_t> idx(static_cast<std::size_t>(h.tokens * 2));
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % 16);
    std::vector<float> const w(idx.size(), .5f);
    std::vector<std::int64_t> received(2, -1);
    moecomm::inproc_world const world(2, std::chrono::seconds(5));
    auto const step = [&] {
      world.run([&](moecomm::inproc_communicator comm) {
        moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(2, 2));
        moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, policy> d(moecomm::host_backend{}, groups,
                                                                                           16, h.p);
        d.route({idx.data(), w.data(), h.tokens, 2});
        received[static_cast<std::size_t>(comm.rank())] = d.received_rows();
      });
    };
    if (*h.message == '\0') {
      step();
      CHECK(received == std::vector<std::int64_t>{0, 0});
    } else {
      check_error(step, moecomm::status::invalid_argument, {h.message});
      CHECK(received == std::vector<std::int64_t>{-1, -1});
    }
  }
}

TEST_CASE("Philox4x32-10 matches Random123's known answers") {
  auto const zero = moecomm::detail::philox4x32_10(0, {{0, 0, 0, 0}});
  CHECK(zero.x[0] == 0x6627e8d5u);
  CHECK(zero.x[1] == 0xe169c58du);
  CHECK(zero.x[2] == 0xbc57ac4cu);
  CHECK(zero.x[3] == 0x9b00dbd8u);
  auto const ones = moecomm::detail::philox4x32_10(~std::uint64_t{0}, {{~0u, ~0u, ~0u, ~0u}});
  CHECK(ones.x[0] == 0x408f276du);
  CHECK(ones.x[1] == 0x41c83b0eu);
  CHECK(ones.x[2] == 0xa20bc7c6u);
  CHECK(ones.x[3] == 0x6d5451fdu);
}

// Example P1 routed with C = 2 (cf = 0.75: ceil(8 / 3 * 0.75) = 2) on one rank, by the standalone
// primitive and by the dispatcher; returns the kept plan's row_of (both must agree).
template <class Rule>
std::vector<int32_t> d1_row_of(Rule rule, std::vector<float> weights) {
  std::vector<int32_t> const idx{2, 0, 1, -1, 0, 2, 1, 0};
  moecomm::host_backend const be;
  moecomm::routing_view const routing{idx.data(), weights.data(), 4, 2};
  auto const all = moecomm::make_permute_plan(be, routing, 3);
  std::int64_t const c = moecomm::expert_capacity(4, 2, 3, 0.75, 0);
  CHECK(c == 2);
  std::vector<int32_t> kept_idx(8, 99);
  moecomm::workspace<moecomm::host_backend> scratch;
  auto const result = moecomm::drop_to_capacity(be, all, c, moecomm::array_view<int32_t>(kept_idx), scratch, rule);
  CHECK(result.kept_slots == 6);
  CHECK(result.dropped_slots == 1);
  moecomm::routing_view kept = routing;
  kept.topk_idx = kept_idx.data();
  auto const plan = moecomm::make_permute_plan(be, kept, 3);
  std::vector<int32_t> const standalone(plan.row_of(), plan.row_of() + 8);

  std::vector<int32_t> row_of;
  moecomm::inproc_world const world(1);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::capacity<Rule>> d(
        moecomm::host_backend{}, groups, 3, moecomm::capacity<Rule>{0.75, 0, false, rule});
    d.route(routing);
    CHECK(d.report().capacity == 2);
    CHECK(d.report().dropped_slots == 1);
    row_of.assign(d.plan().row_of(), d.plan().row_of() + 8);
  });
  CHECK(row_of == standalone);
  return row_of;
}

TEST_CASE("drop_to_capacity checks its output's size and its plan") {
  std::vector<int32_t> const idx{2, 0, 1, -1, 0, 2, 1, 0};
  moecomm::host_backend const be;
  auto const all = moecomm::make_permute_plan(be, moecomm::routing_view{idx.data(), nullptr, 4, 2}, 3);
  std::vector<int32_t> kept(7, 99);
  moecomm::workspace<moecomm::host_backend> scratch;
  check_error([&] { (void)moecomm::drop_to_capacity(be, all, 2, moecomm::array_view<int32_t>(kept), scratch); },
              moecomm::status::invalid_argument,
              {"moecomm::drop_to_capacity", "argument 'kept_topk_idx' has 7 elements; needs at least 8"});
  CHECK(kept == std::vector<int32_t>(7, 99));
  kept.resize(8, 99);
  check_error([&] { (void)moecomm::drop_to_capacity(be, all, 2, moecomm::array_view<int32_t>(kept), scratch,
                                                    moecomm::drop_by_probability{}); },
              moecomm::status::invalid_argument, {"drop_by_probability needs topk_weights"});
  check_error([&] { (void)moecomm::drop_to_capacity(be, all, -1, moecomm::array_view<int32_t>(kept), scratch); },
              moecomm::status::invalid_argument, {"capacity = -1 must be >= 0"});
}

TEST_CASE("drop rules reproduce semantics example D1") {
  std::vector<float> const w{.6f, .4f, 1.f, 0.f, .7f, .3f, .5f, .5f};
  CHECK(d1_row_of(moecomm::drop_by_position{}, w) == std::vector<int32_t>{4, 0, 2, -1, 1, 5, 3, -1});
  CHECK(d1_row_of(moecomm::drop_by_probability{}, w) == std::vector<int32_t>{4, -1, 2, -1, 0, 5, 3, 1});
  // "If w[0][1] were .5 (a tie with t3), by_probability keeps t2 and t0."
  std::vector<float> tie = w;
  tie[1] = .5f;
  CHECK(d1_row_of(moecomm::drop_by_probability{}, tie) == std::vector<int32_t>{4, 0, 2, -1, 1, 5, 3, -1});
}

}  // namespace test
