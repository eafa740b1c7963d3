// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `sort_chunks`: reorder the rows an all-to-all delivered from rank-major to local-expert-major,
//! and back (semantics §10, Megatron-LM's `sort_chunks_by_idxs`).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/kernels/row_kernels.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <cstdint>
#include <type_traits>
#include <limits>

MOECOMM_NAMESPACE_BEGIN

//! Direction of `sort_chunks`.
enum class chunk_order {
  rank_major_to_expert_major,  //!< after dispatch's all-to-all: chunk (s, l) moves to position (l, s)
  expert_major_to_rank_major,  //!< before combine's all-to-all: the inverse
};

//! Reorders `R x L` chunks of rows. `counts[s * L + l]` is the number of rows source rank `s`
//! sent for local expert `l`, the same matrix for both directions. Rank-major order is chunks
//! `(0,0), (0,1), …, (R-1,L-1)`; expert-major is `(0,0), (1,0), …, (R-1,L-1)`. Rows keep their
//! order inside a chunk; the move is a bit copy. Chunks of one size move without a table (no
//! upload): a padded capacity's exchange, as a captured CUDA graph runs it.
//! @param in `[>= total][H]`, `total` = the sum of `counts`.
//! @param counts host array `[>= num_ranks * num_local_experts]`, each `>= 0`.
//! @param out `[>= total][H]`; must not overlap `in`.
//! @param scratch the chunk table's memory, kept between calls.
//! @throws error (invalid_argument) naming the argument (and the chunk for a bad count).
template <class Backend, class T>
void sort_chunks(Backend const& be, matrix_view<std::add_const_t<T>> in, array_view<std::int32_t const> counts,
                 std::int32_t num_ranks, std::int32_t num_local_experts, matrix_view<T> out, workspace<Backend>& scratch,
                 chunk_order order = chunk_order::rank_major_to_expert_major) {
  static_assert(is_supported_dtype_v<T>, "moecomm::sort_chunks: unsupported element type");
  char const* op = "sort_chunks";
  detail::require(num_ranks > 0, op, "num_ranks = ", num_ranks, " must be positive");
  detail::require(num_local_experts > 0, op, "num_local_experts = ", num_local_experts, " must be positive");
  std::int64_t const chunks = detail::checked_int32(std::int64_t{num_ranks} * num_local_experts, op,
                                                    "num_ranks * num_local_experts", "every chunk is an int32 expert id");
  detail::check_elements(counts, chunks, op, "counts", "one count per (source rank, local expert)");
  auto const count = [&](std::int64_t s, std::int64_t l) -> std::int64_t { return counts.data[s * num_local_experts + l]; };
  // The chunk table, listed in destination order: [dst_begin (chunks + 1) | src_begin (chunks)],
  // built on the host after the first row of chunk (s, l), indexed s * L + l, in each order.
  std::int64_t* const table = scratch.template host<std::int64_t>(4 * chunks + 1);
  std::int64_t* const rank_major = table + 2 * chunks + 1;
  std::int64_t* const expert_major = rank_major + chunks;
  std::int64_t total = 0;
  bool alike = true;  // every chunk has count(0, 0) rows
  for (std::int64_t s = 0; s < num_ranks; ++s)
    for (std::int64_t l = 0; l < num_local_experts; ++l) {
      detail::require(count(s, l) >= 0, op, "counts[", s, "][", l, "] = ", count(s, l),
                      " is negative (source rank ", s, ", local expert ", l, ")");
      rank_major[s * num_local_experts + l] = total;
      total += count(s, l);
      alike = alike && count(s, l) == count(0, 0);
    }
  std::int64_t position = 0;
  for (std::int64_t l = 0; l < num_local_experts; ++l)
    for (std::int64_t s = 0; s < num_ranks; ++s) {
      expert_major[s * num_local_experts + l] = position;
      position += count(s, l);
    }
  detail::check_row_move(in, total, "in", "the sum of counts", out, total, "out", "the sum of counts", op);

  bool const to_expert_major = order == chunk_order::rank_major_to_expert_major;
  // Every chunk alike (a padded capacity's exchange): the move is a transposition, with no table to
  // upload from pageable memory (which a captured CUDA graph may not do).
  if (alike && total > 0) {
    std::int32_t const outer = to_expert_major ? num_local_experts : num_ranks;
    std::int32_t const inner = to_expert_major ? num_ranks : num_local_experts;
    detail::with_fragment_width<T>(out.hidden, {in.data, out.data}, [&](auto width) {
      constexpr int n = decltype(width)::value;
      be.for_each_row(total, detail::gather_rows_kernel<T, n, detail::transposed_chunk_source>{
                                 in.data, out.data, out.hidden, {count(0, 0), outer, inner}});
    });
    return;
  }
  std::int64_t const* dst = to_expert_major ? expert_major : rank_major;
  std::int64_t const* src = to_expert_major ? rank_major : expert_major;
  for (std::int64_t d = 0; d < chunks; ++d) {
    std::int64_t const c = to_expert_major ? (d % num_ranks) * num_local_experts + d / num_ranks : d;
    table[d] = dst[c];
    table[chunks + 1 + d] = src[c];
  }
  table[chunks] = total;
  std::int64_t* const device_table = scratch.template get<std::int64_t>(be, 2 * chunks + 1);
  be.copy(device_table, table, 2 * chunks + 1);
  detail::chunk_source const source{device_table, device_table + chunks + 1, static_cast<std::int32_t>(chunks)};
  detail::with_fragment_width<T>(out.hidden, {in.data, out.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    be.for_each_row(total, detail::gather_rows_kernel<T, n, detail::chunk_source>{
                               in.data, out.data, out.hidden, source});
  });
  // No wait: the table is pageable host memory (workspace::host), which a copy to the device has
  // read when the call returns, and the device table is rewritten only by later work on the stream.
}

//! `sort_chunks` with a table of its own, allocated for this call.
template <class Backend, class T>
void sort_chunks(Backend const& be, matrix_view<std::add_const_t<T>> in, array_view<std::int32_t const> counts,
                 std::int32_t num_ranks, std::int32_t num_local_experts, matrix_view<T> out,
                 chunk_order order = chunk_order::rank_major_to_expert_major) {
  workspace<Backend> scratch;
  sort_chunks(be, in, counts, num_ranks, num_local_experts, out, scratch, order);
}

MOECOMM_NAMESPACE_END
