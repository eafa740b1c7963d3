// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `permute`: token rows into expert-major order, and its backward (semantics §4, §6).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/kernels/row_kernels.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/permute_plan.hpp>

#include <cstdint>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `permuted_w[r] = w[token_of[r]][slot_of[r]]`, or 0 for a padding row.
struct gather_slot_weights {
  float const* weights;
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t top_k;
  float* permuted_weights;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    std::int32_t const t = token_of[r];
    permuted_weights[r] = t < 0 ? 0.0f : weights[static_cast<std::int64_t>(t) * top_k + slot_of[r]];
  }
};

//! `dw[slot] = d_permuted_w[row_of[slot]]`, or 0 for a slot without a row.
struct scatter_slot_weight_grads {
  float const* d_permuted_weights;
  std::int32_t const* row_of;
  float* d_weights;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t slot) const {
    std::int32_t const r = row_of[slot];
    d_weights[slot] = r < 0 ? 0.0f : d_permuted_weights[r];
  }
};

//! `permute`'s row move for the plan's tokens `[first, first + count)` alone: each writes its
//! slots' rows of `out` (a relay forwarding one piece of what it got: `dedup_node_plan`).
template <class Backend, class T>
void scatter_token_rows(Backend const& be, permute_plan<Backend> const& plan, matrix_view<T const> x, matrix_view<T> out,
                        std::int64_t first, std::int64_t count) {
  std::int32_t const top_k = plan.routing().top_k;
  T const* const from = x.data + first * x.hidden;
  with_fragment_width<T>(x.hidden, {from, out.data}, [&](auto width) {
    be.for_each_row(count, scatter_rows_kernel<T, decltype(width)::value, false>{
                               from, out.data, x.hidden, plan.row_of() + first * top_k, top_k, nullptr,
                               plan.num_rows() * out.row_bytes() >= streaming_store_min_bytes});
  });
}

}  // namespace detail

//! Copies each kept slot's token row to its expert-major row: `out[r] = x[token_of[r]]`, bit for
//! bit, for `r < plan.num_rows()`; rows of `out` beyond that are not touched.
//! @param x `[>= T][H]` token rows.
//! @param out `[>= P][H]` permuted rows; must not overlap `x`.
//! @param out_weights `[>= P]`: the routing weight of each row's slot (needs weights in the plan's
//!        routing), or `not_needed`.
//! @throws error (invalid_argument) naming the argument, before anything is written.
template <class Backend, class T>
void permute(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> x, matrix_view<T> out,
             optional_output<array_view<float>> out_weights = not_needed) {
  static_assert(is_supported_dtype_v<T>, "moecomm::permute: unsupported element type");
  char const* op = "permute";
  std::int64_t const tokens = plan.routing().num_tokens;
  std::int64_t const rows = plan.num_rows();
  detail::check_row_move(x, tokens, "x", "one row per token",
                         out, rows, "out", "one row per kept slot: plan.num_rows()", op);
  if (out_weights.wanted()) {
    detail::check_elements(out_weights.view(), rows, op, "out_weights", "one weight per kept slot: plan.num_rows()");
    detail::require(tokens == 0 || plan.routing().topk_weights != nullptr, op,
                    "argument 'out_weights' was given but the plan's routing has no topk_weights");
  }
  // Each token row is read once and written to its slots' rows (one pass over x, not K); a padded
  // plan's tail rows, which no slot maps to, are zeroed apart.
  detail::scatter_token_rows(be, plan, x, out, 0, tokens);
  detail::with_fragment_width<T>(out.hidden, {x.data, out.data}, [&](auto width) {
    detail::zero_padding_rows<T, decltype(width)::value>(be, plan, out);
  });
  if (out_weights.wanted())
    be.for_each_index(rows, detail::gather_slot_weights{plan.routing().topk_weights, plan.token_of(), plan.slot_of(),
                                                        plan.routing().top_k, out_weights.view().data});
}

namespace detail {

template <class Backend, class T>
void check_permute_backward(permute_plan<Backend> const& plan, matrix_view<T const> d_out,
                           matrix_view<T> d_x, char const* op) {
  static_assert(is_supported_dtype_v<T>, "moecomm::permute_backward: unsupported element type");
  std::int64_t const tokens = plan.routing().num_tokens;
  std::int64_t const rows = plan.num_rows();
  check_row_move(d_out, rows, "d_out", "one row per kept slot: plan.num_rows()",
                 d_x, tokens, "d_x", "one row per token", op);
}

}  // namespace detail

//! The backward of `permute`: `d_x[t] = sum of d_out over the token's rows` (fp32, ascending k,
//! one rounding).
//! @param d_out `[>= P][H]` gradient of the permuted rows.
//! @param d_x `[>= T][H]` gradient of the token rows; every token row is written (zeros when it has no kept slot).
template <class Backend, class T>
void permute_backward(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> d_out,
                      matrix_view<T> d_x) {
  detail::check_permute_backward<Backend, T>(plan, d_out, d_x, "permute_backward");
  detail::with_fragment_width<T>(d_x.hidden, {d_out.data, d_x.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    std::int64_t const tokens = plan.routing().num_tokens;
    be.for_each_row(tokens, detail::combine_rows_kernel<T, n, false>{
                                d_out.data, d_x.data, d_x.hidden, plan.row_of(), nullptr, plan.routing().top_k,
                                tokens * d_x.row_bytes() >= detail::streaming_store_min_bytes, tokens});
  });
}

//! The same, and the gradient of `permute`'s `out_weights`: `d_weights[t][k] =
//! d_out_weights[row_of[t][k]]` (0 for a slot without a row).
//! @param d_out_weights `[>= P]` gradient of `permute`'s `out_weights`.
//! @param d_weights `[>= T * K]` gradient of the routing weights.
template <class Backend, class T>
void permute_backward(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> d_out,
                      array_view<float const> d_out_weights, matrix_view<T> d_x, array_view<float> d_weights) {
  char const* op = "permute_backward";
  std::int64_t const slots = plan.routing().num_tokens * plan.routing().top_k;
  detail::check_permute_backward<Backend, T>(plan, d_out, d_x, op);
  detail::check_elements(d_out_weights, plan.num_rows(), op, "d_out_weights", "one per kept slot: plan.num_rows()");
  detail::check_elements(d_weights, slots, op, "d_weights", "one per slot: num_tokens * top_k");
  permute_backward(be, plan, d_out, d_x);
  be.for_each_index(slots, detail::scatter_slot_weight_grads{d_out_weights.data, plan.row_of(), d_weights.data});
}

MOECOMM_NAMESPACE_END
