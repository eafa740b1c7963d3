// SPDX-License-Identifier: Apache-2.0
//! Example 00: a small MoE model trained end to end, on in-process ranks or under mpiexec.
//!
//! The task: each token x in R^H lies near one of C cluster centres (cluster c drawn with
//! probability ~ 1/(c+1), so a few clusters are common), and its target is y = tanh(A_c x), a fixed
//! nonlinear map per cluster. The model is one MoE layer: a softmax top-K gate (logits = x W_g,
//! router_forward / router_backward with the load-balancing loss) and E experts, 2-layer MLPs
//! H -> F -> H with ReLU (examples/common/mlp_experts.hpp), expert parallel over R ranks. The loss
//! is the MSE of the layer's output against y over every rank's tokens, plus aux_coeff times the
//! ranks' mean load-balancing loss. W_g is replicated: every rank computes the gradient of its own
//! tokens and `ordered_allreduce` sums them in rank order, the same bits on every transport; each
//! expert's gradient arrives at its owner through the layer's backward. Plain SGD, fixed rate.
//!
//! The same training runs three times from the same initial parameters on the same batches (every
//! rank draws its own from a generator seeded by the seed, the rank and the step), with layers that
//! differ in one policy: plain expert parallelism with the flat all-to-all, FasterMoE's shadowing
//! of hot experts, and the hierarchical_2d all-to-all. It prints the loss curves side by side, the
//! tokens per expert at the first and the last step, the time per step, and whether each curve
//! equals plain's bit for bit; the exit code is 1 if the loss did not decrease or a curve strayed
//! from plain's further than --tolerance.
//!
//! Ranks are threads of this process (inproc_world), or, with --mpi under `mpiexec -n R`, processes
//! (mpi_communicator): the printed curves, and the --csv file, are the same bits either way.
//!
//! Run with --help for the flags.

#include "../common/clustered_task.hpp"
#include "../common/format.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/rank_flags.hpp"
#include "../common/sgd_moe_model.hpp"
#include "../common/timing.hpp"
#include "../common/training_options.hpp"
#include "../common/training_report.hpp"

#include <moecomm/moecomm.hpp>
#if MOECOMM_ENABLE_MPI
#include <moecomm/comm/mpi.hpp>

#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace example_support;  // flags, formatting, timing, the MLP experts (examples/common/)

using moecomm::matrix_view;
using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

struct options : training_options {
  // ranks, experts, top-k, tokens, hidden, inner, steps, every, lr, aux, tolerance, seed
  options() : training_options{4, 8, 2, 64, 16, 32, 300, 25, 0.2, 0.01, 1e-4, 1} {}
  int32_t nodes = 2;
  int32_t clusters = 6;
  int timeout = 60;  // seconds a rank may wait in a collective
  std::string csv;
  bool mpi = false;
};

constexpr char const* program = "example_00_train";

options parse_options(int argc, char** argv) {
  options o;
  flag_set flags(program,
                 "%s [flags]            R ranks as threads of this process\n"
                 "       mpiexec -n R %s --mpi [flags]   one rank per MPI process",
                 "Trains a small MoE model (a softmax top-K gate and E expert MLPs, expert parallel over R ranks)\n"
                 "with SGD on a clustered regression task, three times from the same initial parameters: plain\n"
                 "expert parallelism (flat all-to-all), FasterMoE shadowing and the hierarchical_2d all-to-all;\n"
                 "prints the loss curves side by side, tokens per expert, the time per step, and whether each\n"
                 "curve equals plain's bit for bit. Exit code 1 if the loss does not decrease or a curve differs\n"
                 "from plain's by more than --tolerance.");
  add_rank_flags(flags, o.ranks, o.nodes, "ranks; with --mpi, the number of processes")
      .add("--experts", "E", "experts; a multiple of R", o.experts, 1, 1 << 12)
      .add("--topk", "K", "experts per token, 2 <= K <= E", o.topk, 2, 1 << 12)
      .add("--clusters", "C", "clusters of the task, cluster c drawn with probability ~ 1/(c+1)", o.clusters, 1, 1 << 10)
      .add("--tokens", "T", "tokens per rank and step", o.tokens, 1, 1 << 16)
      .add("--hidden", "H", "token width", o.hidden, 1, 1024)
      .add("--inner", "F", "the experts' hidden width, H -> F -> H", o.inner, 1, 4096);
  add_step_flags(flags, o, "SGD steps", "SGD learning rate", 100.0)
      .add("--aux", "X", "weight of the load-balancing loss", o.aux, 0.0, 100.0)
      .add("--tolerance", "X", "largest |loss - plain's loss| / plain's loss allowed for the other\npatterns",
           o.tolerance, 0.0, 1e6)
      .add("--seed", "N", "seed of the task, the batches and the initial parameters", o.seed, 0, INT64_MAX)
      .add("--csv", "FILE", "write step,plain,fastermoe,hierarchical_2d losses to FILE (%.17g: every bit)", o.csv)
      .add_switch("--mpi", "ranks are the processes of mpiexec (needs a build with MPI)", o.mpi)
      .add("--timeout", "S", "seconds a rank may wait in a collective before the run aborts", o.timeout, 1, 3600);
  flags.parse(argc, argv);
  return o;
}

//! The checks that need more than one flag, once R is known (with --mpi, the processes).
void check_options(options const& o) {
  auto const str = [](int64_t v) { return std::to_string(v); };
  if (o.ranks % o.nodes != 0)
    usage_error(program, "--nodes " + str(o.nodes) + " does not divide the " + str(o.ranks) + " ranks");
  if (o.experts % o.ranks != 0)
    usage_error(program, "--experts " + str(o.experts) + " is not a multiple of the " + str(o.ranks) + " ranks");
  if (o.topk > o.experts) usage_error(program, "--topk " + str(o.topk) + " exceeds --experts " + str(o.experts));
}

// ---- the task -------------------------------------------------------------------------------------

// ---- the model --------------------------------------------------------------------------------------

// ---- training -------------------------------------------------------------------------------------

//! Trains `model` for o.steps steps with `layer`; every rank calls it. The record is rank 0's.
template <class Layer, class Comm>
pattern_run train(options const& o, task const& t, Comm& comm, Layer& layer, rank_model model) {
  moecomm::host_backend const be;
  int32_t const R = o.ranks, E = o.experts, K = o.topk, me = comm.rank();
  int64_t const T = o.tokens, H = o.hidden;
  moecomm::router_config config;
  config.top_k = K;
  config.aux_loss_coeff = static_cast<float>(o.aux / R);  // the loss has the ranks' mean aux loss
  moecomm::router_state<moecomm::host_backend> router;
  moecomm::workspace<moecomm::host_backend> scratch;
  std::vector<float> logits(static_cast<std::size_t>(T * E)), d_logits(logits.size());
  std::vector<float> weights(static_cast<std::size_t>(T * K)), d_weights(weights.size());
  std::vector<int32_t> idx(weights.size()), counts(static_cast<std::size_t>(E));
  std::vector<float> out(static_cast<std::size_t>(T * H)), d_out(out.size()), d_gate(model.gate.size());
  std::vector<double> sums(static_cast<std::size_t>(2 + E));  // squared error, aux loss, tokens per expert
  moecomm::router_losses losses;
  double const elements = static_cast<double>(R) * static_cast<double>(T * H);
  auto const lr = static_cast<float>(o.lr);

  pattern_run run;
  for (int s = 0; s < o.steps; ++s) {
    batch const b = draw_batch(o.seed, t, o.tokens, o.hidden, me, s);
    auto const start = clock_type::now();
    // The gate and the layer, forward.
    multiply(b.x.data(), T, H, model.gate.data(), E, logits.data());
    moecomm::router_forward(be, matrix_view<float const>{logits.data(), T, E}, matrix_view<int32_t>{idx.data(), T, K},
                            matrix_view<float>{weights.data(), T, K},
                            moecomm::array_view<int32_t>{counts.data(), E},
                            moecomm::array_view<moecomm::router_losses>{&losses, 1}, router, config);
    moecomm::routing_view const routing{idx.data(), weights.data(), T, K};
    layer.forward(routing, {b.x.data(), T, H}, {out.data(), T, H}, model.experts);
    // The loss's gradient: d(sum over every rank of (out - y)^2 / (R T H)) / d out.
    double squared_error = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      float const diff = out[i] - b.y[i];
      squared_error += static_cast<double>(diff) * diff;
      d_out[i] = static_cast<float>(2.0 / elements) * diff;
    }
    // Backward: the layer (the experts' gradients reach their owners), the router, the gate.
    layer.backward({d_out.data(), T, H}, moecomm::not_needed, d_weights, model.experts);
    moecomm::router_backward(be, router, matrix_view<float const>{d_weights.data(), T, K},
                             matrix_view<float>{d_logits.data(), T, E});
    std::fill(d_gate.begin(), d_gate.end(), 0.0f);
    for (int64_t i = 0; i < T; ++i)  // d_W_g = x^T d_logits, in ascending token order
      for (int64_t h = 0; h < H; ++h)
        axpy(b.x[static_cast<std::size_t>(i * H + h)], d_logits.data() + i * E, d_gate.data() + h * E, E);
    moecomm::ordered_allreduce(be, comm, moecomm::array_view<float>{d_gate.data(), static_cast<int64_t>(d_gate.size())},
                               scratch);
    sums[0] = squared_error;
    sums[1] = losses.aux;
    for (int32_t e = 0; e < E; ++e) sums[static_cast<std::size_t>(2 + e)] = counts[static_cast<std::size_t>(e)];
    moecomm::ordered_allreduce(be, comm, moecomm::array_view<double>{sums.data(), static_cast<int64_t>(sums.size())},
                               scratch);
    sgd(model.gate, d_gate, lr);
    sgd(model.experts.params, model.experts.grads, lr);
    double const seconds = seconds_since(start);
    if (me != 0) continue;
    run.seconds.push_back(seconds);
    run.mse.push_back(sums[0] / elements);
    run.loss.push_back(sums[0] / elements + o.aux * sums[1] / R);
    run.shadowed.push_back(shadowed_experts(layer, 0));
    if (s == 0) run.first_tokens.assign(sums.begin() + 2, sums.end());
    if (s == o.steps - 1) run.last_tokens.assign(sums.begin() + 2, sums.end());
  }
  return run;
}

//! The three runs on this rank's communicator: plain expert parallelism, FasterMoE shadowing, and
//! the hierarchical_2d all-to-all. Every rank calls it; the records are rank 0's.
template <class Comm>
std::vector<pattern_run> train_patterns(options const& o, task const& t, Comm& comm) {
  moecomm::host_backend const be;
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(o.ranks, o.ranks / o.nodes));
  rank_model const initial = initial_model(o, comm.rank());
  // FasterMoE's cost model with the paper's constants (V100s, 50 Gb/s), not this machine's: its
  // decisions, and so the curve, are the same wherever the example runs.
  moecomm::fastermoe_cost_params model;
  model.alpha = static_cast<double>(o.inner) / static_cast<double>(o.hidden);
  auto plain = moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden);
  auto shadowed = moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden,
                                                             moecomm::fastermoe_shadowing<>{model});
  auto hierarchical =
      moecomm::make_expert_parallel_layer<float>(be, groups, o.experts, o.hidden, moecomm::hierarchical_2d{});
  std::vector<pattern_run> runs;
  runs.push_back(train(o, t, comm, plain, initial));
  runs.push_back(train(o, t, comm, shadowed, initial));
  runs.push_back(train(o, t, comm, hierarchical, initial));
  return runs;
}

// ---- the report -----------------------------------------------------------------------------------

//! The report (rank 0); returns the exit code.
int report(options const& o, std::vector<pattern_run> const& runs, double wall_seconds) {
  print_curves(o, runs);
  print_load(o, runs[0]);
  print_shadowing(o, runs[1]);
  print_step_times(runs);
  bool const close = print_verdicts(o, runs);
  auto const [first, last] = loss_ends(runs[0]);
  bool const decreased = std::isfinite(last) && last < first;
  std::printf("7. Checks\n   the loss decreased: %s (mean of the first and of the last %zu steps: %.6f -> %.6f,"
              " %.1fx lower)\n",
              decreased ? "yes" : "NO", std::max<std::size_t>(1, runs[0].loss.size() / 10), first, last, first / last);
  std::printf("   every pattern within --tolerance of plain: %s\n", close ? "yes" : "NO");
  if (!o.csv.empty()) {
    write_csv(o.csv, runs);
    std::printf("   losses written to %s\n", o.csv.c_str());
  }
  std::printf("   ran in %.2f s\n", wall_seconds);
  return decreased && close ? 0 : 1;
}

int run_in_process(options const& o) {
  auto const wall = clock_type::now();
  check_options(o);
  print_setup(o, o.nodes, o.clusters, "threads of this process");
  std::fflush(stdout);
  task const t = make_task(o.seed, o.clusters, o.hidden);
  std::vector<pattern_run> runs;
  moecomm::inproc_world const world(o.ranks, std::chrono::seconds(o.timeout));
  world.run([&](moecomm::inproc_communicator comm) {
    std::vector<pattern_run> mine = train_patterns(o, t, comm);
    if (comm.rank() == 0) runs = std::move(mine);
  });
  return report(o, runs, seconds_since(wall));
}

#if MOECOMM_ENABLE_MPI
//! One rank per MPI process; rank 0 prints. Every process returns rank 0's exit code.
int run_mpi(options o, int argc, char** argv) {
  auto const wall = clock_type::now();
  MPI_Init(&argc, &argv);
  int rc = 1;
  try {
    moecomm::mpi_communicator comm(MPI_COMM_WORLD, {std::chrono::seconds(o.timeout)});
    o.ranks = comm.size();
    check_options(o);
    if (comm.rank() == 0) print_setup(o, o.nodes, o.clusters, "MPI processes");
    std::fflush(stdout);
    std::vector<pattern_run> const runs = train_patterns(o, make_task(o.seed, o.clusters, o.hidden), comm);
    if (comm.rank() == 0) rc = report(o, runs, seconds_since(wall));
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  try {
    if (o.mpi) {
#if MOECOMM_ENABLE_MPI
      return run_mpi(o, argc, argv);
#else
      usage_error(program, "--mpi: this build has no MPI (configure with MOECOMM_ENABLE_MPI=ON)");
#endif
    }
    return run_in_process(o);
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  return 1;
}
