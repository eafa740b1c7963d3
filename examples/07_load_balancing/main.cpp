// SPDX-License-Identifier: Apache-2.0
//! Example 07: load balancing by replicated experts on a simulated H100 node (FineMoE, FlexMoE).
//!
//! Default: one node of FineMoE's cluster, `platforms/finemoe-h100.platform` (8 H100, NVLink). One
//! MoE layer of 32 experts (MLPs H -> 4H -> H, H = 2048 in bf16) trains for a few steps on a skewed
//! gate (Zipf 1.2, top-2) under four patterns, each one policy of the same layer:
//!   plain EP         `make_expert_parallel_layer<float>(be, groups, E, H)` over EP groups of 4 ranks
//!                    (Megatron-LM: EP 4 x expert-DP 2, so every pattern holds 8 expert slots per GPU);
//!   FasterMoE        the same, plus `fastermoe_shadowing<collective_path>{model}` (replicas broadcast with
//!                    collectives, the path example 04 and the benches use: its best here);
//!   FlexMoE          all 8 ranks, `flexmoe{placement, {}, {planner}}`: each rank's tokens split evenly
//!                    over an expert's replicas, `layer.rebalance(experts, state)` every few steps moves
//!                    replicas (parameters and Adam state) where the planner says they pay off;
//!   FineMoE          all 8 ranks, `finemoe{cyclic placement}`: the exact min-max split every step;
//!                    after a few steps re-placed from the loads seen (`layer.move_replicas`).
//! For each: rows per rank on the first and the last step, bytes moved (tokens, parameters, optimizer
//! state), the simulated step beside a rows model's prediction, the solvers' host time, and a bitwise
//! check against plain EP. The steps are written as CSV and drawn as a PNG.
//!
//! A small real hidden size stands for the model's (`simulation_scale`), so the run is cheap and the
//! times are the model-sized layer's. Run with --help for the flags.

#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/load_balancing_report.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/plot.hpp"
#include "../common/simulated_cluster.hpp"
#include "../common/simulated_experts.hpp"
#include "../common/simulated_options.hpp"
#include "../common/timing.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/layer_policies.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>
#include <moecomm/planners/replica_schedule.hpp>
#include <moecomm/simulation/platform.hpp>

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

constexpr int32_t topk = 2, ranks = 8, experts = 32, slots = 8, ep = experts / slots;
constexpr char const* program = "example_07_load_balancing";
constexpr char const* pattern_names[] = {"plain EP", "FasterMoE", "FlexMoE", "FineMoE"};
constexpr char const* csv_names[] = {"megatron", "fastermoe", "flexmoe", "finemoe"};

struct options : simulated_options {
  // platform, tokens, hidden, model hidden, zipf, seed, CSV
  options() : simulated_options{"finemoe-h100", 4096, 8, 2048, 1.2, 1, MOECOMM_EXAMPLE_STEPS_CSV} {}
  int32_t steps = 40;
  int32_t interval = 10;       // FlexMoE's rebalancing interval
  int32_t replace_after = 10;  // FineMoE's re-placement
};

//! What `--help` says the example does.
std::string const about = "Trains one MoE layer for a few steps on a SIMULATED node (SimGrid) of " + std::to_string(ranks) + R"( GPUs under four patterns: plain expert
parallelism, FasterMoE shadowing, FlexMoE (dynamic replicas, even split) and FineMoE (replicas, exact min-max
split): rows per rank, bytes moved, simulated steps beside a model, solver times, and a bitwise check.)";

options parse_options(int argc, char** argv) {
  return parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_platform_flag(flags, o, "a platform of platforms/ with " + std::to_string(ranks) + " GPUs per node");
    add_row_flags(flags, o, "tokens per rank and step, top-" + std::to_string(topk) + " routing", 1 << 20,
                  "the hidden size H stands for; experts HM -> 4 HM -> HM in bf16")
        .add("--steps", "N", "training steps", o.steps, 1, 100000)
        .add("--interval", "N", "FlexMoE rebalances every N steps", o.interval, 1, 100000)
        .add("--replace-after", "N", "FineMoE re-places from the loads of its first N steps", o.replace_after, 1, 100000);
    add_zipf_and_csv_flags(flags, o, "gate skew: P(expert) ~ 1/(i+1)^s over a shuffled order", "where the per-step results are written",
                           "plot-load-balancing", "--csv");
  });
}

// ---- the problem ------------------------------------------------------------------------------

struct problem : simulated_experts {  // the experts H -> 4H -> H, the model's in bf16
  explicit problem(options const& opts)
      : simulated_experts(make_simulated_experts(opts, 4, 2, experts)), o(opts),
        platform(moecomm::simulated_platform::named(opts.platform)) {}
  options o;
  moecomm::simulated_platform platform;
  std::vector<int32_t> popularity;             //!< the gate's i-th most popular expert (hot experts anywhere, as a trained gate's)
  double seconds_per_row = 0;                  //!< a model row's fwd+bwd compute and transfer: the rows model
  double expert_bytes = 0;                     //!< bf16 parameters of one model expert
};

problem make_problem(options const& o) {
  problem p(o);
  if (p.platform.gpus_per_node() != ranks || p.platform.spec().num_gpus() < ranks)
    usage_error(program, "--platform " + o.platform + " must have nodes of " + std::to_string(ranks) + " GPUs");
  p.popularity = random_popularity(experts, o.seed);
  auto const& spec = p.platform.spec();
  p.seconds_per_row = 3 * p.model.flops_per_row() / spec.gemm_flops() + 4 * p.model.row_bytes() / spec.intra_node.bytes_per_second;
  p.expert_bytes = p.model.parameter_bytes();
  return p;
}

//! Rank `r`'s gate at `step`.
routing_data gate_of(problem const& p, int32_t step, int32_t r) {
  std::seed_seq seq{static_cast<std::uint32_t>(p.o.seed), static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(step)};
  std::mt19937_64 rng(seq);
  routing_data g = route_tokens(p.o.tokens, experts, topk, p.o.zipf, rng);
  for (int32_t& e : g.idx) e = p.popularity[static_cast<std::size_t>(e)];
  return g;
}

// ---- one pattern's run ----------------------------------------------------------------------------

run_result run(problem const& p, int pattern) {
  options const& o = p.o;
  int64_t const T = o.tokens, H = o.hidden;
  auto const R = static_cast<std::size_t>(ranks);
  run_result res;
  res.steps.resize(static_cast<std::size_t>(o.steps));
  res.digest.resize(static_cast<std::size_t>(o.steps) * R);
  res.first_rows.resize(R);
  res.last_rows.resize(R);
  rank_figures f(R);  // every rank's figures of the step, summed up by rank 0
  run_ranks(p.platform, R, p.scale, nullptr, [&](sim_comm comm, sim_backend const& be) {
    int32_t const me = comm.rank();
    auto const at = static_cast<std::size_t>(me);
    // Plain EP and FasterMoE: EP groups of `ep` ranks side by side; the replicated patterns: all ranks.
    sim_comm ep_comm = comm.split(me / ep, me);
    moecomm::exchange_groups<sim_comm> ep_groups(ep_comm, moecomm::topology(ep, ep));
    moecomm::exchange_groups<sim_comm> all(comm, moecomm::topology(ranks, ranks));
    moecomm::fastermoe_cost_params shadow;
    shadow.alpha = 4;
    shadow.bytes_per_element = 2;
    shadow.gemm_flops = p.platform.spec().gemm_flops();
    shadow.net_bandwidth = shadow.local_bandwidth = p.platform.spec().intra_node.bytes_per_second;
    moecomm::flexmoe_planner_options planner;
    planner.interval_steps = o.interval;
    planner.seconds_per_row = p.seconds_per_row;
    planner.bytes_per_replica = p.expert_bytes * 7;  // bf16 weights and 12 B per parameter of Adam state
    planner.move_bytes_per_second = p.platform.spec().intra_node.bytes_per_second;
    moecomm::replica_placement const cyclic = moecomm::replica_placement::cyclic(ranks, slots, ranks * slots / experts);
    moecomm::replica_placement const even =
        moecomm::replica_placement::from_loads(ranks, slots, std::vector<double>(experts, 1.0), o.seed);
    auto const left = moecomm::replica_gradients::left_to_trainer;  // summed with the trainer's expert-DP reduction
    // The four layers; each is one policy of make_expert_parallel_layer.
    using plain_t = moecomm::expert_parallel_layer_of<float, sim_backend, sim_comm>;
    using shadow_t = moecomm::expert_parallel_layer_of<float, sim_backend, sim_comm, moecomm::fastermoe_shadowing<moecomm::collective_path>>;
    using flex_t = moecomm::expert_parallel_layer_of<float, sim_backend, sim_comm, moecomm::flexmoe>;
    using fine_t = moecomm::expert_parallel_layer_of<float, sim_backend, sim_comm, moecomm::finemoe>;
    std::optional<plain_t> plain;
    std::optional<shadow_t> shadowed;
    std::optional<flex_t> flex;
    std::optional<fine_t> fine;
    if (pattern == 0) plain.emplace(be, ep_groups, experts, H);
    if (pattern == 1) shadowed.emplace(be, ep_groups, experts, H, moecomm::dropless{}, moecomm::flat{}, moecomm::routing_checks{},
                                       moecomm::fastermoe_shadowing<moecomm::collective_path>{shadow, {}, {}});
    if (pattern == 2) flex.emplace(be, all, even, H, moecomm::even_split{}, moecomm::routing_checks{}, moecomm::dynamic_placement{planner}, left);
    if (pattern == 3) fine.emplace(be, all, cyclic, H, moecomm::finemoe_split{}, moecomm::routing_checks{}, moecomm::static_placement{}, left);
    moecomm::replica_placement const* const placed = pattern == 2 ? &even : pattern == 3 ? &cyclic : nullptr;
    // Slot l of this rank: expert `placed->expert_at(me, l)`, or the EP group's contiguous block.
    mlp_experts mlp = mlp_experts_in_slots(H, p.inner, p.parameters, slots, [&](int32_t l) {
      return placed ? std::max(placed->expert_at(me, l), 0) : (me % ep) * slots + l;
    });
    // Adam's fp32 master weights and moments: 12 B per model parameter beside its 2 B of bf16, so 6 real
    // floats per real float parameter (both are scaled alike by simulation_scale::parameters).
    adam_state adam{std::vector<float>(mlp.params.size() * 6, 0.0f), mlp.parameter_count() * 6};
    std::vector<double> seen(experts, 0.0);
    moecomm::replica_schedule schedule;
    moecomm::replica_schedule_workspace schedule_ws;
    moecomm::placement_decision plan;
    moecomm::flexmoe_planner_workspace plan_ws;

    for (int32_t step = 0; step < o.steps; ++step) {
      routing_data const gate = gate_of(p, step, me);
      std::mt19937_64 rng(o.seed * 1000003u + static_cast<std::uint64_t>(step * ranks + me));
      std::vector<float> const x = random_rows(T * H, rng), d_out = random_rows(T * H, rng);
      std::vector<float> out(x.size()), d_x(x.size()), d_w(static_cast<std::size_t>(T * topk));
      comm.barrier();
      f.start[at] = moecomm::simulated_seconds{}();
      auto const train = [&](auto& layer) {
        layer.forward({gate.idx.data(), gate.weights.data(), T, topk}, {x.data(), T, H}, {out.data(), T, H}, mlp);
        layer.backward({d_out.data(), T, H}, {d_x.data(), T, H}, d_w, mlp);
      };
      if (plain) train(*plain);
      else if (shadowed) train(*shadowed);
      else if (flex) train(*flex);
      else train(*fine);
      f.end[at] = moecomm::simulated_seconds{}();
      std::fill(mlp.grads.begin(), mlp.grads.end(), 0.0f);  // the trainer's optimizer step would go here
      if (plain || shadowed) {
        auto const& d = plain ? plain->dispatch_state() : shadowed->dispatch_state();
        f.rows[at] = static_cast<double>(d.received_rows() + d.home_rows());
        f.tokens[at] = static_cast<double>(d.report().exchange.bytes()) * p.scale.payload;
      } else {
        auto const& report = flex ? flex->report() : fine->report();
        f.rows[at] = static_cast<double>(report.rank_rows[at]);
        f.tokens[at] = static_cast<double>(report.exchange.bytes()) * p.scale.payload;
      }
      f.moved[at] = 0;
      if (shadowed && me % ep == 0)  // each shadowed expert: broadcast to and reduced from the other ranks of the EP group
        f.moved[at] = static_cast<double>(shadowed->shadow_state().decision().shadowed.size()) * (ep - 1) * 2 * p.expert_bytes;
      f.move_start[at] = f.move_end[at] = 0;
      auto const timed_move = [&](auto&& move) {
        comm.barrier();
        f.move_start[at] = moecomm::simulated_seconds{}();
        move();
        f.move_end[at] = moecomm::simulated_seconds{}();
      };
      if (flex && step % o.interval == o.interval - 1) {
        if (me == 0) {  // the planner's host time, on the loads rebalance() is about to plan on
          res.solver_seconds += seconds_of([&] { moecomm::plan_replica_moves(flex->placement(), flex->expert_loads(), planner, plan, plan_ws); });
          ++res.decisions;
        }
        timed_move([&] {
          moecomm::placement_decision const& d = flex->rebalance(mlp, adam);
          if (me == 0) res.moves += static_cast<int32_t>(d.moves.size());
          if (!d.moves.empty()) f.moved[at] = static_cast<double>(flex->migration().bytes_sent) * p.scale.parameters;
        });
      }
      if (fine) {
        auto const loads = fine->expert_loads();
        for (int32_t e = 0; e < experts; ++e) seen[static_cast<std::size_t>(e)] += static_cast<double>(loads.data[e]);
        if (me == 0) {  // FineMoE's split, timed on the host: what the layer solved this step
          moecomm::replica_sets const sets = moecomm::replica_sets_of(fine->placement());
          res.solver_seconds += seconds_of([&] { moecomm::schedule_replicas(sets, loads, schedule, schedule_ws); });
          ++res.decisions;
        }
        if (step == o.replace_after - 1)
          timed_move([&] {
            f.moved[at] = static_cast<double>(
                            fine->move_replicas(moecomm::replica_placement::from_loads(ranks, slots, seen, o.seed), mlp, adam).bytes_sent) *
                        p.scale.parameters;
          });
      }
      res.digest[static_cast<std::size_t>(step) * R + at] = fnv(fnv(fnv(1469598103934665603ull, out), d_x), d_w);
      if (step == 0) res.first_rows[at] = static_cast<int64_t>(f.rows[at]);
      res.last_rows[at] = static_cast<int64_t>(f.rows[at]);
      comm.barrier();
      if (me == 0) res.steps[static_cast<std::size_t>(step)] = summarize_step(f, shadowed.has_value());
    }
    return 0.0;  // nothing recorded
  });
  return res;
}

// ---- the report -----------------------------------------------------------------------------------

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  problem const p = make_problem(o);
  print_simulated_heading("example 07: load balancing by replicated experts on a simulated node");
  std::printf("1. Configuration\n");
  print_platform(p.platform, ", its first node: " + std::to_string(ranks) + " GPUs");
  std::printf("   E = %d experts, MLP %" PRId64 " -> %" PRId64 " -> %" PRId64 " bf16 (%s each, %s with Adam state); top-%d, Zipf(%.1f)\n",
              experts, o.model_hidden, 4 * o.model_hidden, o.model_hidden, format_bytes(p.expert_bytes).c_str(),
              format_bytes(p.expert_bytes * 7).c_str(), topk, o.zipf);
  std::printf("   %d expert slots per GPU in every pattern; %" PRId64 " tokens per GPU per step; %d steps; FlexMoE rebalances every %d,\n"
              "   FineMoE re-places after %d; replica gradients are left to the trainer's expert-DP reduction in all of them\n\n",
              slots, o.tokens, o.steps, o.interval, o.replace_after);

  std::vector<run_result> runs;
  for (int i = 0; i < 4; ++i) runs.push_back(run(p, i));

  std::printf("2. Rows each GPU computed, first step -> last step\n");
  for (std::size_t i = 0; i < runs.size(); ++i) print_rows(pattern_names[i], runs[i].first_rows, runs[i].last_rows);

  std::printf("\n3. Per step (simulated), beside the rows model (busiest GPU's rows x %.3g us per row, compute and transfer)\n",
              p.seconds_per_row * 1e6);
  print_steps_table(runs, pattern_names, p.seconds_per_row);
  std::printf("   FlexMoE made %d moves; the model leaves out latencies, the permutations and the all-to-all's contention.\n\n",
              runs[2].moves);

  bool equal = true;
  for (std::size_t i = 1; i < runs.size(); ++i) equal = equal && runs[i].digest == runs[0].digest;
  std::printf("4. Outputs, input gradients and routing-weight gradients of every pattern identical to plain EP's, on every\n"
              "   rank at every step (before and after every move): %s\n\n", equal ? "yes" : "NO");

  write_steps_csv(o.csv, p.platform.name(), runs, csv_names);
  std::printf("5. The steps, per pattern: %s\n", o.csv.c_str());
  draw_csv(MOECOMM_PLOT_LOAD_BALANCING, o.csv, o.plot);
  return equal ? 0 : 1;
}
