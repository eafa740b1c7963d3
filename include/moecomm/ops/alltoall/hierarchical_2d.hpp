// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `hierarchical_2d`: Tutel's 2DH all-to-all generalised to variable-size blocks (semantics §11):
//! an intra-node exchange, then an inter-node exchange among the ranks with the same local index,
//! with block reorderings between. Each rank sends at most (G - 1) + (N - 1) messages instead of
//! N·G - 1; the receive buffer is bit for bit that of `flat`. Where the communicator checks
//! collectives, the ranks first agree on the topology and the byte matrix across the whole group
//! (`detail::agree_across_world`), so a disagreement is an `invalid_usage` on every rank, not a wait
//! in different sub-groups.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/ops/alltoall/byte_matrix.hpp>
#include <moecomm/ops/alltoall/exchange_groups.hpp>
#include <moecomm/ops/alltoall/flat.hpp>
#include <moecomm/ops/alltoall/stats.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Two dependent rounds; falls back to `flat` with one node or one rank per node (as Tutel does).
struct hierarchical_2d {
  static constexpr char const* name = "hierarchical_2d";

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats) const {
    topology const& topo = groups.topo();
    std::int32_t const nodes = topo.num_nodes(), locals = topo.ranks_per_node();
    agree_on_layout(groups, m);
    if (nodes == 1 || locals == 1) return flat{}.run(be, groups, m, send, recv, stats);
    std::int32_t const me = groups.world().rank();
    std::int32_t const my_node = topo.node_of(me), my_local = topo.local_of(me);
    auto const rank_at = [&](std::int32_t n, std::int32_t g) { return topo.rank_at(n, g); };
    char const* const in = static_cast<char const*>(send);

    // 1. Reorder my blocks [destination node][destination local] -> [destination local][destination node].
    auto stage_a = be.template allocate<char>(m.send_total(me));
    std::vector<std::int64_t> a_begin(static_cast<std::size_t>(locals) + 1, 0);  // segment per local peer
    std::int64_t at = 0;
    for (std::int32_t g = 0; g < locals; ++g) {
      a_begin[static_cast<std::size_t>(g)] = at;
      for (std::int32_t n = 0; n < nodes; ++n) {
        std::int32_t const d = rank_at(n, g);
        be.copy(stage_a.data() + at, in + m.send_offset(me, d), m.bytes(me, d));
        at += m.bytes(me, d);
      }
    }
    a_begin[static_cast<std::size_t>(locals)] = at;

    // 2. Intra-node: local peer g gets my blocks for (n, g), all n; I get from each local peer g'
    //    its blocks for (n, my_local), all n. Stage B is [source local][destination node].
    auto const intra_bytes = [&](std::int32_t src, std::int32_t g) {  // src's blocks for local index g
      std::int64_t b = 0;
      for (std::int32_t n = 0; n < nodes; ++n) b += m.bytes(src, rank_at(n, g));
      return b;
    };
    std::vector<std::int64_t> b_begin(static_cast<std::size_t>(locals) + 1, 0);
    for (std::int32_t g = 0; g < locals; ++g)
      b_begin[static_cast<std::size_t>(g) + 1] = b_begin[static_cast<std::size_t>(g)] + intra_bytes(rank_at(my_node, g), my_local);
    auto stage_b = be.template allocate<char>(b_begin.back());
    {
      std::vector<send_block> sends;
      std::vector<recv_block> recvs;
      for (std::int32_t g = 0; g < locals; ++g) {
        std::int64_t const out = a_begin[static_cast<std::size_t>(g) + 1] - a_begin[static_cast<std::size_t>(g)];
        std::int64_t const back = b_begin[static_cast<std::size_t>(g) + 1] - b_begin[static_cast<std::size_t>(g)];
        if (g == my_local) {
          be.copy(stage_b.data() + b_begin[static_cast<std::size_t>(g)], stage_a.data() + a_begin[static_cast<std::size_t>(g)], out);
          continue;
        }
        if (out > 0) sends.push_back({g, stage_a.data() + a_begin[static_cast<std::size_t>(g)], out});
        if (back > 0) recvs.push_back({g, stage_b.data() + b_begin[static_cast<std::size_t>(g)], back});
        stats.record(topo, me, rank_at(my_node, g), out);
      }
      groups.intra().exchange(sends, recvs);
      stats.rounds += 1;
    }

    // 3. Reorder [source local][destination node] -> [destination node][source local].
    auto stage_c = be.template allocate<char>(b_begin.back());
    std::vector<std::int64_t> c_begin(static_cast<std::size_t>(nodes) + 1, 0);  // segment per node
    at = 0;
    for (std::int32_t n = 0; n < nodes; ++n) {
      c_begin[static_cast<std::size_t>(n)] = at;
      for (std::int32_t g = 0; g < locals; ++g) {
        std::int32_t const src = rank_at(my_node, g), dst = rank_at(n, my_local);
        std::int64_t within = 0;  // offset of (src -> dst) inside src's segment of stage B
        for (std::int32_t n2 = 0; n2 < n; ++n2) within += m.bytes(src, rank_at(n2, my_local));
        be.copy(stage_c.data() + at, stage_b.data() + b_begin[static_cast<std::size_t>(g)] + within, m.bytes(src, dst));
        at += m.bytes(src, dst);
      }
    }
    c_begin[static_cast<std::size_t>(nodes)] = at;

    // 4. Inter-node, among the ranks with my local index: node n gets the blocks bound for
    //    (n, my_local); I get, from each node, the blocks its ranks sent me, in local order.
    auto const node_bytes_to_me = [&](std::int32_t n) {
      std::int64_t b = 0;
      for (std::int32_t g = 0; g < locals; ++g) b += m.bytes(rank_at(n, g), me);
      return b;
    };
    std::vector<std::int64_t> d_begin(static_cast<std::size_t>(nodes) + 1, 0);
    for (std::int32_t n = 0; n < nodes; ++n)
      d_begin[static_cast<std::size_t>(n) + 1] = d_begin[static_cast<std::size_t>(n)] + node_bytes_to_me(n);
    auto stage_d = be.template allocate<char>(d_begin.back());  // [source node][source local]
    {
      std::vector<send_block> sends;
      std::vector<recv_block> recvs;
      for (std::int32_t n = 0; n < nodes; ++n) {
        std::int64_t const out = c_begin[static_cast<std::size_t>(n) + 1] - c_begin[static_cast<std::size_t>(n)];
        std::int64_t const back = d_begin[static_cast<std::size_t>(n) + 1] - d_begin[static_cast<std::size_t>(n)];
        if (n == my_node) {
          be.copy(stage_d.data() + d_begin[static_cast<std::size_t>(n)], stage_c.data() + c_begin[static_cast<std::size_t>(n)], out);
          continue;
        }
        if (out > 0) sends.push_back({n, stage_c.data() + c_begin[static_cast<std::size_t>(n)], out});
        if (back > 0) recvs.push_back({n, stage_d.data() + d_begin[static_cast<std::size_t>(n)], back});
        stats.record(topo, me, rank_at(n, my_local), out);
      }
      groups.inter().exchange(sends, recvs);
      stats.rounds += 1;
    }

    // 5. Blocks into source-rank order (a plain copy of whole segments when nodes are contiguous).
    at = 0;
    for (std::int32_t n = 0; n < nodes; ++n)
      for (std::int32_t g = 0; g < locals; ++g) {
        std::int32_t const src = rank_at(n, g);
        be.copy(static_cast<char*>(recv) + m.recv_offset(src, me), stage_d.data() + at, m.bytes(src, me));
        at += m.bytes(src, me);
      }
    be.synchronize();  // the staging buffers are released on return
  }

 private:
  //! Ranks that disagree on the topology or the byte matrix would wait in different sub-groups until
  //! the timeout: in the checked mode they all throw `invalid_usage` at once instead.
  template <class Comm>
  static void agree_on_layout(exchange_groups<Comm>& groups, byte_matrix const& m) {
    topology const& topo = groups.topo();
    std::uint64_t hash = 14695981039346656037ull;  // FNV-1a over the node map and the matrix
    auto const mix = [&](std::int64_t v) { hash = (hash ^ static_cast<std::uint64_t>(v)) * 1099511628211ull; };
    for (std::int32_t r = 0; r < topo.num_ranks(); ++r) mix(topo.node_of(r));
    for (std::int32_t i = 0; i < m.ranks(); ++i)
      for (std::int32_t j = 0; j < m.ranks(); ++j) mix(m.bytes(i, j));
    char const* const names[] = {"nodes", "ranks per node", "hash of node map and byte matrix"};
    std::int64_t const values[] = {topo.num_nodes(), topo.ranks_per_node(), static_cast<std::int64_t>(hash)};
    detail::agree_across_world(groups.world(), name, names, values);
  }
};

MOECOMM_NAMESPACE_END
