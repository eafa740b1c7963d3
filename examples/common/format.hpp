// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the examples print with: numbers, times and byte counts for people, and text bars.

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

inline std::string format_time(double seconds) {
  if (seconds >= 1.0) return format("%.3f s", seconds);
  if (seconds >= 1e-3) return format("%.2f ms", seconds * 1e3);
  if (seconds >= 1e-6) return format("%.1f us", seconds * 1e6);
  return format("%.0f ns", seconds * 1e9);
}

inline std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return format("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return format("%.1f MiB", bytes / (1024.0 * 1024));
  if (bytes >= 1024.0) return format("%.1f KiB", bytes / 1024.0);
  return format("%.0f B", bytes);
}

inline std::string bar(double value, double max_value, int width) {
  int const n = max_value > 0 ? static_cast<int>(std::lround(width * value / max_value)) : 0;
  return std::string(static_cast<std::size_t>(std::max(n, value > 0 ? 1 : 0)), '#');
}

}  // namespace example_support
