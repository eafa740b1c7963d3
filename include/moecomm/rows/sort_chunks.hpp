// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `sort_chunks`: reorder the rows an all-to-all delivered from rank-major to local-expert-major,
//! and back (semantics §10, Megatron-LM's `sort_chunks_by_idxs`).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/read_back.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/kernels/row_kernels.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Direction of `sort_chunks`.
enum class chunk_order {
  rank_major_to_expert_major,  //!< after dispatch's all-to-all: chunk (s, l) moves to position (l, s)
  expert_major_to_rank_major,  //!< before combine's all-to-all: the inverse
};

namespace detail {

//! The number of chunks, `R x L`, once the shape and `counts`' size are checked (before any table
//! is sized by it).
inline std::int64_t checked_chunks(array_view<std::int32_t const> counts, std::int32_t num_ranks, std::int32_t num_local_experts,
                                   char const* op) {
  detail::require(num_ranks > 0, op, "num_ranks = ", num_ranks, " must be positive");
  detail::require(num_local_experts > 0, op, "num_local_experts = ", num_local_experts, " must be positive");
  std::int64_t const chunks = detail::checked_int32(std::int64_t{num_ranks} * num_local_experts, op,
                                                    "num_ranks * num_local_experts", "every chunk is an int32 expert id");
  detail::check_elements(counts, chunks, op, "counts", "one count per (source rank, local expert)");
  return chunks;
}

//! The first row of each chunk (s, l), indexed s * L + l, in rank-major and in expert-major order,
//! after checking the counts (`checked_chunks` checked the shape); their total and whether every
//! chunk has `counts[0]` rows.
struct chunk_layout {
  std::int64_t total = 0;
  bool alike = true;
};
inline chunk_layout lay_out_chunks(array_view<std::int32_t const> counts, std::int32_t num_ranks, std::int32_t num_local_experts,
                                   std::int64_t* rank_major, std::int64_t* expert_major, char const* op) {
  auto const count = [&](std::int64_t s, std::int64_t l) -> std::int64_t { return counts.data[s * num_local_experts + l]; };
  chunk_layout layout;
  for (std::int64_t s = 0; s < num_ranks; ++s)
    for (std::int64_t l = 0; l < num_local_experts; ++l) {
      detail::require(count(s, l) >= 0, op, "counts[", s, "][", l, "] = ", count(s, l),
                      " is negative (source rank ", s, ", local expert ", l, ")");
      rank_major[s * num_local_experts + l] = layout.total;
      layout.total += count(s, l);
      layout.alike = layout.alike && count(s, l) == count(0, 0);
    }
  std::int64_t position = 0;
  for (std::int64_t l = 0; l < num_local_experts; ++l)
    for (std::int64_t s = 0; s < num_ranks; ++s) {
      expert_major[s * num_local_experts + l] = position;
      position += count(s, l);
    }
  return layout;
}

//! The chunk table of `order` from `lay_out_chunks`' starts, listed in destination order:
//! `[dst_begin (chunks + 1) | src_begin (chunks)]`.
inline void fill_chunk_table(std::int64_t const* rank_major, std::int64_t const* expert_major, std::int32_t num_ranks,
                             std::int32_t num_local_experts, std::int64_t total, chunk_order order, std::int64_t* table) {
  std::int64_t const chunks = std::int64_t{num_ranks} * num_local_experts;
  bool const to_expert_major = order == chunk_order::rank_major_to_expert_major;
  std::int64_t const* dst = to_expert_major ? expert_major : rank_major;
  std::int64_t const* src = to_expert_major ? rank_major : expert_major;
  for (std::int64_t d = 0; d < chunks; ++d) {
    std::int64_t const c = to_expert_major ? (d % num_ranks) * num_local_experts + d / num_ranks : d;
    table[d] = dst[c];
    table[chunks + 1 + d] = src[c];
  }
  table[chunks] = total;
}

//! `out[r] = in[source(r)]` for r < rows, or a zero row where `source(r) < 0`: one row kernel, at
//! the widest fragment both pointers allow.
template <class Backend, class T, class Source>
void gather_rows_by(Backend const& be, matrix_view<std::add_const_t<T>> in, matrix_view<T> out, std::int64_t rows, Source source) {
  if (rows == 0) return;
  detail::with_fragment_width<T>(out.hidden, {in.data, out.data}, [&](auto width) {
    constexpr int n = decltype(width)::value;
    be.for_each_row(rows, detail::gather_rows_kernel<T, n, Source>{in.data, out.data, out.hidden, source});
  });
}

//! The move itself: chunks of `chunk_rows` rows each by a transposition (`device_table` unused), or
//! by `device_table` (`fill_chunk_table`'s, in the back-end's memory).
template <class Backend, class T>
void move_chunks(Backend const& be, matrix_view<std::add_const_t<T>> in, matrix_view<T> out, std::int64_t total, bool alike,
                 std::int64_t chunk_rows, std::int32_t num_ranks, std::int32_t num_local_experts, chunk_order order,
                 std::int64_t const* device_table) {
  bool const to_expert_major = order == chunk_order::rank_major_to_expert_major;
  std::int32_t const chunks = num_ranks * num_local_experts;
  if (alike)
    gather_rows_by<Backend, T>(be, in, out, total,
                               transposed_chunk_source{chunk_rows, to_expert_major ? num_local_experts : num_ranks,
                                                       to_expert_major ? num_ranks : num_local_experts});
  else
    gather_rows_by<Backend, T>(be, in, out, total, chunk_source{device_table, device_table + chunks + 1, chunks});
}

}  // namespace detail

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
  std::int64_t const chunks = detail::checked_chunks(counts, num_ranks, num_local_experts, op);
  // Host: [dst_begin (chunks + 1) | src_begin (chunks)], then the starts in each order.
  std::int64_t* const table = scratch.template host<std::int64_t>(4 * chunks + 1);
  std::int64_t* const rank_major = table + 2 * chunks + 1;
  std::int64_t* const expert_major = rank_major + chunks;
  detail::chunk_layout const layout = detail::lay_out_chunks(counts, num_ranks, num_local_experts, rank_major, expert_major, op);
  detail::check_row_move(in, layout.total, "in", "the sum of counts", out, layout.total, "out", "the sum of counts", op);
  std::int64_t* device_table = nullptr;
  // Every chunk alike (a padded capacity's exchange): the move is a transposition, with no table to
  // upload from pageable memory (which a captured CUDA graph may not do).
  if (!layout.alike) {
    detail::fill_chunk_table(rank_major, expert_major, num_ranks, num_local_experts, layout.total, order, table);
    device_table = scratch.template get<std::int64_t>(be, 2 * chunks + 1);
    be.copy(device_table, table, 2 * chunks + 1);
    // No wait: the table is pageable host memory (workspace::host), which a copy to the device has
    // read when the call returns, and the device table is rewritten only by later work on the stream.
  }
  detail::move_chunks<Backend, T>(be, in, out, layout.total, layout.alike, counts.data[0], num_ranks, num_local_experts, order,
                                  device_table);
}

//! The chunk tables of the last count matrix a dispatcher's `sort_chunks` moved by in an eager call,
//! one per order, kept in the back-end's memory, so that a captured CUDA graph moves chunks of
//! different sizes (a padded capacity's with home experts, whose chunks are empty) by them, with no
//! upload (an upload from pageable memory may not be captured).
template <class Backend>
class chunk_tables {
 public:
  //! `order`'s table of `counts` in the back-end's memory: an eager call uploads it; a call while
  //! the back-end's stream captures takes the last eager call's of that order, and refuses other counts.
  std::int64_t const* device_table(Backend const& be, array_view<std::int32_t const> counts, std::int32_t num_ranks,
                                   std::int32_t num_local_experts, std::int64_t total, chunk_order order) {
    std::int64_t const chunks = std::int64_t{num_ranks} * num_local_experts, width = 2 * chunks + 1;
    auto const o = static_cast<std::size_t>(order == chunk_order::rank_major_to_expert_major ? 0 : 1);
    std::vector<std::int32_t>& made_for = counts_[o];
    if (detail::capturing(be)) {
      detail::require(std::equal(made_for.begin(), made_for.end(), counts.data, counts.data + chunks) &&
                          device_.size() >= 2 * width,
                      "sort_chunks", "a captured call moves chunks of different sizes by the table of the eager call before "
                      "the capture, and these counts differ from that call's: capture after an eager step of the same shape "
                      "and home experts");
    } else {
      made_for.assign(counts.data, counts.data + chunks);
      host_.resize(static_cast<std::size_t>(width + 2 * chunks));  // capacity kept between calls
      std::int64_t* const rank_major = host_.data() + width;
      (void)detail::lay_out_chunks(counts, num_ranks, num_local_experts, rank_major, rank_major + chunks, "sort_chunks");
      detail::fill_chunk_table(rank_major, rank_major + chunks, num_ranks, num_local_experts, total, order, host_.data());
      be.copy(grow(be, device_, 2 * width).data() + o * width, host_.data(), width);  // pageable: read when enqueued
    }
    return device_.data() + o * width;
  }
  //! Sized for `R x L` chunks, so that a call allocates nothing.
  void reserve(Backend const& be, std::int32_t num_ranks, std::int32_t num_local_experts) {
    std::int64_t const chunks = std::int64_t{num_ranks} * num_local_experts;
    for (auto& c : counts_) c.reserve(static_cast<std::size_t>(chunks));
    host_.reserve(static_cast<std::size_t>(4 * chunks + 1));
    grow(be, device_, 2 * (2 * chunks + 1));
  }

 private:
  std::vector<std::int32_t> counts_[2];  //!< the counts each order's table was made for
  std::vector<std::int64_t> host_;       //!< [a table][the starts in each order]
  typename Backend::template buffer_type<std::int64_t> device_;  //!< [both orders' tables]
};

//! `sort_chunks` by the tables kept in `tables` (`chunk_tables`): the same move.
template <class Backend, class T>
void sort_chunks(Backend const& be, matrix_view<std::add_const_t<T>> in, array_view<std::int32_t const> counts,
                 std::int32_t num_ranks, std::int32_t num_local_experts, matrix_view<T> out, chunk_tables<Backend>& tables,
                 workspace<Backend>& scratch, chunk_order order) {
  static_assert(is_supported_dtype_v<T>, "moecomm::sort_chunks: unsupported element type");
  char const* op = "sort_chunks";
  std::int64_t const chunks = detail::checked_chunks(counts, num_ranks, num_local_experts, op);
  std::int64_t* const rank_major = scratch.template host<std::int64_t>(2 * chunks);
  detail::chunk_layout const layout =
      detail::lay_out_chunks(counts, num_ranks, num_local_experts, rank_major, rank_major + chunks, op);
  detail::check_row_move(in, layout.total, "in", "the sum of counts", out, layout.total, "out", "the sum of counts", op);
  std::int64_t const* const device_table =
      layout.alike ? nullptr : tables.device_table(be, counts, num_ranks, num_local_experts, layout.total, order);
  detail::move_chunks<Backend, T>(be, in, out, layout.total, layout.alike, counts.data[0], num_ranks, num_local_experts, order,
                                  device_table);
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
