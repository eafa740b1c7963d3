// SPDX-License-Identifier: Apache-2.0
// Capacity policies on their worked examples (semantics §7, §8): the capacity formula's evaluation
// order, Example D1 for both deterministic drop rules, and Philox against Random123's known answers.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/ops/dispatcher.hpp>

namespace test {

TEST_CASE("capacity is ceil((T*K / E) * cf), division first, in double") {
  CHECK(moecomm::detail::local_capacity(25, 2, 5, 1.1, 0) == 11);  // cf*T*K/E would give 12
  CHECK(moecomm::detail::local_capacity(4, 2, 3, 1.0, 0) == 3);
  CHECK(moecomm::detail::local_capacity(4, 2, 3, 0.5, 0) == 2);
  CHECK(moecomm::detail::local_capacity(4, 2, 3, 0.5, 5) == 5);  // min_capacity
  CHECK(moecomm::detail::local_capacity(0, 2, 3, 1.0, 0) == 0);
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

// Example P1 routed with C = 2 (cf = 0.75: ceil(8 / 3 * 0.75) = 2) on one rank; returns row_of.
template <class Rule>
std::vector<int32_t> d1_row_of(Rule rule, std::vector<float> weights) {
  std::vector<int32_t> row_of;
  moecomm::inproc_world const world(1);
  world.run([&](moecomm::inproc_communicator comm) {
    std::vector<int32_t> const idx{2, 0, 1, -1, 0, 2, 1, 0};
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::capacity<Rule>> d(
        moecomm::host_backend{}, groups, 3, moecomm::capacity<Rule>{0.75, 0, false, rule});
    d.route({idx.data(), weights.data(), 4, 2});
    CHECK(d.report().capacity == 2);
    CHECK(d.report().dropped_slots == 1);
    row_of.assign(d.plan().row_of(), d.plan().row_of() + 8);
  });
  return row_of;
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
