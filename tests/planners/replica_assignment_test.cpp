// SPDX-License-Identifier: Apache-2.0
// Token -> replica assignment (planners/replica_assignment.hpp): FineMoE's Algorithm 1 on a worked
// example and on random counts with the min-max scheduler's split (every replica takes exactly its
// split, every rank sends exactly its tokens, own replica first), the position -> replica map, the
// even split, and errors naming the expert or the count.

#include "../support/test_support.hpp"

#include <moecomm/core/replica_placement.hpp>
#include <moecomm/planners/replica_assignment.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <random>
#include <vector>

namespace test {

using moecomm::replica_assignment;
using moecomm::replica_sets;

moecomm::array_view<std::int64_t const> counts_of(std::vector<std::int64_t> const& v) {
  return {v.data(), static_cast<std::int64_t>(v.size())};
}

TEST_CASE("replica_assignment: FineMoE's Algorithm 1 on a worked example") {
  // 3 ranks; expert 0 on ranks 0 and 2 (split 5 / 5), expert 1 on rank 1 only.
  replica_sets const sets{3, {0, 2, 3}, {0, 2, 1}};
  std::vector<std::int64_t> const counts = {6, 1,   // rank 0
                                            2, 0,   // rank 1
                                            2, 3};  // rank 2
  replica_assignment a;
  moecomm::assign_tokens_finemoe(sets, counts_of(counts), {5, 5, 4}, a);
  // Own replicas first: rank 0 -> 0: min(6, 5) = 5; rank 2 -> 2: min(2, 5) = 2. Then in rank order:
  // rank 0's last token to rank 2's replica, rank 1's two there too.
  CHECK(a.take == std::vector<std::int64_t>{5, 1, 1,   // rank 0: expert 0 to ranks 0 and 2, expert 1 to rank 1
                                            0, 2, 0,   // rank 1
                                            0, 2, 3}); // rank 2
  // Rank 0's six tokens of expert 0: positions 0..4 to its own replica (index 0), 5 to rank 2's.
  for (std::int64_t p = 0; p < 5; ++p) CHECK(a.replica_of(sets, 0, 0, p) == 0);
  CHECK(a.replica_of(sets, 0, 0, 5) == 1);
  CHECK(a.replica_of(sets, 1, 0, 0) == 1);  // rank 1 holds no replica of expert 0
  CHECK(a.replica_of(sets, 2, 0, 1) == 1);  // rank 2's own replica is index 1
  check_error([&] { (void)a.replica_of(sets, 1, 0, 2); }, moecomm::status::invalid_argument,
              {"position 0 is past rank 1's tokens of expert 0"});
}

TEST_CASE("replica_assignment: with the min-max split every replica takes its split and every rank sends its tokens") {
  std::mt19937_64 rng(11);
  for (int instance = 0; instance < 300; ++instance) {
    CAPTURE(instance);
    std::int32_t const R = 2 + static_cast<std::int32_t>(rng() % 7), S = 1 + static_cast<std::int32_t>(rng() % 3);
    std::int32_t const E = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(R * S));
    std::vector<double> expected(static_cast<std::size_t>(E));
    for (double& l : expected) l = static_cast<double>(rng() % 100);
    moecomm::replica_placement const p = moecomm::replica_placement::from_loads(R, S, expected, rng());
    replica_sets const sets = moecomm::replica_sets_of(p);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(R * E)), load(static_cast<std::size_t>(E), 0);
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t e = 0; e < E; ++e) {
        std::int64_t const c = rng() % 4 == 0 ? 0 : static_cast<std::int64_t>(rng() % 50);  // some ranks send nothing
        counts[static_cast<std::size_t>(s * E + e)] = c;
        load[static_cast<std::size_t>(e)] += c;
      }
    moecomm::replica_schedule const schedule = moecomm::schedule_replicas(sets, load);
    replica_assignment a;
    moecomm::assign_tokens_finemoe(sets, counts_of(counts), schedule.split, a);
    std::size_t const K = sets.ranks.size();
    std::vector<std::int64_t> to_replica(K, 0);
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t e = 0; e < E; ++e) {
        std::int64_t sent = 0;
        for (std::int32_t k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k) {
          std::int64_t const t = a.take[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(k)];
          REQUIRE(t >= 0);
          sent += t;
          to_replica[static_cast<std::size_t>(k)] += t;
        }
        REQUIRE(sent == counts[static_cast<std::size_t>(s * E + e)]);
        std::int32_t const own = replica_assignment::own_replica(sets, s, e);
        if (own >= 0)  // own replica first: as much as it takes
          REQUIRE(a.take[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(sets.offsets[static_cast<std::size_t>(e)] + own)] ==
                  std::min(counts[static_cast<std::size_t>(s * E + e)], schedule.split[static_cast<std::size_t>(sets.offsets[static_cast<std::size_t>(e)] + own)]));
        std::vector<std::int64_t> seen(K, 0);  // the position map agrees with `take`
        for (std::int64_t q = 0; q < counts[static_cast<std::size_t>(s * E + e)]; ++q)
          ++seen[static_cast<std::size_t>(sets.offsets[static_cast<std::size_t>(e)] + a.replica_of(sets, s, e, q))];
        for (std::int32_t k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k)
          REQUIRE(seen[static_cast<std::size_t>(k)] == a.take[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(k)]);
      }
    CHECK(to_replica == schedule.split);
  }
}

TEST_CASE("replica_assignment: FlexMoE's even split differs by at most one token per replica") {
  replica_sets const sets{4, {0, 3, 4}, {0, 1, 3, 2}};
  std::vector<std::int64_t> const counts = {7, 1, 0, 5, 2, 2, 3, 0};
  replica_assignment a;
  moecomm::assign_tokens_evenly(sets, counts_of(counts), a);
  CHECK(a.take == std::vector<std::int64_t>{3, 2, 2, 1,   // rank 0: 7 over 3 replicas, 1 to the only one
                                            0, 0, 0, 5,   // rank 1
                                            1, 1, 0, 2,   // rank 2
                                            1, 1, 1, 0}); // rank 3
}

TEST_CASE("replica_assignment: errors name the expert or the count") {
  replica_sets const sets{2, {0, 1, 2}, {0, 1}};
  std::vector<std::int64_t> const counts = {1, 2, 3, -4};
  replica_assignment a;
  check_error([&] { moecomm::assign_tokens_evenly(sets, counts_of(counts), a); }, moecomm::status::invalid_argument,
              {"moecomm::assign_tokens_evenly: counts[1][1] = -4 is negative"});
  std::vector<std::int64_t> const good = {1, 2, 3, 4};
  check_error([&] { moecomm::assign_tokens_finemoe(sets, counts_of(good), {4, 5}, a); }, moecomm::status::invalid_argument,
              {"expert 1's split takes 5 tokens, its ranks send 6"});
  check_error([&] { moecomm::assign_tokens_finemoe(sets, counts_of(good), {4}, a); }, moecomm::status::invalid_argument,
              {"split has 1 entries, the replicas 2"});
  std::vector<std::int64_t> const short_counts = {1, 2, 3};  // a rank's row cut short: refused, never read past
  check_error([&] { moecomm::assign_tokens_evenly(sets, counts_of(short_counts), a); }, moecomm::status::invalid_argument,
              {"argument 'counts' has 3 entries, ranks x experts = 4"});
}

}  // namespace test
