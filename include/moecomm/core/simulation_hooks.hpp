// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The two hooks through which a simulated back-end prices work it cannot see in its own calls;
//! for every other back-end both do nothing.
//! - `detail::payload_scope(be)` marks the code that moves rows or parameters, whose size grows with
//!   the hidden size: a simulated back-end lets a small real hidden size stand for a large one by
//!   scaling what is moved inside such a scope (`<moecomm/simulation/device_time.hpp>`).
//! - `detail::charge_flops(be, flops)`: compute done outside the back-end (the caller's experts).

#include <moecomm/config.hpp>

#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Backend, class = void>
struct scales_payload : std::false_type {};
template <class Backend>
struct scales_payload<Backend, std::void_t<decltype(std::declval<Backend const&>().payload_scope())>> : std::true_type {};

template <class Backend, class = void>
struct charges_flops : std::false_type {};
template <class Backend>
struct charges_flops<Backend, std::void_t<decltype(std::declval<Backend const&>().charge_flops(1.0))>> : std::true_type {};

struct no_payload_scope {};

//! Hold the result for as long as rows or parameters move: `auto const scope = payload_scope(be);`.
template <class Backend>
[[nodiscard]] auto payload_scope(Backend const& be) {
  if constexpr (scales_payload<Backend>::value) {
    return be.payload_scope();
  } else {
    (void)be;
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
