// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the examples on a simulated cluster (SimGrid) do alike around a run: put rank r on GPU r,
//! check that the ranks fill whole nodes, time a step from a barrier as its slowest rank sees it,
//! add up the traffic of every rank (a step's traffic is the cluster's), and name the platform.

#include "flags.hpp"
#include "plot.hpp"

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/moecomm.hpp>
#include <moecomm/simulation/platform.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace example_support {

//! A rank's communicator and back-end on a simulated cluster.
using sim_comm = moecomm::simgrid_communicator;
using sim_backend = moecomm::simulated_backend<>;

//! GPUs 0..n-1: rank r on GPU r, the placement every example's `simgrid_world` uses.
inline std::vector<std::int32_t> first_gpus(std::size_t n) {
  std::vector<std::int32_t> gpus(n);
  for (std::size_t r = 0; r < n; ++r) gpus[r] = static_cast<std::int32_t>(r);
  return gpus;
}

//! The GPUs a node of `ranks` holds; a usage error when `ranks` exceed the platform's GPUs or do not
//! fill whole nodes (a partly used node would price its links as if it were whole).
inline std::int32_t whole_nodes(char const* program, moecomm::simulated_platform const& platform, std::int32_t ranks) {
  std::int32_t const gpus = platform.spec().num_gpus(), per_node = std::min(ranks, platform.gpus_per_node());
  auto const str = [](auto v) { return std::to_string(v); };
  if (ranks > gpus) usage_error(program, "--ranks " + str(ranks) + " exceeds the " + str(gpus) + " GPUs of " + platform.name());
  if (ranks % per_node != 0)
    usage_error(program, "--ranks " + str(ranks) + " does not fill whole nodes of " + str(per_node) + " GPUs");
  return per_node;
}

//! Runs `rank(comm, be)` on every rank of a fresh world of `ranks` GPUs of `platform` (rank r on
//! GPU r), each with a simulated back-end of `scale`. With `recorded`, the simulated events are
//! recorded there, and those that began before the earliest time `rank` returned are dropped (a
//! warm-up step's).
template <class Rank>
void run_ranks(moecomm::simulated_platform const& platform, std::size_t ranks, moecomm::simulation_scale const& scale,
               moecomm::timeline* recorded, Rank&& rank) {
  double from = std::numeric_limits<double>::infinity();
  moecomm::simgrid_world world(platform, first_gpus(ranks));
  optional_recording recording(recorded);
  world.run([&](sim_comm comm) {
    sim_backend const be(moecomm::host_backend{}, scale);
    from = std::min(from, rank(comm, be));
  });
  recording.keep_from(from);
}

//! One rank's simulated times of a step: when it started, its forward and its backward.
struct step_times {
  double start = 0, forward = 0, backward = 0;
};

//! Runs `forward()` then `backward()`, each after a barrier, so that every rank starts each pass
//! together and a pass's time is its slowest rank's.
template <class Comm, class Forward, class Backward>
step_times timed_step(Comm& comm, Forward&& forward, Backward&& backward) {
  auto const clock = moecomm::simulated_seconds{};
  step_times t;
  comm.barrier();
  t.start = clock();
  forward();
  t.forward = clock() - t.start;
  comm.barrier();
  double const backward_start = clock();
  backward();
  t.backward = clock() - backward_start;
  return t;
}

//! The slowest rank's time.
inline double slowest(std::vector<double> const& seconds) { return *std::max_element(seconds.begin(), seconds.end()); }

//! Adds one rank's messages and bytes, by link class, to `into` (rounds are not summed: they are
//! dependent steps of every rank at once, not a quantity that adds up over ranks).
inline void add_traffic(moecomm::alltoall_stats& into, moecomm::alltoall_stats const& s) {
  into.intra_messages += s.intra_messages;
  into.intra_bytes += s.intra_bytes;
  into.inter_messages += s.inter_messages;
  into.inter_bytes += s.inter_bytes;
  into.inter_domain_messages += s.inter_domain_messages;
  into.inter_domain_bytes += s.inter_domain_bytes;
}

//! "   platform NAME`what` (FILE)" and, below it, where its figures come from.
inline void print_platform(moecomm::simulated_platform const& platform, std::string const& what = "") {
  std::printf("   platform %s%s (%s)\n     source: %s\n", platform.name().c_str(), what.c_str(),
              moecomm::platform_file(platform.name()).c_str(), platform.spec().source.c_str());
}

}  // namespace example_support
