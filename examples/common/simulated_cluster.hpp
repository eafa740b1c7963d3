// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the examples on a simulated cluster (SimGrid) do alike around a run: put rank r on GPU r,
//! and add up the all-to-all traffic of every rank, since a step's traffic is the cluster's.

#include <moecomm/moecomm.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace example_support {

//! GPUs 0..n-1: rank r on GPU r, the placement every example's `simgrid_world` uses.
inline std::vector<std::int32_t> first_gpus(std::size_t n) {
  std::vector<std::int32_t> gpus(n);
  for (std::size_t r = 0; r < n; ++r) gpus[r] = static_cast<std::int32_t>(r);
  return gpus;
}

//! Adds one rank's messages and bytes, by link class, to `into` (rounds are not summed: they are
//! dependent steps of every rank at once, not a quantity that adds up over ranks).
inline void add_traffic(moecomm::alltoall_stats& into, moecomm::alltoall_stats const& s) {
  into.intra_messages += s.intra_messages;
  into.intra_bytes += s.intra_bytes;
  into.inter_messages += s.inter_messages;
  into.inter_bytes += s.inter_bytes;
}

}  // namespace example_support
