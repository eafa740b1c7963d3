// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `torch_device<Backend>`: what torch must know of a back-end that reads and writes its tensors:
//! the device they live on, and how the back-end's work is ordered with torch's.
//!
//! | member | meaning |
//! |---|---|
//! | `static c10::Device of(Backend const&)` | the device of every tensor a layer on this back-end takes |
//! | `stream_join(Backend const&)` | for its scope, the back-end's device is current, its work follows what torch enqueued before it, and torch's later work follows the back-end's (no host wait) |
//! | `stream_guard(Backend const&)` | for its scope, torch enqueues its own operations where the back-end runs (a torch expert called by the layer) |
//! | `static constexpr bool sixteen_bit_rows` | rows of bfloat16 and float16 as well as float32 (`with_row_type`) |
//!
//! The host back-end's are here: the CPU, and nothing to order (its calls return when done).
//! `cuda_backend`'s are in torch/cuda.cuh.

#include <moecomm/backend/host.hpp>
#include <moecomm/config.hpp>

#include <moecomm/torch/tensor_views.hpp>

#include <c10/core/Device.h>

#include <type_traits>

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

template <class Backend>
struct torch_device {
  static_assert(sizeof(Backend) == 0,
                "moecomm::libtorch::torch_device: no torch device for this back-end (host_backend here; cuda_backend: "
                "include <moecomm/torch/cuda.cuh>)");
};

template <>
struct torch_device<host_backend> {
  [[nodiscard]] static c10::Device of(host_backend const&) { return c10::kCPU; }
  static constexpr bool sixteen_bit_rows = false;
  struct stream_join {
    explicit stream_join(host_backend const&) {}
  };
  struct stream_guard {
    explicit stream_guard(host_backend const&) {}
  };
};

//! `f(T{})` for the row type T of dtype `dtype` on `Backend` (float; `__nv_bfloat16` and `__half`
//! where `torch_device<Backend>::sixteen_bit_rows`), for a call that takes rows of any of them.
//! @throws error (invalid_argument) naming tensor `name` for another dtype.
template <class Backend, class F>
std::invoke_result_t<F, float> with_row_type(at::ScalarType dtype, char const* name, char const* op, F&& f) {
  if (dtype == at::kFloat) return f(float{});
#if MOECOMM_HAS_CUDA_FP16()
  if constexpr (torch_device<Backend>::sixteen_bit_rows) {
    if (dtype == at::kBFloat16) return f(__nv_bfloat16{});
    if (dtype == at::kHalf) return f(__half{});
  }
#endif
  moecomm::detail::fail(status::invalid_argument, op, "tensor '", name, "' has dtype ", detail::dtype_name(dtype), "; needs ",
                        torch_device<Backend>::sixteen_bit_rows ? "Float (float32), BFloat16 or Half" : "Float (float32) on the CPU");
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END
