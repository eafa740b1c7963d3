// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `read_back`: values of a back-end's memory copied into host memory for the host to read, with
//! one host wait. A back-end with a `read_back` member (the CUDA back-end: through pinned memory
//! of its own, so that the copy is asynchronous and the wait is the only one) does it; any other
//! copies and synchronizes.

#include <moecomm/config.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Backend, class T, class = void>
struct has_read_back : std::false_type {};
template <class Backend, class T>
struct has_read_back<Backend, T,
                     std::void_t<decltype(std::declval<Backend const&>().read_back(std::declval<T*>(), std::declval<T const*>(),
                                                                                   std::int64_t{}))>> : std::true_type {};

//! `host[0, n)` = `src[0, n)` (the back-end's memory), everything earlier on the back-end done.
template <class Backend, class T>
void read_back(Backend const& be, T* host, T const* src, std::int64_t n) {
  if constexpr (has_read_back<Backend, T>::value) {
    be.read_back(host, src, n);
  } else {
    be.copy(host, src, n);
    be.synchronize();
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
