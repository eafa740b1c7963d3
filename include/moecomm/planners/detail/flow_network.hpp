// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! A small integral flow network for the host planners: Dinic's maximum flow, and the primal-dual
//! minimum-cost flow (Dijkstra on reduced costs, then Dinic's maximum flow on the arcs of reduced
//! cost zero). Integer capacities and costs keep every answer exact and identical on every rank;
//! the arrays keep their capacity between calls, so a network rebuilt or re-solved in a steady
//! state allocates nothing. Arcs of a node are visited newest first, which makes ties
//! deterministic.

#include <moecomm/config.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

class flow_network {
 public:
  static constexpr std::int64_t infinite = std::numeric_limits<std::int64_t>::max() / 4;

  //! An empty network of `nodes` nodes.
  void reset(std::int32_t nodes) {
    head_.assign(static_cast<std::size_t>(nodes), -1);
    to_.clear();
    next_.clear();
    cap_.clear();
    initial_cap_.clear();
    cost_.clear();
  }

  //! Appends a node without arcs; returns its id.
  std::int32_t add_node() {
    head_.push_back(-1);
    return static_cast<std::int32_t>(head_.size() - 1);
  }

  [[nodiscard]] std::int32_t num_nodes() const { return static_cast<std::int32_t>(head_.size()); }

  //! Adds `from -> to` with capacity `cap` and cost `cost` per unit (>= 0), and its residual twin;
  //! returns the arc's id (the twin is `id ^ 1`).
  std::int32_t add_arc(std::int32_t from, std::int32_t to, std::int64_t cap, std::int64_t cost = 0) {
    auto const id = static_cast<std::int32_t>(to_.size());
    push(from, to, cap, cost);
    push(to, from, 0, -cost);
    return id;
  }

  //! Flow on arc `id` (initial capacity minus residual).
  [[nodiscard]] std::int64_t flow(std::int32_t id) const {
    return initial_cap_[static_cast<std::size_t>(id)] - cap_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] std::int64_t cost(std::int32_t id) const { return cost_[static_cast<std::size_t>(id)]; }

  //! Raises the capacity of arc `id` by `delta`, keeping the flow.
  void raise_capacity(std::int32_t id, std::int64_t delta) {
    cap_[static_cast<std::size_t>(id)] += delta;
    initial_cap_[static_cast<std::size_t>(id)] += delta;
  }

  //! Sets the capacity of arc `id` to `cap` from the next `min_cost_max_flow` on.
  void set_capacity(std::int32_t id, std::int64_t cap) { initial_cap_[static_cast<std::size_t>(id)] = cap; }

  //! Augments the current flow to a maximum one from `s` to `t` (Dinic); returns the flow added.
  //! Afterwards `reachable(v)` tells the source side of a minimum cut.
  std::int64_t max_flow(std::int32_t s, std::int32_t t) {
    potential_.assign(head_.size(), 0);
    return blocking_flows(s, t);
  }

  //! A minimum-cost maximum flow from `s` to `t`, from zero flow; returns its cost. Phases: Dijkstra
  //! on reduced costs `c + π(u) − π(v)` (kept >= 0), π += distance capped at the sink's, then Dinic
  //! on the arcs whose reduced cost is zero. The phases are as many as the distinct lengths of
  //! successive shortest paths.
  std::int64_t min_cost_max_flow(std::int32_t s, std::int32_t t) {
    cap_.assign(initial_cap_.begin(), initial_cap_.end());
    potential_.assign(head_.size(), 0);
    for (;;) {
      shortest_distances(s);
      std::int64_t const dt = dist_[static_cast<std::size_t>(t)];
      if (dt == infinite) break;
      for (std::size_t v = 0; v < head_.size(); ++v) potential_[v] += std::min(dist_[v], dt);
      blocking_flows(s, t);
    }
    std::int64_t total = 0;
    for (std::size_t a = 0; a < to_.size(); a += 2) total += flow(static_cast<std::int32_t>(a)) * cost_[a];
    return total;
  }

  //! After `max_flow`: whether `v` is on the source side of the minimum cut it found.
  [[nodiscard]] bool reachable(std::int32_t v) const { return level_[static_cast<std::size_t>(v)] >= 0; }

 private:
  void push(std::int32_t from, std::int32_t to, std::int64_t cap, std::int64_t cost) {
    to_.push_back(to);
    next_.push_back(head_[static_cast<std::size_t>(from)]);
    head_[static_cast<std::size_t>(from)] = static_cast<std::int32_t>(to_.size() - 1);
    cap_.push_back(cap);
    initial_cap_.push_back(cap);
    cost_.push_back(cost);
  }

  [[nodiscard]] bool admissible(std::int32_t a, std::int32_t u) const {
    auto const i = static_cast<std::size_t>(a);
    return cap_[i] > 0 &&
           cost_[i] + potential_[static_cast<std::size_t>(u)] - potential_[static_cast<std::size_t>(to_[i])] == 0;
  }

  //! Dijkstra from `s` over residual arcs with reduced costs into `dist_`.
  void shortest_distances(std::int32_t s) {
    dist_.assign(head_.size(), infinite);
    heap_.clear();
    dist_[static_cast<std::size_t>(s)] = 0;
    heap_.push_back({0, s});
    auto const later = [](entry const& a, entry const& b) { return a.d != b.d ? a.d > b.d : a.v > b.v; };
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), later);
      entry const top = heap_.back();
      heap_.pop_back();
      if (top.d != dist_[static_cast<std::size_t>(top.v)]) continue;
      for (std::int32_t a = head_[static_cast<std::size_t>(top.v)]; a >= 0; a = next_[static_cast<std::size_t>(a)]) {
        auto const i = static_cast<std::size_t>(a);
        if (cap_[i] <= 0) continue;
        auto const w = static_cast<std::size_t>(to_[i]);
        std::int64_t const d = top.d + cost_[i] + potential_[static_cast<std::size_t>(top.v)] - potential_[w];
        if (d < dist_[w]) {
          dist_[w] = d;
          heap_.push_back({d, to_[i]});
          std::push_heap(heap_.begin(), heap_.end(), later);
        }
      }
    }
  }

  //! Dinic on the admissible arcs until `t` is unreachable; `level_` then marks the source side.
  std::int64_t blocking_flows(std::int32_t s, std::int32_t t) {
    std::int64_t total = 0;
    while (levels(s, t)) {
      current_.assign(head_.begin(), head_.end());
      while (std::int64_t const f = augment(s, t, infinite)) total += f;
    }
    return total;
  }

  bool levels(std::int32_t s, std::int32_t t) {
    level_.assign(head_.size(), -1);
    queue_.clear();
    level_[static_cast<std::size_t>(s)] = 0;
    queue_.push_back(s);
    for (std::size_t q = 0; q < queue_.size(); ++q) {
      std::int32_t const u = queue_[q];
      for (std::int32_t a = head_[static_cast<std::size_t>(u)]; a >= 0; a = next_[static_cast<std::size_t>(a)]) {
        auto const w = static_cast<std::size_t>(to_[static_cast<std::size_t>(a)]);
        if (level_[w] < 0 && admissible(a, u)) {
          level_[w] = level_[static_cast<std::size_t>(u)] + 1;
          queue_.push_back(static_cast<std::int32_t>(w));
        }
      }
    }
    return level_[static_cast<std::size_t>(t)] >= 0;
  }

  std::int64_t augment(std::int32_t u, std::int32_t t, std::int64_t limit) {
    if (u == t) return limit;
    for (std::int32_t& a = current_[static_cast<std::size_t>(u)]; a >= 0; a = next_[static_cast<std::size_t>(a)]) {
      auto const i = static_cast<std::size_t>(a);
      std::int32_t const w = to_[i];
      if (level_[static_cast<std::size_t>(w)] != level_[static_cast<std::size_t>(u)] + 1 || !admissible(a, u)) continue;
      if (std::int64_t const f = augment(w, t, std::min(limit, cap_[i]))) {
        cap_[i] -= f;
        cap_[i ^ 1] += f;
        return f;
      }
    }
    return 0;
  }

  struct entry {
    std::int64_t d;
    std::int32_t v;
  };

  std::vector<std::int32_t> head_, to_, next_, level_, current_, queue_;
  std::vector<std::int64_t> cap_, initial_cap_, cost_, potential_, dist_;
  std::vector<entry> heap_;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
