// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `topology`: how the ranks of an expert-parallel group sit on nodes, and the nodes in domains
//! (data centres joined by slower links than a domain's own network: HybridEP's setting). Three
//! link classes follow: inside a node, between nodes of a domain, between domains.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! World = domains x nodes x local ranks. Rank `r` is on node `node_of(r)` with local index
//! `local_of(r)`; node `n` is in domain `domain_of_node(n)`. By default ranks are contiguous per
//! node (`r / G`, `r % G`) and nodes per domain; any mapping with equal node sizes and equal domain
//! sizes can be given instead.
class topology {
 public:
  //! Contiguous: `num_ranks / ranks_per_node` nodes of `ranks_per_node` consecutive ranks, and
  //! domains of `nodes_per_domain` consecutive nodes (default: one domain).
  //! @throws error (invalid_argument) unless `ranks_per_node` divides `num_ranks` and
  //!         `nodes_per_domain` the nodes.
  topology(std::int32_t num_ranks, std::int32_t ranks_per_node, std::int32_t nodes_per_domain = 0) {
    detail::require(num_ranks > 0, "topology", "num_ranks = ", num_ranks, " must be positive");
    detail::require(ranks_per_node > 0 && num_ranks % ranks_per_node == 0, "topology", "ranks_per_node = ",
                    ranks_per_node, " must be positive and divide num_ranks = ", num_ranks);
    std::int32_t const nodes = num_ranks / ranks_per_node;
    if (nodes_per_domain == 0) nodes_per_domain = nodes;
    detail::require(nodes_per_domain > 0 && nodes % nodes_per_domain == 0, "topology", "nodes_per_domain = ",
                    nodes_per_domain, " must be positive and divide the ", nodes, " nodes");
    std::vector<std::int32_t> node(static_cast<std::size_t>(num_ranks)), domain(static_cast<std::size_t>(nodes));
    for (std::int32_t r = 0; r < num_ranks; ++r) node[static_cast<std::size_t>(r)] = r / ranks_per_node;
    for (std::int32_t n = 0; n < nodes; ++n) domain[static_cast<std::size_t>(n)] = n / nodes_per_domain;
    *this = topology(std::move(node), std::move(domain));
  }

  //! Any mapping: `node_of_rank[r]` is rank r's node, nodes numbered `0..N-1`, each with the same
  //! number of ranks; local indices follow rank order within a node. `domain_of_node[n]` is node
  //! n's domain, domains numbered `0..D-1`, each with the same number of nodes (empty: one domain).
  //! @throws error (invalid_argument) naming the node or domain whose size differs, or a bad id.
  explicit topology(std::vector<std::int32_t> node_of_rank, std::vector<std::int32_t> domain_of_node = {})
      : node_(std::move(node_of_rank)), domain_(std::move(domain_of_node)) {
    std::int32_t const ranks = static_cast<std::int32_t>(node_.size());
    detail::require(ranks > 0, "topology", "node_of_rank is empty");
    std::vector<std::int32_t> const size = equal_groups(node_, "node_of_rank", "node", "ranks");
    std::int32_t const nodes = static_cast<std::int32_t>(size.size());
    per_node_ = size[0];
    std::vector<std::int32_t> seen(size.size(), 0);
    local_.resize(node_.size());
    for (std::int32_t r = 0; r < ranks; ++r) local_[static_cast<std::size_t>(r)] = seen[static_cast<std::size_t>(node_[static_cast<std::size_t>(r)])]++;
    rank_at_.assign(static_cast<std::size_t>(ranks), 0);
    for (std::int32_t r = 0; r < ranks; ++r) rank_at_[static_cast<std::size_t>(node_of(r) * per_node_ + local_of(r))] = r;
    if (domain_.empty()) domain_.assign(static_cast<std::size_t>(nodes), 0);
    detail::require(static_cast<std::int32_t>(domain_.size()) == nodes, "topology", "domain_of_node has ", domain_.size(),
                    " entries, the nodes ", nodes);
    nodes_per_domain_ = equal_groups(domain_, "domain_of_node", "domain", "nodes")[0];
  }

  //! The topology of the members of a group, in group rank order: `members[i]` is the rank (of
  //! this topology) that is group rank i. Nodes and domains keep their sharing, renumbered in order
  //! of first appearance. @throws error (invalid_argument) as the mapping constructor does, e.g.
  //! when the members are spread unevenly over nodes.
  [[nodiscard]] topology of_members(std::vector<std::int32_t> const& members) const {
    std::vector<std::int32_t> node_id(static_cast<std::size_t>(num_nodes()), -1), domain_id(static_cast<std::size_t>(num_domains()), -1);
    std::vector<std::int32_t> node, domain;
    for (std::int32_t r : members) {
      detail::require(r >= 0 && r < num_ranks(), "topology::of_members", "member ", r, " is not a rank of ", num_ranks());
      std::int32_t& n = node_id[static_cast<std::size_t>(node_of(r))];
      if (n < 0) {
        n = static_cast<std::int32_t>(domain.size());
        std::int32_t& d = domain_id[static_cast<std::size_t>(domain_of(r))];
        if (d < 0) d = *std::max_element(domain_id.begin(), domain_id.end()) + 1;
        domain.push_back(d);
      }
      node.push_back(n);
    }
    return topology(std::move(node), std::move(domain));
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
  //! D, domains.
  [[nodiscard]] std::int32_t num_domains() const { return num_nodes() / nodes_per_domain_; }
  [[nodiscard]] std::int32_t nodes_per_domain() const { return nodes_per_domain_; }
  [[nodiscard]] std::int32_t ranks_per_domain() const { return nodes_per_domain_ * per_node_; }
  [[nodiscard]] std::int32_t domain_of_node(std::int32_t node) const { return domain_[static_cast<std::size_t>(node)]; }
  [[nodiscard]] std::int32_t domain_of(std::int32_t rank) const { return domain_of_node(node_of(rank)); }
  [[nodiscard]] bool same_domain(std::int32_t a, std::int32_t b) const { return domain_of(a) == domain_of(b); }

 private:
  //! The size of each group `0..G-1` that `group_of[i]` names, checked: ids in `[0, size)`, every
  //! group as large as group 0. Errors name `name[i]`, or the `kind` whose count of `members` differs.
  static std::vector<std::int32_t> equal_groups(std::vector<std::int32_t> const& group_of, char const* name, char const* kind,
                                                char const* members) {
    std::int32_t const n = static_cast<std::int32_t>(group_of.size());
    std::int32_t groups = 0;
    for (std::int32_t i = 0; i < n; ++i) {
      std::int32_t const g = group_of[static_cast<std::size_t>(i)];
      detail::require(g >= 0 && g < n, "topology", name, "[", i, "] = ", g, " is not in [0, ", n, ")");
      groups = g + 1 > groups ? g + 1 : groups;
    }
    std::vector<std::int32_t> size(static_cast<std::size_t>(groups), 0);
    for (std::int32_t g : group_of) ++size[static_cast<std::size_t>(g)];
    for (std::int32_t g = 0; g < groups; ++g)
      detail::require(size[static_cast<std::size_t>(g)] == size[0], "topology", kind, " ", g, " has ", size[static_cast<std::size_t>(g)],
                      " ", members, " but ", kind, " 0 has ", size[0], " (every ", kind, " must hold the same number)");
    return size;
  }

  std::vector<std::int32_t> node_, local_, rank_at_, domain_;
  std::int32_t per_node_ = 1, nodes_per_domain_ = 1;
};

MOECOMM_NAMESPACE_END
