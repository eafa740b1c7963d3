// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_set` (an expert's owner and the ranks that hold a copy of it) and the two transport
//! paths of `replica_broadcast` and `gradient_reduce`.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! The ranks (of one communicator) that hold an expert: its `owner`, whose copy is authoritative,
//! and its `replicas`, in ascending order, owner excluded. May change every iteration.
struct replica_set {
  std::int32_t owner = 0;
  std::vector<std::int32_t> replicas;

  //! Every rank of a group of `ranks` holds a copy (FasterMoE's shadowed experts).
  [[nodiscard]] static replica_set everyone(std::int32_t owner, std::int32_t ranks) {
    replica_set set;
    set.assign_everyone(owner, ranks);
    return set;
  }

  //! This set becomes `everyone(owner, ranks)`, keeping the replicas' capacity (no allocation once
  //! it has held as many).
  void assign_everyone(std::int32_t new_owner, std::int32_t ranks) {
    owner = new_owner;
    replicas.clear();
    for (std::int32_t r = 0; r < ranks; ++r)
      if (r != owner) replicas.push_back(r);
  }

  //! The owner and the replicas, ascending: the fixed order in which gradients are summed.
  [[nodiscard]] std::vector<std::int32_t> members() const {
    std::vector<std::int32_t> all;
    all.reserve(replicas.size() + 1);
    bool placed = false;
    for (std::int32_t r : replicas) {
      if (!placed && owner < r) all.push_back(owner), placed = true;
      all.push_back(r);
    }
    if (!placed) all.push_back(owner);
    return all;
  }

  [[nodiscard]] bool holds(std::int32_t rank) const {
    if (rank == owner) return true;
    for (std::int32_t r : replicas)
      if (r == rank) return true;
    return false;
  }
};

//! Path policy: one collective per chunk on a communicator whose ranks are exactly the replica set
//! (the whole group, or a sub-group made with `split`). Suits a set that stays fixed.
struct collective_path {
  static constexpr char const* name = "collective";
  std::int64_t chunk_bytes = std::int64_t{16} << 20;  //!< largest piece one call moves
};

//! Path policy: grouped point-to-point messages between the owner and each replica, on the whole
//! group, which every rank enters (ranks outside the set post nothing). Suits sets that change
//! every iteration, since no sub-group has to be made.
struct point_to_point_path {
  static constexpr char const* name = "point_to_point";
  std::int64_t chunk_bytes = std::int64_t{16} << 20;  //!< largest piece one exchange moves per peer
};

namespace detail {

//! Checks `set` against a group of `ranks`: owner and replicas are ranks, replicas ascend and
//! exclude the owner; and the path's chunk size is positive.
template <class Path>
void validate_replica_set(char const* op, Path const& path, replica_set const& set, std::int32_t ranks) {
  require(path.chunk_bytes > 0, op, Path::name, "_path.chunk_bytes = ", path.chunk_bytes, " must be positive");
  require(set.owner >= 0 && set.owner < ranks, op, "owner = ", set.owner, " is not a rank of this group of ", ranks);
  for (std::size_t i = 0; i < set.replicas.size(); ++i) {
    std::int32_t const r = set.replicas[i];
    require(r >= 0 && r < ranks, op, "replicas[", i, "] = ", r, " is not a rank of this group of ", ranks);
    require(r != set.owner, op, "replicas[", i, "] = ", r, " is the owner; list only the other ranks");
    require(i == 0 || set.replicas[i - 1] < r, op, "replicas[", i, "] = ", r, " does not follow replicas[", i - 1,
            "] = ", set.replicas[i - 1], "; list replicas in ascending order, each once");
  }
}

//! The collective path needs the set to be the whole communicator.
inline void require_whole_group(char const* op, replica_set const& set, std::int32_t ranks) {
  for (std::int32_t r = 0; r < ranks; ++r)
    require(set.holds(r), op, "collective_path needs every rank of the communicator in the set, but rank ", r,
            " is not; split a sub-group of the set or use point_to_point_path");
}

}  // namespace detail

MOECOMM_NAMESPACE_END
