// SPDX-License-Identifier: Apache-2.0
//! Example 06: HybridEP on a simulated cross-data-centre cluster (HybridEP, arXiv 2510.19470).
//!
//! Default: HybridEP's 16-GPU platform, `platforms/hybridep-a800-16.platform`: 4 data centres of one
//! node of 4 A800 (PCIe inside, 10 Gb/s Ethernet between). One MoE layer of 32 experts (MLPs
//! H -> 4H -> H, H = 150 in fp16: 0.36 MB each, the paper's expert size) runs one training step
//! (the pre-expert compute, forward, backward) as plain expert parallelism and as HybridEP with
//! expert domains of every size S (across the data centres), with the planner's S and the 50x top-k
//! codec, and as the strongest baseline, EP inside each data centre with the experts data-parallel
//! across them (`expert_data_parallel`). For each: the simulated step, the bytes per link class (tokens and experts),
//! and the planner's prediction beside it. Every exact run must give plain EP's outputs and
//! gradients bit for bit on every rank. The planner's S is drawn as a per-rank timeline, where the
//! expert gather hides behind the pre-expert compute.
//!
//! A small real hidden size stands for the model's (`simulation_scale`), so the run is cheap and the
//! times are the model-sized layer's. Run with --help for the flags.

#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/plot.hpp"
#include "../common/simulated_cluster.hpp"
#include "../common/simulated_experts.hpp"
#include "../common/simulated_options.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/planners/hybridep_planner.hpp>
#include <moecomm/simulation/platform.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace example_support;  // flags, formatting, inputs, experts, the gate, plots (examples/common/)

using std::int32_t;
using std::int64_t;

constexpr int32_t topk = 2;
constexpr char const* program = "example_06_hybridep";

// tokens per rank and step: 16384 x 2 slots x 150 x 2 B = 9.8 MB of traffic per GPU; H_model 150: 0.36 MB experts
struct options : simulated_options {
  // platform, tokens, hidden, model hidden, zipf, seed, CSV
  options() : simulated_options{"hybridep-a800-16", 16384, 4, 150, 0.0, 1, MOECOMM_EXAMPLE_TIMELINE_CSV} {}
  int32_t experts = 32;
  double pre_expert_ms = 2;  // attention and dense FFN before the MoE block
  double compression = 50;   // the codec's run at the planner's S
};

//! What `--help` says the example does.
constexpr char const* about = R"(Runs one MoE layer on a SIMULATED cross-data-centre cluster (SimGrid) as plain expert parallelism and as
HybridEP with expert domains of every size S across the data centres (and the planner's S with the top-k
codec): simulated step times beside the planner's predictions, bytes per link class, a bitwise check
against plain EP, and the planner's S drawn as a per-rank timeline.)";

options parse_options(int argc, char** argv) {
  return parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_platform_flag(flags, o, "a platform of platforms/ with one node per data centre")
        .add("--experts", "E", "experts, a multiple of the ranks", o.experts, 1, 1 << 14);
    add_row_flags(flags, o, "tokens per rank and step, top-" + std::to_string(topk) + " routing", 1 << 22,
                  "the hidden size H stands for; experts HM -> 4 HM -> HM")
        .add("--pre-expert-ms", "MS", "pre-expert compute per step, simulated", o.pre_expert_ms, 0.0, 1e6)
        .add("--compression", "C", "the codec's ratio at the planner's S", o.compression, 1.0, 1e6);
    add_zipf_and_csv_flags(flags, o, zipf_help, "where the planner's S's step is written, per rank");
  });
}

// ---- the problem ------------------------------------------------------------------------------

struct problem : simulated_experts {  // the experts H -> 4H -> H, the model's in fp16
  explicit problem(options const& opts)
      : simulated_experts(make_simulated_experts(opts, 4, 2, opts.experts)), o(opts),
        platform(moecomm::simulated_platform::named(opts.platform)) {}
  options o;
  moecomm::simulated_platform platform;
  int32_t ranks = 0, per_node = 0, domains = 0, local_experts = 0;
  std::vector<std::vector<step_inputs>> steps;  //!< [warm-up, measured][rank]
};

problem make_problem(options const& o) {
  problem p(o);
  moecomm::cluster_spec const& spec = p.platform.spec();
  p.ranks = spec.num_gpus();
  p.per_node = p.platform.gpus_per_node();
  p.domains = spec.domains;
  if (spec.nodes_per_domain != 1)
    usage_error(program, "--platform " + o.platform + " has " + std::to_string(spec.nodes_per_domain) +
                             " nodes per data centre; the planner models one (HybridEP's setting)");
  if (o.experts % p.ranks != 0)
    usage_error(program, "--experts " + std::to_string(o.experts) + " is not a multiple of the " + std::to_string(p.ranks) + " ranks");
  p.local_experts = o.experts / p.ranks;
  p.steps = make_step_inputs(o.seed, 2, p.ranks, o.tokens, o.hidden,
                             [&](std::mt19937_64& rng) { return route_tokens(o.tokens, o.experts, topk, o.zipf, rng); });
  return p;
}

//! The planner's view of the model-sized layer.
moecomm::hybridep_layer_shape planner_shape(problem const& p) {
  moecomm::hybridep_layer_shape s;
  s.ranks_per_domain = p.per_node;
  s.domains = p.domains;
  s.experts_per_rank = p.local_experts;
  s.parameter_bytes_per_expert = static_cast<int64_t>(p.model.parameter_bytes());
  s.token_bytes = p.o.tokens * topk * static_cast<int64_t>(p.model.row_bytes());
  s.pre_expert_seconds = p.o.pre_expert_ms * 1e-3;
  s.expert_flops = static_cast<double>(p.o.tokens * topk) * p.model.flops_per_row();
  return s;
}

// ---- one run: a fresh layer on a fresh world -----------------------------------------------------

struct run_result {
  std::string name;
  double step_s = 0;                                      //!< the measured step, earliest start to latest end
  moecomm::alltoall_stats tokens, experts;                //!< measured step, all ranks, real bytes
  std::vector<std::vector<float>> out, d_x, d_w, grads;  //!< [rank]
};

//! Plain expert parallelism, HybridEP with a policy, or EP inside each data centre with the experts
//! data-parallel across them (`expert_data_parallel`: every data centre holds every expert).
struct layout {
  std::optional<moecomm::hybridep> hybridep;
  bool expert_data_parallel = false;
};

run_result run(problem const& p, std::string name, layout const& how, moecomm::timeline* recorded = nullptr) {
  auto const R = static_cast<std::size_t>(p.ranks);
  int64_t const T = p.o.tokens, H = p.o.hidden;
  run_result res;
  res.name = std::move(name);
  res.out.resize(R);
  res.d_x.resize(R);
  res.d_w.resize(R);
  res.grads.resize(R);
  std::vector<double> start(R), end(R);
  std::vector<moecomm::alltoall_stats> tokens(R), experts(R);
  run_ranks(p.platform, R, p.scale, recorded, [&](sim_comm comm, sim_backend const& be) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::exchange_groups<sim_comm> groups(comm, moecomm::topology(p.ranks, p.per_node, 1));  // a data centre = a node
    std::optional<moecomm::expert_parallel_layer<float, sim_backend, sim_comm>> plain;
    std::optional<moecomm::hybridep_layer<float, sim_backend, sim_comm>> hybrid;
    std::optional<moecomm::expert_parallel_layer_of<float, sim_backend, sim_comm, moecomm::expert_data_parallel>> replicated;
    // Every data centre holds all E experts, E / per_node consecutive ones on each of its ranks.
    auto const per_domain = moecomm::replica_placement::per_domain(p.ranks, p.o.experts / p.per_node, p.per_node);
    if (how.hybridep) hybrid.emplace(be, groups, p.o.experts, H, *how.hybridep);
    else if (how.expert_data_parallel) replicated.emplace(be, groups, per_domain, H);
    else plain.emplace(be, groups, p.o.experts, H);
    mlp_experts mlp = how.expert_data_parallel
                          ? mlp_experts_of(H, p.inner, p.parameters, per_domain.expert_at(comm.rank(), 0), per_domain.slots_per_rank())
                          : mlp_experts_of(H, p.inner, p.parameters, comm.rank() * p.local_experts, p.local_experts);
    for (std::size_t s = 0; s < 2; ++s) {
      step_inputs const& in = p.steps[s][me];
      std::vector<float> out(static_cast<std::size_t>(T * H)), d_x(out.size()), d_w(static_cast<std::size_t>(T * topk));
      moecomm::routing_view const routing{in.gate.idx.data(), in.gate.weights.data(), T, topk};
      comm.barrier();
      start[me] = moecomm::simulated_seconds{}();
      if (hybrid) hybrid->begin_expert_gather(mlp);  // in the background, beside the pre-expert compute
      be.charge_flops(p.o.pre_expert_ms * 1e-3 * p.platform.spec().gemm_flops() / p.scale.flops);
      moecomm::matrix_view<float const> const x{in.x.data(), T, H}, g{in.d_out.data(), T, H};
      moecomm::matrix_view<float> const y{out.data(), T, H}, dx{d_x.data(), T, H};
      moecomm::array_view<float> const dw{d_w.data(), T * topk};
      auto const step = [&](auto& layer) {
        layer.forward(routing, x, y, mlp);
        layer.backward(g, dx, dw, mlp);
      };
      if (hybrid) step(*hybrid);
      else if (replicated) step(*replicated);
      else step(*plain);
      end[me] = moecomm::simulated_seconds{}();
      if (s == 0) {
        std::fill(mlp.grads.begin(), mlp.grads.end(), 0.0f);
        continue;
      }
      if (hybrid) {
        tokens[me] = hybrid->report().exchange;
        experts[me] = hybrid->report().expert_gather;
      } else {
        tokens[me] = replicated ? replicated->report().exchange : plain->dispatch_state().report().exchange;
      }
      res.out[me] = std::move(out);
      res.d_x[me] = std::move(d_x);
      res.d_w[me] = std::move(d_w);
      res.grads[me] = mlp.grads;
    }
    return start[me];  // the measured step's: the timeline keeps it alone
  });
  double const first = *std::min_element(start.begin(), start.end());
  res.step_s = *std::max_element(end.begin(), end.end()) - first;
  for (std::size_t r = 0; r < R; ++r) {
    add_traffic(res.tokens, tokens[r]);
    add_traffic(res.experts, experts[r]);
  }
  return res;
}

bool same_bits(run_result const& a, run_result const& b) {
  return a.out == b.out && a.d_x == b.d_x && a.d_w == b.d_w;
}

// ---- the report -----------------------------------------------------------------------------------

std::string link_bytes(moecomm::alltoall_stats const& s, double scale) {
  return format_bytes(static_cast<double>(s.intra_bytes + s.inter_bytes) * scale) + " / " +
         format_bytes(static_cast<double>(s.inter_domain_bytes) * scale);
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  problem const p = make_problem(o);
  moecomm::cluster_spec const& spec = p.platform.spec();
  print_simulated_heading("example 06: HybridEP on a simulated cross-data-centre cluster");
  std::printf("1. Configuration\n");
  print_platform(p.platform, ": " + std::to_string(p.domains) + " data centres x " + std::to_string(p.per_node) + " GPUs");
  std::printf("     inside a data centre %s per GPU port; between data centres %s per data centre\n",
              format_bytes(spec.intra_node.bytes_per_second).c_str(), format_bytes(spec.inter_domain.bytes_per_second).c_str());
  moecomm::hybridep_layer_shape const shape = planner_shape(p);
  std::printf("   E = %d experts (%d per rank), MLP %" PRId64 " -> %" PRId64 " -> %" PRId64 " fp16: %s each; top-%d, Zipf(%.1f)\n",
              o.experts, p.local_experts, o.model_hidden, 4 * o.model_hidden, o.model_hidden,
              format_bytes(static_cast<double>(shape.parameter_bytes_per_expert)).c_str(), topk, o.zipf);
  std::printf("   %" PRId64 " tokens per rank: %s of token traffic per GPU per all-to-all; pre-expert compute %.1f ms\n",
              o.tokens, format_bytes(static_cast<double>(shape.token_bytes)).c_str(), o.pre_expert_ms);
  std::printf("   real rows of %" PRId64 " floats stand for the model's (simulation_scale {payload %.3g, parameters %.3g, flops %.3g})\n\n",
              o.hidden, p.scale.payload, p.scale.parameters, p.scale.flops);

  moecomm::hybridep_planner const planner(moecomm::hybridep_params::from_cluster(spec));
  moecomm::hybridep_choice const choice = planner.choose(shape);

  std::vector<run_result> runs;
  runs.push_back(run(p, "plain EP", {}));
  moecomm::timeline recorded;
  for (auto const& c : choice.candidates) {
    int32_t const s = c.expert_domain_ranks;
    bool const planned = s == choice.expert_domain_ranks;
    runs.push_back(run(p, "HybridEP S=" + std::to_string(s), {moecomm::hybridep{s}}, planned ? &recorded : nullptr));
  }
  runs.push_back(run(p, "HybridEP S=" + std::to_string(choice.expert_domain_ranks) + " codec " + format("%.0fx", o.compression),
                     {moecomm::hybridep{choice.expert_domain_ranks, moecomm::expert_domain_spread::across_data_centres, o.compression}}));
  runs.push_back(run(p, "EP per DC + expert DP", {std::nullopt, true}));

  std::printf("2. One training step (pre-expert compute, forward, backward), simulated, beside the planner\n");
  std::printf("   (bytes: all ranks, the measured step; 'in DC / across' = inside data centres / between them)\n");
  std::printf("   %-24s %10s %8s %10s   %-25s %-25s\n", "run", "step", "speedup", "planner", "tokens in DC / across",
              "experts in DC / across");
  bool all_equal = true;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    run_result const& r = runs[i];
    std::string predicted = "-";
    if (i >= 1 && i <= choice.candidates.size()) predicted = format_time(choice.candidates[i - 1].step_total);
    bool const exact = i <= choice.candidates.size() || i == runs.size() - 1;  // all but the codec's run
    if (exact && i > 0) all_equal = all_equal && same_bits(r, runs[0]);
    std::printf("   %-24s %10s %7.2fx %10s   %-25s %-25s%s\n", r.name.c_str(), format_time(r.step_s).c_str(), runs[0].step_s / r.step_s,
                predicted.c_str(), link_bytes(r.tokens, p.scale.payload).c_str(), (i + 1 == runs.size() ? std::string("(gradients' all-reduce)") : link_bytes(r.experts, p.scale.parameters)).c_str(),
                i >= 1 && i <= choice.candidates.size() && choice.candidates[i - 1].expert_domain_ranks == choice.expert_domain_ranks
                    ? "  <- planner's S"
                    : "");
  }
  std::size_t planned_run = 0;  // runs[i] is candidate i - 1
  for (std::size_t i = 0; i < choice.candidates.size(); ++i)
    if (choice.candidates[i].expert_domain_ranks == choice.expert_domain_ranks) planned_run = i + 1;
  std::printf("   'EP per DC + expert DP' (expert_data_parallel): every data centre holds every expert, tokens stay home, and each\n"
              "   step all-reduces the experts' gradients across the data centres: HybridEP's strongest baseline. The planner's\n"
              "   S is %.2fx faster than it (and %.2fx than plain EP).\n",
              runs.back().step_s / runs[planned_run].step_s, runs[0].step_s / runs[planned_run].step_s);
  std::printf("   planner: planners/hybridep_planner.hpp with the platform's figures (hybridep_params::from_cluster): the paper's\n"
              "   stream model of the forward (gather beside the pre-expert compute, two all-to-alls, GEMMs) plus the backward\n"
              "   (two all-to-alls, the gradients' reduce-scatter, the GEMMs twice); uniform routing; not the permutations.\n\n");

  std::printf("3. The planner chose S = %d (p = %.3f of plain EP's bytes still sent as tokens); section III-E's closed\n"
              "   form for one data centre gives p* = %.3f and picks p = %.3f. Expert domains lie across the data centres:\n"
              "   experts (%s each) cross the slow links, tokens stay inside a data centre when S is a multiple of %d.\n\n",
              choice.expert_domain_ranks, choice.p, choice.p_star, choice.p_rule,
              format_bytes(static_cast<double>(shape.parameter_bytes_per_expert)).c_str(), p.domains);

  std::printf("4. Outputs, input gradients and routing-weight gradients of every exact run identical to plain EP on every\n"
              "   rank: %s (the codec's run differs by design: its gathered experts are approximations)\n\n",
              all_equal ? "yes" : "NO");
  write_timeline(recorded, o.csv, MOECOMM_PLOT_TIMELINE, o.plot,
                 "5. Timeline of the planner's S's measured step (the gather on each rank's lane, beside the compute)");
  return all_equal ? 0 : 1;
}
