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
//!
//! The host back-end's are here: the CPU, and nothing to order (its calls return when done).
//! `cuda_backend`'s are in torch/cuda.cuh.

#include <moecomm/backend/host.hpp>
#include <moecomm/config.hpp>

#include <c10/core/Device.h>

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
  struct stream_join {
    explicit stream_join(host_backend const&) {}
  };
  struct stream_guard {
    explicit stream_guard(host_backend const&) {}
  };
};

}  // namespace libtorch
MOECOMM_NAMESPACE_END
