// SPDX-License-Identifier: Apache-2.0
//! Example 03: FasterMoE's expert shadowing, beside plain expert parallelism.
//!
//! With skewed routing the owner of a popular expert receives and computes far more token rows
//! than the other ranks. FasterMoE (Lei et al., PPoPP'22, §4.1) "shadows" such experts: their
//! owners broadcast their parameters to every rank, every rank computes its own tokens of them
//! (those rows never cross the network), and in the backward every rank's gradient of them is
//! summed back into the owner's. Each step its Algorithm 1 picks the set from the all-gathered
//! token counts with a cost model (planners/fastermoe_cost_model.hpp, planners/shadow_selection.hpp).
//!
//! R ranks run as R threads of this process (`inproc_world`), as N nodes of G ranks. The experts
//! are FasterMoE's: 2-layer MLPs H -> alpha*H -> H with ReLU, written below with plain loops as
//! parametric experts (patterns/experts.hpp). Every step, each rank routes fresh tokens (Zipf
//! gate) through two layers that differ in one policy type:
//!   expert_parallel_layer<float, host_backend, inproc_communicator, dropless, pairwise, weighted, no_shadowing>
//!   expert_parallel_layer<float, host_backend, inproc_communicator, dropless, pairwise, weighted,
//!   fastermoe_shadowing<>>
//! with fresh, identical copies of the experts' parameters. The program reports the shadow set,
//! the rows each rank computes, the bytes of parameters moved against the bytes of tokens no longer
//! sent, the model's predicted layer time (calibrated on this machine by models/calibration.hpp)
//! beside the measured one (median and range of --iters runs), and checks that outputs and
//! gradients agree with plain expert parallelism.
//!
//! Run with --help for the flags.

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include "../common/flags.hpp"
#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/timing.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/models/calibration.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <new>
#include <optional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace example_support;  // flag checks, formatting, timing, inputs, the Zipf gate (examples/common/)

using moecomm::inproc_communicator;
using moecomm::matrix_view;
using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

struct options {
  int32_t ranks = 8;
  int32_t nodes = 2;
  int32_t experts = 16;
  int32_t topk = 2;
  int64_t tokens = 1024;  // per rank
  int64_t hidden = 64;
  int32_t alpha = 2;  // the experts' hidden layer is alpha * H wide
  double zipf = 1.2;
  std::uint64_t seed = 1;
  int steps = 3;
  int iters = 5;     // timed runs of each step's layers: a median and a range
  int timeout = 60;  // seconds, the in-process world's collective timeout
};

constexpr char const* program = "example_03_fastermoe_shadowing";

options parse_options(int argc, char** argv) {
  options o;
  flag_set flags(program, "%s [flags]",
                 "Runs an MoE layer of 2-layer MLP experts, expert parallel over R in-process ranks (threads),\n"
                 "with and without FasterMoE's shadowing of hot experts, on the same inputs: reports the shadow\n"
                 "set of each step, the rows each rank computes, parameter bytes moved against token bytes saved,\n"
                 "the cost model's predicted time beside the measured one, and checks that outputs and gradients\n"
                 "agree with plain expert parallelism.");
  flags.add("--ranks", "R", "in-process ranks, one thread each", o.ranks, 1, 64)
      .add("--nodes", "N", "nodes; must divide R, each holds R / N ranks", o.nodes, 1, 64)
      .add("--experts", "E", "experts; a multiple of R, E / R per rank", o.experts, 1, 1 << 12)
      .add("--topk", "K", "distinct experts per token, K <= E", o.topk, 1, 1 << 12)
      .add("--tokens", "T", "tokens per rank and step", o.tokens, 1, 1 << 20)
      .add("--hidden", "H", "elements per token row", o.hidden, 1, 4096)
      .add("--alpha", "A", "expert MLP H -> A*H -> H", o.alpha, 1, 16)
      .add("--zipf", "s", "gate skew: P(expert e) ~ 1/(e+1)^s, the same on every rank; 0 is uniform", o.zipf, 0.0, 16.0)
      .add("--seed", "N", "seed of the gate, the rows and the parameters", o.seed)
      .add("--steps", "N", "steps, each with fresh tokens; one untimed warm-up step comes first", o.steps, 1, 1000)
      .add("--iters", "N", "timed runs of each step's layers, the first one checked; the median and\nmin-max are shown",
           o.iters, 1, 1000)
      .add("--timeout", "S", "seconds a rank may wait in a collective before the run aborts", o.timeout, 1, 3600);
  flags.parse(argc, argv);
  auto const str = [](auto v) { return std::to_string(v); };
  if (o.ranks % o.nodes != 0)
    usage_error(program, "--nodes " + str(o.nodes) + " does not divide --ranks " + str(o.ranks) +
                ": every node holds the same number of ranks");
  if (o.experts % o.ranks != 0)
    usage_error(program, "--experts " + str(o.experts) + " is not a multiple of --ranks " + str(o.ranks) +
                ": each rank holds E / R experts");
  if (o.topk > o.experts)
    usage_error(program, "--topk " + str(o.topk) + " exceeds --experts " + str(o.experts) +
                ": every token picks K distinct experts");
  return o;
}

// ---- the experts: FasterMoE's 2-layer MLP (examples/common/mlp_experts.hpp) -------------------

//! 4*alpha*H^2: FLOPs of one row through one expert, forward (the cost model's count).
double forward_flops_per_row(int64_t hidden, int32_t alpha) {
  return 4.0 * alpha * static_cast<double>(hidden) * static_cast<double>(hidden);
}

// ---- calibration: the cost model's machine constants, measured ----------------------------------

//! The time of one thread running an expert's forward, fitted over 3 row counts up to ~50 MFLOP.
moecomm::compute_calibration measure_expert_rate(int64_t hidden, int32_t alpha, int repeats) {
  double const flops_per_row = forward_flops_per_row(hidden, alpha);
  int64_t const rows = std::max<int64_t>(16, static_cast<int64_t>(5e7 / flops_per_row));
  mlp_experts experts;
  experts.hidden = hidden;
  experts.inner = alpha * hidden;
  experts.params.assign(static_cast<std::size_t>(experts.parameter_count()), 0.01f);
  std::vector<float> in(static_cast<std::size_t>(rows * hidden), 0.5f), out(in.size());
  auto const forward = [&](int64_t n) {
    experts.forward(experts.parameters(0), {in.data(), n, hidden}, {out.data(), n, hidden});
  };
  return moecomm::measure_compute_rate(forward, flops_per_row, {{rows / 16, rows / 4, rows}, repeats});
}

//! Both link classes of R in-process ranks as N nodes: ring exchanges of 16 KiB to 4 MiB, every
//! rank at once, agreed across ranks (the same on every rank; rank 0's is returned).
moecomm::link_calibration measure_rank_links(options const& o, int32_t per_node, int repeats) {
  moecomm::link_calibration links;
  moecomm::inproc_world const world(o.ranks, std::chrono::seconds(o.timeout));
  moecomm::topology const topo(o.ranks, per_node);
  world.run([&](inproc_communicator comm) {
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    auto const mine = moecomm::measure_links(moecomm::host_backend{}, groups, {{16 << 10, 256 << 10, 4 << 20}, repeats});
    if (comm.rank() == 0) links = mine;
  });
  return links;
}

// ---- the problem: every step's inputs and the experts' parameters, made on the main thread --------

//! One rank's inputs of one step.
struct rank_inputs {
  routing_data gate;
  std::vector<float> x, d_out;  //!< [T][H]: the tokens, and the gradient of the layer's output
};

struct problem {
  options o;
  int32_t per_node = 1, local_experts = 1;
  int64_t inner = 0;                            //!< the experts' hidden width, alpha * H
  std::vector<std::vector<rank_inputs>> steps;  //!< [warm-up + steps][rank]
  std::vector<std::vector<float>> parameters;   //!< [E][parameter count]: every expert's initial values
};

problem make_problem(options const& o) {
  problem p;
  p.o = o;
  p.per_node = o.ranks / o.nodes;
  p.local_experts = o.experts / o.ranks;
  p.inner = o.alpha * o.hidden;
  for (int s = 0; s <= o.steps; ++s) {  // step 0 is the warm-up
    p.steps.emplace_back();
    for (int32_t r = 0; r < o.ranks; ++r) {
      std::seed_seq seq{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(o.seed >> 32),
                        static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(s)};
      std::mt19937_64 rng(seq);
      rank_inputs in;
      in.gate = route_tokens(o.tokens, o.experts, o.topk, o.zipf, rng);
      in.x = random_rows(o.tokens * o.hidden, rng);
      in.d_out = random_rows(o.tokens * o.hidden, rng);
      p.steps.back().push_back(std::move(in));
    }
  }
  for (int32_t e = 0; e < o.experts; ++e) p.parameters.push_back(mlp_initial_parameters(o.seed, o.hidden, p.inner, e));
  return p;
}

//! Rank r's experts with their initial parameters and zeroed gradients: a fresh copy per layer.
mlp_experts experts_of_rank(problem const& p, int32_t r) {
  return mlp_experts_of(p.o.hidden, p.inner, p.parameters, r * p.local_experts, p.local_experts);
}

// ---- one step on one rank: both layers, then the comparison -------------------------------------

//! What one layer produced on one rank in one step.
struct layer_step {
  std::vector<float> out, d_x, d_w;
  mlp_experts experts;     //!< with the owners' parameter gradients, after the reduction
  double seconds = 0;      //!< forward + backward, this rank's wall clock
  int64_t rows = 0;        //!< rows this rank's experts computed (received + home)
  int64_t home_rows = 0;   //!< of which rows of its own tokens for shadowed experts
  int64_t sent_bytes = 0;  //!< the step's 4 all-to-alls, report().exchange
};

template <class Layer>
layer_step run_layer(Layer& layer, inproc_communicator& comm, problem const& p, rank_inputs const& in) {
  int64_t const T = p.o.tokens, H = p.o.hidden;
  layer_step res;
  res.out.resize(static_cast<std::size_t>(T * H));
  res.d_x.resize(res.out.size());
  res.d_w.resize(static_cast<std::size_t>(T * p.o.topk));
  res.experts = experts_of_rank(p, comm.rank());
  moecomm::routing_view const routing{in.gate.idx.data(), in.gate.weights.data(), T, p.o.topk};
  comm.barrier();  // every rank starts the layer together
  auto const start = clock_type::now();
  layer.forward(routing, {in.x.data(), T, H}, {res.out.data(), T, H}, res.experts);
  layer.backward({in.d_out.data(), T, H}, {res.d_x.data(), T, H}, res.d_w, res.experts);
  res.seconds = seconds_since(start);
  auto const& report = layer.dispatch_state().report();
  res.rows = report.received_rows + report.home_rows;
  res.home_rows = report.home_rows;
  res.sent_bytes = report.exchange.bytes();
  return res;
}

//! How far the shadowed layer's gradient of one owned expert is from plain EP's.
struct gradient_gap {
  bool same = true;    //!< bit for bit
  double max_abs = 0;  //!< max |shadowed - plain|
  double largest = 0;  //!< max |plain|, the scale of the gradient
};

//! What one rank found in one step.
struct rank_record {
  int64_t plain_rows = 0, shadowed_rows = 0, home_rows = 0;
  int64_t plain_bytes = 0, shadowed_bytes = 0;
  bool out_same = false, d_x_same = false, d_w_same = false;
  std::vector<gradient_gap> gradients;  //!< per local expert
};

rank_record compare(layer_step const& plain, layer_step const& shadowed, int32_t local_experts) {
  rank_record r;
  r.plain_rows = plain.rows;
  r.shadowed_rows = shadowed.rows;
  r.home_rows = shadowed.home_rows;
  r.plain_bytes = plain.sent_bytes;
  r.shadowed_bytes = shadowed.sent_bytes;
  r.out_same = same_bits(shadowed.out, plain.out);
  r.d_x_same = same_bits(shadowed.d_x, plain.d_x);
  r.d_w_same = same_bits(shadowed.d_w, plain.d_w);
  int64_t const n = plain.experts.parameter_count();
  for (int32_t l = 0; l < local_experts; ++l) {
    gradient_gap g;
    for (int64_t i = l * n; i < (l + 1) * n; ++i) {
      float const a = shadowed.experts.grads[static_cast<std::size_t>(i)];
      float const b = plain.experts.grads[static_cast<std::size_t>(i)];
      g.same = g.same && std::memcmp(&a, &b, sizeof a) == 0;
      g.max_abs = std::max(g.max_abs, std::fabs(static_cast<double>(a) - b));
      g.largest = std::max(g.largest, std::fabs(static_cast<double>(b)));
    }
    r.gradients.push_back(g);
  }
  return r;
}

//! One step, every rank: what the ranks found, and the shadowing decision (the same on every rank).
struct step_record {
  std::vector<rank_record> ranks;
  moecomm::shadow_decision decision;
  std::vector<int64_t> counts;  //!< [R][E] rows each rank routed to each expert
  std::vector<std::vector<double>> plain_s, shadowed_s;  //!< [iteration][rank]: the layers' times
};

//! Runs every step (after an untimed warm-up) on R in-process ranks.
std::vector<step_record> run_steps(problem const& p, moecomm::fastermoe_cost_params const& model) {
  using plain_layer =
      moecomm::expert_parallel_layer<float, moecomm::host_backend, inproc_communicator, moecomm::dropless,
                                     moecomm::pairwise, moecomm::weighted, moecomm::no_shadowing>;
  using shadowed_layer =
      moecomm::expert_parallel_layer<float, moecomm::host_backend, inproc_communicator, moecomm::dropless,
                                     moecomm::pairwise, moecomm::weighted, moecomm::fastermoe_shadowing<>>;
  options const& o = p.o;
  std::vector<step_record> steps(static_cast<std::size_t>(o.steps));
  for (auto& s : steps) {
    s.ranks.resize(static_cast<std::size_t>(o.ranks));
    s.plain_s.assign(static_cast<std::size_t>(o.iters), std::vector<double>(static_cast<std::size_t>(o.ranks)));
    s.shadowed_s = s.plain_s;
  }
  moecomm::inproc_world const world(o.ranks, std::chrono::seconds(o.timeout));
  moecomm::topology const topo(o.ranks, p.per_node);
  world.run([&](inproc_communicator comm) {
    int32_t const me = comm.rank();
    moecomm::host_backend const be;  // one thread per rank: the ranks are the parallelism
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    plain_layer plain(be, groups, o.experts, o.hidden, {}, moecomm::pairwise{1});
    shadowed_layer shadowed(be, groups, o.experts, o.hidden, {}, moecomm::pairwise{1}, {},
                            moecomm::fastermoe_shadowing<>{model, {}, {}});
    for (int s = 0; s <= o.steps; ++s) {  // step 0 warms the heap and the caches, and is not reported
      rank_inputs const& in = p.steps[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
      for (int it = 0; it < (s == 0 ? 1 : o.iters); ++it) {  // the same inputs, fresh experts each time
        layer_step const a = run_layer(plain, comm, p, in);
        layer_step const b = run_layer(shadowed, comm, p, in);
        if (s == 0) continue;
        step_record& rec = steps[static_cast<std::size_t>(s - 1)];
        auto const i = static_cast<std::size_t>(it), mine = static_cast<std::size_t>(me);
        rec.plain_s[i][mine] = a.seconds;
        rec.shadowed_s[i][mine] = b.seconds;
        if (it > 0) continue;  // the first run is the one checked and reported
        rec.ranks[mine] = compare(a, b, p.local_experts);
        if (me == 0) {
          rec.decision = shadowed.shadow_state().decision();
          rec.counts = shadowed.shadow_state().counts();
        }
      }
    }
  });
  return steps;
}

// ---- the report ---------------------------------------------------------------------------------

double max_of(std::vector<int64_t> const& v) { return static_cast<double>(*std::max_element(v.begin(), v.end())); }
double mean_of(std::vector<int64_t> const& v) {
  return static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) / static_cast<double>(v.size());
}

//! Per rank: rows computed with and without shadowing (the layers' reports), beside the model's B_w.
//! Returns whether the layers computed what the model assumed.
bool print_rows_table(problem const& p, step_record const& rec) {
  int32_t const L = p.local_experts;
  std::vector<int64_t> before, after;
  for (auto const& r : rec.ranks) {
    before.push_back(r.plain_rows);
    after.push_back(r.shadowed_rows);
  }
  bool const as_modelled = before == rec.decision.tokens_unshadowed && after == rec.decision.tokens;
  double const widest = max_of(before);
  std::printf(
      "   rows computed per rank: report().received_rows + home_rows, a row = one (token, expert) pair;\n"
      "   home_rows, in brackets, are the rank's own rows of shadowed experts\n");
  std::printf("     %-4s %-4s %-7s %7s %-16s %9s %-16s %s\n", "rank", "node", "experts", "plain", "", "shadowed", "",
              "(home)");
  for (int32_t w = 0; w < p.o.ranks; ++w) {
    auto const& r = rec.ranks[static_cast<std::size_t>(w)];
    std::string const held =
        L == 1 ? std::to_string(w * L) : std::to_string(w * L) + "-" + std::to_string(w * L + L - 1);
    std::printf("     %4d %4d %-7s %7" PRId64 " %-16s %9" PRId64 " %-16s (%" PRId64 ")\n", w, w / p.per_node,
                held.c_str(), r.plain_rows, bar(static_cast<double>(r.plain_rows), widest, 16).c_str(), r.shadowed_rows,
                bar(static_cast<double>(r.shadowed_rows), widest, 16).c_str(), r.home_rows);
  }
  std::printf("     max %.0f -> %.0f rows, mean %.0f -> %.0f, max/mean %.2f -> %.2f%s\n", max_of(before), max_of(after),
              mean_of(before), mean_of(after), max_of(before) / mean_of(before), max_of(after) / mean_of(after),
              as_modelled ? " (= the model's B_w and B'_w)" : " (DIFFERS from the model's B_w / B'_w!)");
  return as_modelled;
}

//! Parameter bytes broadcast against token bytes no longer sent, from the gathered counts; and the
//! all-to-all bytes the layers' reports measured, which must differ by the latter.
void print_traffic(problem const& p, step_record const& rec, int64_t parameter_bytes) {
  options const& o = p.o;
  int64_t saved_rows = 0;
  for (int32_t e : rec.decision.shadowed)
    for (int32_t s = 0; s < o.ranks; ++s)
      if (s != e / p.local_experts) saved_rows += rec.counts[static_cast<std::size_t>(s) * o.experts + e];
  auto const shadowed = static_cast<int64_t>(rec.decision.shadowed.size());
  int64_t const broadcast = shadowed * parameter_bytes * (o.ranks - 1);
  int64_t const row_bytes = o.hidden * static_cast<int64_t>(sizeof(float));
  int64_t const saved = saved_rows * row_bytes * 4;
  int64_t plain_sent = 0, shadowed_sent = 0;
  for (auto const& r : rec.ranks) plain_sent += r.plain_bytes, shadowed_sent += r.shadowed_bytes;
  std::printf("   bytes, all ranks:\n");
  std::printf("     parameters broadcast  %10s = %" PRId64
              " expert%s x %s x (R-1 = %d), and as many gradient\n"
              "                                        bytes reduced to the owners\n",
              format_bytes(static_cast<double>(broadcast)).c_str(), shadowed, shadowed == 1 ? "" : "s",
              format_bytes(static_cast<double>(parameter_bytes)).c_str(), o.ranks - 1);
  std::printf("     token rows not sent   %10s = %" PRId64 " rows of non-owner ranks x %" PRId64
              " B x 4 (dispatch, combine; fwd, bwd)\n",
              format_bytes(static_cast<double>(saved)).c_str(), saved_rows, row_bytes);
  std::printf(
      "     all-to-alls measured  %10s sent by plain EP, %s shadowed (report().exchange):\n"
      "                                        %s less%s\n",
      format_bytes(static_cast<double>(plain_sent)).c_str(), format_bytes(static_cast<double>(shadowed_sent)).c_str(),
      format_bytes(static_cast<double>(plain_sent - shadowed_sent)).c_str(),
      plain_sent - shadowed_sent == saved ? ", exactly the token rows not sent" : " (DIFFERS from the rows not sent!)");
}

//! The measured layer times of a step, plain and shadowed: the slowest rank's in each run, over the runs.
std::pair<spread, spread> measured_times(step_record const& rec) {
  auto const slowest = [](std::vector<std::vector<double>> const& runs) {
    std::vector<double> max_over_ranks;
    for (auto const& ranks : runs) max_over_ranks.push_back(*std::max_element(ranks.begin(), ranks.end()));
    return spread_of(max_over_ranks);
  };
  return {slowest(rec.plain_s), slowest(rec.shadowed_s)};
}

//! The model's prediction, the compute the CPUs of this machine allow, and the measured time.
void print_times(problem const& p, step_record const& rec, moecomm::fastermoe_cost_model const& model, unsigned cpus) {
  auto const [plain, shadowed] = measured_times(rec);
  auto const& d = rec.decision;
  // The ranks' threads share the CPUs: no layer computes faster than all its rows on all CPUs.
  int64_t const cores = std::min<int64_t>(p.o.ranks, cpus);
  auto const compute_floor = [&](std::vector<int64_t> const& rows) {
    int64_t const total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    return model.training_compute_time(
        std::max(*std::max_element(rows.begin(), rows.end()), (total + cores - 1) / cores));
  };
  double const floor_plain = compute_floor(d.tokens_unshadowed), floor_shadowed = compute_floor(d.tokens);
  auto const line = [](std::string const& what, std::string const& a, std::string const& b, double speed_up) {
    std::printf("     %-40s %24s %24s %8.2fx\n", what.c_str(), a.c_str(), b.c_str(), speed_up);
  };
  auto const times = [&](std::string const& what, double a, double b) { line(what, format_time(a), format_time(b), a / b); };
  std::printf("   %-42s %24s %24s %9s\n", "layer time, forward + backward", "plain", "shadowed", "speed-up");
  times("model: Lat(none), Lat(shadow set)", d.latency_unshadowed, d.latency);
  times("compute alone, " + std::to_string(p.o.ranks) + " ranks sharing " + std::to_string(cores) + " CPUs",
        floor_plain, floor_shadowed);
  line("measured: slowest rank, median (min-max)", format_spread(plain), format_spread(shadowed),
       plain.median / shadowed.median);
}

//! Prints the checks of one step; returns whether outputs and input / weight gradients agree bit for bit.
bool print_checks(problem const& p, step_record const& rec) {
  bool out = true, d_x = true, d_w = true;
  int32_t shadowed_same = 0, shadowed_count = 0, others_differ = 0;
  double max_abs = 0, max_rel = 0;
  auto const& set = rec.decision.shadowed;
  for (int32_t w = 0; w < p.o.ranks; ++w) {
    auto const& r = rec.ranks[static_cast<std::size_t>(w)];
    out = out && r.out_same, d_x = d_x && r.d_x_same, d_w = d_w && r.d_w_same;
    for (int32_t l = 0; l < p.local_experts; ++l) {
      gradient_gap const& g = r.gradients[static_cast<std::size_t>(l)];
      if (std::find(set.begin(), set.end(), w * p.local_experts + l) == set.end()) {
        others_differ += g.same ? 0 : 1;
        continue;
      }
      ++shadowed_count;
      shadowed_same += g.same ? 1 : 0;
      max_abs = std::max(max_abs, g.max_abs);
      max_rel = std::max(max_rel, g.largest > 0 ? g.max_abs / g.largest : 0.0);
    }
  }
  auto const verdict = [](bool same) { return same ? "bit for bit" : "DIFFERENT"; };
  std::printf("   shadowed vs plain EP: output %s, input gradient %s, routing-weight gradient %s\n", verdict(out),
              verdict(d_x), verdict(d_w));
  std::printf("     owners' parameter gradients after the reduction: unshadowed experts %s",
              others_differ == 0 ? "bit for bit" : (std::to_string(others_differ) + " DIFFERENT").c_str());
  if (shadowed_count > 0)
    std::printf(";\n     shadowed experts %d of %d bit for bit, max |diff| %.2g = %.2g x the largest |gradient|",
                shadowed_same, shadowed_count, max_abs, max_rel);
  std::printf("\n");
  return out && d_x && d_w;
}

//! Rows routed to expert e, in all and from ranks other than its owner.
std::pair<int64_t, int64_t> rows_of_expert(problem const& p, step_record const& rec, int32_t e) {
  int64_t total = 0, from_others = 0;
  for (int32_t s = 0; s < p.o.ranks; ++s) {
    int64_t const c = rec.counts[static_cast<std::size_t>(s) * p.o.experts + e];
    total += c;
    from_others += s == e / p.local_experts ? 0 : c;
  }
  return {total, from_others};
}

//! The shadow set, and the expert whose shadowing the model rejected (which ends Algorithm 1's search).
void print_shadow_set(problem const& p, step_record const& rec, moecomm::fastermoe_cost_model const& model) {
  int32_t const L = p.local_experts;
  auto const& d = rec.decision;
  std::printf("   shadow set%s\n", d.shadowed.empty() ? ": none" : ", in Algorithm 1's order (descending rows):");
  for (int32_t e : d.shadowed) {
    auto const [total, from_others] = rows_of_expert(p, rec, e);
    std::printf("     expert %2d, owner rank %d (node %d): %5" PRId64 " rows routed to it, %5" PRId64
                " of them from other ranks\n",
                e, e / L, e / L / p.per_node, total, from_others);
  }
  // The next expert by load (ties: smaller id) is the one the model turned down.
  std::vector<int32_t> order;
  for (int32_t e = 0; e < p.o.experts; ++e)
    if (rows_of_expert(p, rec, e).first > 0 && std::find(d.shadowed.begin(), d.shadowed.end(), e) == d.shadowed.end())
      order.push_back(e);
  if (order.empty()) return;
  int32_t const next = *std::min_element(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    int64_t const ra = rows_of_expert(p, rec, a).first, rb = rows_of_expert(p, rec, b).first;
    return ra != rb ? ra > rb : a < b;
  });
  std::vector<int32_t> with_next = d.shadowed;
  with_next.push_back(next);
  double const latency =
      moecomm::predicted_latency(model, moecomm::topology(p.o.ranks, p.per_node),
                                 moecomm::contiguous_placement(p.o.experts, p.o.ranks), rec.counts, with_next);
  std::printf("     next by rows: expert %d (owner rank %d, %" PRId64
              " rows); shadowing it too, the model predicts\n"
              "     %s, not below %s, so Algorithm 1 stopped there\n",
              next, next / L, rows_of_expert(p, rec, next).first, format_time(latency).c_str(),
              format_time(d.latency).c_str());
}

//! "rows 25, 100, 400" or "16.0 KiB, 256.0 KiB, 4.0 MiB", and the fit's residual.
std::string fitted_on(moecomm::linear_fit const& fit, bool bytes) {
  std::string text = bytes ? "" : "rows ";
  for (std::size_t i = 0; i < fit.sizes.size(); ++i)
    text += (i == 0 ? "" : ", ") + (bytes ? format_bytes(static_cast<double>(fit.sizes[i])) : std::to_string(fit.sizes[i]));
  return text + format(", residual %.1f%%", 100 * fit.relative_residual);
}

void print_link(char const* symbol, std::optional<moecomm::linear_fit> const& link, char const* how) {
  if (!link) return;
  std::printf("   %-7s = %.2f GB/s (latency %s): %s\n             fitted on %s\n", symbol, 1e-9 / link->slope,
              format_time(link->intercept).c_str(), how, fitted_on(*link, true).c_str());
}

void print_calibration(moecomm::compute_calibration const& compute, moecomm::link_calibration const& links,
                       moecomm::fastermoe_cost_params const& model) {
  std::printf("2. The cost model (FasterMoE eqs. 7-8), calibrated here (moecomm/models/calibration.hpp)\n");
  std::printf(
      "   P       = %.2f GFLOP/s: one thread running the expert forward above, 4*alpha*H^2 FLOP a row over the\n"
      "             slope of time = a + b*rows, fitted on %s\n",
      model.gemm_flops / 1e9, fitted_on(compute.time, false).c_str());
  print_link("W_local", links.intra_node, "every rank sends to the next rank of its node, all at once");
  print_link("W_net", links.inter_node, "every rank sends to its peer on the next node, all at once");
  if (!links.intra_node && links.inter_node) std::printf("   W_local = W_net: one rank per node, no intra-node link\n");
  if (links.intra_node && !links.inter_node) std::printf("   W_net   = W_local: one node, no inter-node link\n");
  if (!links.intra_node && !links.inter_node)
    std::printf("   W_net = W_local = %.2f GB/s, the default: one rank, no links\n", model.net_bandwidth / 1e9);
  std::printf(
      "   a message's time is the slowest rank's; in-process, it is a memcpy by the receiving thread, and\n"
      "   the ranks' threads share the CPUs. The model has no latency term: latencies are shown, not used.\n");
}

int run(options const& o) {
  auto const wall = clock_type::now();
  problem const p = make_problem(o);
  int32_t const R = o.ranks, N = o.nodes, G = p.per_node, L = p.local_experts;
  unsigned const cpus = std::max(1u, std::thread::hardware_concurrency());
  mlp_experts const shape = experts_of_rank(p, 0);
  int64_t const parameter_bytes = shape.parameter_count() * static_cast<int64_t>(sizeof(float));

  std::printf("moecomm %d.%d.%d - example 03: FasterMoE shadowing of hot experts, over in-process ranks\n",
              MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("==============================================================================\n");
  std::printf(
      "With a skewed gate the owner of a popular expert computes far more rows than the other ranks.\n"
      "FasterMoE (PPoPP'22, sec. 4.1) shadows such experts: each step it picks them from the all-gathered\n"
      "[rank][expert] token counts (Algorithm 1: hottest first, while its cost model predicts a faster\n"
      "layer); their owners broadcast their parameters to every rank; every rank computes its own tokens\n"
      "of them (those rows are never sent); in the backward their gradients are reduced to the owners.\n"
      "Each step below runs the same tokens through plain expert parallelism and through the shadowed\n"
      "layer (one policy type apart: no_shadowing vs fastermoe_shadowing<>), each with fresh, identical\n"
      "copies of the experts.\n\n");

  std::printf("1. Setup\n");
  std::printf("   ranks R = %d as %d node%s x %d; one thread per rank (inproc_world), %u CPU%s here\n", R, N,
              N == 1 ? "" : "s", G, cpus, cpus == 1 ? "" : "s");
  std::printf(
      "   experts E = %d, %d per rank (rank r owns experts %d*r..%d*r+%d), top-K = %d, gate Zipf(s = %.2f),"
      " seed %" PRIu64 "\n",
      o.experts, L, L, L, L - 1, o.topk, o.zipf, o.seed);
  std::printf("   tokens: %" PRId64 " per rank and step, fp32 rows of H = %" PRId64 "; dropless, pairwise all-to-all\n",
              o.tokens, o.hidden);
  std::printf("   expert: relu(x W1 + b1) W2 + b2, H -> %" PRId64 " -> H (alpha = %d); %" PRId64
              " parameters = %s per expert\n",
              p.inner, o.alpha, shape.parameter_count(), format_bytes(static_cast<double>(parameter_bytes)).c_str());
  std::printf("   steps: %d, fresh tokens each, after one untimed warm-up step; each step's layers run %d time%s\n\n",
              o.steps, o.iters, o.iters == 1 ? "" : "s");

  // The cost model, calibrated to this machine before the run.
  moecomm::fastermoe_cost_params base;
  base.alpha = o.alpha;
  base.hidden = o.hidden;
  // Timings on a busy machine can come out as no line at all (a larger size measured faster than a
  // smaller one, which to_fastermoe_cost_params refuses): measure again with more repeats (medians).
  moecomm::compute_calibration compute;
  moecomm::link_calibration links;
  moecomm::fastermoe_cost_params model;
  for (int repeats = 5;; repeats *= 2) {
    compute = measure_expert_rate(o.hidden, o.alpha, repeats);
    links = measure_rank_links(o, G, repeats);
    try {
      model = moecomm::to_fastermoe_cost_params(compute, links, base);
      break;
    } catch (moecomm::error const& e) {
      if (repeats >= 40) throw;
      std::printf("   calibration with %d repeats was too noisy (%s); measuring again\n", repeats, e.what());
    }
  }
  moecomm::fastermoe_cost_model const m(model);
  print_calibration(compute, links, model);
  std::printf(
      "   so: a row's forward + backward %s (12*alpha*H^2/P), its 4 trips over a link %s,\n"
      "       moving one expert's weights twice (broadcast + reduce, 2*2*alpha*H^2*s bytes) %s\n",
      format_time(m.training_compute_time(1)).c_str(), format_time(m.token_transfer_time(0, 1)).c_str(),
      format_time(m.shadow_transfer_time(1)).c_str());
  std::printf(
      "   Lat(S), the layer's predicted time with shadow set S (eq. 7 for S = none, else eq. 8; in\n"
      "   decision(): latency_unshadowed, latency) =\n"
      "     max over ranks w of (rows w computes x 12*alpha*H^2/P + rows w receives x 4*H*s/W)\n"
      "     + |S| x 2 transfers x 2*alpha*H^2*s / W_net\n");
  std::printf(
      "   the model gives every rank a CPU of its own; here %d ranks share %u, so each step also shows\n"
      "   'compute alone' = max(B_max, all rows / CPUs) x 12*alpha*H^2/P, a floor under both layers' time.\n"
      "   And this backward computes the hidden layer again (2.5x the forward; the model says 2x).\n\n",
      R, std::min<unsigned>(cpus, static_cast<unsigned>(R)));

  std::vector<step_record> const steps = run_steps(p, model);

  std::printf("3. Steps\n");
  bool all_same = true, all_as_modelled = true;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    std::printf("Step %zu\n", s + 1);
    print_shadow_set(p, steps[s], m);
    all_as_modelled = print_rows_table(p, steps[s]) && all_as_modelled;
    print_traffic(p, steps[s], parameter_bytes);
    print_times(p, steps[s], m, cpus);
    all_same = print_checks(p, steps[s]) && all_same;
    std::printf("\n");
  }
  std::printf("4. Summary\n");
  std::printf("   %-4s %-18s %-22s %-20s %s\n", "step", "shadow set", "busiest rank max/mean",
              "predicted speed-up", "measured speed-up (medians)");
  for (std::size_t s = 0; s < steps.size(); ++s) {
    auto const& d = steps[s].decision;
    std::string ids;
    for (int32_t e : d.shadowed) ids += (ids.empty() ? "" : ",") + std::to_string(e);
    // Expert ids are named as such: a bare "0" would read as "no expert shadowed".
    std::string const set = d.shadowed.empty() ? "none" : (d.shadowed.size() == 1 ? "expert " : "experts ") + ids;
    auto const [plain, shadowed] = measured_times(steps[s]);
    std::printf("   %4zu %-18s %5.2f -> %-13.2f %8.2fx %19.2fx\n", s + 1, set.c_str(),
                max_of(d.tokens_unshadowed) / mean_of(d.tokens_unshadowed), max_of(d.tokens) / mean_of(d.tokens),
                d.latency_unshadowed / d.latency, plain.median / shadowed.median);
  }
  std::printf("   outputs, input and routing-weight gradients equal plain EP's bit for bit in every step: %s\n",
              all_same ? "yes" : "NO");
  std::printf(
      "   (the owners' parameter gradients of shadowed experts are sums of the same terms grouped per rank,\n"
      "    then across ranks, so they differ from plain EP's single pass in the last bits)\n");
  if (!all_as_modelled) std::printf("   note: the rows computed differ from the model's B_w in some step\n");
  std::printf("   ran in %.2f s\n", seconds_since(wall));
  return all_same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  try {
    return run(o);
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "%s: out of memory (try fewer --tokens or --ranks, or a smaller --hidden)\n", program);
  }
  return 1;
}
