// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! A dispatch layout for people (example 01): tokens and their share per expert, as bars, and the
//! tokens and slots each rank receives, with the load imbalance they make.

#include "format.hpp"

#include <moecomm/moecomm.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

namespace example_support {

//! `slots`: every token's K slots, T * K. Shows the first 24 experts when there are more than 32.
template <class Layout, class Placement>
void print_dispatch_layout(Layout const& layout, Placement const& placement, std::int64_t slots) {
  std::int32_t const E = placement.num_experts(), R = placement.num_ranks(), L = placement.num_local_experts();
  std::int32_t max_count = 0;
  for (std::int32_t e = 0; e < E; ++e) max_count = std::max(max_count, layout.tokens_per_expert()[e]);
  std::int32_t const shown_experts = E <= 32 ? E : 24;
  std::printf("   expert  rank   tokens   share\n");
  for (std::int32_t e = 0; e < shown_experts; ++e) {
    std::int32_t const n = layout.tokens_per_expert()[e];
    std::printf("   %6d  %4d  %7d  %5.1f%%%s%s\n", e, placement.rank_of(e), n,
                slots > 0 ? 100.0 * n / static_cast<double>(slots) : 0.0, n > 0 ? "  " : "",
                bar(n, max_count, 40).c_str());
  }
  if (shown_experts < E) std::printf("   ... %d more experts\n", E - shown_experts);
  std::printf("\n   rank  experts      tokens    slots\n");
  std::int64_t max_slots = 0;
  for (std::int32_t r = 0; r < R; ++r) {
    std::string const held = experts_held(r, L);
    std::printf("   %4d  %-9s  %7d  %7d\n", r, held.c_str(), layout.tokens_per_rank()[r], layout.slots_per_rank()[r]);
    max_slots = std::max<std::int64_t>(max_slots, layout.slots_per_rank()[r]);
  }
  std::printf("   (a token counts once per rank it reaches, a slot once per expert)\n");
  if (slots > 0)
    std::printf("   load imbalance: busiest rank gets %.2fx the mean number of slots\n",
                static_cast<double>(max_slots) * R / static_cast<double>(slots));
  std::printf("\n");
}

}  // namespace example_support
