// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What the examples that train a model end to end (00, 09) are run with alike: the ranks and
//! experts, the sizes, the optimizer's steps and rate, the losses' weights and the tolerance their
//! curves are held to; and the flags for the steps, shared word for word.

#include "flags.hpp"

#include <cstdint>
#include <string>
#include <utility>

namespace example_support {

//! An example's `options` derives from it and sets its defaults.
struct training_options {
  std::int32_t ranks = 4;
  std::int32_t experts = 8;
  std::int32_t topk = 2;
  std::int64_t tokens = 0;  //!< per rank and step
  std::int64_t hidden = 0;
  std::int64_t inner = 0;   //!< the experts' hidden width, H -> F -> H
  int steps = 0;
  int every = 0;            //!< print the losses every N steps
  double lr = 0;
  double aux = 0;           //!< the load-balancing loss's weight
  double tolerance = 1e-4;  //!< largest relative distance of a curve from its reference
  std::int64_t seed = 1;
};

//! --steps S, --every N, --lr X (in [0, `max_lr`]).
inline flag_set& add_step_flags(flag_set& flags, training_options& o, std::string steps_help, std::string lr_help, double max_lr) {
  return flags.add("--steps", "S", std::move(steps_help), o.steps, 1, 100000)
      .add("--every", "N", "print the losses every N steps", o.every, 1, 100000)
      .add("--lr", "X", std::move(lr_help), o.lr, 0.0, max_lr);
}

}  // namespace example_support
