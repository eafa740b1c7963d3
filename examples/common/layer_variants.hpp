// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Variants of one MoE layer run side by side on a simulated cluster (example 04): what each run
//! leaves, and the tables that compare them with the first, plain one: simulated times beside
//! FasterMoE's model, all-to-all traffic per link class, and whether the outputs are the same bits.

#include "format.hpp"
#include "inputs.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

//! One variant's run: a fresh layer on a fresh world, a warm-up step and a measured one.
struct variant_result {
  variant_result(std::string n, std::size_t ranks, bool dedup) : name(std::move(n)), out(ranks), d_x(ranks), per_rank_sums(dedup) {}
  std::string name;
  double forward_s = 0, backward_s = 0;  //!< the measured step's, slowest rank
  moecomm::alltoall_stats exchange;      //!< the measured step's all-to-alls, summed over ranks (real bytes)
  std::optional<moecomm::shadow_decision> decision;  //!< the measured step's, shadowing variants only
  std::vector<std::vector<float>> out, d_x;         //!< [rank]
  bool per_rank_sums = false;  //!< dedup: the combine adds per rank (and node) first (semantics §10a)
};

//! "experts 3,7": the set FasterMoE shadowed, or "none".
inline std::string shadow_set(moecomm::shadow_decision const& d) {
  if (d.shadowed.empty()) return "none";
  std::string ids;
  for (std::int32_t e : d.shadowed) ids += (ids.empty() ? "" : ",") + std::to_string(e);
  return (d.shadowed.size() == 1 ? "expert " : "experts ") + ids;
}

//! Section 2: each variant's simulated forward, backward and speed-up over the first, and, beside the
//! shadowing ones, FasterMoE's predicted time and the experts it shadowed.
inline void print_variant_times(std::vector<variant_result> const& variants) {
  variant_result const& plain = variants.front();
  double const base = plain.forward_s + plain.backward_s;
  std::printf("2. Simulated time of the measured step (slowest rank)\n");
  std::printf("   %-28s %11s %11s %11s %9s %13s   %s\n", "variant", "forward", "backward", "total", "speed-up",
              "model", "shadowed");
  for (auto const& v : variants) {
    double const total = v.forward_s + v.backward_s;
    std::printf("   %-28s %11s %11s %11s %8.2fx %13s   %s\n", v.name.c_str(), format_time(v.forward_s).c_str(),
                format_time(v.backward_s).c_str(), format_time(total).c_str(), base / total,
                v.decision ? format_time(v.decision->latency).c_str() : "",
                v.decision ? shadow_set(*v.decision).c_str() : "");
  }
  auto const shadowed = std::find_if(variants.begin(), variants.end(), [](auto const& v) { return v.decision.has_value(); });
  if (shadowed != variants.end())
    std::printf(
        "   model: FasterMoE's predicted forward + backward with the chosen set (eq. 8); for no shadowing it\n"
        "   predicts %s (eq. 7). It knows compute and token bytes only: no latencies, memory kernels or\n"
        "   overlap (the smart schedule's gain is outside it).\n\n",
        format_time(shadowed->decision->latency_unshadowed).c_str());
}

//! Section 3: each variant's all-to-all messages and bytes inside and between nodes (model-sized bytes).
inline void print_variant_traffic(std::vector<variant_result> const& variants, double payload_scale) {
  std::printf("3. All-to-all traffic of the measured step, forward + backward, all ranks (report().exchange;\n"
              "   simulated bytes = real bytes x %g; shadowing's parameter broadcasts and reduces are not in it)\n",
              payload_scale);
  std::printf("   %-28s %12s %12s %12s %12s\n", "variant", "intra msgs", "intra bytes", "inter msgs", "inter bytes");
  for (auto const& v : variants)
    std::printf("   %-28s %12" PRId64 " %12s %12" PRId64 " %12s\n", v.name.c_str(), v.exchange.intra_messages,
                format_bytes(static_cast<double>(v.exchange.intra_bytes) * payload_scale).c_str(),
                v.exchange.inter_messages,
                format_bytes(static_cast<double>(v.exchange.inter_bytes) * payload_scale).c_str());
  std::printf("\n");
}

//! Every variant's outputs and input gradients against plain flat's, every rank: bit for bit, or
//! for the deduplicated exchange (whose combine adds per rank first) within fp32 rounding.
inline bool identical_to_plain(std::vector<variant_result> const& variants) {
  variant_result const& plain = variants.front();
  bool same = true;
  double regrouped = 0;
  for (auto const& v : variants)
    for (std::size_t r = 0; r < plain.out.size(); ++r) {
      if (v.per_rank_sums) {
        regrouped = std::max({regrouped, normwise_difference(v.out[r], plain.out[r]), normwise_difference(v.d_x[r], plain.d_x[r])});
        continue;
      }
      bool const here = same_bits(v.out[r], plain.out[r]) && same_bits(v.d_x[r], plain.d_x[r]);
      if (!here) std::printf("   %s differs from plain EP, flat on rank %zu\n", v.name.c_str(), r);
      same = same && here;
    }
  std::printf("   dedup variants: per-rank (per-node) partial sums regroup the combine's fp32 additions (semantics §10a);\n"
              "   largest difference from plain EP, flat, relative to the largest value: %.2e%s\n",
              regrouped, regrouped <= 1e-6 ? "" : " (more than 1e-6: WRONG)");
  return same && regrouped <= 1e-6;
}

}  // namespace example_support
