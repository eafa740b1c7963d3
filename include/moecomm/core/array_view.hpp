// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `array_view`: a non-owning, sized, contiguous 1-D buffer: how every public call takes a vector
//! of values (routing-weight gradients, counts, parameters, gradients), so that it can check the
//! buffer's size before it writes.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! `size` elements of `T` at `data`, in host or device memory (the back-end that reads it decides).
//! @tparam T element type; `T const` for an input.
template <class T>
struct array_view {
  T* data = nullptr;       //!< first element
  std::int64_t size = 0;   //!< elements the memory holds

  array_view() = default;
  MOECOMM_HOST_DEVICE array_view(T* data_, std::int64_t size_) : data(data_), size(size_) {}
  //! A writable view converts to a read-only one.
  template <class U, class = std::enable_if_t<std::is_same_v<U const, T> && !std::is_same_v<U, T>>>
  MOECOMM_HOST_DEVICE array_view(array_view<U> const& other) : data(other.data), size(other.size) {}
  //! Any contiguous host container with `data()` and `size()` (`std::vector`, `std::array`).
  template <class Container,
            class = std::enable_if_t<std::is_convertible_v<decltype(std::declval<Container&>().data()), T*> &&
                                     !std::is_same_v<std::remove_cv_t<Container>, array_view>>>
  array_view(Container& c) : data(c.data()), size(static_cast<std::int64_t>(c.size())) {}  // NOLINT: implicit on purpose
};

//! Builds a view; `T` is deduced from the pointer.
template <class T>
[[nodiscard]] array_view<T> make_array_view(T* data, std::int64_t size) {
  return {data, size};
}

namespace detail {

//! `v` must hold at least `n` elements (and memory behind them).
template <class T>
void check_elements(array_view<T> const& v, std::int64_t n, char const* op, char const* name, char const* why) {
  require(v.size >= n, op, "argument '", name, "' has ", v.size, " elements; needs at least ", n, " (", why, ")");
  require(n == 0 || v.data != nullptr, op, "argument '", name, "' is null but must hold ", n, " elements");
}

}  // namespace detail

MOECOMM_NAMESPACE_END
