// SPDX-License-Identifier: Apache-2.0
// FineMoE's token scheduling over replicas (arXiv 2511.16947 §5.1, App. A.1): hand-worked cases,
// edge cases, and random instances against eq. 3 computed by brute force over rank subsets; the
// communication-aware variant on hand-worked cases and against exhaustive enumeration of every
// integral routing of small instances. The LP-solver oracle (GLPK) is replica_schedule_lp_test.cpp.

#include "../support/test_support.hpp"
#include "replica_schedule_cases.hpp"

#include <moecomm/core/topology.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <functional>
#include <limits>

namespace test {

using moecomm::link_weights;
using moecomm::replica_schedule;
using moecomm::replica_schedule_workspace;
using moecomm::replica_sets;
using moecomm::topology;

replica_schedule solve(replica_sets const& sets, std::vector<int64_t> const& load) {
  replica_schedule out = moecomm::schedule_replicas(sets, load);
  check_split(sets, load, out.split, out.rank_load, out.bound);
  return out;
}

TEST_CASE("replica_schedule: hand-worked min-max cases") {
  // e0 only on rank 0 pins it at 10; e1 must go entirely to rank 1.
  replica_schedule a = solve(make_sets(2, {{0}, {0, 1}}), {10, 4});
  CHECK(a.bound == 10);
  CHECK(a.split == std::vector<int64_t>{10, 0, 4});
  CHECK(a.rank_load == std::vector<int64_t>{10, 4});

  // An odd load over two replicas: eq. 3 gives 5/2, rounded up.
  replica_schedule b = solve(make_sets(2, {{0, 1}}), {5});
  CHECK(b.bound == 3);

  // A ring of three: S = all ranks binds, 15/3.
  CHECK(solve(make_sets(3, {{0, 1}, {1, 2}, {0, 2}}), {6, 6, 3}).bound == 5);

  // The starting bounds (16/4 = 4 and ⌈7/2⌉ = 4) are infeasible: the cut S = {0, 1} raises B to
  // 14/2 = 7 (one Newton step).
  replica_schedule d = solve(make_sets(4, {{0, 1}, {1, 0}, {2, 3}}), {7, 7, 2});
  CHECK(d.bound == 7);
  CHECK(d.rank_load[0] == 7);
  CHECK(d.rank_load[1] == 7);
  CHECK(d.rank_load[2] + d.rank_load[3] == 2);
}

TEST_CASE("replica_schedule: experts with one replica keep their whole load") {
  std::mt19937 rng(7);
  replica_sets const sets = random_sets(rng, 6, 20, 1, 1);
  std::vector<int64_t> const load = zipf_loads(rng, 20, 5000, 1.2);
  replica_schedule const out = solve(sets, load);
  CHECK(out.split == load);
  std::vector<int64_t> per_rank(6, 0);
  for (std::size_t e = 0; e < load.size(); ++e) per_rank[static_cast<std::size_t>(sets.ranks[e])] += load[e];
  CHECK(out.rank_load == per_rank);
}

TEST_CASE("replica_schedule: a rank without tokens or replicas does not lower the bound") {
  // Rank 3 holds nothing: 12 tokens over ranks {0, 1, 2}, not 12/4.
  replica_schedule const out = solve(make_sets(4, {{0, 1}, {1, 2}}), {8, 4});
  CHECK(out.bound == 4);
  CHECK(out.rank_load[3] == 0);
  // A rank with a replica but no load on it: experts without tokens take nothing.
  replica_schedule const idle = solve(make_sets(3, {{0, 1}, {2}}), {6, 0});
  CHECK(idle.bound == 3);
  CHECK(idle.rank_load == std::vector<int64_t>{3, 3, 0});
  // No tokens at all.
  replica_schedule const none = solve(make_sets(3, {{0, 1}, {2}}), {0, 0});
  CHECK(none.bound == 0);
  CHECK(none.split == std::vector<int64_t>{0, 0, 0});
}

TEST_CASE("replica_schedule: all tokens on one expert") {
  std::vector<std::vector<int32_t>> lists(8, std::vector<int32_t>{0});
  lists[3] = {2, 5, 7};
  std::vector<int64_t> load(8, 0);
  load[3] = 1000;
  replica_schedule const out = solve(make_sets(8, lists), load);
  CHECK(out.bound == 334);  // ⌈1000 / 3⌉
  CHECK(out.rank_load[0] == 0);
}

TEST_CASE("replica_schedule: Zipf 1.2 and Zipf 8 loads meet eq. 3") {
  for (double s : {1.2, 8.0}) {
    for (std::uint32_t seed = 1; seed <= 4; ++seed) {
      CAPTURE(s);
      CAPTURE(seed);
      std::mt19937 rng(seed);
      replica_sets const sets = random_sets(rng, 12, 48, 2, 4);
      std::vector<int64_t> const load = zipf_loads(rng, 48, 12 * 4096, s);
      CHECK(solve(sets, load).bound == ceil_of(eq3_by_subsets(sets, load)));
    }
  }
}

TEST_CASE("replica_schedule: random small instances meet eq. 3 exactly") {
  std::mt19937 rng(2024);
  replica_schedule_workspace workspace;  // reused across sizes
  replica_schedule out;
  for (int i = 0; i < 500; ++i) {
    std::int32_t const ranks = std::uniform_int_distribution<std::int32_t>(1, 8)(rng);
    std::int32_t const experts = std::uniform_int_distribution<std::int32_t>(1, 12)(rng);
    replica_sets const sets = random_sets(rng, ranks, experts, 1, 4);
    std::vector<int64_t> load(static_cast<std::size_t>(experts));
    for (auto& l : load) l = rng() % 3 == 0 ? 0 : std::uniform_int_distribution<int64_t>(0, 60)(rng);
    moecomm::schedule_replicas(sets, load, out, workspace);
    CAPTURE(i);
    CHECK(out.bound == ceil_of(eq3_by_subsets(sets, load)));
    check_split(sets, load, out.split, out.rank_load, out.bound);
  }
}

TEST_CASE("replica_schedule: deterministic, whatever the workspace held before") {
  std::mt19937 rng(99);
  replica_sets const sets = random_sets(rng, 16, 64, 2, 4);
  std::vector<int64_t> const load = zipf_loads(rng, 64, 16 * 4096, 1.2);
  replica_schedule const fresh = moecomm::schedule_replicas(sets, load);
  replica_schedule_workspace workspace;
  replica_schedule reused;
  replica_sets const other = random_sets(rng, 5, 9, 1, 3);
  std::vector<int64_t> const other_load = zipf_loads(rng, 9, 300, 0);
  moecomm::schedule_replicas(other, other_load, reused, workspace);
  moecomm::schedule_replicas(sets, load, reused, workspace);
  CHECK(reused.bound == fresh.bound);
  CHECK(reused.split == fresh.split);
  CHECK(reused.rank_load == fresh.rank_load);
}

TEST_CASE("replica_schedule: errors name the field") {
  using moecomm::status;
  auto const run = [](replica_sets const& sets, std::vector<int64_t> const& load) {
    return [=] { (void)moecomm::schedule_replicas(sets, load); };
  };
  check_error(run(make_sets(8, {{0}, {1}, {2}, {3, 9}}), {1, 1, 1, 1}), status::invalid_argument,
              {"moecomm::schedule_replicas: replicas of expert 3 name rank 9, not in [0, 8)"});
  check_error(run(make_sets(4, {{0}, {1, 2, 1}}), {1, 1}), status::invalid_argument, {"replicas of expert 1 name rank 1 twice"});
  check_error(run(make_sets(4, {{0}, {}, {1}}), {1, 1, 1}), status::invalid_argument, {"expert 1 has no replica"});
  check_error(run(make_sets(0, {{0}}), {1}), status::invalid_argument, {"replica_sets.num_ranks = 0"});
  check_error(run(make_sets(4, {{0}, {1}}), {1, -2}), status::invalid_argument, {"load[1] = -2 is negative"});
  check_error(run(make_sets(4, {{0}, {1}}), {1}), status::invalid_argument, {"load has 1 entries"});
  replica_sets bad = make_sets(4, {{0}, {1}});
  bad.offsets.back() = 3;
  check_error(run(bad, {1, 1}), status::invalid_argument, {"replica_sets.offsets[2] = 3", "ranks has 2 entries"});
  bad.offsets = {1, 2};
  check_error(run(bad, {1}), status::invalid_argument, {"replica_sets.offsets must start with 0"});
  replica_schedule out;
  replica_schedule_workspace workspace;
  check_error([&] { moecomm::schedule_replicas(make_sets(2, {{0}}), {}, out, workspace); }, status::invalid_argument,
              {"argument 'load' has 0 elements; needs at least 1"});
  std::vector<int64_t> const short_load{4}, short_counts(7, 1);  // 2 experts, 4 x 2 counts
  check_error([&] { moecomm::schedule_replicas(make_sets(2, {{0}, {1}}), short_load, out, workspace); }, status::invalid_argument,
              {"schedule_replicas", "argument 'load' has 1 elements; needs at least 2 (one token count per expert"});
  moecomm::comm_aware_schedule aware_out;
  check_error([&] { moecomm::schedule_replicas_comm_aware(make_sets(4, {{0}, {1}}), topology(4, 2), {}, short_counts, aware_out, workspace); },
              status::invalid_argument, {"argument 'counts' has 7 elements; needs at least 8 (R x E token counts)"});
  std::vector<int64_t> loads;
  check_error([&] { moecomm::expert_loads(short_counts, 4, 2, loads); }, status::invalid_argument,
              {"expert_loads", "argument 'counts' has 7 elements; needs at least 8"});

  topology const topo(4, 2);
  auto const aware = [&](topology const& t, link_weights alpha, std::vector<int64_t> const& counts) {
    return [=] { (void)moecomm::schedule_replicas_comm_aware(make_sets(4, {{0, 1}}), t, alpha, counts); };
  };
  check_error(aware(topology(2, 1), {}, {1, 1, 1, 1}), status::invalid_argument, {"topo has 2 ranks, replica_sets.num_ranks = 4"});
  check_error(aware(topo, {-0.5, 1.0}, {1, 1, 1, 1}), status::invalid_argument, {"link_weights.intra_node = -0.5"});
  check_error(aware(topo, {0.1, std::numeric_limits<double>::quiet_NaN()}, {1, 1, 1, 1}), status::invalid_argument,
              {"link_weights.inter_node = nan"});
  check_error(aware(topo, {}, {1, 1, -3, 1}), status::invalid_argument, {"counts[2] = -3 is negative"});
  check_error(aware(topo, {}, {1, 1}), status::invalid_argument, {"counts has 2 entries, expected R x E = 4 x 1"});
}

// ---- communication-aware --------------------------------------------------------------------

moecomm::comm_aware_schedule solve_aware(replica_sets const& sets, topology const& topo, link_weights alpha,
                                         std::vector<int64_t> const& counts) {
  moecomm::comm_aware_schedule out = moecomm::schedule_replicas_comm_aware(sets, topo, alpha, counts);
  check_route(sets, topo, alpha, counts, out);
  return out;
}

TEST_CASE("replica_schedule: comm-aware hand-worked cases") {
  // Two nodes of one rank; rank 0 routes 10 tokens to an expert on both. f(B) = B + α·(10 − B)
  // for B in [5, 10]: α < 1 moves half, α > 1 moves nothing.
  replica_sets const pair = make_sets(2, {{0, 1}});
  topology const two_nodes(2, 1);
  auto const cheap = solve_aware(pair, two_nodes, {0.5, 0.5}, {10, 0});
  CHECK(cheap.bound == 5);
  CHECK(cheap.inter_node_tokens == 5);
  CHECK(cheap.objective == 7.5);
  CHECK(cheap.route == std::vector<int64_t>{5, 0, 5, 0});
  auto const dear = solve_aware(pair, two_nodes, {2, 2}, {10, 0});
  CHECK(dear.bound == 10);
  CHECK(dear.inter_node_tokens == 0);
  CHECK(dear.objective == 10);

  // Nodes {0, 1} and {2, 3}; rank 0 (no replica) routes 8 tokens to an expert on ranks 1 and 2.
  // Sending a to rank 1 costs max(a, 8 − a) + a/8 + (8 − a): a = 4 gives 8.5, the least.
  auto const split = solve_aware(make_sets(4, {{1, 2}}), topology(4, 2), {0.125, 1.0}, {8, 0, 0, 0});
  CHECK(split.bound == 4);
  CHECK(split.intra_node_tokens == 4);
  CHECK(split.inter_node_tokens == 4);
  CHECK(split.objective == 8.5);
}

TEST_CASE("replica_schedule: comm-aware with free links is the min-max optimum") {
  std::mt19937 rng(5);
  replica_sets const sets = random_sets(rng, 8, 32, 2, 4);
  std::vector<int64_t> const counts = zipf_counts(rng, 8, 32, 512, 1.2);
  std::vector<int64_t> load;
  moecomm::expert_loads(counts, 8, 32, load);
  auto const free = solve_aware(sets, topology(8, 4), {0, 0}, counts);
  CHECK(free.bound == moecomm::schedule_replicas(sets, load).bound);
  CHECK(free.objective == static_cast<double>(free.bound));
}

// The least objective over every integral routing: (source, expert) pairs one by one, each over
// every composition of its count into the expert's replicas.
double enumerate_best(replica_sets const& sets, topology const& topo, link_weights alpha, std::vector<int64_t> const& counts) {
  auto const R = static_cast<std::size_t>(sets.num_ranks), E = static_cast<std::size_t>(sets.num_experts());
  std::vector<int64_t> rank_load(R, 0);
  double best = std::numeric_limits<double>::infinity();
  std::function<void(std::size_t, double)> pair_at;
  std::function<void(std::size_t, std::int32_t, int64_t, double)> part;
  pair_at = [&](std::size_t cell, double moved) {
    while (cell < R * E && counts[cell] == 0) ++cell;
    if (cell == R * E) {
      best = std::min(best, static_cast<double>(*std::max_element(rank_load.begin(), rank_load.end())) + moved);
      return;
    }
    part(cell, sets.offsets[cell % E], counts[cell], moved);
  };
  part = [&](std::size_t cell, std::int32_t k, int64_t left, double moved) {
    auto const s = static_cast<std::int32_t>(cell / E);
    std::int32_t const last = sets.offsets[cell % E + 1] - 1;
    auto const g = static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(k)]);
    double const per_token = static_cast<std::int32_t>(g) == s ? 0 : topo.same_node(s, static_cast<std::int32_t>(g)) ? alpha.intra_node : alpha.inter_node;
    for (int64_t take = k == last ? left : 0; take <= left; ++take) {
      rank_load[g] += take;
      if (k == last) pair_at(cell + 1, moved + per_token * static_cast<double>(take));
      else part(cell, k + 1, left - take, moved + per_token * static_cast<double>(take));
      rank_load[g] -= take;
    }
  };
  pair_at(0, 0);
  return best;
}

TEST_CASE("replica_schedule: comm-aware equals exhaustive enumeration on small instances") {
  std::mt19937 rng(11);
  replica_schedule_workspace workspace;
  moecomm::comm_aware_schedule out;
  int checked = 0;
  for (int i = 0; i < 400 && checked < 150; ++i) {
    std::int32_t const per_node = std::uniform_int_distribution<std::int32_t>(1, 2)(rng);
    std::int32_t const ranks = per_node * std::uniform_int_distribution<std::int32_t>(1, 3)(rng);
    std::int32_t const experts = std::uniform_int_distribution<std::int32_t>(1, 3)(rng);
    replica_sets const sets = random_sets(rng, ranks, experts, 1, 3);
    std::vector<int64_t> counts(static_cast<std::size_t>(ranks * experts));
    double routings = 1;
    for (std::size_t c = 0; c < counts.size(); ++c) {
      counts[c] = rng() % 2 == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, 4)(rng);
      std::int64_t const r = sets.offsets[c % static_cast<std::size_t>(experts) + 1] - sets.offsets[c % static_cast<std::size_t>(experts)];
      routings *= std::tgamma(static_cast<double>(counts[c] + r)) / std::tgamma(static_cast<double>(counts[c] + 1)) / std::tgamma(static_cast<double>(r));
    }
    if (routings > 2e5) continue;
    ++checked;
    // Dyadic weights: every objective is exact in binary, so the comparison is exact.
    link_weights const alpha{std::uniform_int_distribution<int>(0, 8)(rng) / 8.0, std::uniform_int_distribution<int>(0, 24)(rng) / 8.0};
    topology const topo(ranks, per_node);
    moecomm::schedule_replicas_comm_aware(sets, topo, alpha, counts, out, workspace);
    CAPTURE(i);
    check_route(sets, topo, alpha, counts, out);
    CHECK(out.objective == enumerate_best(sets, topo, alpha, counts));
  }
  CHECK(checked == 150);
}

TEST_CASE("replica_schedule: comm-aware routes are consistent on Zipf 1.2 and Zipf 8 counts") {
  for (double s : {1.2, 8.0}) {
    CAPTURE(s);
    std::mt19937 rng(3);
    replica_sets const sets = random_sets(rng, 16, 64, 2, 4);
    std::vector<int64_t> const counts = zipf_counts(rng, 16, 64, 1024, s);
    auto const out = solve_aware(sets, topology(16, 4), {0.1, 1.0}, counts);
    std::vector<int64_t> load;
    moecomm::expert_loads(counts, 16, 64, load);
    CHECK(out.bound >= moecomm::schedule_replicas(sets, load).bound);
  }
}

}  // namespace test
