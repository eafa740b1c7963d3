// SPDX-License-Identifier: Apache-2.0
//! Example 04: an MoE layer on a simulated GPU cluster, five ways.
//!
//! The ranks are S4U actors on the GPUs of a SimGrid platform (default: all 64 GPUs, 16 nodes x 4,
//! of FasterMoE's cluster, `platforms/fastermoe-v100-ib.platform`). The library's code runs for real on each rank and the
//! data really moves, so outputs are real; time is SimGrid's: messages are priced by the platform's
//! links and a per-collective overhead, the experts' GEMMs by the GPU's roofline for their rows,
//! memory kernels by its HBM (docs/simulation.md, "The device").
//!
//! A small real hidden size H stands for the model's H_model: the simulated back-end multiplies
//! token-row bytes by H_model / H and parameter bytes and FLOPs by (H_model / H)^2
//! (`simulation_scale`), so the run is cheap and the times are those of the model-sized layer.
//!
//! Every variant is a fresh layer on a fresh world, on the same tokens and expert parameters:
//!   plain EP with the flat all-to-all, plain EP with hierarchical_2d, FasterMoE's shadowing (flat),
//!   FasterMoE's smart schedule, shadowing with the smart schedule, and plain EP and shadowing with
//!   the deduplicated exchanges (`dedup_per_rank`: one row per token and destination rank; `dedup_per_node`:
//!   one per token and destination node between nodes).
//! For each: the simulated forward and backward of one measured step after a warm-up step, the
//! speed-up over plain flat, the all-to-all messages and bytes by link class, and, beside the
//! shadowing variants, the time FasterMoE's cost model predicted with the platform's rates. Every
//! variant's output and input gradient must equal plain flat's bit for bit on every rank (the
//! deduplicated ones, whose combine adds per rank first, within 1e-6). Shadowing with the smart
//! schedule's measured step is written as a per-rank timeline (CSV, and a PNG drawn by
//! scripts/plot-timeline). Last, whole training iterations: 12 transformer blocks (FasterMoE's
//! MoE-BERT-Wide: every block's FFN is this MoE layer), each variant's step 12 times plus the rest of
//! the iteration (attention, the LM head, the dense gradients' all-reduce, Adam), simulated once and
//! predicted by `iteration_model` beside it.
//!
//! Run with --help for the flags.

#include "../common/exit_code.hpp"
#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/layer_variants.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/plot.hpp"
#include "../common/simulated_cluster.hpp"
#include "../common/simulated_experts.hpp"
#include "../common/simulated_options.hpp"
#include "../common/timing.hpp"
#include "../common/whole_iterations.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/simulation/platform.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace example_support;  // flag checks, formatting, timing, inputs, experts, the Zipf gate, plots (examples/common/)

using std::int32_t;
using std::int64_t;

//! FasterMoE's experts and routing (PPoPP'22 sec. 5): MLP H -> alpha*H -> H with alpha = 2, top-2.
constexpr int32_t alpha = 2;
constexpr int32_t topk = 2;

// ---- options ------------------------------------------------------------------------------------

constexpr char const* program = "example_04_simulated_cluster";

struct options : simulated_options {
  // ranks 0: one per GPU (64 on the default platform: about 11 s here); H_model: FasterMoE's MoE-BERT-Wide
  // platform, tokens, hidden, model hidden, zipf, seed, CSV
  options() : simulated_options{"fastermoe-v100-ib", 256, 32, 1024, 1.2, 1, MOECOMM_EXAMPLE_TIMELINE_CSV} {}
  int32_t ranks = 0;
  int32_t experts = 64;
};

//! What `--help` says the example does.
constexpr char const* about = R"(Runs an MoE layer of 2-layer MLP experts on a SIMULATED GPU cluster (SimGrid), one rank per GPU:
plain expert parallelism (flat and hierarchical_2d all-to-all), FasterMoE's shadowing, its smart
schedule, both, and the deduplicated exchanges (dedup_per_rank, dedup_per_node). Reports simulated forward and
backward times, speed-ups over plain flat, the all-to-all traffic per link class, FasterMoE's cost
model beside the simulated time, checks that every variant's output equals plain flat's (bit for
bit; dedup within 1e-6), and draws one step as a per-rank timeline.)";

options parse_options(int argc, char** argv) {
  return parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_platform_flag(flags, o)
        .add("--ranks", "R", "ranks on GPUs 0..R-1, whole nodes; 0 = every GPU", o.ranks, 0, 1 << 14)
        .add("--experts", "E", "experts; a multiple of R", o.experts, 1, 1 << 14);
    add_row_flags(flags, o, "tokens per rank and step, top-2 Zipf routing", 1 << 16,
                  "the hidden size H stands for: bytes are scaled by HM/H, parameters and\nFLOPs by (HM/H)^2");
    add_zipf_and_csv_flags(flags, o, zipf_help, "where the last variant's step is written, per rank");
  });
}

// ---- the problem: both steps' inputs and the experts' parameters, made before any simulation ------

struct problem : simulated_experts {  // the experts H -> alpha*H -> H, the model's in fp32
  explicit problem(options const& opts)
      : simulated_experts(make_simulated_experts(opts, alpha, sizeof(float), opts.experts)), o(opts),
        platform(moecomm::simulated_platform::named(opts.platform)) {}

  options o;
  moecomm::simulated_platform platform;
  int32_t ranks = 0, per_node = 0, local_experts = 0;
  std::vector<std::vector<step_inputs>> steps;  //!< [warm-up, measured][rank]
  std::vector<int32_t> by_popularity;           //!< the experts from hottest to coldest (a seeded shuffle)
};

problem make_problem(options const& o) {
  problem p(o);
  p.ranks = o.ranks == 0 ? p.platform.spec().num_gpus() : o.ranks;
  p.per_node = whole_nodes(program, p.platform, p.ranks);
  if (o.experts % p.ranks != 0)
    usage_error(program, "--experts " + std::to_string(o.experts) + " is not a multiple of the " + std::to_string(p.ranks) + " ranks");
  p.local_experts = o.experts / p.ranks;
  p.by_popularity = random_popularity(o.experts, o.seed);
  p.steps = make_step_inputs(o.seed, 2, p.ranks, o.tokens, o.hidden,
                             [&](std::mt19937_64& rng) { return route_tokens(o.tokens, p.by_popularity, topk, o.zipf, rng); });
  return p;
}

//! FasterMoE's cost model (planners/fastermoe_cost_model.hpp) with the platform's rates. The layer gives it its real
//! H and scales it by the back-end's simulation_scale, so it prices the H_model-wide layer.
moecomm::fastermoe_cost_params cost_params(problem const& p) {
  moecomm::cluster_spec const& s = p.platform.spec();
  moecomm::fastermoe_cost_params c;
  c.alpha = alpha;
  c.bytes_per_element = sizeof(float);
  c.gemm_flops = s.gemm_flops();
  c.local_bandwidth = s.intra_node.bytes_per_second;
  // In an all-to-all every GPU of a node sends at once: each gets its share of the node's NICs,
  // and no more than its own PCIe link to them.
  c.net_bandwidth = std::min(s.pcie.bytes_per_second, s.nics_per_node * s.nic.bytes_per_second / s.gpus_per_node);
  return c;
}

// ---- one variant: a fresh layer on a fresh world ------------------------------------------------

//! Runs a warm-up step (it sizes the layer's workspaces, as a training loop's first step does) and
//! a measured one. With `recorded`, the measured step's events are left in it.
template <class Algorithm, class Shadowing>
variant_result run_variant(char const* name, problem const& p, Algorithm const& algorithm, Shadowing const& shadowing,
                           moecomm::timeline* recorded = nullptr) {
  using layer_type = moecomm::expert_parallel_layer<float, sim_backend, sim_comm,
                                                    moecomm::dropless, Algorithm, moecomm::weighted, Shadowing>;
  auto const R = static_cast<std::size_t>(p.ranks);
  int64_t const T = p.o.tokens, H = p.o.hidden;
  variant_result res(name, R, moecomm::detail::is_dedup_v<Algorithm>);
  std::vector<double> forward(R), backward(R);
  std::vector<moecomm::alltoall_stats> stats(R);
  run_ranks(p.platform, R, p.scale, recorded, [&](sim_comm comm, sim_backend const& be) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::exchange_groups<sim_comm> groups(comm, moecomm::topology(p.ranks, p.per_node));
    layer_type layer(be, groups, p.o.experts, H, {}, algorithm, {}, shadowing);
    double measured = 0;  // when the measured step began: the timeline keeps it alone
    for (std::size_t s = 0; s < 2; ++s) {
      step_inputs const& in = p.steps[s][me];
      mlp_experts experts = mlp_experts_of(H, p.inner, p.parameters, comm.rank() * p.local_experts, p.local_experts);
      std::vector<float> out(static_cast<std::size_t>(T * H)), d_x(out.size()), d_w(static_cast<std::size_t>(T * topk));
      step_times const t = timed_step(
          comm, [&] { layer.forward({in.gate.idx.data(), in.gate.weights.data(), T, topk}, {in.x.data(), T, H}, {out.data(), T, H}, experts); },
          [&] { layer.backward({in.d_out.data(), T, H}, {d_x.data(), T, H}, d_w, experts); });
      if (s == 0) continue;
      measured = t.start;
      forward[me] = t.forward;
      backward[me] = t.backward;
      stats[me] = layer.dispatch_state().report().exchange;
      res.out[me] = std::move(out);
      res.d_x[me] = std::move(d_x);
      if constexpr (Shadowing::shadows)
        if (me == 0) res.decision = layer.shadow_state().decision();
    }
    return measured;
  });
  res.forward_s = slowest(forward);
  res.backward_s = slowest(backward);
  for (auto const& s : stats) add_traffic(res.exchange, s);
  return res;
}

// ---- the report ---------------------------------------------------------------------------------

void print_setup(problem const& p, moecomm::fastermoe_cost_params const& model) {
  moecomm::cluster_spec const& s = p.platform.spec();
  options const& o = p.o;
  print_simulated_heading("example 04: an MoE layer on a simulated cluster");
  std::printf("1. Configuration\n");
  print_platform(p.platform);
  std::printf(
      "     %d node%s x %d GPUs; %s TFLOP/s, HBM %s GB/s per GPU; intra-node %s GB/s per GPU port%s,\n"
      "     PCIe %s GB/s, %d x %s Gb/s NIC per node, fabric %s\n",
      s.domains * s.nodes_per_domain, s.domains * s.nodes_per_domain == 1 ? "" : "s", s.gpus_per_node,
      format("%g", s.gpu_flops / 1e12).c_str(), format("%g", s.hbm_bytes_per_second / 1e9).c_str(),
      format("%g", s.intra_node.bytes_per_second / 1e9).c_str(), s.intra_node_over_pcie ? " (over PCIe)" : "",
      format("%g", s.pcie.bytes_per_second / 1e9).c_str(), s.nics_per_node,
      format("%g", s.nic.bytes_per_second * 8 / 1e9).c_str(),
      s.fabric.bytes_per_second > 0 ? (format("%g", s.fabric.bytes_per_second / 1e9) + " GB/s shared").c_str()
                                    : "non-blocking");
  std::printf("   ranks R = %d, one per GPU 0..%d (%d node%s x %d); experts E = %d, %d per rank; top-%d, gate Zipf(s = %.2f)\n",
              p.ranks, p.ranks - 1, p.ranks / p.per_node, p.ranks / p.per_node == 1 ? "" : "s", p.per_node, o.experts,
              p.local_experts, topk, o.zipf);
  std::printf("   hottest experts (a random placement, from --seed): ");
  for (int32_t i = 0; i < 4 && i < o.experts; ++i)
    std::printf("%s%d on node %d", i > 0 ? ", " : "", p.by_popularity[static_cast<std::size_t>(i)],
                p.by_popularity[static_cast<std::size_t>(i)] / p.local_experts / p.per_node);
  std::printf("\n");
  std::printf("   tokens: %" PRId64 " per rank; fp32 rows of H = %" PRId64 " real elements standing for H_model = %" PRId64
              "\n     simulation_scale {payload %g, parameters %g, flops %g}\n",
              o.tokens, o.hidden, o.model_hidden, p.scale.payload, p.scale.parameters, p.scale.flops);
  std::printf("   experts: FasterMoE's MLP H -> %dH -> H; simulated: %s parameters, %s FLOP a row forward\n", alpha,
              format_bytes(p.model.parameter_bytes()).c_str(), format("%.3g", p.model.flops_per_row()).c_str());
  std::printf(
      "   each variant: a fresh layer on a fresh world, dropless, weighted combine; one warm-up step, then one\n"
      "   measured step; each pass starts after a barrier and takes its slowest rank's time\n");
  std::printf(
      "   FasterMoE cost model from the platform: P = %s TFLOP/s, W_local = %s GB/s, W_net = %s GB/s\n"
      "     (W_net: min(PCIe, a GPU's share of its node's NICs), as in an all-to-all every GPU sends)\n\n",
      format("%g", s.gpu_flops / 1e12).c_str(), format("%g", model.local_bandwidth / 1e9).c_str(),
      format("%.4g", model.net_bandwidth / 1e9).c_str());
}

int run(options const& o) {
  problem const p = make_problem(o);
  moecomm::fastermoe_cost_params const model = cost_params(p);
  print_setup(p, model);
  // The smart schedule's groups are the nodes: each step exchanges with one node while computing
  // the rows of the previous one (FasterMoE sec. 4.2).
  moecomm::smart_schedule const smart{p.per_node};
  // Parameters and gradients move by the communicator's broadcast and reduce (pipelined chains),
  // as FasterMoE's NCCL collectives do and its model prices them (one transfer at W_net each); the
  // default point-to-point path has the owner send to every rank in turn (R - 1 transfers).
  moecomm::fastermoe_shadowing<moecomm::collective_path> const shadowing{model, {}, {}};
  moecomm::timeline recorded;
  std::vector<variant_result> variants;
  variants.push_back(run_variant("plain EP, flat", p, moecomm::flat{}, moecomm::no_shadowing{}));
  variants.push_back(run_variant("plain EP, hierarchical_2d", p, moecomm::hierarchical_2d{}, moecomm::no_shadowing{}));
  variants.push_back(run_variant("FasterMoE shadowing, flat", p, moecomm::flat{}, shadowing));
  variants.push_back(run_variant("smart schedule", p, smart, moecomm::no_shadowing{}));
  variants.push_back(run_variant("shadowing + smart schedule", p, smart, shadowing, &recorded));
  // One row per (token, destination rank) instead of per slot, summed there (DeepEP's normal kernels).
  variants.push_back(run_variant("plain EP, dedup_per_rank", p, moecomm::dedup_per_rank<moecomm::flat>{}, moecomm::no_shadowing{}));
  variants.push_back(run_variant("shadowing + dedup_per_rank", p, moecomm::dedup_per_rank<moecomm::flat>{}, shadowing));
  // One row per (token, destination node) between nodes, forwarded inside the node (DeepEP's internode kernels).
  variants.push_back(run_variant("plain EP, dedup_per_node", p, moecomm::dedup_per_node{}, moecomm::no_shadowing{}));
  print_variant_times(variants);
  print_variant_traffic(variants, p.scale.payload);
  bool const same = identical_to_plain(variants);
  std::printf("   outputs and input gradients identical to plain EP, flat on every rank (dedup within 1e-6): %s\n\n",
              same ? "yes" : "NO");
  write_timeline(recorded, o.csv, MOECOMM_PLOT_TIMELINE, o.plot,
                 "4. Timeline of the measured step of 'shadowing + smart schedule'");
  print_iterations(p.platform, p.ranks, transformer(o.model_hidden, o.tokens), p.local_experts * p.model.parameters(), variants);
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  return exit_code_of(program, "fewer --tokens or --ranks, or a smaller --hidden", [&] { return with_wall_clock_line([&] { return run(o); }); });
}
