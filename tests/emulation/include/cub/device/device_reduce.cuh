// SPDX-License-Identifier: Apache-2.0
#pragma once
// The emulation's cub::DeviceReduce::TransformReduce, as a job on the stream. Its functors are
// checked and rewritten like a kernel's arguments; the items are combined in ascending order.
#include <moecomm_emulation/cub_support.hpp>

namespace cub {

struct DeviceReduce {
  template <class Input, class Output, class NumItems, class ReduceOp, class TransformOp, class T>
  static cudaError_t TransformReduce(void* d_temp_storage, std::size_t& temp_storage_bytes, Input d_in, Output* d_out,
                                     NumItems num_items, ReduceOp reduction_op, TransformOp transform_op, T init,
                                     cudaStream_t stream = 0) {
    std::size_t const n = static_cast<std::size_t>(num_items);
    std::size_t const need = moecomm_emulation::cub_scratch_bytes(0);
    cudaError_t result;
    if (!moecomm_emulation::cub_scratch_ready(d_temp_storage, temp_storage_bytes, need, result)) return result;
    struct arguments {
      Input in;
      ReduceOp op;
      TransformOp map;
    };
    auto args = std::make_shared<arguments>(arguments{d_in, reduction_op, transform_op});
    std::vector<moecomm_emulation::buffer_use> uses{
        {d_temp_storage, need, moecomm_emulation::access::write, "d_temp_storage"},
        {d_out, sizeof(Output), moecomm_emulation::access::write, "d_out"}};
    // The functors' pointers, each found by type: the counting iterator is no aggregate, and a
    // struct holding it would be read word by word, its padding taken for pointers.
    std::vector<moecomm_emulation::detail::kernel_pointer> pointers = moecomm_emulation::pointer_arguments(transform_op);
    for (auto const& p : moecomm_emulation::pointer_arguments(reduction_op)) pointers.push_back(p);
    if constexpr (std::is_pointer_v<Input>) pointers.push_back({reinterpret_cast<std::uintptr_t>(d_in), moecomm_emulation::detail::kernel_pointer::unknown});
    cudaError_t const scanned = moecomm_emulation::check_kernel_launch(stream, "cub::DeviceReduce::TransformReduce", pointers, uses);
    if (scanned != cudaSuccess) return scanned;
    return moecomm_emulation::enqueue(stream, "cub::DeviceReduce::TransformReduce", uses, [=] {
      T acc = init;
      for (std::size_t i = 0; i < n; ++i) acc = args->op(acc, args->map(args->in[static_cast<std::ptrdiff_t>(i)]));
      *d_out = acc;
    });
  }
};

}  // namespace cub
