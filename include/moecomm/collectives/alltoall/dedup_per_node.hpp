// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dedup_per_node`: the dispatcher's exchange policy that sends each token once to each node
//! holding at least one of its experts, to the rank of that node with the sender's local index
//! (rail-aligned, as DeepEP's internode kernels), which forwards it once to each rank of its node
//! that holds one of the token's experts; the combine sums per rank, then per node, before a row
//! crosses back (semantics §10a).

#include <moecomm/config.hpp>
#include <moecomm/collectives/alltoall/dedup_per_rank.hpp>
#include <moecomm/collectives/alltoall/flat.hpp>

#include <cstdint>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! One row per (token, destination node) between nodes, one per (token, destination rank) inside a
//! node. The hops overlap: the rows each rank sends each relay are cut into `pieces` (every `pieces`
//! consecutive rows fill each piece once, so each piece carries a share of every link on both hops),
//! and one grouped exchange carries piece j's first hop (between ranks of equal local index, and the
//! self-copy) with piece j − 1's second (inside nodes), so a relay forwards a piece while the next
//! crosses between nodes (DeepEP's internode pipeline; `pieces + 1` exchanges each way). `pieces = 1`
//! is store-and-forward: the second hop starts when the first has ended. On one node (nothing
//! crosses between nodes) it runs as one piece.
struct dedup_per_node : detail::dedup_exchange<flat> {
  static constexpr char const* name = "dedup_per_node";
  //! Pieces per relay whose hops overlap; the same on every rank. 4 by default (docs/performance.md
  //! measures 1, 4 and 8 beyond one node); 1 is store-and-forward.
  std::int32_t pieces = 4;

  constexpr dedup_per_node() = default;
  constexpr explicit dedup_per_node(std::int32_t pieces_per_relay) : pieces(pieces_per_relay) {}
};

namespace detail {
template <>
struct is_dedup<dedup_per_node> : std::true_type {};
}  // namespace detail

MOECOMM_NAMESPACE_END
