// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Element types a token row may hold, and their conversions to and from fp32.
//!
//! `float` always; `__half` and `__nv_bfloat16` from CUDA's own headers, which compile with g++
//! too, so the host back-end runs the same conversions as the device.

#include <moecomm/config.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if MOECOMM_HAS_CUDA_FP16()
#  include <cuda_bf16.h>
#  include <cuda_fp16.h>
#endif

MOECOMM_NAMESPACE_BEGIN

//! Traits of an element type: its name and exact conversions through fp32. Specialised for every
//! supported type; using another type is a compile error.
template <class T>
struct dtype_traits {
  static_assert(sizeof(T) == 0, "moecomm::dtype_traits: unsupported element type (float, __half, __nv_bfloat16)");
};

template <>
struct dtype_traits<float> {
  static constexpr char const* name = "float";
  MOECOMM_HOST_DEVICE static float to_float(float v) { return v; }
  MOECOMM_HOST_DEVICE static float from_float(float v) { return v; }
};

#if MOECOMM_HAS_CUDA_FP16()
template <>
struct dtype_traits<__half> {
  static constexpr char const* name = "half";
  MOECOMM_HOST_DEVICE static float to_float(__half v) { return __half2float(v); }
  MOECOMM_HOST_DEVICE static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct dtype_traits<__nv_bfloat16> {
  static constexpr char const* name = "bf16";
#if MOECOMM_DEVICE_PASS()
  MOECOMM_HOST_DEVICE static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  MOECOMM_HOST_DEVICE static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
#else
  // The host computes the bits of CUDA's host __bfloat162float / __float2bfloat16_rn (checked for
  // all 2^32 floats) without branches, so that loops over elements vectorise; CUDA's own host
  // fallback is a compare-and-branch per element that g++ leaves scalar.
  MOECOMM_HOST_DEVICE static float to_float(__nv_bfloat16 v) {
    std::uint16_t h;
    std::memcpy(&h, &v, sizeof h);
    std::uint32_t const u = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  MOECOMM_HOST_DEVICE static __nv_bfloat16 from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    std::uint32_t const rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // to nearest, ties to even
    bool const nan = (u & 0x7fffffffu) > 0x7f800000u;
    std::uint16_t const h = static_cast<std::uint16_t>(nan ? 0x7fffu : rounded);
    __nv_bfloat16 v;
    std::memcpy(static_cast<void*>(&v), &h, sizeof v);
    return v;
  }
#endif
};
#endif

//! True for the element types moecomm moves and reduces.
template <class T>
inline constexpr bool is_supported_dtype_v = std::is_same_v<std::remove_cv_t<T>, float>
#if MOECOMM_HAS_CUDA_FP16()
                                             || std::is_same_v<std::remove_cv_t<T>, __half> ||
                                             std::is_same_v<std::remove_cv_t<T>, __nv_bfloat16>
#endif
    ;

namespace detail {

//! `a * b + c` with one rounding, on host and device alike. The explicit fused multiply-add is
//! what makes host and device results bit-identical (nvcc contracts `a*b+c`, g++ in ISO mode
//! does not).
MOECOMM_HOST_DEVICE inline float fma32(float a, float b, float c) {
#if MOECOMM_DEVICE_PASS()
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

//! `a * b` rounded once to fp32; never contracted with a later add.
MOECOMM_HOST_DEVICE inline float mul32(float a, float b) {
#if MOECOMM_DEVICE_PASS()
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

//! `a + b` rounded once to fp32; never contracted with an earlier multiply.
MOECOMM_HOST_DEVICE inline float add32(float a, float b) {
#if MOECOMM_DEVICE_PASS()
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

//! `a / b` rounded once to fp32 (nvcc's fast-math division is not).
MOECOMM_HOST_DEVICE inline float div32(float a, float b) {
#if MOECOMM_DEVICE_PASS()
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace detail

MOECOMM_NAMESPACE_END
