// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the examples print with: numbers, times and byte counts for people, text bars, and the
//! heading of an example on a simulated cluster.

#include <moecomm/version.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace example_support {

inline std::string format(char const* fmt, double v) {
  char text[64];
  std::snprintf(text, sizeof text, fmt, v);
  return text;
}

//! The unit a time is shown in, and its digits.
struct time_unit {
  double per_second;
  char const* name;
  char const* digits;
};

inline time_unit time_unit_of(double seconds) {
  if (seconds >= 1.0) return {1.0, "s", "%.3f"};
  if (seconds >= 1e-3) return {1e3, "ms", "%.2f"};
  if (seconds >= 1e-6) return {1e6, "us", "%.1f"};
  return {1e9, "ns", "%.0f"};
}

inline std::string format_time(double seconds) {
  time_unit const u = time_unit_of(seconds);
  return format(u.digits, seconds * u.per_second) + " " + u.name;
}

inline std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return format("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return format("%.1f MiB", bytes / (1024.0 * 1024));
  if (bytes >= 1024.0) return format("%.1f KiB", bytes / 1024.0);
  return format("%.0f B", bytes);
}

//! "4-7": the experts rank r holds when each holds L consecutive ones (contiguous placement).
inline std::string experts_held(int r, int L) {
  return L == 1 ? std::to_string(r * L) : std::to_string(r * L) + "-" + std::to_string(r * L + L - 1);
}

inline std::string bar(double value, double max_value, int width) {
  int const n = max_value > 0 ? static_cast<int>(std::lround(width * value / max_value)) : 0;
  return std::string(static_cast<std::size_t>(std::max(n, value > 0 ? 1 : 0)), '#');
}

//! The heading of an example on a simulated cluster: "moecomm X.Y.Z - `title`", a rule, and what its
//! times are; `priced`: what the simulation prices besides the messages.
inline void print_simulated_heading(char const* title,
                                    char const* priced = "expert GEMMs at the GPU's roofline rate for their rows, memory\n"
                                                         "kernels by its HBM (shared when concurrent)") {
  std::printf("moecomm %d.%d.%d - %s\n", MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH, title);
  std::printf("==============================================================================\n");
  std::printf("All times are SIMULATED by SimGrid (CM02 max-min network model, docs/simulation.md), not measured:\n"
              "the layer's code runs for real on every rank and its data really moves; messages are priced by the\n"
              "platform's links plus a fixed overhead per collective, which holds some of the GPU's SMs while it\n"
              "runs; %s.\n\n",
              priced);
}

}  // namespace example_support
