// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `exchange_groups`: a communicator with its intra-node and inter-node sub-groups, made once and
//! reused by every all-to-all.

#include <moecomm/config.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/error.hpp>

#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! The world communicator of an expert-parallel group, its topology, and two sub-groups: the ranks
//! of this rank's node (`intra`, ranked by local index) and the ranks with this rank's local index
//! on every node (`inter`, ranked by node). Creating it is collective (two splits).
template <class Comm>
class exchange_groups {
 public:
  //! @throws error (invalid_argument) when the topology does not describe `world`.
  exchange_groups(Comm& world, topology topo)
      : world_(&world),
        topo_(std::move(topo)),
        intra_(checked(world, topo_).split(topo_.node_of(world.rank()), topo_.local_of(world.rank()))),
        inter_(world.split(topo_.local_of(world.rank()), topo_.node_of(world.rank()))) {}

  [[nodiscard]] Comm& world() { return *world_; }
  [[nodiscard]] Comm& intra() { return intra_; }
  [[nodiscard]] Comm& inter() { return inter_; }
  [[nodiscard]] topology const& topo() const { return topo_; }

 private:
  static Comm& checked(Comm& world, topology const& topo) {
    detail::require(world.size() == topo.num_ranks(), "exchange_groups", "the communicator has ", world.size(),
                    " ranks but the topology describes ", topo.num_ranks());
    return world;
  }

  Comm* world_;
  topology topo_;
  Comm intra_;
  Comm inter_;
};

MOECOMM_NAMESPACE_END
