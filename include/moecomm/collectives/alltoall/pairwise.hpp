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
#include <moecomm/collectives/alltoall/byte_matrix.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/alltoall/flat.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

namespace detail {

//! The first rank of the group that pairwise step `step` brings rank `me` rows from (groups of
//! `group_size` consecutive ranks, `num_groups` of them).
inline std::int32_t pairwise_source(std::int32_t me, std::int32_t group_size, std::int32_t num_groups, std::int32_t step) {
  return (me / group_size - step % num_groups + num_groups) % num_groups * group_size;
}

//! Step `step` of the pairwise exchange of `m`: this rank's group sends to group `g + step` and
//! receives from group `g - step` (groups of `group_size` consecutive ranks; the self block is
//! not part of any step). One round.
template <class Backend, class Comm>
void pairwise_step(std::int32_t group_size, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send,
                   void* recv, std::int32_t step, alltoall_stats& stats, alltoall_workspace<Backend>& scratch) {
  Comm& comm = groups.world();
  std::int32_t const me = comm.rank();
  std::int32_t const num_groups = m.ranks() / group_size;
  std::int32_t const mine = me / group_size;
  std::int32_t const to = (mine + step) % num_groups;
  std::int32_t const from = pairwise_source(me, group_size, num_groups, step) / group_size;
  scratch.clear_messages();
  std::vector<send_block>& sends = scratch.sends;
  std::vector<recv_block>& recvs = scratch.recvs;
  for (std::int32_t i = 0; i < group_size; ++i) {
    std::int32_t const dst = to * group_size + i, src = from * group_size + i;
    if (dst != me && m.bytes(me, dst) > 0)
      sends.push_back({dst, static_cast<char const*>(send) + m.send_offset(me, dst), m.bytes(me, dst)});
    if (src != me && m.bytes(src, me) > 0)
      recvs.push_back({src, static_cast<char*>(recv) + m.recv_offset(src, me), m.bytes(src, me)});
    stats.record(groups.topo(), me, dst, m.bytes(me, dst));
  }
  detail::exchange_in_stream_order(comm, sends, recvs);
  stats.rounds += 1;
}

inline void validate_group_size(char const* op, std::int32_t group_size, std::int32_t ranks) {
  require(group_size > 0 && ranks % group_size == 0, op, "group_size = ", group_size,
          " must be positive and divide the ", ranks, " ranks");
}

}  // namespace detail

//! R / group_size rounds; the same messages as `flat`, in a fixed order.
struct pairwise {
  static constexpr char const* name = "pairwise";
  std::int32_t group_size = 1;  //!< ranks per group; must divide R

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    detail::validate_group_size("alltoallv<pairwise>", group_size, m.ranks());
    detail::copy_self_block(be, m, groups.world().rank(), send, recv);
    for (std::int32_t step = 0; step < m.ranks() / group_size; ++step)
      detail::pairwise_step(group_size, groups, m, send, recv, step, stats, scratch);
  }
};

//! FasterMoE's smart schedule (§4.2): the `pairwise` steps, with the experts' work on step j's
//! rows overlapping the exchange of step j + 1, and each step's results returned as soon as they
//! are computed. `expert_parallel_layer` runs its forward and backward so; as a plain all-to-all
//! (`alltoallv`) it is `pairwise`.
struct smart_schedule {
  static constexpr char const* name = "smart_schedule";
  std::int32_t group_size = 1;  //!< ranks per group; must divide R (fastmoe's FMOE_FASTER_GROUP_SIZE)

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    pairwise{group_size}.run(be, groups, m, send, recv, stats, scratch);
  }
};

MOECOMM_NAMESPACE_END
