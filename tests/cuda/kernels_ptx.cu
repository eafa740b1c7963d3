// SPDX-License-Identifier: Apache-2.0
// The data-movement kernels, instantiated for every element type and both access widths, the
// expert codec's element kernels, the deduplicated exchange's and the router's, for the ptxas resource check (check_kernels.sh):
// no spills, and 16-byte vector accesses on aligned rows.

#include <moecomm/moecomm.cuh>

namespace moecomm::detail {

#define MOECOMM_ROW_KERNELS(T, WIDE)                                                                            \
  template __global__ void for_each_row_kernel(std::int64_t, gather_rows_kernel<T, WIDE, chunk_source>);        \
  template __global__ void for_each_row_kernel(std::int64_t, gather_rows_kernel<T, 1, chunk_source>);           \
  template __global__ void for_each_row_kernel(std::int64_t, gather_rows_kernel<T, WIDE, transposed_chunk_source>); \
  template __global__ void for_each_row_kernel(std::int64_t, scatter_rows_kernel<T, WIDE, false>);              \
  template __global__ void for_each_row_kernel(std::int64_t, scatter_rows_kernel<T, WIDE, true>);               \
  template __global__ void for_each_row_kernel(std::int64_t, scatter_rows_kernel<T, 1, false>);                 \
  template __global__ void for_each_row_kernel(std::int64_t, scatter_weighted_rows_with_dot_kernel<T, WIDE>);   \
  template __global__ void for_each_row_kernel(std::int64_t, zero_unmapped_rows_kernel<T, WIDE>);               \
  template __global__ void for_each_row_kernel(std::int64_t, combine_rows_kernel<T, WIDE, true>);               \
  template __global__ void for_each_row_kernel(std::int64_t, combine_rows_kernel<T, WIDE, false>);              \
  template __global__ void for_each_row_kernel(std::int64_t, combine_rows_kernel<T, 1, true>);                  \
  template __global__ void for_each_row_kernel(std::int64_t, slot_dot_kernel<T, WIDE>);

MOECOMM_ROW_KERNELS(float, 4)
MOECOMM_ROW_KERNELS(__half, 8)
MOECOMM_ROW_KERNELS(__nv_bfloat16, 8)

template __global__ void for_each_index_kernel(std::int64_t, sum_local_experts);
template __global__ void for_each_index_kernel(std::int64_t, divide_by_count);
template __global__ void for_each_index_kernel(std::int64_t, residual_order_key);
template __global__ void for_each_index_kernel(std::int64_t, gather_kept_values);
template __global__ void for_each_index_kernel(std::int64_t, scatter_kept_values);

// The deduplicated exchange's plans.
template __global__ void for_each_index_kernel(std::int64_t, dedup_source_slots);
template __global__ void for_each_index_kernel(std::int64_t, dedup_slot_lists);
template __global__ void for_each_index_kernel(std::int64_t, split_slot_lists);
template __global__ void for_each_index_kernel(std::int64_t, gather_dedup_weight_grads);
template __global__ void for_each_index_kernel(std::int64_t, count_forwarded_rows_per_piece);
template __global__ void for_each_index_kernel(std::int64_t, widen_counts);
template __global__ void for_each_index_kernel(std::int64_t, move_rows_by_index<std::int32_t>);
template __global__ void for_each_index_kernel(std::int64_t, move_rows_by_index<float>);

// The router: forward, the losses' block sums and values, backward.
template __global__ void for_each_index_kernel(std::int64_t, router_forward_kernel);
template __global__ void for_each_index_kernel(std::int64_t, block_column_sums);
template __global__ void for_each_index_kernel(std::int64_t, block_lse_squares);
template __global__ void for_each_index_kernel(std::int64_t, router_loss_values);
template __global__ void for_each_index_kernel(std::int64_t, router_backward_kernel);

}  // namespace moecomm::detail
