// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The flags of the examples whose ranks are threads of this process (or processes) arranged as
//! nodes: --ranks R and --nodes N, N dividing R, so that the hierarchical all-to-alls have nodes to
//! work with.

#include "flags.hpp"

#include <cstdint>
#include <string>
#include <utility>

namespace example_support {

//! --ranks R (`ranks_help`: what a rank is) and --nodes N, each in [1, 64].
inline flag_set& add_rank_flags(flag_set& flags, std::int32_t& ranks, std::int32_t& nodes, std::string ranks_help) {
  return flags.add("--ranks", "R", std::move(ranks_help), ranks, 1, 64)
      .add("--nodes", "N", "nodes; must divide R, each holds R / N ranks", nodes, 1, 64);
}

//! Usage errors unless N divides R, E is a multiple of R and K <= E: every node holds as many
//! ranks, every rank as many experts, and every token picks K distinct experts.
inline void check_ranks_and_experts(char const* program, std::int32_t ranks, std::int32_t nodes, std::int32_t experts,
                                    std::int32_t topk) {
  auto const str = [](auto v) { return std::to_string(v); };
  if (ranks % nodes != 0)
    usage_error(program, "--nodes " + str(nodes) + " does not divide --ranks " + str(ranks) + ": every node holds the same number of ranks");
  if (experts % ranks != 0)
    usage_error(program, "--experts " + str(experts) + " is not a multiple of --ranks " + str(ranks) + ": each rank holds E / R experts");
  if (topk > experts)
    usage_error(program, "--topk " + str(topk) + " exceeds --experts " + str(experts) + ": every token picks K distinct experts");
}

}  // namespace example_support
