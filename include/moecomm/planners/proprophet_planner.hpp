// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Pro-Prophet's planner (Wang et al., arXiv 2411.10003, Algorithm 1; reference/systems.md §2):
//! which experts to replicate for the next iteration and on which ranks, from the predicted `[R][E]`
//! token counts. Unlike FasterMoE's shadowing, a replica goes to a subset of the ranks: all but the
//! owner and the `n` ranks that send the expert the fewest tokens. A pure host function of the
//! counts: every rank reaches the same decision without talking to the others.
//!
//! State of a replica list, with `counts[s][e]` the tokens rank s routes to expert e:
//!
//!   H_i   tokens rank i computes: its own experts' tokens, except that a replicated expert's
//!         tokens from a rank of its subset are computed there; plus, for each replica it holds,
//!         its own tokens of that expert.
//!   R_i   tokens rank i receives: its own experts' tokens from the ranks that hold no replica.
//!   T'    `proprophet_cost_model::layer_time` of max R, max H and the list's length.
//!
//! Algorithm 1 as implemented (D = R ranks, I = Σ counts, n' = min(n, D − 1)):
//!   1. best = T'(no replica).
//!   2. While max H − min H >= balance_factor · I / D (eq. 7) and max H > min H:
//!      a. i = the rank of largest H (ties: lower rank);
//!      b. e = i's expert with the most tokens computed on i (ties: smaller id); stop if i owns no
//!         expert with tokens left on it, or if e was already chosen (the paper's "stop if i was
//!         used");
//!      c. skip the n' ranks other than the owner that send e the fewest tokens (ties: lower rank);
//!         the other non-owner ranks get a replica and compute their own tokens of e;
//!      d. update H and R; T = T'(list). If T < best: best = T, and the list so far is the best prefix.
//!   3. The decision is the best prefix; nothing when no prefix beats T'(no replica).
//!
//! Where the code (`load-balancing/search_algorithm.py`) differs:
//! - it works per device (its experts fused per device), so "the device's heaviest expert" is the
//!   device's whole expert set; here it is one expert, as the paper's placement allows;
//! - it keeps `seq[:cntt]` with `cntt` the number of prefixes that improved on the best so far,
//!   not the length of the best prefix (the two differ when an improvement follows a step that
//!   did not improve); here the best prefix, as the paper's Algorithm 1 says;
//! - it prices every prefix's Trans and Agg as one device's experts (`(i + 1)` with `i` never
//!   incremented); here `T_Trans(s, n)` with s the prefix length;
//! - it skips a device only when every device has a source that sends it nothing (`C = 1`, else
//!   0), picks it among all sources including the owner, and still counts the skipped device's
//!   tokens as computed locally; here n' non-owner ranks always, and their tokens stay with the owner.
//!
//! Cost: one O(R·E) pass over the counts, then per step O(R + E/R) (the loads, the skipped ranks,
//! the owner's experts); at most E steps.

#include <moecomm/config.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/planners/proprophet_cost_model.hpp>
#include <moecomm/planners/shadow_selection.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! How Algorithm 1 chooses.
struct proprophet_planner_options {
  //! n: ranks that get no replica of a chosen expert, those sending it the fewest tokens (the
  //! code skips one). Clamped to R − 1; 0 replicates on every rank.
  std::int32_t skipped_ranks = 1;
  //! Which T' the planner minimises: with Trans and Agg hidden by the scheduler (the paper's) or exposed.
  proprophet_schedule schedule = proprophet_schedule::with_scheduler;
};

//! What `select_proprophet_replicas` builds on the way, kept between calls so that a call whose
//! sizes were all seen before allocates nothing.
struct proprophet_planner_workspace {
  std::vector<std::int64_t> computed, received;  //!< H_i, R_i
  std::vector<std::int64_t> on_owner;            //!< per expert: tokens its owner computes
  std::vector<std::int32_t> experts_of, experts_offsets;  //!< each rank's experts, ascending (CSR)
  std::vector<std::int64_t> column;              //!< the chosen expert's counts per rank
  std::vector<std::int32_t> others;              //!< the skipped ranks (and the candidates for them)
  std::vector<char> chosen, skipped;             //!< per expert, per rank
};

//! Algorithm 1 of Pro-Prophet on `counts` (see the file comment).
//! @param owner    owner rank of each expert; E = owner.size()
//! @param counts   row-major `[R][E]`: tokens rank s routes to expert e (predicted for the iteration planned)
//! @param decision overwritten (its vectors keep their capacity): `shadowed` the chosen experts in
//!                 the order chosen, `subset_offsets`/`subset_ranks` their ranks (size
//!                 `shadowed.size() + 1`, `{0}` when nothing is chosen), `latency_unshadowed` =
//!                 T'(no replica), `latency` = T'(chosen) <= it, `tokens_unshadowed`/`tokens` = H
//!                 before and after.
//! @throws error (invalid_argument) naming the bad argument: owner empty or out of range, counts
//!         shorter than R x E or negative (with rank and expert), `options.skipped_ranks` negative.
inline void select_proprophet_replicas(proprophet_cost_model const& model, topology const& topo,
                                       std::vector<std::int32_t> const& owner, array_view<std::int64_t const> counts,
                                       proprophet_planner_options const& options, shadow_decision& decision,
                                       proprophet_planner_workspace& workspace) {
  char const* const op = "select_proprophet_replicas";
  std::int32_t const experts = detail::check_shadow_inputs(op, topo, owner, counts);
  detail::require(options.skipped_ranks >= 0, op, "options.skipped_ranks = ", options.skipped_ranks,
                  " must not be negative");
  std::int32_t const ranks = topo.num_ranks();
  auto const E = static_cast<std::size_t>(experts), R = static_cast<std::size_t>(ranks);
  std::int32_t const skip = std::min(options.skipped_ranks, ranks - 1);
  auto const at = [&](std::size_t s, std::size_t e) { return counts.data[s * E + e]; };

  // Per expert its total, read in memory order; then per rank what it computes and receives.
  std::vector<std::int64_t>& on_owner = workspace.on_owner;
  on_owner.assign(E, 0);
  std::int64_t routed = 0;
  for (std::size_t s = 0; s < R; ++s) {
    std::int64_t const* row = counts.data + s * E;
    for (std::size_t e = 0; e < E; ++e) on_owner[e] += row[e];
  }
  std::vector<std::int64_t>& computed = workspace.computed;
  std::vector<std::int64_t>& received = workspace.received;
  computed.assign(R, 0);
  received.assign(R, 0);
  std::vector<std::int32_t>& offsets = workspace.experts_offsets;
  offsets.assign(R + 1, 0);
  for (std::size_t e = 0; e < E; ++e) {
    auto const o = static_cast<std::size_t>(owner[e]);
    routed += on_owner[e];
    computed[o] += on_owner[e];
    received[o] += on_owner[e] - at(o, e);  // the owner's own tokens never move
    ++offsets[o + 1];
  }
  for (std::size_t r = 0; r < R; ++r) offsets[r + 1] += offsets[r];
  // Each rank's experts in ascending order (a counting sort; `others` serves as the cursors).
  std::vector<std::int32_t>& experts_of = workspace.experts_of;
  std::vector<std::int32_t>& others = workspace.others;
  experts_of.resize(E);
  others.assign(offsets.begin(), offsets.end() - 1);
  for (std::size_t e = 0; e < E; ++e)
    experts_of[static_cast<std::size_t>(others[static_cast<std::size_t>(owner[e])]++)] = static_cast<std::int32_t>(e);

  auto const largest = [](std::vector<std::int64_t> const& v) { return *std::max_element(v.begin(), v.end()); };
  auto const layer_time = [&](std::size_t replicated) {
    return model.layer_time(largest(received), largest(computed), static_cast<std::int64_t>(replicated), ranks, skip,
                            options.schedule);
  };

  decision.shadowed.clear();
  decision.subset_offsets.assign(1, 0);
  decision.subset_ranks.clear();
  decision.tokens_unshadowed.assign(computed.begin(), computed.end());
  decision.tokens.assign(computed.begin(), computed.end());
  decision.latency_unshadowed = layer_time(0);
  double best = decision.latency_unshadowed;
  std::size_t best_length = 0;

  std::vector<char>& chosen = workspace.chosen;
  std::vector<char>& skipped = workspace.skipped;
  chosen.assign(E, 0);
  skipped.assign(R, 0);
  workspace.column.resize(R);
  double const threshold = model.params().balance_factor * static_cast<double>(routed) / static_cast<double>(ranks);

  for (;;) {
    // Eq. 7 on H; max_element and min_element return the first extreme, i.e. the lower rank.
    auto const most = std::max_element(computed.begin(), computed.end());
    std::int64_t const spread = *most - *std::min_element(computed.begin(), computed.end());
    if (spread == 0 || static_cast<double>(spread) < threshold) break;
    auto const i = static_cast<std::size_t>(most - computed.begin());

    // The busiest rank's heaviest expert, by the tokens still computed on it.
    std::int32_t e = -1;
    for (std::int32_t k = offsets[i]; k < offsets[i + 1]; ++k) {
      std::int32_t const candidate = experts_of[static_cast<std::size_t>(k)];
      if (e < 0 || on_owner[static_cast<std::size_t>(candidate)] > on_owner[static_cast<std::size_t>(e)]) e = candidate;
    }
    if (e < 0 || on_owner[static_cast<std::size_t>(e)] == 0 || chosen[static_cast<std::size_t>(e)]) break;
    auto const ue = static_cast<std::size_t>(e);
    chosen[ue] = 1;

    // e's column, read once: the counts are row-major, so each rank's count is a cache line of its own.
    std::vector<std::int64_t>& column = workspace.column;
    for (std::size_t s = 0; s < R; ++s) column[s] = at(s, ue);
    // The n' non-owner ranks sending e the fewest tokens (ties: lower rank) get no replica; n' = 1,
    // the code's, by one scan.
    others.clear();
    if (skip == 1) {
      std::size_t fewest = i == 0 ? 1 : 0;
      std::int64_t least = column[fewest];
      for (std::size_t s = fewest + 1; s < R; ++s)
        if (s != i && column[s] < least) {
          fewest = s;
          least = column[s];
        }
      others.push_back(static_cast<std::int32_t>(fewest));
    } else if (skip > 1) {
      for (std::size_t s = 0; s < R; ++s)
        if (s != i) others.push_back(static_cast<std::int32_t>(s));
      auto const fewer = [&](std::int32_t a, std::int32_t b) {
        std::int64_t const ca = column[static_cast<std::size_t>(a)], cb = column[static_cast<std::size_t>(b)];
        return ca != cb ? ca < cb : a < b;
      };
      std::nth_element(others.begin(), others.begin() + (skip - 1), others.end(), fewer);
      others.resize(static_cast<std::size_t>(skip));
    }
    for (std::int32_t r : others) skipped[static_cast<std::size_t>(r)] = 1;
    // Every other rank computes its own tokens of e; the owner no longer receives or computes them.
    std::vector<std::int32_t>& subset_ranks = decision.subset_ranks;
    std::size_t written = subset_ranks.size();
    subset_ranks.resize(written + R - 1 - static_cast<std::size_t>(skip));
    std::int64_t moved = 0;
    for (std::size_t s = 0; s < R; ++s) {
      if (s == i || skipped[s]) continue;
      subset_ranks[written++] = static_cast<std::int32_t>(s);
      computed[s] += column[s];
      moved += column[s];
    }
    computed[i] -= moved;
    received[i] -= moved;
    on_owner[ue] -= moved;
    for (std::int32_t r : others) skipped[static_cast<std::size_t>(r)] = 0;
    decision.shadowed.push_back(e);
    decision.subset_offsets.push_back(static_cast<std::int32_t>(decision.subset_ranks.size()));

    double const t = layer_time(decision.shadowed.size());
    if (t < best) {
      best = t;
      best_length = decision.shadowed.size();
      decision.tokens.assign(computed.begin(), computed.end());
    }
  }

  decision.shadowed.resize(best_length);
  decision.subset_ranks.resize(static_cast<std::size_t>(decision.subset_offsets[best_length]));
  decision.subset_offsets.resize(best_length + 1);
  decision.latency = best;
}

//! Algorithm 1 as above, returning a fresh decision (a one-off call).
[[nodiscard]] inline shadow_decision select_proprophet_replicas(proprophet_cost_model const& model,
                                                                topology const& topo,
                                                                std::vector<std::int32_t> const& owner,
                                                                array_view<std::int64_t const> counts,
                                                                proprophet_planner_options const& options = {}) {
  shadow_decision decision;
  proprophet_planner_workspace workspace;
  select_proprophet_replicas(model, topo, owner, counts, options, decision, workspace);
  return decision;
}

//! The paper's load prediction (loads drift slowly from one iteration to the next): the next
//! iteration's counts are the last ones. A predictor is any type with
//! `array_view<std::int64_t const> predict(array_view<std::int64_t const> observed)` returning the
//! `[R][E]` counts to plan with: `observed` itself or a buffer it owns (valid until its next call).
struct last_iteration_predictor {
  array_view<std::int64_t const> predict(array_view<std::int64_t const> observed) { return observed; }
};

//! Pro-Prophet's planner with the call signature of `fastermoe_shadowing`'s planners, so that it
//! can be its `Planner`. It plans with its own `model` (the FasterMoE model the policy passes is
//! ignored: set `model`'s `hidden` to the layer's) on the counts `predictor` returns for the
//! observed ones. `fastermoe_shadowing` replicates each chosen expert on its subset only; in a
//! scheduled step (`begin_replica_transfer`) the counts it is given are the last step's, which is
//! Pro-Prophet's prediction.
template <class Predictor = last_iteration_predictor>
struct proprophet_planner {
  proprophet_cost_model model{};
  proprophet_planner_options options{};
  Predictor predictor{};
  proprophet_planner_workspace workspace{};  //!< kept between steps

  void operator()(fastermoe_cost_model const& /*ignored*/, topology const& topo, std::vector<std::int32_t> const& owner,
                  array_view<std::int64_t const> counts, shadow_decision& decision) {
    select_proprophet_replicas(model, topo, owner, predictor.predict(counts), options, decision, workspace);
  }
};

MOECOMM_NAMESPACE_END
