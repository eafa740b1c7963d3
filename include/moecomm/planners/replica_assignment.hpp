// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Which replica each rank's tokens of an expert go to, from the all-gathered `[R][E]` counts: the
//! second half of replicated-expert dispatch (reference/systems.md §3, §4), after a split says how
//! many tokens each replica takes (`planners/replica_schedule.hpp`).
//!
//! - `assign_tokens_finemoe` (FineMoE Algorithm 1, §5.2): for each expert, every rank first sends
//!   its own tokens to its own replica, `min(its tokens, what that replica still takes)`; then the
//!   ranks in ascending order fill the replicas in ascending rank order with what is left. Each
//!   replica takes exactly its split.
//! - `assign_tokens_evenly` (FlexMoE): each rank's tokens of an expert are shared evenly among its
//!   replicas, the remainder one each to the first replicas in ascending rank.
//! - `assign_tokens_in_domain`: as evenly, among the expert's replicas in the rank's own domain
//!   (the topology's third level); among all of them when it has none there. With one replica per
//!   domain no token leaves its domain: expert parallelism inside, expert data parallelism across.
//!
//! A rank's tokens of one expert, in their dispatch order (the permute plan's (token, slot) order),
//! go to the replicas as contiguous ranges: its own replica's first, then the others in ascending
//! rank (`replica_assignment::replica_of`). Every rank computes the same assignment from the same
//! counts, so no further agreement is needed.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/error.hpp>
#include <moecomm/planners/replica_schedule.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Tokens of each (source rank, expert) per replica.
struct replica_assignment {
  std::int32_t num_ranks = 0;
  //! `take[s * K + offsets[e] + j]`: tokens rank s sends to replica j of expert e (K = all replicas),
  //! aligned with `replica_sets::ranks`.
  std::vector<std::int64_t> take;
  //! Algorithm 1's running totals (tokens a replica still takes, a rank still sends), kept between
  //! calls so that a warm assignment allocates nothing.
  std::vector<std::int64_t> still_takes, still_sends;

  //! The replica (index into expert e's list) that takes position `p` of rank `s`'s tokens of `e`:
  //! the own replica's range first, then the others in ascending rank. `p` must be below the count.
  [[nodiscard]] std::int32_t replica_of(replica_sets const& sets, std::int32_t s, std::int32_t e, std::int64_t p) const {
    std::int32_t const first = sets.offsets[static_cast<std::size_t>(e)], n = sets.offsets[static_cast<std::size_t>(e) + 1] - first;
    std::int64_t const* row = take.data() + static_cast<std::size_t>(s) * sets.ranks.size() + first;
    std::int32_t const own = own_replica(sets, s, e);
    if (own >= 0) {
      if (p < row[own]) return own;
      p -= row[own];
    }
    for (std::int32_t j = 0; j < n; ++j) {
      if (j == own) continue;
      if (p < row[j]) return j;
      p -= row[j];
    }
    detail::fail(status::invalid_argument, "replica_assignment::replica_of", "position ", p, " is past rank ", s,
                 "'s tokens of expert ", e);
  }

  //! The index of rank `s` in expert `e`'s replica list, or -1.
  [[nodiscard]] static std::int32_t own_replica(replica_sets const& sets, std::int32_t s, std::int32_t e) {
    auto const b = sets.ranks.begin() + sets.offsets[static_cast<std::size_t>(e)];
    auto const end = sets.ranks.begin() + sets.offsets[static_cast<std::size_t>(e) + 1];
    auto const it = std::find(b, end, s);
    return it == end ? -1 : static_cast<std::int32_t>(it - b);
  }
};

namespace detail {

//! Checks `counts` (`[R][E]`, non-negative) against `sets`; sizes `out`.
inline void prepare_assignment(char const* op, replica_sets const& sets, array_view<std::int64_t const> counts,
                               replica_assignment& out) {
  require(sets.num_ranks > 0 && sets.num_experts() > 0, op, "sets has ", sets.num_ranks, " ranks and ", sets.num_experts(),
          " experts: both must be positive");
  std::int32_t const R = sets.num_ranks, E = sets.num_experts();
  require(counts.size == std::int64_t{R} * E && (counts.data != nullptr || counts.size == 0), op, "argument 'counts' has ",
          counts.size, " entries, ranks x experts = ", std::int64_t{R} * E);
  for (std::int64_t i = 0; i < counts.size; ++i)
    require(counts.data[i] >= 0, op, "counts[", i / E, "][", i % E, "] = ", counts.data[i], " is negative");
  out.num_ranks = R;
  out.take.assign(static_cast<std::size_t>(R) * sets.ranks.size(), 0);
}

}  // namespace detail

//! FineMoE's Algorithm 1 (file comment). `counts` is `[R][E]`; `split` is aligned with `sets.ranks` (e.g.
//! `replica_schedule::split`); each expert's split must sum to its tokens over the ranks.
//! @throws error (invalid_argument) naming the expert whose split does not match its load, or a
//!         negative count or split.
inline void assign_tokens_finemoe(replica_sets const& sets, array_view<std::int64_t const> counts, std::vector<std::int64_t> const& split,
                                  replica_assignment& out) {
  char const* op = "assign_tokens_finemoe";
  detail::prepare_assignment(op, sets, counts, out);
  std::int32_t const R = sets.num_ranks, E = sets.num_experts();
  std::size_t const K = sets.ranks.size();
  detail::require(split.size() == K, op, "split has ", split.size(), " entries, the replicas ", K);
  std::vector<std::int64_t>& left = out.still_takes;
  std::vector<std::int64_t>& input = out.still_sends;
  left.resize(K);
  input.resize(static_cast<std::size_t>(R));
  for (std::int32_t e = 0; e < E; ++e) {
    std::int32_t const first = sets.offsets[static_cast<std::size_t>(e)], n = sets.offsets[static_cast<std::size_t>(e) + 1] - first;
    std::int64_t load = 0, taken = 0;
    for (std::int32_t s = 0; s < R; ++s) load += input[static_cast<std::size_t>(s)] = counts.data[std::int64_t{s} * E + e];
    for (std::int32_t j = 0; j < n; ++j) {
      std::int64_t const x = split[static_cast<std::size_t>(first + j)];
      detail::require(x >= 0, op, "split of expert ", e, " replica ", j, " = ", x, " is negative");
      taken += left[static_cast<std::size_t>(first + j)] = x;
    }
    detail::require(taken == load, op, "expert ", e, "'s split takes ", taken, " tokens, its ranks send ", load);
    auto give = [&](std::int32_t s, std::int32_t j) {  // rank s to replica j: as much as both allow
      std::int64_t& l = left[static_cast<std::size_t>(first + j)];
      std::int64_t const t = std::min(input[static_cast<std::size_t>(s)], l);
      out.take[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(first + j)] += t;
      input[static_cast<std::size_t>(s)] -= t;
      l -= t;
    };
    for (std::int32_t j = 0; j < n; ++j) give(sets.ranks[static_cast<std::size_t>(first + j)], j);  // own replica first
    for (std::int32_t s = 0; s < R; ++s)
      for (std::int32_t j = 0; j < n && input[static_cast<std::size_t>(s)] > 0; ++j) give(s, j);
  }
}

namespace detail {

//! Each rank's tokens of each expert shared evenly among the replicas `in(s, replica rank)` admits
//! (all of them when it admits none), the remainder one each to the first in ascending rank.
template <class Admits>
void assign_evenly_among(replica_sets const& sets, array_view<std::int64_t const> counts, replica_assignment& out, Admits&& in) {
  std::int32_t const R = sets.num_ranks, E = sets.num_experts();
  std::size_t const K = sets.ranks.size();
  for (std::int32_t s = 0; s < R; ++s)
    for (std::int32_t e = 0; e < E; ++e) {
      std::int32_t const first = sets.offsets[static_cast<std::size_t>(e)], n = sets.offsets[static_cast<std::size_t>(e) + 1] - first;
      auto const admitted = [&](std::int32_t j) { return in(s, sets.ranks[static_cast<std::size_t>(first + j)]); };
      std::int32_t m = 0;  // replicas admitted
      for (std::int32_t j = 0; j < n; ++j) m += admitted(j) ? 1 : 0;
      bool const all = m == 0;
      if (all) m = n;
      std::int64_t const c = counts.data[std::int64_t{s} * E + e];
      for (std::int32_t j = 0, i = 0; j < n; ++j) {
        if (!all && !admitted(j)) continue;
        out.take[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(first + j)] = c / m + (i < c % m ? 1 : 0);
        ++i;
      }
    }
}

}  // namespace detail

//! FlexMoE's even split (file comment).
//! @throws error (invalid_argument) naming a negative count.
inline void assign_tokens_evenly(replica_sets const& sets, array_view<std::int64_t const> counts, replica_assignment& out) {
  detail::prepare_assignment("assign_tokens_evenly", sets, counts, out);
  detail::assign_evenly_among(sets, counts, out, [](std::int32_t, std::int32_t) { return true; });
}

//! Each rank's tokens to its own domain's replicas (file comment); `domain_of(rank)` names a rank's
//! domain (e.g. `topology::domain_of`).
//! @throws error (invalid_argument) naming a negative count.
template <class DomainOf>
void assign_tokens_in_domain(replica_sets const& sets, array_view<std::int64_t const> counts, DomainOf&& domain_of,
                             replica_assignment& out) {
  detail::prepare_assignment("assign_tokens_in_domain", sets, counts, out);
  detail::assign_evenly_among(sets, counts, out, [&](std::int32_t s, std::int32_t r) { return domain_of(s) == domain_of(r); });
}

MOECOMM_NAMESPACE_END
