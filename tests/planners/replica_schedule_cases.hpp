// SPDX-License-Identifier: Apache-2.0
#pragma once
// Instances and independent checks for the replica schedulers, shared by the host tests and the
// GLPK oracle tests: random replica sets and loads, eq. 3 by brute force over subsets of ranks,
// and the constraints every schedule must meet.

#include <moecomm/planners/replica_schedule.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace test {

// Expert e on ranks `lists[e]`.
inline moecomm::replica_sets make_sets(std::int32_t ranks, std::vector<std::vector<std::int32_t>> const& lists) {
  moecomm::replica_sets sets;
  sets.num_ranks = ranks;
  for (auto const& list : lists) {
    sets.ranks.insert(sets.ranks.end(), list.begin(), list.end());
    sets.offsets.push_back(static_cast<std::int32_t>(sets.ranks.size()));
  }
  return sets;
}

// Every expert on `min_replicas..max_replicas` distinct ranks drawn uniformly.
inline moecomm::replica_sets random_sets(std::mt19937& rng, std::int32_t ranks, std::int32_t experts, std::int32_t min_replicas,
                                         std::int32_t max_replicas) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(ranks));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_int_distribution<std::int32_t> count(min_replicas, std::min(max_replicas, ranks));
  std::vector<std::vector<std::int32_t>> lists;
  for (std::int32_t e = 0; e < experts; ++e) {
    std::shuffle(all.begin(), all.end(), rng);
    lists.emplace_back(all.begin(), all.begin() + count(rng));
  }
  return make_sets(ranks, lists);
}

// `tokens` draws from Zipf(s) over the experts (s = 0: uniform).
inline std::vector<std::int64_t> zipf_loads(std::mt19937& rng, std::int32_t experts, std::int64_t tokens, double s) {
  std::vector<double> p(static_cast<std::size_t>(experts));
  for (std::int32_t e = 0; e < experts; ++e) p[static_cast<std::size_t>(e)] = 1.0 / std::pow(e + 1.0, s);
  std::discrete_distribution<std::int32_t> pick(p.begin(), p.end());
  std::vector<std::int64_t> load(static_cast<std::size_t>(experts), 0);
  for (std::int64_t t = 0; t < tokens; ++t) ++load[static_cast<std::size_t>(pick(rng))];
  return load;
}

// Eq. 3 as a fraction: max over nonempty rank subsets S of Σ_{e: G_e ⊆ S} load_e / |S|, as
// (numerator, denominator). Brute force: R <= 16.
struct fraction {
  std::int64_t num = 0, den = 1;
};
inline fraction eq3_by_subsets(moecomm::replica_sets const& sets, std::vector<std::int64_t> const& load) {
  std::int32_t const ranks = sets.num_ranks;
  std::vector<std::uint32_t> mask(load.size(), 0);
  for (std::size_t e = 0; e < load.size(); ++e)
    for (std::int32_t k = sets.offsets[e]; k < sets.offsets[e + 1]; ++k) mask[e] |= 1u << sets.ranks[static_cast<std::size_t>(k)];
  fraction best;
  for (std::uint32_t S = 1; S < (1u << ranks); ++S) {
    std::int64_t inside = 0;
    for (std::size_t e = 0; e < load.size(); ++e)
      if ((mask[e] & ~S) == 0) inside += load[e];
    std::int64_t const size = __builtin_popcount(S);
    if (inside * best.den > best.num * size) best = {inside, size};
  }
  return best;
}

inline std::int64_t ceil_of(fraction f) { return (f.num + f.den - 1) / f.den; }

// The split is a schedule of `load` over `sets`: one entry per replica, none negative, each
// expert's entries summing to its load; rank loads are the split's sums and `bound` their maximum.
inline void check_split(moecomm::replica_sets const& sets, std::vector<std::int64_t> const& load,
                        std::vector<std::int64_t> const& split, std::vector<std::int64_t> const& rank_load, std::int64_t bound) {
  REQUIRE(split.size() == sets.ranks.size());
  REQUIRE(rank_load.size() == static_cast<std::size_t>(sets.num_ranks));
  std::vector<std::int64_t> sums(static_cast<std::size_t>(sets.num_ranks), 0);
  for (std::size_t e = 0; e < load.size(); ++e) {
    std::int64_t sum = 0;
    for (std::int32_t k = sets.offsets[e]; k < sets.offsets[e + 1]; ++k) {
      std::int64_t const x = split[static_cast<std::size_t>(k)];
      CHECK_MESSAGE(x >= 0, "expert ", e, " entry ", k, " = ", x);
      sum += x;
      sums[static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(k)])] += x;
    }
    CHECK_MESSAGE(sum == load[e], "expert ", e, ": split sums to ", sum, ", load ", load[e]);
  }
  CHECK(sums == rank_load);
  CHECK(*std::max_element(rank_load.begin(), rank_load.end()) == bound);
}

// Row-major [R][E] counts: rank s routes `tokens_per_rank` draws from Zipf(s) over the experts.
inline std::vector<std::int64_t> zipf_counts(std::mt19937& rng, std::int32_t ranks, std::int32_t experts,
                                             std::int64_t tokens_per_rank, double s) {
  std::vector<std::int64_t> counts;
  for (std::int32_t r = 0; r < ranks; ++r) {
    std::vector<std::int64_t> const row = zipf_loads(rng, experts, tokens_per_rank, s);
    counts.insert(counts.end(), row.begin(), row.end());
  }
  return counts;
}

// A comm-aware schedule is consistent: the route delivers every count to a replica of its expert,
// its sums per replica are the split, the link counts and objective follow from the route.
inline void check_route(moecomm::replica_sets const& sets, moecomm::topology const& topo, moecomm::link_weights alpha,
                        std::vector<std::int64_t> const& counts, moecomm::comm_aware_schedule const& out) {
  auto const R = static_cast<std::size_t>(sets.num_ranks), E = static_cast<std::size_t>(sets.num_experts());
  std::vector<std::int64_t> load(E, 0);
  for (std::size_t s = 0; s < R; ++s)
    for (std::size_t e = 0; e < E; ++e) load[e] += counts[s * E + e];
  check_split(sets, load, out.split, out.rank_load, out.bound);
  REQUIRE(out.route.size() == sets.ranks.size() * R);
  std::int64_t intra = 0, inter = 0;
  for (std::size_t e = 0; e < E; ++e) {
    std::vector<std::int64_t> sent(R, 0);
    for (std::int32_t k = sets.offsets[e]; k < sets.offsets[e + 1]; ++k) {
      std::int64_t taken = 0;
      std::int32_t const g = sets.ranks[static_cast<std::size_t>(k)];
      for (std::size_t s = 0; s < R; ++s) {
        std::int64_t const y = out.route[static_cast<std::size_t>(k) * R + s];
        CHECK(y >= 0);
        taken += y;
        sent[s] += y;
        if (static_cast<std::int32_t>(s) != g) (topo.same_node(static_cast<std::int32_t>(s), g) ? intra : inter) += y;
      }
      CHECK(taken == out.split[static_cast<std::size_t>(k)]);
    }
    for (std::size_t s = 0; s < R; ++s) CHECK(sent[s] == counts[s * E + e]);
  }
  CHECK(intra == out.intra_node_tokens);
  CHECK(inter == out.inter_node_tokens);
  CHECK(out.objective == static_cast<double>(out.bound) + alpha.intra_node * static_cast<double>(intra) +
                             alpha.inter_node * static_cast<double>(inter));
}

}  // namespace test
