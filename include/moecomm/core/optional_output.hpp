// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `optional_output`: an output the caller may decline, explicitly, with `moecomm::not_needed`
//! (e.g. the input gradient of a first layer, or the routing-weight gradient of a fixed router).
//! An empty view is never taken to mean "not needed": it is checked like any other output.

#include <moecomm/config.hpp>

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
  optional_output(not_needed_t) : view_(), wanted_(false) {}   // NOLINT: implicit on purpose

  [[nodiscard]] bool wanted() const { return wanted_; }
  //! The view (an empty one when not wanted).
  [[nodiscard]] View const& view() const { return view_; }

 private:
  View view_;
  bool wanted_;
};

MOECOMM_NAMESPACE_END
