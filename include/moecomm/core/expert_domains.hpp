// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! HybridEP's expert domains over a topology's data centres: which ranks gather each other's
//! experts, and which ranks (the same offset in every expert domain) exchange tokens. Shared by the
//! layer (patterns/hybridep.hpp), its planner and the pattern adviser's model of it
//! (models/hybridep_layout_model.hpp), so that all three cut the ranks alike.

#include <moecomm/config.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! How HybridEP's expert domains lie over the data centres (patterns/hybridep.hpp).
enum class expert_domain_spread {
  //! Ranks taken local index first, data centre second (position `l·K + d`); an expert domain is
  //! `S` consecutive positions: the same local rank of `S` data centres, or `S / K` local ranks of
  //! every one. Experts cross the slow links; with `K | S` tokens stay in their data centre.
  across_data_centres,
  //! `S` consecutive ranks of one data centre (`S` divides `G`): experts stay on the fast links.
  within_data_centres,
};

namespace detail {

//! The expert domains of `size` ranks: each rank's position (expert domains are runs of `size`
//! positions), and the way back.
struct expert_domain_layout {
  std::int32_t size = 1, ranks = 1, domains = 1, per_domain = 1;
  expert_domain_spread spread = expert_domain_spread::across_data_centres;

  //! @throws error (invalid_argument), as `op`, naming `size_name` unless `size` divides the ranks
  //!   (`within_data_centres`: a domain's), or a rank whose domain's ranks are not consecutive.
  static expert_domain_layout of(topology const& topo, std::int32_t size, expert_domain_spread spread, char const* op,
                                 char const* size_name) {
    std::int32_t const per_domain = topo.ranks_per_domain(), ranks = topo.num_ranks();
    for (std::int32_t r = 0; r < ranks; ++r)
      require(topo.domain_of(r) == r / per_domain, op, "rank ", r, " is in domain ", topo.domain_of(r),
              ": HybridEP needs each domain's ranks consecutive (rank / ", per_domain, ")");
    bool const within = spread == expert_domain_spread::within_data_centres;
    std::int32_t const limit = within ? per_domain : ranks;
    require(size >= 1 && limit % size == 0, op, size_name, " = ", size, " must be positive and divide the ", limit,
            within ? " ranks of a domain" : " ranks");
    return {size, ranks, topo.num_domains(), per_domain, spread};
  }
  [[nodiscard]] std::int32_t position_of(std::int32_t rank) const {
    if (spread == expert_domain_spread::within_data_centres) return rank;
    return (rank % per_domain) * domains + rank / per_domain;
  }
  [[nodiscard]] std::int32_t rank_at(std::int32_t position) const {
    if (spread == expert_domain_spread::within_data_centres) return position;
    return (position % domains) * per_domain + position / domains;
  }
  //! World ranks of expert domain `j`, by offset; of the same-offset group of offset `o`, by expert domain.
  [[nodiscard]] std::vector<std::int32_t> members(std::int32_t j) const {
    std::vector<std::int32_t> m;
    for (std::int32_t o = 0; o < size; ++o) m.push_back(rank_at(j * size + o));
    return m;
  }
  [[nodiscard]] std::vector<std::int32_t> same_offset(std::int32_t o) const {
    std::vector<std::int32_t> m;
    for (std::int32_t j = 0; j < ranks / size; ++j) m.push_back(rank_at(j * size + o));
    return m;
  }
  //! The rank that computes `rank`'s rows of the experts `owner` holds: `rank`'s offset in `owner`'s expert domain.
  [[nodiscard]] std::int32_t computing_rank(std::int32_t rank, std::int32_t owner) const {
    return rank_at(position_of(owner) / size * size + position_of(rank) % size);
  }
};

}  // namespace detail

MOECOMM_NAMESPACE_END
