// SPDX-License-Identifier: Apache-2.0
//! @file
//! Pro-Prophet's evaluation in simulated time (arXiv 2411.10003 §VI; reference/systems.md §2): a
//! stack of MoE blocks trained for a few iterations on Pro-Prophet's RTX 3090 cluster
//! (`platforms/proprophet-3090.platform`: 4 GPUs per node on PCIe 3.0, 100 Gb/s InfiniBand), for
//!   `deepspeed`  plain expert parallelism (DeepSpeed-MoE's dispatch, dropless),
//!   `fastermoe`  FasterMoE's shadowing (Algorithm 1 on the platform's figures) and smart schedule,
//!   `planner`    Pro-Prophet's planner (replicas on subsets; parameters broadcast and gradients
//!                reduced over every rank, as its code does on its global communicator), planned on
//!                each step's counts, with Trans and Agg exposed (the planner minimises that T'),
//!   `prophet`    planner and block-wise scheduler (`block_schedule`): each block planned on the last
//!                iteration's counts, its Trans begun a block ahead, its Agg left running under the
//!                earlier blocks' backward;
//! at 16 and 32 GPUs (`--ranks`), top-1 and top-2, 16384 and 32768 tokens per iteration. Reported:
//! the iteration time, the speedup over deepspeed and over fastermoe, and the load-balance ratio
//! (max/mean rows per GPU, averaged over blocks and iterations).
//!
//!     bench_pro_prophet --ranks=16 --csv=p16.csv     (~1 min)
//!     bench_pro_prophet --ranks=32 --csv=p32.csv
//!     scripts/plot-pro-prophet p16.csv p16.png
//!
//! Configuration (ours where the paper is silent; docs/performance.md): MoE-GPT-like blocks with
//! H = 1024, experts H -> 2H -> H in fp32 (the code's element size and its planner's MLP ratio),
//! E = GPUs (one expert each), 4 blocks (the paper's models have more: compare speedups, not
//! seconds), Zipf(1.2) gates with a popularity order of their own per block, redrawn tokens every
//! iteration; the non-expert compute per block is the code's FNEC = (4bs²h + 4bsh²)·4 / 35.7e12 s
//! (b = sequences per GPU of 256 tokens), its backward twice that. The iteration ends with the
//! all-reduce of the blocks' dense gradients (attention, 4·H² + 6·H a block, fp32) over all GPUs and
//! fp32 Adam over the rank's parameters (`simulate_gradient_step`), the same for every variant and
//! reported beside. Rows carry 4 real floats that
//! stand for 1024 (`simulation_scale`). Check: every variant's outputs and input gradients, summed
//! over the ranks, equal deepspeed's bit for bit at every iteration.
//!
//! Times are simulated seconds (SimGrid 3.32, CM02): a model of the platform, not a measurement.

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/block_schedule.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;
using moecomm_bench::mlp_experts;

constexpr std::int64_t real_hidden = 4, real_ffn = 8, model_hidden = 1024, model_ffn = 2048, seq_length = 256;
constexpr double fp32 = 4.0, code_flops = 35.7e12;
constexpr std::int32_t blocks = 4, iterations = 4;
char const* const variants[] = {"deepspeed", "fastermoe", "planner", "prophet"};
constexpr double expert_parameters_per_gpu = blocks * 2.0 * model_hidden * model_ffn;  // one expert a block, no biases

struct config {
  std::int32_t top_k;
  std::int64_t tokens;  //!< per iteration, all GPUs
};
config const configs[] = {{1, 16384}, {2, 16384}, {1, 32768}, {2, 32768}};

struct outcome {
  double seconds = 0, balance = 0, checksum = 0;  //!< per iteration (mean over the measured ones)
  double gradient_step = 0;                       //!< of `seconds`: the all-reduce and the optimizer
};
std::map<std::string, outcome> g_results;
std::int32_t g_ranks = 16;

std::string key(config const& c, char const* variant) {
  return "k" + std::to_string(c.top_k) + "/T" + std::to_string(c.tokens) + "/" + variant;
}

//! The code's FNEC for one block on one GPU, seconds.
double fnec_seconds(std::int64_t tokens_per_gpu) {
  double const b = double(tokens_per_gpu) / seq_length, s = seq_length, h = model_hidden;
  return (4 * b * s * s * h + 4 * b * s * h * h) * 4 / code_flops;
}

//! The model around the MoE layers: the blocks' attention (its compute is the FNEC above, charged by
//! the bench itself), fp32 gradients and Adam.
moecomm::transformer_shape transformer(std::int64_t tokens_per_gpu) {
  moecomm::transformer_shape s;
  s.layers = s.moe_layers = blocks;
  s.hidden = model_hidden;
  s.sequence = seq_length;
  s.tokens_per_rank = tokens_per_gpu;
  s.gradient_bytes = fp32;
  s.optimizer_bytes_per_parameter = 28;  // fp32 Adam: reads weight, gradient, moments; writes weight, moments
  return s;
}

//! One stack of `blocks` layers on every rank; `iterations` iterations, the first one a warm-up.
template <class Layer, class MakeLayer>
outcome run(moecomm::simulated_platform const& platform, config const& c, char const* variant, MakeLayer&& make_layer) {
  std::int32_t const R = g_ranks;
  std::int64_t const T = c.tokens / R;  // real rows = model tokens; only the hidden size is scaled
  moecomm::simulation_scale scale = moecomm_bench::model_scale(model_hidden, model_ffn, fp32, real_hidden, real_ffn, fp32);
  backend const be(moecomm::host_backend{}, scale);
  std::string const name = variant;
  bool const scheduled = name == "prophet";
  std::vector<double> start(static_cast<std::size_t>(R)), end(start.size()), sums(start.size()), rows(start.size());
  std::vector<double> backward_end(start.size());
  outcome o;
  double balance_sum = 0;
  std::int32_t balance_count = 0;
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, R);
  world.run([&](comm_t comm) {
    std::int32_t const me = comm.rank();
    auto const at = static_cast<std::size_t>(me);
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(R, platform.gpus_per_node()));
    std::vector<std::unique_ptr<Layer>> layers;
    std::vector<std::unique_ptr<mlp_experts>> experts;
    std::vector<Layer*> layer_ptrs;
    std::vector<mlp_experts*> expert_ptrs;
    for (std::int32_t b = 0; b < blocks; ++b) {
      layers.push_back(make_layer(be, groups));
      experts.push_back(std::make_unique<mlp_experts>(1, real_hidden, real_ffn, std::uint64_t(1000 * b + me)));
      layer_ptrs.push_back(layers.back().get());
      expert_ptrs.push_back(experts.back().get());
    }
    std::optional<moecomm::block_schedule<Layer, mlp_experts>> schedule;
    if constexpr (Layer::shadowing_policy::shadows)
      if (scheduled) schedule.emplace(layer_ptrs, expert_ptrs);
    double const fnec = fnec_seconds(T) * platform.spec().gemm_flops() / be.simulated_scale().flops;  // in the experts' FLOPs
    std::vector<std::vector<float>> x(blocks + 1), d(blocks + 1);
    for (std::int32_t it = 0; it < iterations; ++it) {
      std::vector<moecomm_bench::rank_routing> routing;
      for (std::int32_t b = 0; b < blocks; ++b) {
        std::mt19937 order_rng(static_cast<std::uint32_t>(77 + b));  // each block's popularity order, fixed
        std::vector<std::int32_t> order(static_cast<std::size_t>(R));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), order_rng);
        auto pick = moecomm_bench::zipf_popularity(R, 1.2);
        std::mt19937 rng(static_cast<std::uint32_t>(it * 7919 + b * 104729 + me * 131 + 5));  // tokens redrawn every iteration
        routing.push_back(moecomm_bench::zipf_routing(T, c.top_k, order, 0, pick, rng));
      }
      x[0] = moecomm_bench::random_rows(T * real_hidden, 200 + at);
      comm.barrier();
      start[at] = moecomm::simulated_seconds{}();
      double rows_sum = 0;
      for (std::int32_t b = 0; b < blocks; ++b) {
        auto const bi = static_cast<std::size_t>(b);
        if constexpr (Layer::shadowing_policy::shadows)
          if (schedule) schedule->before_forward(b);
        be.charge_flops(fnec);  // attention and the dense parts before the MoE layer
        x[bi + 1].assign(static_cast<std::size_t>(T * real_hidden), 0.0f);
        layers[bi]->forward(routing[bi].view(), {x[bi].data(), T, real_hidden}, {x[bi + 1].data(), T, real_hidden}, *experts[bi]);
        auto const& ds = layers[bi]->dispatch_state();
        rows_sum += double(ds.received_rows() + ds.home_rows());
      }
      d[blocks] = moecomm_bench::random_rows(T * real_hidden, 300 + at);
      std::vector<float> d_w;
      for (std::int32_t b = blocks - 1; b >= 0; --b) {
        auto const bi = static_cast<std::size_t>(b);
        d[bi].assign(static_cast<std::size_t>(T * real_hidden), 0.0f);
        d_w.assign(static_cast<std::size_t>(T * c.top_k), 0.0f);
        layers[bi]->backward({d[bi + 1].data(), T, real_hidden}, moecomm::matrix_view<float>{d[bi].data(), T, real_hidden},
                             moecomm::array_view<float>{d_w.data(), static_cast<std::int64_t>(d_w.size())}, *experts[bi]);
        be.charge_flops(2 * fnec);  // the dense parts' backward
      }
      if constexpr (Layer::shadowing_policy::shadows)
        if (schedule) schedule->finish_backward();
      backward_end[at] = moecomm::simulated_seconds{}();
      moecomm::simulate_gradient_step(comm, transformer(T), expert_parameters_per_gpu);
      end[at] = moecomm::simulated_seconds{}();
      for (auto& e : experts) std::fill(e->grads.begin(), e->grads.end(), 0.0f);
      sums[at] = moecomm_bench::checksum(x[blocks], d[0]);
      rows[at] = rows_sum / blocks;
      comm.barrier();
      if (me == 0 && it > 0) {  // the first iteration warms up (and has nothing to predict from)
        double const last_end = *std::max_element(end.begin(), end.end());
        o.seconds += last_end - *std::min_element(start.begin(), start.end());
        o.gradient_step += last_end - *std::max_element(backward_end.begin(), backward_end.end());
        double const mean = std::accumulate(rows.begin(), rows.end(), 0.0) / R;
        balance_sum += mean > 0 ? *std::max_element(rows.begin(), rows.end()) / mean : 1.0;
        ++balance_count;
        o.checksum += std::accumulate(sums.begin(), sums.end(), 0.0) * (it + 1);
      }
    }
  });
  o.seconds /= (iterations - 1);
  o.gradient_step /= (iterations - 1);
  o.balance = balance_sum / std::max(balance_count, 1);
  return o;
}

using plain_t = moecomm::expert_parallel_layer<float, backend, comm_t>;
using faster_t = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, moecomm::smart_schedule,
                                                moecomm::weighted, moecomm::fastermoe_shadowing<moecomm::collective_path>>;
using prophet_policy = moecomm::fastermoe_shadowing<moecomm::collective_path, moecomm::proprophet_planner<>>;
using prophet_t = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, moecomm::flat, moecomm::weighted, prophet_policy>;

moecomm::fastermoe_cost_params fastermoe_model(moecomm::cluster_spec const& spec) {
  moecomm::fastermoe_cost_params p;
  p.alpha = double(model_ffn) / model_hidden;
  p.bytes_per_element = fp32;
  p.gemm_flops = spec.gemm_flops();
  p.net_bandwidth = spec.nic.bytes_per_second * spec.nics_per_node / spec.gpus_per_node;  // a GPU's share of its node's NIC
  p.local_bandwidth = spec.intra_node.bytes_per_second;
  return p;
}

prophet_policy prophet_for(config const& c, moecomm::proprophet_schedule schedule) {
  moecomm::proprophet_cost_params p;
  p.hidden = model_hidden;
  p.mlp_ratio = double(model_ffn) / model_hidden;
  p.sequences_per_device = std::max<std::int64_t>(1, c.tokens / g_ranks / seq_length);
  p.seq_length = seq_length;
  prophet_policy policy{{}, {}, {}};
  policy.planner.model = moecomm::proprophet_cost_model(p);
  policy.planner.options.schedule = schedule;
  return policy;
}

void register_run(moecomm::simulated_platform const& platform, config const& c, char const* variant) {
  std::string const name = "pro_prophet/R:" + std::to_string(g_ranks) + "/" + key(c, variant);
  moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, c, variant](benchmark::State& state) {
    outcome o;
    std::string const v = variant;
    for (auto _ : state) {
      if (v == "deepspeed")
        o = run<plain_t>(platform, c, variant, [](backend const& be, auto& g) { return std::make_unique<plain_t>(be, g, g_ranks, real_hidden); });
      else if (v == "fastermoe")
        o = run<faster_t>(platform, c, variant, [&](backend const& be, auto& g) {
          return std::make_unique<faster_t>(be, g, g_ranks, real_hidden, moecomm::dropless{}, moecomm::smart_schedule{4},
                                            moecomm::routing_checks{},
                                            moecomm::fastermoe_shadowing<moecomm::collective_path>{fastermoe_model(platform.spec()), {}, {}});
        });
      else
        o = run<prophet_t>(platform, c, variant, [&](backend const& be, auto& g) {
          auto const schedule = v == "prophet" ? moecomm::proprophet_schedule::with_scheduler : moecomm::proprophet_schedule::planner_only;
          return std::make_unique<prophet_t>(be, g, g_ranks, real_hidden, moecomm::dropless{}, moecomm::flat{}, moecomm::routing_checks{},
                                             prophet_for(c, schedule));
        });
      state.SetIterationTime(o.seconds);
    }
    g_results[key(c, variant)] = o;
    auto const base = g_results.find(key(c, "deepspeed"));
    if (base == g_results.end()) return moecomm_bench::fail(state, "deepspeed must run first");
    if (o.checksum != base->second.checksum) return moecomm_bench::fail(state, v + ": outputs differ from deepspeed's");
    state.counters["iter_ms"] = o.seconds * 1e3;
    state.counters["gradient_step_ms"] = o.gradient_step * 1e3;
    state.counters["balance"] = o.balance;
    state.counters["vs_deepspeed"] = base->second.seconds / o.seconds;
  });
}

void print_summary(moecomm::simulated_platform const& platform) {
  std::printf("\n%s, %d GPUs, %d MoE blocks (H %lld, experts H -> 2H -> H fp32, E = GPUs): one training iteration, simulated\n",
              platform.name().c_str(), g_ranks, blocks, static_cast<long long>(model_hidden));
  std::printf("%-4s %7s %12s %12s %12s %12s   %-22s %-22s %s\n", "k", "tokens", "deepspeed", "fastermoe", "planner", "prophet",
              "prophet vs deepspeed", "prophet vs fastermoe", "balance (max/mean): ds / fm / planner / prophet");
  for (config const& c : configs) {
    outcome const* o[4] = {};
    for (int i = 0; i < 4; ++i) {
      auto const it = g_results.find(key(c, variants[i]));
      o[i] = it == g_results.end() ? nullptr : &it->second;
    }
    if (!o[0] || !o[1] || !o[2] || !o[3]) continue;
    std::printf("%-4d %7lld %10.2fms %10.2fms %10.2fms %10.2fms   %-22s %-22s %.2f / %.2f / %.2f / %.2f\n", c.top_k,
                static_cast<long long>(c.tokens), o[0]->seconds * 1e3, o[1]->seconds * 1e3, o[2]->seconds * 1e3, o[3]->seconds * 1e3,
                (std::to_string(o[0]->seconds / o[3]->seconds).substr(0, 4) + "x").c_str(),
                (std::to_string(o[1]->seconds / o[3]->seconds).substr(0, 4) + "x").c_str(), o[0]->balance, o[1]->balance,
                o[2]->balance, o[3]->balance);
  }
  for (config const& c : configs)
    if (auto const it = g_results.find(key(c, "deepspeed")); it != g_results.end()) {
      moecomm::iteration_model const model(platform.spec(), g_ranks, transformer(c.tokens / g_ranks));
      std::printf("k %d, %lld tokens: the gradient step (all-reduce of the dense gradients, Adam) takes %.2f ms of each "
                  "iteration, simulated (model: %.2f ms)\n",
                  c.top_k, static_cast<long long>(c.tokens), it->second.gradient_step * 1e3,
                  (model.allreduce_seconds() + model.optimizer_seconds(expert_parameters_per_gpu)) * 1e3);
    }
  std::printf("(Pro-Prophet reports 1.18-2.66x over DeepSpeed-MoE and 1.01-1.50x over FasterMoE, whole models on its cluster)\n");
}

void write_csv(std::string const& path) {
  std::ofstream f(path);
  f << "ranks,top_k,tokens,variant,seconds,balance\n";
  for (config const& c : configs)
    for (char const* v : variants) {
      auto const it = g_results.find(key(c, v));
      if (it != g_results.end()) f << g_ranks << ',' << c.top_k << ',' << c.tokens << ',' << v << ',' << it->second.seconds << ',' << it->second.balance << '\n';
    }
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string const csv = moecomm_bench::take_flag(argc, argv, "--csv=", "");
  moecomm_bench::take_contention_flag(argc, argv);
  g_ranks = static_cast<std::int32_t>(moecomm_bench::take_int_flag(argc, argv, "--ranks", 16, 2, moecomm::cluster_spec::max_gpus));
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform("proprophet-3090");
  if (g_ranks < 2 || g_ranks > platform.spec().num_gpus()) {
    std::fprintf(stderr, "bench_pro_prophet: --ranks must be in [2, %d]\n", platform.spec().num_gpus());
    return 1;
  }
  benchmark::AddCustomContext("workload", std::to_string(blocks) + " MoE blocks, H 1024, E = " + std::to_string(g_ranks) +
                                              ", Zipf(1.2), top-1/2, 16384/32768 tokens per iteration");
  for (config const& c : configs)
    for (char const* v : variants) register_run(platform, c, v);
  return moecomm_bench::finish("bench_pro_prophet", [&] {
    print_summary(platform);
    if (!csv.empty()) write_csv(csv);
  });
}
