// SPDX-License-Identifier: Apache-2.0
//! Example 05: Parm's schedules for an MoE layer under model (MP), expert (EP) and expert-slicing
//! (ESP) parallelism, on Parm's simulated 32-GPU cluster.
//!
//! Default: 8 ranks on the first two nodes (2 x 4 RTX 2080 Ti, PCIe 3.0, 100 Gb/s InfiniBand) of
//! `platforms/parm-2080ti.platform`, as MP 2 x EP 4 with ESP 2: every expert is cut in two slices,
//! held by the two ranks of an MP group. The same layer runs four ways, each a fresh layer on a
//! fresh world on the same tokens and parameters:
//!   deepspeed_mp (DeepSpeed-MoE: every MP rank dispatches the MP group's tokens), parm_s1 (PauseMP,
//!   separate collectives), parm_s2 (PauseMP, the all-to-all pipelined with the ESP all-gather) and
//!   parm_auto (Parm's rule: the cost model prices S1 and S2 for the step and runs the cheaper);
//!   and the strongest baseline, DeepSpeed-MoE with `drop_tokens` (each MP rank dispatches its share
//!   of the tokens to unsliced experts, replicated on the MP ranks, and the outputs are all-gathered
//!   over MP: PauseMP with ESP = 1, holding MP / ESP times the expert parameters).
//! For each: the simulated forward and backward of one measured step after a warm-up step, the rows
//! each rank dispatches and computes, messages and bytes inside and between nodes, and the cost
//! model's prediction beside the simulated time. Every schedule's output, input gradient and
//! routing-weight gradient must equal deepspeed_mp's bit for bit on every rank (drop_tokens' unsliced
//! experts round once where the slices round twice: within 1e-5 of the largest value). parm_s2's measured
//! step is drawn as a per-rank timeline (CSV and PNG).
//!
//! A small real hidden size stands for the model's (`simulation_scale`), so the run is cheap and the
//! times are the model-sized layer's. Run with --help for the flags.

#include "../common/exit_code.hpp"
#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/parm_tables.hpp"
#include "../common/plot.hpp"
#include "../common/simulated_cluster.hpp"
#include "../common/simulated_experts.hpp"
#include "../common/simulated_options.hpp"
#include "../common/timing.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/parm.hpp>
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

using namespace example_support;  // flags, formatting, timing, inputs, experts, the gate, plots (examples/common/)

using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

constexpr char const* program = "example_05_parm";
constexpr int32_t topk = 2;  // experts per token

struct options : simulated_options {
  // tokens per MP group: batch 4 x sequence 1024
  // platform, tokens, hidden, model hidden, zipf, seed, CSV
  options() : simulated_options{"parm-2080ti", 4096, 8, 2048, 0.0, 1, MOECOMM_EXAMPLE_TIMELINE_CSV} {}
  int32_t ranks = 8;
  int32_t mp = 2, esp = 2;
  int32_t experts = 8;
  int32_t ffn_ratio = 4;  // experts H -> ratio * H -> H
  int32_t pieces = 4;
};

//! What `--help` says the example does.
std::string const about = R"(Runs one MoE layer under MP + EP + ESP on a SIMULATED GPU cluster (SimGrid) with Parm's schedules:
deepspeed_mp, DeepSpeed's drop_tokens (the strongest baseline), parm_s1, parm_s2 and parm_auto.
Reports the rows each rank dispatches and computes, messages and bytes inside and between nodes,
simulated times beside the cost model's predictions, which schedule parm_auto picked and why, checks
every schedule against the baseline (bit for bit on sliced experts), and draws parm_s2's step as a
per-rank timeline.)";

options parse_options(int argc, char** argv) {
  return parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_platform_flag(flags, o)
        .add("--ranks", "R", "ranks on GPUs 0..R-1, whole nodes", o.ranks, 1, 1 << 14)
        .add("--mp", "M", "model-parallel group size, dividing a node's GPUs", o.mp, 1, 1 << 10)
        .add("--esp", "G", "expert-slicing group size, dividing M", o.esp, 1, 1 << 10)
        .add("--experts", "E", "experts, a multiple of EP = R / M", o.experts, 1, 1 << 14);
    add_row_flags(flags, o, "tokens per MP group and step, top-" + std::to_string(topk) + " routing", 1 << 20, "the hidden size H stands for")
        .add("--ffn-ratio", "F", "experts H -> F*H -> H", o.ffn_ratio, 1, 64)
        .add("--pieces", "W", "pipeline depth of parm_s2 and parm_auto", o.pieces, 1, 1024);
    add_zipf_and_csv_flags(flags, o, zipf_help, "where parm_s2's measured step is written, per rank");
  });
}

// ---- the problem: both steps' inputs and the experts' parameters, made before any simulation ------

struct problem : simulated_experts {  // every whole expert; `scale` is a slice's (`scale_for`)
  explicit problem(options const& opts)
      : simulated_experts(make_simulated_experts(opts, opts.ffn_ratio, 2, opts.experts)), o(opts),
        platform(moecomm::simulated_platform::named(opts.platform)) {}

  options o;
  moecomm::simulated_platform platform;
  moecomm::parallel_sizes sizes;
  int32_t per_node = 0, local_experts = 0;
  std::vector<std::vector<step_inputs>> steps;  //!< [warm-up, measured][MP group]: every rank of a group holds the same
};

//! A rank holds one ESP slice of each of its experts (inner I / ESP, and its own copy of b2): the
//! model's experts sliced alike. The model is fp16, as the platform's rate is the 2080 Ti's fp16
//! tensor rate (bench_parm_grid likewise); the stand-in computes in fp32.
moecomm::simulation_scale scale_for(options const& o, int64_t inner, int32_t esp) {
  return moecomm::mlp_simulation_scale({static_cast<double>(o.model_hidden), static_cast<double>(o.ffn_ratio * o.model_hidden) / esp, 2},
                                       {static_cast<double>(o.hidden), static_cast<double>(inner / esp), sizeof(float)});
}

//! `p` with every expert whole on every MP rank (ESP 1): DeepSpeed-MoE's layout under MP.
problem unsliced(problem p) {
  p.sizes.expert_slicing = 1;
  p.scale = scale_for(p.o, p.inner, 1);
  return p;
}

problem make_problem(options const& o) {
  problem p(o);
  p.per_node = whole_nodes(program, p.platform, o.ranks);
  auto const str = [](auto v) { return std::to_string(v); };
  if (p.per_node % o.mp != 0) usage_error(program, "--mp " + str(o.mp) + " does not divide a node's " + str(p.per_node) + " GPUs");
  if (o.mp % o.esp != 0) usage_error(program, "--esp " + str(o.esp) + " does not divide --mp " + str(o.mp));
  p.sizes = {o.mp, o.ranks / o.mp, o.esp};  // DP 1: EP spans the other ranks
  if (o.experts % p.sizes.expert != 0)
    usage_error(program, "--experts " + str(o.experts) + " is not a multiple of EP = " + str(p.sizes.expert));
  p.local_experts = o.experts / p.sizes.expert;
  if (p.inner % o.esp != 0) usage_error(program, "the experts' inner width " + str(p.inner) + " does not split into --esp slices");
  p.scale = scale_for(o, p.inner, o.esp);
  p.steps = make_step_inputs(o.seed, 2, p.sizes.expert, o.tokens, o.hidden,
                             [&](std::mt19937_64& rng) { return route_tokens(o.tokens, o.experts, topk, o.zipf, rng); });
  return p;
}

// ---- one schedule: a fresh layer on a fresh world -----------------------------------------------

template <class Schedule>
schedule_result run_schedule(char const* name, problem const& p, Schedule const& schedule,
                             moecomm::timeline* recorded = nullptr) {
  using layer_type = moecomm::parm_layer<float, sim_backend, sim_comm, Schedule>;
  auto const R = static_cast<std::size_t>(p.o.ranks);
  int64_t const T = p.o.tokens, H = p.o.hidden;
  schedule_result res(name, R);
  std::vector<double> forward(R), backward(R);
  std::vector<moecomm::parm_report> reports(R);
  run_ranks(p.platform, R, p.scale, recorded, [&](sim_comm comm, sim_backend const& be) {
    auto const me = static_cast<std::size_t>(comm.rank());
    moecomm::parallel_groups<sim_comm> groups(comm, p.sizes, moecomm::topology(p.o.ranks, p.per_node));
    auto const at = groups.coordinates();
    layer_type layer(be, groups, p.o.experts, H, schedule);
    double measured = 0;  // when the measured step began: the timeline keeps it alone
    for (std::size_t s = 0; s < 2; ++s) {
      step_inputs const& in = p.steps[s][static_cast<std::size_t>(at.ep)];  // the MP group's tokens
      sliced_mlp_experts experts = sliced_mlp_experts_of(H, p.inner, p.parameters, at.ep * p.local_experts,
                                                         p.local_experts, at.esp, p.sizes.expert_slicing);
      std::vector<float> out(static_cast<std::size_t>(T * H)), d_x(out.size()), d_w(static_cast<std::size_t>(T * topk));
      step_times const t = timed_step(
          comm, [&] { layer.forward({in.gate.idx.data(), in.gate.weights.data(), T, topk}, {in.x.data(), T, H}, {out.data(), T, H}, experts); },
          [&] {
            layer.backward({in.d_out.data(), T, H}, moecomm::matrix_view<float>{d_x.data(), T, H},
                           moecomm::array_view<float>{d_w.data(), T * topk}, experts);
          });
      if (s == 0) continue;
      measured = t.start;
      forward[me] = t.forward;
      backward[me] = t.backward;
      reports[me] = layer.report();
      res.out[me] = std::move(out);
      res.d_x[me] = std::move(d_x);
      res.d_w[me] = std::move(d_w);
    }
    return measured;
  });
  res.forward_s = slowest(forward);
  res.backward_s = slowest(backward);
  for (auto const& r : reports) {
    res.rows_dispatched = std::max(res.rows_dispatched, r.rows_dispatched);
    res.rows_computed = std::max(res.rows_computed, r.rows_computed);
    add_traffic(res.traffic, r.alltoall);
    add_traffic(res.traffic, r.expert_slicing);
    add_traffic(res.traffic, r.model_gather);
  }
  res.auto_report = reports.front();
  return res;
}

// ---- the report ---------------------------------------------------------------------------------

void print_setup(problem const& p) {
  moecomm::cluster_spec const& s = p.platform.spec();
  options const& o = p.o;
  print_simulated_heading("example 05: Parm's schedules (MP + EP + ESP) on a simulated cluster");
  std::printf("1. Configuration\n");
  print_platform(p.platform);
  std::printf("     %d GPUs per node; %s TFLOP/s, HBM %s GB/s per GPU; GPU ports %s GB/s%s, %d x %s Gb/s NIC per node\n",
              s.gpus_per_node, format("%g", s.gpu_flops / 1e12).c_str(), format("%g", s.hbm_bytes_per_second / 1e9).c_str(),
              format("%g", s.intra_node.bytes_per_second / 1e9).c_str(), s.intra_node_over_pcie ? " (PCIe)" : "",
              s.nics_per_node, format("%g", s.nic.bytes_per_second * 8 / 1e9).c_str());
  std::printf("   ranks R = %d on GPUs 0..%d (%d node%s x %d) as MP %d x EP %d, ESP %d: rank = ep * %d + mp\n", o.ranks,
              o.ranks - 1, o.ranks / p.per_node, o.ranks / p.per_node == 1 ? "" : "s", p.per_node, p.sizes.model, p.sizes.expert,
              p.sizes.expert_slicing, p.sizes.model);
  std::printf("   experts E = %d, %d per EP rank, each cut into %d slice%s; top-%d, gate Zipf(s = %.2f), dropless\n", o.experts,
              p.local_experts, p.sizes.expert_slicing, p.sizes.expert_slicing == 1 ? "" : "s", topk, o.zipf);
  std::printf("   tokens: %" PRId64 " per MP group (the same on its %d ranks); fp32 rows of H = %" PRId64
              " real elements standing for fp16 rows of H_model = %" PRId64 "\n     experts H -> %dH -> H; simulation_scale {payload %g, parameters %g, flops %g}\n",
              o.tokens, p.sizes.model, o.hidden, o.model_hidden, o.ffn_ratio, p.scale.payload, p.scale.parameters, p.scale.flops);
  std::printf("   each schedule: a fresh layer on a fresh world; one warm-up step, then one measured step; each pass\n"
              "   starts after a barrier and takes its slowest rank's time; S2 and parm_auto pipeline in %d pieces\n\n",
              o.pieces);
}

int run(options const& o) {
  problem const p = make_problem(o);
  print_setup(p);
  moecomm::parm_cost_model const model(moecomm::parm_cost_params::from_cluster(p.platform.spec()));
  moecomm::timeline recorded;
  problem const whole = unsliced(p);
  std::vector<schedule_result> results;
  results.push_back(run_schedule("deepspeed_mp", p, moecomm::deepspeed_mp{}));
  // Its MP peers' replicas of an expert sum their gradients in the trainer's once-per-iteration
  // expert-data-parallel all-reduce, as DeepSpeed's do, not in every layer step.
  results.push_back(run_schedule("ds_drop_tokens", whole, moecomm::parm_s1{moecomm::replica_gradients::left_to_trainer}));
  results.push_back(run_schedule("parm_s1", p, moecomm::parm_s1{}));
  results.push_back(run_schedule("parm_s2", p, moecomm::parm_s2{o.pieces}, &recorded));
  results.push_back(run_schedule("parm_auto", p, moecomm::parm_auto{model, p.inner, o.pieces}));
  print_rows_and_traffic(results, p.sizes, p.scale.payload);
  // The shape parm_auto agreed on (the layer's real rows), priced as the layer prices it.
  moecomm::parm_layer_shape const shape = results[4].auto_report.shape;
  moecomm::parm_layer_shape whole_shape = shape;
  whole_shape.sizes.expert_slicing = 1;
  moecomm::parm_cost_model const priced = model.scaled(p.scale.payload, p.scale.parameters, p.scale.flops);
  results[0].predicted_s = priced.predict_deepspeed_mp(shape).step_total;
  results[1].predicted_s = model.scaled(whole.scale.payload, whole.scale.parameters, whole.scale.flops).predict_s1(whole_shape).step_total;
  results[2].predicted_s = priced.predict_s1(shape).step_total;
  results[3].predicted_s = priced.predict_s2(shape).step_total;
  results[4].predicted_s = std::string(results[4].auto_report.schedule) == "parm_s2" ? results[3].predicted_s : results[2].predicted_s;
  print_schedule_times(results);
  print_choice(results[4], results[2], results[3]);
  bool const same = identical_to_baseline(results, results[1].name);
  std::printf("5. Outputs, input gradients and routing-weight gradients identical to deepspeed_mp on every rank: %s\n\n",
              same ? "yes" : "NO");
  write_timeline(recorded, o.csv, MOECOMM_PLOT_TIMELINE, o.plot, "6. Timeline of parm_s2's measured step");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  return exit_code_of(program, "fewer --tokens or --ranks, or a smaller --hidden", [&] { return with_wall_clock_line([&] { return run(o); }); });
}
