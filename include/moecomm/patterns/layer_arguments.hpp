// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The argument checks every layer's `forward` and `backward` run before their first collective,
//! naming the user's argument and the call (`expert_parallel_layer`, `parm_layer`).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `x` and `out` hold a row of `hidden` per token of `routing`, and do not overlap.
template <class T>
void check_layer_forward_arguments(char const* op, routing_view const& routing, matrix_view<T const> x, matrix_view<T> out,
                                   std::int64_t hidden) {
  require(routing.num_tokens >= 0, op, "routing.num_tokens = ", routing.num_tokens, " is negative");
  check_rows(x, routing.num_tokens, op, "x", "one row per token: routing.num_tokens");
  require(x.hidden == hidden, op, "argument 'x' has hidden = ", x.hidden, ", the layer's hidden = ", hidden);
  check_rows(out, routing.num_tokens, op, "out", "one row per token: routing.num_tokens");
  require(out.hidden == hidden, op, "argument 'out' has hidden = ", out.hidden, ", the layer's hidden = ", hidden);
  check_no_overlap(x, routing.num_tokens, "x", out, routing.num_tokens, "out", op);
}

//! `d_out`, and `d_x` and `d_weights` when wanted, fit the last forward's `tokens` x `top_k` slots;
//! `d_weights` only on a `weighted` layer.
template <class T>
void check_layer_backward_arguments(char const* op, std::int64_t tokens, std::int32_t top_k, bool weighted,
                                    matrix_view<T const> d_out, optional_output<matrix_view<T>> const& d_x,
                                    optional_output<array_view<float>> const& d_weights, std::int64_t hidden) {
  check_rows(d_out, tokens, op, "d_out", "one row per token of the last forward");
  require(d_out.hidden == hidden, op, "argument 'd_out' has hidden = ", d_out.hidden, ", the layer's hidden = ", hidden);
  if (d_x.wanted()) {
    check_rows(d_x.view(), tokens, op, "d_x", "one row per token of the last forward");
    require(d_x.view().hidden == hidden, op, "argument 'd_x' has hidden = ", d_x.view().hidden, ", the layer's hidden = ",
            hidden);
  }
  if (d_weights.wanted()) {
    require(weighted, op,
            "argument 'd_weights' was given, but an unweighted layer has no routing-weight gradient; pass moecomm::not_needed");
    check_elements(d_weights.view(), tokens * top_k, op, "d_weights", "one per routing slot of the last forward: num_tokens * top_k");
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
