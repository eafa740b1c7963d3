// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The two machine constants of an alpha-beta model of in-process messages, measured on this
//! machine: what a byte costs (a memcpy) and what a round costs (a barrier of the ranks' threads).

#include "timing.hpp"

#include <moecomm/comm/inproc.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace example_support {

//! Bytes one thread copies per second with std::memcpy: 64 MiB into 64 MiB, both written first,
//! best of 5. This is the model's link bandwidth: an in-process message is such a memcpy.
inline double memcpy_bandwidth() {
  std::size_t const n = std::size_t{64} << 20;
  std::vector<char> src(n, 1), dst(n, 2);
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 5; ++i) {
    auto const start = clock_type::now();
    std::memcpy(dst.data(), src.data(), n);
    best = std::min(best, seconds_since(start));
    src[static_cast<std::size_t>(i)] = dst[n - 1];  // keep the copies observable
  }
  return static_cast<double>(n) / best;
}

//! The latency of one barrier of `ranks` in-process ranks (median of 5 batches of 100, on rank 0):
//! the model's alpha, the fixed cost of one dependent exchange round (a two-phase rendezvous, as a
//! barrier is).
inline double barrier_latency(std::int32_t ranks, std::chrono::seconds timeout) {
  moecomm::inproc_world const world(ranks, timeout);
  std::vector<double> batches;
  world.run([&](moecomm::inproc_communicator comm) {
    for (int i = 0; i < 20; ++i) comm.barrier();
    for (int b = 0; b < 5; ++b) {
      comm.barrier();
      auto const start = clock_type::now();
      for (int i = 0; i < 100; ++i) comm.barrier();
      if (comm.rank() == 0) batches.push_back(seconds_since(start) / 100);
    }
  });
  return spread_of(batches).median;
}

}  // namespace example_support
