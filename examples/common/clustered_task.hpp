// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 00's task, a clustered regression: each token x in R^H lies near one of C cluster centres
//! (cluster c drawn with probability ~ 1/(c+1), so a few clusters are common) and its target is
//! y = tanh(A_c x), a fixed nonlinear map per cluster. Every rank draws its own batches from a
//! generator seeded by the seed, the rank and the step, so a run is the same bits on any transport.

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace example_support {

//! A generator for one purpose (`tag`), one rank and one step, from the seed.
inline std::mt19937_64 generator(std::int64_t seed_flag, std::uint32_t tag, std::int32_t rank = 0, int step = 0) {
  auto const seed = static_cast<std::uint64_t>(seed_flag);
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), tag,
                    static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(step)};
  return std::mt19937_64(seq);
}

inline void fill_uniform(std::vector<float>& v, std::int64_t n, double limit, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(static_cast<float>(-limit), static_cast<float>(limit));
  for (std::int64_t i = 0; i < n; ++i) v.push_back(u(rng));
}

//! The clusters: centres in [-1, 1]^H, maps A_c [H][H], and how often each is drawn.
struct task {
  std::vector<float> centres;     //!< [C][H]
  std::vector<float> maps;        //!< [C][H][H]
  std::vector<double> frequency;  //!< [C] ~ 1/(c+1), summing to 1
};

inline task make_task(std::int64_t seed, std::int32_t clusters, std::int64_t hidden) {
  std::mt19937_64 rng = generator(seed, 0x7a5cu);
  task t;
  fill_uniform(t.centres, clusters * hidden, 1.0, rng);
  fill_uniform(t.maps, clusters * hidden * hidden, 2.0 / std::sqrt(static_cast<double>(hidden)), rng);
  double total = 0;
  for (std::int32_t c = 0; c < clusters; ++c) total += 1.0 / (c + 1);
  for (std::int32_t c = 0; c < clusters; ++c) t.frequency.push_back(1.0 / (c + 1) / total);
  return t;
}

//! One rank's tokens of one step and their targets, `[T][H]` each.
struct batch {
  std::vector<float> x, y;
};

//! x = a centre + uniform noise in +-0.3, y = tanh(A_c x).
inline batch draw_batch(std::int64_t seed, task const& t, std::int64_t tokens, std::int64_t hidden, std::int32_t rank, int step) {
  std::mt19937_64 rng = generator(seed, 0xba7cu, rank, step);
  std::discrete_distribution<std::int32_t> cluster(t.frequency.begin(), t.frequency.end());
  std::int64_t const H = hidden;
  batch b;
  fill_uniform(b.x, tokens * H, 0.3, rng);
  b.y.resize(b.x.size());
  for (std::int64_t i = 0; i < tokens; ++i) {
    std::int32_t const c = cluster(rng);
    float* const x = b.x.data() + i * H;
    for (std::int64_t j = 0; j < H; ++j) x[j] += t.centres[static_cast<std::size_t>(c * H + j)];
    for (std::int64_t j = 0; j < H; ++j) {
      float const* const a = t.maps.data() + (c * H + j) * H;
      float z = 0.0f;
      for (std::int64_t k = 0; k < H; ++k) z += a[k] * x[k];
      b.y[static_cast<std::size_t>(i * H + j)] = std::tanh(z);
    }
  }
  return b;
}

}  // namespace example_support
