// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! How a small real problem stands for a large one under simulation (`simulation_scale`), and the
//! hooks through which a simulated back-end prices work it cannot see in its own calls; for every
//! other back-end they do nothing.
//! - `detail::payload_scope(be, kind)` marks the code that moves token rows or expert parameters,
//!   whose sizes grow with the model's dimensions: a simulated back-end lets a small real model
//!   stand for a large one by scaling what is moved inside such a scope (`simulation_scale`,
//!   `<moecomm/backend/simulated.hpp>`).
//! - `detail::charge_flops(be, flops, rows)`: compute done outside the back-end (the caller's experts), in GEMMs of `rows` rows.
//! - `detail::simulated_scale(be)`: the scale, for planners whose cost models must price the
//!   model-sized layer the simulation stands for (all 1 on other back-ends).

#include <moecomm/config.hpp>

#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! How a small real problem stands for a large one under simulation (`simulated_backend`).
//! For MLP experts, `mlp_simulation_scale` (`<moecomm/core/mlp_simulation_scale.hpp>`) computes it.
struct simulation_scale {
  double payload = 1;     //!< simulated bytes per real byte of token rows (H_model / H, times the element sizes' ratio)
  double parameters = 1;  //!< simulated bytes per real byte of expert parameters (a model expert's bytes over a real one's)
  double flops = 1;       //!< simulated FLOPs per FLOP the experts declare ((H_model · F_model) / (H · F) for MLPs)
};

namespace detail {

//! What a payload scope moves: token rows (scale with the hidden size), expert parameters (with
//! the hidden and the expert's inner size), or control words (sizes, counts: never scaled, for
//! the agreement a collective runs inside an outer scope).
enum class payload_kind { rows, parameters, control };

template <class Backend, class = void>
struct scales_payload : std::false_type {};
template <class Backend>
struct scales_payload<Backend, std::void_t<decltype(std::declval<Backend const&>().payload_scope(payload_kind::rows))>>
    : std::true_type {};

template <class Backend, class = void>
struct charges_flops : std::false_type {};
template <class Backend>
struct charges_flops<Backend, std::void_t<decltype(std::declval<Backend const&>().charge_flops(1.0, 1.0))>> : std::true_type {};

template <class Backend, class = void>
struct has_simulated_scale : std::false_type {};
template <class Backend>
struct has_simulated_scale<Backend, std::void_t<decltype(std::declval<Backend const&>().simulated_scale())>> : std::true_type {};

struct no_payload_scope {};

//! Hold the result while rows or parameters move: `auto const scope = payload_scope(be, payload_kind::rows);`.
template <class Backend>
[[nodiscard]] auto payload_scope(Backend const& be, payload_kind kind) {
  if constexpr (scales_payload<Backend>::value) {
    return be.payload_scope(kind);
  } else {
    (void)be;
    (void)kind;
    return no_payload_scope{};
  }
}

//! `flops` of the caller's compute on `be`'s device, in GEMMs of `rows` rows.
template <class Backend>
void charge_flops(Backend const& be, double flops, double rows) {
  if constexpr (charges_flops<Backend>::value) be.charge_flops(flops, rows);
}

//! `be`'s simulation scale: what a planner multiplies its model's times by.
template <class Backend>
[[nodiscard]] simulation_scale simulated_scale(Backend const& be) {
  if constexpr (has_simulated_scale<Backend>::value) {
    return be.simulated_scale();
  } else {
    (void)be;
    return {};
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
