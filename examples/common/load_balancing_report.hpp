// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Load balancing by replicated experts, pattern against pattern (example 07): the Adam state that
//! moves with a replica, what one pattern's training run records per step, and the report: rows per
//! rank first and last, the steps beside the rows model, and the steps as CSV for the plot.

#include "format.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace example_support {

//! Slot experts with Adam's state beside (12 B per parameter as fp32 master weights and moments):
//! the optimizer state interface of collectives/replica_migration.hpp.
struct adam_state {
  std::vector<float> values;
  std::int64_t count = 0;
  [[nodiscard]] std::int64_t state_count() const { return count; }
  float* state(std::int32_t l) { return values.data() + l * count; }
};

//! One training step of one pattern, simulated; bytes are the model's.
struct step_row {
  double seconds = 0, move_seconds = 0, imbalance = 0, token_bytes = 0, parameter_bytes = 0, state_bytes = 0;
};

struct run_result {
  std::vector<step_row> steps;
  std::vector<std::int64_t> first_rows, last_rows;  //!< rows each rank computed, on the first and the last step
  std::vector<std::uint64_t> digest;                //!< [step][rank]: the bits of out, d_x and d_w
  double solver_seconds = 0;                        //!< host time per decision (FineMoE's split, FlexMoE's plan)
  std::int32_t decisions = 0, moves = 0;
};

//! Every rank's figures of one step (each rank writes its own entry), in simulated seconds and model bytes.
struct rank_figures {
  explicit rank_figures(std::size_t ranks)
      : start(ranks), end(ranks), move_start(ranks), move_end(ranks), rows(ranks), tokens(ranks), moved(ranks) {}
  std::vector<double> start, end, move_start, move_end, rows, tokens, moved;
};

//! The step from every rank's figures: the span from the first start to the last end, plus the moves'
//! span; the busiest rank's rows over the mean; the bytes moved, split into weights and Adam state
//! (`parameters_only`: FasterMoE's shadows move no optimizer state).
inline step_row summarize_step(rank_figures const& f, bool parameters_only) {
  auto const span = [](std::vector<double> const& from, std::vector<double> const& to) {
    return *std::max_element(to.begin(), to.end()) - *std::min_element(from.begin(), from.end());
  };
  step_row s;
  s.move_seconds = span(f.move_start, f.move_end);
  s.seconds = span(f.start, f.end) + s.move_seconds;
  double const mean = std::accumulate(f.rows.begin(), f.rows.end(), 0.0) / static_cast<double>(f.rows.size());
  s.imbalance = mean > 0 ? *std::max_element(f.rows.begin(), f.rows.end()) / mean : 1.0;
  s.token_bytes = std::accumulate(f.tokens.begin(), f.tokens.end(), 0.0);
  double const all_moved = std::accumulate(f.moved.begin(), f.moved.end(), 0.0);
  s.parameter_bytes = parameters_only ? all_moved : all_moved / 7;  // replicas move 2 B of weights per 14 B
  s.state_bytes = all_moved - s.parameter_bytes;
  return s;
}

//! FNV-1a over the bits of `v`, on from `h`: one number per rank and step stands for its outputs,
//! so that every pattern's can be checked bit for bit against plain EP's without keeping them.
inline std::uint64_t fnv(std::uint64_t h, std::vector<float> const& v) {
  for (float f : v) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof bits);
    h = (h ^ bits) * 1099511628211ull;
  }
  return h;
}

//! Rows each rank computed, on the first step and the last, as bars.
inline void print_rows(char const* name, std::vector<std::int64_t> const& first, std::vector<std::int64_t> const& last) {
  std::int64_t const most = std::max(*std::max_element(first.begin(), first.end()), *std::max_element(last.begin(), last.end()));
  std::printf("   %s\n", name);
  for (std::size_t r = 0; r < first.size(); ++r)
    std::printf("     rank %zu  %7" PRId64 " %-24s -> %7" PRId64 " %s\n", r, first[r], bar(static_cast<double>(first[r]), static_cast<double>(most), 24).c_str(),
                last[r], bar(static_cast<double>(last[r]), static_cast<double>(most), 24).c_str());
}

//! Each pattern's mean and last step beside the rows model (the busiest rank's rows x `seconds_per_row`),
//! the bytes it moved, and its solver's host time.
inline void print_steps_table(std::vector<run_result> const& runs, char const* const* names, double seconds_per_row) {
  std::printf("   %-10s %10s %10s %9s %10s %12s %12s %13s %18s\n", "pattern", "mean step", "last step", "model", "max/mean",
              "tokens", "parameters", "Adam state", "solver (host)");
  double const base = std::accumulate(runs[0].steps.begin(), runs[0].steps.end(), 0.0, [](double a, step_row const& s) { return a + s.seconds; });
  for (std::size_t i = 0; i < runs.size(); ++i) {
    run_result const& r = runs[i];
    double total = 0, tokens = 0, params = 0, state = 0;
    for (step_row const& s : r.steps) total += s.seconds, tokens += s.token_bytes, params += s.parameter_bytes, state += s.state_bytes;
    std::int64_t const busiest = *std::max_element(r.last_rows.begin(), r.last_rows.end());
    std::string const solver = r.decisions > 0 ? format_time(r.solver_seconds / r.decisions) + " x " + std::to_string(r.decisions) : "-";
    std::printf("   %-10s %10s %10s %9s %9.2fx %12s %12s %13s %18s   %.2fx plain EP\n", names[i],
                format_time(total / static_cast<double>(r.steps.size())).c_str(), format_time(r.steps.back().seconds).c_str(),
                format_time(static_cast<double>(busiest) * seconds_per_row).c_str(), r.steps.back().imbalance,
                format_bytes(tokens).c_str(), format_bytes(params).c_str(), format_bytes(state).c_str(), solver.c_str(), base / total);
  }
}

//! The steps of every pattern, one row each, for scripts/plot-load-balancing.
inline void write_steps_csv(std::string const& path, std::string const& platform, std::vector<run_result> const& runs,
                            char const* const* names) {
  std::ofstream f(path);
  f << "platform,trace,pattern,step,seconds,move_seconds,imbalance,token_bytes,parameter_bytes,state_bytes\n";
  for (std::size_t i = 0; i < runs.size(); ++i)
    for (std::size_t s = 0; s < runs[i].steps.size(); ++s) {
      step_row const& r = runs[i].steps[s];
      f << platform << ",zipf," << names[i] << ',' << s << ',' << r.seconds << ',' << r.move_seconds << ',' << r.imbalance
        << ',' << r.token_bytes << ',' << r.parameter_bytes << ',' << r.state_bytes << '\n';
    }
}

}  // namespace example_support
