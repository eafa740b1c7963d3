// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! How an error thrown in a backward reaches the caller of `loss.backward()`. torch's autograd
//! engine runs backwards on threads of its own and hands every C++ exception to the caller as a
//! `c10::Error` (a `RuntimeError` in Python), except a Python error, which it carries unchanged.
//! `backward_error_handler` lets a Python module raise its own type there: moecomm's raises
//! `moecomm.Error`, as for the forward's errors, so that `except moecomm.Error` catches both on
//! every rank. Left null (C++), the `moecomm::error` leaves the backward as it is.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

//! Called with a backward's `moecomm::error` before it leaves for the engine; it may throw instead.
inline void (*backward_error_handler)(error const&) = nullptr;

namespace detail {

//! `body()`, its `moecomm::error` passed to `backward_error_handler` first.
template <class F>
decltype(auto) translating_errors(F&& body) {
  try {
    return body();
  } catch (error const& e) {
    if (backward_error_handler != nullptr) backward_error_handler(e);
    throw;
  }
}

}  // namespace detail
}  // namespace libtorch
MOECOMM_NAMESPACE_END
