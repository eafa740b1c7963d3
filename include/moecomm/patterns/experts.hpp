// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The two ways a layer can be given its experts, and how the layer calls either.
//!
//! 1. A callable, for plain expert parallelism: `experts(l, rows_in, rows_out)` runs local expert
//!    `l` (global expert `rank * E / R + l`) and `experts(l, rows_in, d_rows_out, d_rows_in)` its
//!    backward, which accumulates its parameter gradient however the caller likes.
//! 2. Parametric experts, needed when experts are shadowed or replicated (the layer must move their
//!    parameters and gradients), and accepted by plain expert parallelism too:
//!
//! | member | meaning |
//! |---|---|
//! | `std::int64_t parameter_count() const` | elements of one expert's flat parameter buffer (the same for every expert) |
//! | `P* parameters(std::int32_t l)` | local expert `l`'s parameters, `P` = float or double, in the back-end's memory |
//! | `P* gradients(std::int32_t l)` | local expert `l`'s gradient accumulator (same layout) |
//! | `void forward(P const* params, matrix_view<T const> in, matrix_view<T> out)` | any expert, given its parameters |
//! | `void backward(P const* params, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in, P* d_params)` | writes `d_in`, adds this batch's parameter gradient to `d_params` |
//!
//! Rows are independent: an expert's output row depends only on its input row, so the layer may
//! hand an expert its rows in several calls.

#include <moecomm/config.hpp>
#include <moecomm/core/matrix.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Experts, class = void>
struct is_parametric_experts : std::false_type {};
template <class Experts>
struct is_parametric_experts<Experts, std::void_t<decltype(std::declval<Experts&>().parameters(std::int32_t{0})),
                                                  decltype(std::declval<Experts&>().gradients(std::int32_t{0})),
                                                  decltype(std::declval<Experts const&>().parameter_count())>>
    : std::true_type {};
template <class Experts>
inline constexpr bool is_parametric_experts_v = is_parametric_experts<std::remove_reference_t<Experts>>::value;

//! The element type of parametric experts' parameters.
template <class Experts>
using parameter_t = std::remove_pointer_t<decltype(std::declval<Experts&>().parameters(std::int32_t{0}))>;

//! Runs local expert `l` on its rows.
template <class T, class Experts>
void run_local_expert(Experts& experts, std::int32_t l, matrix_view<T const> in, matrix_view<T> out) {
  if constexpr (is_parametric_experts_v<Experts>) experts.forward(experts.parameters(l), in, out);
  else experts(l, in, out);
}

//! Runs local expert `l`'s backward (parametric experts add to their own gradient accumulator).
template <class T, class Experts>
void run_local_expert_backward(Experts& experts, std::int32_t l, matrix_view<T const> in, matrix_view<T const> d_out,
                               matrix_view<T> d_in) {
  if constexpr (is_parametric_experts_v<Experts>) experts.backward(experts.parameters(l), in, d_out, d_in, experts.gradients(l));
  else experts(l, in, d_out, d_in);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
