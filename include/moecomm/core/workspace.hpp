// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `workspace`: scratch memory a call keeps between calls, so that a steady state allocates
//! nothing (CUB's temporary storage, owned by the caller instead of sized by a first call).

#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/messages.hpp>

#include <cstddef>
#include <cstdint>
#include <new>

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

  //! At least `n` elements of `T` of pageable host memory, for tables a call builds on the host
  //! before it copies them to the back-end (the same memory as `get` on the host back-end is not
  //! assumed). Pageable on purpose: a copy from it to a GPU has read it when the call returns, so
  //! the next call may refill it without waiting (values read back go through `detail::read_back`).
  template <class T>
  [[nodiscard]] T* host(std::int64_t n) {
    static_assert(alignof(T) <= alignof(std::max_align_t), "moecomm::workspace::host: over-aligned type");
    return reinterpret_cast<T*>(grow(staging_backend{}, host_bytes_, n * static_cast<std::int64_t>(sizeof(T))).data());
  }

  //! Message lists for a call's exchanges (emptied by the call that fills them).
  [[nodiscard]] message_lists& messages() { return messages_; }

 private:
  //! Plain host memory, aligned for any fundamental type.
  struct staging_allocator {
    void* allocate(std::size_t bytes) const { return ::operator new(bytes); }
    void deallocate(void* p, std::size_t) const noexcept { ::operator delete(p); }
  };
  //! What `grow` needs of a back-end to allocate host staging.
  struct staging_backend {
    template <class T>
    [[nodiscard]] buffer<T, staging_allocator> allocate(std::int64_t n) const { return {staging_allocator{}, n}; }
  };

  typename Backend::template buffer_type<char> bytes_;
  buffer<char, staging_allocator> host_bytes_;
  message_lists messages_;
};

MOECOMM_NAMESPACE_END
