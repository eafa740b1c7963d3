// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `exchange_adviser`: which all-to-all algorithm to give the dispatcher (`flat`, `hierarchical_2d`,
//! `dedup_per_rank<flat>`, `dedup_per_node`) for a cluster, a row size and a routing step. Each
//! candidate's route, dispatch and combine are predicted from the cluster's links (`cluster_spec`)
//! and the routing's exact byte matrices, without running anything (0.6-115 ms of host time);
//! the candidates come back fastest first.
//!
//! The model (docs/performance.md, "The exchange adviser", validates it against the simulation):
//! - rounds of messages, all-gathers and memory kernels are priced by `link_model`;
//! - an algorithm is a sequence of dependent rounds: `flat` one; `hierarchical_2d` an intra-node
//!   round then an inter-node one between ranks of equal local index; `dedup_per_node` a rail-aligned
//!   round to the relays and an intra-node one, overlapped in `pieces`: P + 1 rounds, the first of
//!   1/P of the first hop's bytes, the last of 1/P of the second's, the P − 1 between of 1/P of
//!   both at once, the relay's copy (or sum) of each piece between them (and a launch per piece
//!   for each hop's block to itself);
//! - `route` is the ring all-gather of the counts (n - 1 dependent steps), and for the deduplicated
//!   exchanges the slot lists (8·K bytes a row; per node twice, 4 more with pieces: the row's source
//!   token), its count row wider by the pieces' counts (P·R words);
//! - `route` builds its permute plans, each in `plan_kernels` launches (sort keys, sort, offsets, row
//!   maps, the validity reduce, the read-back), and a deduplicated hop runs `hop_kernels` more (the
//!   home table, the slot lists, their split): `flat` 1 plan, `dedup_per_rank` 3 (the routing's, the
//!   source's, the receive map) and 1 hop, `dedup_per_node` 4 and 2 hops (and the relay's origins);
//! - the row kernels move their bytes at HBM bandwidth, each launch costing `kernel_launch_seconds`
//!   (permute, the chunk sort or the receive map, the relay's copy and sum, unpermute;
//!   `hierarchical_2d`'s three batched block copies and two own-segment copies).
//! What it leaves out: the plans' kernels' bytes, and what `link_model` leaves out.

#include <moecomm/config.hpp>
#include <moecomm/collectives/alltoall/dedup_per_node.hpp>
#include <moecomm/collectives/alltoall/hierarchical_2d.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>
#include <moecomm/models/link_model.hpp>
#include <moecomm/core/cluster_spec.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! One candidate's predicted times (seconds) and traffic.
struct exchange_prediction {
  std::string algorithm;        //!< "flat", "hierarchical_2d", "dedup_per_rank", "dedup_per_node"
  double route_seconds = 0;     //!< the counts' all-gather and, deduplicated, the slot lists
  double dispatch_seconds = 0;  //!< the rows to the experts, after `route`
  double combine_seconds = 0;   //!< the rows back, summed
  double inter_node_bytes = 0;  //!< dispatch row bytes that cross between nodes, mean per rank
  double intra_node_bytes = 0;  //!< dispatch row bytes that move inside nodes, mean per rank
  [[nodiscard]] double seconds() const { return route_seconds + dispatch_seconds + combine_seconds; }
};

class exchange_adviser {
 public:
  static constexpr int plan_kernels = 6;  //!< launches that build one permute plan
  static constexpr int hop_kernels = 3;   //!< launches a deduplicated hop adds to `route`

  //! @param spec the cluster; @param topo the ranks' nodes and domains (e.g. the first GPUs:
  //! `topology(R, spec.gpus_per_node, spec.nodes_per_domain)`).
  //! @throws error (invalid_argument) naming the field of `spec` that is invalid (a cluster of more
  //!   than `cluster_spec::max_gpus` GPUs, say), or `topo` when it has more ranks than `spec` GPUs.
  //! @param dedup_pieces `dedup_per_node::pieces` of the candidate it prices.
  exchange_adviser(cluster_spec spec, topology topo, std::int32_t dedup_pieces = dedup_per_node{}.pieces)
      : links_(std::move(spec), std::move(topo)), pieces_(dedup_pieces) {
    detail::require(links_.ranks() <= links_.spec().num_gpus(), "exchange_adviser", "argument 'topo' has ", links_.ranks(),
                    " ranks; they must be in [1, the platform's ", links_.spec().num_gpus(), " GPUs]");
    detail::require(dedup_pieces >= 1, "exchange_adviser", "dedup_pieces = ", dedup_pieces, " must be at least 1");
  }

  //! Every candidate for one routing step, fastest first. `routing[r]` is rank r's routing (host
  //! memory; expert e on rank e / (E / R); -1 masked), `row_bytes` a token row's size. `groups`:
  //! the exchange runs on each of these disjoint groups of n ranks (each its own communicator, a
  //! rank's routing addressing its group's experts only), side by side, so each group all-gathers
  //! its own counts (Megatron's EP groups); empty: one group of every rank.
  //! @throws error (invalid_argument) naming the argument: one routing per rank, each of the same
  //! top_k in [1, num_experts] with its ids given, experts a multiple of the ranks, a positive
  //! finite row size, groups of one size covering the ranks.
  [[nodiscard]] std::vector<exchange_prediction> rank(std::vector<routing_view> const& routing, std::int32_t num_experts,
                                                      double row_bytes, std::vector<std::vector<std::int32_t>> const& groups = {}) const {
    std::int32_t const R = links_.topo().num_ranks();
    detail::require(static_cast<std::int32_t>(routing.size()) == R, "exchange_adviser::rank", "argument 'routing' has ",
                    routing.size(), " ranks' routings; the topology has ", R);
    detail::require(num_experts > 0 && num_experts % R == 0, "exchange_adviser::rank", "num_experts = ", num_experts,
                    " must be a positive multiple of the ", R, " ranks");
    detail::require(row_bytes > 0 && std::isfinite(row_bytes), "exchange_adviser::rank", "row_bytes = ", row_bytes,
                    " must be positive and finite");
    std::int32_t const top_k = routing[0].top_k;
    detail::require(top_k >= 1 && top_k <= num_experts, "exchange_adviser::rank", "top_k = ", top_k, " must be in [1, num_experts = ",
                    num_experts, "]: a token's slots name distinct experts");
    for (std::int32_t s = 0; s < R; ++s) {
      routing_view const& v = routing[static_cast<std::size_t>(s)];
      detail::require(v.top_k == top_k && top_k > 0, "exchange_adviser::rank", "routing[", s, "].top_k = ", v.top_k,
                      "; routing[0].top_k = ", top_k, " (every rank's, positive)");
      detail::require(v.num_tokens >= 0 && (v.num_tokens == 0 || v.topk_idx != nullptr), "exchange_adviser::rank", "routing[", s,
                      "] has ", v.num_tokens, " tokens and topk_idx ", v.topk_idx == nullptr ? "null" : "given");
    }
    std::int32_t const n = groups.empty() ? R : static_cast<std::int32_t>(groups.front().size());
    std::size_t covered = 0;
    std::vector<char> seen(static_cast<std::size_t>(R), 0);
    for (auto const& g : groups) {
      detail::require(static_cast<std::int32_t>(g.size()) == n, "exchange_adviser::rank", "argument 'groups' has groups of ", n,
                      " and of ", g.size(), " ranks: they must be of one size");
      for (std::int32_t r : g) {
        detail::require(r >= 0 && r < R && !seen[static_cast<std::size_t>(r)], "exchange_adviser::rank", "argument 'groups' holds rank ", r,
                        r >= 0 && r < R ? " twice" : " of a topology of ", r >= 0 && r < R ? "" : std::to_string(R));
        seen[static_cast<std::size_t>(r)] = 1;
      }
      covered += g.size();
    }
    detail::require(groups.empty() || covered == static_cast<std::size_t>(R), "exchange_adviser::rank", "argument 'groups' holds ",
                    covered, " ranks; the topology has ", R);
    // The counts' ring all-gathers, over every rank or over each group (its n / R of the experts) side by side.
    double const experts = static_cast<double>(num_experts) * n / R;
    auto const gather = [&](double bytes) { return groups.empty() ? links_.allgather_seconds(bytes) : links_.allgather_seconds(groups, bytes); };
    count_gathers const counts{gather(8.0 * experts), gather(8.0 * (experts + n)), gather(8.0 * (experts + n + pieces_ * n))};
    rows const r = count_rows(routing, num_experts);
    double const route = counts.experts + links_.launches(plan_kernels);
    std::vector<exchange_prediction> out;
    out.push_back(predict_slots("flat", r.slots, r.tokens, row_bytes, false, route));
    if (links_.topo().num_nodes() > 1 && links_.topo().ranks_per_node() > 1)
      out.push_back(predict_slots("hierarchical_2d", r.slots, r.tokens, row_bytes, true, route));
    out.push_back(predict_dedup_per_rank(r, row_bytes, top_k, counts));
    if (links_.topo().num_nodes() > 1) out.push_back(predict_dedup_per_node(r, row_bytes, top_k, counts));
    std::stable_sort(out.begin(), out.end(), [](auto const& a, auto const& b) { return a.seconds() < b.seconds(); });
    return out;
  }

  //! `flat`'s dispatch and combine of `slots` (`link_model::cell(s, d)`: the rows, one per (token,
  //! expert) slot, rank s sends rank d), rank r holding `tokens[r]` tokens, after a route of
  //! `route_seconds`: for layers that do not place expert e on rank e / (E / R), such as HybridEP's
  //! same-offset groups side by side.
  //! @throws error (invalid_argument) naming `slots` or `tokens` when not of the ranks' shape, or
  //!   `row_bytes` unless positive and finite.
  [[nodiscard]] exchange_prediction flat(link_model::matrix const& slots, std::vector<double> const& tokens, double row_bytes,
                                         double route_seconds) const {
    std::int32_t const R = links_.topo().num_ranks();
    detail::require(slots.size() == links_.cell(R, 0), "exchange_adviser::flat", "argument 'slots' has ", slots.size(),
                    " cells; the ", R, " ranks need ", links_.cell(R, 0));
    detail::require(tokens.size() == static_cast<std::size_t>(R), "exchange_adviser::flat", "argument 'tokens' has ", tokens.size(),
                    " entries; the topology has ", R, " ranks");
    detail::require(row_bytes > 0 && std::isfinite(row_bytes), "exchange_adviser::flat", "row_bytes = ", row_bytes,
                    " must be positive and finite");
    return predict_slots("flat", slots, tokens, row_bytes, false, route_seconds);
  }

 private:
  using matrix = link_model::matrix;  //!< [R][R] rows (or bytes) rank s sends rank d

  //! The route's all-gather of counts: the experts' (flat), the experts' and the ranks' (the
  //! deduplicated exchanges), and those with the pieces' (`dedup_per_node`).
  struct count_gathers {
    double experts, experts_and_ranks, experts_ranks_and_pieces;
  };

  //! The rows each algorithm moves, from the routing.
  struct rows {
    matrix slots;     //!< one per (token, expert) slot
    matrix per_rank;  //!< one per (token, destination rank)
    matrix to_relay;  //!< one per (token, destination node), to the relay there
    matrix relayed;   //!< relay -> destination rank, one per (token, destination rank)
    std::vector<double> tokens;  //!< tokens per rank
  };

  [[nodiscard]] rows count_rows(std::vector<routing_view> const& routing, std::int32_t num_experts) const {
    std::int32_t const R = links_.topo().num_ranks(), L = num_experts / R;
    auto const cells = static_cast<std::size_t>(R) * static_cast<std::size_t>(R);
    rows r{matrix(cells, 0), matrix(cells, 0), matrix(cells, 0), matrix(cells, 0), std::vector<double>(static_cast<std::size_t>(R), 0)};
    std::set<std::int32_t> ranks, nodes;
    for (std::int32_t s = 0; s < R; ++s) {
      routing_view const& v = routing[static_cast<std::size_t>(s)];
      r.tokens[static_cast<std::size_t>(s)] = static_cast<double>(v.num_tokens);
      for (std::int64_t t = 0; t < v.num_tokens; ++t) {
        ranks.clear();
        nodes.clear();
        for (std::int32_t k = 0; k < v.top_k; ++k) {
          std::int32_t const e = v.topk_idx[t * v.top_k + k];
          if (e < 0 || e >= num_experts) continue;
          std::int32_t const d = e / L;
          r.slots[links_.cell(s, d)] += 1;
          ranks.insert(d);
          nodes.insert(links_.topo().node_of(d));
        }
        for (std::int32_t d : ranks) {
          r.per_rank[links_.cell(s, d)] += 1;
          r.relayed[links_.cell(links_.topo().rank_at(links_.topo().node_of(d), links_.topo().local_of(s)), d)] += 1;
        }
        for (std::int32_t n : nodes) r.to_relay[links_.cell(s, links_.topo().rank_at(n, links_.topo().local_of(s)))] += 1;
      }
    }
    return r;
  }

  //! `m` scaled: rows to bytes.
  static matrix scaled(matrix m, double factor) {
    for (double& v : m) v *= factor;
    return m;
  }

  //! The largest over ranks of `per_rank(r)` rows, as bytes through one memory pass.
  template <class PerRank>
  [[nodiscard]] double busiest_pass(PerRank&& per_rank, double row_bytes) const {
    double most = 0;
    for (std::int32_t r = 0; r < links_.topo().num_ranks(); ++r) most = std::max(most, per_rank(r));
    return links_.memory_seconds(most * row_bytes);
  }

  [[nodiscard]] double row_sum(matrix const& m, std::int32_t s) const {
    double sum = 0;
    for (std::int32_t d = 0; d < links_.topo().num_ranks(); ++d) sum += m[links_.cell(s, d)];
    return sum;
  }
  [[nodiscard]] double column_sum(matrix const& m, std::int32_t d) const {
    double sum = 0;
    for (std::int32_t s = 0; s < links_.topo().num_ranks(); ++s) sum += m[links_.cell(s, d)];
    return sum;
  }

  //! Mean per rank of the bytes in `m` that cross between nodes (`inter`) or stay inside one.
  void traffic(matrix const& m, double row_bytes, exchange_prediction& p, bool add = false) const {
    double inter = 0, intra = 0;
    std::int32_t const R = links_.topo().num_ranks();
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t d = 0; d < R; ++d)
        if (s != d) (links_.topo().same_node(s, d) ? intra : inter) += m[links_.cell(s, d)] * row_bytes / R;
    if (!add) p.inter_node_bytes = p.intra_node_bytes = 0;
    p.inter_node_bytes += inter;
    p.intra_node_bytes += intra;
  }

  //! `hierarchical_2d`'s two rounds for `m`: to the local peer of each destination's local index,
  //! then between ranks of equal local index.
  [[nodiscard]] double two_step_seconds(matrix const& m) const {
    std::int32_t const R = links_.topo().num_ranks();
    matrix first(m.size(), 0), second(m.size(), 0);
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t d = 0; d < R; ++d) {
        std::int32_t const via = links_.topo().rank_at(links_.topo().node_of(s), links_.topo().local_of(d));
        first[links_.cell(s, via)] += m[links_.cell(s, d)];
        second[links_.cell(via, d)] += m[links_.cell(s, d)];
      }
    return links_.round_seconds(first) + links_.round_seconds(second);
  }

  //! `flat` or `hierarchical_2d`: a row per slot; the chunk sort on the experts' side each way.
  [[nodiscard]] exchange_prediction predict_slots(char const* name, matrix const& slots, std::vector<double> const& tokens, double row_bytes,
                                                  bool two_step, double route_seconds) const {
    std::int32_t const R = links_.topo().num_ranks();
    exchange_prediction p{name};
    p.route_seconds = route_seconds;
    matrix const there = scaled(slots, row_bytes), back = links_.transposed(there);
    double const exchange = two_step ? two_step_seconds(there) : links_.round_seconds(there);
    double const returned = two_step ? two_step_seconds(back) : links_.round_seconds(back);
    // hierarchical_2d stages the blocks in five reorderings (semantics §11), in
    // `hierarchical_2d::copy_launches(R)` launches; each stage moves the rank's rows once (a copy
    // reads and writes them).
    double most = 0;
    for (std::int32_t s = 0; s < R; ++s) most = std::max(most, std::max(row_sum(slots, s), column_sum(slots, s)));
    double const copies = hierarchical_2d::copy_launches(R);
    double const reorders = two_step ? copies * links_.spec().kernel_launch_seconds + 5 * 2 * most * row_bytes / links_.spec().hbm_bytes_per_second : 0;
    double const permute = busiest_pass([&](std::int32_t s) { return tokens[static_cast<std::size_t>(s)] + row_sum(slots, s); }, row_bytes);
    double const sort = busiest_pass([&](std::int32_t d) { return 2 * column_sum(slots, d); }, row_bytes);
    p.dispatch_seconds = permute + exchange + reorders + sort;
    p.combine_seconds = sort + returned + reorders + permute;  // unpermute moves what permute does
    traffic(there, 1.0, p);
    return p;
  }

  //! `dedup_per_rank<flat>`: a row per (token, rank); the receive map spreads them, the receiver sums.
  [[nodiscard]] exchange_prediction predict_dedup_per_rank(rows const& r, double row_bytes, std::int32_t top_k,
                                                           count_gathers const& counts) const {
    exchange_prediction p{"dedup_per_rank"};
    p.route_seconds = counts.experts_and_ranks + links_.round_seconds(scaled(r.per_rank, 8.0 * top_k)) +
                      links_.launches(3 * plan_kernels + hop_kernels);
    double const permute = busiest_pass([&](std::int32_t s) { return r.tokens[static_cast<std::size_t>(s)] + row_sum(r.per_rank, s); }, row_bytes);
    double const spread = busiest_pass([&](std::int32_t d) { return column_sum(r.per_rank, d) + column_sum(r.slots, d); }, row_bytes);
    p.dispatch_seconds = permute + links_.round_seconds(scaled(r.per_rank, row_bytes)) + spread;
    p.combine_seconds = spread + links_.round_seconds(scaled(links_.transposed(r.per_rank), row_bytes)) + permute;
    traffic(r.per_rank, row_bytes, p);
    return p;
  }

  //! `dedup_per_node`: a row per (token, node) to the relays, which forward a row per (token, rank)
  //! inside their node; the two hops overlapped piece by piece, each way.
  [[nodiscard]] exchange_prediction predict_dedup_per_node(rows const& r, double row_bytes, std::int32_t top_k,
                                                           count_gathers const& counts) const {
    exchange_prediction p{"dedup_per_node"};
    double const list = 8.0 * top_k + (pieces_ > 1 ? 4.0 : 0.0);
    p.route_seconds = counts.experts_ranks_and_pieces + links_.round_seconds(scaled(r.to_relay, list)) +
                      links_.round_seconds(scaled(r.relayed, list)) + links_.launches(4 * plan_kernels + 2 * hop_kernels + 1);
    double const permute = busiest_pass([&](std::int32_t s) { return r.tokens[static_cast<std::size_t>(s)] + row_sum(r.to_relay, s); }, row_bytes);
    // Each piece beyond the first: the relay's copy (or sum) and each hop's block to itself, a launch each.
    double const relay = busiest_pass([&](std::int32_t m) { return column_sum(r.to_relay, m) + row_sum(r.relayed, m); }, row_bytes) +
                         links_.launches(3 * (pieces_ - 1));
    double const spread = busiest_pass([&](std::int32_t d) { return column_sum(r.relayed, d) + column_sum(r.slots, d); }, row_bytes);
    // Pieces: the source's blocks laid out in pieces (4 launches), the relay's lists and source tokens
    // put piece-major (3), the arrived rows ordered by source token (2).
    p.route_seconds += links_.launches(pieces_ > 1 ? 9 : 0);
    p.dispatch_seconds = permute + overlapped_hops(r.to_relay, r.relayed, row_bytes) + relay + spread;
    p.combine_seconds = spread + overlapped_hops(links_.transposed(r.relayed), links_.transposed(r.to_relay), row_bytes) + relay + permute;
    traffic(r.to_relay, row_bytes, p);
    traffic(r.relayed, row_bytes, p, true);
    return p;
  }

  //! Two hops of `first` then `second` (rows), in `pieces_` pieces: piece j's first hop in the
  //! round of piece j − 1's second.
  [[nodiscard]] double overlapped_hops(matrix const& first, matrix const& second, double row_bytes) const {
    double const share = row_bytes / pieces_;
    matrix both = scaled(first, share);
    for (std::size_t c = 0; c < both.size(); ++c) both[c] += second[c] * share;
    return links_.round_seconds(scaled(first, share)) + (pieces_ - 1) * links_.round_seconds(both) +
           links_.round_seconds(scaled(second, share));
  }

  link_model links_;
  std::int32_t pieces_;
};

MOECOMM_NAMESPACE_END
