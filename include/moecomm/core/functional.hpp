// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Small host/device function objects for back-end index spaces and reductions.

#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Maps index `i` to itself where `predicate(i)` holds, else to `none`; a `minimum` reduction
//! then finds the first such index.
template <class Predicate>
struct first_index_where {
  Predicate predicate;
  std::int64_t none;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t i) const { return predicate(i) ? i : none; }
};

struct minimum {
  template <class T>
  MOECOMM_HOST_DEVICE T operator()(T a, T b) const { return b < a ? b : a; }
};

struct maximum {
  template <class T>
  MOECOMM_HOST_DEVICE T operator()(T a, T b) const { return b > a ? b : a; }
};

struct plus {
  template <class T>
  MOECOMM_HOST_DEVICE T operator()(T a, T b) const { return a + b; }
};

//! `data[i] = value`.
template <class T>
struct fill_value {
  T* data;
  T value;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const { data[i] = value; }
};

//! `to[i] += from[i]` (e.g. summed gradient shares into the experts' own).
template <class T>
struct add_into {
  T const* from;
  T* to;
  [[nodiscard]] std::int64_t bytes_per_index() const { return 3 * std::int64_t{sizeof(T)}; }  // two read, one written
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const { to[i] = to[i] + from[i]; }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
