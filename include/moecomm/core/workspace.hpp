// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `workspace`: scratch memory a call keeps between calls, so that a steady state allocates
//! nothing (CUB's temporary storage, owned by the caller instead of sized by a first call).

#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! Grow-only scratch in a back-end's memory. A call that takes a `workspace&` takes what it needs
//! from it and leaves it larger or unchanged, never smaller. One per thread of calls: not shared
//! between calls that run at the same time.
template <class Backend>
class workspace {
 public:
  //! At least `n` elements of `T` of the back-end's memory (aligned for any element type); the
  //! contents are not kept from the last call.
  template <class T = char>
  [[nodiscard]] T* get(Backend const& be, std::int64_t n) {
    return reinterpret_cast<T*>(grow(be, bytes_, n * static_cast<std::int64_t>(sizeof(T))).data());
  }

 private:
  typename Backend::template buffer_type<char> bytes_;
};

MOECOMM_NAMESPACE_END
