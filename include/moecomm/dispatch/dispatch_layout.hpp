// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dispatch_layout`: how many tokens go to each expert, rank and node, and which tokens go to
//! which rank (semantics §3; DeepEP's `get_dispatch_layout`).

#include <moecomm/config.hpp>
#include <moecomm/core/atomic.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/validate_routing.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! One token: marks the ranks it reaches and adds it to the expert, slot, rank and node counts.
//! Integer atomics keep the counts exact in any order.
template <class Placement>
struct count_token_destinations {
  std::int32_t const* idx;
  std::int32_t top_k;
  Placement placement;
  std::int32_t ranks_per_node;
  std::int32_t* tokens_per_expert;
  std::int32_t* slots_per_rank;
  std::int32_t* tokens_per_rank;
  std::int32_t* tokens_per_node;
  bool* is_token_in_rank;  //!< `[T][R]`

  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int32_t const ranks = placement.num_ranks();
    bool* in_rank = is_token_in_rank + t * ranks;
    for (std::int32_t r = 0; r < ranks; ++r) in_rank[r] = false;
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::int32_t const e = idx[t * top_k + k];
      if (!is_valid_expert(e, placement.num_experts())) continue;
      std::int32_t const r = placement.rank_of(e);
      atomic_add(tokens_per_expert + e, 1);
      atomic_add(slots_per_rank + r, 1);
      in_rank[r] = true;
    }
    for (std::int32_t node = 0; node * ranks_per_node < ranks; ++node) {
      bool in_node = false;
      for (std::int32_t r = node * ranks_per_node; r < (node + 1) * ranks_per_node; ++r) {
        if (in_rank[r]) atomic_add(tokens_per_rank + r, 1);
        in_node = in_node || in_rank[r];
      }
      if (in_node) atomic_add(tokens_per_node + node, 1);
    }
  }
};

}  // namespace detail

//! The counts of one routing decision, in the back-end's memory (semantics §3). Move-only.
template <class Backend>
class dispatch_layout {
  template <class T>
  using buffer_t = typename Backend::template buffer_type<T>;

 public:
  //! `[E]` slots routed to each expert (a duplicate counts twice).
  [[nodiscard]] std::int32_t const* tokens_per_expert() const { return counts_.data(); }
  //! `[R]` tokens that reach each rank (a token counts once per rank).
  [[nodiscard]] std::int32_t const* tokens_per_rank() const { return counts_.data() + num_experts_; }
  //! `[N]` tokens that reach each node (DeepEP's `num_tokens_per_rdma_rank`).
  [[nodiscard]] std::int32_t const* tokens_per_node() const { return counts_.data() + num_experts_ + num_ranks_; }
  //! `[R]` slots (rows of the expanded layout) sent to each rank.
  [[nodiscard]] std::int32_t const* slots_per_rank() const {
    return counts_.data() + num_experts_ + num_ranks_ + num_nodes_;
  }
  //! `[T][R]` whether token `t` goes to rank `r`.
  [[nodiscard]] bool const* is_token_in_rank() const { return is_token_in_rank_.data(); }
  [[nodiscard]] std::int32_t num_experts() const { return num_experts_; }
  [[nodiscard]] std::int32_t num_ranks() const { return num_ranks_; }
  [[nodiscard]] std::int32_t num_nodes() const { return num_nodes_; }
  [[nodiscard]] std::int64_t num_tokens() const { return num_tokens_; }

 private:
  template <class B, class P>
  friend dispatch_layout<B> make_dispatch_layout(B const&, routing_view const&, P const&, std::int32_t,
                                                 routing_checks const&);

  dispatch_layout(Backend const& be, std::int64_t tokens, std::int32_t experts, std::int32_t ranks, std::int32_t nodes)
      : num_tokens_(tokens),
        num_experts_(experts),
        num_ranks_(ranks),
        num_nodes_(nodes),
        counts_(be.template allocate<std::int32_t>(std::int64_t{experts} + 2 * std::int64_t{ranks} + nodes)),
        is_token_in_rank_(be.template allocate<bool>(tokens * ranks)) {}

  std::int64_t num_tokens_;
  std::int32_t num_experts_, num_ranks_, num_nodes_;
  buffer_t<std::int32_t> counts_;  //!< [experts | ranks | nodes | slots per rank]
  buffer_t<bool> is_token_in_rank_;
};

//! Computes the dispatch layout of `routing` for experts placed by `placement`, with ranks grouped
//! into nodes of `ranks_per_node` consecutive ranks. Masked slots count nowhere.
//! @param ranks_per_node G; must divide the number of ranks.
//! @throws error (invalid_argument) for bad routing (naming token and slot) or a bad node size.
template <class Backend, class Placement>
[[nodiscard]] dispatch_layout<Backend> make_dispatch_layout(Backend const& be, routing_view const& routing,
                                                            Placement const& placement, std::int32_t ranks_per_node,
                                                            routing_checks const& checks = {}) {
  char const* op = "make_dispatch_layout";
  std::int32_t const ranks = placement.num_ranks();
  detail::require(ranks_per_node > 0 && ranks % ranks_per_node == 0, op, "ranks_per_node = ", ranks_per_node,
                  " must be positive and divide num_ranks = ", ranks);
  validate_routing(be, routing, placement.num_experts(), checks, op);
  // No size below overflows: T < 2^31 (validate_routing) and E, R < 2^31, so T * R and E + 2R + N fit int64.
  std::int32_t const nodes = ranks / ranks_per_node;
  dispatch_layout<Backend> layout(be, routing.num_tokens, placement.num_experts(), ranks, nodes);
  be.for_each_index(layout.counts_.size(), detail::fill_value<std::int32_t>{layout.counts_.data(), 0});
  std::int32_t* counts = layout.counts_.data();
  be.for_each_index(routing.num_tokens,
                    detail::count_token_destinations<Placement>{
                        routing.topk_idx, routing.top_k, placement, ranks_per_node, counts,
                        counts + placement.num_experts() + ranks + nodes, counts + placement.num_experts(),
                        counts + placement.num_experts() + ranks, layout.is_token_in_rank_.data()});
  return layout;
}

//! The same with every rank on one node.
template <class Backend, class Placement>
[[nodiscard]] dispatch_layout<Backend> make_dispatch_layout(Backend const& be, routing_view const& routing,
                                                            Placement const& placement,
                                                            routing_checks const& checks = {}) {
  return make_dispatch_layout(be, routing, placement, placement.num_ranks(), checks);
}

MOECOMM_NAMESPACE_END
