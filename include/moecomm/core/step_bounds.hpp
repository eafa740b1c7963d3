// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `step_bounds`: the largest step a trainer will run, which a layer's or dispatcher's `reserve`
//! sizes every batch-dependent buffer for, once (as DeepEP sizes its `Buffer`).

#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

struct step_bounds {
  std::int64_t max_tokens = 0;  //!< tokens one rank routes in a step
  std::int32_t top_k = 0;       //!< slots per token
  //! Rows one rank's experts may receive in a step. 0: the capacity policy's own bound: the
  //! capacity's `L · R · C` (C for `max_tokens`), the receiver budget, or, dropless, every slot of
  //! every rank (`R · max_tokens · K`, the worst case, which a trainer that knows its routing's
  //! balance may lower: a larger step still runs, and grows what it needs).
  std::int64_t max_received_rows = 0;
  //! Experts a shadowing policy (FasterMoE, Pro-Prophet) may replicate in a step: the replica
  //! buffers hold that many experts' parameters and gradients. 0: every expert (the worst case; a
  //! trainer that caps its shadow set, or knows it stays small, lowers it: a larger set still runs,
  //! and grows them).
  std::int32_t max_shadowed_experts = 0;
};

MOECOMM_NAMESPACE_END
