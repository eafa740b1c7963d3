// SPDX-License-Identifier: Apache-2.0
//! @file
//! `hybridep_planner::choose` (HybridEP §III-E, every divisor of the data centre's ranks priced):
//! the time of one decision, which a layer makes whenever its shape (tokens, Lat_PE) changes, on
//! the path before the expert all-gather starts.
//!
//! Inputs: G ranks per data centre and K data centres, on `from_cluster` of the hybridep-a800
//! platforms' figures (16 GB/s PCIe inside, 10 Gb/s between); 2 experts per rank of 0.36 MB (Table
//! V's expert); 64 MB of tokens per rank; Lat_PE 20 ms; 2 TFLOP of expert GEMMs per rank.
//!
//! Counters: `S_ED` chosen, its `p`, §III-E's `p_star`, the chosen total (ms) and `candidates`.
//! The benchmark fails if the chosen total is larger than any candidate's.

#include <moecomm/planners/hybridep_planner.hpp>

#include "../support/harness.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace {

using namespace moecomm_bench;

struct hybridep_case {
  std::int32_t ranks_per_domain, domains;
  [[nodiscard]] std::string name() const {
    return "hybridep_planner/G:" + std::to_string(ranks_per_domain) + "/K:" + std::to_string(domains);
  }
};

//! platforms/hybridep-a800-*.platform with `domains` data centres of one node of `gpus` A800.
moecomm::cluster_spec a800_spec(hybridep_case c) {
  moecomm::cluster_spec s;
  s.name = "hybridep-a800";
  s.source = "bench";
  s.domains = c.domains;
  s.nodes_per_domain = 1;
  s.gpus_per_node = c.ranks_per_domain;
  s.gpu_flops = 312e12;
  s.hbm_bytes_per_second = 1935e9;
  s.kernel_launch_seconds = 4e-6;
  s.intra_node_over_pcie = true;
  s.intra_node = s.pcie = {16e9, 1e-6};
  s.nic = {1.25e9, 5e-6};
  s.inter_domain = {1.25e9, 25e-6};
  return s;
}

void bm_hybridep_choose(benchmark::State& state, hybridep_case c) {
  moecomm::hybridep_planner const planner(moecomm::hybridep_params::from_cluster(a800_spec(c)));
  moecomm::hybridep_layer_shape shape;
  shape.ranks_per_domain = c.ranks_per_domain;
  shape.domains = c.domains;
  shape.experts_per_rank = 2;
  shape.parameter_bytes_per_expert = 360'000;
  shape.token_bytes = 64'000'000;
  shape.pre_expert_seconds = 20e-3;
  shape.expert_flops = 2e12;

  moecomm::hybridep_choice choice;
  for (auto _ : state) {
    benchmark::DoNotOptimize(shape);
    choice = planner.choose(shape);
    benchmark::DoNotOptimize(choice);
  }

  for (auto const& candidate : choice.candidates)
    if (candidate.total < choice.chosen().total)
      return fail(state, c.name() + ": chose S_ED " + std::to_string(choice.expert_domain_ranks) + ", but S_ED " +
                             std::to_string(candidate.expert_domain_ranks) + " predicts less");
  state.counters["S_ED"] = choice.expert_domain_ranks;
  state.counters["p"] = choice.p;
  state.counters["p_star"] = choice.p_star;
  state.counters["total_ms"] = choice.chosen().total * 1e3;
  state.counters["candidates"] = static_cast<double>(choice.candidates.size());
}

//! The workload, as the output's context block says it.
std::initializer_list<context_line> const kContext = {
    {"model", "hybridep_params::from_cluster of the hybridep-a800 figures, G GPUs per node"},
    {"shape", "n 2, P_E 0.36 MB, D 64 MB, Lat_PE 20 ms, 2 TFLOP of expert GEMMs per rank"}};

void register_all() {
  for (hybridep_case const c : {hybridep_case{64, 1}, hybridep_case{64, 4}, hybridep_case{8, 1}, hybridep_case{1024, 1}})
    benchmark::RegisterBenchmark(c.name().c_str(), bm_hybridep_choose, c)->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) { return moecomm_bench::run(argc, argv, "bench_hybridep_planner", kContext, register_all); }
