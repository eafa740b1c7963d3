// SPDX-License-Identifier: Apache-2.0
//! @file
//! HybridEP's evaluation in simulated time (arXiv 2510.19470 §V, Table V): one MoE layer's training
//! step (forward and backward, after the pre-expert compute) on HybridEP's cross-data-centre
//! platforms, as the per-GPU token traffic grows, for
//!   `flat` (plain expert parallelism, one all-to-all), `hier2d` (hierarchical_2d: Tutel-like),
//!   `fastermoe` (FasterMoE shadowing, Algorithm 1 on the platform's figures), `ep_dc_dp` (expert
//!   parallelism inside each data centre, every expert replicated in every data centre and its
//!   gradient all-reduced across them each step: tokens never cross), and `hybridep/S:s`
//!   (expert domains of s ranks across the data centres, every divisor s of the ranks), with
//!   `hybridep_planner`'s pick marked, and that pick with the 50x top-k codec (`/c50`: its outputs
//!   differ, by design, and are not checked against flat's).
//!
//!     bench_hybridep --platform=hybridep-a800-16   (4 data centres x 4 A800; the default)
//!     bench_hybridep --platform=hybridep-a800-32   (8 x 4)
//!     bench_hybridep ... --csv=FILE                (one line per (traffic, variant); scripts/plot-hybridep draws it)
//!     bench_hybridep --data-centres=128 --gpus-per-dc=8 --traffic=24 --only-planned
//!                                                  (the scaling run: the platform's figures on D x G GPUs,
//!                                                   E = the ranks, one traffic, flat against the planner's S)
//!     bench_hybridep ... --model-only               (no simulation: the planner's predicted steps, plain EP
//!                                                   (S = 1) against its pick, for every traffic)
//!
//! Configuration (systems.md §5; ours where the paper is silent): E = 32 experts (the ranks, when more); each expert an MLP
//! H -> 4H -> H in fp16 with H = 150, so 2·H·4H·2 B = 0.36 MB, Table V's expert size; top-2 uniform
//! routing; dropless; per-GPU token traffic D = T·K·H·2 B of 6, 12, 24, 48, 96 and 192 MB (T up to
//! 320 000 tokens per rank). Pre-expert compute (attention, dense FFN) charged before the layer: 2 ms
//! per step, the same for every variant; HybridEP begins its expert gather before it. The real
//! rows hold 4 floats, 2048 per rank, each standing for T / 2048 model tokens (`simulation_scale`
//! multiplies bytes and FLOPs accordingly); the experts are MLPs 4 -> 16 -> 4.
//!
//! Iterations: the paper's Table V times whole training iterations of a model it does not describe
//! beyond the expert's size. Ours: 12 such blocks (our choice), each the 2 ms of pre-expert compute
//! and the MoE layer, then the all-reduce of the blocks' dense parameters (attention, 4·H² + 6·H a
//! block, fp16 gradients) over every GPU, across the data centres, and Adam
//! (`simulate_gradient_step`): 12 layer steps plus that, printed beside the layer step.
//!
//! Times are simulated seconds (SimGrid 3.32, CM02): a model of the platform, not a measurement of
//! it.
//! Speedup: the fastest baseline's time over HybridEP's (the paper reports the mean of its
//! baselines', systems.md §5 [I], which a slow baseline inflates). Check: every variant's output and
//! input gradient, summed over all ranks, equal `flat`'s bit for bit.

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/planners/hybridep_planner.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using moecomm_bench::mlp_experts;
using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;

constexpr std::int64_t model_hidden = 150, model_ffn = 600, real_hidden = 4, real_ffn = 16, real_tokens = 2048;
constexpr double fp16 = 2.0, fp32 = 4.0, pre_expert_seconds = 2e-3;
constexpr std::int32_t top_k = 2;
std::int32_t num_experts = 32;  // E = 32 (Table V), or the ranks when there are more
std::vector<double> traffic_mb = {6, 12, 24, 48, 96, 192};

//! Model tokens per rank for `mb` megabytes of dispatch traffic per GPU.
double model_tokens(double mb) { return mb * 1e6 / (top_k * model_hidden * fp16); }

//! Each real row stands for `model_tokens / real_tokens` model rows of the model's width.
moecomm::simulation_scale scale_for(double mb) {
  moecomm::simulation_scale s = moecomm_bench::model_scale(double(model_hidden), double(model_ffn), fp16, real_hidden, real_ffn, fp32);
  double const rows = model_tokens(mb) / real_tokens;
  s.payload *= rows;
  s.flops *= rows;
  return s;
}

struct outcome {
  double seconds = 0, checksum = 0;
  std::int64_t inter_domain_bytes = 0;  //!< real bytes of rank 0's token messages across data centres
};

struct row {
  double mb;
  std::string variant;
  outcome o;
  bool planned = false;
};
std::vector<row> g_rows;
std::map<double, outcome> g_flat;
constexpr std::int32_t blocks = 12;
std::map<double, double> g_gradient_step;  //!< simulated seconds, by traffic

//! The model around the MoE layers: only its parameters count (the blocks' compute is the
//! pre-expert charge); sequences of 1000 tokens, so that every traffic's tokens make whole ones.
moecomm::transformer_shape transformer(double mb) {
  moecomm::transformer_shape s;
  s.layers = s.moe_layers = blocks;
  s.hidden = model_hidden;
  s.sequence = 1000;
  s.tokens_per_rank = std::int64_t(model_tokens(mb));
  s.gradient_bytes = fp16;
  return s;
}

//! One step of `layer` (pre-expert compute, forward, backward) on every rank, timed; `begin` runs
//! before the pre-expert compute (HybridEP's gather).
template <class MakeLayer>
outcome run(moecomm::simulated_platform const& platform, double mb, MakeLayer&& make_layer) {
  std::int32_t const ranks = platform.spec().num_gpus(), per_node = platform.gpus_per_node();
  auto const routing = moecomm_bench::skewed_routing(ranks, real_tokens, top_k, num_experts, 0.0, 2510);
  backend const be(moecomm::host_backend{}, scale_for(mb));
  moecomm_bench::step_span span(ranks);
  std::vector<double> sums(static_cast<std::size_t>(ranks));
  outcome o;
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, ranks);
  world.run([&](comm_t comm) {
    auto const me = static_cast<std::size_t>(comm.rank());
    // One node per data centre on these platforms: the topology's domains are its nodes.
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(ranks, per_node, 1));
    auto layer = make_layer(be, groups);
    mlp_experts mlp = layer->experts(static_cast<std::int32_t>(me), ranks);
    std::vector<float> const x = moecomm_bench::random_rows(real_tokens * real_hidden, 200 + me);
    std::vector<float> const d_out = moecomm_bench::random_rows(real_tokens * real_hidden, 300 + me);
    std::vector<float> out(x.size()), d_x(x.size()), d_w(routing[me].idx.size());
    for (int step = 0; step < 2; ++step) {  // the first warms up
      comm.barrier();
      span.start[me] = moecomm::simulated_seconds{}();
      layer->begin(mlp);
      be.charge_flops(pre_expert_seconds * platform.spec().gemm_flops() / be.simulated_scale().flops);
      layer->forward(routing[me].view(), {x.data(), real_tokens, real_hidden}, {out.data(), real_tokens, real_hidden}, mlp);
      layer->backward({d_out.data(), real_tokens, real_hidden}, moecomm::matrix_view<float>{d_x.data(), real_tokens, real_hidden},
                      moecomm::array_view<float>{d_w.data(), static_cast<std::int64_t>(d_w.size())}, mlp);
      span.end[me] = moecomm::simulated_seconds{}();
    }
    sums[me] = moecomm_bench::checksum(out, d_x);
    if (me == 0) o.inter_domain_bytes = layer->inter_domain_bytes();
  });
  o.seconds = span.seconds();
  for (double s : sums) o.checksum += s;
  return o;
}

using hybridep_t = moecomm::hybridep_layer<float, backend, comm_t>;

//! Global experts [first, first + count) with the parameters every variant gives them: expert e is
//! the flat layout's local expert e % L of rank e / L (L = E / ranks), drawn from that rank's seed.
mlp_experts experts_of(std::int32_t first, std::int32_t count, std::int32_t ranks) {
  std::int32_t const L = num_experts / ranks;
  mlp_experts mine(count, real_hidden, real_ffn, 0);
  for (std::int32_t i = 0; i < count; ++i) {
    std::int32_t const e = first + i;
    mlp_experts const owner(L, real_hidden, real_ffn, 100 + std::uint64_t(e / L));
    std::copy_n(owner.params.data() + (e % L) * owner.parameter_count(), owner.parameter_count(), mine.parameters(i));
  }
  return mine;
}

//! Every variant behind one interface; `begin` starts HybridEP's background gather (nothing for the others).
template <class Layer>
struct variant {
  template <class... A>
  explicit variant(A&&... a) : layer(std::forward<A>(a)...) {}
  void begin(mlp_experts& experts) {
    if constexpr (std::is_same_v<Layer, hybridep_t>) layer.begin_expert_gather(experts);
  }
  void forward(moecomm::routing_view const& r, moecomm::matrix_view<float const> x, moecomm::matrix_view<float> out,
               mlp_experts& experts) {
    layer.forward(r, x, out, experts);
  }
  void backward(moecomm::matrix_view<float const> d_out, moecomm::matrix_view<float> d_x, moecomm::array_view<float> d_w,
                mlp_experts& experts) {
    layer.backward(d_out, d_x, d_w, experts);
  }
  //! Rank `me`'s experts: `E / ranks` of them, as the layer places them.
  [[nodiscard]] static mlp_experts experts(std::int32_t me, std::int32_t ranks) {
    return experts_of(me * (num_experts / ranks), num_experts / ranks, ranks);
  }
  //! Rank 0's bytes across data centres: tokens, and for HybridEP parameters too.
  [[nodiscard]] std::int64_t inter_domain_bytes() const {
    if constexpr (std::is_same_v<Layer, hybridep_t>)
      return layer.report().exchange.inter_domain_bytes + layer.report().expert_gather.inter_domain_bytes;
    else
      return layer.dispatch_state().report().exchange.inter_domain_bytes;
  }
  Layer layer;
};

//! Each data centre's communicator and groups, and each rank's replicas' across the data centres
//! (a base of `ep_per_data_centre`, so that they exist before its layer).
struct data_centre_groups {
  comm_t local, across;
  moecomm::exchange_groups<comm_t> groups;
  explicit data_centre_groups(moecomm::exchange_groups<comm_t>& world)
      : local(world.world().split(world.topo().domain_of(world.world().rank()), world.world().rank())),
        across(world.world().split(local.rank(), world.world().rank())),
        groups(local, moecomm::topology(local.size(), std::min(local.size(), world.topo().ranks_per_node()))) {}
};

//! HybridEP's strongest baseline: expert parallelism inside each data centre, the
//! experts data-parallel across them. Every data centre holds all E experts over its ranks, so its
//! tokens never leave it; each step then all-reduces every expert's gradient with its replicas in
//! the other data centres (the ranks of the same index), over the slow links, in ascending rank.
//! Built from plain EP on each data centre's communicator and one all-reduce: the library's
//! `expert_data_parallel` is the same layout, but all-gathers its counts over every data centre and
//! took 33.4 ms where this takes 31.5 (16 GPUs, 6 MB).
//! No token crosses a data centre (the gradients' all-reduce does, and is not counted in its bytes).
struct ep_per_data_centre : data_centre_groups, variant<moecomm::expert_parallel_layer<float, backend, comm_t>> {
  backend be;
  moecomm::workspace<backend> scratch;

  ep_per_data_centre(backend const& b, moecomm::exchange_groups<comm_t>& world)
      : data_centre_groups(world), variant(b, groups, num_experts, real_hidden), be(b) {}
  void backward(moecomm::matrix_view<float const> d_out, moecomm::matrix_view<float> d_x, moecomm::array_view<float> d_w,
                mlp_experts& experts) {
    layer.backward(d_out, d_x, d_w, experts);
    [[maybe_unused]] auto const payload = moecomm::detail::payload_scope(be, moecomm::detail::payload_kind::parameters);
    moecomm::ordered_allreduce(be, across, moecomm::array_view<float>(experts.grads), scratch);
  }
  //! Rank `me`'s experts: E / (ranks per data centre) of them, those of its index in its data centre.
  [[nodiscard]] mlp_experts experts(std::int32_t me, std::int32_t ranks) const {
    (void)me;
    std::int32_t const count = num_experts / local.size();
    return experts_of(local.rank() * count, count, ranks);
  }
};

using shadowing = moecomm::fastermoe_shadowing<moecomm::collective_path>;
shadowing shadowing_for(moecomm::cluster_spec const& spec) {
  moecomm::fastermoe_cost_params p;
  p.alpha = double(model_ffn) / double(model_hidden);
  p.bytes_per_element = fp16;
  p.gemm_flops = spec.gemm_flops();
  p.net_bandwidth = spec.inter_domain.bytes_per_second;  // a data centre's uplink, shared by its GPUs
  p.local_bandwidth = spec.intra_node.bytes_per_second;
  return shadowing{p, {}, {}};
}

//! HybridEP's planner's choice for the model-sized layer of `mb` traffic.
moecomm::hybridep_choice planner_choice(moecomm::simulated_platform const& platform, double mb) {
  moecomm::hybridep_planner const planner(moecomm::hybridep_params::from_cluster(platform.spec()));
  moecomm::hybridep_layer_shape shape;
  shape.ranks_per_domain = platform.gpus_per_node();
  shape.domains = platform.spec().num_gpus() / platform.gpus_per_node();
  shape.experts_per_rank = num_experts / platform.spec().num_gpus();
  shape.parameter_bytes_per_expert = std::int64_t(2 * model_hidden * model_ffn * fp16);
  shape.token_bytes = std::int64_t(mb * 1e6);
  shape.pre_expert_seconds = pre_expert_seconds;
  shape.expert_flops = 4.0 * model_tokens(mb) * top_k * model_hidden * model_ffn;
  return planner.choose(shape);
}

std::int32_t planned_expert_domain(moecomm::simulated_platform const& platform, double mb) {
  return planner_choice(platform, mb).expert_domain_ranks;
}

//! `--model-only`: the planner's predicted steps, without simulating.
void print_model(moecomm::simulated_platform const& platform) {
  std::printf("The planner's model (not a simulation) on %s, %d ranks, E = %d: one layer's step\n", platform.name().c_str(),
              platform.spec().num_gpus(), num_experts);
  for (double mb : traffic_mb) {
    moecomm::hybridep_choice const c = planner_choice(platform, mb);
    std::printf("%6gMB  plain EP (S 1) %9.1f ms   HybridEP S %4d %9.1f ms   %5.2fx\n", mb, c.candidates.front().step_total * 1e3,
                c.expert_domain_ranks, c.chosen().step_total * 1e3, c.candidates.front().step_total / c.chosen().step_total);
  }
}

template <class Make>
void register_variant(moecomm::simulated_platform const& platform, double mb, std::string const& variant, bool planned, Make make) {
  char label[32];
  std::snprintf(label, sizeof label, "%gMB", mb);
  std::string const name = std::string("hybridep/") + label + "/" + variant;
  moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, mb, variant, planned, make](benchmark::State& state) {
    outcome o;
    for (auto _ : state) {
      o = run(platform, mb, make);
      state.SetIterationTime(o.seconds);
    }
    if (variant == "flat") {
      g_flat[mb] = o;
      std::int32_t const ranks = platform.spec().num_gpus(), experts = std::max(1, num_experts / ranks);
      g_gradient_step[mb] =
          moecomm_bench::simulate_dense(platform, ranks, transformer(mb), experts * 2.0 * model_hidden * model_ffn, false).simulated;
    }
    auto const flat = g_flat.find(mb);
    if (flat == g_flat.end()) return moecomm_bench::fail(state, "flat must run before the other variants");
    bool const compressed = variant.size() > 4 && variant.compare(variant.size() - 4, 4, "/c50") == 0;
    if (!compressed && o.checksum != flat->second.checksum)  // compressed experts compute other outputs
      return moecomm_bench::fail(state, variant + ": output and input gradient differ from flat's");
    state.counters["sim_ms"] = o.seconds * 1e3;
    state.counters["vs_flat"] = flat->second.seconds / o.seconds;
    state.counters["iter_ms"] = (blocks * o.seconds + g_gradient_step[mb]) * 1e3;
    state.counters["planned"] = planned ? 1 : 0;
    g_rows.push_back({mb, variant, o, planned});
  });
}

void print_summary(char const* platform) {
  std::printf("\nOne MoE layer's step on %s, simulated (speedup = the fastest baseline's step / HybridEP's;\n"
              "ep_dc_dp = EP inside each data centre, experts data-parallel across them):\n",
              platform);
  std::printf("%8s %10s %10s %10s %10s   %-22s %-22s %-18s\n", "traffic", "flat", "hier2d", "fastermoe", "ep_dc_dp",
              "HybridEP planned (S)", "HybridEP best (S)", "planned, 50x codec");
  for (double mb : traffic_mb) {
    double base[4] = {0, 0, 0, 0}, planned = 0, best = 0, codec = 0;
    std::string planned_s, best_s;
    for (row const& r : g_rows) {
      if (r.mb != mb) continue;
      if (r.variant == "flat") base[0] = r.o.seconds;
      else if (r.variant == "hier2d") base[1] = r.o.seconds;
      else if (r.variant == "fastermoe") base[2] = r.o.seconds;
      else if (r.variant == "ep_dc_dp") base[3] = r.o.seconds;
      else if (r.variant.find("/c50") != std::string::npos) codec = r.o.seconds;
      else {
        if (r.planned) planned = r.o.seconds, planned_s = r.variant.substr(11);
        if (best == 0 || r.o.seconds < best) best = r.o.seconds, best_s = r.variant.substr(11);
      }
    }
    if (base[0] > 0 && planned > 0 && (base[1] == 0 || base[2] == 0)) {  // --only-planned
      std::printf("%6gMB %8.1fms %10s %10s   %7.1fms %5.2fx (%s) over flat\n", mb, base[0] * 1e3, "-", "-", planned * 1e3,
                  base[0] / planned, planned_s.c_str());
      continue;
    }
    if (base[0] == 0 || base[1] == 0 || base[2] == 0 || base[3] == 0 || best == 0) continue;
    double const fastest = *std::min_element(std::begin(base), std::end(base));
    std::printf("%6gMB %8.1fms %8.1fms %8.1fms %8.1fms   %7.1fms %5.2fx (%s)   %7.1fms %5.2fx (%s)   %7.1fms %5.2fx\n", mb,
                base[0] * 1e3, base[1] * 1e3, base[2] * 1e3, base[3] * 1e3, planned * 1e3, planned > 0 ? fastest / planned : 0.0,
                planned_s.c_str(), best * 1e3, fastest / best, best_s.c_str(), codec * 1e3, codec > 0 ? fastest / codec : 0.0);
  }
  std::printf("\nIterations of %d such blocks and the gradient step (the dense gradients' all-reduce across the data "
              "centres, Adam), simulated:\n",
              blocks);
  std::printf("%8s %14s %16s %18s %10s\n", "traffic", "gradient step", "fastest baseline", "HybridEP planned", "speedup");
  for (double mb : traffic_mb) {
    double fastest = 0, planned = 0;
    for (row const& r : g_rows) {
      if (r.mb != mb || r.variant.find("/c50") != std::string::npos) continue;
      bool const hybrid = r.variant.rfind("hybridep/", 0) == 0;
      if (!hybrid && (fastest == 0 || r.o.seconds < fastest)) fastest = r.o.seconds;
      if (hybrid && r.planned) planned = r.o.seconds;
    }
    if (fastest == 0 || planned == 0 || g_gradient_step.count(mb) == 0) continue;
    double const step = g_gradient_step[mb], base = blocks * fastest + step, ours = blocks * planned + step;
    std::printf("%6gMB %12.1fms %15.3fs %17.3fs %9.2fx\n", mb, step * 1e3, base, ours, base / ours);
  }
  std::printf("(HybridEP reports 1.09x -> 5.60x on its Cluster-L as traffic grows from 6 to 192 MB; Tutel 28.46 s, FasterMoE\n"
              " 29.43 s, HybridEP 5.20 s per iteration at 192 MB: whole iterations, not one layer)\n");
}

void write_csv(std::string const& path) {
  std::ofstream f(path);
  f << "traffic_mb,variant,planned,seconds,inter_domain_bytes_rank0\n";
  for (row const& r : g_rows)
    f << r.mb << ',' << r.variant << ',' << (r.planned ? 1 : 0) << ',' << r.o.seconds << ',' << r.o.inter_domain_bytes << '\n';
  std::printf("wrote %s (%zu rows)\n", path.c_str(), g_rows.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "hybridep-a800-16");
  moecomm_bench::take_contention_flag(argc, argv);
  std::string const csv = moecomm_bench::take_flag(argc, argv, "--csv=", "");
  int const data_centres = std::stoi(moecomm_bench::take_flag(argc, argv, "--data-centres=", "0"));
  int const gpus_per_dc = std::stoi(moecomm_bench::take_flag(argc, argv, "--gpus-per-dc=", "0"));
  std::string const traffic = moecomm_bench::take_flag(argc, argv, "--traffic=", "");
  bool const only_planned = moecomm_bench::take_flag(argc, argv, "--only-planned", "no") != "no";
  bool const model_only = moecomm_bench::take_flag(argc, argv, "--model-only", "no") != "no";
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name, [&](moecomm::cluster_spec& spec) {
    if (data_centres <= 0 && gpus_per_dc <= 0) return;
    if (data_centres > 0) spec.domains = data_centres;
    if (gpus_per_dc > 0) spec.gpus_per_node = gpus_per_dc;
    spec.name += "-scaled";
    spec.source += "; scaled to " + std::to_string(spec.domains) + " data centres x " + std::to_string(spec.gpus_per_node) +
                   " GPUs by bench_hybridep";
  });
  std::int32_t const ranks = platform.spec().num_gpus();
  num_experts = std::max(32, ranks);
  if (!traffic.empty()) traffic_mb = {std::stod(traffic)};
  if (model_only) {
    print_model(platform);
    return 0;
  }
  benchmark::AddCustomContext("workload", "E = 32, MLP 150 -> 600 -> 150 fp16 (0.36 MB), top-2 uniform, dropless, 2 ms "
                                          "pre-expert compute; per-GPU traffic 6-192 MB");
  shadowing const shadow = shadowing_for(platform.spec());
  for (double mb : traffic_mb) {
    register_variant(platform, mb, "flat", false, [](backend const& be, moecomm::exchange_groups<comm_t>& g) {
      using L = moecomm::expert_parallel_layer<float, backend, comm_t>;
      return std::make_unique<variant<L>>(be, g, num_experts, real_hidden);
    });
    std::int32_t const planned = planned_expert_domain(platform, mb);
    if (only_planned) {
      register_variant(platform, mb, "hybridep/S:" + std::to_string(planned), true,
                       [planned](backend const& be, moecomm::exchange_groups<comm_t>& g) {
                         return std::make_unique<variant<hybridep_t>>(be, g, num_experts, real_hidden, moecomm::hybridep{planned});
                       });
      continue;
    }
    register_variant(platform, mb, "hier2d", false, [](backend const& be, moecomm::exchange_groups<comm_t>& g) {
      using L = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, moecomm::hierarchical_2d>;
      return std::make_unique<variant<L>>(be, g, num_experts, real_hidden);
    });
    register_variant(platform, mb, "fastermoe", false, [shadow](backend const& be, moecomm::exchange_groups<comm_t>& g) {
      using L = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, moecomm::flat, moecomm::weighted, shadowing>;
      return std::make_unique<variant<L>>(be, g, num_experts, real_hidden, moecomm::dropless{}, moecomm::flat{},
                                             moecomm::routing_checks{}, shadow);
    });
    register_variant(platform, mb, "ep_dc_dp", false, [](backend const& be, moecomm::exchange_groups<comm_t>& g) {
      return std::make_unique<ep_per_data_centre>(be, g);
    });
    register_variant(platform, mb, "hybridep/S:" + std::to_string(planned) + "/c50", false,
                     [planned](backend const& be, moecomm::exchange_groups<comm_t>& g) {
                       moecomm::hybridep const policy{planned, moecomm::expert_domain_spread::across_data_centres, 50};
                       return std::make_unique<variant<hybridep_t>>(be, g, num_experts, real_hidden, policy);
                     });
    for (std::int32_t s = 1; s <= ranks; ++s) {
      if (ranks % s != 0) continue;
      register_variant(platform, mb, "hybridep/S:" + std::to_string(s), s == planned,
                       [s](backend const& be, moecomm::exchange_groups<comm_t>& g) {
                         return std::make_unique<variant<hybridep_t>>(be, g, num_experts, real_hidden, moecomm::hybridep{s});
                       });
    }
  }
  int const rc = moecomm_bench::finish("bench_hybridep");
  if (g_rows.empty()) return rc;
  print_summary(platform.name().c_str());
  if (!csv.empty()) write_csv(csv);
  return rc;
}
