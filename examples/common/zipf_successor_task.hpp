// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 09's task: predict a fixed random successor of each token. Tokens are Zipf distributed
//! (token v with probability ~ 1/(v+1)), so a few tokens, and the experts they route to, are hot.
//! Every rank draws its own batch from a generator seeded by the seed, the step and the rank.

#include "torch_moe_model.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <vector>

namespace example_support {

struct batch {
  at::Tensor tokens, targets;  // [T] int64
};

inline batch make_batch(torch_model_options const& o, int rank, int step) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(o.seed) * 1000003u + static_cast<std::uint64_t>(step) * 101u +
                      static_cast<std::uint64_t>(rank));
  std::vector<double> weight(static_cast<std::size_t>(o.vocab));
  for (std::int64_t v = 0; v < o.vocab; ++v) weight[static_cast<std::size_t>(v)] = 1.0 / static_cast<double>(v + 1);
  std::discrete_distribution<std::int64_t> zipf(weight.begin(), weight.end());
  std::vector<std::int64_t> successor(static_cast<std::size_t>(o.vocab));
  std::mt19937_64 fixed(static_cast<std::uint64_t>(o.seed));
  for (std::int64_t v = 0; v < o.vocab; ++v) successor[static_cast<std::size_t>(v)] = static_cast<std::int64_t>(fixed() % o.vocab);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(o.tokens)), targets(tokens.size());
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    tokens[t] = zipf(rng);
    targets[t] = successor[static_cast<std::size_t>(tokens[t])];
  }
  return {at::tensor(tokens), at::tensor(targets)};
}

}  // namespace example_support
