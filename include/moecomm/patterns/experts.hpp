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
//!
//! 3. Sliced experts, for expert-slicing parallelism (ESP: Parm, DeepSpeed-MoE with tensor-sliced
//!    experts): parametric experts of which this rank holds slice `slice()` of `slices()` of every
//!    local expert (an MLP cut along its inner dimension: columns of the first GEMM, rows of the
//!    second). Their `forward` writes this slice's *partial* output and `backward` its partial input
//!    gradient; the sum over the slices, in ascending slice order, is the expert's (a bias after the
//!    second GEMM belongs to slice 0). Parameters and gradients are the slice's. Two more members:
//!
//! | member | meaning |
//! |---|---|
//! | `std::int32_t slices() const` | N_ESP, the number of slices (1: unsliced) |
//! | `std::int32_t slice() const` | this rank's slice, in `[0, slices())` |
//!
//! **The back-end a call runs on.** Either kind may take, as one more last argument, the back-end
//! the layer runs that call on: `experts(l, in, out, be)`, `forward(params, in, out, be)` and the
//! same for the backward (`Backend const& be`, the layer's back-end type). It is the layer's own
//! back-end, or a lane's when the call overlaps communication (the smart schedule): on
//! `cuda_backend`, launch on `be.stream()` (`cublasSetStream(handle, be.stream())`) and the expert's
//! kernels are ordered with the layer's copies and exchanges by the layer's own events; experts
//! without the argument must enqueue on the layer's stream themselves, and an overlapped call is
//! then serialised with the exchanges it was meant to hide.
//!
//! **Grouped experts.** Either kind may also declare the grouped form, which the layer then prefers
//! for its local experts: one call for a block of rows cut among local experts 0 .. L−1, as a
//! grouped GEMM takes them (`grouped_rows`, `grouped_gradient_rows` below: the views are exactly
//! the block, expert `l`'s rows are its rows `[offsets[l], offsets[l + 1])`, `offsets[0] = 0`, in
//! host memory):
//!
//! | member | meaning |
//! |---|---|
//! | `void forward_grouped(grouped_rows<T> const& rows, Backend const& be)` | every local expert on its rows (parametric: with `parameters(l)`) |
//! | `void backward_grouped(grouped_gradient_rows<T> const& rows, Backend const& be)` | every local expert's backward (parametric: adding to `gradients(l)`) |
//!
//! The per-expert form is still required: shadowed and gathered experts (FasterMoE's home experts,
//! HybridEP) run on parameters other than `parameters(l)`, one expert at a time. Layers that call
//! the grouped form: `expert_parallel_layer` (for the smart schedule, once per source rank),
//! `replicated_expert_layer` (one group per slot) and Parm's baseline schedule; Parm's S1/S2
//! (rows in segments) and HybridEP call experts one at a time.
//!
//! Either kind may also declare `double flops(std::int64_t rows) const`: the FLOPs of one expert's
//! forward over `rows` rows (an MLP: 2 · rows · H · F per GEMM). A simulated back-end charges them
//! to the device (the backward as twice the forward: the input and the weight gradients), at the
//! efficiency its platform gives GEMMs of that many rows; other back-ends ignore them.
//!
//! The layer checks its experts member by member (`detail::check_experts`): the first missing or
//! mis-declared member stops compilation with one static_assert that spells its expected signature.
//! Experts that declare any of `parameter_count`, `parameters` or `gradients` are checked as
//! parametric, so a half-declared parametric interface is never taken for a callable.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/simulation_hooks.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The grouped form's forward rows: local expert `l` maps rows `[offsets[l], offsets[l + 1])` of
//! `in` to the same rows of `out`, for `l` in `[0, offsets.size - 1)`; `offsets[0] = 0` and the
//! last offset is the views' row count.
template <class T>
struct grouped_rows {
  matrix_view<T const> in;
  matrix_view<T> out;
  array_view<std::int64_t const> offsets;  //!< host memory, ascending from 0, one more than the experts
};

//! The grouped form's backward rows, cut by `offsets` as in `grouped_rows`.
template <class T>
struct grouped_gradient_rows {
  matrix_view<T const> in;     //!< the forward's input rows
  matrix_view<T const> d_out;  //!< the gradient of its output rows
  matrix_view<T> d_in;         //!< written: the gradient of its input rows
  array_view<std::int64_t const> offsets;
};

namespace detail {

// ---- detection: one trait per member of either interface --------------------------------------
//! `Member<Args...>` (the type of a call expression) when it is well-formed, else `no_member`.
struct no_member {};
template <class Void, template <class...> class Member, class... Args>
struct detect_member {
  using type = no_member;
};
template <template <class...> class Member, class... Args>
struct detect_member<std::void_t<Member<Args...>>, Member, Args...> {
  using type = Member<Args...>;
};
template <template <class...> class Member, class... Args>
using member_t = typename detect_member<void, Member, Args...>::type;
template <template <class...> class Member, class... Args>
inline constexpr bool has_member_v = !std::is_same_v<member_t<Member, Args...>, no_member>;

template <class E>
using const_parameter_count_member = decltype(std::declval<E const&>().parameter_count());
template <class E>
using parameter_count_member = decltype(std::declval<E&>().parameter_count());  // const or not
template <class E>
using parameters_member = decltype(std::declval<E&>().parameters(std::int32_t{0}));
template <class E>
using gradients_member = decltype(std::declval<E&>().gradients(std::int32_t{0}));
template <class E, class T, class P>
using forward_member = decltype(std::declval<E&>().forward(std::declval<P const*>(), std::declval<matrix_view<T const>>(),
                                                           std::declval<matrix_view<T>>()));
template <class E, class T, class P>
using backward_member = decltype(std::declval<E&>().backward(std::declval<P const*>(), std::declval<matrix_view<T const>>(),
                                                             std::declval<matrix_view<T const>>(),
                                                             std::declval<matrix_view<T>>(), std::declval<P*>()));
template <class E, class T, class P, class B>
using forward_member_on = decltype(std::declval<E&>().forward(std::declval<P const*>(), std::declval<matrix_view<T const>>(),
                                                              std::declval<matrix_view<T>>(), std::declval<B const&>()));
template <class E, class T, class P, class B>
using backward_member_on = decltype(std::declval<E&>().backward(std::declval<P const*>(), std::declval<matrix_view<T const>>(),
                                                                std::declval<matrix_view<T const>>(),
                                                                std::declval<matrix_view<T>>(), std::declval<P*>(),
                                                                std::declval<B const&>()));
template <class E, class T, class B>
using forward_call_on = decltype(std::declval<E&>()(std::int32_t{0}, std::declval<matrix_view<T const>>(),
                                                    std::declval<matrix_view<T>>(), std::declval<B const&>()));
template <class E, class T, class B>
using backward_call_on = decltype(std::declval<E&>()(std::int32_t{0}, std::declval<matrix_view<T const>>(),
                                                     std::declval<matrix_view<T const>>(), std::declval<matrix_view<T>>(),
                                                     std::declval<B const&>()));
template <class E, class T, class B>
using forward_grouped_member = decltype(std::declval<E&>().forward_grouped(std::declval<grouped_rows<T> const&>(),
                                                                           std::declval<B const&>()));
template <class E, class T, class B>
using backward_grouped_member = decltype(std::declval<E&>().backward_grouped(std::declval<grouped_gradient_rows<T> const&>(),
                                                                             std::declval<B const&>()));
template <class E, class T>
using forward_call = decltype(std::declval<E&>()(std::int32_t{0}, std::declval<matrix_view<T const>>(),
                                                 std::declval<matrix_view<T>>()));
template <class E, class T>
using backward_call = decltype(std::declval<E&>()(std::int32_t{0}, std::declval<matrix_view<T const>>(),
                                                  std::declval<matrix_view<T const>>(), std::declval<matrix_view<T>>()));

//! Experts that declare any accessor of the parametric interface mean to be parametric: they are
//! checked as such (a missing or mis-declared member is named), never taken for a callable.
template <class Experts>
inline constexpr bool is_parametric_experts_v = has_member_v<parameter_count_member, std::remove_reference_t<Experts>> ||
                                                has_member_v<parameters_member, std::remove_reference_t<Experts>> ||
                                                has_member_v<gradients_member, std::remove_reference_t<Experts>>;

template <class E>
using slices_member = decltype(std::declval<E const&>().slices());
template <class E>
using slice_member = decltype(std::declval<E const&>().slice());

//! Parametric experts that hold a slice of each expert (see the file comment).
template <class Experts>
inline constexpr bool is_sliced_experts_v = is_parametric_experts_v<Experts> &&
                                            std::is_same_v<member_t<slices_member, std::remove_reference_t<Experts>>, std::int32_t> &&
                                            std::is_same_v<member_t<slice_member, std::remove_reference_t<Experts>>, std::int32_t>;

//! The element type of parametric experts' parameters.
template <class Experts>
using parameter_t = std::remove_pointer_t<decltype(std::declval<Experts&>().parameters(std::int32_t{0}))>;

template <class E>
inline constexpr bool parameters_are_float_or_double_v = std::is_same_v<member_t<parameters_member, E>, float*> ||
                                                         std::is_same_v<member_t<parameters_member, E>, double*>;
template <class E>
inline constexpr bool gradients_match_parameters_v =
    std::is_same_v<member_t<gradients_member, E>, member_t<parameters_member, E>>;

template <class E, class T, class B>
inline constexpr bool has_forward_member_v = has_member_v<forward_member, E, T, parameter_t<E>> ||
                                             has_member_v<forward_member_on, E, T, parameter_t<E>, B>;
template <class E, class T, class B>
inline constexpr bool has_backward_member_v = has_member_v<backward_member, E, T, parameter_t<E>> ||
                                              has_member_v<backward_member_on, E, T, parameter_t<E>, B>;
template <class E, class T, class B>
inline constexpr bool has_forward_call_v = has_member_v<forward_call, E, T> || has_member_v<forward_call_on, E, T, B>;
template <class E, class T, class B>
inline constexpr bool has_backward_call_v = has_member_v<backward_call, E, T> || has_member_v<backward_call_on, E, T, B>;

//! Member by member, the first missing or mis-declared member of parametric experts `E` fails a
//! static_assert that spells the member's expected signature; later members are not looked at.
template <class T, class B, class E, bool for_backward>
[[nodiscard]] constexpr bool check_parametric_experts() {
  if constexpr (!has_member_v<const_parameter_count_member, E>) {
    if constexpr (has_member_v<parameter_count_member, E>)
      static_assert(has_member_v<const_parameter_count_member, E>,
                    "moecomm: parametric experts: parameter_count() must be a const member function: "
                    "std::int64_t parameter_count() const");
    else
      static_assert(has_member_v<const_parameter_count_member, E>,
                    "moecomm: parametric experts need std::int64_t parameter_count() const");
    return false;
  } else if constexpr (!parameters_are_float_or_double_v<E>) {
    static_assert(parameters_are_float_or_double_v<E>,
                  "moecomm: parametric experts need P* parameters(std::int32_t l), returning float* or double*");
    return false;
  } else if constexpr (!gradients_match_parameters_v<E>) {
    static_assert(gradients_match_parameters_v<E>,
                  "moecomm: parametric experts need P* gradients(std::int32_t l), returning the same P* as parameters(l)");
    return false;
  } else if constexpr (!for_backward && !has_forward_member_v<E, T, B>) {
    static_assert(has_forward_member_v<E, T, B>,
                  "moecomm: parametric experts need void forward(P const* params, matrix_view<T const> in, "
                  "matrix_view<T> out), with P* what parameters(l) returns and T the layer's element type (a last "
                  "argument Backend const& be, the back-end the call runs on, may be added)");
    return false;
  } else if constexpr (for_backward && !has_backward_member_v<E, T, B>) {
    static_assert(has_backward_member_v<E, T, B>,
                  "moecomm: parametric experts need void backward(P const* params, matrix_view<T const> in, "
                  "matrix_view<T const> d_out, matrix_view<T> d_in, P* d_params), with P* what parameters(l) returns "
                  "and T the layer's element type (a last argument Backend const& be may be added)");
    return false;
  } else {
    return true;
  }
}

//! Whether a layer of element type `T` on back-end `B` can run `Experts` (in its forward, or its
//! backward), as a constant for `if constexpr`: when it cannot, exactly one static_assert has
//! failed, spelling the expected signature, and the caller's guarded body is never instantiated (no
//! cascade of errors).
//! @tparam needs_parametric the layer moves parameters (shadowing), so callables will not do.
template <class T, class B, class Experts, bool needs_parametric, bool for_backward>
[[nodiscard]] constexpr bool check_experts() {
  using E = std::remove_reference_t<Experts>;
  if constexpr (is_parametric_experts_v<E>) {
    return check_parametric_experts<T, B, E, for_backward>();
  } else if constexpr (needs_parametric) {
    static_assert(is_parametric_experts_v<E>,
                  "moecomm: a shadowing layer moves expert parameters, so it needs parametric experts, not a "
                  "callable: std::int64_t parameter_count() const, P* parameters(std::int32_t l), P* "
                  "gradients(std::int32_t l), void forward(P const* params, matrix_view<T const> in, matrix_view<T> "
                  "out), void backward(P const* params, matrix_view<T const> in, matrix_view<T const> d_out, "
                  "matrix_view<T> d_in, P* d_params)");
    return false;
  } else if constexpr (for_backward) {
    static_assert(has_backward_call_v<E, T, B>,
                  "moecomm: the layer's backward needs callable experts with the overload void operator()(std::int32_t "
                  "l, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in), T being the layer's "
                  "element type, optionally with a last argument Backend const& be (or parametric experts, see "
                  "patterns/experts.hpp)");
    return has_backward_call_v<E, T, B>;
  } else {
    static_assert(has_forward_call_v<E, T, B>,
                  "moecomm: experts must be callable as void operator()(std::int32_t l, matrix_view<T const> in, "
                  "matrix_view<T> out), T being the layer's element type, optionally with a last argument Backend "
                  "const& be, or parametric (see patterns/experts.hpp)");
    return has_forward_call_v<E, T, B>;
  }
}

template <class E>
using flops_member = decltype(std::declval<E const&>().flops(std::int64_t{0}));

//! Charges `be`'s device with `passes` forwards of `rows` rows (1 forward, 2 backward), if the
//! experts declare `flops` (see the file comment).
template <class Backend, class Experts>
void charge_expert_flops(Backend const& be, Experts const& experts, std::int64_t rows, double passes) {
  if constexpr (has_member_v<flops_member, Experts>)
    charge_flops(be, passes * static_cast<double>(experts.flops(rows)), static_cast<double>(rows));
}

//! Any expert's forward on parameters `params`, on back-end `be` if the experts take it.
template <class T, class Experts, class P, class Backend>
void expert_forward(Experts& experts, P const* params, matrix_view<T const> in, matrix_view<T> out, Backend const& be) {
  if constexpr (has_member_v<forward_member_on, Experts, T, parameter_t<Experts>, Backend>) experts.forward(params, in, out, be);
  else experts.forward(params, in, out);
}

//! Any expert's backward on parameters `params`, adding to `d_params`, on `be` if the experts take it.
template <class T, class Experts, class P, class Backend>
void expert_backward(Experts& experts, P const* params, matrix_view<T const> in, matrix_view<T const> d_out,
                     matrix_view<T> d_in, P* d_params, Backend const& be) {
  if constexpr (has_member_v<backward_member_on, Experts, T, parameter_t<Experts>, Backend>)
    experts.backward(params, in, d_out, d_in, d_params, be);
  else experts.backward(params, in, d_out, d_in, d_params);
}

//! Runs local expert `l` on its rows, on `be`.
template <class T, class Experts, class Backend>
void run_local_expert(Experts& experts, std::int32_t l, matrix_view<T const> in, matrix_view<T> out, Backend const& be) {
  if constexpr (is_parametric_experts_v<Experts>) expert_forward(experts, experts.parameters(l), in, out, be);
  else if constexpr (has_member_v<forward_call_on, Experts, T, Backend>) experts(l, in, out, be);
  else experts(l, in, out);
}

//! Runs local expert `l`'s backward on `be` (parametric experts add to their own gradient accumulator).
template <class T, class Experts, class Backend>
void run_local_expert_backward(Experts& experts, std::int32_t l, matrix_view<T const> in, matrix_view<T const> d_out,
                               matrix_view<T> d_in, Backend const& be) {
  if constexpr (is_parametric_experts_v<Experts>) expert_backward(experts, experts.parameters(l), in, d_out, d_in, experts.gradients(l), be);
  else if constexpr (has_member_v<backward_call_on, Experts, T, Backend>) experts(l, in, d_out, d_in, be);
  else experts(l, in, d_out, d_in);
}

//! The rows `[begin, end)` of `v`.
template <class T>
[[nodiscard]] matrix_view<T> row_block(matrix_view<T> v, std::int64_t begin, std::int64_t end) {
  return {v.data + begin * v.hidden, end - begin, v.hidden};
}

//! `offsets` (L + 1 host values) made relative to the first, in `relative` (kept by the caller, so
//! that a steady state allocates nothing).
inline array_view<std::int64_t const> relative_offsets(array_view<std::int64_t const> offsets, std::vector<std::int64_t>& relative) {
  relative.resize(static_cast<std::size_t>(offsets.size));
  for (std::int64_t l = 0; l < offsets.size; ++l) relative[static_cast<std::size_t>(l)] = offsets.data[l] - offsets.data[0];
  return {relative.data(), offsets.size};
}

//! Local experts 0 .. L−1 on rows `[offsets[l], offsets[l + 1])` of `in` -> `out` (L + 1 host
//! offsets), on `be`: one grouped call on exactly the block's rows if the experts have the grouped
//! form (offsets made relative to the block in `scratch`), else one call per expert with rows; each
//! expert's FLOPs charged to `be`.
template <class T, class Experts, class Backend>
void run_local_experts(Experts& experts, array_view<std::int64_t const> offsets, matrix_view<T const> in, matrix_view<T> out,
                       Backend const& be, std::vector<std::int64_t>& scratch) {
  std::int64_t const first = offsets.data[0], last = offsets.data[offsets.size - 1];
  if constexpr (has_member_v<forward_grouped_member, Experts, T, Backend>)
    experts.forward_grouped(grouped_rows<T>{row_block(in, first, last), row_block(out, first, last), relative_offsets(offsets, scratch)}, be);
  for (std::int32_t l = 0; l + 1 < offsets.size; ++l) {
    std::int64_t const begin = offsets.data[l], end = offsets.data[l + 1];
    if (begin == end) continue;
    if constexpr (!has_member_v<forward_grouped_member, Experts, T, Backend>)
      run_local_expert<T>(experts, l, row_block(in, begin, end), row_block(out, begin, end), be);
    charge_expert_flops(be, experts, end - begin, 1);
  }
}

//! The backward of `run_local_experts`.
template <class T, class Experts, class Backend>
void run_local_experts_backward(Experts& experts, array_view<std::int64_t const> offsets, matrix_view<T const> in,
                                matrix_view<T const> d_out, matrix_view<T> d_in, Backend const& be,
                                std::vector<std::int64_t>& scratch) {
  std::int64_t const first = offsets.data[0], last = offsets.data[offsets.size - 1];
  if constexpr (has_member_v<backward_grouped_member, Experts, T, Backend>)
    experts.backward_grouped(grouped_gradient_rows<T>{row_block(in, first, last), row_block(d_out, first, last),
                                                      row_block(d_in, first, last), relative_offsets(offsets, scratch)},
                             be);
  for (std::int32_t l = 0; l + 1 < offsets.size; ++l) {
    std::int64_t const begin = offsets.data[l], end = offsets.data[l + 1];
    if (begin == end) continue;
    if constexpr (!has_member_v<backward_grouped_member, Experts, T, Backend>)
      run_local_expert_backward<T>(experts, l, row_block(in, begin, end), row_block(d_out, begin, end), row_block(d_in, begin, end), be);
    charge_expert_flops(be, experts, end - begin, 2);
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
