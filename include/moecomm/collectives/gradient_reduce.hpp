// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `gradient_reduce`: the replicas' gradients of an expert summed into its owner's, in a fixed
//! order (FasterMoE's shadow reduce); and `replica_allreduce`, the same sum left on every member
//! (FlexMoE's and MicroMoE's replica groups). Both chunked, over either path.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/collectives/replica_set.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `owner[i] = v_0 + v_1 + ... + v_n`, left to right, over the set's members in ascending rank:
//! member `owner_position` is the owner's own value, the others are the staged replica chunks in
//! ascending rank (slot `j` at `staged + j * stride`).
template <class T>
struct sum_in_rank_order {
  T const* staged;
  std::int64_t stride;
  std::int32_t members;
  std::int32_t owner_position;
  T* owner;
  MOECOMM_HOST_DEVICE T value(std::int32_t m, std::int64_t i) const {
    return m == owner_position ? owner[i] : staged[(m < owner_position ? m : m - 1) * stride + i];
  }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    T acc = value(0, i);
    for (std::int32_t m = 1; m < members; ++m) acc = acc + value(m, i);
    owner[i] = acc;
  }
};

template <class T>
constexpr void require_gradient_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "moecomm: gradients are reduced in float or double");
}

//! Elements of T in one chunk of the path (at least one).
template <class T, class Path>
std::int64_t chunk_elements(Path const& path) {
  std::int64_t const n = path.chunk_bytes / static_cast<std::int64_t>(sizeof(T));
  return n > 0 ? n : 1;
}

template <class Path, class T>
void validate_reduce(char const* op, Path const& path, replica_set const& set, std::int32_t ranks, std::int32_t me,
                     std::int64_t count, array_view<T> grads) {
  validate_replica_set(op, path, set, ranks);
  require(count >= 0, op, "count = ", count, " must be >= 0");
  if (set.holds(me)) check_elements(grads, count, op, "grads", "count, on a rank of the replica set");
  if constexpr (std::is_same_v<Path, collective_path>) require_whole_group(op, set, ranks);
}

}  // namespace detail

//! The owner's `grads[0, count)` becomes the sum of every member's `grads`, added left to right in
//! ascending rank (the owner's own value at its place): bitwise the same on every run. Replicas'
//! buffers are left unchanged. Collective over `comm`, as `replica_broadcast`; ranks outside the
//! set may pass an empty view.
//!
//! Order: `point_to_point_path` sums on the owner in exactly that order on every transport.
//! `collective_path` uses the communicator's `reduce`: the same order in-process; MPI's and NCCL's
//! own (fixed for a fixed configuration) otherwise.
//!
//! On a communicator that enqueues its exchanges (NCCL's), the point-to-point path is left in the
//! back-end's stream order, with no host wait (a CUDA graph captures it); otherwise it returns done.
//! @tparam T float or double.
//! @param be the back-end that owns `grads`' memory (it runs the sum and holds the staging chunks).
//! @param grads `[>= count]` on the owner and the replicas.
//! @param scratch the staging of the point-to-point path, reused between calls.
template <class Backend, class Comm, class T, class Path = point_to_point_path>
void gradient_reduce(Backend const& be, Comm& comm, replica_set const& set, std::int64_t count, array_view<T> grads,
                     workspace<Backend>& scratch, Path const& path = {}) {
  detail::require_gradient_type<T>();
  char const* op = "gradient_reduce";
  detail::require_one_stream(be, comm, op);
  std::int32_t const ranks = comm.size(), me = comm.rank();
  detail::validate_reduce(op, path, set, ranks, me, count, grads);
  if (set.replicas.empty()) return;
  constexpr bool stream_ordered = detail::has_enqueue_exchange<Comm>::value;  // its messages follow the stream's work
  std::int64_t const chunk = detail::chunk_elements<T>(path);
  // split_into_chunks counts elements here: `piece.bytes` is the piece's length in elements.
  auto const pieces = detail::split_into_chunks(count, chunk);
  if constexpr (std::is_same_v<Path, collective_path>) {
    for (detail::byte_chunk const piece : pieces)
      comm.reduce(grads.data + piece.offset, me == set.owner ? grads.data + piece.offset : nullptr, piece.bytes,
                  reduce_op::sum, set.owner);
  } else {
    static_assert(std::is_same_v<Path, point_to_point_path>,
                  "moecomm::gradient_reduce: the path must be collective_path or point_to_point_path");
    auto const replicas = static_cast<std::int64_t>(set.replicas.size());
    std::int64_t const chunk_rows = count < chunk ? count : chunk;
    T* const staged = me == set.owner ? scratch.template get<T>(be, chunk_rows * replicas) : nullptr;
    // The owner's place among the members in ascending rank (the replicas are ascending).
    auto const owner_position = static_cast<std::int32_t>(
        std::count_if(set.replicas.begin(), set.replicas.end(), [&](std::int32_t r) { return r < set.owner; }));
    message_lists& lists = scratch.messages();
    for (detail::byte_chunk const piece : pieces) {
      T* const mine = grads.data + piece.offset;
      std::int64_t const bytes = piece.bytes * static_cast<std::int64_t>(sizeof(T));
      lists.clear_messages();
      if (me == set.owner)
        for (std::int64_t j = 0; j < replicas; ++j)
          lists.recvs.push_back({set.replicas[static_cast<std::size_t>(j)], staged + j * chunk_rows, bytes});
      else if (set.holds(me))
        lists.sends.push_back({set.owner, mine, bytes});
      detail::exchange_in_stream_order(comm, lists.sends, lists.recvs);
      if (me == set.owner) {
        be.for_each_index(piece.bytes, detail::sum_in_rank_order<T>{staged, chunk_rows,
                                                                    static_cast<std::int32_t>(replicas + 1),
                                                                    owner_position, mine});
        // The next piece's messages land in the same staging rows: after the sum, in stream order
        // on a communicator that enqueues (NCCL's), else after a wait.
        if constexpr (!stream_ordered) be.synchronize();
      }
    }
  }
  if constexpr (!stream_ordered) be.synchronize();
}

//! Every member's `grads[0, count)` becomes the sum of all members' (the order of
//! `gradient_reduce`), the same bits on every member. `point_to_point_path`: reduce to the owner,
//! then broadcast from it.
template <class Backend, class Comm, class T, class Path = point_to_point_path>
void replica_allreduce(Backend const& be, Comm& comm, replica_set const& set, std::int64_t count, array_view<T> grads,
                       workspace<Backend>& scratch, Path const& path = {}) {
  detail::require_gradient_type<T>();
  char const* op = "replica_allreduce";
  detail::require_one_stream(be, comm, op);
  detail::validate_reduce(op, path, set, comm.size(), comm.rank(), count, grads);
  if constexpr (std::is_same_v<Path, collective_path>) {
    for (detail::byte_chunk const piece : detail::split_into_chunks(count, detail::chunk_elements<T>(path)))
      comm.allreduce(grads.data + piece.offset, grads.data + piece.offset, piece.bytes, reduce_op::sum);  // bytes: elements
  } else {
    gradient_reduce(be, comm, set, count, grads, scratch, path);
    replica_broadcast(be, comm, set, count, grads, scratch, path);
  }
}

MOECOMM_NAMESPACE_END
