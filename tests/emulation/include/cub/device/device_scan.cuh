// SPDX-License-Identifier: Apache-2.0
#pragma once
// The emulation's cub::DeviceScan::ExclusiveSum, as a job on the stream.
#include <moecomm_emulation/cub_support.hpp>

namespace cub {

struct DeviceScan {
  template <class T, class NumItems>
  static cudaError_t ExclusiveSum(void* d_temp_storage, std::size_t& temp_storage_bytes, T const* d_in, T* d_out,
                                  NumItems num_items, cudaStream_t stream = 0) {
    std::size_t const n = static_cast<std::size_t>(num_items);
    std::size_t const need = moecomm_emulation::cub_scratch_bytes(0);
    cudaError_t result;
    if (!moecomm_emulation::cub_scratch_ready(d_temp_storage, temp_storage_bytes, need, result)) return result;
    if (n == 0) return cudaSuccess;
    std::vector<moecomm_emulation::buffer_use> uses{
        {d_temp_storage, need, moecomm_emulation::access::write, "d_temp_storage"},
        {d_in, n * sizeof(T), moecomm_emulation::access::read, "d_in"},
        {d_out, n * sizeof(T), moecomm_emulation::access::write, "d_out"}};
    // Launched as a kernel is: from a thread whose current device is the stream's.
    cudaError_t const checked = moecomm_emulation::check_kernel_launch(stream, "cub::DeviceScan::ExclusiveSum", {}, uses);
    if (checked != cudaSuccess) return checked;
    return moecomm_emulation::enqueue(stream, "cub::DeviceScan::ExclusiveSum", uses, [=] {
      T sum{};
      for (std::size_t i = 0; i < n; ++i) {
        T const v = d_in[i];  // in place allowed
        d_out[i] = sum;
        sum = static_cast<T>(sum + v);
      }
    });
  }
};

}  // namespace cub
