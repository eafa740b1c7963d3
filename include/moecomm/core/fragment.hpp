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
#if !MOECOMM_DEVICE_PASS() && (defined(__AVX__) || defined(__AVX512F__))
#  include <immintrin.h>
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

//! Host only: copies `bytes` (a multiple of 16; both pointers 16-byte aligned) from `src` to `dst`
//! with non-temporal stores, each cache line of `dst` written by the widest store the target has
//! (one 64-byte store with AVX-512). Measured on one core, rows copied with 16-byte streaming
//! stores reach about 0.8 of those written a line at a time, which is what memcpy does. Without
//! SSE2, a plain copy. Callers fence with `streaming_store_fence()`.
inline void stream_bytes(void* dst, void const* src, std::int64_t bytes) {
#if !MOECOMM_DEVICE_PASS() && defined(__SSE2__)
  auto* out = static_cast<char*>(dst);
  auto const* in = static_cast<char const*>(src);
  char* const end = out + bytes;
  auto const mid_line = [](char const* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 != 0; };
  for (; out < end && mid_line(out); out += 16, in += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), _mm_loadu_si128(reinterpret_cast<__m128i const*>(in)));
  for (; end - out >= 64; out += 64, in += 64) {
#  if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out), _mm512_loadu_si512(in));
#  elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(in)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(in + 32)));
#  else
    for (int i = 0; i < 64; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), _mm_loadu_si128(reinterpret_cast<__m128i const*>(in + i)));
#  endif
  }
  for (; out < end; out += 16, in += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), _mm_loadu_si128(reinterpret_cast<__m128i const*>(in)));
#else
  memcpy(dst, src, static_cast<std::size_t>(bytes));
#endif
}

//! Host only: `stream_bytes` of a fixed `Bytes` (a multiple of 64) into a 64-byte aligned `dst`: whole
//! lines, no alignment checks, so that a kernel's values can go from registers to memory directly.
template <int Bytes>
inline void stream_lines(void* dst, void const* src) {
  static_assert(Bytes % 64 == 0, "stream_lines: whole cache lines only");
#if !MOECOMM_DEVICE_PASS() && defined(__SSE2__)
  auto* out = static_cast<char*>(dst);
  auto const* in = static_cast<char const*>(src);
  for (int b = 0; b < Bytes; b += 64) {
#  if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out + b), _mm512_loadu_si512(in + b));
#  elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + b), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(in + b)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + b + 32), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(in + b + 32)));
#  else
    for (int i = 0; i < 64; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + b + i), _mm_loadu_si128(reinterpret_cast<__m128i const*>(in + b + i)));
#  endif
  }
#else
  memcpy(dst, src, static_cast<std::size_t>(Bytes));
#endif
}

//! Host only: asks for the cache line at `p` ahead of its use (a hint; `p` need not be valid).
inline void prefetch_line(void const* p) {
#if !MOECOMM_DEVICE_PASS() && (defined(__GNUC__) || defined(__clang__))
  __builtin_prefetch(p);
#else
  (void)p;
#endif
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
