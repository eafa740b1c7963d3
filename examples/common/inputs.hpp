// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' token rows, and how they compare what two layers produced.

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace example_support {

//! `n` uniform values in [-1, 1), multiples of 2^-15: exact in every format the examples use.
inline std::vector<float> random_rows(std::int64_t n, std::mt19937_64& rng) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& f : v) f = static_cast<float>(static_cast<std::int16_t>(rng() >> 48)) * 0x1p-15f;
  return v;
}

//! Equal bit for bit (a plain == would take -0 for +0 and fail on NaN).
inline bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace example_support
