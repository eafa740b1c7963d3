// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `router_config`: what a router (gate) computes from the logits (docs/semantics.md §15), with
//! Megatron-LM's defaults, and the checks that name the field a bad value came from.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <cmath>
#include <cstdint>
#include <optional>

MOECOMM_NAMESPACE_BEGIN

//! How logits become scores (Megatron's `moe_router_score_function`).
enum class score_function {
  softmax,  //!< over all experts (`pre_softmax`) or over the k selected logits
  sigmoid,  //!< per expert, `1 / (1 + exp(-l))`
};

//! The scalar losses of one forward pass, without their coefficients (Megatron logs the same).
struct router_losses {
  float aux = 0.0f;  //!< the load-balancing loss (`switch_load_balancing_loss_func` / coefficient)
  float z = 0.0f;    //!< the z-loss, `mean_t(logsumexp(logits[t])^2)`
};

//! A router's options. The defaults are Megatron-LM's `TopKRouter` defaults.
struct router_config {
  std::int32_t top_k = 2;                          //!< K, experts per token (`moe_router_topk`)
  score_function score = score_function::softmax;  //!< `moe_router_score_function`
  //! Softmax over all E experts before the top-k (`moe_router_pre_softmax`); else the top-k is
  //! taken on the logits and the softmax over the K selected. Softmax only.
  bool pre_softmax = false;
  //! Group-limited routing (`moe_router_num_groups`, `moe_router_group_topk`): the experts form
  //! `num_groups` equal groups and each token picks among the `group_top_k` groups with the largest
  //! sum of their top `top_k / group_top_k` selection scores. Both 0: no group limit.
  std::int32_t num_groups = 0;
  std::int32_t group_top_k = 0;
  //! `[E]` per-expert bias added to the sigmoid scores for the selection only (DeepSeek-V3's
  //! aux-loss-free balancing, `moe_router_enable_expert_bias`), in the back-end's memory. Sigmoid only.
  std::optional<array_view<float const>> expert_bias;
  //! Divide the K selected scores by their sum (+1e-20), as Megatron does for sigmoid when K > 1.
  bool renormalize = false;
  float scaling_factor = 1.0f;  //!< multiplies the weights last (`moe_router_topk_scaling_factor`)
  float aux_loss_coeff = 0.0f;  //!< weight of `router_losses::aux` in the backward (`moe_aux_loss_coeff`)
  float z_loss_coeff = 0.0f;    //!< weight of `router_losses::z` in the backward (`moe_z_loss_coeff`)
  //! Scan the logits (and the bias) for NaN and +inf before anything is written. Unchecked, such
  //! values give NaN weights and losses but still K distinct valid expert ids per token.
  bool check_values = true;
};

namespace detail {

//! Groups are tracked in a 64-bit mask per token.
inline constexpr std::int32_t router_max_groups = 64;

inline bool is_finite_nonnegative(float x) { return std::isfinite(x) && x >= 0.0f; }

//! The O(1) checks of a config for `num_experts` experts, each naming the field.
inline void check_router_config(router_config const& c, std::int64_t num_experts, char const* op) {
  bool const softmax = c.score == score_function::softmax;
  require(c.top_k >= 1 && c.top_k <= num_experts, op, "config.top_k = ", c.top_k, " must be in [1, E = ", num_experts,
          "] (E is logits.hidden)");
  require(softmax || !c.pre_softmax, op,
          "config.pre_softmax = true needs score_function::softmax; sigmoid scores are always taken before the top-k");
  require(!softmax || c.pre_softmax || c.top_k > 1, op,
          "config.pre_softmax = false with config.top_k = 1 gives every token weight 1 and the router no gradient; "
          "set pre_softmax (Megatron-LM rejects this too)");
  require(softmax || c.score == score_function::sigmoid, op, "config.score = ", static_cast<int>(c.score),
          " is not a score_function");
  if (c.expert_bias) {
    require(!softmax, op, "config.expert_bias needs score_function::sigmoid (as in Megatron-LM)");
    check_elements(*c.expert_bias, num_experts, op, "config.expert_bias", "one bias per expert");
  }
  require((c.num_groups == 0) == (c.group_top_k == 0), op, "config.num_groups = ", c.num_groups,
          " and config.group_top_k = ", c.group_top_k, " must be both 0 (no group limit) or both positive");
  if (c.num_groups != 0) {
    require(c.num_groups > 0 && c.num_groups <= router_max_groups && num_experts % c.num_groups == 0, op,
            "config.num_groups = ", c.num_groups, " must divide E = ", num_experts, " and be in [1, ",
            router_max_groups, "]");
    require(c.group_top_k > 0 && c.group_top_k <= c.num_groups && c.group_top_k <= c.top_k, op,
            "config.group_top_k = ", c.group_top_k, " must be in [1, min(num_groups = ", c.num_groups,
            ", top_k = ", c.top_k, ")]");
    std::int64_t const reachable = c.group_top_k * (num_experts / c.num_groups);
    require(c.top_k <= reachable, op, "config.top_k = ", c.top_k, " exceeds the ", reachable,
            " experts of the config.group_top_k = ", c.group_top_k, " selected groups");
  }
  require(std::isfinite(c.scaling_factor) && c.scaling_factor > 0.0f, op, "config.scaling_factor = ",
          c.scaling_factor, " must be finite and positive (1 for no scaling)");
  require(is_finite_nonnegative(c.aux_loss_coeff), op, "config.aux_loss_coeff = ", c.aux_loss_coeff,
          " must be finite and >= 0");
  require(is_finite_nonnegative(c.z_loss_coeff), op, "config.z_loss_coeff = ", c.z_loss_coeff,
          " must be finite and >= 0");
}

}  // namespace detail
MOECOMM_NAMESPACE_END
