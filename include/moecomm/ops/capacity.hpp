// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Capacity policies (semantics §7–§9): how many slots each source rank may send each expert, and
//! which slots survive when more want to. Dropped slots become masked slots (-1) of a "kept"
//! routing, so everything downstream (permute, combine, backward) treats them as absent: zero
//! output and zero gradient from the dropped slot.

#include <moecomm/config.hpp>
#include <moecomm/core/philox.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/permute_plan.hpp>
#include <moecomm/ops/validate_routing.hpp>

#include <cmath>
#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! Every slot is kept; no capacity.
struct dropless {
  static constexpr char const* name = "dropless";
};

//! Keeps the first C slots of each expert in `(t, k)` order (first come; DeepSpeed's cumsum rule).
struct drop_by_position {
  static constexpr char const* name = "drop_by_position";
};
//! Keeps the C slots with the largest weight; ties go to the lower token, then the lower slot.
struct drop_by_probability {
  static constexpr char const* name = "drop_by_probability";
};
//! Keeps the C slots with the largest Philox priority `u = (x0 >> 8) * 2^-24`, `x0` the first word
//! of `philox4x32_10(seed, (t_global, k, layer, 0))`; ties go to the lower token.
struct drop_random {
  static constexpr char const* name = "drop_random";
  std::uint64_t seed = 0;
  std::uint32_t layer = 0;
};

//! Per-source-rank capacity `C = max(ceil((double(T·K) / E) · factor), min_capacity)` (division
//! first: that order is part of the contract), agreed across ranks as the maximum, and the rule
//! that picks the survivors. With `pad_to_capacity` every expert block has exactly C rows, the
//! kept rows then zero rows, so the all-to-all has a fixed size.
template <class Rule>
struct capacity {
  static constexpr char const* name = Rule::name;
  double factor = 1.0;
  std::int64_t min_capacity = 0;
  bool pad_to_capacity = false;
  Rule rule{};
};

//! The receiver-budget variant (semantics §7): every rank accepts at most `rows_per_rank` rows over
//! all its local experts; the longest prefix of its rank-major receive stream (source rank
//! ascending, then the sender's permuted order) that fits is kept. Needs the count matrix of every
//! rank before any data moves (one extra all-gather). Cf. Megatron-LM's
//! `moe_expert_rank_capacity_factor`, NCCL EP's `max_recv_tokens_per_rank`.
struct receiver_budget {
  static constexpr char const* name = "receiver_budget";
  std::int64_t rows_per_rank = 0;
};

namespace detail {

template <class Policy>
inline constexpr bool is_dropless_v = std::is_same_v<Policy, dropless>;
template <class Policy>
inline constexpr bool is_receiver_budget_v = std::is_same_v<Policy, receiver_budget>;

//! Keeps slot i when its row falls in the first `allowed[d]` rows of this rank's block for its
//! destination rank d (the block is the experts `[d * L, (d + 1) * L)` of the plan).
struct keep_receiver_prefix {
  std::int32_t const* idx;
  std::int32_t const* row_of;  //!< dropless plan
  std::int32_t const* expert_offsets;
  std::int64_t const* allowed;  //!< `[R]`
  std::int32_t local_experts;
  std::int32_t* kept_idx;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const row = row_of[i];
    if (row < 0) {
      kept_idx[i] = -1;
      return;
    }
    std::int32_t const d = idx[i] / local_experts;
    kept_idx[i] = row - expert_offsets[d * local_experts] < allowed[d] ? idx[i] : -1;
  }
};

//! This rank's capacity before agreement (semantics §7): IEEE double, division first.
inline std::int64_t local_capacity(std::int64_t tokens, std::int32_t top_k, std::int32_t experts, double factor,
                                   std::int64_t min_capacity) {
  auto const c = static_cast<std::int64_t>(std::ceil((static_cast<double>(tokens * top_k) / experts) * factor));
  return c > min_capacity ? c : min_capacity;
}

//! The score a slot competes with; larger survives.
struct position_score {
  MOECOMM_HOST_DEVICE float operator()(std::int64_t, std::int32_t) const { return 0.0f; }  // ties: (t, k) order decides
};
struct weight_score {
  float const* weights;
  std::int32_t top_k;
  MOECOMM_HOST_DEVICE float operator()(std::int64_t t, std::int32_t k) const {
    float const w = weights[t * top_k + k];
    return is_nan(w) ? -INFINITY : w + 0.0f;  // -0.0 == +0.0; NaN ranks lowest
  }
};
struct random_score {
  std::uint64_t seed;
  std::uint32_t layer;
  std::int64_t first_token;  //!< t_global of this rank's token 0
  MOECOMM_HOST_DEVICE float operator()(std::int64_t t, std::int32_t k) const {
    std::int64_t const tg = first_token + t;
    philox_block const counter{{static_cast<std::uint32_t>(tg), static_cast<std::uint32_t>(k), layer, 0u}};
    return static_cast<float>(philox4x32_10(seed, counter).x[0] >> 8) * (1.0f / 16777216.0f);
  }
};

//! `scores[i]`: the score of slot i (computed once, so the selection compares stored values).
template <class Score>
struct score_slots {
  Score score;
  std::int32_t top_k;
  float* scores;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    scores[i] = score(i / top_k, static_cast<std::int32_t>(i % top_k));
  }
};

//! Slot i survives when fewer than C competitors of its expert beat it: a larger score, or an
//! equal score and an earlier (t, k). Competitors are the expert's rows in the dropless plan, in
//! (t, k) order, so "earlier" is "a lower row".
struct keep_top_capacity {
  std::int32_t const* idx;
  std::int32_t const* row_of;          //!< dropless plan
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t const* expert_offsets;
  float const* scores;                 //!< `[T][K]`
  std::int32_t top_k;
  std::int64_t capacity;
  std::int32_t* kept_idx;  //!< out: idx, or -1 where dropped

  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const e = idx[i];
    std::int32_t const row = row_of[i];
    if (row < 0) {  // masked (or out of range with the scan off)
      kept_idx[i] = -1;
      return;
    }
    float const mine = scores[i];
    std::int64_t better = 0;
    for (std::int32_t r = expert_offsets[e]; r < expert_offsets[e + 1] && better < capacity; ++r) {
      if (r == row) continue;
      float const other = scores[static_cast<std::int64_t>(token_of[r]) * top_k + slot_of[r]];
      better += (other > mine || (other == mine && r < row)) ? 1 : 0;
    }
    kept_idx[i] = better < capacity ? e : -1;
  }
};

}  // namespace detail

MOECOMM_NAMESPACE_END
