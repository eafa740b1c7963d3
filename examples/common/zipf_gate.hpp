// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The examples' gate: top-K routing with Zipf-distributed expert popularity, so that a few experts
//! are hot, as in a trained MoE.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace example_support {

//! `[T][K]` expert ids and weights, host memory (which is what host_backend reads).
struct routing_data {
  std::vector<std::int32_t> idx;
  std::vector<float> weights;
};

//! Each token draws K distinct experts, without replacement, the i-th most popular expert
//! (`by_popularity[i]`) with P ~ 1/(i+1)^s, and gets random positive gate scores normalised to sum
//! to 1. Slots are ordered by weight, descending, as a top-k gate returns them.
inline routing_data route_tokens(std::int64_t tokens, std::vector<std::int32_t> const& by_popularity, std::int32_t topk,
                                 double s, std::mt19937_64& rng) {
  auto const experts = static_cast<std::int32_t>(by_popularity.size());
  std::vector<double> p(static_cast<std::size_t>(experts));
  for (std::int32_t i = 0; i < experts; ++i) p[static_cast<std::size_t>(by_popularity[static_cast<std::size_t>(i)])] = std::pow(i + 1.0, -s);
  double const total = std::accumulate(p.begin(), p.end(), 0.0);

  routing_data r;
  r.idx.resize(static_cast<std::size_t>(tokens * topk));
  r.weights.resize(static_cast<std::size_t>(tokens * topk));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<char> taken(static_cast<std::size_t>(experts));
  std::vector<std::pair<float, std::int32_t>> picks(static_cast<std::size_t>(topk));  // (weight, expert)
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::fill(taken.begin(), taken.end(), 0);
    double remaining = total;
    float score_sum = 0.0f;
    for (auto& pick : picks) {
      double u = uniform(rng) * remaining;
      std::int32_t chosen = -1;  // the last free expert, should rounding run u past the end
      for (std::int32_t e = 0; e < experts; ++e) {
        if (taken[static_cast<std::size_t>(e)]) continue;
        chosen = e;
        if (u < p[static_cast<std::size_t>(e)]) break;
        u -= p[static_cast<std::size_t>(e)];
      }
      taken[static_cast<std::size_t>(chosen)] = 1;
      remaining -= p[static_cast<std::size_t>(chosen)];
      pick = {0.05f + 0.95f * static_cast<float>(uniform(rng)), chosen};  // a positive score
      score_sum += pick.first;
    }
    for (auto& pick : picks) pick.first /= score_sum;
    std::sort(picks.begin(), picks.end(), [](auto const& a, auto const& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (std::int32_t k = 0; k < topk; ++k) {
      auto const slot = static_cast<std::size_t>(t * topk + k);
      r.weights[slot] = picks[static_cast<std::size_t>(k)].first;
      r.idx[slot] = picks[static_cast<std::size_t>(k)].second;
    }
  }
  return r;
}

//! The same with expert e the (e+1)-th most popular: the hot experts are the first ones, on the
//! first ranks (a placement the example states).
inline routing_data route_tokens(std::int64_t tokens, std::int32_t experts, std::int32_t topk, double s, std::mt19937_64& rng) {
  std::vector<std::int32_t> by_popularity(static_cast<std::size_t>(experts));
  std::iota(by_popularity.begin(), by_popularity.end(), 0);
  return route_tokens(tokens, by_popularity, topk, s, rng);
}

//! A popularity order drawn at random from `seed`: the hot experts land on random ranks, as a
//! trained gate's would, not on the first ones by construction.
inline std::vector<std::int32_t> random_popularity(std::int32_t experts, std::uint64_t seed) {
  std::vector<std::int32_t> by_popularity(static_cast<std::size_t>(experts));
  std::iota(by_popularity.begin(), by_popularity.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(by_popularity.begin(), by_popularity.end(), rng);
  return by_popularity;
}

}  // namespace example_support
