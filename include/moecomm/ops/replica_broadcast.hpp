// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_broadcast`: an expert's parameters from its owner to its replicas (FasterMoE's shadow
//! broadcast; FlexMoE's and Pro-Prophet's replica updates), chunked, over either path.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/replica/replica_set.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Copies the owner's `bytes` at `data` into `data` on every replica, bit for bit, in chunks of at
//! most `path.chunk_bytes`. Collective over `comm`: every rank calls it with the same `set` and
//! `bytes`; ranks outside the set may pass a null `data` and receive nothing.
//! @param path `collective_path{}` (comm is exactly the set) or `point_to_point_path{}` (any subset).
//! @throws error (invalid_argument) naming the bad argument, before any message is sent.
template <class Path, class Comm>
void replica_broadcast(Path const& path, Comm& comm, replica_set const& set, void* data, std::int64_t bytes) {
  char const* op = "replica_broadcast";
  std::int32_t const ranks = comm.size(), me = comm.rank();
  detail::validate_replica_set(op, path, set, ranks);
  detail::require(bytes >= 0, op, "bytes = ", bytes, " must be >= 0");
  detail::require(data != nullptr || bytes == 0 || !set.holds(me), op, "data is null on rank ", me,
                  ", which is in the replica set, but bytes = ", bytes);
  if constexpr (std::is_same_v<Path, collective_path>) detail::require_whole_group(op, set, ranks);
  if (set.replicas.empty()) return;  // every rank knows the set: nobody has anything to move
  auto* const base = static_cast<char*>(data);
  for (detail::byte_chunk const chunk : detail::split_into_chunks(bytes, path.chunk_bytes)) {
    if constexpr (std::is_same_v<Path, collective_path>) {
      comm.broadcast(base + chunk.offset, chunk.bytes, set.owner);
    } else {
      static_assert(std::is_same_v<Path, point_to_point_path>,
                    "moecomm::replica_broadcast: the path must be collective_path or point_to_point_path");
      std::vector<send_block> sends;
      std::vector<recv_block> recvs;
      if (me == set.owner)
        for (std::int32_t r : set.replicas) sends.push_back({r, base + chunk.offset, chunk.bytes});
      else if (set.holds(me))
        recvs.push_back({set.owner, base + chunk.offset, chunk.bytes});
      comm.exchange(sends, recvs);
    }
  }
}

MOECOMM_NAMESPACE_END
