// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The report of example 00's three training runs (plain expert parallelism, FasterMoE shadowing,
//! the hierarchical_2d all-to-all): what rank 0 records of each, the loss curves side by side with
//! every bit that differs from plain's marked, tokens per expert, the shadow sets, the time per step,
//! each curve's verdict against plain's and why, and the curves as CSV.

#include "format.hpp"
#include "timing.hpp"
#include "training_options.hpp"

#include <moecomm/error.hpp>
#include <moecomm/version.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

//! What rank 0 records of one pattern's run.
struct pattern_run {
  std::vector<double> loss, mse;                   //!< per step, over every rank's tokens
  std::vector<double> seconds;                     //!< per step, rank 0's wall clock
  std::vector<double> first_tokens, last_tokens;   //!< [E] tokens per expert, all ranks, first and last step
  std::vector<std::vector<std::int32_t>> shadowed;      //!< per step, FasterMoE's shadow set (empty otherwise)
};

//! The experts a shadowing layer shadowed in its last step; none for the others.
template <class Layer>
auto shadowed_experts(Layer const& layer, int) -> decltype(layer.shadow_state().decision().shadowed) {
  return layer.shadow_state().decision().shadowed;
}
template <class Layer>
std::vector<std::int32_t> shadowed_experts(Layer const&, long) {
  return {};
}

inline constexpr int patterns = 3;
inline constexpr char const* pattern_names[patterns] = {"plain (flat)", "FasterMoE", "hierarchical_2d"};

//! Why a pattern's curve is, or is not, plain's: [pattern][differs].
inline constexpr char const* reasons[patterns][2] = {
    {"", ""},
    {"no shadowed expert's gradient sum was rounded differently",
     "a shadowed expert's tokens are computed on their own ranks and its gradient is summed per rank,\n"
     "           then across ranks: the same terms grouped otherwise, so the float sums differ in\n"
     "           the last bits (the first step's forward is the same bits) and SGD carries that on"},
    {"the node leaders forward the same rows, and every expert receives them in the same order as with\n"
     "           the flat all-to-all, so every sum adds the same terms in the same order",
     "an expert received its rows in another order than with the flat all-to-all"}};

//! The same double to the bit.
inline bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

//! How a run's curve compares with plain's.
struct curve_gap {
  int first_difference = -1;  //!< the first step whose loss differs in any bit, or -1
  double max_abs = 0;         //!< max |loss - plain's|
  double max_rel = 0;         //!< max |loss - plain's| / plain's
};

inline curve_gap compare(pattern_run const& run, pattern_run const& plain) {
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
inline std::string loss_cell(double loss, double plain, bool is_plain) {
  std::string text = format("%.8f", loss);
  if (is_plain) return text;
  return text + (same_bits(loss, plain) ? " =        " : format(" %+.1e", loss - plain));
}

//! Section 2: the three loss curves side by side, every `every` steps, '=' where a loss is plain's to the bit.
inline void print_curves(training_options const& o, std::vector<pattern_run> const& runs) {
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

//! The busiest expert's tokens over the mean.
inline double max_over_mean(std::vector<double> const& v) {
  double total = 0;
  for (double x : v) total += x;
  return total > 0 ? *std::max_element(v.begin(), v.end()) * static_cast<double>(v.size()) / total : 0;
}

//! Section 3: tokens per expert of the plain run, first step and last, as bars.
inline void print_load(training_options const& o, pattern_run const& plain) {
  std::printf("3. Tokens per expert (plain run, all ranks: %" PRId64 " tokens x K = %d slots a step)\n",
              o.ranks * o.tokens, o.topk);
  std::printf("   %6s   %-28s   %-28s\n", "expert", "step 1", ("step " + std::to_string(o.steps)).c_str());
  double const top = std::max(*std::max_element(plain.first_tokens.begin(), plain.first_tokens.end()),
                              *std::max_element(plain.last_tokens.begin(), plain.last_tokens.end()));
  for (std::int32_t e = 0; e < o.experts; ++e) {
    auto const i = static_cast<std::size_t>(e);
    double const a = plain.first_tokens[i], b = plain.last_tokens[i];
    std::printf("   %6d   %5.0f %-22s   %5.0f %-22s\n", e, a, bar(a, top, 20).c_str(), b, bar(b, top, 20).c_str());
  }
  std::printf("   busiest expert / mean: %.2f at step 1, %.2f at step %d\n\n", max_over_mean(plain.first_tokens),
              max_over_mean(plain.last_tokens), o.steps);
}

//! Section 4: in how many steps FasterMoE shadowed an expert, and which, how often.
inline void print_shadowing(training_options const& o, pattern_run const& shadowed) {
  std::vector<int> times(static_cast<std::size_t>(o.experts));
  int steps = 0;
  for (auto const& set : shadowed.shadowed) {
    steps += set.empty() ? 0 : 1;
    for (std::int32_t e : set) ++times[static_cast<std::size_t>(e)];
  }
  std::printf("4. FasterMoE shadowed some expert in %d of %d steps", steps, o.steps);
  if (steps > 0) {
    std::printf(":");
    char const* separator = " ";
    for (std::int32_t e = 0; e < o.experts; ++e)
      if (times[static_cast<std::size_t>(e)] > 0) {
        std::printf("%sexpert %d in %d", separator, e, times[static_cast<std::size_t>(e)]);
        separator = ", ";
      }
  }
  std::printf("\n   (its cost model has the paper's constants: V100s, 50 Gb/s; the same choices on every machine)\n\n");
}

//! Section 5: each pattern's time per step, rank 0's wall clock, median (min-max).
inline void print_step_times(std::vector<pattern_run> const& runs) {
  std::printf("5. Time per step, rank 0's wall clock (each step ends in a collective): median (min-max)\n");
  for (int p = 0; p < patterns; ++p) {
    spread const s = spread_of(runs[static_cast<std::size_t>(p)].seconds);
    std::printf("   %-20s %s\n", pattern_names[p], format_spread(s).c_str());
  }
  std::printf("\n");
}

//! Prints each pattern's verdict against plain; returns whether all are within the tolerance.
inline bool print_verdicts(training_options const& o, std::vector<pattern_run> const& runs) {
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
inline std::pair<double, double> loss_ends(pattern_run const& run) {
  std::size_t const n = std::max<std::size_t>(1, run.loss.size() / 10);
  double first = 0, last = 0;
  for (std::size_t i = 0; i < n; ++i) {
    first += run.loss[i];
    last += run.loss[run.loss.size() - 1 - i];
  }
  return {first / static_cast<double>(n), last / static_cast<double>(n)};
}

//! The curves to `path`, every bit of every loss (%.17g).
inline void write_csv(std::string const& path, std::vector<pattern_run> const& runs) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw moecomm::error(moecomm::status::invalid_argument, "--csv " + path + ": cannot open it");
  std::fprintf(f, "step,plain,fastermoe,hierarchical_2d\n");
  for (std::size_t s = 0; s < runs[0].loss.size(); ++s)
    std::fprintf(f, "%zu,%.17g,%.17g,%.17g\n", s + 1, runs[0].loss[s], runs[1].loss[s], runs[2].loss[s]);
  if (std::fclose(f) != 0) throw moecomm::error(moecomm::status::invalid_argument, "--csv " + path + ": write failed");
}

//! Section 1: the ranks, the task, the gate, the experts and the optimizer.
inline void print_setup(training_options const& o, std::int32_t nodes, std::int32_t clusters, char const* transport) {
  std::printf("moecomm %d.%d.%d - example 00: training a small MoE model end to end\n", MOECOMM_VERSION_MAJOR,
              MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("===================================================================\n");
  std::printf("1. Setup\n");
  std::printf("   ranks R = %d (%s) as %d node%s x %d; experts E = %d, %d per rank; top-K = %d\n", o.ranks, transport,
              nodes, nodes == 1 ? "" : "s", o.ranks / nodes, o.experts, o.experts / o.ranks, o.topk);
  std::printf("   task: x near one of %d cluster centres in R^%" PRId64
              " (cluster c with probability ~ 1/(c+1)), y = tanh(A_c x)\n",
              clusters, o.hidden);
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

}  // namespace example_support
