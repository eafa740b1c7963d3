// SPDX-License-Identifier: Apache-2.0
// Replica placements (core/replica_placement.hpp): the rules every placement keeps (>= 1 replica per
// expert, one local index per expert, one replica per slot), each constructor's shape, and errors
// naming the slot or expert that breaks a rule.

#include "../support/test_support.hpp"

#include <moecomm/core/placement.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <algorithm>
#include <set>
#include <vector>

namespace test {

using moecomm::replica_placement;

// The rules of the file comment, checked from the slots alone.
void check_rules(replica_placement const& p) {
  std::vector<std::set<std::int32_t>> ranks(static_cast<std::size_t>(p.num_experts()));
  for (std::int32_t r = 0; r < p.num_ranks(); ++r)
    for (std::int32_t l = 0; l < p.slots_per_rank(); ++l) {
      std::int32_t const e = p.expert_at(r, l);
      if (e < 0) continue;
      CHECK(p.local_index_of(e) == l);
      ranks[static_cast<std::size_t>(e)].insert(r);
    }
  for (std::int32_t e = 0; e < p.num_experts(); ++e) {
    CAPTURE(e);
    auto const& g = ranks[static_cast<std::size_t>(e)];
    REQUIRE(!g.empty());
    CHECK(p.replica_count(e) == static_cast<std::int32_t>(g.size()));
    std::vector<std::int32_t> const listed(p.replica_ranks().begin() + p.replica_offsets()[static_cast<std::size_t>(e)],
                                           p.replica_ranks().begin() + p.replica_offsets()[static_cast<std::size_t>(e) + 1]);
    CHECK(listed == std::vector<std::int32_t>(g.begin(), g.end()));  // ascending, each rank once
  }
}

TEST_CASE("replica_placement: contiguous is today's expert parallelism") {
  replica_placement const p = replica_placement::contiguous(12, 4);
  moecomm::contiguous_placement const plain(12, 4);
  check_rules(p);
  CHECK(p.slots_per_rank() == 3);
  for (std::int32_t e = 0; e < 12; ++e) {
    CHECK(p.replica_count(e) == 1);
    CHECK(p.replica_ranks()[static_cast<std::size_t>(e)] == plain.rank_of(e));
    CHECK(p.local_index_of(e) == plain.local_index_of(e));
  }
}

TEST_CASE("replica_placement: cyclic tiles every slot row, r replicas each, and rows intersect differently") {
  for (auto const [R, S, r] : {std::array<std::int32_t, 3>{8, 2, 2}, {8, 4, 2}, {16, 3, 4}, {12, 5, 3}, {6, 1, 6}, {5, 2, 1}}) {
    CAPTURE(R);
    CAPTURE(S);
    CAPTURE(r);
    replica_placement const p = replica_placement::cyclic(R, S, r);
    check_rules(p);
    CHECK(p.num_experts() == R * S / r);
    for (std::int32_t e = 0; e < p.num_experts(); ++e) CHECK(p.replica_count(e) == r);
    for (std::int32_t rank = 0; rank < R; ++rank)
      for (std::int32_t l = 0; l < S; ++l) CHECK(p.expert_at(rank, l) >= 0);  // no empty slot
  }
  // R 8, r 2: row 0 steps by 1 ({0,1}, {2,3}, ...), row 1 by 2 ({0,2}, {1,3}, {4,6}, ...): an expert
  // of row 0 and one of row 1 share exactly one rank, not both.
  replica_placement const p = replica_placement::cyclic(8, 2, 2);
  auto group = [&](std::int32_t e) {
    auto const b = p.replica_ranks().begin();
    return std::vector<std::int32_t>(b + p.replica_offsets()[static_cast<std::size_t>(e)], b + p.replica_offsets()[static_cast<std::size_t>(e) + 1]);
  };
  CHECK(group(0) == std::vector<std::int32_t>{0, 1});
  CHECK(group(4) == std::vector<std::int32_t>{0, 2});
  CHECK(group(5) == std::vector<std::int32_t>{1, 3});
}

TEST_CASE("replica_placement: from_loads gives hot experts more replicas, fills the slots, and draws ranks by seed") {
  std::vector<double> loads;
  for (std::int32_t e = 0; e < 16; ++e) loads.push_back(1000.0 / std::pow(e + 1.0, 1.2));  // Zipf 1.2
  replica_placement const p = replica_placement::from_loads(8, 4, loads, 7);
  check_rules(p);
  std::int32_t replicas = 0;
  for (std::int32_t e = 0; e < 16; ++e) replicas += p.replica_count(e);
  CHECK(replicas == 32);                                // every slot used
  CHECK(p.replica_count(0) > p.replica_count(15));      // the hottest expert has more replicas
  CHECK(p.replica_count(0) >= 3);
  for (std::int32_t e = 0; e < 16; ++e) CHECK(p.replica_count(e) >= 1);
  // The same seed gives the same placement; another seed moves the replicas.
  replica_placement const same = replica_placement::from_loads(8, 4, loads, 7);
  replica_placement const other = replica_placement::from_loads(8, 4, loads, 8);
  CHECK(same.replica_ranks() == p.replica_ranks());
  CHECK(other.replica_ranks() != p.replica_ranks());
  // Uniform loads over as many experts as slots: one replica each.
  replica_placement const flat = replica_placement::from_loads(4, 2, std::vector<double>(8, 1.0), 1);
  for (std::int32_t e = 0; e < 8; ++e) CHECK(flat.replica_count(e) == 1);
  // Zipf 8: almost everything on expert 0, which gets a replica on every rank of its row.
  std::vector<double> extreme;
  for (std::int32_t e = 0; e < 8; ++e) extreme.push_back(std::pow(e + 1.0, -8.0));
  replica_placement const hot = replica_placement::from_loads(4, 4, extreme, 3);
  check_rules(hot);
  CHECK(hot.replica_count(0) == 4);
}

TEST_CASE("replica_placement: the min-max scheduler takes a placement's replica sets") {
  replica_placement const p = replica_placement::cyclic(8, 2, 2);
  std::vector<std::int64_t> load(static_cast<std::size_t>(p.num_experts()), 0);
  load[0] = 100;  // expert 0 on ranks 0 and 1: 50 each
  moecomm::replica_schedule const s = moecomm::schedule_replicas(moecomm::replica_sets_of(p), load);
  CHECK(s.bound == 50);
}

TEST_CASE("replica_placement: errors name the slot or the expert that breaks a rule") {
  using slots = std::vector<std::int32_t>;
  check_error([] { replica_placement p(2, 2, 1, slots{0, 0, 1}); }, moecomm::status::invalid_argument,
              {"slot_expert has 3 entries, ranks x slots = 2"});
  check_error([] { replica_placement p(2, 2, 1, slots{0, 5}); }, moecomm::status::invalid_argument,
              {"slot (rank 1, local 0) holds expert 5, not in [0, 2)"});
  check_error([] { replica_placement p(2, 2, 2, slots{0, 1, 1, -1}); }, moecomm::status::invalid_argument,
              {"expert 1 has replicas at local indices 1 and 0"});
  check_error([] { replica_placement p(3, 2, 1, slots{0, 1}); }, moecomm::status::invalid_argument, {"expert 2 has no replica"});
  check_error([] { (void)replica_placement::cyclic(8, 2, 3); }, moecomm::status::invalid_argument,
              {"replica_placement::cyclic: replicas = 3 must divide num_ranks = 8"});
  check_error([] { (void)replica_placement::from_loads(2, 1, std::vector<double>(3, 1.0), 0); }, moecomm::status::invalid_argument,
              {"loads has 3 experts: between 1 and ranks x slots = 2"});
  check_error([] { (void)replica_placement::from_loads(2, 2, {1.0, -1.0}, 0); }, moecomm::status::invalid_argument,
              {"loads[1] = -1 must be >= 0"});
}

}  // namespace test
