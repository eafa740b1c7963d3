// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `alltoallv`: the all-to-all of variable-size blocks, with the algorithm as a policy:
//! `flat`, `hierarchical_2d` or `pairwise`. All produce bit-identical receive buffers.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall/alltoall_workspace.hpp>
#include <moecomm/collectives/alltoall/byte_matrix.hpp>
#include <moecomm/collectives/alltoall/dedup_per_node.hpp>
#include <moecomm/collectives/alltoall/dedup_per_rank.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/alltoall/flat.hpp>
#include <moecomm/collectives/alltoall/hierarchical_2d.hpp>
#include <moecomm/collectives/alltoall/pairwise.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <type_traits>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Sends row `me` of `m` (blocks by destination rank, in `send`) and receives column `me` (blocks
//! by source rank, into `recv`). Collective over `groups.world()`; every rank passes the same `m`.
//! @param send `[>= m.send_total(me)]` bytes; @param recv `[>= m.recv_total(me)]` bytes.
//! @param stats accumulates this rank's messages and bytes by link class.
//! @param scratch the staging and message lists, kept between calls.
//! @param algorithm `flat{}`, `hierarchical_2d{}` or `pairwise{group_size}`.
template <class Backend, class Comm, class Algorithm = flat>
void alltoallv(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, array_view<char const> send,
               array_view<char> recv, alltoall_stats& stats, alltoall_workspace<Backend>& scratch,
               Algorithm const& algorithm = {}) {
  char const* op = "alltoallv";
  detail::require_one_stream(be, groups.world(), op);
  std::int32_t const me = groups.world().rank();
  detail::require(m.ranks() == groups.world().size(), op, "the byte matrix has ", m.ranks(),
                  " ranks but the communicator has ", groups.world().size());
  detail::check_elements(send, m.send_total(me), op, "send", "the bytes this rank sends: m.send_total(rank)");
  detail::check_elements(recv, m.recv_total(me), op, "recv", "the bytes this rank receives: m.recv_total(rank)");
  algorithm.run(be, groups, m, send.data, recv.data, stats, scratch);
}

//! `alltoallv` with scratch of its own, allocated for this call.
template <class Backend, class Comm, class Algorithm = flat>
void alltoallv(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, array_view<char const> send,
               array_view<char> recv, alltoall_stats& stats, Algorithm const& algorithm = {}) {
  alltoall_workspace<Backend> scratch;
  alltoallv(be, groups, m, send, recv, stats, scratch, algorithm);
}

//! The count exchange: every rank contributes its row (bytes to each rank) and gets the matrix.
template <class Comm>
[[nodiscard]] byte_matrix exchange_byte_counts(Comm& comm, std::vector<std::int64_t> const& my_row) {
  detail::require(static_cast<int>(my_row.size()) == comm.size(), "exchange_byte_counts", "my_row has ",
                  my_row.size(), " entries for ", comm.size(), " ranks");
  std::vector<std::int64_t> cells(my_row.size() * my_row.size());
  allgather_host(comm, my_row.data(), cells.data(), static_cast<std::int64_t>(my_row.size() * sizeof(std::int64_t)));
  return byte_matrix(comm.size(), std::move(cells));
}

namespace detail {

//! Sizes what `algorithm` stages (`hierarchical_2d`'s blocks; the others stage nothing) for exchanges
//! in which no rank sends more than `max_send` bytes or receives more than `max_recv`.
template <class Algorithm, class Backend>
void reserve_exchange(Algorithm const& algorithm, Backend const& be, topology const& topo, std::int64_t max_send,
                      std::int64_t max_recv, alltoall_workspace<Backend>& scratch) {
  if constexpr (std::is_same_v<Algorithm, hierarchical_2d>) algorithm.reserve(be, topo, max_send, max_recv, scratch);
  else if constexpr (detail::is_dedup_v<Algorithm>) reserve_exchange(algorithm.inner, be, topo, max_send, max_recv, scratch);
}

}  // namespace detail

MOECOMM_NAMESPACE_END
