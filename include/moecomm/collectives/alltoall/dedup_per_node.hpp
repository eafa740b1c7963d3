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

#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! One row per (token, destination node) between nodes, one per (token, destination rank) inside a
//! node. Both hops are one grouped exchange each (`flat`): the first only between ranks of equal
//! local index (and the self-copy), the second only inside nodes.
struct dedup_per_node : detail::dedup_exchange<flat> {
  static constexpr char const* name = "dedup_per_node";
};

namespace detail {
template <>
struct is_dedup<dedup_per_node> : std::true_type {};
}  // namespace detail

MOECOMM_NAMESPACE_END
