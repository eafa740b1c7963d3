// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FasterMoE's cost model (planners/fastermoe_cost_model.hpp) calibrated on this machine: the rate
//! of one thread running an MLP expert, and both link classes of in-process ranks as nodes
//! (models/calibration.hpp); and how the examples print what was measured.

#include "format.hpp"
#include "mlp_experts.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/models/calibration.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace example_support {

using std::int32_t;
using std::int64_t;

//! 4*alpha*H^2: FLOPs of one row through one expert, forward (the cost model's count).
inline double forward_flops_per_row(int64_t hidden, int32_t alpha) {
  return 4.0 * alpha * static_cast<double>(hidden) * static_cast<double>(hidden);
}

// ---- calibration: the cost model's machine constants, measured ----------------------------------

//! The time of one thread running an expert's forward, fitted over 3 row counts up to ~50 MFLOP.
inline moecomm::compute_calibration measure_expert_rate(int64_t hidden, int32_t alpha, int repeats) {
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
inline moecomm::link_calibration measure_rank_links(int32_t ranks, int32_t per_node, int timeout, int repeats) {
  moecomm::link_calibration links;
  moecomm::inproc_world const world(ranks, std::chrono::seconds(timeout));
  moecomm::topology const topo(ranks, per_node);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, topo);
    auto const mine = moecomm::measure_links(moecomm::host_backend{}, groups, {{16 << 10, 256 << 10, 4 << 20}, repeats});
    if (comm.rank() == 0) links = mine;
  });
  return links;
}

//! "rows 25, 100, 400" or "16.0 KiB, 256.0 KiB, 4.0 MiB", and the fit's residual.
inline std::string fitted_on(moecomm::linear_fit const& fit, bool bytes) {
  std::string text = bytes ? "" : "rows ";
  for (std::size_t i = 0; i < fit.sizes.size(); ++i)
    text += (i == 0 ? "" : ", ") + (bytes ? format_bytes(static_cast<double>(fit.sizes[i])) : std::to_string(fit.sizes[i]));
  return text + format(", residual %.1f%%", 100 * fit.relative_residual);
}

inline void print_link(char const* symbol, std::optional<moecomm::linear_fit> const& link, char const* how) {
  if (!link) return;
  std::printf("   %-7s = %.2f GB/s (latency %s): %s\n             fitted on %s\n", symbol, 1e-9 / link->slope,
              format_time(link->intercept).c_str(), how, fitted_on(*link, true).c_str());
}

inline void print_calibration(moecomm::compute_calibration const& compute, moecomm::link_calibration const& links,
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

//! FasterMoE's cost parameters for experts H -> alpha*H -> H, calibrated on R in-process ranks as
//! nodes of `per_node`. Timings on a busy machine can come out as no line at all (a larger size
//! measured faster than a smaller one, which to_fastermoe_cost_params refuses): it measures again
//! with more repeats (medians), up to 40.
struct fastermoe_calibration {
  moecomm::compute_calibration compute;
  moecomm::link_calibration links;
  moecomm::fastermoe_cost_params model;
};
inline fastermoe_calibration calibrate_fastermoe(int64_t hidden, int32_t alpha, int32_t ranks, int32_t per_node, int timeout) {
  moecomm::fastermoe_cost_params base;
  base.alpha = alpha;
  base.hidden = hidden;
  fastermoe_calibration c;
  for (int repeats = 5;; repeats *= 2) {
    c.compute = measure_expert_rate(hidden, alpha, repeats);
    c.links = measure_rank_links(ranks, per_node, timeout, repeats);
    try {
      c.model = moecomm::to_fastermoe_cost_params(c.compute, c.links, base);
      return c;
    } catch (moecomm::error const& e) {
      if (repeats >= 40) throw;
      std::printf("   calibration with %d repeats was too noisy (%s); measuring again\n", repeats, e.what());
    }
  }
}

}  // namespace example_support
