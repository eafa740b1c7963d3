// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! moecomm's sized views of libtorch tensors, checked before anything reads or writes them: the
//! dtype, the device, the shape and the contiguity, with errors that name the tensor
//! ("moecomm::libtorch::moe_layer::forward: tensor 'x' has dtype Double; needs Float (float32)").
//! A view aliases the tensor's memory: the tensor must outlive it.
//!
//! A view is of memory on one device, `device` (the CPU unless given): the back-end that reads it
//! must run there (`torch_device<Backend>::of(be)`, torch/backend_device.hpp). Element types: float,
//! double, int32, int64, and CUDA's `__half` and `__nv_bfloat16` (torch's Half and BFloat16) where
//! their headers are.

#include <moecomm/config.hpp>

#if !MOECOMM_HAS_TORCH()
#  error "moecomm/torch/ needs libtorch: link the target moecomm::torch (moecomm built with MOECOMM_ENABLE_TORCH=ON)"
#else

#include <moecomm/core/array_view.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

namespace detail {

//! The dtype of a moecomm element type.
template <class T>
constexpr at::ScalarType dtype_of() {
  using U = std::remove_const_t<T>;
#if MOECOMM_HAS_CUDA_FP16()
  if constexpr (std::is_same_v<U, __half>) return at::kHalf;
  else if constexpr (std::is_same_v<U, __nv_bfloat16>) return at::kBFloat16;
  else
#endif
  {
    static_assert(std::is_same_v<U, float> || std::is_same_v<U, std::int32_t> || std::is_same_v<U, double> ||
                      std::is_same_v<U, std::int64_t>,
                  "moecomm::torch: views of float, double, int32, int64, __half and __nv_bfloat16 tensors");
    if constexpr (std::is_same_v<U, float>) return at::kFloat;
    else if constexpr (std::is_same_v<U, double>) return at::kDouble;
    else if constexpr (std::is_same_v<U, std::int32_t>) return at::kInt;
    else return at::kLong;
  }
}

inline char const* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "Float (float32)";
    case at::kDouble: return "Double (float64)";
    case at::kInt: return "Int (int32)";
    case at::kLong: return "Long (int64)";
    case at::kHalf: return "Half (float16)";
    case at::kBFloat16: return "BFloat16 (bfloat16)";
    default: return at::toString(t);
  }
}

//! Checks that `t` is a defined, contiguous tensor of T on `device` with `dims` dimensions.
template <class T>
void check_tensor(at::Tensor const& t, char const* name, std::int64_t dims, char const* op, c10::Device device) {
  using moecomm::detail::require;
  require(t.defined(), op, "tensor '", name, "' is undefined");
  require(t.scalar_type() == dtype_of<T>(), op, "tensor '", name, "' has dtype ", dtype_name(t.scalar_type()), "; needs ",
          dtype_name(dtype_of<T>()), " (convert it with .to(", dtype_name(dtype_of<T>()), "))");
  require(t.device() == device, op, "tensor '", name, "' is on ", t.device().str(), "; the layer runs on ", device.str(),
          " (move it with .to(\"", device.str(), "\"))");
  require(t.dim() == dims, op, "tensor '", name, "' has ", t.dim(), " dimensions ", t.sizes(), "; needs ", dims);
  require(t.is_contiguous(), op, "tensor '", name, "' is not contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
          "); call .contiguous()");
}

}  // namespace detail

//! A `[rows][hidden]` view of a 2-D contiguous tensor of T on `device`, optionally of a required
//! shape (`rows`, `hidden` < 0: any).
template <class T>
[[nodiscard]] matrix_view<T> matrix_of(at::Tensor const& t, char const* name, char const* op, std::int64_t rows = -1,
                                       std::int64_t hidden = -1, c10::Device device = c10::kCPU) {
  detail::check_tensor<T>(t, name, 2, op, device);
  moecomm::detail::require(rows < 0 || t.size(0) == rows, op, "tensor '", name, "' has ", t.size(0), " rows; needs ", rows);
  moecomm::detail::require(hidden < 0 || t.size(1) == hidden, op, "tensor '", name, "' has ", t.size(1), " columns; needs ",
                           hidden);
  return {static_cast<T*>(t.data_ptr()), t.size(0), t.size(1)};
}

//! The routing of `topk_idx` (`[T][K]` int32, -1 masks a slot) and `topk_weights` (`[T][K]` float),
//! both on `device`.
[[nodiscard]] inline routing_view routing_of(at::Tensor const& topk_idx, at::Tensor const& topk_weights, char const* op,
                                             c10::Device device = c10::kCPU) {
  auto const idx = matrix_of<std::int32_t const>(topk_idx, "topk_idx", op, -1, -1, device);
  auto const w = matrix_of<float const>(topk_weights, "topk_weights", op, idx.rows, idx.hidden, device);
  moecomm::detail::require(idx.hidden <= INT32_MAX, op, "tensor 'topk_idx' has ", idx.hidden, " columns");
  return {idx.data, w.data, idx.rows, static_cast<std::int32_t>(idx.hidden)};
}

//! `topk_idx` with int32 ids: int64 ids (as Megatron-LM and DeepEP hand them) converted, a value
//! outside int32 clamped to one, which the routing check then refuses; any other tensor as it is
//! (the views check it).
[[nodiscard]] inline at::Tensor int32_ids(at::Tensor const& topk_idx) {
  if (!topk_idx.defined() || topk_idx.scalar_type() != at::kLong) return topk_idx;
  return topk_idx.clamp(INT32_MIN, INT32_MAX).to(at::kInt);
}

//! An `[elements]` view of a contiguous tensor of T on `device`, of any shape.
template <class T>
[[nodiscard]] array_view<T> array_of(at::Tensor const& t, char const* name, char const* op, c10::Device device = c10::kCPU) {
  detail::check_tensor<T>(t, name, t.defined() ? t.dim() : 0, op, device);
  return {static_cast<T*>(t.data_ptr()), t.numel()};
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END

#endif  // MOECOMM_HAS_TORCH()
