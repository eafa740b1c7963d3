// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `fragment`: N consecutive elements loaded or stored as one aligned access. With 16 bytes the
//! device emits `ld.global.v4` / `st.global.v4`; on the host the copy vectorises.

#include <moecomm/config.hpp>

#include <cstdint>
#include <cstring>

#if !MOECOMM_DEVICE_PASS() && defined(__SSE2__)
#  include <emmintrin.h>
#endif

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The widest access moecomm issues.
inline constexpr int max_access_bytes = 16;

//! `N` elements of `T`, aligned to their total size.
template <class T, int N>
struct alignas(N * sizeof(T)) fragment {
  T v[N];
};

//! Reads `N` elements at `p` (which must be aligned to `N * sizeof(T)`).
template <class T, int N>
MOECOMM_HOST_DEVICE inline fragment<T, N> load_fragment(T const* p) {
  fragment<T, N> f;
#if MOECOMM_DEVICE_PASS()
  if constexpr (sizeof(f) == 16) {
    uint4 const w = *reinterpret_cast<uint4 const*>(p);
    memcpy(static_cast<void*>(&f), &w, sizeof(f));
    return f;
  }
#endif
  memcpy(static_cast<void*>(&f), p, sizeof(f));
  return f;
}

//! Writes `N` elements at `p` (which must be aligned to `N * sizeof(T)`).
template <class T, int N>
MOECOMM_HOST_DEVICE inline void store_fragment(T* p, fragment<T, N> const& f) {
#if MOECOMM_DEVICE_PASS()
  if constexpr (sizeof(f) == 16) {
    uint4 w;
    memcpy(&w, &f, sizeof(f));
    // The intrinsic keeps it one 16-byte store (st.global.wb.v4): a plain assignment of a fragment
    // held across a loop (the scatter kernels) was split into four 4-byte stores.
    __stwb(reinterpret_cast<uint4*>(p), w);
    return;
  }
#endif
  memcpy(static_cast<void*>(p), &f, sizeof(f));
}

//! Host only: `store_fragment` with a non-temporal store (16-byte fragments, SSE2), which writes a
//! whole cache line without first reading it (no read-for-ownership). Falls back to
//! `store_fragment`. Callers fence with `streaming_store_fence()` before the data is shared.
template <class T, int N>
inline void store_fragment_streaming(T* p, fragment<T, N> const& f) {
#if !MOECOMM_DEVICE_PASS() && defined(__SSE2__)
  if constexpr (sizeof(f) == 16) {
    __m128i w;
    memcpy(&w, &f, sizeof(f));
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), w);
    return;
  }
#endif
  store_fragment(p, f);
}

//! Host only: `store_fragment_streaming` when `Streaming`, else `store_fragment` (the host row
//! kernels' two paths).
template <bool Streaming, class T, int N>
inline void store_fragment_host(T* p, fragment<T, N> const& f) {
  if constexpr (Streaming) store_fragment_streaming(p, f);
  else store_fragment(p, f);
}

//! Host only: orders this thread's earlier non-temporal stores before its later stores.
inline void streaming_store_fence() {
#if !MOECOMM_DEVICE_PASS() && defined(__SSE2__)
  _mm_sfence();
#endif
}

//! True when `p` is aligned to `bytes`.
inline bool is_aligned(void const* p, std::int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

}  // namespace detail
MOECOMM_NAMESPACE_END
