// SPDX-License-Identifier: Apache-2.0
#pragma once
// Values whose float sum depends on the order of the ranks, and the sequential oracle of
// `ordered_allreduce`: shared by the in-process and the MPI tests.

#include <cstdint>
#include <vector>

namespace test {

// Rank r's value i: large values of both signs mixed with small ones, so rounding depends on the order.
template <class T>
T order_sensitive_value(int r, std::int64_t i) {
  static double const pool[] = {1e16, -1e16, 3.25, 1e-3, -7.5e15, 0.1, 4.4e15, -2.0 / 3.0, 1.0 / 3.0, 6e7};
  auto const k = static_cast<std::size_t>((static_cast<std::uint64_t>(r) * 7919u + static_cast<std::uint64_t>(i) * 104729u) % 10u);
  return static_cast<T>(pool[k] * (1.0 + 0.01 * static_cast<double>(r)));
}

template <class T>
std::vector<T> rank_values(int r, std::int64_t count) {
  std::vector<T> v(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = order_sensitive_value<T>(r, i);
  return v;
}

// The oracle: element by element, rank 0 + rank 1 + ... in T (or the reverse, to show the order matters).
template <class T>
std::vector<T> sequential_sum(int ranks, std::int64_t count, bool reversed = false) {
  std::vector<T> sum(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    T acc = order_sensitive_value<T>(reversed ? ranks - 1 : 0, i);
    for (int k = 1; k < ranks; ++k) acc = acc + order_sensitive_value<T>(reversed ? ranks - 1 - k : k, i);
    sum[static_cast<std::size_t>(i)] = acc;
  }
  return sum;
}

}  // namespace test
