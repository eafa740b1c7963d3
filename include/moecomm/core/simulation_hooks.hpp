// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The two hooks through which a simulated back-end prices work it cannot see in its own calls;
//! for every other back-end both do nothing.
//! - `detail::payload_scope(be, kind)` marks the code that moves token rows or expert parameters,
//!   whose sizes grow with the model's dimensions: a simulated back-end lets a small real model
//!   stand for a large one by scaling what is moved inside such a scope (`simulation_scale`,
//!   `<moecomm/backend/simulated.hpp>`).
//! - `detail::charge_flops(be, flops)`: compute done outside the back-end (the caller's experts).

#include <moecomm/config.hpp>

#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! What a payload scope moves: token rows (scale with the hidden size) or expert parameters (with
//! the hidden and the expert's inner size).
enum class payload_kind { rows, parameters };

template <class Backend, class = void>
struct scales_payload : std::false_type {};
template <class Backend>
struct scales_payload<Backend, std::void_t<decltype(std::declval<Backend const&>().payload_scope(payload_kind::rows))>>
    : std::true_type {};

template <class Backend, class = void>
struct charges_flops : std::false_type {};
template <class Backend>
struct charges_flops<Backend, std::void_t<decltype(std::declval<Backend const&>().charge_flops(1.0))>> : std::true_type {};

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

//! `flops` of the caller's compute on `be`'s device.
template <class Backend>
void charge_flops(Backend const& be, double flops) {
  if constexpr (charges_flops<Backend>::value) be.charge_flops(flops);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
