// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Integer atomics that kernel functors use on host and device alike. Integer sums are exact, so
//! counts built with them are deterministic whatever the order of the updates.

#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `*p += v`, atomically (relaxed on the host: only the final value matters).
MOECOMM_HOST_DEVICE inline void atomic_add(std::int32_t* p, std::int32_t v) {
#if MOECOMM_DEVICE_PASS()
  atomicAdd(p, v);
#else
  __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

}  // namespace detail
MOECOMM_NAMESPACE_END
