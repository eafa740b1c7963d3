// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The element kernels of the expert codec (`<moecomm/collectives/expert_codec.hpp>`): the shared expert's
//! sum and mean, the sort key that orders parameters by |residual|, the gather and scatter of the
//! kept values, and the scans that find the first bad input.
//!
//! Each is a `MOECOMM_HOST_DEVICE` functor over an index, run by `for_each_index` or `reduce`:
//! a loop on the host, a grid on the GPU, the same code on both. Each kernel that `for_each_index`
//! runs declares `bytes_per_index()`, so the simulated back-end prices it.

#include <moecomm/config.hpp>
#include <moecomm/core/dtype.hpp>

#include <cstdint>
#include <cstring>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The bits of a float (`memcpy` compiles on host and device alike).
MOECOMM_HOST_DEVICE inline std::uint32_t float_bits(float x) {
  std::uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return bits;
}

//! Neither NaN nor ±Inf: the exponent is not all ones.
MOECOMM_HOST_DEVICE inline bool is_finite_float(float x) {
  constexpr std::uint32_t exponent = 0x7F800000u;
  return (float_bits(x) & exponent) != exponent;
}

// ---- shared expert -------------------------------------------------------------------------------

//! `sum[i]` = the rank's experts' parameter `i` added left to right (expert 0 first), or +0.0
//! when the rank holds no expert.
struct sum_local_experts {
  float const* experts;  //!< `[rows][n]`
  std::int64_t rows;
  std::int64_t n;
  float* sum;
  [[nodiscard]] std::int64_t bytes_per_index() const { return (rows + 1) * std::int64_t{sizeof(float)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    float acc = rows > 0 ? experts[i] : 0.0f;
    for (std::int64_t e = 1; e < rows; ++e) acc = add32(acc, experts[e * n + i]);
    sum[i] = acc;
  }
};

//! `data[i] = data[i] / count`.
struct divide_by_count {
  float* data;
  float count;
  [[nodiscard]] std::int64_t bytes_per_index() const { return 2 * std::int64_t{sizeof(float)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const { data[i] = div32(data[i], count); }
};

// ---- encode --------------------------------------------------------------------------------------

//! Key bits of `residual_order_key`: the key is below 2^31.
inline constexpr int residual_key_bits = 31;

//! `keys[i]` orders parameter `i` by descending |expert[i] - shared[i]| in an ascending sort:
//! the bits of a non-negative float grow with its value, so `0x7FFFFFFF - bits(|r|)` shrinks with
//! it (|r| may be +Inf when the difference of two finite values overflows; it still sorts first).
//! `ids[i] = i`, so a stable sort breaks ties by the smaller index.
struct residual_order_key {
  float const* expert;
  float const* shared;
  std::uint32_t* keys;
  std::int32_t* ids;
  [[nodiscard]] std::int64_t bytes_per_index() const { return 4 * std::int64_t{sizeof(float)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::uint32_t const magnitude = float_bits(expert[i] - shared[i]) & 0x7FFFFFFFu;
    keys[i] = 0x7FFFFFFFu - magnitude;
    ids[i] = static_cast<std::int32_t>(i);
  }
};

//! Key bits that hold every index of `[0, n)` (at least 1).
[[nodiscard]] inline int index_key_bits(std::int64_t n) {
  int bits = 1;
  while ((std::int64_t{1} << bits) < n) ++bits;
  return bits;
}

//! `values[j] = expert[indices[j]]`.
struct gather_kept_values {
  std::int32_t const* indices;
  float const* expert;
  float* values;
  [[nodiscard]] std::int64_t bytes_per_index() const { return 3 * std::int64_t{sizeof(float)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t j) const { values[j] = expert[indices[j]]; }
};

// ---- decode --------------------------------------------------------------------------------------

//! `params[indices[j]] = values[j]`.
struct scatter_kept_values {
  std::int32_t const* indices;
  float const* values;
  float* params;
  [[nodiscard]] std::int64_t bytes_per_index() const { return 3 * std::int64_t{sizeof(float)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t j) const { params[indices[j]] = values[j]; }
};

// ---- input scans (for `first_index_where` and a `minimum` reduction) -----------------------------

//! Index `i` where `expert[i]` or `shared[i]` is NaN or ±Inf.
struct not_finite_at {
  float const* expert;
  float const* shared;
  MOECOMM_HOST_DEVICE bool operator()(std::int64_t i) const {
    return !is_finite_float(expert[i]) || !is_finite_float(shared[i]);
  }
};

//! Position `j` whose index is outside `[0, n)` or not above the index before it.
struct bad_index_at {
  std::int32_t const* indices;
  std::int64_t n;
  MOECOMM_HOST_DEVICE bool operator()(std::int64_t j) const {
    std::int32_t const i = indices[j];
    return i < 0 || i >= n || (j > 0 && i <= indices[j - 1]);
  }
};

// ---- error bound ---------------------------------------------------------------------------------

//! |expert[i] - shared[i]| for a parameter the encoding dropped (`i` not among the ascending
//! `indices`, found by binary search), 0 for a kept one: a `maximum` reduction gives what decode
//! loses.
struct dropped_residual_magnitude {
  float const* expert;
  float const* shared;
  std::int32_t const* indices;
  std::int64_t k;
  MOECOMM_HOST_DEVICE float operator()(std::int64_t i) const {
    std::int64_t lo = 0, hi = k;  // the first position whose index is >= i
    while (lo < hi) {
      std::int64_t const mid = lo + (hi - lo) / 2;
      if (indices[mid] < i) lo = mid + 1; else hi = mid;
    }
    if (lo < k && indices[lo] == i) return 0.0f;
    float const r = expert[i] - shared[i];
    return r < 0.0f ? -r : r;
  }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
