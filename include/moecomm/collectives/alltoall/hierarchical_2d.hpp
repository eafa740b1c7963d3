// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `hierarchical_2d`: Tutel's 2DH all-to-all generalised to variable-size blocks (semantics §11):
//! an intra-node exchange, then an inter-node exchange among the ranks with the same local index,
//! with block reorderings between. Each rank sends at most (G - 1) + (N - 1) messages instead of
//! N·G - 1; the receive buffer is bit for bit that of `flat`. Where the communicator checks
//! collectives, the ranks first agree on the topology and the byte matrix across the whole group
//! (`detail::agree_across_world`), so a disagreement is an `invalid_usage` on every rank, not a wait
//! in different sub-groups. Each of the three reorderings is one batched copy (`copy_blocks`: one
//! launch for its R blocks), not a copy per block.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/collectives/alltoall/alltoall_workspace.hpp>
#include <moecomm/collectives/alltoall/byte_matrix.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/alltoall/flat.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>
#include <moecomm/rows/kernels/block_copies.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Two dependent rounds; falls back to `flat` with one node or one rank per node (as Tutel does).
struct hierarchical_2d {
  static constexpr char const* name = "hierarchical_2d";

  //! Sizes `scratch`'s staging for exchanges in which no rank sends more than `max_send` bytes or
  //! receives more than `max_recv`: a rank's blocks, what its node sends its local index (twice),
  //! and what it receives.
  template <class Backend>
  void reserve(Backend const& be, topology const& topo, std::int64_t max_send, std::int64_t max_recv,
               alltoall_workspace<Backend>& scratch) const {
    if (topo.num_nodes() == 1 || topo.ranks_per_node() == 1) return;
    scratch.blocks.reserve(static_cast<std::size_t>(topo.num_ranks()));
    std::int64_t const to_my_index = std::min(topo.ranks_per_node() * max_send, topo.num_nodes() * max_recv);
    (void)scratch.staging.template get<char>(be, max_send + 2 * to_my_index + max_recv);
  }

  //! The copies it launches per exchange among `ranks` ranks (N, G > 1): three batched reorderings
  //! of `ranks` blocks each (`copy_blocks`) and the two rounds' own segments (what the exchange
  //! adviser prices).
  [[nodiscard]] static constexpr std::int32_t copy_launches(std::int32_t ranks) {
    constexpr std::int32_t per_launch = detail::block_copies_kernel::max_blocks;
    return 3 * ((ranks + per_launch - 1) / per_launch) + 2;
  }

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    topology const& topo = groups.topo();
    std::int32_t const nodes = topo.num_nodes(), locals = topo.ranks_per_node();
    agree_on_layout(groups, m, scratch.agreement);
    if (nodes == 1 || locals == 1) return flat{}.run(be, groups, m, send, recv, stats, scratch);
    std::int32_t const me = groups.world().rank();
    std::int32_t const my_node = topo.node_of(me), my_local = topo.local_of(me);
    auto const rank_at = [&](std::int32_t n, std::int32_t g) { return topo.rank_at(n, g); };
    char const* const in = static_cast<char const*>(send);

    // Segment offsets per local peer (stages A, B) and per node (C, D), kept between calls.
    scratch.offsets.assign(2 * (static_cast<std::size_t>(locals) + 1) + 2 * (static_cast<std::size_t>(nodes) + 1), 0);
    std::int64_t* const a_begin = scratch.offsets.data();
    std::int64_t* const b_begin = a_begin + locals + 1;
    std::int64_t* const c_begin = b_begin + locals + 1;
    std::int64_t* const d_begin = c_begin + nodes + 1;
    auto const intra_bytes = [&](std::int32_t src, std::int32_t g) {  // src's blocks for local index g
      std::int64_t b = 0;
      for (std::int32_t n = 0; n < nodes; ++n) b += m.bytes(src, rank_at(n, g));
      return b;
    };
    auto const node_bytes_to_me = [&](std::int32_t n) {
      std::int64_t b = 0;
      for (std::int32_t g = 0; g < locals; ++g) b += m.bytes(rank_at(n, g), me);
      return b;
    };
    for (std::int32_t g = 0; g < locals; ++g) b_begin[g + 1] = b_begin[g] + intra_bytes(rank_at(my_node, g), my_local);
    for (std::int32_t n = 0; n < nodes; ++n) d_begin[n + 1] = d_begin[n] + node_bytes_to_me(n);
    // The four stages, back to back in one staging area: A and C hold what B and D hold, resorted.
    std::int64_t const a_bytes = m.send_total(me), b_bytes = b_begin[locals], d_bytes = d_begin[nodes];
    char* const stage_a = scratch.staging.template get<char>(be, a_bytes + 2 * b_bytes + d_bytes);
    char* const stage_b = stage_a + a_bytes;
    char* const stage_c = stage_b + b_bytes;
    char* const stage_d = stage_c + b_bytes;
    // One exchange round over `comm`, whose rank `mine` is this one: peer p gets segment p of `from`
    // (`from_begin`) and sends segment p of `to` (`to_begin`); this rank's own segment is copied.
    auto const round = [&](Comm& comm, std::int32_t peers, std::int32_t mine, char const* from,
                           std::int64_t const* from_begin, char* to, std::int64_t const* to_begin, auto world_rank_of) {
      scratch.clear_messages();
      for (std::int32_t p = 0; p < peers; ++p) {
        std::int64_t const out = from_begin[p + 1] - from_begin[p];
        std::int64_t const back = to_begin[p + 1] - to_begin[p];
        if (p == mine) {
          be.copy(to + to_begin[p], from + from_begin[p], out);
          continue;
        }
        if (out > 0) scratch.sends.push_back({p, from + from_begin[p], out});
        if (back > 0) scratch.recvs.push_back({p, to + to_begin[p], back});
        stats.record(topo, me, world_rank_of(p), out);
      }
      detail::exchange_in_stream_order(comm, scratch.sends, scratch.recvs);
      stats.rounds += 1;
    };

    // 1. Reorder my blocks [destination node][destination local] -> [destination local][destination node].
    std::int64_t at = 0;
    scratch.blocks.clear();
    for (std::int32_t g = 0; g < locals; ++g) {
      a_begin[g] = at;
      for (std::int32_t n = 0; n < nodes; ++n) {
        std::int32_t const d = rank_at(n, g);
        scratch.blocks.push_back({stage_a + at, in + m.send_offset(me, d), m.bytes(me, d)});
        at += m.bytes(me, d);
      }
    }
    a_begin[locals] = at;
    copy_blocks(be, scratch.blocks);

    // 2. Intra-node: local peer g gets my blocks for (n, g), all n; I get from each local peer g'
    //    its blocks for (n, my_local), all n. Stage B is [source local][destination node].
    round(groups.intra(), locals, my_local, stage_a, a_begin, stage_b, b_begin,
          [&](std::int32_t g) { return rank_at(my_node, g); });

    // 3. Reorder [source local][destination node] -> [destination node][source local].
    at = 0;
    scratch.blocks.clear();
    for (std::int32_t n = 0; n < nodes; ++n) {
      c_begin[n] = at;
      for (std::int32_t g = 0; g < locals; ++g) {
        std::int32_t const src = rank_at(my_node, g), dst = rank_at(n, my_local);
        std::int64_t within = 0;  // offset of (src -> dst) inside src's segment of stage B
        for (std::int32_t n2 = 0; n2 < n; ++n2) within += m.bytes(src, rank_at(n2, my_local));
        scratch.blocks.push_back({stage_c + at, stage_b + b_begin[g] + within, m.bytes(src, dst)});
        at += m.bytes(src, dst);
      }
    }
    c_begin[nodes] = at;
    copy_blocks(be, scratch.blocks);

    // 4. Inter-node, among the ranks with my local index: node n gets the blocks bound for
    //    (n, my_local); I get, from each node, the blocks its ranks sent me, in local order.
    round(groups.inter(), nodes, my_node, stage_c, c_begin, stage_d, d_begin,
          [&](std::int32_t n) { return rank_at(n, my_local); });

    // 5. Blocks into source-rank order (a plain copy of whole segments when nodes are contiguous).
    at = 0;
    scratch.blocks.clear();
    for (std::int32_t n = 0; n < nodes; ++n)
      for (std::int32_t g = 0; g < locals; ++g) {
        std::int32_t const src = rank_at(n, g);
        scratch.blocks.push_back({static_cast<char*>(recv) + m.recv_offset(src, me), stage_d + at, m.bytes(src, me)});
        at += m.bytes(src, me);
      }
    copy_blocks(be, scratch.blocks);
    // No wait: the staging is reused only by later work on the same stream.
  }

 private:
  //! Ranks that disagree on the topology or the byte matrix would wait in different sub-groups until
  //! the timeout: in the checked mode they all throw `invalid_usage` at once instead.
  template <class Comm>
  static void agree_on_layout(exchange_groups<Comm>& groups, byte_matrix const& m, std::vector<std::int64_t>& gathered) {
    topology const& topo = groups.topo();
    std::uint64_t hash = 14695981039346656037ull;  // FNV-1a over the node map and the matrix
    auto const mix = [&](std::int64_t v) { hash = (hash ^ static_cast<std::uint64_t>(v)) * 1099511628211ull; };
    for (std::int32_t r = 0; r < topo.num_ranks(); ++r) mix(topo.node_of(r));
    for (std::int32_t i = 0; i < m.ranks(); ++i)
      for (std::int32_t j = 0; j < m.ranks(); ++j) mix(m.bytes(i, j));
    char const* const names[] = {"nodes", "ranks per node", "hash of node map and byte matrix"};
    std::int64_t const values[] = {topo.num_nodes(), topo.ranks_per_node(), static_cast<std::int64_t>(hash)};
    detail::agree_across_world(groups.world(), name, names, values, gathered);
  }
};

MOECOMM_NAMESPACE_END
