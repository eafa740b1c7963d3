// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `router_forward` and `router_backward`: a top-k router (gate) from logits to routing, with the
//! load-balancing and z losses, matching Megatron-LM's `TopKRouter` (docs/semantics.md §15).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/router/router_config.hpp>
#include <moecomm/rows/router/router_kernels.hpp>

#include <cstdint>
#include <limits>

MOECOMM_NAMESPACE_BEGIN

template <class Backend>
class router_state;

template <class Backend>
void router_forward(Backend const& be, matrix_view<float const> logits, matrix_view<std::int32_t> topk_idx,
                    matrix_view<float> topk_weights, optional_output<array_view<std::int32_t>> tokens_per_expert,
                    optional_output<array_view<router_losses>> losses, router_state<Backend>& state,
                    router_config const& config = {});
template <class Backend>
void router_backward(Backend const& be, router_state<Backend> const& state, matrix_view<float const> d_topk_weights,
                     matrix_view<float> d_logits);

//! What `router_forward` keeps for `router_backward`: a copy of the logits, the selection, per-token
//! statistics and the load-balancing loss's counts, in the back-end's memory. Buffers only grow, so
//! a steady state allocates nothing. One forward at a time: the next forward overwrites it.
template <class Backend>
class router_state {
  template <class T>
  using buffer_t = typename Backend::template buffer_type<T>;

 public:
  //! T of the last forward pass, or -1 before the first.
  [[nodiscard]] std::int64_t num_tokens() const { return tokens_; }
  //! E of the last forward pass.
  [[nodiscard]] std::int64_t num_experts() const { return experts_; }
  //! The config of the last forward pass (its `expert_bias` is not read after that pass).
  [[nodiscard]] router_config const& config() const { return config_; }
  //! `[T][E]` the logits of the last forward pass.
  [[nodiscard]] float const* saved_logits() const { return logits_.data(); }
  //! `[T][K]` the selected experts of the last forward pass, best first (`topk_idx` as written).
  [[nodiscard]] std::int32_t const* selected_experts() const { return selected_.data(); }

  //! Sizes the buffers for passes of up to `max_tokens` tokens over `num_experts` experts with
  //! `top_k`, so that such passes allocate nothing (a trainer calls it beside its layer's `reserve`).
  //! @throws error (invalid_argument) naming the argument that is negative.
  void reserve(Backend const& be, std::int64_t max_tokens, std::int64_t num_experts, std::int32_t top_k) {
    char const* const op = "router_state::reserve";
    detail::require(max_tokens >= 0, op, "max_tokens = ", max_tokens, " must be >= 0");
    detail::require(num_experts >= 0, op, "num_experts = ", num_experts, " must be >= 0");
    detail::require(top_k >= 0, op, "top_k = ", top_k, " must be >= 0");
    size_buffers(be, max_tokens, num_experts, top_k);
  }

 private:
  friend void router_forward<Backend>(Backend const&, matrix_view<float const>, matrix_view<std::int32_t>,
                                      matrix_view<float>, optional_output<array_view<std::int32_t>>,
                                      optional_output<array_view<router_losses>>, router_state&, router_config const&);
  friend void router_backward<Backend>(Backend const&, router_state const&, matrix_view<float const>,
                                       matrix_view<float>);

  //! Sizes the buffers for a pass (growing only) and records its shape.
  void begin_pass(Backend const& be, std::int64_t tokens, std::int64_t experts, router_config const& config) {
    size_buffers(be, tokens, experts, config.top_k);
    tokens_ = tokens;
    experts_ = experts;
    config_ = config;
  }

  void size_buffers(Backend const& be, std::int64_t tokens, std::int64_t experts, std::int32_t top_k) {
    grow(be, logits_, tokens * experts);
    grow(be, scores_, tokens * experts);
    grow(be, selected_, tokens * top_k);
    grow(be, stats_, tokens);
    grow(be, aux_counts_, experts);
    grow(be, aux_sums_, experts);
    std::int64_t const blocks = (tokens + detail::router_sum_block - 1) / detail::router_sum_block;
    grow(be, block_sums_, blocks * (experts + 1));  // per block: E column sums, then the z sum
  }

  std::int64_t tokens_ = -1;
  std::int64_t experts_ = 0;
  router_config config_{};
  buffer_t<float> logits_;
  buffer_t<float> scores_;  //!< the forward's scratch: selection keys, then aux scores
  buffer_t<std::int32_t> selected_;
  buffer_t<detail::router_row_stats> stats_;
  buffer_t<std::int32_t> aux_counts_;  //!< per expert, of the aux loss's own top-k
  buffer_t<float> aux_sums_;           //!< per expert, the aux scores summed over tokens
  buffer_t<float> block_sums_;         //!< the losses' partial sums per block of 64 tokens
};

namespace detail {

//! `m` must be exactly `columns` wide with at least `rows` rows.
template <class T>
void check_router_matrix(matrix_view<T> const& m, std::int64_t rows, std::int64_t columns, char const* op,
                         char const* name, char const* why) {
  require(m.hidden == columns, op, "argument '", name, "' has hidden = ", m.hidden, "; needs exactly ", columns, " (",
          why, ")");
  check_rows(m, rows, op, name, "one row per token");
}

//! Reads the first bad logit back and reports it (checked mode).
template <class Backend>
[[noreturn]] void report_bad_logit(Backend const& be, matrix_view<float const> logits, std::int64_t code,
                                   char const* op) {
  std::int64_t const t = code / (logits.hidden + 1), e = code % (logits.hidden + 1);
  if (e == logits.hidden)
    fail(status::invalid_argument, op, "argument 'logits' row ", t,
         " has no finite value: every expert's logit is -inf (token ", t, ")");
  float value = 0.0f;
  be.copy(&value, logits.row(t) + e, 1);
  be.synchronize();
  fail(status::invalid_argument, op, "argument 'logits' has logits[", t, "][", e, "] = ", value,
       "; logits must be finite or -inf (token ", t, ", expert ", e, ")");
}

//! The value scans of checked mode: the logits, then the bias.
template <class Backend>
void scan_router_inputs(Backend const& be, matrix_view<float const> logits, router_config const& config,
                        char const* op) {
  std::int64_t const tokens = logits.rows, experts = logits.hidden;
  std::int64_t const none = std::numeric_limits<std::int64_t>::max();
  std::int64_t const bad = be.reduce(tokens, none, first_bad_logit{logits.data, experts, none}, minimum{});
  if (bad != none) report_bad_logit(be, logits, bad, op);
  if (!config.expert_bias) return;
  float const* bias = config.expert_bias->data;
  std::int64_t const e = be.reduce(experts, experts, first_index_where<not_finite>{{bias}, experts}, minimum{});
  if (e == experts) return;
  float value = 0.0f;
  be.copy(&value, bias + e, 1);
  be.synchronize();
  fail(status::invalid_argument, op, "config.expert_bias[", e, "] = ", value, " is not finite (expert ", e, ")");
}

}  // namespace detail

//! Routes each token to its top-k experts (docs/semantics.md §15): scores, optional group limit and
//! bias, top-k with ties to the lower expert id, renormalisation and scaling, all in fp32 with a
//! fixed order. Keeps what `router_backward` needs in `state`.
//! @param logits `[T][E]` router logits; T and E are its `rows` and `hidden`. Finite or -inf,
//!        with at least one finite logit per token (checked unless `config.check_values` is off).
//! @param topk_idx `[>= T][K]` the selected experts, best first.
//! @param topk_weights `[>= T][K]` their routing weights.
//! @param tokens_per_expert optional `[>= E]`: how many tokens selected each expert.
//! @param losses optional `[>= 1]`: the load-balancing loss and the z-loss, without coefficients.
//! @throws error (invalid_argument) naming the argument or config field, before anything is written.
template <class Backend>
void router_forward(Backend const& be, matrix_view<float const> logits, matrix_view<std::int32_t> topk_idx,
                    matrix_view<float> topk_weights, optional_output<array_view<std::int32_t>> tokens_per_expert,
                    optional_output<array_view<router_losses>> losses, router_state<Backend>& state,
                    router_config const& config) {
  char const* op = "router_forward";
  std::int64_t const tokens = logits.rows, experts = logits.hidden;
  detail::require(tokens >= 0, op, "argument 'logits' has negative rows = ", tokens);
  detail::require(experts >= 1 && experts <= std::numeric_limits<std::int32_t>::max(), op,
                  "argument 'logits' has hidden = ", experts, "; needs one column per expert, E in [1, 2^31 - 1]");
  detail::check_rows(logits, tokens, op, "logits", "T tokens");
  detail::check_router_config(config, experts, op);
  detail::check_router_matrix(topk_idx, tokens, config.top_k, op, "topk_idx", "config.top_k slots per token");
  detail::check_router_matrix(topk_weights, tokens, config.top_k, op, "topk_weights", "config.top_k slots per token");
  detail::check_no_overlap(topk_idx, tokens, "topk_idx", topk_weights, tokens, "topk_weights", op);
  if (tokens_per_expert.wanted())
    detail::check_elements(tokens_per_expert.view(), experts, op, "tokens_per_expert", "one count per expert");
  if (losses.wanted()) detail::check_elements(losses.view(), 1, op, "losses", "one router_losses");
  if (config.check_values) detail::scan_router_inputs(be, logits, config, op);

  state.begin_pass(be, tokens, experts, config);
  be.copy(state.logits_.data(), logits.data, tokens * experts);
  bool const aux_needed = config.aux_loss_coeff > 0.0f || losses.wanted();
  std::int32_t* const counts = tokens_per_expert.wanted() ? tokens_per_expert.view().data : nullptr;
  if (counts != nullptr) be.for_each_index(experts, detail::fill_value<std::int32_t>{counts, 0});
  if (aux_needed) be.for_each_index(experts, detail::fill_value<std::int32_t>{state.aux_counts_.data(), 0});
  auto const rule = detail::router_rule::from(config, experts);
  be.for_each_index(tokens, detail::router_forward_kernel{rule, state.logits_.data(),
                                                          config.expert_bias ? config.expert_bias->data : nullptr,
                                                          state.stats_.data(), state.scores_.data(),
                                                          state.selected_.data(), topk_idx.data,
                                                          topk_weights.data, counts,
                                                          aux_needed ? state.aux_counts_.data() : nullptr});
  if (losses.wanted()) {
    // Blocks of 64 tokens in parallel, then their partials (kernels/router_kernels.hpp).
    std::int64_t const blocks = (tokens + detail::router_sum_block - 1) / detail::router_sum_block;
    float* const column_blocks = state.block_sums_.data();
    float* const z_blocks = column_blocks + blocks * experts;
    be.for_each_index(blocks * experts, detail::block_column_sums{state.scores_.data(), tokens, experts,
                                                                  detail::router_sum_block, column_blocks});
    be.for_each_index(experts, detail::block_column_sums{column_blocks, blocks, experts, blocks, state.aux_sums_.data()});
    be.for_each_index(blocks, detail::block_lse_squares{state.stats_.data(), tokens, z_blocks});
    double const t = static_cast<double>(tokens);
    auto const aux_scale = tokens > 0 ? static_cast<float>(static_cast<double>(experts) / (config.top_k * t * t)) : 0.0f;
    be.for_each_index(1, detail::router_loss_values{state.aux_sums_.data(), state.aux_counts_.data(), z_blocks, rule.experts,
                                                    tokens, aux_scale, losses.view().data});
  }
}

//! The gradient of `sum_{t,k} topk_weights[t][k] * d_topk_weights[t][k] + aux_loss_coeff * aux +
//! z_loss_coeff * z` with respect to the logits of the last `router_forward`, with the selection
//! held fixed; the aux loss's counts are constants, as in Megatron-LM (docs/semantics.md §15).
//! @param d_topk_weights `[>= T][K]` gradient of `topk_weights`.
//! @param d_logits `[>= T][E]`; every element of the first T rows is written.
template <class Backend>
void router_backward(Backend const& be, router_state<Backend> const& state, matrix_view<float const> d_topk_weights,
                     matrix_view<float> d_logits) {
  char const* op = "router_backward";
  detail::require(state.tokens_ >= 0, op, "argument 'state' holds no forward pass; call router_forward first");
  std::int64_t const tokens = state.tokens_, experts = state.experts_;
  router_config const& config = state.config_;
  detail::check_router_matrix(d_topk_weights, tokens, config.top_k, op, "d_topk_weights",
                              "config.top_k slots per token, as in the forward");
  detail::check_router_matrix(d_logits, tokens, experts, op, "d_logits", "one column per expert, as the logits");
  detail::check_no_overlap(d_topk_weights, tokens, "d_topk_weights", d_logits, tokens, "d_logits", op);
  double const t = static_cast<double>(tokens);
  bool const aux = config.aux_loss_coeff > 0.0f && tokens > 0;
  auto const aux_scale = aux ? static_cast<float>(config.aux_loss_coeff * static_cast<double>(experts) /
                                                  (config.top_k * t * t))
                             : 0.0f;
  auto const z_scale = tokens > 0 ? static_cast<float>(2.0 * config.z_loss_coeff / t) : 0.0f;
  be.for_each_index(tokens, detail::router_backward_kernel{detail::router_rule::from(config, experts),
                                                           state.logits_.data(), state.stats_.data(),
                                                           state.selected_.data(),
                                                           aux ? state.aux_counts_.data() : nullptr,
                                                           d_topk_weights.data, d_logits.data, aux_scale, z_scale});
}

MOECOMM_NAMESPACE_END
