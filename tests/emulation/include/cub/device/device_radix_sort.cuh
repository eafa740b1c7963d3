// SPDX-License-Identifier: Apache-2.0
#pragma once
// The emulation's cub::DeviceRadixSort::SortPairs: CUB's two-phase interface (a null scratch asks
// for its size), run as a job on the stream: a stable sort by the key bits [begin_bit, end_bit).
#include <moecomm_emulation/cub_support.hpp>

#include <algorithm>
#include <numeric>

namespace cub {

struct DeviceRadixSort {
  template <class Key, class Value, class NumItems>
  static cudaError_t SortPairs(void* d_temp_storage, std::size_t& temp_storage_bytes, Key const* d_keys_in, Key* d_keys_out,
                               Value const* d_values_in, Value* d_values_out, NumItems num_items, int begin_bit = 0,
                               int end_bit = int(sizeof(Key) * 8), cudaStream_t stream = 0) {
    std::size_t const n = static_cast<std::size_t>(num_items);
    std::size_t const need = moecomm_emulation::cub_scratch_bytes(n * (sizeof(Key) + sizeof(Value) + sizeof(std::size_t)));
    cudaError_t result;
    if (!moecomm_emulation::cub_scratch_ready(d_temp_storage, temp_storage_bytes, need, result)) return result;
    if (n == 0) return cudaSuccess;
    std::vector<moecomm_emulation::buffer_use> uses{
        {d_temp_storage, need, moecomm_emulation::access::write, "d_temp_storage"},
        {d_keys_in, n * sizeof(Key), moecomm_emulation::access::read, "d_keys_in"},
        {d_values_in, n * sizeof(Value), moecomm_emulation::access::read, "d_values_in"},
        {d_keys_out, n * sizeof(Key), moecomm_emulation::access::write, "d_keys_out"},
        {d_values_out, n * sizeof(Value), moecomm_emulation::access::write, "d_values_out"}};
    // Launched as a kernel is: from a thread whose current device is the stream's.
    cudaError_t const checked = moecomm_emulation::check_kernel_launch(stream, "cub::DeviceRadixSort::SortPairs", {}, uses);
    if (checked != cudaSuccess) return checked;
    return moecomm_emulation::enqueue(stream, "cub::DeviceRadixSort::SortPairs", uses, [=] {
      auto bits = [&](Key k) {
        using U = std::make_unsigned_t<Key>;
        U const u = static_cast<U>(k) >> begin_bit;
        int const width = end_bit - begin_bit;
        return width >= int(sizeof(U) * 8) ? u : static_cast<U>(u & ((U{1} << width) - 1));
      };
      std::vector<std::size_t> order(n);
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bits(d_keys_in[a]) < bits(d_keys_in[b]); });
      std::vector<Key> keys(n);
      std::vector<Value> values(n);
      for (std::size_t i = 0; i < n; ++i) {
        keys[i] = d_keys_in[order[i]];
        values[i] = d_values_in[order[i]];
      }
      std::copy(keys.begin(), keys.end(), d_keys_out);
      std::copy(values.begin(), values.end(), d_values_out);
    });
  }
};

}  // namespace cub
