// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The report of example 09's training runs: each pattern's loss curve beside the dense model's,
//! how far each strays from it, the time per step, FasterMoE's shadow sets, and the tokens per
//! expert at the first and the last step.

#include "format.hpp"
#include "torch_moe_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace example_support {

//! One pattern's training, as every rank sees it.
struct curve {
  std::string name;
  std::vector<double> loss;  // the mean cross-entropy over every rank's tokens, per step
  double seconds = 0;        // wall time of the steps
  std::vector<std::vector<std::int32_t>> shadowed;  // FasterMoE: block 0's shadow set per step
  std::vector<std::int64_t> first_load, last_load;  // block 0's tokens per expert, every rank's, at the first and last step
};

inline int report(torch_model_options const& o, curve const& dense, std::vector<curve> const& curves, int ranks, char const* where) {
  std::printf("moecomm example 09: a libtorch model trained with moecomm's MoE layer and torch::optim::Adam\n");
  std::printf("  %d blocks of [Linear %lld->%lld->%lld] + [gate, router top-%d of %d, expert MLPs %lld->%lld->%lld], vocab %lld\n",
              o.blocks, static_cast<long long>(o.hidden), static_cast<long long>(o.inner), static_cast<long long>(o.hidden),
              o.topk, o.experts, static_cast<long long>(o.hidden), static_cast<long long>(o.inner),
              static_cast<long long>(o.hidden), static_cast<long long>(o.vocab));
  std::printf("  %d ranks (%s), %lld tokens per rank and step, Adam lr %g, aux %g, z %g\n\n", ranks, where,
              static_cast<long long>(o.tokens), o.lr, o.aux, o.z);
  std::printf("1. Loss (mean cross-entropy over every rank's tokens); 'dense' is one process, every expert on every token\n\n");
  std::printf("  %6s  %10s", "step", "dense");
  for (auto const& c : curves) std::printf("  %10s", c.name.c_str());
  std::printf("\n");
  for (int s = 0; s < o.steps; ++s) {
    if (s % o.every != 0 && s != o.steps - 1) continue;
    std::printf("  %6d  %10.6f", s, dense.loss[static_cast<std::size_t>(s)]);
    for (auto const& c : curves) std::printf("  %10.6f", c.loss[static_cast<std::size_t>(s)]);
    std::printf("\n");
  }
  int status = 0;
  std::printf("\n2. Against the dense model (largest |loss - dense| / dense over the steps; tolerance %g)\n\n", o.tolerance);
  for (auto const& c : curves) {
    double worst = 0;
    for (std::size_t s = 0; s < c.loss.size(); ++s) worst = std::max(worst, std::abs(c.loss[s] - dense.loss[s]) / dense.loss[s]);
    bool const ok = worst <= o.tolerance;
    std::printf("  %-10s %.2e  %s   %s per step\n", c.name.c_str(), worst, ok ? "ok" : "TOO FAR",
                format_time(c.seconds / o.steps).c_str());
    if (!ok) status = 1;
  }
  std::printf("  %-10s            %s per step (one process)\n", "dense", format_time(dense.seconds / o.steps).c_str());
  for (auto const& c : curves) {
    if (c.shadowed.empty()) continue;
    int steps = 0;
    for (auto const& s : c.shadowed) steps += s.empty() ? 0 : 1;
    std::printf("\n3. FasterMoE shadowed an expert of block 0 in %d of %d steps (last: {", steps, o.steps);
    for (std::size_t i = 0; i < c.shadowed.back().size(); ++i) std::printf("%s%d", i ? ", " : "", c.shadowed.back()[i]);
    std::printf("})\n");
  }
  if (!curves.empty()) {
    curve const& c = curves.front();
    std::printf("\n4. Tokens per expert of block 0 (every rank's slots), first and last step: the router learns the load\n\n");
    std::int64_t const most = std::max(*std::max_element(c.first_load.begin(), c.first_load.end()),
                                       *std::max_element(c.last_load.begin(), c.last_load.end()));
    for (std::int32_t e = 0; e < o.experts; ++e)
      std::printf("  expert %2d  %5lld %-24s %5lld %s\n", e, static_cast<long long>(c.first_load[static_cast<std::size_t>(e)]),
                  bar(static_cast<double>(c.first_load[static_cast<std::size_t>(e)]), static_cast<double>(most), 24).c_str(),
                  static_cast<long long>(c.last_load[static_cast<std::size_t>(e)]),
                  bar(static_cast<double>(c.last_load[static_cast<std::size_t>(e)]), static_cast<double>(most), 24).c_str());
  }
  bool const learned = dense.loss.back() < 0.8 * dense.loss.front();
  std::printf("\n%s\n", learned ? "The loss decreased." : "The loss did not decrease enough (by 20%).");
  return status != 0 || !learned ? 1 : 0;
}

}  // namespace example_support
