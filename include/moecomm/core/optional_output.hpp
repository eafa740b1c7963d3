// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `optional_output`: an output the caller may decline, explicitly, with `moecomm::not_needed`
//! (e.g. the input gradient of a first layer, or the routing-weight gradient of a fixed router).
//! An empty view is never taken to mean "not needed": it is checked like any other output.

#include <moecomm/config.hpp>

#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! The type of `not_needed`.
struct not_needed_t {
  explicit constexpr not_needed_t(int) {}
};
//! Passed for an `optional_output` the caller does not want computed.
inline constexpr not_needed_t not_needed{0};

//! A view to write into, or `not_needed`. Converts implicitly from either.
template <class View>
class optional_output {
 public:
  optional_output(View view) : view_(view), wanted_(true) {}  // NOLINT: implicit on purpose
  //! Anything the view converts from (e.g. a `std::vector` for an `array_view`).
  template <class Source, class = std::enable_if_t<std::is_convertible_v<Source&&, View> &&
                                                   !std::is_same_v<std::decay_t<Source>, View> &&
                                                   !std::is_same_v<std::decay_t<Source>, not_needed_t> &&
                                                   !std::is_same_v<std::decay_t<Source>, optional_output>>>
  optional_output(Source&& source) : view_(std::forward<Source>(source)), wanted_(true) {}  // NOLINT: implicit on purpose
  //! The view's own fields, so `{data, rows, hidden}` works as it does for the view.
  template <class First, class Second, class... Rest,
            class = std::enable_if_t<std::is_constructible_v<View, First&&, Second&&, Rest&&...>>>
  optional_output(First&& first, Second&& second, Rest&&... rest)  // NOLINT: implicit on purpose
      : view_(std::forward<First>(first), std::forward<Second>(second), std::forward<Rest>(rest)...), wanted_(true) {}
  optional_output(not_needed_t) : view_(), wanted_(false) {}   // NOLINT: implicit on purpose

  [[nodiscard]] bool wanted() const { return wanted_; }
  //! The view (an empty one when not wanted).
  [[nodiscard]] View const& view() const { return view_; }

 private:
  View view_;
  bool wanted_;
};

MOECOMM_NAMESPACE_END
