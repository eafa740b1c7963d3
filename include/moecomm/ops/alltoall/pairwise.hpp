// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `pairwise`: FasterMoE's smart schedule (semantics §11; reference/systems.md): ranks in groups of
//! `group_size`; in step j group g sends to group g + j and receives from group g - j. Each step
//! is its own round, so a later step's exchange can overlap the expert work on an earlier step's
//! rows.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/alltoall/byte_matrix.hpp>
#include <moecomm/ops/alltoall/exchange_groups.hpp>
#include <moecomm/ops/alltoall/flat.hpp>
#include <moecomm/ops/alltoall/stats.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! R / group_size rounds; the same messages as `flat`, in a fixed order.
struct pairwise {
  static constexpr char const* name = "pairwise";
  std::int32_t group_size = 1;  //!< ranks per group; must divide R

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats) const {
    Comm& comm = groups.world();
    std::int32_t const me = comm.rank();
    detail::require(group_size > 0 && m.ranks() % group_size == 0, "alltoallv<pairwise>", "group_size = ", group_size,
                    " must be positive and divide the ", m.ranks(), " ranks");
    std::int32_t const num_groups = m.ranks() / group_size;
    std::int32_t const mine = me / group_size;
    detail::copy_self_block(be, m, me, send, recv);
    for (std::int32_t step = 0; step < num_groups; ++step) {
      std::int32_t const to = (mine + step) % num_groups;
      std::int32_t const from = (mine - step + num_groups) % num_groups;
      std::vector<send_block> sends;
      std::vector<recv_block> recvs;
      for (std::int32_t i = 0; i < group_size; ++i) {
        std::int32_t const dst = to * group_size + i, src = from * group_size + i;
        if (dst != me && m.bytes(me, dst) > 0)
          sends.push_back({dst, static_cast<char const*>(send) + m.send_offset(me, dst), m.bytes(me, dst)});
        if (src != me && m.bytes(src, me) > 0)
          recvs.push_back({src, static_cast<char*>(recv) + m.recv_offset(src, me), m.bytes(src, me)});
        stats.record(groups.topo(), me, dst, m.bytes(me, dst));
      }
      comm.exchange(sends, recvs);
      stats.rounds += 1;
    }
  }
};

MOECOMM_NAMESPACE_END
