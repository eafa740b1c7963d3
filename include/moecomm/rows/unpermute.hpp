// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `unpermute`: the local combine, a weighted or plain sum of each token's expert rows, and its
//! backward (semantics §5, §6).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/kernels/row_kernels.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/permute_plan.hpp>

#include <cstdint>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! Combine policy: multiply each expert row by its routing weight (weights applied at combine).
struct weighted {};
//! Combine policy: a plain sum (weights applied inside the expert, Megatron-LM style, or none).
struct unweighted {};

namespace detail {
//! True for `weighted`, false for `unweighted`; any other policy type is a compile error.
template <class Weighting>
constexpr bool is_weighted() {
  static_assert(std::is_same_v<Weighting, weighted> || std::is_same_v<Weighting, unweighted>,
                "moecomm: the combine policy must be moecomm::weighted or moecomm::unweighted");
  return std::is_same_v<Weighting, weighted>;
}

//! `unpermute`'s row sums for the plan's tokens `[first, first + count)` alone (a relay summing one
//! piece of what it got: `dedup_node_plan`).
template <bool Weighted, class Backend, class T>
void combine_token_rows(Backend const& be, permute_plan<Backend> const& plan, matrix_view<T const> y, matrix_view<T> out,
                        std::int64_t first, std::int64_t count) {
  std::int32_t const top_k = plan.routing().top_k;
  float const* const weights = Weighted ? plan.routing().topk_weights + first * top_k : nullptr;
  T* const to = out.data + first * out.hidden;
  with_fragment_width<T>(out.hidden, {y.data, to}, [&](auto width) {
    be.for_each_row(count, combine_rows_kernel<T, decltype(width)::value, Weighted>{
                               y.data, to, out.hidden, plan.row_of() + first * top_k, weights, top_k,
                               count * out.row_bytes() >= streaming_store_min_bytes, count});
  });
}

}  // namespace detail

//! `out[t] = round(sum over valid k, ascending, of w[t][k] * y[row_of[t][k]])` in fp32 with an
//! explicit FMA (`weighted`), or the plain fp32 sum (`unweighted`). Bitwise deterministic; a token
//! with no kept slot gets a zero row. Every token row `[0, T)` of `out` is written.
//! @tparam Weighting `weighted` (default) or `unweighted`.
//! @param y `[>= P][H]` expert outputs in permuted order.
//! @param out `[>= T][H]` combined token rows; must not overlap `y`.
//! @throws error (invalid_argument) naming the argument; `weighted` needs weights in the plan's routing.
template <class Weighting = weighted, class Backend, class T>
void unpermute(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> y,
               matrix_view<T> out) {
  static_assert(is_supported_dtype_v<T>, "moecomm::unpermute: unsupported element type");
  char const* op = "unpermute";
  constexpr bool is_weighted = detail::is_weighted<Weighting>();
  std::int64_t const tokens = plan.routing().num_tokens;
  std::int64_t const rows = plan.num_rows();
  detail::check_row_move(y, rows, "y", "one row per kept slot: plan.num_rows()",
                         out, tokens, "out", "one row per token", op);
  detail::require(!is_weighted || tokens == 0 || plan.routing().topk_weights != nullptr, op,
                  "the weighted combine needs topk_weights, but the plan's routing has none "
                  "(use moecomm::unweighted for a plain sum)");
  detail::combine_token_rows<is_weighted>(be, plan, y, out, 0, tokens);
}

namespace detail {

template <class Weighting, class Backend, class T>
void check_unpermute_backward(permute_plan<Backend> const& plan, matrix_view<T const> d_out, matrix_view<T> d_y,
                              char const* op) {
  static_assert(is_supported_dtype_v<T>, "moecomm::unpermute_backward: unsupported element type");
  std::int64_t const tokens = plan.routing().num_tokens;
  std::int64_t const rows = plan.num_rows();
  check_row_move(d_out, tokens, "d_out", "one row per token",
                 d_y, rows, "d_y", "one row per kept slot: plan.num_rows()", op);
  require(!is_weighted<Weighting>() || tokens == 0 || plan.routing().topk_weights != nullptr, op,
          "the weighted combine needs topk_weights, but the plan's routing has none");
}

}  // namespace detail

//! The backward of `unpermute`. Writes `d_y[r]` for every `r < P`: `w[t][k] * d_out[t]` (fp32
//! multiply, one rounding) when `weighted`, a bit copy of `d_out[t]` when `unweighted`.
//! @param d_out `[>= T][H]` gradient of the combined rows.
//! @param d_y `[>= P][H]` gradient of the expert outputs; must not overlap `d_out`.
template <class Weighting = weighted, class Backend, class T>
void unpermute_backward(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> d_out,
                        matrix_view<T> d_y) {
  detail::check_unpermute_backward<Weighting, Backend, T>(plan, d_out, d_y, "unpermute_backward");
  routing_view const& routing = plan.routing();
  // One pass over the tokens: each gradient row is read once and written (weighted) to its slots'
  // rows; a padded plan's tail rows get zeros.
  detail::with_fragment_width<T>(d_y.hidden, {d_out.data, d_y.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    be.for_each_row(routing.num_tokens, detail::scatter_rows_kernel<T, n, detail::is_weighted<Weighting>()>{
                                            d_out.data, d_y.data, d_y.hidden, plan.row_of(), routing.top_k,
                                            routing.topk_weights});
    detail::zero_padding_rows<T, n>(be, plan, d_y);
  });
}

template <class Backend, class T>
void unpermute_backward(Backend const& be, permute_plan<Backend> const& plan, matrix_view<std::add_const_t<T>> d_out,
                        matrix_view<std::add_const_t<T>> y, matrix_view<T> d_y, array_view<float> d_weights) {
  char const* op = "unpermute_backward";
  routing_view const& routing = plan.routing();
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  detail::check_unpermute_backward<weighted, Backend, T>(plan, d_out, d_y, op);
  detail::check_rows(y, plan.num_rows(), op, "y", "the forward's expert outputs, needed for d_weights");
  detail::check_same_hidden(d_out, "d_out", y, "y", op);
  detail::check_elements(d_weights, slots, op, "d_weights", "one per slot: num_tokens * top_k");
  if (routing.top_k > detail::fused_dot_max_slots) {  // more slots than the fused kernel keeps: two passes
    unpermute_backward<weighted>(be, plan, d_out, d_y);
    detail::with_fragment_width<T>(y.hidden, {y.data, d_out.data}, [&](auto width) {
      constexpr int n = decltype(width)::value;
      be.for_each_row(slots, detail::slot_dot_kernel<T, n>{y.data, d_out.data, d_weights.data, y.hidden, plan.row_of(),
                                                           routing.top_k});
    });
    return;
  }
  // One pass over the tokens: d_y and the weight gradient together, each d_out row read once.
  detail::with_fragment_width<T>(y.hidden, {y.data, d_out.data, d_y.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    be.for_each_row(routing.num_tokens, detail::scatter_weighted_rows_with_dot_kernel<T, n>{
                                            d_out.data, y.data, d_y.data, d_weights.data, y.hidden, plan.row_of(),
                                            routing.topk_weights, routing.top_k});
    detail::zero_padding_rows<T, n>(be, plan, d_y);
  });
}

MOECOMM_NAMESPACE_END
