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
#include "../common/exit_code.hpp"
#include "../common/fastermoe_calibration.hpp"
#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/shadowing_problem.hpp"
#include "../common/shadowing_report.hpp"
#include "../common/timing.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace example_support;  // options, problem, calibration, the tables, formatting, timing (examples/common/)

using moecomm::inproc_communicator;
using std::int32_t;
using std::int64_t;

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
layer_step run_layer(Layer& layer, inproc_communicator& comm, problem const& p, step_inputs const& in) {
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
      step_inputs const& in = p.steps[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
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
  auto const [compute, links, model] = calibrate_fastermoe(o.hidden, o.alpha, R, G, o.timeout);
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
  return exit_code_of(program, "fewer --tokens or --ranks, or a smaller --hidden", [&] { return run(o); });
}
