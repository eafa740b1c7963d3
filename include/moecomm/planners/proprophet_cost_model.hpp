// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Pro-Prophet's performance model of one MoE layer (Wang et al., "Pro-Prophet", arXiv 2411.10003,
//! §IV-B; reference/systems.md §2): the time of the all-to-all (T_A2A), of the expert compute
//! (T_FEC, T_BEC), of moving replicas' parameters and gradients (T_Trans, T_Agg), and the layer
//! time T' that the planner (`planners/proprophet_planner.hpp`) minimises. Times are in seconds; the
//! model predicts and never measures.
//!
//! Symbols: D devices (ranks), R_i the tokens device i receives from other devices, H_i the tokens
//! it computes, s experts replicated, n devices skipped per replica, h = `hidden`. §IV-B has eqs.
//! 1–8; reference/systems.md numbers only eq. 7 (the balance condition), so the other formulas are
//! cited by the names §IV-B gives them.
//!
//! Paper and code (`king0722/Pro-Prophet`, `load-balancing/search_algorithm.py`) differ; the
//! choices here:
//! - constants are the code's: A2A bandwidth by message size, Trans/Agg bandwidth, compute rate,
//!   FNEC's formula, the balance threshold 3 · (routed tokens) / D;
//! - the code multiplies every FLOP count by its element size (4, fp32), so its compute times are
//!   4x FLOPs / rate; `flop_scale` keeps that factor (1 gives FLOPs / rate);
//! - the A2A message size is the largest R_i in bytes, as the code picks its bandwidth; R_i counts
//!   only tokens from other devices (the code also counts a device's own tokens);
//! - the code's expert MLP ratio `alpha` is undefined in the published file; 2 is FasterMoE's,
//!   whose code Pro-Prophet extends.
//! The layer time leaves the non-expert compute out (it is the same for every plan) except where it
//! hides Trans and Agg.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! The model's constants; the defaults are Pro-Prophet's code on its RTX 3090 cluster, except
//! `hidden` and `mlp_ratio`, which the code takes from its model.
struct proprophet_cost_params {
  //! h = d_model (the code's script takes it on its command line; 1024 is a placeholder: set the
  //! layer's).
  std::int64_t hidden = 1024;
  //! Bytes per element of tokens and parameters (the code's `data_size`: fp32).
  double bytes_per_element = 4.0;
  //! Expert = 2-layer MLP h -> mlp_ratio·h -> h: 2·mlp_ratio·h² parameters, 4·mlp_ratio·h² forward
  //! FLOPs per token.
  double mlp_ratio = 2.0;
  //! t, FLOP/s of the RTX 3090 in the code (`Comp_tp`).
  double compute_flops = 35.7e12;
  //! Factor on every FLOP count: the code's `data_size` (see the file comment).
  double flop_scale = 4.0;
  //! A2A bandwidth B̄ (bytes/s) by message size: messages up to `a2a_size_limits[k]` bytes get
  //! `a2a_bandwidths[k]`, larger ones the last (the code's `Bd_A2A`, measured with Tutel's
  //! all-to-all: 6, 16, 42, 100 Gb/s up to 128 KiB, 256 KiB, 1 MiB and beyond).
  std::array<double, 3> a2a_size_limits{128.0 * 1024, 256.0 * 1024, 1024.0 * 1024};
  std::array<double, 4> a2a_bandwidths{6e9 / 8, 16e9 / 8, 42e9 / 8, 100e9 / 8};
  //! Bandwidth (bytes/s) of Trans, the parameter broadcast, and of Agg, the gradient reduce
  //! (the code's `Bd_Trans`, `Bd_AGG`: 15 Gb/s).
  double trans_bandwidth = 15e9 / 8;
  double agg_bandwidth = 15e9 / 8;
  //! α of eq. 7: devices count as balanced when max H − min H < α · I / D, I the routed tokens
  //! (the code's `3 · top_k · global_batch · seq_length / world_size`; the paper divides by E,
  //! which equals D in its experiments).
  double balance_factor = 3.0;
  //! b and s of FNEC: sequences per device and their length (the code's `global_batch_size /
  //! world_size` and `seq_length`; defaults: its script's 64 x 256 tokens over 16 GPUs).
  std::int64_t sequences_per_device = 4;
  std::int64_t seq_length = 256;
};

//! Whether Trans and Agg overlap the neighbouring compute.
enum class proprophet_schedule {
  //! The planner alone: Trans and Agg are fully exposed (a layer without Pro-Prophet's scheduler).
  planner_only,
  //! Planner and block-wise scheduler (§V): Trans hides behind FEC and FNEC, Agg behind BEC and
  //! BNEC; only the rest is exposed (the paper's T').
  with_scheduler,
};

//! The formulas of Pro-Prophet §IV-B over validated `proprophet_cost_params`. The same arguments
//! always give the same bits: the planner and any re-evaluation agree exactly.
class proprophet_cost_model {
 public:
  //! @throws error (invalid_argument) naming the first parameter out of range: every size, rate and
  //!         bandwidth must be positive, the size limits ascending, `balance_factor`,
  //!         `sequences_per_device` and `seq_length` not negative.
  explicit proprophet_cost_model(proprophet_cost_params const& params = {}) : params_(params) {
    detail::require(params.hidden > 0, op, "hidden = ", params.hidden, " must be positive");
    require_positive("bytes_per_element", params.bytes_per_element);
    require_positive("mlp_ratio", params.mlp_ratio);
    require_positive("compute_flops", params.compute_flops);
    require_positive("flop_scale", params.flop_scale);
    for (std::size_t k = 0; k < params.a2a_size_limits.size(); ++k) {
      double const limit = params.a2a_size_limits[k];
      detail::require(limit > 0, op, "a2a_size_limits[", k, "] = ", limit, " must be positive");
      if (k > 0)
        detail::require(limit > params.a2a_size_limits[k - 1], op, "a2a_size_limits[", k, "] = ", limit,
                        " must be above a2a_size_limits[", k - 1, "] = ", params.a2a_size_limits[k - 1]);
    }
    for (std::size_t k = 0; k < params.a2a_bandwidths.size(); ++k)
      detail::require(params.a2a_bandwidths[k] > 0, op, "a2a_bandwidths[", k, "] = ", params.a2a_bandwidths[k],
                      " must be positive");
    require_positive("trans_bandwidth", params.trans_bandwidth);
    require_positive("agg_bandwidth", params.agg_bandwidth);
    // `!(x < 0)` would let NaN through; `x >= 0` does not.
    detail::require(params.balance_factor >= 0, op, "balance_factor = ", params.balance_factor,
                    " must not be negative");
    detail::require(params.sequences_per_device >= 0, op, "sequences_per_device = ", params.sequences_per_device,
                    " must not be negative");
    detail::require(params.seq_length >= 0, op, "seq_length = ", params.seq_length, " must not be negative");
  }

  [[nodiscard]] proprophet_cost_params const& params() const { return params_; }

  //! h·s: one token's row.
  [[nodiscard]] double token_bytes() const { return static_cast<double>(params_.hidden) * params_.bytes_per_element; }

  //! size(params) = 2·mlp_ratio·h²·s: one expert's two weight matrices (the code's `Expert_size`
  //! per expert).
  [[nodiscard]] double expert_parameter_bytes() const {
    double const h = static_cast<double>(params_.hidden);
    return 2.0 * params_.mlp_ratio * h * h * params_.bytes_per_element;
  }

  //! B̄ for an all-to-all whose largest message is `message_bytes` (the code's size classes).
  [[nodiscard]] double a2a_bandwidth(double message_bytes) const {
    for (std::size_t k = 0; k < params_.a2a_size_limits.size(); ++k)
      if (message_bytes <= params_.a2a_size_limits[k]) return params_.a2a_bandwidths[k];
    return params_.a2a_bandwidths.back();
  }

  //! T_A2A(R) = max_i R_i·size(input) / B̄ (§IV-B), from `most_received` = max_i R_i; B̄ by that
  //! message's size.
  [[nodiscard]] double a2a_time(std::int64_t most_received) const {
    double const bytes = static_cast<double>(most_received) * token_bytes();
    return bytes / a2a_bandwidth(bytes);
  }

  //! T_FEC(H) = max_i H_i / t (§IV-B), from `most_computed` = max_i H_i: 4·mlp_ratio·h² FLOPs
  //! (times `flop_scale`) per token.
  [[nodiscard]] double forward_expert_time(std::int64_t most_computed) const {
    double const h = static_cast<double>(params_.hidden);
    return static_cast<double>(most_computed) * (4.0 * params_.mlp_ratio * h * h * params_.flop_scale) /
           params_.compute_flops;
  }

  //! T_BEC = 2·T_FEC (§IV-B): the backward computes two gradients per GEMM.
  [[nodiscard]] double backward_expert_time(std::int64_t most_computed) const {
    return 2.0 * forward_expert_time(most_computed);
  }

  //! FNEC = (4·b·s²·h + 4·b·s·h²)·flop_scale / t: the code's forward non-expert compute of one
  //! device (attention scores and dense projections of its b sequences of s tokens).
  [[nodiscard]] double forward_non_expert_time() const {
    double const b = static_cast<double>(params_.sequences_per_device);
    double const s = static_cast<double>(params_.seq_length);
    double const h = static_cast<double>(params_.hidden);
    return (4.0 * b * s * s * h + 4.0 * b * s * h * h) * params_.flop_scale / params_.compute_flops;
  }

  //! BNEC = 2·FNEC (the code's).
  [[nodiscard]] double backward_non_expert_time() const { return 2.0 * forward_non_expert_time(); }

  //! T_Trans(s, n) = s·(D − n)·size(params) / (D·B̄_Trans) (§IV-B): broadcasting `replicated` = s
  //! experts' parameters over `devices` = D devices of which `skipped` = n get no replica.
  [[nodiscard]] double trans_time(std::int64_t replicated, std::int32_t devices, std::int32_t skipped) const {
    return move_time(replicated, devices, skipped, params_.trans_bandwidth);
  }

  //! T_Agg(s, n): T_Trans's formula with the gradients at B̄_Agg (§IV-B).
  [[nodiscard]] double agg_time(std::int64_t replicated, std::int32_t devices, std::int32_t skipped) const {
    return move_time(replicated, devices, skipped, params_.agg_bandwidth);
  }

  //! The layer time (§IV-B):
  //!   T' = 4·T_A2A(R) + 3·T_FEC(H) + T_PTrans + T_PAgg
  //! with_scheduler: T_PTrans = max(0, T_Trans − T_FEC − T_FNEC), T_PAgg = max(0, T_Agg − T_BEC −
  //! T_BNEC), the parts the scheduler cannot hide; planner_only: T_PTrans = T_Trans, T_PAgg = T_Agg.
  //! Four all-to-alls (dispatch and combine, forward and backward); 3·T_FEC = T_FEC + T_BEC.
  [[nodiscard]] double layer_time(std::int64_t most_received, std::int64_t most_computed, std::int64_t replicated,
                                  std::int32_t devices, std::int32_t skipped, proprophet_schedule schedule) const {
    double const fec = forward_expert_time(most_computed);
    double exposed_trans = trans_time(replicated, devices, skipped);
    double exposed_agg = agg_time(replicated, devices, skipped);
    if (schedule == proprophet_schedule::with_scheduler) {
      exposed_trans = positive_part(exposed_trans - fec - forward_non_expert_time());
      exposed_agg = positive_part(exposed_agg - backward_expert_time(most_computed) - backward_non_expert_time());
    }
    return 4.0 * a2a_time(most_received) + 3.0 * fec + exposed_trans + exposed_agg;
  }

 private:
  static constexpr char const* op = "proprophet_cost_model";

  static void require_positive(char const* name, double value) {
    // `value > 0` is false for NaN too, so NaN is refused.
    detail::require(value > 0, op, name, " = ", value, " must be positive");
  }
  static double positive_part(double x) { return x > 0 ? x : 0.0; }

  [[nodiscard]] double move_time(std::int64_t replicated, std::int32_t devices, std::int32_t skipped,
                                 double bandwidth) const {
    detail::require(devices > 0 && skipped >= 0 && skipped < devices, op, "devices = ", devices, ", skipped = ",
                    skipped, ": need 0 <= skipped < devices");
    detail::require(replicated >= 0, op, "replicated = ", replicated, " must not be negative");
    double const d = static_cast<double>(devices);
    return static_cast<double>(replicated) * (d - static_cast<double>(skipped)) * expert_parameter_bytes() /
           (d * bandwidth);
  }

  proprophet_cost_params params_;
};

MOECOMM_NAMESPACE_END
