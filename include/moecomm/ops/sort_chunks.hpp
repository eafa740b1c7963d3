// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `sort_chunks`: reorder the rows an all-to-all delivered from rank-major to local-expert-major,
//! and back (semantics §10, Megatron-LM's `sort_chunks_by_idxs`).

#include <moecomm/config.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/kernels/row_kernels.hpp>
#include <moecomm/ops/matrix_checks.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Direction of `sort_chunks`.
enum class chunk_order {
  rank_major_to_expert_major,  //!< after dispatch's all-to-all: chunk (s, l) moves to position (l, s)
  expert_major_to_rank_major,  //!< before combine's all-to-all: the inverse
};

//! Reorders `R x L` chunks of rows. `counts[s * L + l]` is the number of rows source rank `s`
//! sent for local expert `l`, the same matrix for both directions. Rank-major order is chunks
//! `(0,0), (0,1), …, (R-1,L-1)`; expert-major is `(0,0), (1,0), …, (R-1,L-1)`. Rows keep their
//! order inside a chunk; the move is a bit copy.
//! @param in `[>= total][H]`, `total` = the sum of `counts`.
//! @param out `[>= total][H]`; must not overlap `in`.
//! @param counts host array `[num_ranks * num_local_experts]`, each `>= 0`.
//! @throws error (invalid_argument) naming the argument (and the chunk for a bad count).
template <class Backend, class T>
void sort_chunks(Backend const& be, matrix_view<std::add_const_t<T>> in, matrix_view<T> out, std::int32_t const* counts,
                 std::int32_t num_ranks, std::int32_t num_local_experts,
                 chunk_order order = chunk_order::rank_major_to_expert_major) {
  static_assert(is_supported_dtype_v<T>, "moecomm::sort_chunks: unsupported element type");
  char const* op = "sort_chunks";
  detail::require(num_ranks > 0, op, "num_ranks = ", num_ranks, " must be positive");
  detail::require(num_local_experts > 0, op, "num_local_experts = ", num_local_experts, " must be positive");
  detail::require(counts != nullptr, op, "argument 'counts' is null");
  std::int32_t const chunks = detail::checked_int32(std::int64_t{num_ranks} * num_local_experts, op,
                                                    "num_ranks * num_local_experts", "every chunk is an int32 expert id");
  auto const count = [&](std::int32_t s, std::int32_t l) { return counts[s * num_local_experts + l]; };
  // First row of chunk (s, l), indexed s * L + l, in each of the two orders.
  std::vector<std::int64_t> rank_major(static_cast<std::size_t>(chunks));
  std::vector<std::int64_t> expert_major(static_cast<std::size_t>(chunks));
  std::int64_t total = 0;
  for (std::int32_t s = 0; s < num_ranks; ++s)
    for (std::int32_t l = 0; l < num_local_experts; ++l) {
      detail::require(count(s, l) >= 0, op, "counts[", s, "][", l, "] = ", count(s, l),
                      " is negative (source rank ", s, ", local expert ", l, ")");
      rank_major[static_cast<std::size_t>(s * num_local_experts + l)] = total;
      total += count(s, l);
    }
  std::int64_t position = 0;
  for (std::int32_t l = 0; l < num_local_experts; ++l)
    for (std::int32_t s = 0; s < num_ranks; ++s) {
      expert_major[static_cast<std::size_t>(s * num_local_experts + l)] = position;
      position += count(s, l);
    }
  detail::check_rows(in, total, op, "in", "the sum of counts");
  detail::check_rows(out, total, op, "out", "the sum of counts");
  detail::check_same_hidden(in, "in", out, "out", op);
  detail::check_no_overlap(in, total, "in", out, total, "out", op);

  // The chunk table, listed in destination order: [dst_begin (chunks + 1) | src_begin (chunks)].
  bool const to_expert_major = order == chunk_order::rank_major_to_expert_major;
  std::vector<std::int64_t> const& dst = to_expert_major ? expert_major : rank_major;
  std::vector<std::int64_t> const& src = to_expert_major ? rank_major : expert_major;
  std::vector<std::int64_t> table(2 * static_cast<std::size_t>(chunks) + 1);
  for (std::int32_t d = 0; d < chunks; ++d) {
    std::int32_t const c = to_expert_major ? (d % num_ranks) * num_local_experts + d / num_ranks : d;
    table[static_cast<std::size_t>(d)] = dst[static_cast<std::size_t>(c)];
    table[static_cast<std::size_t>(chunks + 1 + d)] = src[static_cast<std::size_t>(c)];
  }
  table[static_cast<std::size_t>(chunks)] = total;
  auto device_table = be.template allocate<std::int64_t>(static_cast<std::int64_t>(table.size()));
  be.copy(device_table.data(), table.data(), static_cast<std::int64_t>(table.size()));
  detail::chunk_source const source{device_table.data(), device_table.data() + chunks + 1, chunks};
  detail::with_fragment_width<T>(out.hidden, {in.data, out.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    be.for_each_row(total, detail::gather_rows_kernel<T, n, detail::chunk_source, detail::no_scale>{
                               in.data, out.data, out.hidden, source, {}});
  });
  be.synchronize();  // the table's memory is released on return
}

MOECOMM_NAMESPACE_END
