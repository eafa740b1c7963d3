// SPDX-License-Identifier: Apache-2.0
//! @file
//! `select_proprophet_replicas` (Pro-Prophet's Algorithm 1): the time of one decision, which every
//! rank makes once per layer and iteration on the all-gathered (predicted) count matrix. Target:
//! <= 50 µs at 64 ranks x 256 experts.
//!
//! Inputs: R ranks, E experts, expert e on rank e / (E / R) (the contiguous placement). Every rank
//! routes 1024 tokens (Pro-Prophet's 16,384 tokens per iteration over 16 GPUs) to 2 distinct
//! experts drawn from Zipf(1.2) over a fixed shuffled popularity order, from splitmix64. The model
//! is Pro-Prophet's code's constants (`proprophet_cost_params{}`: h 1024, fp32, balance α 3), one
//! rank skipped per replica; `scheduler` minimises the paper's T' (Trans and Agg hidden where they
//! can be), `exposed` the planner-only T'. The decision and workspace are reused (the steady state).
//!
//! Counters: `replicated` experts, `ranks_per_replica` (mean subset size), the load imbalance max H
//! / mean H before and after, and the predicted layer time without and with the replicas (ms). The
//! benchmark fails if the decision predicts a slower layer than replicating nothing.

#include <moecomm/core/topology.hpp>
#include <moecomm/planners/proprophet_cost_model.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

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

constexpr std::int32_t kTokensPerRank = 1024;
constexpr double kZipf = 1.2;

struct planner_case {
  std::int32_t ranks, experts;
  moecomm::proprophet_schedule schedule;
  [[nodiscard]] std::string name() const {
    return std::string("proprophet_planner/") +
           (schedule == moecomm::proprophet_schedule::with_scheduler ? "scheduler" : "exposed") +
           "/R:" + std::to_string(ranks) + "/E:" + std::to_string(experts);
  }
};

//! max H / mean H.
double imbalance(std::vector<std::int64_t> const& tokens) {
  double const total = static_cast<double>(std::accumulate(tokens.begin(), tokens.end(), std::int64_t{0}));
  return static_cast<double>(*std::max_element(tokens.begin(), tokens.end())) * static_cast<double>(tokens.size()) / total;
}

void bm_proprophet_planner(benchmark::State& state, planner_case c) {
  moecomm::proprophet_cost_model const model;
  moecomm::topology const topo(c.ranks, std::min(c.ranks, 4));  // 4 GPUs per node, as the paper's
  std::vector<std::int32_t> owner(static_cast<std::size_t>(c.experts));
  for (std::int32_t e = 0; e < c.experts; ++e) owner[static_cast<std::size_t>(e)] = e / (c.experts / c.ranks);
  splitmix64 rng{kSeed};
  std::vector<std::int64_t> const counts = zipf_top2_counts(c.ranks, c.experts, kTokensPerRank, kZipf, rng);
  moecomm::proprophet_planner_options options;
  options.schedule = c.schedule;

  moecomm::shadow_decision decision;
  moecomm::proprophet_planner_workspace workspace;
  for (auto _ : state) {
    moecomm::select_proprophet_replicas(model, topo, owner, counts, options, decision, workspace);
    benchmark::DoNotOptimize(decision);
  }

  if (!(decision.latency <= decision.latency_unshadowed))
    return fail(state, c.name() + ": predicted " + std::to_string(decision.latency) + " s with replicas, " +
                           std::to_string(decision.latency_unshadowed) + " s without");
  double const replicated = static_cast<double>(decision.shadowed.size());
  state.counters["replicated"] = replicated;
  state.counters["ranks_per_replica"] =
      replicated > 0 ? static_cast<double>(decision.subset_ranks.size()) / replicated : 0.0;
  state.counters["imbalance_before"] = imbalance(decision.tokens_unshadowed);
  state.counters["imbalance_after"] = imbalance(decision.tokens);
  state.counters["lat_none_ms"] = decision.latency_unshadowed * 1e3;
  state.counters["lat_ms"] = decision.latency * 1e3;
}

//! The workload, as the output's context block says it.
std::initializer_list<context_line> const kContext = {
    {"counts", "1024 tokens per rank, top-2, Zipf(1.2) over a shuffled expert order"},
    {"model", "proprophet_cost_params{} (h 1024, fp32, 35.7 TFLOP/s, Trans/Agg 15 Gb/s, alpha 3), n = 1"}};

void register_all() {
  for (auto schedule : {moecomm::proprophet_schedule::with_scheduler, moecomm::proprophet_schedule::planner_only})
    for (auto [ranks, experts] : {std::pair{16, 16}, std::pair{64, 64}, std::pair{64, 256}}) {
      planner_case const c{ranks, experts, schedule};
      benchmark::RegisterBenchmark(c.name().c_str(), bm_proprophet_planner, c)->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) { return moecomm_bench::run(argc, argv, "bench_proprophet_planner", kContext, register_all); }
