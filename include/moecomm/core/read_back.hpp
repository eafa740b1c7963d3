// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `read_back`: values of a back-end's memory copied into host memory for the host to read, with
//! one host wait. A back-end with a `read_back` member (the CUDA back-end: through pinned memory
//! of its own, so that the copy is asynchronous and the wait is the only one) does it; any other
//! copies and synchronizes. While a back-end's stream captures a CUDA graph (`capturing`), no
//! read back is possible: the captured work has not run.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

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

template <class Backend, class = void>
struct has_capturing : std::false_type {};
template <class Backend>
struct has_capturing<Backend, std::void_t<decltype(std::declval<Backend const&>().capturing())>> : std::true_type {};

//! Whether `be`'s stream is capturing a CUDA graph (a back-end with a `capturing` member, the CUDA
//! one, says; the others never capture).
template <class Backend>
[[nodiscard]] bool capturing(Backend const& be) {
  if constexpr (has_capturing<Backend>::value) return be.capturing();
  else return false;
}

//! `host[0, n)` = `src[0, n)` (the back-end's memory), everything earlier on the back-end done.
//! @throws error (invalid_usage) while the back-end's stream captures a CUDA graph.
template <class Backend, class T>
void read_back(Backend const& be, T* host, T const* src, std::int64_t n) {
  if (capturing(be))
    fail(status::invalid_usage, "read_back", "the host would read device memory while the back-end's stream captures a CUDA graph, "
         "whose work has not run: this step is not capturable (the layers say why before they capture anything)");
  if constexpr (has_read_back<Backend, T>::value) {
    be.read_back(host, src, n);
  } else {
    be.copy(host, src, n);
    be.synchronize();
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
