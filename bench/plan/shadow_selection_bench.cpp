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
#include <moecomm/plan/cost_model.hpp>
#include <moecomm/plan/shadow_selection.hpp>

#include "../support/harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace moecomm_bench;

constexpr std::int32_t kTokensPerRank = 4096;
constexpr double kZipf = 1.2;
constexpr std::int32_t kRanksPerNode = 8;
constexpr std::uint64_t kSeed = 0x6d6f65636f6d6dULL;  // "moecomm"

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

//! `[R][E]` token counts: each rank's tokens pick 2 distinct experts from Zipf(kZipf).
std::vector<std::int64_t> zipf_counts(shadow_case c) {
  splitmix64 rng{kSeed};
  auto const E = static_cast<std::size_t>(c.experts);
  std::vector<std::int32_t> expert_at_rank(E);  // the popularity order
  for (std::size_t i = 0; i < E; ++i) expert_at_rank[i] = static_cast<std::int32_t>(i);
  for (std::size_t i = E - 1; i > 0; --i) std::swap(expert_at_rank[i], expert_at_rank[rng.below(static_cast<std::uint32_t>(i + 1))]);
  std::vector<double> cdf(E);
  double total = 0;
  for (std::size_t i = 0; i < E; ++i) cdf[i] = total += 1.0 / std::pow(static_cast<double>(i + 1), kZipf);
  for (double& p : cdf) p /= total;
  auto const draw = [&] {
    auto const i = static_cast<std::size_t>(std::lower_bound(cdf.begin(), cdf.end(), rng.unit()) - cdf.begin());
    return expert_at_rank[std::min(i, E - 1)];  // unit() may round above the last cdf entry
  };

  std::vector<std::int64_t> counts(static_cast<std::size_t>(c.ranks) * E, 0);
  for (std::int32_t s = 0; s < c.ranks; ++s) {
    std::int64_t* row = counts.data() + static_cast<std::size_t>(s) * E;
    for (std::int32_t t = 0; t < kTokensPerRank; ++t) {
      std::int32_t const first = draw();
      std::int32_t second = draw();
      while (second == first) second = draw();
      ++row[first];
      ++row[second];
    }
  }
  return counts;
}

void bm_shadow_selection(benchmark::State& state, shadow_case c) {
  moecomm::fastermoe_cost_model const model;
  moecomm::topology const topo(c.ranks, std::min(c.ranks, kRanksPerNode));
  std::vector<std::int32_t> const owner = spread_owners(c);
  std::vector<std::int64_t> const counts = zipf_counts(c);

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

void register_all() {
  for (std::int32_t ranks : {16, 64, 256, 1024})
    for (std::int32_t experts : {64, 256}) {
      shadow_case const c{ranks, experts};
      benchmark::RegisterBenchmark(c.name().c_str(), bm_shadow_selection, c)->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("counts", "4096 tokens per rank, top-2, Zipf(1.2) over a shuffled expert order");
  benchmark::AddCustomContext("model", "fastermoe_cost_params{} (alpha 2, H 2048, fp32, 11.5 TFLOP/s, 50 Gb/s)");
  register_all();
  return moecomm_bench::finish("bench_shadow_selection");
}
