// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' token rows, a rank's inputs of each step, and how they compare what two layers produced.

#include "zipf_gate.hpp"

#include <moecomm/core/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace example_support {

//! `n` uniform values in [-1, 1), multiples of 2^-15: exact in every format the examples use.
inline std::vector<float> random_rows(std::int64_t n, std::mt19937_64& rng) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& f : v) f = static_cast<float>(static_cast<std::int16_t>(rng() >> 48)) * 0x1p-15f;
  return v;
}

//! Fills v[0, n) with multiples of 2^-15 in [-1, 1), four per draw of `rng`, as element type T
//! (exact in bf16 too): the rows of the examples whose element type is a flag.
template <class T>
void fill_random_rows(T* v, std::int64_t n, std::mt19937_64& rng) {
  for (std::int64_t i = 0; i < n; i += 4) {
    std::uint64_t const bits = rng();
    for (std::int64_t j = 0; j < 4 && i + j < n; ++j)
      v[i + j] = moecomm::dtype_traits<T>::from_float(static_cast<float>(static_cast<std::int16_t>(bits >> (16 * j))) * 0x1p-15f);
  }
}

//! One rank's inputs of one step.
struct step_inputs {
  routing_data gate;            //!< [T][K]
  std::vector<float> x, d_out;  //!< [T][H]: the tokens, and the gradient of the layer's output
};

//! The inputs of `steps` steps for `count` ranks (or groups), [step][rank]: each drawn from a
//! generator of its own, seeded {seed, rank, step}: first the gate, `route(rng)`, then x, then d_out.
template <class Route>
std::vector<std::vector<step_inputs>> make_step_inputs(std::uint64_t seed, int steps, std::int32_t count, std::int64_t tokens,
                                                       std::int64_t hidden, Route&& route) {
  std::vector<std::vector<step_inputs>> all(static_cast<std::size_t>(steps));
  for (int s = 0; s < steps; ++s)
    for (std::int32_t r = 0; r < count; ++r) {
      std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(s)};
      std::mt19937_64 rng(seq);
      step_inputs in;
      in.gate = route(rng);
      in.x = random_rows(tokens * hidden, rng);
      in.d_out = random_rows(tokens * hidden, rng);
      all[static_cast<std::size_t>(s)].push_back(std::move(in));
    }
  return all;
}

//! The largest difference between `a` and `b`, relative to b's largest magnitude (infinite when their
//! sizes differ): how far a regrouped sum (per-rank partials, unsliced experts) strays.
inline double normwise_difference(std::vector<float> const& a, std::vector<float> const& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

//! Equal bit for bit (a plain == would take -0 for +0 and fail on NaN).
inline bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace example_support
