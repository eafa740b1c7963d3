// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `topology`: how the ranks of an expert-parallel group sit on nodes.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! World = nodes x local ranks. Rank `r` is on node `node_of(r)` with local index `local_of(r)`.
//! By default ranks are contiguous per node (`r / G`, `r % G`); any mapping with equal node sizes
//! can be given instead.
class topology {
 public:
  //! Contiguous: `num_ranks / ranks_per_node` nodes of `ranks_per_node` consecutive ranks.
  //! @throws error (invalid_argument) unless `ranks_per_node` divides `num_ranks`.
  topology(std::int32_t num_ranks, std::int32_t ranks_per_node) {
    detail::require(num_ranks > 0, "topology", "num_ranks = ", num_ranks, " must be positive");
    detail::require(ranks_per_node > 0 && num_ranks % ranks_per_node == 0, "topology", "ranks_per_node = ",
                    ranks_per_node, " must be positive and divide num_ranks = ", num_ranks);
    std::vector<std::int32_t> node(static_cast<std::size_t>(num_ranks));
    for (std::int32_t r = 0; r < num_ranks; ++r) node[static_cast<std::size_t>(r)] = r / ranks_per_node;
    *this = topology(std::move(node));
  }

  //! Any mapping: `node_of_rank[r]` is rank r's node, nodes numbered `0..N-1`, each with the same
  //! number of ranks; local indices follow rank order within a node.
  //! @throws error (invalid_argument) naming the node whose size differs, or a bad node id.
  explicit topology(std::vector<std::int32_t> node_of_rank) : node_(std::move(node_of_rank)) {
    std::int32_t const ranks = static_cast<std::int32_t>(node_.size());
    detail::require(ranks > 0, "topology", "node_of_rank is empty");
    std::int32_t nodes = 0;
    for (std::int32_t r = 0; r < ranks; ++r) {
      std::int32_t const n = node_[static_cast<std::size_t>(r)];
      detail::require(n >= 0 && n < ranks, "topology", "node_of_rank[", r, "] = ", n, " is not in [0, ", ranks, ")");
      nodes = n + 1 > nodes ? n + 1 : nodes;
    }
    std::vector<std::int32_t> size(static_cast<std::size_t>(nodes), 0);
    local_.resize(node_.size());
    for (std::int32_t r = 0; r < ranks; ++r) local_[static_cast<std::size_t>(r)] = size[static_cast<std::size_t>(node_[static_cast<std::size_t>(r)])]++;
    per_node_ = size[0];
    for (std::int32_t n = 0; n < nodes; ++n)
      detail::require(size[static_cast<std::size_t>(n)] == per_node_, "topology", "node ", n, " has ",
                      size[static_cast<std::size_t>(n)], " ranks but node 0 has ", per_node_,
                      " (every node must hold the same number)");
    rank_at_.assign(static_cast<std::size_t>(ranks), 0);
    for (std::int32_t r = 0; r < ranks; ++r) rank_at_[static_cast<std::size_t>(node_of(r) * per_node_ + local_of(r))] = r;
  }

  //! R, ranks in the group.
  [[nodiscard]] std::int32_t num_ranks() const { return static_cast<std::int32_t>(node_.size()); }
  //! N, nodes.
  [[nodiscard]] std::int32_t num_nodes() const { return num_ranks() / per_node_; }
  //! G, ranks per node.
  [[nodiscard]] std::int32_t ranks_per_node() const { return per_node_; }
  [[nodiscard]] std::int32_t node_of(std::int32_t rank) const { return node_[static_cast<std::size_t>(rank)]; }
  [[nodiscard]] std::int32_t local_of(std::int32_t rank) const { return local_[static_cast<std::size_t>(rank)]; }
  //! The rank at (node, local index).
  [[nodiscard]] std::int32_t rank_at(std::int32_t node, std::int32_t local) const {
    return rank_at_[static_cast<std::size_t>(node * per_node_ + local)];
  }
  [[nodiscard]] bool same_node(std::int32_t a, std::int32_t b) const { return node_of(a) == node_of(b); }

 private:
  std::vector<std::int32_t> node_, local_, rank_at_;
  std::int32_t per_node_ = 1;
};

MOECOMM_NAMESPACE_END
