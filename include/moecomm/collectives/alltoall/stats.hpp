// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `alltoall_stats`: what one rank sent in an all-to-all, split by link class.

#include <moecomm/config.hpp>
#include <moecomm/core/topology.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! Messages and bytes one rank sent to other ranks (its self-copy excluded), split into the link
//! classes of `topology`: inside a node, between nodes of a domain, between domains; `rounds` counts dependent exchange rounds. Zero-byte blocks
//! are not sent and not counted. Statistics accumulate over calls.
struct alltoall_stats {
  std::int64_t intra_messages = 0;
  std::int64_t intra_bytes = 0;
  std::int64_t inter_messages = 0;
  std::int64_t inter_bytes = 0;
  std::int64_t inter_domain_messages = 0;
  std::int64_t inter_domain_bytes = 0;
  std::int64_t rounds = 0;

  //! Records a message of `bytes` from world rank `from` to world rank `to`.
  void record(topology const& topo, std::int32_t from, std::int32_t to, std::int64_t bytes) {
    if (from == to || bytes == 0) return;
    bool const intra = topo.same_node(from, to), inter = !intra && topo.same_domain(from, to);
    (intra ? intra_messages : inter ? inter_messages : inter_domain_messages) += 1;
    (intra ? intra_bytes : inter ? inter_bytes : inter_domain_bytes) += bytes;
  }
  [[nodiscard]] std::int64_t messages() const { return intra_messages + inter_messages + inter_domain_messages; }
  [[nodiscard]] std::int64_t bytes() const { return intra_bytes + inter_bytes + inter_domain_bytes; }
};

MOECOMM_NAMESPACE_END
