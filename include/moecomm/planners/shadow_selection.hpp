// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FasterMoE's shadowing decision (PPoPP'22 §4.1, Algorithm 1): which hot experts every rank should
//! replicate for one iteration, so that their tokens are computed where they were routed instead of
//! queueing at the owner. A pure host function of the all-gathered count matrix: every rank holds
//! the same matrix and reaches the same decision without talking to the others.
//!
//! The model of a shadow set S, with `counts[s][e]` the tokens rank s routes to expert e:
//!
//!   B_w       tokens rank w computes: for e not in S, owner(e) computes all of e's tokens; for e in
//!             S, every rank s computes its own `counts[s][e]`.
//!   traffic_w tokens rank w receives: for e not in S owned by w, `counts[s][e]` from every s != w,
//!             split into same-node and other-node tokens (a rank's own tokens do not move;
//!             shadowed experts move no tokens).
//!   Lat(S)  = max_w rank_time(B_w, traffic_w) + shadow_transfer_time(|S|)   (`fastermoe_cost_model`)
//!
//! Lat(∅) is eq. 7. Lat(S) is eq. 8 in the consistent form that fastmoe's code uses: eq. 8 drops the
//! token term, but the tokens of the experts that stay unshadowed still move, so here the term
//! remains. Two refinements of eq. 7: only tokens that cross a link are charged (eq. 7 charges all
//! B_w), and tokens from the same node are priced at W_local. Only the receiving side is modelled,
//! as in eq. 7.
//!
//! Algorithm 1: c_min = Lat(∅); visit the experts by descending total load Σ_s counts[s][e] (ties:
//! smaller expert id first); tentatively add the next one; accept it if Lat strictly drops below
//! c_min (c_min = Lat), otherwise stop. The set is a greedy prefix of that order: the first expert
//! that does not help ends the search, even if a lighter one would have helped. Experts with no
//! tokens are never shadowed. Loads are per-expert totals as the paper prescribes (fastmoe's
//! `global_policy` sums the counts per source rank, `.sum(1)`, instead).
//!
//! Cost: one O(R·E) pass over the counts and an O(E log E) sort, then O(R) per tentative expert
//! (the owner's and every rank's loads change; the max over ranks is taken again).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! What a replication planner decided and what its model predicts for it: `select_shadowed_experts`
//! (FasterMoE) or `select_proprophet_replicas` (Pro-Prophet, `planners/proprophet_planner.hpp`).
struct shadow_decision {
  //! The accepted experts, in the order accepted (FasterMoE: descending load).
  std::vector<std::int32_t> shadowed;
  //! The predicted time without replicas, seconds (FasterMoE: Lat(∅), eq. 7; Pro-Prophet: T').
  double latency_unshadowed = 0;
  //! The predicted time with the accepted ones, seconds; never above `latency_unshadowed`.
  double latency = 0;
  //! B_w, tokens each rank computes without shadowing.
  std::vector<std::int64_t> tokens_unshadowed;
  //! B'_w, tokens each rank computes with the accepted set.
  std::vector<std::int64_t> tokens;
  //! Subsets (Pro-Prophet): when non-empty (size shadowed.size() + 1), accepted expert i is replicated
  //! only on ranks subset_ranks[subset_offsets[i] .. subset_offsets[i + 1]) (ascending, never its owner);
  //! empty: on every rank (FasterMoE).
  std::vector<std::int32_t> subset_offsets, subset_ranks;
};

namespace detail {

//! Checks `owner` (size E >= 1, every entry a rank of `topo`) and the `[R][E]` count matrix (non-null,
//! no negative entry); returns E.
inline std::int32_t check_shadow_inputs(char const* op, topology const& topo, std::vector<std::int32_t> const& owner,
                                        array_view<std::int64_t const> counts) {
  std::int32_t const ranks = topo.num_ranks();
  std::int32_t const experts = static_cast<std::int32_t>(owner.size());
  require(experts > 0, op, "owner is empty (E = owner.size() must be at least 1)");
  for (std::int32_t e = 0; e < experts; ++e) {
    std::int32_t const o = owner[static_cast<std::size_t>(e)];
    require(o >= 0 && o < ranks, op, "owner[", e, "] = ", o, " is not a rank in [0, ", ranks, ")");
  }
  check_elements(counts, std::int64_t{ranks} * experts, op, "counts", "R x E token counts");
  std::size_t const cells = static_cast<std::size_t>(ranks) * static_cast<std::size_t>(experts);
  // A min reduction (which vectorises) finds whether anything is negative; only then is the
  // position looked up.
  std::int64_t smallest = 0;
  for (std::size_t i = 0; i < cells; ++i) smallest = std::min(smallest, counts.data[i]);
  if (smallest >= 0) return experts;
  std::int64_t const* bad = std::find_if(counts.data, counts.data + cells, [](std::int64_t c) { return c < 0; });
  auto const cell = static_cast<std::size_t>(bad - counts.data);
  auto const rank = cell / static_cast<std::size_t>(experts), expert = cell % static_cast<std::size_t>(experts);
  fail(status::invalid_argument, op, "counts[", rank, "][", expert, "] = ", *bad, " is negative (tokens rank ", rank,
       " routes to expert ", expert, ")");
}

//! Per rank: tokens computed, and the tokens among them received from the same node and from
//! other nodes.
struct rank_loads {
  std::vector<std::int64_t> computed, intra_node, inter_node;
  rank_loads() = default;
  explicit rank_loads(std::int32_t ranks) { reset(ranks); }
  //! `ranks` zeros each, keeping the capacity.
  void reset(std::int32_t ranks) {
    computed.assign(static_cast<std::size_t>(ranks), 0);
    intra_node.assign(static_cast<std::size_t>(ranks), 0);
    inter_node.assign(static_cast<std::size_t>(ranks), 0);
  }
};

//! Lat(S) from the rank loads of S. Both the selection and `predicted_latency` end here, so the
//! two agree bit for bit on the same set.
inline double shadow_latency(fastermoe_cost_model const& model, rank_loads const& loads, std::size_t shadowed) {
  double slowest = 0;
  for (std::size_t w = 0; w < loads.computed.size(); ++w)
    slowest = std::max(slowest, model.rank_time(loads.computed[w], loads.intra_node[w], loads.inter_node[w]));
  return slowest + model.shadow_transfer_time(static_cast<std::int64_t>(shadowed));
}

//! `owner[e] = placement.rank_of(e)`, once the placement is known to span `topo`'s ranks.
inline std::vector<std::int32_t> owners_of(char const* op, contiguous_placement const& placement, topology const& topo) {
  require(placement.num_ranks() == topo.num_ranks(), op, "placement has ", placement.num_ranks(),
          " ranks but topo has ", topo.num_ranks());
  std::vector<std::int32_t> owner(static_cast<std::size_t>(placement.num_experts()));
  for (std::int32_t e = 0; e < placement.num_experts(); ++e) owner[static_cast<std::size_t>(e)] = placement.rank_of(e);
  return owner;
}

}  // namespace detail

//! What `select_shadowed_experts` builds on the way, kept between calls so that a steady state
//! allocates nothing.
struct shadow_selection_workspace {
  std::vector<std::int32_t> owner_node, order;
  std::vector<std::int64_t> load, owner_node_load;
  detail::rank_loads loads;
};

//! Lat(`shadow_set`) evaluated from scratch, in seconds (the empty set gives eq. 7).
//! @param owner   owner rank of each expert; E = owner.size()
//! @param counts  row-major `[R][E]`: tokens rank s routes to expert e
//! @throws error (invalid_argument) naming the bad argument: owner empty or out of range, counts
//!         shorter than R x E or negative (with rank and expert), a shadow_set entry that is not an expert or
//!         appears twice.
[[nodiscard]] inline double predicted_latency(fastermoe_cost_model const& model, topology const& topo,
                                              std::vector<std::int32_t> const& owner, array_view<std::int64_t const> counts,
                                              std::vector<std::int32_t> const& shadow_set) {
  char const* const op = "predicted_latency";
  std::int32_t const experts = detail::check_shadow_inputs(op, topo, owner, counts);
  std::int32_t const ranks = topo.num_ranks();
  std::vector<bool> is_shadowed(static_cast<std::size_t>(experts), false);
  for (std::size_t i = 0; i < shadow_set.size(); ++i) {
    std::int32_t const e = shadow_set[i];
    detail::require(e >= 0 && e < experts, op, "shadow_set[", i, "] = ", e, " is not an expert in [0, ", experts, ")");
    detail::require(!is_shadowed[static_cast<std::size_t>(e)], op, "shadow_set[", i, "] = ", e, " appears twice");
    is_shadowed[static_cast<std::size_t>(e)] = true;
  }
  detail::rank_loads loads(ranks);
  for (std::int32_t s = 0; s < ranks; ++s)
    for (std::int32_t e = 0; e < experts; ++e) {
      std::int64_t const c = counts.data[static_cast<std::size_t>(s) * static_cast<std::size_t>(experts) + static_cast<std::size_t>(e)];
      if (is_shadowed[static_cast<std::size_t>(e)]) {
        loads.computed[static_cast<std::size_t>(s)] += c;
        continue;
      }
      std::int32_t const o = owner[static_cast<std::size_t>(e)];
      loads.computed[static_cast<std::size_t>(o)] += c;
      if (s != o) (topo.same_node(s, o) ? loads.intra_node : loads.inter_node)[static_cast<std::size_t>(o)] += c;
    }
  return detail::shadow_latency(model, loads, shadow_set.size());
}

//! `predicted_latency` with `owner[e] = placement.rank_of(e)`.
//! @throws error (invalid_argument) also when the placement's rank count differs from `topo`'s.
[[nodiscard]] inline double predicted_latency(fastermoe_cost_model const& model, topology const& topo,
                                              contiguous_placement const& placement, array_view<std::int64_t const> counts,
                                              std::vector<std::int32_t> const& shadow_set) {
  return predicted_latency(model, topo, detail::owners_of("predicted_latency", placement, topo), counts, shadow_set);
}

//! Algorithm 1 of FasterMoE on the all-gathered counts (see the file comment for the model).
//! @param owner   owner rank of each expert; E = owner.size() (E < R is fine: some ranks own nothing)
//! @param counts  row-major `[R][E]`: tokens rank s routes to expert e
//! @throws error (invalid_argument) naming the bad argument: owner empty or out of range, counts
//!         shorter than R x E or negative (with rank and expert).
//! @param decision overwritten (its vectors keep their capacity); `workspace` likewise.
inline void select_shadowed_experts(fastermoe_cost_model const& model, topology const& topo,
                                    std::vector<std::int32_t> const& owner, array_view<std::int64_t const> counts,
                                    shadow_decision& decision, shadow_selection_workspace& workspace) {
  char const* const op = "select_shadowed_experts";
  std::int32_t const experts = detail::check_shadow_inputs(op, topo, owner, counts);
  std::int32_t const ranks = topo.num_ranks();
  auto const E = static_cast<std::size_t>(experts);
  auto const at = [&](std::int32_t s, std::int32_t e) {
    return counts.data[static_cast<std::size_t>(s) * E + static_cast<std::size_t>(e)];
  };

  // Per expert: its total load and the part of it that comes from the owner's node (owner
  // included), accumulated row by row so that the pass reads the matrix in memory order.
  std::vector<std::int32_t>& owner_node = workspace.owner_node;
  owner_node.resize(E);
  for (std::size_t e = 0; e < E; ++e) owner_node[e] = topo.node_of(owner[e]);
  std::vector<std::int64_t>& load = workspace.load;
  std::vector<std::int64_t>& owner_node_load = workspace.owner_node_load;
  load.assign(E, 0);
  owner_node_load.assign(E, 0);
  for (std::int32_t s = 0; s < ranks; ++s) {
    std::int64_t const* row = counts.data + static_cast<std::size_t>(s) * E;
    std::int32_t const node = topo.node_of(s);
    for (std::size_t e = 0; e < E; ++e) {
      load[e] += row[e];
      owner_node_load[e] += owner_node[e] == node ? row[e] : 0;
    }
  }
  // Tokens expert e brings to its owner from the same node (its own stay put) and from other nodes.
  auto const intra_node_traffic = [&](std::int32_t e) {
    return owner_node_load[static_cast<std::size_t>(e)] - at(owner[static_cast<std::size_t>(e)], e);
  };
  auto const inter_node_traffic = [&](std::int32_t e) {
    return load[static_cast<std::size_t>(e)] - owner_node_load[static_cast<std::size_t>(e)];
  };

  detail::rank_loads& loads = workspace.loads;
  loads.reset(ranks);
  for (std::int32_t e = 0; e < experts; ++e) {
    auto const o = static_cast<std::size_t>(owner[static_cast<std::size_t>(e)]);
    loads.computed[o] += load[static_cast<std::size_t>(e)];
    loads.intra_node[o] += intra_node_traffic(e);
    loads.inter_node[o] += inter_node_traffic(e);
  }

  decision.shadowed.clear();
  decision.subset_offsets.clear();  // every rank gets each shadowed expert
  decision.subset_ranks.clear();
  decision.tokens_unshadowed.assign(loads.computed.begin(), loads.computed.end());
  decision.latency_unshadowed = detail::shadow_latency(model, loads, 0);

  // Experts without tokens could only add transfer time, so they are not even visited.
  std::vector<std::int32_t>& order = workspace.order;
  order.clear();
  for (std::int32_t e = 0; e < experts; ++e)
    if (load[static_cast<std::size_t>(e)] > 0) order.push_back(e);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    std::int64_t const la = load[static_cast<std::size_t>(a)], lb = load[static_cast<std::size_t>(b)];
    return la != lb ? la > lb : a < b;
  });

  // Shadowing e (sign +1) or undoing it (sign -1): every rank computes its own tokens of e, the
  // owner no longer computes or receives the rest.
  auto const shadow = [&](std::int32_t e, std::int64_t sign) {
    for (std::int32_t s = 0; s < ranks; ++s) loads.computed[static_cast<std::size_t>(s)] += sign * at(s, e);
    auto const o = static_cast<std::size_t>(owner[static_cast<std::size_t>(e)]);
    loads.computed[o] -= sign * load[static_cast<std::size_t>(e)];
    loads.intra_node[o] -= sign * intra_node_traffic(e);
    loads.inter_node[o] -= sign * inter_node_traffic(e);
  };

  double c_min = decision.latency_unshadowed;
  for (std::int32_t e : order) {
    shadow(e, +1);
    double const latency = detail::shadow_latency(model, loads, decision.shadowed.size() + 1);
    if (!(latency < c_min)) {
      shadow(e, -1);  // back to the accepted set, whose loads are reported
      break;
    }
    c_min = latency;
    decision.shadowed.push_back(e);
  }
  decision.latency = c_min;
  decision.tokens.assign(loads.computed.begin(), loads.computed.end());
}

//! Algorithm 1 as above, returning a fresh decision (a one-off call).
[[nodiscard]] inline shadow_decision select_shadowed_experts(fastermoe_cost_model const& model, topology const& topo,
                                                             std::vector<std::int32_t> const& owner,
                                                             array_view<std::int64_t const> counts) {
  shadow_decision decision;
  shadow_selection_workspace workspace;
  select_shadowed_experts(model, topo, owner, counts, decision, workspace);
  return decision;
}

//! `select_shadowed_experts` with `owner[e] = placement.rank_of(e)`.
//! @throws error (invalid_argument) also when the placement's rank count differs from `topo`'s.
[[nodiscard]] inline shadow_decision select_shadowed_experts(fastermoe_cost_model const& model, topology const& topo,
                                                             contiguous_placement const& placement,
                                                             array_view<std::int64_t const> counts) {
  return select_shadowed_experts(model, topo, detail::owners_of("select_shadowed_experts", placement, topo), counts);
}

MOECOMM_NAMESPACE_END
