// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `buffer`: a move-only array of trivially copyable elements in a back-end's memory.

#include <moecomm/config.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! Owns `size()` elements allocated by `Allocator` (host memory for `host_backend`, stream-ordered
//! device memory for `cuda_backend`). The elements start uninitialised.
//! @tparam Allocator has `void* allocate(std::size_t bytes)` and `void deallocate(void*, std::size_t)`.
template <class T, class Allocator>
class buffer {
  static_assert(std::is_trivially_copyable_v<T>, "moecomm::buffer holds trivially copyable elements only");

 public:
  buffer() = default;
  buffer(Allocator allocator, std::int64_t size) : allocator_(std::move(allocator)), size_(size) {
    if (size_ > 0) data_ = static_cast<T*>(allocator_.allocate(bytes()));
  }
  buffer(buffer&& other) noexcept
      : allocator_(std::move(other.allocator_)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      release();
      allocator_ = std::move(other.allocator_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  buffer(buffer const&) = delete;
  buffer& operator=(buffer const&) = delete;
  ~buffer() { release(); }

  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] T const* data() const noexcept { return data_; }
  [[nodiscard]] std::int64_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return static_cast<std::size_t>(size_) * sizeof(T); }

 private:
  // GCC bug 80635 (https://gcc.gnu.org/bugzilla/show_bug.cgi?id=80635): destroying a disengaged
  // std::optional<buffer> (the dispatcher keeps one) can warn that data_ "may be used uninitialized"
  // here, as g++ 12.2 does under -fsanitize=address; data_ is always initialised.
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
  void release() noexcept {
    if (data_ != nullptr) allocator_.deallocate(data_, bytes());
    data_ = nullptr;
  }
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic pop
#endif

  Allocator allocator_{};
  T* data_ = nullptr;
  std::int64_t size_ = 0;
};

//! Grow-only reuse: `b` itself when it holds at least `n` elements, else `b` replaced by a new
//! allocation from the back-end `be` (contents not kept) of `n` elements the first time, and of at
//! least 1.5 times the old size after that. Buffers kept from step to step this way allocate, and
//! page-fault, nothing in a steady state; when the sizes drift from step to step (a trainer's
//! batches), the geometric growth makes the allocations stop after a few steps instead of recurring
//! at every new maximum (each is a `cudaMallocAsync` on a GPU, and rules out graph capture).
template <class Backend, class T, class Allocator>
buffer<T, Allocator>& grow(Backend const& be, buffer<T, Allocator>& b, std::int64_t n) {
  if (b.size() >= n) return b;
  std::int64_t const geometric = b.size() > 0 ? b.size() + b.size() / 2 : 0;
  b = be.template allocate<T>(n > geometric ? n : geometric);
  return b;
}

MOECOMM_NAMESPACE_END
