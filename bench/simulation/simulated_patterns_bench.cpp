// SPDX-License-Identifier: Apache-2.0
//! @file
//! FasterMoE's two optimisations on FasterMoE's simulated clusters: one MoE layer step (forward and
//! backward) of plain expert parallelism, of FasterMoE shadowing, of the smart schedule and of
//! both, timed in simulated seconds.
//!
//! `bench_simulated_patterns --platform=fastermoe-v100-ib` (64 ranks, the default) or
//! `--platform=fastermoe-v100-pcie` (16 ranks): SimGrid holds one platform per process.
//!
//! Configuration (FasterMoE PPoPP'22 §5 as summarised in /work/shared/reference/systems.md §1):
//! MoE-GPT-S / MoE-GPT / MoE-GPT-L, H = 1024 / 2048 / 4096, experts H -> 2H -> H (α = 2), fp32,
//! top-2, dropless, 16 experts per rank (FastMoE's `num_expert` counts experts per worker).
//! T = 4096 tokens per rank (the paper's batch is not in systems.md: our choice). Routing is
//! Zipf(1.2) over experts whose popularity order is a fixed random permutation, the same on every
//! rank. The real rows hold 4 floats and the experts are MLPs 4 -> 8 -> 4; `simulation_scale`
//! makes each row's messages and copies, each expert's parameters and its FLOPs those of the model.
//!
//! Variants: `plain` (flat all-to-all), `shadow` (`fastermoe_shadowing`, Algorithm 1 on the model's
//! H and the platform's figures), `smart` (`smart_schedule{4}`: fastmoe's default group size),
//! `both`. One world runs a warm-up step then the timed step; the time is the simulated span of the
//! timed step over all ranks (earliest start to latest end). Simulated time is deterministic, so
//! each case runs one iteration.
//!
//! Iterations: each model is 12 transformer blocks, every FFN an MoE layer (fastmoe's `fmoefy`
//! replaces each), sequences of 1024 tokens (our choice), GPT-2's vocabulary of 50257, fp32 Adam.
//! A variant's iteration is 12 of its layer steps plus the rest of the iteration
//! (`simulate_dense_iteration`: attention and the LM head, the all-reduce of the dense gradients,
//! the optimizer), simulated once per model on the same ranks.
//!
//! Check: every variant's output and input gradient, summed over all ranks, equal plain's bit for
//! bit (the layer sums every slot in the same order whatever the variant).

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

using moecomm_bench::mlp_experts;
using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;

struct model_size {
  char const* name;
  std::int64_t hidden;
};
constexpr model_size models[] = {{"MoE-GPT-S", 1024}, {"MoE-GPT", 2048}, {"MoE-GPT-L", 4096}};

constexpr std::int64_t real_hidden = 4, real_ffn = 8;  // α = 2, as the model
constexpr double alpha = 2.0, fp32 = 4.0, zipf = 1.2;
constexpr std::int32_t top_k = 2, experts_per_rank = 16, group_size = 4;

struct config {
  std::int32_t ranks = 0, per_node = 0;
  std::int64_t tokens = 4096;
};

// Parameters and gradients move by broadcast and reduce on the world, as FasterMoE does with NCCL.
// The layer prices Algorithm 1 for the model-sized rows the simulation stands for (its
// simulation_scale), so the planner is the default one.
using shadowing = moecomm::fastermoe_shadowing<moecomm::collective_path>;

//! The planner's figures: the model's, and the platform's (FLOP rate, a node's NICs, a GPU's port).
shadowing shadowing_for(moecomm::cluster_spec const& spec) {
  moecomm::fastermoe_cost_params p;
  p.alpha = alpha;
  p.bytes_per_element = fp32;
  p.gemm_flops = spec.gemm_flops();
  p.net_bandwidth = spec.nics_per_node * spec.nic.bytes_per_second;
  p.local_bandwidth = spec.intra_node.bytes_per_second;
  return shadowing{p, {}, {}};
}

//! What one variant measured, kept to compare with plain's.
struct outcome {
  double seconds = 0, checksum = 0;
  std::int64_t shadowed = 0, busiest_rows = 0, inter_bytes = 0;
};
std::map<std::string, outcome> g_plain;  // by model name
std::map<std::string, moecomm_bench::dense_times> g_dense;  // by model name

//! The model around the MoE layers (see the file comment).
moecomm::transformer_shape transformer(model_size const& m, config const& c) {
  moecomm::transformer_shape s;
  s.layers = s.moe_layers = 12;
  s.hidden = m.hidden;
  s.sequence = 1024;
  s.tokens_per_rank = c.tokens;
  s.vocabulary = 50257;
  s.gradient_bytes = fp32;
  s.optimizer_bytes_per_parameter = 28;  // fp32 Adam: reads weight, gradient, moments; writes weight, moments
  return s;
}

//! The parameters of one rank's experts (H -> αH -> H, as `model_scale` prices them: no biases).
double expert_parameters(model_size const& m) { return experts_per_rank * 2 * alpha * double(m.hidden) * double(m.hidden); }

//! Bytes the dispatcher reports are real ones; each stands for this many simulated bytes.
double row_scale(model_size const& m) { return double(m.hidden) / double(real_hidden); }

template <class Algorithm, class Shadowing>
outcome run_layer(moecomm::simulated_platform const& platform, config const& c, model_size const& m,
                  Algorithm const& algorithm, Shadowing const& shadow) {
  std::int32_t const experts = c.ranks * experts_per_rank;
  auto const routing = moecomm_bench::skewed_routing(c.ranks, c.tokens, top_k, experts, zipf, 2022);
  backend const be(moecomm::host_backend{},
                   moecomm_bench::model_scale(double(m.hidden), alpha * double(m.hidden), fp32, real_hidden, real_ffn, fp32));
  moecomm_bench::step_span span(c.ranks);
  std::vector<double> sums(static_cast<std::size_t>(c.ranks));
  outcome o;
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, c.ranks);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(c.ranks, c.per_node));
    moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, Algorithm, moecomm::weighted, Shadowing> layer(
        be, groups, experts, real_hidden, {}, algorithm, {}, shadow);
    mlp_experts mlp(experts_per_rank, real_hidden, real_ffn, 100 + me);
    sums[me] = moecomm_bench::warm_then_timed_step(layer, comm, routing[me], real_hidden, mlp, span).checksum;
    auto const& report = layer.dispatch_state().report();
    o.inter_bytes += report.exchange.inter_bytes;  // actors run one at a time
    o.busiest_rows = std::max(o.busiest_rows, report.received_rows + report.home_rows);
    if constexpr (Shadowing::shadows)
      if (me == 0) o.shadowed = static_cast<std::int64_t>(layer.shadow_state().decision().shadowed.size());
  });
  o.seconds = span.seconds();
  for (double s : sums) o.checksum += s;
  return o;
}

template <class Algorithm, class Shadowing>
void register_variant(moecomm::simulated_platform const& platform, config const& c, model_size const& m,
                      char const* variant, Algorithm algorithm, Shadowing shadow) {
  std::string const name = std::string("fastermoe/") + m.name + "/R:" + std::to_string(c.ranks) + "/" + variant;
  moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, c, m, variant, algorithm, shadow](benchmark::State& state) {
    outcome o;
    for (auto _ : state) {
      o = run_layer(platform, c, m, algorithm, shadow);
      state.SetIterationTime(o.seconds);
    }
    bool const is_plain = std::string(variant) == "plain";
    if (is_plain) {
      g_plain[m.name] = o;
      g_dense[m.name] = moecomm_bench::simulate_dense(platform, c.ranks, transformer(m, c), expert_parameters(m));
    }
    moecomm_bench::dense_times const& dense = g_dense[m.name];
    double const layers = transformer(m, c).moe_layers;
    auto const plain = g_plain.find(m.name);
    if (plain == g_plain.end()) return moecomm_bench::fail(state, "plain must run before the other variants");
    if (o.checksum != plain->second.checksum)
      return moecomm_bench::fail(state, std::string(variant) + ": output and input gradient differ from plain's " + std::to_string(o.checksum) + " vs " + std::to_string(plain->second.checksum));
    state.counters["sim_ms"] = o.seconds * 1e3;
    state.counters["speedup"] = plain->second.seconds / o.seconds;
    state.counters["iter_ms"] = (layers * o.seconds + dense.simulated) * 1e3;
    state.counters["iter_speedup"] = (layers * plain->second.seconds + dense.simulated) / (layers * o.seconds + dense.simulated);
    state.counters["dense_ms"] = dense.simulated * 1e3;
    state.counters["dense_model_ms"] = dense.predicted * 1e3;
    state.counters["shadowed"] = double(o.shadowed);
    state.counters["busiest_rows"] = double(o.busiest_rows);
    state.counters["inter_GB"] = double(o.inter_bytes) * row_scale(m) / 1e9;
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "fastermoe-v100-ib");
  moecomm_bench::take_contention_flag(argc, argv);
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  config c;
  c.ranks = platform.spec().num_gpus();
  c.per_node = platform.gpus_per_node();
  benchmark::AddCustomContext("workload", "top-2 Zipf(1.2), 16 experts per rank, MLP H->2H->H fp32, T = 4096 per rank, dropless");
  for (model_size const& m : models) {
    shadowing const shadow = shadowing_for(platform.spec());
    register_variant(platform, c, m, "plain", moecomm::flat{}, moecomm::no_shadowing{});
    register_variant(platform, c, m, "shadow", moecomm::flat{}, shadow);
    register_variant(platform, c, m, "smart", moecomm::smart_schedule{group_size}, moecomm::no_shadowing{});
    register_variant(platform, c, m, "both", moecomm::smart_schedule{group_size}, shadow);
  }
  return moecomm_bench::finish("bench_simulated_patterns");
}
