// SPDX-License-Identifier: Apache-2.0
//! @file
//! `plan_replica_moves` (FlexMoE's greedy placement planner, reconstructed): the time of one
//! triggered decision, which every rank makes on the all-gathered expert loads once per
//! rebalancing interval.
//!
//! Inputs: R ranks; every expert has 2–4 replicas (splitmix64), experts packed first fit into slot
//! rows (S = the rows used), each expert's replicas on distinct shuffled ranks of its row. `packed`
//! fills rows of R slots (what first fit leaves over stays empty), so expansions mostly need a
//! replace; `headroom` fills only 3R/4 of each row, the memory FlexMoE reserves for new replicas. Loads: R x 4096 tokens x top-2, shared by Zipf(1.2) over a
//! shuffled popularity order (expected counts, rounded), so the hot experts' replicas are far too
//! few. Model: 1 µs per row; a replica of an expert with H = 1024, α = 4 (8.4 M parameters) in
//! bf16 with fp32 master, m and v (16 bytes per parameter, 134 MB) over 25 GB/s; a 50-step interval;
//! at most 64 moves. The decision and workspace are reused (the steady state).
//!
//! Counters: `moves` (expand + shrink + migrate), `imbalance_before`/`_after` (max/mean rank
//! load) and the predicted step times (ms). The benchmark fails unless the decision is triggered,
//! its moves apply to the slot table it reports, and the predicted step time does not grow. The
//! greedy stops early on some of these inputs (no single move lowers the busiest rank enough to
//! pay for its copy): the time of a decision follows its moves, about 4 µs each at 64 x 256.

#include <moecomm/planners/flexmoe_planner.hpp>

#include "../support/harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace moecomm_bench;

constexpr std::int64_t kTokensPerRank = 4096, kTopK = 2;
constexpr double kZipf = 1.2;

struct planner_case {
  std::int32_t ranks, experts;
  bool headroom;  //!< a quarter of every slot row kept free for expansions
  [[nodiscard]] std::string name() const {
    return std::string("flexmoe_planner/") + (headroom ? "headroom" : "packed") + "/R:" + std::to_string(ranks) +
           "/E:" + std::to_string(experts);
  }
};

//! The placement of the file comment.
moecomm::replica_placement random_placement(planner_case c, splitmix64& rng) {
  std::vector<std::int32_t> count(static_cast<std::size_t>(c.experts)), row(static_cast<std::size_t>(c.experts)), free_in_row;
  for (std::int32_t e = 0; e < c.experts; ++e) {
    std::int32_t& n = count[static_cast<std::size_t>(e)];
    n = std::min<std::int32_t>(c.ranks, 2 + static_cast<std::int32_t>(rng.below(3)));
    auto const fits = std::find_if(free_in_row.begin(), free_in_row.end(), [n](std::int32_t f) { return f >= n; });
    row[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(fits - free_in_row.begin());
    if (fits == free_in_row.end()) free_in_row.push_back(c.headroom ? c.ranks - c.ranks / 4 : c.ranks);
    free_in_row[static_cast<std::size_t>(row[static_cast<std::size_t>(e)])] -= n;
  }
  auto const S = static_cast<std::int32_t>(free_in_row.size());
  std::vector<std::int32_t> slots(static_cast<std::size_t>(c.ranks * S), -1);
  std::vector<std::int32_t> ranks(static_cast<std::size_t>(c.ranks));
  for (std::int32_t l = 0; l < S; ++l) {
    std::iota(ranks.begin(), ranks.end(), 0);
    for (std::size_t i = ranks.size() - 1; i > 0; --i) std::swap(ranks[i], ranks[rng.below(static_cast<std::uint32_t>(i + 1))]);
    std::size_t next = 0;
    for (std::int32_t e = 0; e < c.experts; ++e)
      if (row[static_cast<std::size_t>(e)] == l)
        for (std::int32_t j = 0; j < count[static_cast<std::size_t>(e)]; ++j)
          slots[static_cast<std::size_t>(ranks[next++] * S + l)] = e;
  }
  return moecomm::replica_placement(c.experts, c.ranks, S, std::move(slots));
}

//! Expected tokens per expert: Zipf(kZipf) over a shuffled popularity order.
std::vector<std::int64_t> zipf_loads(planner_case c, splitmix64& rng) {
  auto const E = static_cast<std::size_t>(c.experts);
  std::vector<std::int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = E - 1; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<std::uint32_t>(i + 1))]);
  std::vector<double> weight(E);
  for (std::size_t i = 0; i < E; ++i) weight[i] = 1.0 / std::pow(static_cast<double>(i + 1), kZipf);
  double const sum = std::accumulate(weight.begin(), weight.end(), 0.0);
  double const tokens = static_cast<double>(c.ranks * kTokensPerRank * kTopK);
  std::vector<std::int64_t> load(E);
  for (std::size_t i = 0; i < E; ++i) load[static_cast<std::size_t>(order[i])] = std::llround(tokens * weight[i] / sum);
  return load;
}

void bm_flexmoe_planner(benchmark::State& state, planner_case c) {
  splitmix64 rng{kSeed};
  moecomm::replica_placement const placement = random_placement(c, rng);
  std::vector<std::int64_t> const load = zipf_loads(c, rng);
  moecomm::flexmoe_planner_options options;
  options.seconds_per_row = 1e-6;
  options.bytes_per_replica = 2.0 * 4 * 1024 * 1024 * 16;
  options.move_bytes_per_second = 25e9;
  moecomm::placement_decision decision;
  moecomm::flexmoe_planner_workspace workspace;
  for (auto _ : state) {
    moecomm::plan_replica_moves(placement, load, options, decision, workspace);
    // The whole decision, not a double member: on a double, g++ 12 returned a wrong value through
    // DoNotOptimize's "+m,r" (google/benchmark#903, GCC PR 92597).
    benchmark::DoNotOptimize(decision);
  }

  if (!decision.triggered) return fail(state, c.name() + ": the imbalance did not trigger a decision");
  if (moecomm::apply_replica_moves(placement, decision.moves).slot_experts() != decision.slot_expert_after)
    return fail(state, c.name() + ": the moves do not give the reported slot table");
  if (!(decision.step_seconds_after <= decision.step_seconds_before))
    return fail(state, c.name() + ": the predicted step got slower");
  state.counters["S"] = placement.slots_per_rank();
  state.counters["moves"] = static_cast<double>(decision.moves.size());
  state.counters["imbalance_before"] = decision.imbalance_before;
  state.counters["imbalance_after"] = decision.imbalance_after;
  state.counters["step_before_ms"] = decision.step_seconds_before * 1e3;
  state.counters["step_after_ms"] = decision.step_seconds_after * 1e3;
}

//! The workload, as the output's context block says it.
std::initializer_list<context_line> const kContext = {
    {"loads", "4096 tokens per rank, top-2, Zipf(1.2) over a shuffled expert order (expected counts)"},
    {"placement", "2-4 replicas per expert, first fit into rows of R (packed) or 3R/4 (headroom) slots, shuffled ranks"},
    {"model", "1 us per row; 134 MB per replica at 25 GB/s; 50-step interval; <= 64 moves"}};

void register_all() {
  for (bool headroom : {false, true})
    for (planner_case const c : {planner_case{8, 64, headroom}, planner_case{64, 256, headroom}})
      benchmark::RegisterBenchmark(c.name().c_str(), bm_flexmoe_planner, c)->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) { return moecomm_bench::run(argc, argv, "bench_flexmoe_planner", kContext, register_all); }
