// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FasterMoE's performance model (Lei et al., "FasterMoE", PPoPP'22, §3 and §4.1): the time one
//! rank spends computing its expert tokens and receiving them, and the time to move an expert's
//! parameters. Times are in seconds. The planners (`planners/shadow_selection.hpp`) compare these
//! predictions; they never measure anything.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! The model's constants. The defaults are the paper's experiments as fastmoe encodes them
//! (`laekov/fastmoe`, `fmoe/fastermoe/shadow_policy.py`, environment variables `FMOE_FASTER_GLBPLC_*`).
struct fastermoe_cost_params {
  //! Expert = 2-layer MLP H -> alpha*H -> H (paper §5; fastmoe `FMOE_FASTER_GLBPLC_ALPHA`).
  double alpha = 2.0;
  //! H = d_model (fastmoe `FMOE_FASTER_GLBPLC_DMODEL`).
  std::int64_t hidden = 2048;
  //! s: fp32, as in the paper's experiments and fastmoe's `* 4`.
  double bytes_per_element = 4.0;
  //! P, FLOP/s of the expert GEMMs (fastmoe `FMOE_FASTER_GLBPLC_GPUTP`; paper: ~90% of V100 peak).
  double gemm_flops = 11.5e12;
  //! W_net, bytes/s between nodes (fastmoe `FMOE_FASTER_GLBPLC_NETBW`: 50 Gb/s).
  double net_bandwidth = 50e9 / 8;
  //! W_local, bytes/s within a node. fastmoe models one bandwidth, so the default is W_net.
  double local_bandwidth = 50e9 / 8;
  //! Parameter transfers per shadowed expert: eq. 8 counts two, the broadcast of the weights and
  //! the reduce of their gradients (fastmoe's code counts one).
  std::int32_t model_transfers = 2;
};

//! The formulas of FasterMoE §3 / §4.1 over validated `fastermoe_cost_params`. The per-token
//! factors are computed once, so a prediction is a few multiplications and the same arguments
//! always give the same bits.
class fastermoe_cost_model {
 public:
  //! @throws error (invalid_argument) naming the first parameter that is not positive
  //!         (`model_transfers` may be 0).
  explicit fastermoe_cost_model(fastermoe_cost_params const& params = {}) : params_(params) {
    require_positive("alpha", params.alpha);
    detail::require(params.hidden > 0, "fastermoe_cost_model", "hidden = ", params.hidden, " must be positive");
    require_positive("bytes_per_element", params.bytes_per_element);
    require_positive("gemm_flops", params.gemm_flops);
    require_positive("net_bandwidth", params.net_bandwidth);
    require_positive("local_bandwidth", params.local_bandwidth);
    detail::require(params.model_transfers >= 0, "fastermoe_cost_model", "model_transfers = ",
                    params.model_transfers, " must not be negative");
    double const h = static_cast<double>(params.hidden);
    forward_seconds_per_token_ = 4.0 * params.alpha * h * h / params.gemm_flops;
    double const moved_bytes_per_token = 4.0 * h * params.bytes_per_element;
    intra_node_seconds_per_token_ = moved_bytes_per_token / params.local_bandwidth;
    inter_node_seconds_per_token_ = moved_bytes_per_token / params.net_bandwidth;
  }

  [[nodiscard]] fastermoe_cost_params const& params() const { return params_; }

  //! This model for a layer whose token bytes, parameter bytes and FLOPs are `token_bytes`,
  //! `parameter_bytes` and `flops` times those of its real rows (a simulated back-end's
  //! `simulation_scale`: the layer hands the model its real hidden size, the simulation prices the
  //! model-sized one).
  [[nodiscard]] fastermoe_cost_model scaled(double token_bytes, double parameter_bytes, double flops) const {
    require_positive("token_bytes scale", token_bytes);
    require_positive("parameter_bytes scale", parameter_bytes);
    require_positive("flops scale", flops);
    fastermoe_cost_model m = *this;
    m.forward_seconds_per_token_ *= flops;
    m.intra_node_seconds_per_token_ *= token_bytes;
    m.inter_node_seconds_per_token_ *= token_bytes;
    m.parameter_bytes_scale_ *= parameter_bytes;
    return m;
  }

  //! 2·α·H²·s: the two H x αH weight matrices of one expert (§3.1).
  [[nodiscard]] double expert_parameter_bytes() const {
    double const h = static_cast<double>(params_.hidden);
    return 2.0 * params_.alpha * h * h * params_.bytes_per_element * parameter_bytes_scale_;
  }

  //! 4·B·α·H²/P: the forward pass of `tokens` tokens through one expert (§3, Lat_comp).
  [[nodiscard]] double forward_compute_time(std::int64_t tokens) const {
    return static_cast<double>(tokens) * forward_seconds_per_token_;
  }

  //! 12·B·α·H²/P: forward and backward, the backward costing twice the forward (eq. 7, first term).
  [[nodiscard]] double training_compute_time(std::int64_t tokens) const {
    return 3.0 * forward_compute_time(tokens);
  }

  //! 4·H·s·(intra/W_local + inter/W_net): every token that changes rank crosses its link four times
  //! (dispatch and combine, forward and backward; eq. 7, second term). Eq. 7 has one bandwidth;
  //! moecomm prices tokens from the same node and from other nodes separately.
  [[nodiscard]] double token_transfer_time(std::int64_t intra_node_tokens, std::int64_t inter_node_tokens) const {
    return static_cast<double>(intra_node_tokens) * intra_node_seconds_per_token_ +
           static_cast<double>(inter_node_tokens) * inter_node_seconds_per_token_;
  }

  //! r · model_transfers · 2αH²s / W_net: moving the parameters of `shadowed_experts` experts
  //! (eq. 8, second term; priced at W_net because replicas reach every node).
  [[nodiscard]] double shadow_transfer_time(std::int64_t shadowed_experts) const {
    return static_cast<double>(shadowed_experts) * params_.model_transfers * expert_parameter_bytes() /
           params_.net_bandwidth;
  }

  //! One rank's term of the max in eq. 7: computing `computed_tokens` tokens and receiving the
  //! `intra_node_tokens` + `inter_node_tokens` of them that come from other ranks.
  [[nodiscard]] double rank_time(std::int64_t computed_tokens, std::int64_t intra_node_tokens,
                                 std::int64_t inter_node_tokens) const {
    return training_compute_time(computed_tokens) + token_transfer_time(intra_node_tokens, inter_node_tokens);
  }

 private:
  static void require_positive(char const* name, double value) {
    // `value > 0` is false for NaN too, so NaN is refused.
    detail::require(value > 0, "fastermoe_cost_model", name, " = ", value, " must be positive");
  }

  fastermoe_cost_params params_;
  double forward_seconds_per_token_ = 0;     //!< 4·α·H²/P
  double intra_node_seconds_per_token_ = 0;  //!< 4·H·s/W_local
  double inter_node_seconds_per_token_ = 0;  //!< 4·H·s/W_net
  double parameter_bytes_scale_ = 1;         //!< see `scaled`
};

MOECOMM_NAMESPACE_END
