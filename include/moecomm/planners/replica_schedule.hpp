// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FineMoE's token scheduling over expert replicas (arXiv 2511.16947 §5.1, App. A.1;
//! reference/systems.md §4), solved exactly with integral flows instead of an LP library. Expert e
//! has replicas on the ranks G_e (at least one) and `load_e` tokens this step; a schedule splits
//! them, `x_e^g >= 0` integral with `Σ_{g∈G_e} x_e^g = load_e`. A pure host function of the
//! all-gathered counts: every rank computes the same schedule (ties go to the lower index).
//!
//! `schedule_replicas` minimises the busiest rank, `max_g Σ_{e: g∈G_e} x_e^g` (§5.1). Its optimum
//! is eq. 3 rounded up to an integer,
//!
//!   m = ⌈ max_{S ⊆ ranks} (1/|S|) · Σ_{e: G_e ⊆ S} load_e ⌉,
//!
//! because a bound B is feasible exactly when the flow network source → e (capacity load_e) → g ∈
//! G_e (unbounded) → sink (capacity B per rank) carries every token, and its minimum cuts are the
//! sets S above. Newton's method on that cut: start from the bounds S = all ranks and S = G_e; while
//! the maximum flow falls short, the source side of its minimum cut (experts X, ranks S) proves
//! B < load(X)/|S| <= m, so raise B to ⌈load(X)/|S|⌉ and augment the same flow. Each step removes
//! a breakpoint of the parametric cut, so there are at most R of them (in practice 1–3), each an
//! incremental Dinic maximum flow on E + R + 2 nodes and E + Σ|G_e| + R arcs.
//!
//! `schedule_replicas_comm_aware` adds FineMoE's communication term (App. A.1) as the total
//! volume: it minimises `B + α_intra · intra + α_inter · inter`, with B the busiest rank's tokens and
//! intra / inter the tokens a replica takes from another rank of its node / another node (a
//! rank's own tokens stay put; α is a token's transfer time over its compute time, 0.1 and 1.0 in
//! the paper). The paper charges `max_g max(send_g, recv_g)` instead, which is not a flow (an LP
//! with side constraints); the total volume is, and so is solved exactly: for a fixed B, the least
//! communication is a min-cost flow (source → (source rank, e) → g ∈ G_e at cost α of their link
//! → sink, capacity B per rank), its cost C(B) is convex and non-increasing in B and integral at
//! integer B, so a binary search on the sign of f(B+1) − f(B), f = B + C(B), over
//! [m, B of the unconstrained cheapest assignment] finds the integral optimum (the smallest B among
//! ties). Sources with the same costs to every replica of e are one node: a replica's own rank;
//! the other ranks of a node that holds a replica; all ranks of nodes that hold none. α is rounded
//! to a multiple of 2^-20 for the solve, which keeps the arithmetic integral and identical on
//! every rank; the reported objective uses α as given.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>
#include <moecomm/planners/detail/flow_network.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Where each expert's replicas live, as CSR: expert e's replicas are on the ranks
//! `ranks[offsets[e] .. offsets[e+1])`, distinct, at least one. A schedule's `split` is aligned
//! with `ranks` (entry k is the tokens of the replica on rank `ranks[k]`).
struct replica_sets {
  std::int32_t num_ranks = 0;            //!< R: ranks that may hold replicas
  std::vector<std::int32_t> offsets{0};  //!< E + 1 non-decreasing offsets into `ranks`, from 0
  std::vector<std::int32_t> ranks;       //!< the replicas' ranks, expert by expert

  //! E.
  [[nodiscard]] std::int32_t num_experts() const { return static_cast<std::int32_t>(offsets.size()) - 1; }
};

//! The replica sets of `placement` (expert by expert, ascending rank).
[[nodiscard]] inline replica_sets replica_sets_of(replica_placement const& placement) {
  return {placement.num_ranks(), placement.replica_offsets(), placement.replica_ranks()};
}

//! A min-max schedule (`schedule_replicas`).
struct replica_schedule {
  //! The busiest rank's tokens: m of eq. 3, rounded up.
  std::int64_t bound = 0;
  //! Tokens of each replica, aligned with `replica_sets::ranks`.
  std::vector<std::int64_t> split;
  //! Tokens each rank computes; none exceeds `bound`.
  std::vector<std::int64_t> rank_load;
};

//! Cost of moving one token over a link class, in units of computing one token (FineMoE App. A.1:
//! α1 = 0.1 inside a node, α2 = 1.0 between nodes). Each in [0, 1024].
struct link_weights {
  double intra_node = 0.1;
  double inter_node = 1.0;
};

//! A communication-aware schedule (`schedule_replicas_comm_aware`).
struct comm_aware_schedule {
  //! The busiest rank's tokens, B.
  std::int64_t bound = 0;
  //! Tokens of each replica, aligned with `replica_sets::ranks`.
  std::vector<std::int64_t> split;
  //! Tokens each rank computes.
  std::vector<std::int64_t> rank_load;
  //! `route[k·R + s]`: tokens rank s sends to the replica at entry k (to `ranks[k]`).
  std::vector<std::int64_t> route;
  //! Tokens that move to another rank of the same node, and to another node.
  std::int64_t intra_node_tokens = 0, inter_node_tokens = 0;
  //! `bound + α_intra · intra_node_tokens + α_inter · inter_node_tokens`, the minimum.
  double objective = 0;
};

//! What the schedulers build on the way, kept between calls so that a steady state allocates nothing.
struct replica_schedule_workspace {
  detail::flow_network net;
  std::vector<std::int64_t> load, pool_tokens, node_tokens, cheapest_load;
  std::vector<std::int32_t> rank_mark, rank_entry, node_mark, node_pool, replica_arc, sink_arc;
  std::vector<std::int32_t> pool_expert, pool_source, pool_arc_begin, pool_arc, source_pool, pool_cursor;
  std::vector<std::int64_t> pool_left;
  replica_schedule minmax;
};

namespace detail {

//! Checks the CSR (see `replica_sets`); returns E. Uses `ws.rank_mark` to find repeated ranks.
inline std::int32_t check_replica_sets(char const* op, replica_sets const& sets, replica_schedule_workspace& ws) {
  std::int32_t const ranks = sets.num_ranks;
  require(ranks > 0, op, "replica_sets.num_ranks = ", ranks, " must be positive");
  require(!sets.offsets.empty() && sets.offsets[0] == 0, op, "replica_sets.offsets must start with 0");
  std::int32_t const experts = sets.num_experts();
  require(experts > 0, op, "replica_sets.offsets has no expert (expected E + 1 >= 2 entries)");
  require(static_cast<std::size_t>(sets.offsets.back()) == sets.ranks.size(), op, "replica_sets.offsets[", experts,
          "] = ", sets.offsets.back(), " but replica_sets.ranks has ", sets.ranks.size(), " entries");
  ws.rank_mark.assign(static_cast<std::size_t>(ranks), -1);
  for (std::int32_t e = 0; e < experts; ++e) {
    std::int32_t const begin = sets.offsets[static_cast<std::size_t>(e)], end = sets.offsets[static_cast<std::size_t>(e) + 1];
    require(begin < end, op, "expert ", e, " has no replica (replica_sets.offsets[", e, "] = ", begin, ", offsets[", e + 1,
            "] = ", end, ")");
    for (std::int32_t k = begin; k < end; ++k) {
      std::int32_t const g = sets.ranks[static_cast<std::size_t>(k)];
      require(g >= 0 && g < ranks, op, "replicas of expert ", e, " name rank ", g, ", not in [0, ", ranks, ")");
      require(ws.rank_mark[static_cast<std::size_t>(g)] != e, op, "replicas of expert ", e, " name rank ", g, " twice");
      ws.rank_mark[static_cast<std::size_t>(g)] = e;
    }
  }
  return experts;
}

//! Σ `values[0..n)`, each checked non-negative (the error names `name[i]`) and the sum below
//! `limit`.
inline std::int64_t checked_total(char const* op, char const* name, std::int64_t const* values, std::size_t n,
                                  std::int64_t limit) {
  require(values != nullptr, op, name, " is null");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    require(values[i] >= 0, op, name, "[", i, "] = ", values[i], " is negative");
    require(values[i] <= limit - total, op, "the tokens of ", name, " add up to more than ", limit);
    total += values[i];
  }
  return total;
}

//! The min-max optimum for `load` (validated), the schedule in `out`. Node ids: 0 source, 1 sink,
//! 2 + g rank g, 2 + R + e expert e.
inline void min_max_schedule(replica_sets const& sets, std::int64_t const* load, std::int64_t total, replica_schedule& out,
                             replica_schedule_workspace& ws) {
  std::int32_t const ranks = sets.num_ranks, experts = sets.num_experts();
  auto const R = static_cast<std::size_t>(ranks);
  flow_network& net = ws.net;
  net.reset(2 + ranks + experts);

  // Lower bounds from eq. 3 with S = all ranks and S = G_e.
  auto const ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  std::int64_t bound = ceil_div(total, ranks);
  ws.replica_arc.assign(sets.ranks.size(), -1);
  // Added last to first: a node's arcs are visited newest first, so experts and replicas are
  // visited in index order.
  for (std::int32_t e = experts - 1; e >= 0; --e) {
    std::int64_t const l = load[static_cast<std::size_t>(e)];
    if (l == 0) continue;
    std::int32_t const begin = sets.offsets[static_cast<std::size_t>(e)], end = sets.offsets[static_cast<std::size_t>(e) + 1];
    bound = std::max(bound, ceil_div(l, end - begin));
    for (std::int32_t k = end - 1; k >= begin; --k)
      ws.replica_arc[static_cast<std::size_t>(k)] =
          net.add_arc(2 + ranks + e, 2 + sets.ranks[static_cast<std::size_t>(k)], flow_network::infinite);
    net.add_arc(0, 2 + ranks + e, l);
  }
  ws.sink_arc.resize(R);
  for (std::int32_t g = 0; g < ranks; ++g) ws.sink_arc[static_cast<std::size_t>(g)] = net.add_arc(2 + g, 1, bound);

  std::int64_t flow = 0;
  for (;;) {
    flow += net.max_flow(0, 1);
    if (flow == total) break;
    std::int64_t stuck = 0;  // load(X): experts on the source side of the cut
    std::int64_t side = 0;   // |S|: ranks on the source side, all saturated at `bound`
    for (std::int32_t e = 0; e < experts; ++e)
      if (net.reachable(2 + ranks + e)) stuck += load[static_cast<std::size_t>(e)];
    for (std::int32_t g = 0; g < ranks; ++g) side += net.reachable(2 + g) ? 1 : 0;
    if (side == 0 || stuck <= side * bound) fail(status::internal_error, "schedule_replicas", "the cut at bound ", bound, " proves nothing");
    std::int64_t const next = ceil_div(stuck, side);
    for (std::int32_t g = 0; g < ranks; ++g) net.raise_capacity(ws.sink_arc[static_cast<std::size_t>(g)], next - bound);
    bound = next;
  }

  out.bound = bound;
  out.split.resize(sets.ranks.size());
  out.rank_load.assign(R, 0);
  for (std::size_t k = 0; k < sets.ranks.size(); ++k) {
    std::int32_t const arc = ws.replica_arc[k];
    out.split[k] = arc < 0 ? 0 : net.flow(arc);
    out.rank_load[static_cast<std::size_t>(sets.ranks[k])] += out.split[k];
  }
}

}  // namespace detail

//! `load[e] = Σ_s counts[s][e]` from the all-gathered row-major `[R][E]` counts.
//! @throws error (invalid_argument) when `counts` holds fewer than R x E entries.
inline void expert_loads(array_view<std::int64_t const> counts, std::int32_t ranks, std::int32_t experts,
                         std::vector<std::int64_t>& load) {
  detail::require(ranks >= 0 && experts >= 0, "expert_loads", "ranks = ", ranks, ", experts = ", experts, " must be >= 0");
  detail::check_elements(counts, std::int64_t{ranks} * experts, "expert_loads", "counts", "R x E token counts");
  load.assign(static_cast<std::size_t>(experts), 0);
  for (std::int32_t s = 0; s < ranks; ++s)
    for (std::int32_t e = 0; e < experts; ++e)
      load[static_cast<std::size_t>(e)] += counts.data[static_cast<std::size_t>(s) * static_cast<std::size_t>(experts) + static_cast<std::size_t>(e)];
}

//! The integral split of each expert's tokens over its replicas that minimises the busiest rank
//! (FineMoE §5.1; the optimum is eq. 3 rounded up). See the file comment for the algorithm.
//! @param sets  the replicas of each expert (E = sets.num_experts())
//! @param load  E token counts, `load[e]` routed to expert e this step
//! @param[out] out        overwritten (its vectors keep their capacity)
//! @param workspace       scratch kept between calls
//! @throws error (invalid_argument) naming the field: num_ranks not positive, offsets malformed, an
//!         expert without replicas, a replica rank out of range or repeated, load shorter than E or
//!         negative, a total above 2^60 tokens.
inline void schedule_replicas(replica_sets const& sets, array_view<std::int64_t const> load, replica_schedule& out,
                              replica_schedule_workspace& workspace) {
  char const* const op = "schedule_replicas";
  std::int32_t const experts = detail::check_replica_sets(op, sets, workspace);
  detail::check_elements(load, experts, op, "load", "one token count per expert of replica_sets");
  std::int64_t const total = detail::checked_total(op, "load", load.data, static_cast<std::size_t>(experts), std::int64_t{1} << 60);
  detail::min_max_schedule(sets, load.data, total, out, workspace);
}

//! `schedule_replicas` as a one-off call returning a fresh schedule.
[[nodiscard]] inline replica_schedule schedule_replicas(replica_sets const& sets, std::vector<std::int64_t> const& load) {
  detail::require(load.size() == static_cast<std::size_t>(std::max(sets.num_experts(), 0)), "schedule_replicas", "load has ",
                  load.size(), " entries, replica_sets has ", sets.num_experts(), " experts");
  replica_schedule out;
  replica_schedule_workspace workspace;
  schedule_replicas(sets, load, out, workspace);
  return out;
}

//! The integral split and token routing that minimise `B + α_intra·intra + α_inter·inter` (see
//! the file comment; FineMoE App. A.1 with the communication as total volume). Cost: one min-max
//! solve, then one min-cost flow per probed bound, 2·⌈log2(B_cheapest − m + 1)⌉ + 1 of them.
//! @param topo    which ranks share a node; `topo.num_ranks() == sets.num_ranks`
//! @param alpha   cost of a token moved inside a node / between nodes, per token computed
//! @param counts  row-major `[R][E]`: tokens rank s routes to expert e
//! @param[out] out        overwritten (its vectors keep their capacity)
//! @throws error (invalid_argument) as `schedule_replicas`, and for a topology of another size, an
//!         α outside [0, 1024], counts negative (naming `counts[s·E + e]`), or more than 2^31
//!         tokens in total.
inline void schedule_replicas_comm_aware(replica_sets const& sets, topology const& topo, link_weights const& alpha,
                                         array_view<std::int64_t const> counts, comm_aware_schedule& out,
                                         replica_schedule_workspace& workspace) {
  char const* const op = "schedule_replicas_comm_aware";
  replica_schedule_workspace& ws = workspace;
  std::int32_t const experts = detail::check_replica_sets(op, sets, ws);
  std::int32_t const ranks = sets.num_ranks;
  detail::require(topo.num_ranks() == ranks, op, "topo has ", topo.num_ranks(), " ranks, replica_sets.num_ranks = ", ranks);
  for (auto const& [name, a] : {std::pair<char const*, double>{"intra_node", alpha.intra_node}, {"inter_node", alpha.inter_node}})
    detail::require(a >= 0 && a <= 1024, op, "link_weights.", name, " = ", a, " is not in [0, 1024]");
  auto const R = static_cast<std::size_t>(ranks), E = static_cast<std::size_t>(experts);
  // 2^31 tokens at 2^20 · (1 + 1024) per token stay below 2^62.
  detail::check_elements(counts, static_cast<std::int64_t>(R * E), op, "counts", "R x E token counts");
  std::int64_t const total = detail::checked_total(op, "counts", counts.data, R * E, std::int64_t{1} << 31);

  // The busiest rank can do no better than the min-max optimum m.
  expert_loads(counts, ranks, experts, ws.load);
  detail::min_max_schedule(sets, ws.load.data(), total, ws.minmax, ws);
  std::int64_t const least_bound = ws.minmax.bound;

  constexpr std::int64_t unit = std::int64_t{1} << 20;  // one token computed
  std::int64_t const cost_intra = std::llround(alpha.intra_node * unit), cost_inter = std::llround(alpha.inter_node * unit);
  auto const link_cost = [&](std::int32_t s, std::int32_t g) { return s == g ? 0 : topo.same_node(s, g) ? cost_intra : cost_inter; };

  // Nodes: 0 source, 1 sink, 2 + g rank g, then one per pool (sources of one expert with the
  // same link costs to all its replicas). `source_pool[s·E + e]` remembers each source's pool.
  detail::flow_network& net = ws.net;
  net.reset(2 + ranks);
  ws.rank_mark.assign(R, -1);
  ws.rank_entry.assign(R, 0);
  ws.node_mark.assign(static_cast<std::size_t>(topo.num_nodes()), -1);
  ws.node_pool.assign(static_cast<std::size_t>(topo.num_nodes()), -1);
  ws.node_tokens.assign(static_cast<std::size_t>(topo.num_nodes()), 0);
  ws.source_pool.assign(R * E, -1);
  ws.cheapest_load.assign(R, 0);
  ws.pool_expert.clear();
  ws.pool_source.clear();
  ws.pool_arc_begin.clear();
  ws.pool_arc.clear();
  ws.pool_tokens.clear();
  for (std::int32_t e = 0; e < experts; ++e) {
    std::int32_t const begin = sets.offsets[static_cast<std::size_t>(e)], end = sets.offsets[static_cast<std::size_t>(e) + 1];
    for (std::int32_t k = begin; k < end; ++k) {
      auto const g = static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(k)]);
      ws.rank_mark[g] = e;
      ws.rank_entry[g] = k;
      ws.node_mark[static_cast<std::size_t>(topo.node_of(static_cast<std::int32_t>(g)))] = e;
    }
    // Pool ids: a replica's own rank, then the rest of a replica's node, then every other node.
    std::int32_t far_pool = -1;
    auto const new_pool = [&](std::int32_t source) {  // `source` has the pool's link costs
      auto const p = static_cast<std::int32_t>(ws.pool_expert.size());
      ws.pool_expert.push_back(e);
      ws.pool_source.push_back(source);
      ws.pool_tokens.push_back(0);
      return p;
    };
    for (std::int32_t s = 0; s < ranks; ++s) {
      std::int64_t const c = counts.data[static_cast<std::size_t>(s) * E + static_cast<std::size_t>(e)];
      if (c == 0) continue;
      auto const node = static_cast<std::size_t>(topo.node_of(s));
      std::int32_t p;
      if (ws.rank_mark[static_cast<std::size_t>(s)] == e) {
        p = new_pool(s);
      } else if (ws.node_mark[node] == e) {
        if (ws.node_pool[node] < 0 || ws.pool_expert[static_cast<std::size_t>(ws.node_pool[node])] != e) ws.node_pool[node] = new_pool(s);
        p = ws.node_pool[node];
      } else {
        if (far_pool < 0) far_pool = new_pool(s);
        p = far_pool;
      }
      ws.pool_tokens[static_cast<std::size_t>(p)] += c;
      ws.source_pool[static_cast<std::size_t>(s) * E + static_cast<std::size_t>(e)] = p;
    }
  }

  // Arcs: source -> pool, pool -> each replica of its expert at the link's cost, rank -> sink.
  std::size_t const pools = ws.pool_expert.size();
  for (std::size_t p = 0; p < pools; ++p) {
    std::int32_t const e = ws.pool_expert[p], representative = ws.pool_source[p];
    std::int32_t const begin = sets.offsets[static_cast<std::size_t>(e)], end = sets.offsets[static_cast<std::size_t>(e) + 1];
    std::int32_t const node = net.add_node();
    ws.pool_arc_begin.push_back(static_cast<std::int32_t>(ws.pool_arc.size()));
    ws.pool_arc.resize(ws.pool_arc.size() + static_cast<std::size_t>(end - begin));
    std::int32_t cheapest = end - 1;
    for (std::int32_t k = end - 1; k >= begin; --k) {  // newest first: replicas visited in order
      std::int32_t const g = sets.ranks[static_cast<std::size_t>(k)];
      std::int64_t const cost = link_cost(representative, g);
      ws.pool_arc[static_cast<std::size_t>(ws.pool_arc_begin[p] + k - begin)] = net.add_arc(node, 2 + g, detail::flow_network::infinite, cost);
      if (cost <= link_cost(representative, sets.ranks[static_cast<std::size_t>(cheapest)])) cheapest = k;
    }
    ws.cheapest_load[static_cast<std::size_t>(sets.ranks[static_cast<std::size_t>(cheapest)])] += ws.pool_tokens[p];
    net.add_arc(0, node, ws.pool_tokens[p]);
  }
  ws.sink_arc.resize(R);
  for (std::int32_t g = 0; g < ranks; ++g) ws.sink_arc[static_cast<std::size_t>(g)] = net.add_arc(2 + g, 1, least_bound);

  // f(B) = B + C(B) in units of 2^-20 token; B = most_bound already has the unconstrained C.
  std::int64_t const most_bound = std::max(least_bound, *std::max_element(ws.cheapest_load.begin(), ws.cheapest_load.end()));
  std::int64_t solved_at = -1;
  auto const f = [&](std::int64_t bound) {
    for (std::int32_t arc : ws.sink_arc) net.set_capacity(arc, bound);
    solved_at = bound;
    return bound * unit + net.min_cost_max_flow(0, 1);
  };
  std::int64_t lo = least_bound, hi = most_bound;
  while (lo < hi) {
    std::int64_t const mid = lo + (hi - lo) / 2;
    if (f(mid + 1) < f(mid)) lo = mid + 1;
    else hi = mid;
  }
  if (solved_at != lo) f(lo);

  // Per replica: the flow of its arcs. Per source, in rank order: its tokens of e taken from its
  // pool's arcs in replica order.
  out.split.assign(sets.ranks.size(), 0);
  out.rank_load.assign(R, 0);
  out.route.assign(sets.ranks.size() * R, 0);
  ws.pool_cursor.assign(pools, 0);
  ws.pool_left.resize(pools);
  for (std::size_t p = 0; p < pools; ++p) {
    std::int32_t const begin = sets.offsets[static_cast<std::size_t>(ws.pool_expert[p])];
    std::int32_t const size = sets.offsets[static_cast<std::size_t>(ws.pool_expert[p]) + 1] - begin;
    for (std::int32_t j = 0; j < size; ++j)
      out.split[static_cast<std::size_t>(begin + j)] += net.flow(ws.pool_arc[static_cast<std::size_t>(ws.pool_arc_begin[p] + j)]);
    ws.pool_left[p] = net.flow(ws.pool_arc[static_cast<std::size_t>(ws.pool_arc_begin[p])]);
  }
  out.intra_node_tokens = out.inter_node_tokens = 0;
  for (std::int32_t s = 0; s < ranks; ++s)
    for (std::size_t e = 0; e < E; ++e) {
      std::int64_t c = counts.data[static_cast<std::size_t>(s) * E + e];
      if (c == 0) continue;
      auto const p = static_cast<std::size_t>(ws.source_pool[static_cast<std::size_t>(s) * E + e]);
      std::int32_t const begin = sets.offsets[e];
      while (c > 0) {
        std::int32_t& j = ws.pool_cursor[p];
        std::int64_t const take = std::min(c, ws.pool_left[p]);
        std::int32_t const k = begin + j;
        out.route[static_cast<std::size_t>(k) * R + static_cast<std::size_t>(s)] += take;
        std::int32_t const g = sets.ranks[static_cast<std::size_t>(k)];
        if (g != s) (topo.same_node(s, g) ? out.intra_node_tokens : out.inter_node_tokens) += take;
        c -= take;
        ws.pool_left[p] -= take;
        if (ws.pool_left[p] == 0 && c > 0) {
          ++j;
          ws.pool_left[p] = net.flow(ws.pool_arc[static_cast<std::size_t>(ws.pool_arc_begin[p] + j)]);
        }
      }
    }
  for (std::size_t k = 0; k < sets.ranks.size(); ++k) out.rank_load[static_cast<std::size_t>(sets.ranks[k])] += out.split[k];
  out.bound = *std::max_element(out.rank_load.begin(), out.rank_load.end());
  out.objective = static_cast<double>(out.bound) + alpha.intra_node * static_cast<double>(out.intra_node_tokens) +
                  alpha.inter_node * static_cast<double>(out.inter_node_tokens);
}

//! `schedule_replicas_comm_aware` as a one-off call returning a fresh schedule.
[[nodiscard]] inline comm_aware_schedule schedule_replicas_comm_aware(replica_sets const& sets, topology const& topo,
                                                                      link_weights const& alpha,
                                                                      std::vector<std::int64_t> const& counts) {
  detail::require(counts.size() == static_cast<std::size_t>(sets.num_ranks) * static_cast<std::size_t>(std::max(sets.num_experts(), 0)),
                  "schedule_replicas_comm_aware", "counts has ", counts.size(), " entries, expected R x E = ", sets.num_ranks,
                  " x ", sets.num_experts());
  comm_aware_schedule out;
  replica_schedule_workspace workspace;
  schedule_replicas_comm_aware(sets, topo, alpha, counts, out, workspace);
  return out;
}

MOECOMM_NAMESPACE_END
