// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_broadcast`: an expert's parameters from its owner to its replicas (FasterMoE's shadow
//! broadcast; FlexMoE's and Pro-Prophet's replica updates), chunked, over either path.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/collectives/replica_set.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

namespace detail {

//! The broadcast itself; `lists` holds the point-to-point path's messages, which with
//! `InStreamOrder` a communicator that enqueues (NCCL's) leaves in stream order.
template <bool InStreamOrder, class Comm, class T, class Path>
void broadcast_to_replicas(Comm& comm, replica_set const& set, std::int64_t count, array_view<T> data, Path const& path,
                           message_lists& lists) {
  static_assert(std::is_trivially_copyable_v<T> && !std::is_const_v<T>,
                "moecomm::replica_broadcast: data must be a writable view of trivially copyable elements");
  char const* op = "replica_broadcast";
  std::int32_t const ranks = comm.size(), me = comm.rank();
  validate_replica_set(op, path, set, ranks);
  require(count >= 0, op, "count = ", count, " must be >= 0");
  require(count <= std::numeric_limits<std::int64_t>::max() / std::int64_t(sizeof(T)), op, "count = ", count,
          " elements of ", sizeof(T), " bytes overflow int64");
  if (set.holds(me)) check_elements(data, count, op, "data", "count, on a rank of the replica set");
  if constexpr (std::is_same_v<Path, collective_path>) require_whole_group(op, set, ranks);
  if (set.replicas.empty()) return;  // every rank knows the set: nobody has anything to move
  auto* const base = reinterpret_cast<char*>(data.data);
  for (byte_chunk const chunk : split_into_chunks(count * std::int64_t(sizeof(T)), path.chunk_bytes)) {
    if constexpr (std::is_same_v<Path, collective_path>) {
      comm.broadcast(base + chunk.offset, chunk.bytes, set.owner);
    } else {
      static_assert(std::is_same_v<Path, point_to_point_path>,
                    "moecomm::replica_broadcast: the path must be collective_path or point_to_point_path");
      lists.clear_messages();
      if (me == set.owner)
        for (std::int32_t r : set.replicas) lists.sends.push_back({r, base + chunk.offset, chunk.bytes});
      else if (set.holds(me))
        lists.recvs.push_back({set.owner, base + chunk.offset, chunk.bytes});
      if constexpr (InStreamOrder) exchange_in_stream_order(comm, lists.sends, lists.recvs);
      else comm.exchange(lists.sends, lists.recvs);
    }
  }
}

}  // namespace detail

//! Copies the owner's `data[0, count)` into `data` on every replica, bit for bit, in chunks of at
//! most `path.chunk_bytes`. Collective over `comm`: every rank calls it with the same `set` and
//! `count`; ranks outside the set may pass an empty view and receive nothing.
//! @param data `[>= count]` on the owner and the replicas.
//! @param path `collective_path{}` (comm is exactly the set) or `point_to_point_path{}` (any subset).
//! @throws error (invalid_argument) naming the bad argument, before any message is sent.
template <class Comm, class T, class Path = point_to_point_path>
void replica_broadcast(Comm& comm, replica_set const& set, std::int64_t count, array_view<T> data, Path const& path = {}) {
  message_lists lists;  // a one-off call: the form below keeps them
  detail::broadcast_to_replicas<false>(comm, set, count, data, path, lists);
}

//! As above, with the message lists kept in `scratch` between calls (a steady state allocates
//! nothing); the argument order of `gradient_reduce`. `be` is the back-end whose work wrote `data`
//! (its stream must be the communicator's: `detail::require_one_stream`) and reads it next: on a
//! communicator that enqueues (NCCL's), the point-to-point path is left in its stream order, with no
//! host wait (a CUDA graph captures it).
template <class Backend, class Comm, class T, class Path = point_to_point_path>
void replica_broadcast(Backend const& be, Comm& comm, replica_set const& set, std::int64_t count, array_view<T> data,
                       workspace<Backend>& scratch, Path const& path = {}) {
  detail::require_one_stream(be, comm, "replica_broadcast");
  detail::broadcast_to_replicas<true>(comm, set, count, data, path, scratch.messages());
}

MOECOMM_NAMESPACE_END
