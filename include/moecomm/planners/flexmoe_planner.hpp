// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FlexMoE's dynamic replica placement planner (Nie et al., "FlexMoE", SIGMOD'23, arXiv 2304.03946;
//! reference/systems.md §3): from per-expert loads, the moves (expand, shrink, migrate) that take a
//! `replica_placement` to a better balanced one. Pure planning: nothing is communicated, no
//! parameter moves. A pure host function of its arguments: every rank computes the same decision
//! from the same loads (ties go to the lower expert, then the lower rank).
//!
//! **Reconstructed.** FlexMoE has no public code and its paper states neither its cost model nor
//! its heuristic; what follows is systems.md §3's reconstruction [I] of the policy that SYMI
//! (arXiv 2504.19925 §2.2, §5), FineMoE (arXiv 2511.16947 §6.4) and TopoEP re-implemented. The trigger
//! metric, the threshold and the cost formula are assumptions, not the paper's.
//!
//! Model. Tokens of expert e are split evenly over its `r_e` replicas (`assign_tokens_evenly`), so
//! rank g's predicted load, in token rows per step, is
//!
//!   L_g = Σ_{e held by g} load_e / r_e          (doubles, summed over g's slots in ascending local index)
//!
//! - imbalance = max_g L_g / mean_g L_g, with mean_g L_g = Σ_e load_e / R (1 when no expert has a
//!   token); a decision is made only when it exceeds `imbalance_threshold`;
//! - predicted step time = max_g L_g × `seconds_per_row` (a row's receive and fwd+bwd compute);
//! - a move's cost = `bytes_per_replica / move_bytes_per_second` for expand and migrate (the new
//!   replica receives parameters and optimizer state, SYMI §5), 0 for shrink;
//! - a move is worth making when its gain over the rebalancing interval exceeds its cost:
//!   `(before − after) × interval_steps − cost > 0`, with before and after predicted step times.
//!
//! The placement's rule holds after every move: all replicas of an expert share one local index, so
//! expert e can only gain a replica in slot row `local_index_of(e)`, on a rank whose slot in that row
//! is empty (such a rank does not hold e); a shrink never removes an expert's last replica.
//!
//! Greedy (systems.md §3, step 3). While the imbalance exceeds the threshold and fewer than
//! `max_moves` moves are planned, from the current state:
//! (a) expansion: the hottest expert (largest `load_e / r_e`, experts with tokens and fewer than R
//!     replicas; the next hottest while one has no qualifying candidate) onto the least-loaded rank
//!     with a free slot in its row, and a *replace*: the coldest replicated expert of that row
//!     (r > 1, smallest `load / r`) shrinks on its least-loaded holder, and the hot expert expands
//!     there (two moves, scored together, made only if both fit under `max_moves`);
//! (b) migration: each replica of the most-loaded rank onto the least-loaded rank with a free slot
//!     in its row.
//! Each candidate is scored by the predicted step time after it; the one of largest net gain is
//! made, provided its gain and its net gain are both positive (ties: lower expert, then lower target
//! rank). The loop ends when no candidate qualifies. The score is the busiest rank's load alone, so
//! when ranks tie at the top only expanding an expert they all hold can gain; the greedy is
//! myopic and may stop above the threshold.
//!
//! Not modelled: the all-to-all time (systems.md's score adds it; here `seconds_per_row` carries a
//! row's transfer), the memory that holds old and new state during a move (SYMI §5.3), moves
//! overlapping compute, and locality-first splits.
//!
//! Cost per step of the loop: O(E + R·S) to build the candidates, O(R + r·S) to score each.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/error.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

enum class replica_move_kind { expand, shrink, migrate };

//! One change of the slot table.
struct replica_move {
  replica_move_kind kind = replica_move_kind::expand;
  std::int32_t expert = -1;
  //! shrink, migrate: the rank that loses its replica; expand: -1.
  std::int32_t from_rank = -1;
  //! expand, migrate: the rank that gains one, in slot `(to_rank, local_index_of(expert))`; shrink: -1.
  std::int32_t to_rank = -1;

  friend bool operator==(replica_move const& a, replica_move const& b) {
    return a.kind == b.kind && a.expert == b.expert && a.from_rank == b.from_rank && a.to_rank == b.to_rank;
  }
  friend bool operator!=(replica_move const& a, replica_move const& b) { return !(a == b); }
  //! "expand expert 3 to rank 5", "shrink expert 1 on rank 2", "migrate expert 4 from rank 0 to rank 7".
  friend std::ostream& operator<<(std::ostream& os, replica_move const& m) {
    switch (m.kind) {
      case replica_move_kind::expand: return os << "expand expert " << m.expert << " to rank " << m.to_rank;
      case replica_move_kind::shrink: return os << "shrink expert " << m.expert << " on rank " << m.from_rank;
      case replica_move_kind::migrate:
        return os << "migrate expert " << m.expert << " from rank " << m.from_rank << " to rank " << m.to_rank;
    }
    return os << "move of unknown kind " << static_cast<int>(m.kind) << " of expert " << m.expert;
  }
};

//! The model's constants and the greedy's limits (file comment).
struct flexmoe_planner_options {
  double imbalance_threshold = 1.1;     //!< plan only when max/mean rank load exceeds it; >= 1
  std::int32_t interval_steps = 50;     //!< steps a move's gain is counted over (the rebalancing interval); > 0
  double seconds_per_row = 1e-6;        //!< a rank's time to receive and compute one token row (fwd+bwd); > 0, finite
  double bytes_per_replica = 0;         //!< parameters + optimizer state of one expert replica; >= 0, finite
  double move_bytes_per_second = 1e10;  //!< point-to-point bandwidth of a move; > 0 (infinite: moves are free)
  std::int32_t max_moves = 64;          //!< moves per decision; >= 0
};

//! What `plan_replica_moves` decided and what the model predicts for it.
struct placement_decision {
  bool triggered = false;                                  //!< imbalance_before above the threshold
  double imbalance_before = 1, imbalance_after = 1;        //!< max/mean predicted rank load
  double step_seconds_before = 0, step_seconds_after = 0;  //!< max_g L_g × seconds_per_row
  double move_seconds = 0;                                 //!< moves that copy a replica × bytes_per_replica / bandwidth
  std::int64_t bytes_moved = 0;                            //!< moves that copy a replica × bytes_per_replica, rounded
  //! In order: applying them in order to the input placement (`apply_replica_moves`) gives the slot
  //! table below. A replace is a shrink followed by an expand onto the shrinking rank.
  std::vector<replica_move> moves;
  std::vector<std::int32_t> slot_expert_after;  //!< the resulting slot table `[rank * S + local]`, -1 empty
  std::vector<double> rank_load_before, rank_load_after;  //!< L_g of the input and of the result
};

//! The state `plan_replica_moves` works on, kept between calls so that a warm call allocates nothing.
struct flexmoe_planner_workspace {
  std::vector<std::int32_t> replicas;  //!< r_e of the state being planned
  std::vector<std::int32_t> tried;     //!< the loop step in which an expert's expansion found no target
};

namespace detail {

//! The planner's state (slot table, replica counts, rank loads) and its moves, done and undone. A
//! rank's load is always recomputed from its slots, so it is the same bits whatever the history.
class flexmoe_state {
 public:
  flexmoe_state(replica_placement const& placement, std::int64_t const* load, std::vector<std::int32_t>& slots,
                std::vector<std::int32_t>& replicas, std::vector<double>& rank_load)
      : placement_(placement), load_(load), slots_(slots), replicas_(replicas), rank_load_(rank_load),
        ranks_(placement.num_ranks()), slots_per_rank_(placement.slots_per_rank()) {
    slots_.assign(placement.slot_experts().begin(), placement.slot_experts().end());
    replicas_.resize(static_cast<std::size_t>(placement.num_experts()));
    for (std::int32_t e = 0; e < placement.num_experts(); ++e) replicas_[static_cast<std::size_t>(e)] = placement.replica_count(e);
    rank_load_.resize(static_cast<std::size_t>(ranks_));
    for (std::int32_t g = 0; g < ranks_; ++g) rank_load_[static_cast<std::size_t>(g)] = fresh_load(g);
  }

  [[nodiscard]] std::int32_t expert_at(std::int32_t g, std::int32_t l) const {
    return slots_[static_cast<std::size_t>(g * slots_per_rank_ + l)];
  }
  [[nodiscard]] std::int32_t replicas(std::int32_t e) const { return replicas_[static_cast<std::size_t>(e)]; }
  [[nodiscard]] double load(std::int32_t g) const { return rank_load_[static_cast<std::size_t>(g)]; }
  //! load_e / r_e: the rows each replica of e computes.
  [[nodiscard]] double per_replica(std::int32_t e) const {
    return static_cast<double>(load_[static_cast<std::size_t>(e)]) / replicas_[static_cast<std::size_t>(e)];
  }

  //! The most-loaded rank (the lowest on a tie).
  [[nodiscard]] std::int32_t busiest() const {
    std::int32_t best = 0;
    for (std::int32_t g = 1; g < ranks_; ++g)
      if (load(g) > load(best)) best = g;
    return best;
  }
  //! The least-loaded rank with an empty slot in row `l`, or -1.
  [[nodiscard]] std::int32_t least_loaded_free(std::int32_t l) const {
    std::int32_t best = -1;
    for (std::int32_t g = 0; g < ranks_; ++g)
      if (expert_at(g, l) < 0 && (best < 0 || load(g) < load(best))) best = g;
    return best;
  }
  //! The least-loaded rank holding `e`.
  [[nodiscard]] std::int32_t least_loaded_holder(std::int32_t e) const {
    std::int32_t const l = placement_.local_index_of(e);
    std::int32_t best = -1;
    for (std::int32_t g = 0; g < ranks_; ++g)
      if (expert_at(g, l) == e && (best < 0 || load(g) < load(best))) best = g;
    return best;
  }

  void apply(replica_move const& m) {
    std::int32_t const l = placement_.local_index_of(m.expert);
    switch (m.kind) {
      case replica_move_kind::expand:
        slot(m.to_rank, l) = m.expert;
        ++replicas_[static_cast<std::size_t>(m.expert)];
        refresh_holders(m.expert);
        break;
      case replica_move_kind::shrink:
        slot(m.from_rank, l) = -1;
        --replicas_[static_cast<std::size_t>(m.expert)];
        refresh_holders(m.expert);
        refresh(m.from_rank);
        break;
      case replica_move_kind::migrate:
        slot(m.from_rank, l) = -1;
        slot(m.to_rank, l) = m.expert;
        refresh(m.from_rank);
        refresh(m.to_rank);
        break;
    }
  }

  void undo(replica_move const& m) {
    std::int32_t const l = placement_.local_index_of(m.expert);
    switch (m.kind) {
      case replica_move_kind::expand:
        slot(m.to_rank, l) = -1;
        --replicas_[static_cast<std::size_t>(m.expert)];
        refresh_holders(m.expert);
        refresh(m.to_rank);
        break;
      case replica_move_kind::shrink:
        slot(m.from_rank, l) = m.expert;
        ++replicas_[static_cast<std::size_t>(m.expert)];
        refresh_holders(m.expert);
        break;
      case replica_move_kind::migrate:
        slot(m.to_rank, l) = -1;
        slot(m.from_rank, l) = m.expert;
        refresh(m.from_rank);
        refresh(m.to_rank);
        break;
    }
  }

 private:
  std::int32_t& slot(std::int32_t g, std::int32_t l) { return slots_[static_cast<std::size_t>(g * slots_per_rank_ + l)]; }
  [[nodiscard]] double fresh_load(std::int32_t g) const {
    double sum = 0;
    for (std::int32_t l = 0; l < slots_per_rank_; ++l)
      if (std::int32_t const e = expert_at(g, l); e >= 0) sum += per_replica(e);
    return sum;
  }
  void refresh(std::int32_t g) { rank_load_[static_cast<std::size_t>(g)] = fresh_load(g); }
  //! After r_e changed: every holder of e.
  void refresh_holders(std::int32_t e) {
    std::int32_t const l = placement_.local_index_of(e);
    for (std::int32_t g = 0; g < ranks_; ++g)
      if (expert_at(g, l) == e) refresh(g);
  }

  replica_placement const& placement_;
  std::int64_t const* load_;
  std::vector<std::int32_t>& slots_;
  std::vector<std::int32_t>& replicas_;
  std::vector<double>& rank_load_;
  std::int32_t ranks_, slots_per_rank_;
};

//! One or two moves the greedy makes together, and their score.
struct flexmoe_candidate {
  replica_move moves[2];
  std::int32_t size = 0;
  double after = 0;  //!< predicted step seconds
  double net = 0;    //!< gain over the interval minus cost
  //! The move that gains a replica: its expert and rank order ties.
  [[nodiscard]] replica_move const& gaining() const { return moves[size - 1]; }
};

inline void check_flexmoe_options(char const* op, flexmoe_planner_options const& o) {
  require(o.imbalance_threshold >= 1, op, "options.imbalance_threshold = ", o.imbalance_threshold, " must be >= 1");
  require(o.interval_steps > 0, op, "options.interval_steps = ", o.interval_steps, " must be positive");
  require(o.seconds_per_row > 0 && std::isfinite(o.seconds_per_row), op, "options.seconds_per_row = ", o.seconds_per_row,
          " must be finite and positive");
  require(o.bytes_per_replica >= 0 && std::isfinite(o.bytes_per_replica), op, "options.bytes_per_replica = ",
          o.bytes_per_replica, " must be finite and >= 0");
  require(o.move_bytes_per_second > 0, op, "options.move_bytes_per_second = ", o.move_bytes_per_second, " must be positive");
  require(o.max_moves >= 0, op, "options.max_moves = ", o.max_moves, " must be >= 0");
  // bytes_moved is an int64: max_moves copies of a replica must fit.
  require(o.bytes_per_replica * o.max_moves <= 0x1p62, op, "options.bytes_per_replica = ", o.bytes_per_replica,
          " times options.max_moves = ", o.max_moves, " exceeds 2^62 bytes");
}

}  // namespace detail

//! FlexMoE's greedy on `current` for the per-expert loads `expert_loads` (size E, each >= 0:
//! tokens per step, e.g. the last step's or an average), as the file comment describes. `out` is
//! overwritten (its vectors keep their capacity), `ws` likewise: a warm call allocates nothing
//! unless it plans more moves than any before.
//! @throws error (invalid_argument) naming `expert_loads` (size, a negative entry) or the option out
//!         of range.
inline void plan_replica_moves(replica_placement const& current, array_view<std::int64_t const> expert_loads,
                               flexmoe_planner_options const& options, placement_decision& out, flexmoe_planner_workspace& ws) {
  char const* const op = "plan_replica_moves";
  std::int32_t const R = current.num_ranks(), S = current.slots_per_rank(), E = current.num_experts();
  detail::require(expert_loads.size == E, op, "expert_loads has ", expert_loads.size, " entries, the placement has ", E, " experts");
  detail::require(expert_loads.data != nullptr, op, "expert_loads is null");
  double total = 0;
  for (std::int32_t e = 0; e < E; ++e) {
    std::int64_t const x = expert_loads.data[e];
    detail::require(x >= 0, op, "expert_loads[", e, "] = ", x, " is negative");
    total += static_cast<double>(x);
  }
  detail::check_flexmoe_options(op, options);

  detail::flexmoe_state state(current, expert_loads.data, out.slot_expert_after, ws.replicas, out.rank_load_after);
  out.rank_load_before.assign(out.rank_load_after.begin(), out.rank_load_after.end());
  double const mean = total / R;
  auto const imbalance = [&](double busiest) { return total > 0 ? busiest / mean : 1.0; };
  double const busiest_before = state.load(state.busiest());
  out.imbalance_before = imbalance(busiest_before);
  out.step_seconds_before = busiest_before * options.seconds_per_row;
  out.triggered = out.imbalance_before > options.imbalance_threshold;
  out.moves.clear();
  ws.tried.assign(static_cast<std::size_t>(E), -1);

  double const seconds_per_copy = options.bytes_per_replica / options.move_bytes_per_second;
  auto const max_moves = static_cast<std::size_t>(options.max_moves);
  double before = out.step_seconds_before, imbalance_now = out.imbalance_before;
  std::int32_t copies = 0;  // expand and migrate moves: the ones that cost
  for (std::int32_t step = 0; imbalance_now > options.imbalance_threshold && out.moves.size() < max_moves; ++step) {
    detail::flexmoe_candidate best;
    auto const consider = [&](detail::flexmoe_candidate c) {
      for (std::int32_t i = 0; i < c.size; ++i) state.apply(c.moves[i]);
      c.after = state.load(state.busiest()) * options.seconds_per_row;
      for (std::int32_t i = c.size; i-- > 0;) state.undo(c.moves[i]);
      double const gain = before - c.after;
      c.net = gain * options.interval_steps - seconds_per_copy;  // each candidate copies one replica
      if (!(gain > 0) || !(c.net > 0)) return;
      replica_move const &m = c.gaining(), *b = best.size > 0 ? &best.gaining() : nullptr;
      if (b == nullptr || c.net > best.net ||
          (c.net == best.net && (m.expert < b->expert || (m.expert == b->expert && m.to_rank < b->to_rank))))
        best = c;
    };

    // (a) The hottest expert with a qualifying target: a free slot in its row, or a replace.
    for (;;) {
      std::int32_t hot = -1;
      for (std::int32_t e = 0; e < E; ++e)
        if (ws.tried[static_cast<std::size_t>(e)] != step && expert_loads.data[e] > 0 && state.replicas(e) < R &&
            (hot < 0 || state.per_replica(e) > state.per_replica(hot)))
          hot = e;
      if (hot < 0) break;
      std::int32_t const l = current.local_index_of(hot);
      if (std::int32_t const g = state.least_loaded_free(l); g >= 0) consider({{{replica_move_kind::expand, hot, -1, g}}, 1});
      std::int32_t cold = -1;
      if (out.moves.size() + 2 <= max_moves)
        for (std::int32_t f = 0; f < E; ++f)
          if (f != hot && current.local_index_of(f) == l && state.replicas(f) > 1 &&
              (cold < 0 || state.per_replica(f) < state.per_replica(cold)))
            cold = f;
      if (cold >= 0) {
        std::int32_t const g = state.least_loaded_holder(cold);  // its slot in row l: g cannot hold hot
        consider({{{replica_move_kind::shrink, cold, g, -1}, {replica_move_kind::expand, hot, -1, g}}, 2});
      }
      if (best.size > 0) break;
      ws.tried[static_cast<std::size_t>(hot)] = step;
    }

    // (b) Each replica of the busiest rank onto the least-loaded rank with a free slot in its row.
    std::int32_t const a = state.busiest();
    for (std::int32_t l = 0; l < S; ++l) {
      std::int32_t const e = state.expert_at(a, l);
      if (e < 0 || expert_loads.data[e] == 0) continue;
      if (std::int32_t const b = state.least_loaded_free(l); b >= 0) consider({{{replica_move_kind::migrate, e, a, b}}, 1});
    }

    if (best.size == 0) break;
    for (std::int32_t i = 0; i < best.size; ++i) {
      state.apply(best.moves[i]);
      out.moves.push_back(best.moves[i]);
    }
    ++copies;
    before = best.after;
    imbalance_now = imbalance(state.load(state.busiest()));
  }

  double const busiest_after = state.load(state.busiest());
  out.imbalance_after = imbalance(busiest_after);
  out.step_seconds_after = busiest_after * options.seconds_per_row;
  out.move_seconds = copies * seconds_per_copy;
  out.bytes_moved = std::llround(copies * options.bytes_per_replica);
}

//! `plan_replica_moves` as a one-off call returning a fresh decision.
[[nodiscard]] inline placement_decision plan_replica_moves(replica_placement const& current,
                                                           array_view<std::int64_t const> expert_loads,
                                                           flexmoe_planner_options const& options = {}) {
  placement_decision out;
  flexmoe_planner_workspace ws;
  plan_replica_moves(current, expert_loads, options, out, ws);
  return out;
}

//! `current` with `moves` applied in order. Each move is checked against the state the moves
//! before it left: its expert exists; an expand's or a migrate's `to_rank` is a rank whose slot at
//! the expert's local index is empty; a shrink's or a migrate's `from_rank` holds the expert; a
//! shrink leaves at least one replica; the unused rank is -1.
//! @throws error (invalid_argument) naming the index of the first illegal move and why.
[[nodiscard]] inline replica_placement apply_replica_moves(replica_placement const& current, array_view<replica_move const> moves) {
  char const* const op = "apply_replica_moves";
  detail::require(moves.size >= 0 && (moves.data != nullptr || moves.size == 0), op, "moves has ", moves.size,
                  " entries at a null pointer");
  std::int32_t const R = current.num_ranks(), S = current.slots_per_rank(), E = current.num_experts();
  std::vector<std::int32_t> slots = current.slot_experts();
  std::vector<std::int32_t> replicas(static_cast<std::size_t>(E));
  for (std::int32_t e = 0; e < E; ++e) replicas[static_cast<std::size_t>(e)] = current.replica_count(e);
  for (std::int64_t i = 0; i < moves.size; ++i) {
    replica_move const& m = moves.data[i];
    auto const check = [&](bool ok, auto const&... why) { detail::require(ok, op, "moves[", i, "] (", m, "): ", why...); };
    check(m.expert >= 0 && m.expert < E, "expert ", m.expert, " is not in [0, ", E, ")");
    std::int32_t const l = current.local_index_of(m.expert);
    bool const gains = m.kind == replica_move_kind::expand || m.kind == replica_move_kind::migrate;
    bool const loses = m.kind == replica_move_kind::shrink || m.kind == replica_move_kind::migrate;
    check(gains || loses, "unknown kind ", static_cast<int>(m.kind));
    if (loses) {
      check(m.from_rank >= 0 && m.from_rank < R, "from_rank ", m.from_rank, " is not a rank in [0, ", R, ")");
      check(slots[static_cast<std::size_t>(m.from_rank * S + l)] == m.expert, "rank ", m.from_rank, " does not hold expert ",
            m.expert);
    } else {
      check(m.from_rank == -1, "from_rank must be -1");
    }
    if (gains) {
      check(m.to_rank >= 0 && m.to_rank < R, "to_rank ", m.to_rank, " is not a rank in [0, ", R, ")");
      std::int32_t const there = slots[static_cast<std::size_t>(m.to_rank * S + l)];
      check(there == -1, "slot (rank ", m.to_rank, ", local ", l, ") holds expert ", there, ", not empty");
    } else {
      check(m.to_rank == -1, "to_rank must be -1");
      check(replicas[static_cast<std::size_t>(m.expert)] > 1, "it would remove the last replica of expert ", m.expert);
    }
    if (loses) slots[static_cast<std::size_t>(m.from_rank * S + l)] = -1;
    if (gains) slots[static_cast<std::size_t>(m.to_rank * S + l)] = m.expert;
    replicas[static_cast<std::size_t>(m.expert)] += (gains ? 1 : 0) - (loses ? 1 : 0);
  }
  return replica_placement(E, R, S, std::move(slots));
}

MOECOMM_NAMESPACE_END
