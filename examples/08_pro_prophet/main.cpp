// SPDX-License-Identifier: Apache-2.0
//! Example 08: Pro-Prophet on a simulated RTX 3090 cluster (Pro-Prophet, arXiv 2411.10003).
//!
//! Default: 8 GPUs of `platforms/proprophet-3090.platform` (two nodes of 4 RTX 3090 on PCIe 3.0,
//! 100 Gb/s InfiniBand). A stack of 4 MoE blocks (H = 1024, experts H -> 2H -> H in fp32, one per
//! GPU, top-2, a Zipf(2.0) gate of its own per block: at 1.2 on 8 GPUs the planner's balance
//! threshold, the code's, finds every block balanced) trains for a few iterations three ways:
//! plain expert parallelism; Pro-Prophet's planner alone (planned on each step's counts, its
//! transfers inside the step); and planner + block-wise scheduler (`block_schedule`: planned on the
//! last iteration's counts, each block's transfers begun a block ahead, its gradient aggregation
//! left running under the earlier blocks' backward). Per block: the replicated experts and their
//! subsets, the bytes of Trans/Agg against the token bytes they save, the planner's predicted layer
//! time; then the simulated iterations, how much of Trans/Agg the scheduler hid, the bitwise check
//! against plain EP, and the scheduled run's per-rank timeline (a PNG).
//!
//! A small real hidden size stands for the model's (`simulation_scale`), so the run is cheap and the
//! times are the model-sized stack's. Run with --help for the flags.

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
#include <moecomm/patterns/block_schedule.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/planners/proprophet_planner.hpp>
#include <moecomm/simulation/platform.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace example_support;  // flags, formatting, inputs, experts, the gate, plots (examples/common/)

using std::int32_t;
using std::int64_t;

constexpr int32_t topk = 2, blocks = 4;
constexpr char const* program = "example_08_pro_prophet";

// zipf 2.0: at 1.2 on 8 GPUs the code's balance threshold (eq. 7, α = 3) finds the blocks balanced
struct options : simulated_options {
  // platform, tokens, hidden, model hidden, zipf, seed, CSV
  options() : simulated_options{"proprophet-3090", 2048, 4, 1024, 2.0, 1, MOECOMM_EXAMPLE_TIMELINE_CSV} {}
  int32_t ranks = 8;
  int32_t iterations = 4;  // the first warms up (nothing to predict from)
};

//! What `--help` says the example does.
std::string const about = "Trains a stack of " + std::to_string(blocks) + R"( MoE blocks on a SIMULATED cluster (SimGrid) as plain expert parallelism, with Pro-Prophet's
planner, and with its planner and block-wise scheduler: per block the replicated experts and their subsets, bytes
moved against bytes saved, predicted and simulated times, the hidden transfers, a bitwise check and a timeline.)";

options parse_options(int argc, char** argv) {
  return parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    add_platform_flag(flags, o).add("--ranks", "R", "GPUs, one expert each", o.ranks, 2, 1024);
    add_row_flags(flags, o, "tokens per GPU and iteration, top-" + std::to_string(topk) + " routing", 1 << 20,
                  "the hidden size H stands for; experts HM -> 2 HM -> HM in fp32")
        .add("--iterations", "N", "iterations, the first a warm-up", o.iterations, 2, 1000);
    add_zipf_and_csv_flags(flags, o, "gate skew", "where the scheduled run's last iteration is written, per rank");
  });
}

// ---- the problem ------------------------------------------------------------------------------

struct problem : simulated_experts {  // the experts H -> 2H -> H, the model's in fp32; `parameters` per block below
  explicit problem(options const& opts)
      : simulated_experts(make_simulated_experts(opts, 2, sizeof(float), 0)), o(opts),
        platform(moecomm::simulated_platform::named(opts.platform)) {}
  options o;
  moecomm::simulated_platform platform;
  moecomm::proprophet_cost_params costs;
  std::vector<std::vector<int32_t>> popularity;  //!< [block]: the gate's i-th most popular expert
  std::vector<std::vector<std::vector<float>>> block_parameters;  //!< [block][expert]
};

problem make_problem(options const& o) {
  problem p(o);
  if (o.ranks > p.platform.spec().num_gpus())
    usage_error(program, "--ranks " + std::to_string(o.ranks) + " exceeds the platform's " + std::to_string(p.platform.spec().num_gpus()) + " GPUs");
  p.costs.hidden = o.model_hidden;
  p.costs.sequences_per_device = std::max<int64_t>(1, o.tokens / 256);
  p.costs.seq_length = 256;
  for (int32_t b = 0; b < blocks; ++b) {
    p.popularity.push_back(random_popularity(o.ranks, o.seed * 31 + static_cast<std::uint64_t>(b)));
    p.block_parameters.push_back(initial_parameters_of(o.seed + 1000 * b, o.hidden, p.inner, o.ranks));
  }
  return p;
}

// ---- one run of the stack ---------------------------------------------------------------------------

enum class mode { plain, planner, scheduled };
using plain_t = moecomm::expert_parallel_layer<float, sim_backend, sim_comm>;
using prophet_policy = moecomm::fastermoe_shadowing<moecomm::collective_path, moecomm::proprophet_planner<>>;
using prophet_t = moecomm::expert_parallel_layer<float, sim_backend, sim_comm, moecomm::dropless, moecomm::flat, moecomm::weighted, prophet_policy>;

struct block_view {
  std::vector<int32_t> experts, subset_offsets, subset_ranks;  //!< the last iteration's decision
  double predicted_none = 0, predicted = 0;                   //!< T' without and with it
  std::vector<int64_t> counts;                                 //!< the gathered [R][E] counts it planned on
};

struct run_result {
  double iteration_s = 0;                        //!< mean over the iterations after the first
  std::vector<std::vector<float>> out, d_x;       //!< [rank] the last iteration's stack output and input gradient
  std::vector<block_view> block;                  //!< rank 0's view of each block's decision
};

template <class Layer>
run_result run(problem const& p, mode m, moecomm::timeline* recorded) {
  options const& o = p.o;
  auto const R = static_cast<std::size_t>(o.ranks);
  int64_t const T = o.tokens, H = o.hidden;
  run_result res;
  res.out.resize(R);
  res.d_x.resize(R);
  res.block.resize(blocks);
  std::vector<double> start(R), end(R);
  run_ranks(p.platform, R, p.scale, recorded, [&](sim_comm comm, sim_backend const& be) {
    int32_t const me = comm.rank();
    auto const at = static_cast<std::size_t>(me);
    moecomm::exchange_groups<sim_comm> groups(comm, moecomm::topology(o.ranks, p.platform.gpus_per_node()));
    prophet_policy policy{{}, {}, {}};
    policy.planner.model = moecomm::proprophet_cost_model(p.costs);
    policy.planner.options.schedule =
        m == mode::scheduled ? moecomm::proprophet_schedule::with_scheduler : moecomm::proprophet_schedule::planner_only;
    std::vector<std::unique_ptr<Layer>> layers;
    std::vector<std::unique_ptr<mlp_experts>> experts;
    for (int32_t b = 0; b < blocks; ++b) {
      if constexpr (Layer::shadowing_policy::shadows)
        layers.push_back(std::make_unique<Layer>(be, groups, o.ranks, H, moecomm::dropless{}, moecomm::flat{}, moecomm::routing_checks{}, policy));
      else
        layers.push_back(std::make_unique<Layer>(be, groups, o.ranks, H));
      experts.push_back(std::make_unique<mlp_experts>(mlp_experts_of(H, p.inner, p.block_parameters[static_cast<std::size_t>(b)], me, 1)));
    }
    std::optional<moecomm::block_schedule<Layer, mlp_experts>> schedule;
    if constexpr (Layer::shadowing_policy::shadows) {
      if (m == mode::scheduled) {
        std::vector<Layer*> l;
        std::vector<mlp_experts*> e;
        for (int32_t b = 0; b < blocks; ++b) l.push_back(layers[static_cast<std::size_t>(b)].get()), e.push_back(experts[static_cast<std::size_t>(b)].get());
        schedule.emplace(l, e);
      }
    }
    double const fnec = moecomm::proprophet_cost_model(p.costs).forward_non_expert_time() * p.platform.spec().gemm_flops() / p.scale.flops;
    double total = 0, last_start = std::numeric_limits<double>::infinity();  // rank 0's last iteration: the timeline's
    for (int32_t it = 0; it < o.iterations; ++it) {
      std::vector<routing_data> gates;
      for (int32_t b = 0; b < blocks; ++b) {
        std::seed_seq seq{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(me), static_cast<std::uint32_t>(it),
                          static_cast<std::uint32_t>(b)};
        std::mt19937_64 rng(seq);
        gates.push_back(route_tokens(T, o.ranks, topk, o.zipf, rng));
        for (int32_t& e : gates.back().idx) e = p.popularity[static_cast<std::size_t>(b)][static_cast<std::size_t>(e)];
      }
      std::mt19937_64 rng(o.seed * 7 + static_cast<std::uint64_t>(me));
      std::vector<std::vector<float>> x(blocks + 1), d(blocks + 1);
      x[0] = random_rows(T * H, rng);
      d[blocks] = random_rows(T * H, rng);
      comm.barrier();
      start[at] = moecomm::simulated_seconds{}();
      if (me == 0 && it == o.iterations - 1) last_start = start[at];
      for (int32_t b = 0; b < blocks; ++b) {
        auto const bi = static_cast<std::size_t>(b);
        if constexpr (Layer::shadowing_policy::shadows)
          if (schedule) schedule->before_forward(b);
        be.charge_flops(fnec);  // attention and the dense parts
        x[bi + 1].assign(static_cast<std::size_t>(T * H), 0.0f);
        layers[bi]->forward({gates[bi].idx.data(), gates[bi].weights.data(), T, topk}, {x[bi].data(), T, H}, {x[bi + 1].data(), T, H},
                            *experts[bi]);
      }
      for (int32_t b = blocks - 1; b >= 0; --b) {
        auto const bi = static_cast<std::size_t>(b);
        d[bi].assign(static_cast<std::size_t>(T * H), 0.0f);
        layers[bi]->backward({d[bi + 1].data(), T, H}, moecomm::matrix_view<float>{d[bi].data(), T, H}, moecomm::not_needed, *experts[bi]);
        be.charge_flops(2 * fnec);
      }
      if constexpr (Layer::shadowing_policy::shadows)
        if (schedule) schedule->finish_backward();
      end[at] = moecomm::simulated_seconds{}();
      for (auto& e : experts) std::fill(e->grads.begin(), e->grads.end(), 0.0f);
      comm.barrier();
      if (it > 0 && me == 0) total += *std::max_element(end.begin(), end.end()) - *std::min_element(start.begin(), start.end());
      if (it == o.iterations - 1) {
        res.out[at] = x[blocks];
        res.d_x[at] = d[0];
        if constexpr (Layer::shadowing_policy::shadows)
          if (me == 0)
            for (int32_t b = 0; b < blocks; ++b) {
              auto const& state = layers[static_cast<std::size_t>(b)]->shadow_state();
              auto const& dec = state.decision();
              res.block[static_cast<std::size_t>(b)] = {dec.shadowed, dec.subset_offsets, dec.subset_ranks, dec.latency_unshadowed,
                                                        dec.latency, state.counts()};
            }
      }
    }
    if (me == 0) res.iteration_s = total / (o.iterations - 1);
    return last_start;
  });
  return res;
}

bool same_bits(run_result const& a, run_result const& b) { return a.out == b.out && a.d_x == b.d_x; }

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  problem const p = make_problem(o);
  moecomm::proprophet_cost_model const model(p.costs);
  print_simulated_heading("example 08: Pro-Prophet on a simulated RTX 3090 cluster",
                          "expert GEMMs at the GPU's roofline rate for their rows");
  std::printf("1. Configuration\n   platform %s, first %d GPUs (%d per node)\n     source: %s\n", p.platform.name().c_str(), o.ranks,
              p.platform.gpus_per_node(), p.platform.spec().source.c_str());
  std::printf("   %d MoE blocks, E = %d (one expert per GPU), MLP %" PRId64 " -> %" PRId64 " -> %" PRId64 " fp32 (%s each), top-%d, Zipf(%.1f)\n",
              blocks, o.ranks, o.model_hidden, 2 * o.model_hidden, o.model_hidden, format_bytes(model.expert_parameter_bytes()).c_str(), topk,
              o.zipf);
  std::printf("   %" PRId64 " tokens per GPU and iteration; non-expert compute per block %s forward, twice that backward (the code's FNEC)\n\n",
              o.tokens, format_time(model.forward_non_expert_time()).c_str());

  moecomm::timeline recorded;
  run_result const plain = run<plain_t>(p, mode::plain, nullptr);
  run_result const planner = run<prophet_t>(p, mode::planner, nullptr);
  run_result const scheduled = run<prophet_t>(p, mode::scheduled, &recorded);

  std::printf("2. Per block, the scheduled run's last iteration (planned on the previous iteration's counts)\n");
  std::printf("   %-6s %-34s %14s %16s %12s %12s\n", "block", "replicated expert -> ranks holding it", "Trans + Agg", "tokens kept home",
              "T' none", "T' planned");
  double hidden_work = 0;
  for (int32_t b = 0; b < blocks; ++b) {
    block_view const& v = scheduled.block[static_cast<std::size_t>(b)];
    std::string list;
    double moved = 0, saved = 0;
    for (std::size_t i = 0; i < v.experts.size(); ++i) {
      int32_t const e = v.experts[i];
      std::string ranks;
      int64_t kept = 0;
      for (int32_t k = v.subset_offsets[i]; k < v.subset_offsets[i + 1]; ++k) {
        int32_t const r = v.subset_ranks[static_cast<std::size_t>(k)];
        ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
        kept += v.counts[static_cast<std::size_t>(r) * static_cast<std::size_t>(o.ranks) + static_cast<std::size_t>(e)];
      }
      list += (list.empty() ? "" : "; ") + std::to_string(e) + " -> {" + ranks + "}";
      auto const n = static_cast<double>(v.subset_offsets[i + 1] - v.subset_offsets[i]);
      moved += 2 * n * model.expert_parameter_bytes();                                   // parameters out, gradients back
      saved += 4 * static_cast<double>(kept) * model.token_bytes();                      // dispatch, combine and their backward
    }
    int32_t const skipped = 1;
    hidden_work += model.trans_time(static_cast<int64_t>(v.experts.size()), o.ranks, skipped) +
                   model.agg_time(static_cast<int64_t>(v.experts.size()), o.ranks, skipped);
    std::printf("   %-6d %-34s %14s %16s %12s %12s\n", b, list.empty() ? "(none)" : list.c_str(), format_bytes(moved).c_str(),
                format_bytes(saved).c_str(), format_time(v.predicted_none).c_str(), format_time(v.predicted).c_str());
  }
  std::printf("   (Trans + Agg: the parameters to the subset and the gradients back; the collective path also hands the parameters\n"
              "   to the ranks outside it, unused. Tokens kept home: their four all-to-all legs. T': the planner's layer time with\n"
              "   the scheduler's overlap, Pro-Prophet's model with its code's constants)\n\n");

  std::printf("3. One training iteration, simulated (mean of %d after a warm-up)\n", o.iterations - 1);
  std::printf("   plain expert parallelism              %10s\n", format_time(plain.iteration_s).c_str());
  std::printf("   Pro-Prophet planner                   %10s   %.2fx\n", format_time(planner.iteration_s).c_str(), plain.iteration_s / planner.iteration_s);
  std::printf("   Pro-Prophet planner + scheduler       %10s   %.2fx\n", format_time(scheduled.iteration_s).c_str(), plain.iteration_s / scheduled.iteration_s);
  double const gained = planner.iteration_s - scheduled.iteration_s;
  std::printf("   the model's Trans + Agg for the scheduled plan: %s; the scheduler saved %s against the planner alone\n"
              "   (they plan on different counts, so this is an indication of how much was hidden, not a measurement of it)\n\n",
              format_time(hidden_work).c_str(), format_time(gained).c_str());

  bool const equal = same_bits(planner, plain) && same_bits(scheduled, plain);
  std::printf("4. The stack's outputs and input gradients identical to plain EP's on every rank: %s\n\n", equal ? "yes" : "NO");
  write_timeline(recorded, o.csv, MOECOMM_PLOT_TIMELINE, o.plot,
                 "5. Timeline of the scheduled run's last iteration (the transfers on each rank's lane, beside the compute)");
  return equal ? 0 : 1;
}
