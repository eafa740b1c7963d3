// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `ordered_allreduce`: a float or double sum over the ranks whose bits do not depend on the
//! transport. A communicator's `allreduce` adds in its own order (ascending rank in-process, MPI's
//! and NCCL's algorithm order otherwise), so data-parallel gradients summed in-process, over MPI and
//! over NCCL can differ in the last bits. Here every rank all-gathers the values, chunk by chunk,
//! and a back-end kernel adds them left to right in ascending rank: the same bits on every rank and
//! every transport. It moves `size()` times the data of a ring all-reduce's reduce-scatter, so use it
//! where bitwise reproducibility matters more than bandwidth.

#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `data[i] = rank 0's + rank 1's + ...`, left to right, from `gathered` (rank r's `n` values at `r * n`).
template <class T>
struct sum_gathered_in_rank_order {
  T const* gathered;
  std::int64_t n;
  std::int32_t ranks;
  T* data;
  //! Every rank's value read, the sum written (the simulated back-end prices the kernel by it).
  [[nodiscard]] std::int64_t bytes_per_index() const { return (ranks + std::int64_t{1}) * std::int64_t{sizeof(T)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    T acc = gathered[i];
    for (std::int32_t r = 1; r < ranks; ++r) acc = acc + gathered[r * n + i];
    data[i] = acc;
  }
};

}  // namespace detail

//! The default chunk: 2^18 elements (1 MiB of float) from every rank per all-gather.
inline constexpr std::int64_t ordered_allreduce_chunk = std::int64_t{1} << 18;

//! `data` becomes, on every rank, the elementwise sum of every rank's `data`, added left to right in
//! ascending rank: bitwise the same on every rank and over every communicator. Collective over `comm`.
//!
//! First the ranks all-gather `(data.size, chunk_elements)`, so that a bad argument or a disagreement
//! throws on every rank before any data moves: the rank with the bad argument throws
//! `invalid_argument`, the others `aborted` naming it; sizes that differ are `invalid_usage` on every
//! rank. `data` is unchanged then.
//! @tparam T float or double.
//! @param be the back-end that owns `data`'s memory; it runs the sum.
//! @param scratch holds the gathered chunks (`size() * min(chunk_elements, data.size)` elements) between calls.
//! @param chunk_elements elements per rank in one all-gather (> 0), the same on every rank.
template <class Backend, class Comm, class T>
void ordered_allreduce(Backend const& be, Comm& comm, array_view<T> data, workspace<Backend>& scratch,
                       std::int64_t chunk_elements = ordered_allreduce_chunk) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "moecomm: ordered_allreduce sums float or double");
  char const* const op = "ordered_allreduce";
  detail::require_one_stream(be, comm, op);
  std::int32_t const ranks = comm.size();
  auto const row_bytes = static_cast<std::int64_t>(sizeof(T)) * ranks;  // one element from every rank
  std::optional<error> const bad = detail::argument_error([&] {
    detail::validate_size(op, "data.size", data.size);
    detail::validate_buffer(op, "data.data", data.data, data.size);
    detail::require(chunk_elements > 0 && chunk_elements <= std::numeric_limits<std::int64_t>::max() / row_bytes, op,
                    "chunk_elements = ", chunk_elements, " is not in [1, ",
                    std::numeric_limits<std::int64_t>::max() / row_bytes, "]");
  });

  // Agreement, in the back-end's memory (NCCL gathers device memory): -1 marks a bad argument.
  std::int64_t const mine[2] = {bad ? -1 : data.size, chunk_elements};
  std::int64_t* const all = scratch.template host<std::int64_t>(2 * std::int64_t{ranks});  // kept: no allocation per call
  auto* const words = scratch.template get<std::int64_t>(be, 2 * (std::int64_t{ranks} + 1));
  {
    // Control words: not what a caller's payload scope (e.g. parameters) stands for.
    [[maybe_unused]] auto const control = detail::payload_scope(be, detail::payload_kind::control);
    be.copy(words, mine, 2);
    be.synchronize();  // also orders the communicator after the back-end's earlier writes to `data`
    comm.allgather(words, words + 2, sizeof(mine));
    be.copy(all, words + 2, 2 * std::int64_t{ranks});
    be.synchronize();
  }
  if (bad) throw *bad;
  for (std::int32_t r = 0; r < ranks; ++r)
    if (all[2 * r] < 0)
      detail::fail(status::aborted, op, "rank ", r, " passed an invalid argument (see its error); nothing was written");
  for (std::int32_t r = 1; r < ranks; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
      detail::fail(status::invalid_usage, op, "ranks disagree: rank 0 has data.size ", all[0], " and chunk_elements ",
                   all[1], ", but rank ", r, " has data.size ", all[2 * r],
                   " and chunk_elements ", all[2 * r + 1]);

  std::int64_t const chunk = std::min(chunk_elements, data.size);
  T* const gathered = scratch.template get<T>(be, chunk * ranks);
  // split_into_chunks counts elements here: `piece.bytes` is the piece's length in elements.
  for (detail::byte_chunk const piece : detail::split_into_chunks(data.size, chunk_elements)) {
    comm.allgather(data.data + piece.offset, gathered, piece.bytes * static_cast<std::int64_t>(sizeof(T)));
    be.for_each_index(piece.bytes, detail::sum_gathered_in_rank_order<T>{gathered, piece.bytes, ranks, data.data + piece.offset});
    be.synchronize();  // the next all-gather lands in the same rows
  }
}

MOECOMM_NAMESPACE_END
