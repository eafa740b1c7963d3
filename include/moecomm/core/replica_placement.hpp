// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_placement`: experts held by several ranks (FineMoE/MicroMoE, FlexMoE, Pro-Prophet;
//! reference/systems.md §3, §4). Each rank has `S` expert slots, `(rank, local index)`; expert `e`
//! has a set `G_e` of one or more replicas, each in a slot, and **all replicas of an expert use the
//! same local index** (FineMoE App. B.3: per-expert reductions in local-index order then cannot
//! deadlock). Every slot holds at most one replica.
//!
//! Constructors:
//! - `contiguous(E, R)`: one replica per expert, expert `e` on rank `e / L` at `e % L` (today's
//!   expert parallelism, `contiguous_placement`).
//! - `cyclic(R, S, r)`: FineMoE's symmetric placement without load knowledge, reconstructed (§6 says
//!   "Cayley-graph placements", nothing more): in slot row `l`, the experts' replica sets are the
//!   translates `{b, b + d_l, ..., b + (r − 1)·d_l}` (mod R) of an arithmetic progression whose step
//!   `d_l` cycles through the divisors of `R / r`, so rows tile the ranks differently and different
//!   experts' replica groups intersect (the point of FineEP). `E = R·S / r`.
//! - `from_loads(R, S, loads, seed)`: FineMoE's asymmetric placement: replica counts greedily
//!   proportional to the expected loads (every expert at least one, `R·S` in all), packed into
//!   slot rows largest first, each expert's replicas on distinct ranks drawn by a seeded generator
//!   (the paper's Monte Carlo placement, one draw).

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

class replica_placement {
 public:
  //! From `slot_expert[rank * S + l]`: the expert in slot `(rank, l)`, or -1 for an empty slot.
  //! @throws error (invalid_argument) naming the slot or expert that breaks a rule of the file
  //!         comment, or an expert without a replica.
  replica_placement(std::int32_t num_experts, std::int32_t num_ranks, std::int32_t slots_per_rank,
                    std::vector<std::int32_t> slot_expert)
      : experts_(num_experts), ranks_(num_ranks), slots_(slots_per_rank), slot_expert_(std::move(slot_expert)) {
    char const* op = "replica_placement";
    detail::require(num_experts > 0, op, "num_experts = ", num_experts, " must be positive");
    detail::require(num_ranks > 0, op, "num_ranks = ", num_ranks, " must be positive");
    detail::require(slots_per_rank > 0, op, "slots_per_rank = ", slots_per_rank, " must be positive");
    detail::require(static_cast<std::int64_t>(slot_expert_.size()) == std::int64_t{num_ranks} * slots_per_rank, op,
                    "slot_expert has ", slot_expert_.size(), " entries, ranks x slots = ", std::int64_t{num_ranks} * slots_per_rank);
    local_.assign(static_cast<std::size_t>(num_experts), -1);
    offsets_.assign(static_cast<std::size_t>(num_experts) + 1, 0);
    for (std::int32_t r = 0; r < num_ranks; ++r)
      for (std::int32_t l = 0; l < slots_per_rank; ++l) {
        std::int32_t const e = slot_expert_[static_cast<std::size_t>(r * slots_per_rank + l)];
        if (e == -1) continue;
        detail::require(e >= 0 && e < num_experts, op, "slot (rank ", r, ", local ", l, ") holds expert ", e, ", not in [0, ",
                        num_experts, ")");
        std::int32_t& local = local_[static_cast<std::size_t>(e)];
        detail::require(local == -1 || local == l, op, "expert ", e, " has replicas at local indices ", local, " and ", l,
                        " (all replicas of an expert share one local index)");
        local = l;
        ++offsets_[static_cast<std::size_t>(e) + 1];
      }
    for (std::int32_t e = 0; e < num_experts; ++e)
      detail::require(offsets_[static_cast<std::size_t>(e) + 1] > 0, op, "expert ", e, " has no replica");
    std::partial_sum(offsets_.begin(), offsets_.end(), offsets_.begin());
    replica_ranks_.resize(static_cast<std::size_t>(offsets_.back()));
    std::vector<std::int32_t> next(offsets_.begin(), offsets_.end() - 1);
    for (std::int32_t r = 0; r < num_ranks; ++r)  // ascending rank within each expert
      for (std::int32_t l = 0; l < slots_per_rank; ++l) {
        std::int32_t const e = slot_expert_[static_cast<std::size_t>(r * slots_per_rank + l)];
        if (e >= 0) replica_ranks_[static_cast<std::size_t>(next[static_cast<std::size_t>(e)]++)] = r;
      }
  }

  //! One replica per expert, in contiguous blocks (`contiguous_placement`).
  [[nodiscard]] static replica_placement contiguous(std::int32_t num_experts, std::int32_t num_ranks) {
    detail::require(num_ranks > 0 && num_experts > 0 && num_experts % num_ranks == 0, "replica_placement::contiguous",
                    "num_experts = ", num_experts, " must be a positive multiple of num_ranks = ", num_ranks);
    std::vector<std::int32_t> slots(static_cast<std::size_t>(num_experts));
    std::iota(slots.begin(), slots.end(), 0);
    return replica_placement(num_experts, num_ranks, num_experts / num_ranks, std::move(slots));
  }

  //! The symmetric placement of the file comment: `replicas` per expert, `R·S / replicas` experts.
  //! @throws error (invalid_argument) unless `replicas` divides `num_ranks`.
  [[nodiscard]] static replica_placement cyclic(std::int32_t num_ranks, std::int32_t slots_per_rank, std::int32_t replicas) {
    char const* op = "replica_placement::cyclic";
    detail::require(num_ranks > 0 && slots_per_rank > 0, op, "num_ranks = ", num_ranks, " and slots_per_rank = ", slots_per_rank,
                    " must be positive");
    detail::require(replicas >= 1 && num_ranks % replicas == 0, op, "replicas = ", replicas, " must divide num_ranks = ", num_ranks);
    std::int32_t const groups = num_ranks / replicas;  // experts per slot row
    std::vector<std::int32_t> steps;                   // the divisors of R / r: the progressions' steps
    for (std::int32_t d = 1; d <= groups; ++d)
      if (groups % d == 0) steps.push_back(d);
    std::vector<std::int32_t> slots(static_cast<std::size_t>(num_ranks) * slots_per_rank, -1);
    for (std::int32_t l = 0; l < slots_per_rank; ++l) {
      std::int32_t const d = steps[static_cast<std::size_t>(l) % steps.size()];
      // Translates of {0, d, ..., (r − 1)·d} by b = a + k·d·r (0 <= a < d, 0 <= k < R / (d·r)) tile Z_R.
      std::int32_t e = l * groups;
      for (std::int32_t k = 0; k < num_ranks / (d * replicas); ++k)
        for (std::int32_t a = 0; a < d; ++a, ++e)
          for (std::int32_t j = 0; j < replicas; ++j)
            slots[static_cast<std::size_t>((a + k * d * replicas + j * d) * slots_per_rank + l)] = e;
    }
    return replica_placement(groups * slots_per_rank, num_ranks, slots_per_rank, std::move(slots));
  }

  //! Every domain of `ranks_per_domain` consecutive ranks holds every expert once: slot `(r, l)`
  //! holds expert `(r mod P) · S + l` (P = `ranks_per_domain`), so there are `P · S` experts with
  //! `R / P` replicas each, one per domain (with `domain_split`: expert parallelism inside each
  //! domain, expert data parallelism across them).
  //! @throws error (invalid_argument) unless `ranks_per_domain` divides `num_ranks`.
  [[nodiscard]] static replica_placement per_domain(std::int32_t num_ranks, std::int32_t slots_per_rank,
                                                    std::int32_t ranks_per_domain) {
    char const* op = "replica_placement::per_domain";
    detail::require(num_ranks > 0 && slots_per_rank > 0, op, "num_ranks = ", num_ranks, " and slots_per_rank = ", slots_per_rank,
                    " must be positive");
    detail::require(ranks_per_domain >= 1 && num_ranks % ranks_per_domain == 0, op, "ranks_per_domain = ", ranks_per_domain,
                    " must divide num_ranks = ", num_ranks);
    std::vector<std::int32_t> slots(static_cast<std::size_t>(num_ranks) * slots_per_rank);
    for (std::int32_t r = 0; r < num_ranks; ++r)
      for (std::int32_t l = 0; l < slots_per_rank; ++l)
        slots[static_cast<std::size_t>(r * slots_per_rank + l)] = (r % ranks_per_domain) * slots_per_rank + l;
    return replica_placement(ranks_per_domain * slots_per_rank, num_ranks, slots_per_rank, std::move(slots));
  }

  //! The load-aware placement of the file comment. `loads[e]` >= 0 (expected tokens of expert e).
  //! @throws error (invalid_argument) when the experts do not fit (`E > R·S`) or a load is negative.
  [[nodiscard]] static replica_placement from_loads(std::int32_t num_ranks, std::int32_t slots_per_rank,
                                                    std::vector<double> const& loads, std::uint64_t seed) {
    char const* op = "replica_placement::from_loads";
    auto const E = static_cast<std::int32_t>(loads.size());
    detail::require(num_ranks > 0 && slots_per_rank > 0, op, "num_ranks = ", num_ranks, " and slots_per_rank = ", slots_per_rank,
                    " must be positive");
    detail::require(E > 0 && std::int64_t{E} <= std::int64_t{num_ranks} * slots_per_rank, op, "loads has ", E,
                    " experts: between 1 and ranks x slots = ", std::int64_t{num_ranks} * slots_per_rank);
    for (std::int32_t e = 0; e < E; ++e)
      detail::require(loads[static_cast<std::size_t>(e)] >= 0, op, "loads[", e, "] = ", loads[static_cast<std::size_t>(e)],
                      " must be >= 0");
    // Replica counts: one each, then each further slot to the expert of the largest load per replica.
    std::vector<std::int32_t> count(static_cast<std::size_t>(E), 1);
    for (std::int64_t extra = std::int64_t{num_ranks} * slots_per_rank - E; extra > 0; --extra) {
      std::int32_t best = -1;
      for (std::int32_t e = 0; e < E; ++e) {
        if (count[static_cast<std::size_t>(e)] == num_ranks) continue;  // a replica on every rank already
        if (best < 0 || loads[static_cast<std::size_t>(e)] * count[static_cast<std::size_t>(best)] >
                            loads[static_cast<std::size_t>(best)] * count[static_cast<std::size_t>(e)])
          best = e;
      }
      if (best < 0) break;
      ++count[static_cast<std::size_t>(best)];
    }
    // Slot rows of R slots, filled largest count first (first fit); an expert that fits no row
    // gives up replicas until it does.
    std::vector<std::int32_t> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return count[static_cast<std::size_t>(a)] > count[static_cast<std::size_t>(b)]; });
    std::vector<std::int32_t> free_in_row(static_cast<std::size_t>(slots_per_rank), num_ranks), row(static_cast<std::size_t>(E));
    for (std::int32_t e : order) {
      std::int32_t& c = count[static_cast<std::size_t>(e)];
      auto const fits = [&] {
        for (std::int32_t l = 0; l < slots_per_rank; ++l)
          if (free_in_row[static_cast<std::size_t>(l)] >= c) return l;
        return -1;
      };
      std::int32_t l = fits();
      while (l < 0) {  // ends by c = 1: the counts never exceed R·S in all, so a row has a free slot
        --c;
        l = fits();
      }
      row[static_cast<std::size_t>(e)] = l;
      free_in_row[static_cast<std::size_t>(l)] -= c;
    }
    // Fill a row's free slots with more replicas of its experts, the largest load per replica first.
    for (std::int32_t l = 0; l < slots_per_rank; ++l)
      while (free_in_row[static_cast<std::size_t>(l)] > 0) {
        std::int32_t best = -1;
        for (std::int32_t e = 0; e < E; ++e)
          if (row[static_cast<std::size_t>(e)] == l && count[static_cast<std::size_t>(e)] < num_ranks &&
              (best < 0 || loads[static_cast<std::size_t>(e)] * count[static_cast<std::size_t>(best)] >
                               loads[static_cast<std::size_t>(best)] * count[static_cast<std::size_t>(e)]))
            best = e;
        if (best < 0) break;  // the row's experts are on every rank already: the slots stay empty
        ++count[static_cast<std::size_t>(best)];
        --free_in_row[static_cast<std::size_t>(l)];
      }
    // Ranks: each expert's replicas on distinct free ranks of its row, drawn by the seeded generator.
    std::mt19937_64 rng(seed);
    std::vector<std::int32_t> slots(static_cast<std::size_t>(num_ranks) * slots_per_rank, -1);
    for (std::int32_t l = 0; l < slots_per_rank; ++l) {
      std::vector<std::int32_t> free_ranks(static_cast<std::size_t>(num_ranks));
      std::iota(free_ranks.begin(), free_ranks.end(), 0);
      std::shuffle(free_ranks.begin(), free_ranks.end(), rng);
      std::size_t next = 0;
      for (std::int32_t e : order)
        if (row[static_cast<std::size_t>(e)] == l)
          for (std::int32_t j = 0; j < count[static_cast<std::size_t>(e)]; ++j)
            slots[static_cast<std::size_t>(free_ranks[next++] * slots_per_rank + l)] = e;
    }
    return replica_placement(E, num_ranks, slots_per_rank, std::move(slots));
  }

  [[nodiscard]] std::int32_t num_experts() const { return experts_; }
  [[nodiscard]] std::int32_t num_ranks() const { return ranks_; }
  //! S, expert slots per rank.
  [[nodiscard]] std::int32_t slots_per_rank() const { return slots_; }
  //! The expert in slot `(rank, local)`, or -1.
  [[nodiscard]] std::int32_t expert_at(std::int32_t rank, std::int32_t local) const {
    return slot_expert_[static_cast<std::size_t>(rank * slots_ + local)];
  }
  //! The slot table `[rank * S + local]`: the expert in each slot, or -1 (the constructor's argument).
  [[nodiscard]] std::vector<std::int32_t> const& slot_experts() const { return slot_expert_; }
  //! The local index every replica of `e` uses.
  [[nodiscard]] std::int32_t local_index_of(std::int32_t e) const { return local_[static_cast<std::size_t>(e)]; }
  //! |G_e|.
  [[nodiscard]] std::int32_t replica_count(std::int32_t e) const {
    return offsets_[static_cast<std::size_t>(e) + 1] - offsets_[static_cast<std::size_t>(e)];
  }
  //! `[E + 1]` offsets into `replica_ranks()`: expert e's replicas, ascending rank.
  [[nodiscard]] std::vector<std::int32_t> const& replica_offsets() const { return offsets_; }
  [[nodiscard]] std::vector<std::int32_t> const& replica_ranks() const { return replica_ranks_; }
  //! A 63-bit digest of the shape and the slot table (FNV-1a), for ranks to check they hold the same
  //! placement with one all-gather.
  [[nodiscard]] std::int64_t digest() const {
    std::uint64_t h = 1469598103934665603ull;
    auto const mix = [&](std::int32_t v) { h = (h ^ static_cast<std::uint32_t>(v)) * 1099511628211ull; };
    mix(experts_);
    mix(ranks_);
    mix(slots_);
    for (std::int32_t e : slot_expert_) mix(e);
    return static_cast<std::int64_t>(h >> 1);
  }

 private:
  std::int32_t experts_, ranks_, slots_;
  std::vector<std::int32_t> slot_expert_, local_, offsets_, replica_ranks_;
};

MOECOMM_NAMESPACE_END
