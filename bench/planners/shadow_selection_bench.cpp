// SPDX-License-Identifier: Apache-2.0
//! @file
//! `select_shadowed_experts` (FasterMoE Algorithm 1): the time of one decision, which every rank
//! makes once per layer and iteration on the all-gathered count matrix, so it sits on the critical
//! path between the count exchange and the dispatch. Target: < 50 µs at 64 ranks x 256 experts.
//!
//! Inputs: R ranks, 8 per node; E experts, expert e on rank e·R/E (the contiguous placement when R
//! divides E; when E < R, one expert every R/E ranks, so the owners spread over all nodes). Every
//! rank routes 4096 tokens to 2 distinct experts drawn from Zipf(1.2) over a fixed shuffled
//! popularity order (so the hot experts sit on different ranks), from splitmix64. The model is
//! FasterMoE's defaults (`fastermoe_cost_params{}`).
//!
//! Counters: `shadowed` experts, and the predicted step time without and with them (ms). The
//! benchmark fails if the decision predicts a slower step than shadowing nothing.

#include <moecomm/core/topology.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/planners/shadow_selection.hpp>

#include "../support/harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace {

using namespace moecomm_bench;

constexpr std::int32_t kTokensPerRank = 4096;
constexpr double kZipf = 1.2;
constexpr std::int32_t kRanksPerNode = 8;

struct shadow_case {
  std::int32_t ranks, experts;
  [[nodiscard]] std::string name() const {
    return "shadow_selection/R:" + std::to_string(ranks) + "/E:" + std::to_string(experts);
  }
};

//! Expert e on rank e·R/E: contiguous when R divides E, spread out when E < R.
std::vector<std::int32_t> spread_owners(shadow_case c) {
  std::vector<std::int32_t> owner(static_cast<std::size_t>(c.experts));
  for (std::int32_t e = 0; e < c.experts; ++e)
    owner[static_cast<std::size_t>(e)] =
        static_cast<std::int32_t>(static_cast<std::int64_t>(e) * c.ranks / c.experts);
  return owner;
}

void bm_shadow_selection(benchmark::State& state, shadow_case c) {
  moecomm::fastermoe_cost_model const model;
  moecomm::topology const topo(c.ranks, std::min(c.ranks, kRanksPerNode));
  std::vector<std::int32_t> const owner = spread_owners(c);
  splitmix64 rng{kSeed};
  std::vector<std::int64_t> const counts = zipf_top2_counts(c.ranks, c.experts, kTokensPerRank, kZipf, rng);

  moecomm::shadow_decision decision;
  for (auto _ : state) {
    decision = moecomm::select_shadowed_experts(model, topo, owner, counts);
    benchmark::DoNotOptimize(decision);
  }

  if (!(decision.latency <= decision.latency_unshadowed))
    return fail(state, c.name() + ": predicted " + std::to_string(decision.latency) + " s with shadowing, " +
                           std::to_string(decision.latency_unshadowed) + " s without");
  state.counters["shadowed"] = static_cast<double>(decision.shadowed.size());
  state.counters["lat_unshadowed_ms"] = decision.latency_unshadowed * 1e3;
  state.counters["lat_ms"] = decision.latency * 1e3;
}

//! The workload, as the output's context block says it.
std::initializer_list<context_line> const kContext = {
    {"counts", "4096 tokens per rank, top-2, Zipf(1.2) over a shuffled expert order"},
    {"model", "fastermoe_cost_params{} (alpha 2, H 2048, fp32, 11.5 TFLOP/s, 50 Gb/s)"}};

void register_all() {
  for (std::int32_t ranks : {16, 64, 256, 1024})
    for (std::int32_t experts : {64, 256}) {
      shadow_case const c{ranks, experts};
      benchmark::RegisterBenchmark(c.name().c_str(), bm_shadow_selection, c)->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) { return moecomm_bench::run(argc, argv, "bench_shadow_selection", kContext, register_all); }
