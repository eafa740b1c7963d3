// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Expert placement: which rank holds each expert.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! Experts in contiguous blocks: expert `e` lives on rank `e / L` as local expert `e % L`, with
//! `L = E / R` (DeepEP and Megatron-LM). A placement type offers `num_experts()`, `num_ranks()`
//! and `rank_of(e)`; later placements (replicated experts) offer the same.
class contiguous_placement {
 public:
  //! @throws error (invalid_argument) unless `num_experts > 0`, `num_ranks > 0` and
  //!         `num_experts % num_ranks == 0`.
  explicit contiguous_placement(std::int32_t num_experts, std::int32_t num_ranks)
      : num_experts_(num_experts), num_ranks_(num_ranks) {
    detail::require(num_experts > 0, "contiguous_placement", "num_experts = ", num_experts, " must be positive");
    detail::require(num_ranks > 0, "contiguous_placement", "num_ranks = ", num_ranks, " must be positive");
    detail::require(num_experts % num_ranks == 0, "contiguous_placement", "num_experts = ", num_experts,
                    " is not divisible by num_ranks = ", num_ranks, " (every rank holds E / R experts)");
    local_experts_ = num_experts / num_ranks;
  }

  MOECOMM_HOST_DEVICE std::int32_t num_experts() const { return num_experts_; }
  MOECOMM_HOST_DEVICE std::int32_t num_ranks() const { return num_ranks_; }
  //! L, experts per rank.
  MOECOMM_HOST_DEVICE std::int32_t num_local_experts() const { return local_experts_; }
  //! The rank that holds expert `e` (`0 <= e < E`).
  MOECOMM_HOST_DEVICE std::int32_t rank_of(std::int32_t e) const { return e / local_experts_; }
  //! The index of expert `e` among its rank's experts.
  MOECOMM_HOST_DEVICE std::int32_t local_index_of(std::int32_t e) const { return e % local_experts_; }

 private:
  std::int32_t num_experts_;
  std::int32_t num_ranks_;
  std::int32_t local_experts_ = 1;
};

MOECOMM_NAMESPACE_END
