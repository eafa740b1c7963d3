// SPDX-License-Identifier: Apache-2.0
//! @file
//! FineMoE's token scheduling over replicas (`schedule_replicas`, and the communication-aware
//! `schedule_replicas_comm_aware`): the time of one decision, which every rank makes once per
//! layer and micro-batch on the all-gathered count matrix, between the count exchange and the
//! dispatch. Targets (min-max, loads included): <= 10 µs at 8 ranks x 64 experts, <= 100 µs at
//! 64 ranks x 256 experts (FineMoE reports ≈ 100 µs for its LP with HiGHS).
//!
//! Inputs: R ranks, 8 per node; every expert has 2–4 replicas on distinct ranks drawn from
//! splitmix64. Every rank routes 4096 tokens to 2 distinct experts drawn from Zipf(1.2) over a
//! fixed shuffled popularity order. The workspace and result are reused (the steady state).
//!
//! Counters: `bound` (the busiest rank's tokens), `balance` (bound over the mean rank load), and
//! for the comm-aware variant the tokens moved inside and between nodes. The benchmark fails if a
//! split does not add up to the loads or if a rank exceeds the bound.

#include <moecomm/core/topology.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include "../support/harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace moecomm_bench;

constexpr std::int32_t kTokensPerRank = 4096;
constexpr double kZipf = 1.2;
constexpr std::int32_t kRanksPerNode = 8;

struct schedule_case {
  std::int32_t ranks, experts;
  [[nodiscard]] std::string name(char const* variant) const {
    return std::string("replica_schedule/") + variant + "/R:" + std::to_string(ranks) + "/E:" + std::to_string(experts);
  }
};

//! 2–4 replicas per expert on distinct random ranks.
moecomm::replica_sets random_replicas(schedule_case c, splitmix64& rng) {
  moecomm::replica_sets sets;
  sets.num_ranks = c.ranks;
  std::vector<std::int32_t> all(static_cast<std::size_t>(c.ranks));
  std::iota(all.begin(), all.end(), 0);
  for (std::int32_t e = 0; e < c.experts; ++e) {
    std::int32_t const count = std::min<std::int32_t>(c.ranks, 2 + static_cast<std::int32_t>(rng.below(3)));
    for (std::int32_t i = 0; i < count; ++i) {  // a partial Fisher-Yates shuffle
      std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(i) + rng.below(static_cast<std::uint32_t>(c.ranks - i))]);
      sets.ranks.push_back(all[static_cast<std::size_t>(i)]);
    }
    sets.offsets.push_back(static_cast<std::int32_t>(sets.ranks.size()));
  }
  return sets;
}

//! Empty when the split is a schedule of `load` within `bound`, else what is wrong.
std::string check(moecomm::replica_sets const& sets, std::vector<std::int64_t> const& load, std::vector<std::int64_t> const& split,
                  std::int64_t bound) {
  std::vector<std::int64_t> per_rank(static_cast<std::size_t>(sets.num_ranks), 0);
  for (std::int32_t e = 0; e < sets.num_experts(); ++e) {
    std::int64_t sum = 0;
    for (std::int32_t k = sets.offsets[static_cast<std::size_t>(e)]; k < sets.offsets[static_cast<std::size_t>(e) + 1]; ++k) {
      if (split[static_cast<std::size_t>(k)] < 0) return "negative split of expert " + std::to_string(e);
      sum += split[static_cast<std::size_t>(k)];
      per_rank[static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(k)])] += split[static_cast<std::size_t>(k)];
    }
    if (sum != load[static_cast<std::size_t>(e)]) return "expert " + std::to_string(e) + " split sums to " + std::to_string(sum);
  }
  if (*std::max_element(per_rank.begin(), per_rank.end()) != bound) return "the busiest rank is not at the bound";
  return {};
}

void bm_minmax(benchmark::State& state, schedule_case c) {
  splitmix64 rng{kSeed};
  moecomm::replica_sets const sets = random_replicas(c, rng);
  std::vector<std::int64_t> const counts = zipf_top2_counts(c.ranks, c.experts, kTokensPerRank, kZipf, rng);
  std::vector<std::int64_t> load;
  moecomm::replica_schedule out;
  moecomm::replica_schedule_workspace workspace;
  for (auto _ : state) {
    moecomm::expert_loads(counts, c.ranks, c.experts, load);
    moecomm::schedule_replicas(sets, load, out, workspace);
    benchmark::DoNotOptimize(out.bound);
  }
  if (std::string const wrong = check(sets, load, out.split, out.bound); !wrong.empty()) return fail(state, c.name("minmax") + ": " + wrong);
  double const mean = static_cast<double>(std::accumulate(load.begin(), load.end(), std::int64_t{0})) / c.ranks;
  state.counters["bound"] = static_cast<double>(out.bound);
  state.counters["balance"] = static_cast<double>(out.bound) / mean;
}

void bm_comm_aware(benchmark::State& state, schedule_case c) {
  splitmix64 rng{kSeed};
  moecomm::replica_sets const sets = random_replicas(c, rng);
  std::vector<std::int64_t> const counts = zipf_top2_counts(c.ranks, c.experts, kTokensPerRank, kZipf, rng);
  moecomm::topology const topo(c.ranks, std::min(c.ranks, kRanksPerNode));
  moecomm::comm_aware_schedule out;
  moecomm::replica_schedule_workspace workspace;
  for (auto _ : state) {
    moecomm::schedule_replicas_comm_aware(sets, topo, moecomm::link_weights{}, counts, out, workspace);
    benchmark::DoNotOptimize(out.bound);
  }
  std::vector<std::int64_t> load;
  moecomm::expert_loads(counts, c.ranks, c.experts, load);
  if (std::string const wrong = check(sets, load, out.split, out.bound); !wrong.empty()) return fail(state, c.name("comm_aware") + ": " + wrong);
  double const mean = static_cast<double>(std::accumulate(load.begin(), load.end(), std::int64_t{0})) / c.ranks;
  state.counters["bound"] = static_cast<double>(out.bound);
  state.counters["balance"] = static_cast<double>(out.bound) / mean;
  state.counters["intra_node"] = static_cast<double>(out.intra_node_tokens);
  state.counters["inter_node"] = static_cast<double>(out.inter_node_tokens);
}

//! The workload, as the output's context block says it.
std::initializer_list<context_line> const kContext = {
    {"counts", "4096 tokens per rank, top-2, Zipf(1.2) over a shuffled expert order"},
    {"replicas", "2-4 per expert on distinct random ranks; 8 ranks per node"},
    {"link_weights", "intra-node 0.1, inter-node 1.0 (FineMoE App. A.1)"}};

void register_all() {
  for (schedule_case const c : {schedule_case{8, 64}, schedule_case{16, 64}, schedule_case{64, 256}, schedule_case{256, 1024}}) {
    benchmark::RegisterBenchmark(c.name("minmax").c_str(), bm_minmax, c)->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(c.name("comm_aware").c_str(), bm_comm_aware, c)->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) { return moecomm_bench::run(argc, argv, "bench_replica_schedule", kContext, register_all); }
