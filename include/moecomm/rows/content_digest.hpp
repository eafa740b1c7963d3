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

//! The bits of `p[at]`, mixed with the element's position `i` (splitmix64's finaliser): moving a
//! value changes the digest.
template <class T>
MOECOMM_HOST_DEVICE std::uint64_t hashed_element(T const* p, std::int64_t at, std::int64_t i) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "moecomm::content_digest: elements of at most 8 bytes");
  std::uint64_t bits = 0;
  memcpy(&bits, p + at, sizeof(T));
  std::uint64_t z = bits + 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! Buffers `a`, `b`, `c` one after the other in one index space, so that one reduction digests
//! all three (on a GPU, one host wait instead of three).
template <class A, class B, class C>
struct three_buffer_hash {
  A const* a;
  std::int64_t na;
  B const* b;
  std::int64_t nb;
  C const* c;
  MOECOMM_HOST_DEVICE std::uint64_t operator()(std::int64_t i) const {
    if (i < na) return hashed_element(a, i, i);
    if (i < na + nb) return hashed_element(b, i - na, i);
    return hashed_element(c, i - na - nb, i);
  }
};

//! The digest of `a[0, na)`, `b[0, nb)` and `c[0, nc)` (in `be`'s memory) taken together: equal
//! buffers give equal digests on every back-end; different ones differ but for a 2^-64 chance.
template <class Backend, class A, class B, class C>
[[nodiscard]] std::uint64_t content_digest(Backend const& be, A const* a, std::int64_t na, B const* b, std::int64_t nb, C const* c,
                                           std::int64_t nc) {
  return be.reduce(na + nb + nc, std::uint64_t{0}, three_buffer_hash<A, B, C>{a, na, b, nb, c}, plus{});
}

//! The digest of one buffer, `data[0, n)`.
template <class Backend, class T>
[[nodiscard]] std::uint64_t content_digest(Backend const& be, T const* data, std::int64_t n) {
  return content_digest(be, data, n, data, 0, data, 0);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
