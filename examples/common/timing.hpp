// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' clock, and how they report repeated timings: the median with the range of the
//! runs, because one run on a shared machine can be off by a large factor.

#include "format.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace example_support {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

//! Seconds of `f()`.
template <class F>
double seconds_of(F&& f) {
  auto const start = clock_type::now();
  f();
  return seconds_since(start);
}

//! `run()`'s exit code; then a line with how long it ran by the wall clock (beside a simulation's
//! simulated times: what the simulation cost here).
template <class Run>
int with_wall_clock_line(Run&& run) {
  auto const start = clock_type::now();
  int const code = run();
  std::printf("   ran in %.2f s (wall clock)\n", seconds_since(start));
  return code;
}

//! The median and the range of repeated timings.
struct spread {
  double median = 0, min = 0, max = 0;
};

inline spread spread_of(std::vector<double> seconds) {
  if (seconds.empty()) return {};
  std::sort(seconds.begin(), seconds.end());
  std::size_t const n = seconds.size();
  double const median = n % 2 == 1 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  return {median, seconds.front(), seconds.back()};
}

//! "1.23 ms (1.10-1.40)": the median, then min-max in the median's unit.
inline std::string format_spread(spread const& s) {
  time_unit const u = time_unit_of(s.median);
  return format_time(s.median) + " (" + format(u.digits, s.min * u.per_second) + "-" +
         format(u.digits, s.max * u.per_second) + ")";
}

}  // namespace example_support
