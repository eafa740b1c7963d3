// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `parallel_groups`: the model-parallel (MP), expert-parallel (EP), expert-slicing (ESP) and
//! data-parallel (DP) groups of a world, each a communicator made by `split` (Parm, DeepSpeed-MoE
//! with tensor parallelism, FSMoE).
//!
//! Layout (Megatron's order, MP innermost): world rank `r = (dp · EP + ep) · MP + mp`, so
//! - an MP group is `MP` consecutive ranks (the same `dp`, `ep`): they hold identical MoE inputs;
//! - an EP group is the ranks with the same `dp` and `mp` (stride `MP`): between them, the
//!   all-to-all (DeepSpeed PR #5626: 8 ranks, MP 2, EP 4 give EP {0,2,4,6} and {1,3,5,7});
//! - an ESP group is `ESP` consecutive ranks of an MP group (`mp / ESP` the same): they hold one
//!   slice each of the same experts (ESP = MP slices every expert over its MP group; ESP = 1 slices
//!   nothing);
//! - a DP group is the ranks with the same `ep` and `mp`: the replicas of the same dense shard;
//! - an expert-DP group is the ranks that hold the same expert slice (the same `ep` and `mp % ESP`):
//!   where expert gradients are summed.
//! `DP = world / (MP · EP)`. ESP must divide MP.

#include <moecomm/config.hpp>
#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The group sizes; DP follows from the world size.
struct parallel_sizes {
  std::int32_t model = 1;           //!< MP: ranks that hold identical inputs (tensor parallelism)
  std::int32_t expert = 1;          //!< EP: ranks the experts are spread over
  std::int32_t expert_slicing = 1;  //!< ESP: ranks that each hold a slice of the same experts (divides MP)
};

//! This rank's place in each group.
struct parallel_coordinates {
  std::int32_t mp = 0, ep = 0, esp = 0, dp = 0;
};

template <class Comm>
class parallel_groups {
 public:
  //! Splits `world` (collective over it). Every rank must pass the same sizes.
  //! @throws error (invalid_argument) naming the size that does not fit the world, before any split;
  //!         (invalid_usage) on every rank when ranks pass different sizes (on communicators that
  //!         compare calls, see `<moecomm/comm/world_agreement.hpp>`).
  //! @param nodes where the world's ranks sit (default: one node), for the traffic reports of the
  //!        layers that use the groups (intra- and inter-node messages).
  parallel_groups(Comm& world, parallel_sizes sizes) : parallel_groups(world, sizes, topology(world.size(), world.size())) {}
  parallel_groups(Comm& world, parallel_sizes sizes, topology nodes)
      : world_(&world), nodes_(checked_nodes(world, std::move(nodes))), sizes_(checked(world, sizes)), at_(coordinates_of(world.rank(), sizes_)),
        mp_(split_checked(world, sizes_, (at_.dp * sizes_.expert + at_.ep), at_.mp)),
        ep_(world.split(at_.dp * sizes_.model + at_.mp, at_.ep)),
        esp_(world.split((at_.dp * sizes_.expert + at_.ep) * (sizes_.model / sizes_.expert_slicing) +
                             at_.mp / sizes_.expert_slicing,
                         at_.esp)),
        dp_(world.split(at_.ep * sizes_.model + at_.mp, at_.dp)),
        expert_dp_(world.split(at_.ep * sizes_.expert_slicing + at_.esp,
                               at_.dp * (sizes_.model / sizes_.expert_slicing) + at_.mp / sizes_.expert_slicing)) {}

  [[nodiscard]] Comm& world() { return *world_; }
  [[nodiscard]] Comm& mp() { return mp_; }
  [[nodiscard]] Comm& ep() { return ep_; }
  [[nodiscard]] Comm& esp() { return esp_; }
  [[nodiscard]] Comm& dp() { return dp_; }
  [[nodiscard]] Comm& expert_dp() { return expert_dp_; }
  [[nodiscard]] parallel_sizes const& sizes() const { return sizes_; }
  [[nodiscard]] std::int32_t data_parallel_size() const { return world_->size() / (sizes_.model * sizes_.expert); }
  [[nodiscard]] parallel_coordinates const& coordinates() const { return at_; }
  [[nodiscard]] topology const& nodes() const { return nodes_; }

  //! The world rank at coordinates `c` (`c.esp` is implied by `c.mp`).
  [[nodiscard]] std::int32_t world_rank_of(parallel_coordinates const& c) const {
    return (c.dp * sizes_.expert + c.ep) * sizes_.model + c.mp;
  }
  //! The world rank of this rank's MP, EP and ESP group members of group rank `i`.
  [[nodiscard]] std::int32_t mp_member(std::int32_t i) const { return world_rank_of({i, at_.ep, 0, at_.dp}); }
  [[nodiscard]] std::int32_t ep_member(std::int32_t i) const { return world_rank_of({at_.mp, i, 0, at_.dp}); }
  [[nodiscard]] std::int32_t esp_member(std::int32_t i) const { return world_rank_of({at_.mp - at_.esp + i, at_.ep, 0, at_.dp}); }

  //! The coordinates of world rank `rank` under `sizes` (the layout of the file comment).
  [[nodiscard]] static parallel_coordinates coordinates_of(std::int32_t rank, parallel_sizes const& sizes) {
    parallel_coordinates c;
    c.mp = rank % sizes.model;
    c.ep = rank / sizes.model % sizes.expert;
    c.dp = rank / (sizes.model * sizes.expert);
    c.esp = c.mp % sizes.expert_slicing;
    return c;
  }

 private:
  static parallel_sizes checked(Comm& world, parallel_sizes const& s) {
    char const* const op = "parallel_groups";
    std::int32_t const ranks = world.size();
    detail::require(s.model >= 1, op, "sizes.model = ", s.model, " must be at least 1");
    detail::require(s.expert >= 1, op, "sizes.expert = ", s.expert, " must be at least 1");
    detail::require(s.expert_slicing >= 1, op, "sizes.expert_slicing = ", s.expert_slicing, " must be at least 1");
    detail::require(std::int64_t{s.model} * s.expert <= ranks && ranks % (s.model * s.expert) == 0, op, "sizes.model x sizes.expert = ",
                    s.model, " x ", s.expert, " does not divide the world of ", ranks, " ranks");
    detail::require(s.model % s.expert_slicing == 0, op, "sizes.expert_slicing = ", s.expert_slicing,
                    " does not divide sizes.model = ", s.model, " (an ESP group lies inside an MP group)");
    return s;
  }

  static topology checked_nodes(Comm& world, topology nodes) {
    detail::require(nodes.num_ranks() == world.size(), "parallel_groups", "argument 'nodes' describes ", nodes.num_ranks(),
                    " ranks, the world has ", world.size());
    return nodes;
  }

  //! The MP split, after every rank has confirmed the same sizes.
  Comm split_checked(Comm& world, parallel_sizes const& s, std::int32_t color, std::int32_t key) {
    char const* const names[] = {"sizes.model", "sizes.expert", "sizes.expert_slicing"};
    std::int64_t const values[] = {s.model, s.expert, s.expert_slicing};
    detail::agree_across_world(world, "parallel_groups", names, values, agreement_);
    return world.split(color, key);
  }

  std::vector<std::int64_t> agreement_;  //!< declared first: the constructor's agreement uses it
  Comm* world_;
  topology nodes_;
  parallel_sizes sizes_;
  parallel_coordinates at_;
  Comm mp_, ep_, esp_, dp_, expert_dp_;
};

MOECOMM_NAMESPACE_END
