// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `content_digest`: a 64-bit digest of a buffer's bits, the same on every back-end (an order-free
//! sum of per-element hashes, so a parallel reduction gets the same value). Ranks that must hold
//! identical inputs (Parm's model-parallel group) compare digests with one small all-gather instead
//! of the inputs themselves.

#include <moecomm/config.hpp>
#include <moecomm/core/functional.hpp>

#include <cstdint>
#include <cstring>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Element `i`'s bits, mixed with `i` (splitmix64's finaliser): moving a value changes the digest.
template <class T>
struct element_hash {
  T const* data;
  MOECOMM_HOST_DEVICE std::uint64_t operator()(std::int64_t i) const {
    static_assert(sizeof(T) <= sizeof(std::uint64_t), "moecomm::content_digest: elements of at most 8 bytes");
    std::uint64_t bits = 0;
    memcpy(&bits, data + i, sizeof(T));
    std::uint64_t z = bits + 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

//! The digest of `data[0, n)` (`n` elements in `be`'s memory): equal buffers give equal digests on
//! every back-end; different ones differ but for a 2^-64 chance.
template <class Backend, class T>
[[nodiscard]] std::uint64_t content_digest(Backend const& be, T const* data, std::int64_t n) {
  return be.reduce(n, std::uint64_t{0}, element_hash<T>{data}, plus{});
}

}  // namespace detail
MOECOMM_NAMESPACE_END
