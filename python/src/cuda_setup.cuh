// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the extension's CUDA translation units share: a back-end and an NCCL communicator for a
// layer or dispatcher on a GPU.

#include <torch/extension.h>

#include <moecomm/moecomm.cuh>
#include <moecomm/torch/cuda.cuh>

#include <chrono>
#include <cstdint>
#include <utility>

namespace moecomm_python {

namespace py = pybind11;

// A back-end on torch's current stream of GPU `device` and a new NCCL communicator of `size` ranks
// over it, bootstrapped through `store`, a store of the caller's own (a PrefixStore of the group's)
// where the group's rank 0 publishes the NCCL id. Collective.
inline std::pair<moecomm::cuda_backend, moecomm::nccl_communicator> on_nccl(py::object const& store, std::int32_t rank,
                                                                            std::int32_t size, c10::DeviceIndex device,
                                                                            double timeout) {
  auto const wait = std::chrono::milliseconds(static_cast<std::int64_t>(timeout * 1000.0));
  c10::cuda::CUDAGuard const on_device(device);
  moecomm::cuda_backend be = moecomm::libtorch::current_stream_backend(wait);
  moecomm::nccl_options options;
  options.timeout = wait;
  auto const st = store.cast<c10::intrusive_ptr<c10d::Store>>();
  py::gil_scoped_release const release;  // the peers' processes are waited for
  return {be, moecomm::libtorch::nccl_from_store(*st, "nccl", rank, size, be.stream(), options)};
}

}  // namespace moecomm_python
