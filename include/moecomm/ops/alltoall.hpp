// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `alltoallv`: the all-to-all of variable-size blocks, with the algorithm as a policy:
//! `flat`, `hierarchical_2d` or `pairwise`. All produce bit-identical receive buffers.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/alltoall/byte_matrix.hpp>
#include <moecomm/ops/alltoall/exchange_groups.hpp>
#include <moecomm/ops/alltoall/flat.hpp>
#include <moecomm/ops/alltoall/hierarchical_2d.hpp>
#include <moecomm/ops/alltoall/pairwise.hpp>
#include <moecomm/ops/alltoall/stats.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Sends row `me` of `m` (blocks by destination rank, in `send`) and receives column `me` (blocks
//! by source rank, into `recv`). Collective over `groups.world()`; every rank passes the same `m`.
//! @param algorithm `flat{}`, `hierarchical_2d{}` or `pairwise{group_size}`.
//! @param stats accumulates this rank's messages and bytes by link class.
template <class Algorithm, class Backend, class Comm>
void alltoallv(Algorithm const& algorithm, Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m,
               void const* send, void* recv, alltoall_stats& stats) {
  detail::require(m.ranks() == groups.world().size(), "alltoallv", "the byte matrix has ", m.ranks(),
                  " ranks but the communicator has ", groups.world().size());
  algorithm.run(be, groups, m, send, recv, stats);
}

//! The count exchange: every rank contributes its row (bytes to each rank) and gets the matrix.
template <class Comm>
[[nodiscard]] byte_matrix exchange_byte_counts(Comm& comm, std::vector<std::int64_t> const& my_row) {
  detail::require(static_cast<int>(my_row.size()) == comm.size(), "exchange_byte_counts", "my_row has ",
                  my_row.size(), " entries for ", comm.size(), " ranks");
  std::vector<std::int64_t> cells(my_row.size() * my_row.size());
  comm.allgather(my_row.data(), cells.data(), static_cast<std::int64_t>(my_row.size() * sizeof(std::int64_t)));
  return byte_matrix(comm.size(), std::move(cells));
}

MOECOMM_NAMESPACE_END
