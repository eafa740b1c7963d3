// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `flat`: the all-to-all as one grouped exchange with every peer (semantics §11).

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/collectives/alltoall/alltoall_workspace.hpp>
#include <moecomm/collectives/alltoall/byte_matrix.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Copies this rank's block to itself; no message.
template <class Backend>
void copy_self_block(Backend const& be, byte_matrix const& m, std::int32_t me, void const* send, void* recv) {
  be.copy(static_cast<char*>(recv) + m.recv_offset(me, me), static_cast<char const*>(send) + m.send_offset(me, me),
          m.bytes(me, me));
}

}  // namespace detail

//! One round: R - 1 messages per rank (every non-empty block), plus the self-copy.
struct flat {
  static constexpr char const* name = "flat";

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    Comm& comm = groups.world();
    std::int32_t const me = comm.rank();
    scratch.clear_messages();
    std::vector<send_block>& sends = scratch.sends;
    std::vector<recv_block>& recvs = scratch.recvs;
    for (std::int32_t peer = 0; peer < m.ranks(); ++peer) {
      if (peer == me) continue;
      if (m.bytes(me, peer) > 0)
        sends.push_back({peer, static_cast<char const*>(send) + m.send_offset(me, peer), m.bytes(me, peer)});
      if (m.bytes(peer, me) > 0)
        recvs.push_back({peer, static_cast<char*>(recv) + m.recv_offset(peer, me), m.bytes(peer, me)});
      stats.record(groups.topo(), me, peer, m.bytes(me, peer));
    }
    detail::copy_self_block(be, m, me, send, recv);
    detail::exchange_in_stream_order(comm, sends, recvs);
    stats.rounds += 1;
  }
};

MOECOMM_NAMESPACE_END
