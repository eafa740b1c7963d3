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

#include "../common/flags.hpp"
#include "../common/format.hpp"
#include "../common/mlp_experts.hpp"
#include "../common/timing.hpp"

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
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace example_support;  // flags, formatting, timing, the MLP experts (examples/common/)

using moecomm::matrix_view;
using std::int32_t;
using std::int64_t;

// ---- options ------------------------------------------------------------------------------------

struct options {
  int32_t ranks = 4;
  int32_t nodes = 2;
  int32_t experts = 8;
  int32_t topk = 2;
  int32_t clusters = 6;
  int64_t tokens = 64;  // per rank and step
  int64_t hidden = 16;
  int64_t inner = 32;
  int steps = 300;
  int every = 25;
  double lr = 0.2;
  double aux = 0.01;
  double tolerance = 1e-4;
  int64_t seed = 1;
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
  flags.add("--ranks", "R", "ranks; with --mpi, the number of processes", o.ranks, 1, 64)
      .add("--nodes", "N", "nodes; must divide R, each holds R / N ranks", o.nodes, 1, 64)
      .add("--experts", "E", "experts; a multiple of R", o.experts, 1, 1 << 12)
      .add("--topk", "K", "experts per token, 2 <= K <= E", o.topk, 2, 1 << 12)
      .add("--clusters", "C", "clusters of the task, cluster c drawn with probability ~ 1/(c+1)", o.clusters, 1, 1 << 10)
      .add("--tokens", "T", "tokens per rank and step", o.tokens, 1, 1 << 16)
      .add("--hidden", "H", "token width", o.hidden, 1, 1024)
      .add("--inner", "F", "the experts' hidden width, H -> F -> H", o.inner, 1, 4096)
      .add("--steps", "S", "SGD steps", o.steps, 1, 100000)
      .add("--every", "N", "print the losses every N steps", o.every, 1, 100000)
      .add("--lr", "X", "SGD learning rate", o.lr, 0.0, 100.0)
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

//! A generator for one purpose (`tag`), one rank and one step, from the seed.
std::mt19937_64 generator(options const& o, std::uint32_t tag, int32_t rank = 0, int step = 0) {
  auto const seed = static_cast<std::uint64_t>(o.seed);
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), tag,
                    static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(step)};
  return std::mt19937_64(seq);
}

void fill_uniform(std::vector<float>& v, int64_t n, double limit, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(static_cast<float>(-limit), static_cast<float>(limit));
  for (int64_t i = 0; i < n; ++i) v.push_back(u(rng));
}

//! The clusters: centres in [-1, 1]^H, maps A_c [H][H], and how often each is drawn.
struct task {
  std::vector<float> centres;     //!< [C][H]
  std::vector<float> maps;        //!< [C][H][H]
  std::vector<double> frequency;  //!< [C] ~ 1/(c+1), summing to 1
};

task make_task(options const& o) {
  std::mt19937_64 rng = generator(o, 0x7a5cu);
  task t;
  fill_uniform(t.centres, o.clusters * o.hidden, 1.0, rng);
  fill_uniform(t.maps, o.clusters * o.hidden * o.hidden, 2.0 / std::sqrt(static_cast<double>(o.hidden)), rng);
  double total = 0;
  for (int32_t c = 0; c < o.clusters; ++c) total += 1.0 / (c + 1);
  for (int32_t c = 0; c < o.clusters; ++c) t.frequency.push_back(1.0 / (c + 1) / total);
  return t;
}

//! One rank's tokens of one step and their targets, `[T][H]` each.
struct batch {
  std::vector<float> x, y;
};

//! x = a centre + uniform noise in +-0.3, y = tanh(A_c x).
batch draw_batch(options const& o, task const& t, int32_t rank, int step) {
  std::mt19937_64 rng = generator(o, 0xba7cu, rank, step);
  std::discrete_distribution<int32_t> cluster(t.frequency.begin(), t.frequency.end());
  int64_t const H = o.hidden;
  batch b;
  fill_uniform(b.x, o.tokens * H, 0.3, rng);
  b.y.resize(b.x.size());
  for (int64_t i = 0; i < o.tokens; ++i) {
    int32_t const c = cluster(rng);
    float* const x = b.x.data() + i * H;
    for (int64_t j = 0; j < H; ++j) x[j] += t.centres[static_cast<std::size_t>(c * H + j)];
    for (int64_t j = 0; j < H; ++j) {
      float const* const a = t.maps.data() + (c * H + j) * H;
      float z = 0.0f;
      for (int64_t k = 0; k < H; ++k) z += a[k] * x[k];
      b.y[static_cast<std::size_t>(i * H + j)] = std::tanh(z);
    }
  }
  return b;
}

// ---- the model --------------------------------------------------------------------------------------

//! One rank's parameters: the gate, the same on every rank, and the rank's own experts.
struct rank_model {
  std::vector<float> gate;  //!< W_g [H][E]
  mlp_experts experts;      //!< this rank's E / R experts, with their gradient accumulators
};

rank_model initial_model(options const& o, int32_t rank) {
  rank_model m;
  std::mt19937_64 rng = generator(o, 0x6a7eu);
  fill_uniform(m.gate, o.hidden * o.experts, 1.0 / std::sqrt(static_cast<double>(o.hidden)), rng);
  m.experts.hidden = o.hidden;
  m.experts.inner = o.inner;
  int32_t const local = o.experts / o.ranks;
  for (int32_t e = rank * local; e < (rank + 1) * local; ++e) {
    std::vector<float> const p = mlp_initial_parameters(static_cast<std::uint64_t>(o.seed), o.hidden, o.inner, e);
    m.experts.params.insert(m.experts.params.end(), p.begin(), p.end());
  }
  m.experts.grads.assign(m.experts.params.size(), 0.0f);
  return m;
}

//! out[t] = sum_i a[t][i] b[i] over rows of `b` (n wide): out = a b, every sum in ascending i.
void multiply(float const* a, int64_t rows, int64_t inner, float const* b, int64_t n, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    std::fill(out + t * n, out + (t + 1) * n, 0.0f);
    for (int64_t i = 0; i < inner; ++i) axpy(a[t * inner + i], b + i * n, out + t * n, n);
  }
}

//! p -= lr * g, and g = 0 for the next step.
void sgd(std::vector<float>& p, std::vector<float>& g, float lr) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
  std::fill(g.begin(), g.end(), 0.0f);
}

// ---- training -------------------------------------------------------------------------------------

//! What rank 0 records of one pattern's run.
struct pattern_run {
  std::vector<double> loss, mse;                   //!< per step, over every rank's tokens
  std::vector<double> seconds;                     //!< per step, rank 0's wall clock
  std::vector<double> first_tokens, last_tokens;   //!< [E] tokens per expert, all ranks, first and last step
  std::vector<std::vector<int32_t>> shadowed;      //!< per step, FasterMoE's shadow set (empty otherwise)
};

//! The experts a shadowing layer shadowed in its last step; none for the others.
template <class Layer>
auto shadowed_experts(Layer const& layer, int) -> decltype(layer.shadow_state().decision().shadowed) {
  return layer.shadow_state().decision().shadowed;
}
template <class Layer>
std::vector<int32_t> shadowed_experts(Layer const&, long) {
  return {};
}

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
    batch const b = draw_batch(o, t, me, s);
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

constexpr int patterns = 3;
constexpr char const* pattern_names[patterns] = {"plain (flat)", "FasterMoE", "hierarchical_2d"};

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

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

//! How a run's curve compares with plain's.
struct curve_gap {
  int first_difference = -1;  //!< the first step whose loss differs in any bit, or -1
  double max_abs = 0;         //!< max |loss - plain's|
  double max_rel = 0;         //!< max |loss - plain's| / plain's
};

curve_gap compare(pattern_run const& run, pattern_run const& plain) {
  curve_gap g;
  for (std::size_t s = 0; s < plain.loss.size(); ++s) {
    double const d = std::fabs(run.loss[s] - plain.loss[s]);
    if (g.first_difference < 0 && !same_bits(run.loss[s], plain.loss[s])) g.first_difference = static_cast<int>(s) + 1;
    g.max_abs = std::max(g.max_abs, d);
    g.max_rel = std::max(g.max_rel, d / plain.loss[s]);
  }
  return g;
}

//! "0.12345678" and, for the other patterns, " =" (the same bits as plain's) or the difference.
std::string loss_cell(double loss, double plain, bool is_plain) {
  std::string text = format("%.8f", loss);
  if (is_plain) return text;
  return text + (same_bits(loss, plain) ? " =        " : format(" %+.1e", loss - plain));
}

void print_curves(options const& o, std::vector<pattern_run> const& runs) {
  std::printf("2. Loss (MSE + %g x aux), every %d steps; '=' marks the same bits as plain's\n", o.aux, o.every);
  std::printf("   %6s", "step");
  for (char const* name : pattern_names) std::printf("   %-20s", name);
  std::printf("\n");
  for (int s = 1; s <= o.steps; ++s) {
    if (s != 1 && s % o.every != 0 && s != o.steps) continue;
    std::printf("   %6d", s);
    for (int p = 0; p < patterns; ++p) {
      auto const i = static_cast<std::size_t>(s - 1);
      std::printf("   %-20s", loss_cell(runs[static_cast<std::size_t>(p)].loss[i], runs[0].loss[i], p == 0).c_str());
    }
    std::printf("\n");
  }
  std::printf("   (MSE alone: %.6f at step 1, %.6f at step %d)\n\n", runs[0].mse.front(), runs[0].mse.back(), o.steps);
}

double max_over_mean(std::vector<double> const& v) {
  double total = 0;
  for (double x : v) total += x;
  return total > 0 ? *std::max_element(v.begin(), v.end()) * static_cast<double>(v.size()) / total : 0;
}

void print_load(options const& o, pattern_run const& plain) {
  std::printf("3. Tokens per expert (plain run, all ranks: %" PRId64 " tokens x K = %d slots a step)\n",
              o.ranks * o.tokens, o.topk);
  std::printf("   %6s   %-28s   %-28s\n", "expert", "step 1", ("step " + std::to_string(o.steps)).c_str());
  double const top = std::max(*std::max_element(plain.first_tokens.begin(), plain.first_tokens.end()),
                              *std::max_element(plain.last_tokens.begin(), plain.last_tokens.end()));
  for (int32_t e = 0; e < o.experts; ++e) {
    auto const i = static_cast<std::size_t>(e);
    double const a = plain.first_tokens[i], b = plain.last_tokens[i];
    std::printf("   %6d   %5.0f %-22s   %5.0f %-22s\n", e, a, bar(a, top, 20).c_str(), b, bar(b, top, 20).c_str());
  }
  std::printf("   busiest expert / mean: %.2f at step 1, %.2f at step %d\n\n", max_over_mean(plain.first_tokens),
              max_over_mean(plain.last_tokens), o.steps);
}

void print_shadowing(options const& o, pattern_run const& shadowed) {
  std::vector<int> times(static_cast<std::size_t>(o.experts));
  int steps = 0;
  for (auto const& set : shadowed.shadowed) {
    steps += set.empty() ? 0 : 1;
    for (int32_t e : set) ++times[static_cast<std::size_t>(e)];
  }
  std::printf("4. FasterMoE shadowed some expert in %d of %d steps", steps, o.steps);
  if (steps > 0) {
    std::printf(":");
    char const* separator = " ";
    for (int32_t e = 0; e < o.experts; ++e)
      if (times[static_cast<std::size_t>(e)] > 0) {
        std::printf("%sexpert %d in %d", separator, e, times[static_cast<std::size_t>(e)]);
        separator = ", ";
      }
  }
  std::printf("\n   (its cost model has the paper's constants: V100s, 50 Gb/s; the same choices on every machine)\n\n");
}

void print_times(std::vector<pattern_run> const& runs) {
  std::printf("5. Time per step, rank 0's wall clock (each step ends in a collective): median (min-max)\n");
  for (int p = 0; p < patterns; ++p) {
    spread const s = spread_of(runs[static_cast<std::size_t>(p)].seconds);
    std::printf("   %-20s %s\n", pattern_names[p], format_spread(s).c_str());
  }
  std::printf("\n");
}

//! Why a pattern's curve is, or is not, plain's: [pattern][differs].
constexpr char const* reasons[patterns][2] = {
    {"", ""},
    {"no shadowed expert's gradient sum was rounded differently",
     "a shadowed expert's tokens are computed on their own ranks and its gradient is summed per rank,\n"
     "           then across ranks: the same terms grouped otherwise, so the float sums differ in\n"
     "           the last bits (the first step's forward is the same bits) and SGD carries that on"},
    {"the node leaders forward the same rows, and every expert receives them in the same order as with\n"
     "           the flat all-to-all, so every sum adds the same terms in the same order",
     "an expert received its rows in another order than with the flat all-to-all"}};

//! Prints each pattern's verdict against plain; returns whether all are within the tolerance.
bool print_verdicts(options const& o, std::vector<pattern_run> const& runs) {
  std::printf("6. Each pattern's curve against plain's\n");
  bool ok = true;
  for (int p = 1; p < patterns; ++p) {
    curve_gap const g = compare(runs[static_cast<std::size_t>(p)], runs[0]);
    bool const differs = g.first_difference >= 0;
    std::printf("   %-16s ", pattern_names[p]);
    if (!differs) {
      std::printf("bitwise identical over all %d steps\n", o.steps);
    } else {
      bool const within = g.max_rel <= o.tolerance;
      ok = ok && within;
      std::printf("first differs at step %d; max |dloss| %.2g = %.2g x the loss (%s --tolerance %g)\n",
                  g.first_difference, g.max_abs, g.max_rel, within ? "within" : "BEYOND", o.tolerance);
    }
    std::printf("      why: %s\n", reasons[p][differs ? 1 : 0]);
  }
  std::printf("\n");
  return ok;
}

//! The mean loss over the first and over the last tenth of the steps (at least one step each).
std::pair<double, double> loss_ends(pattern_run const& run) {
  std::size_t const n = std::max<std::size_t>(1, run.loss.size() / 10);
  double first = 0, last = 0;
  for (std::size_t i = 0; i < n; ++i) {
    first += run.loss[i];
    last += run.loss[run.loss.size() - 1 - i];
  }
  return {first / static_cast<double>(n), last / static_cast<double>(n)};
}

void write_csv(options const& o, std::vector<pattern_run> const& runs) {
  std::FILE* f = std::fopen(o.csv.c_str(), "w");
  if (f == nullptr) throw moecomm::error(moecomm::status::invalid_argument, "--csv " + o.csv + ": cannot open it");
  std::fprintf(f, "step,plain,fastermoe,hierarchical_2d\n");
  for (std::size_t s = 0; s < runs[0].loss.size(); ++s)
    std::fprintf(f, "%zu,%.17g,%.17g,%.17g\n", s + 1, runs[0].loss[s], runs[1].loss[s], runs[2].loss[s]);
  if (std::fclose(f) != 0) throw moecomm::error(moecomm::status::invalid_argument, "--csv " + o.csv + ": write failed");
}

void print_setup(options const& o, char const* transport) {
  std::printf("moecomm %d.%d.%d - example 00: training a small MoE model end to end\n", MOECOMM_VERSION_MAJOR,
              MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("===================================================================\n");
  std::printf("1. Setup\n");
  std::printf("   ranks R = %d (%s) as %d node%s x %d; experts E = %d, %d per rank; top-K = %d\n", o.ranks, transport,
              o.nodes, o.nodes == 1 ? "" : "s", o.ranks / o.nodes, o.experts, o.experts / o.ranks, o.topk);
  std::printf("   task: x near one of %d cluster centres in R^%" PRId64
              " (cluster c with probability ~ 1/(c+1)), y = tanh(A_c x)\n",
              o.clusters, o.hidden);
  std::printf("   gate: logits = x W_g [%" PRId64 "x%d], softmax over the top-%d (router_forward), W_g replicated,\n"
              "         its gradient summed with ordered_allreduce\n",
              o.hidden, o.experts, o.topk);
  std::printf("   experts: relu(x W1 + b1) W2 + b2, %" PRId64 " -> %" PRId64 " -> %" PRId64 ", %" PRId64
              " parameters each; dropless, flat all-to-all unless named\n",
              o.hidden, o.inner, o.hidden, 2 * o.hidden * o.inner + o.inner + o.hidden);
  std::printf("   SGD: %d steps, lr %g, %" PRId64 " tokens per rank and step (each rank its own, seed %" PRId64
              "); loss = MSE + %g x aux\n\n",
              o.steps, o.lr, o.tokens, o.seed, o.aux);
}

//! The report (rank 0); returns the exit code.
int report(options const& o, std::vector<pattern_run> const& runs, double wall_seconds) {
  print_curves(o, runs);
  print_load(o, runs[0]);
  print_shadowing(o, runs[1]);
  print_times(runs);
  bool const close = print_verdicts(o, runs);
  auto const [first, last] = loss_ends(runs[0]);
  bool const decreased = std::isfinite(last) && last < first;
  std::printf("7. Checks\n   the loss decreased: %s (mean of the first and of the last %zu steps: %.6f -> %.6f,"
              " %.1fx lower)\n",
              decreased ? "yes" : "NO", std::max<std::size_t>(1, runs[0].loss.size() / 10), first, last, first / last);
  std::printf("   every pattern within --tolerance of plain: %s\n", close ? "yes" : "NO");
  if (!o.csv.empty()) {
    write_csv(o, runs);
    std::printf("   losses written to %s\n", o.csv.c_str());
  }
  std::printf("   ran in %.2f s\n", wall_seconds);
  return decreased && close ? 0 : 1;
}

int run_in_process(options const& o) {
  auto const wall = clock_type::now();
  check_options(o);
  print_setup(o, "threads of this process");
  std::fflush(stdout);
  task const t = make_task(o);
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
    if (comm.rank() == 0) print_setup(o, "MPI processes");
    std::fflush(stdout);
    std::vector<pattern_run> const runs = train_patterns(o, make_task(o), comm);
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
