// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! One rank's share of example 00's model: the gate W_g, replicated on every rank, and the rank's
//! own MLP experts, drawn from the seed; the plain matrix product the gate's logits take, every sum
//! in a fixed order, and the SGD step.

#include "clustered_task.hpp"
#include "mlp_experts.hpp"
#include "training_options.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace example_support {

//! One rank's parameters: the gate, the same on every rank, and the rank's own experts.
struct rank_model {
  std::vector<float> gate;  //!< W_g [H][E]
  mlp_experts experts;      //!< this rank's E / R experts, with their gradient accumulators
};

inline rank_model initial_model(training_options const& o, std::int32_t rank) {
  rank_model m;
  std::mt19937_64 rng = generator(o.seed, 0x6a7eu);
  fill_uniform(m.gate, o.hidden * o.experts, 1.0 / std::sqrt(static_cast<double>(o.hidden)), rng);
  m.experts.hidden = o.hidden;
  m.experts.inner = o.inner;
  std::int32_t const local = o.experts / o.ranks;
  for (std::int32_t e = rank * local; e < (rank + 1) * local; ++e) {
    std::vector<float> const p = mlp_initial_parameters(static_cast<std::uint64_t>(o.seed), o.hidden, o.inner, e);
    m.experts.params.insert(m.experts.params.end(), p.begin(), p.end());
  }
  m.experts.grads.assign(m.experts.params.size(), 0.0f);
  return m;
}

//! out[t] = sum_i a[t][i] b[i] over rows of `b` (n wide): out = a b, every sum in ascending i.
inline void multiply(float const* a, std::int64_t rows, std::int64_t inner, float const* b, std::int64_t n, float* out) {
  for (std::int64_t t = 0; t < rows; ++t) {
    std::fill(out + t * n, out + (t + 1) * n, 0.0f);
    for (std::int64_t i = 0; i < inner; ++i) axpy(a[t * inner + i], b + i * n, out + t * n, n);
  }
}

//! p -= lr * g, and g = 0 for the next step.
inline void sgd(std::vector<float>& p, std::vector<float>& g, float lr) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
  std::fill(g.begin(), g.end(), 0.0f);
}

}  // namespace example_support
