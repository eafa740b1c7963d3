// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 02's tables: the load per rank, the drops per capacity policy, the messages and bytes per
//! link class, and the oracle's verdicts, from the runs of every (algorithm, policy) configuration.

#include "expert_parallel_oracle.hpp"
#include "format.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace example_support {

inline std::string percent(int64_t part, int64_t whole) { return whole > 0 ? format("%.1f%%", 100.0 * part / whole) : "-"; }

//! The run of configuration (a, pol); the first run when there is none.
inline run_result const& result_of(std::vector<run_result> const& results, algo_id a, policy_id pol) {
  for (auto const& r : results)
    if (r.algo == a && r.policy == pol) return r;
  return results.front();
}

//! The busiest rank's message bytes (intra + inter) in a run's step.
inline int64_t busiest_bytes(run_result const& res) {
  int64_t most = 0;
  for (auto const& rr : res.ranks) most = std::max(most, rr.report.exchange.bytes());
  return most;
}

//! 2. Slots routed to each rank's experts, beside the rows it received under each policy.
template <class T>
void print_load_per_rank(problem<T> const& p, std::vector<run_result> const& results) {
  options const& o = p.o;
  int32_t const R = o.ranks, G = p.per_node, L = p.local_experts, K = o.topk;
  algo_id const first_algo = o.algorithms.front();
  auto const result_of = [&](algo_id a, policy_id pol) -> run_result const& { return example_support::result_of(results, a, pol); };
  std::vector<int64_t> routed(static_cast<std::size_t>(R), 0);  // slots bound to each rank's experts
  for (auto const& g : p.gate)
    for (int32_t e : g.idx) ++routed[static_cast<std::size_t>(e / L)];
  int64_t const slots = p.total_tokens * K;
  int64_t const max_routed = *std::max_element(routed.begin(), routed.end());
  std::printf("2. Load per rank (slots = (token, expert) pairs; a token sent to two experts of a rank counts twice)\n");
  bool const any_drops = o.capacity_factor > 0;
  int const received_width = 12 * static_cast<int>(o.policies.size());
  std::printf("   %-4s %-4s %-7s %6s  %-26s | %-*s", "rank", "node", "experts", "tokens", "routed to its experts",
              received_width - 1, "rows received (after capacity)");
  if (any_drops) std::printf(" | own slots dropped");
  std::printf("\n   %-4s %-4s %-7s %6s  %-26s |", "", "", "", "", "(slots, before capacity)");
  for (policy_id pol : o.policies) std::printf(" %11s", name_of(pol));
  if (any_drops) {
    std::printf(" |");
    for (policy_id pol : o.policies)
      if (pol != policy_id::dropless) std::printf(" %11s", name_of(pol));
  }
  std::printf("\n");
  for (int32_t r = 0; r < R; ++r) {
    auto const ri = static_cast<std::size_t>(r);
    std::string const held = experts_held(r, L);
    std::printf("   %4d %4d %-7s %6" PRId64 "  %7" PRId64 " %-18s |", r, r / G, held.c_str(), p.tokens[ri], routed[ri],
                bar(static_cast<double>(routed[ri]), static_cast<double>(max_routed), 18).c_str());
    for (policy_id pol : o.policies)
      std::printf(" %11" PRId64, result_of(first_algo, pol).ranks[ri].report.received_rows);
    if (any_drops) {
      std::printf(" |");
      for (policy_id pol : o.policies)
        if (pol != policy_id::dropless)
          std::printf(" %11" PRId64, result_of(first_algo, pol).ranks[ri].report.dropped_slots);
    }
    std::printf("\n");
  }
  std::printf(
      "   busiest rank: %.2fx the mean load before capacity (rows received come from "
      "layer.dispatch_state().report())\n\n",
      slots > 0 ? static_cast<double>(max_routed) * R / static_cast<double>(slots) : 0.0);
}

//! 3. Slots and tokens each policy dropped; returns whether every rank agreed on this program's C.
template <class T>
bool print_drops(problem<T> const& p, std::vector<run_result> const& results) {
  options const& o = p.o;
  int64_t const slots = p.total_tokens * o.topk;
  bool const any_drops = o.capacity_factor > 0;
  algo_id const first_algo = o.algorithms.front();
  auto const result_of = [&](algo_id a, policy_id pol) -> run_result const& { return example_support::result_of(results, a, pol); };
  int64_t const agreed_c = result_of(first_algo, o.policies.back()).ranks[0].report.capacity;
  std::printf("3. Drops per capacity policy, all ranks (%" PRId64 " slots of %" PRId64 " tokens)\n", slots,
              p.total_tokens);
  if (any_drops)
    std::printf("   C = max over ranks of ceil(T_r*K/E * %.2f) = %" PRId64
                " rows per (source rank, expert), agreed by an allreduce%s\n",
                o.capacity_factor, agreed_c, agreed_c == p.capacity ? "" : " (DIFFERS from this program's own C!)");
  std::printf("   %-12s %6s %18s %24s %24s\n", "policy", "C", "slots dropped", "tokens losing a slot",
              "tokens losing all slots");
  bool capacity_ok = true;
  for (policy_id pol : o.policies) {
    int64_t dropped = 0, partly = 0, fully = 0;
    auto const& res = result_of(first_algo, pol);
    for (auto const& rr : res.ranks) {
      dropped += rr.report.dropped_slots;
      partly += rr.tokens_partly_dropped;
      fully += rr.tokens_fully_dropped;
      capacity_ok = capacity_ok && rr.report.capacity == (pol == policy_id::dropless ? 0 : p.capacity);
    }
    std::string const c = pol == policy_id::dropless ? "-" : std::to_string(res.ranks[0].report.capacity);
    std::printf("   %-12s %6s %10" PRId64 " %7s %16" PRId64 " %7s %16" PRId64 " %7s\n", name_of(pol), c.c_str(),
                dropped, ("(" + percent(dropped, slots) + ")").c_str(), partly,
                ("(" + percent(partly, p.total_tokens) + ")").c_str(), fully,
                ("(" + percent(fully, p.total_tokens) + ")").c_str());
  }
  if (o.policies.size() > 2)
    std::printf(
        "   (every rule keeps min(slots, C) of each (source rank, expert): the rules drop as many slots, but\n"
        "    different ones - position the latest, probability the lightest, random by a Philox draw)\n");
  std::printf("   (a token that loses all its slots gets a zero output row and a zero gradient)\n\n");
  return capacity_ok;
}

//! 4. Messages and bytes per link class of rank 0 and the busiest rank, per algorithm.
template <class T>
void print_messages(problem<T> const& p, std::vector<run_result> const& results) {
  options const& o = p.o;
  int32_t const R = o.ranks, N = o.nodes, G = p.per_node;
  auto const result_of = [&](algo_id a, policy_id pol) -> run_result const& { return example_support::result_of(results, a, pol); };
  policy_id const shown = o.policies.size() > 1 ? o.policies[1] : o.policies.front();  // a drop rule when there is one
  std::printf("4. Messages and bytes sent per rank in one step, by link class (policy %s)\n", name_of(shown));
  std::printf(
      "   report().exchange accumulates every all-to-all since route(): dispatch + combine (forward) and\n"
      "   their backward (combine_backward + dispatch_backward) = 4 all-to-alls per step. Self-copies are\n"
      "   not messages. 'max' is the maximum over ranks of each column on its own.\n");
  std::printf("   %-16s %-5s %11s %12s %11s %12s %8s\n", "algorithm", "rank", "intra msgs", "intra bytes", "inter msgs",
              "inter bytes", "rounds");
  for (algo_id a : o.algorithms) {
    auto const& res = result_of(a, shown);
    moecomm::alltoall_stats top;
    for (auto const& rr : res.ranks) {
      auto const& s = rr.report.exchange;
      top.intra_messages = std::max(top.intra_messages, s.intra_messages);
      top.intra_bytes = std::max(top.intra_bytes, s.intra_bytes);
      top.inter_messages = std::max(top.inter_messages, s.inter_messages);
      top.inter_bytes = std::max(top.inter_bytes, s.inter_bytes);
      top.rounds = std::max(top.rounds, s.rounds);
    }
    auto const line = [&](char const* algo, char const* who, moecomm::alltoall_stats const& s) {
      std::printf("   %-16s %-5s %11" PRId64 " %12s %11" PRId64 " %12s %8" PRId64 "\n", algo, who, s.intra_messages,
                  format_bytes(static_cast<double>(s.intra_bytes)).c_str(), s.inter_messages,
                  format_bytes(static_cast<double>(s.inter_bytes)).c_str(), s.rounds);
    };
    line(name_of(a), "0", res.ranks[0].report.exchange);
    line("", "max", top);
  }
  if (N == 1 || G == 1)
    std::printf("   (hierarchical_2d falls back to flat with %s)\n", N == 1 ? "one node" : "one rank per node");
  std::printf(
      "   rounds: dependent exchange rounds in the 4 all-to-alls: flat 1 each, hierarchical_2d 2 (intra, then\n"
      "   inter), pairwise{1} R = %d (one per peer distance, 0..R-1)\n",
      R);
  if (o.policies.size() > 1) {
    std::printf("   busiest rank's bytes (intra + inter) per step, by policy:\n   %-16s", "");
    for (policy_id pol : o.policies) std::printf(" %12s", name_of(pol));
    std::printf("\n");
    for (algo_id a : o.algorithms) {
      std::printf("   %-16s", name_of(a));
      for (policy_id pol : o.policies) {
          std::printf(" %12s", format_bytes(static_cast<double>(busiest_bytes(result_of(a, pol)))).c_str());
      }
      std::printf("\n");
    }
  }
  std::printf("\n");
}

//! 6. Every run's check against the oracle; returns whether all of them passed.
template <class T>
bool print_oracle_checks(problem<T> const& p, std::vector<run_result> const& results, bool capacity_ok) {
  std::printf("6. Check against a single-process oracle (plain loops in this file; the first step of each run)\n");
  std::printf(
      "   kept slots: the layer's plan (plan().row_of() >= 0) vs the oracle's own capacity rule (semantics §8)\n");
  std::printf(
      "   output and d_x bit for bit; d_weights within 1e-5*|value| + 1e-6*H (an fp32 dot product over H\n"
      "   whose order differs from the oracle's double sum)\n");
  std::printf("   %-16s %-12s %-11s %-10s %-10s %s\n", "algorithm", "policy", "kept slots", "output", "d_x",
              "d_weights");
  bool all_ok = capacity_ok;
  int64_t bad_out = 0, bad_dx = 0, bad_dw = 0, bad_kept = 0;
  double worst_dw = 0;
  std::string first_problem;
  bool replay_ok = true;
  for (auto const& res : results) {
    int64_t kept = 0, out = 0, dx = 0, dw = 0;
    double worst = 0;
    for (auto const& rr : res.ranks) {
      kept += rr.kept_disagree;
      out += rr.bad_out_tokens;
      dx += rr.bad_dx_tokens;
      dw += rr.bad_dw_slots;
      worst = std::max(worst, rr.dw_worst);
      replay_ok = replay_ok && rr.replay_same_stats;
      if (first_problem.empty() && !rr.first_problem.empty())
        first_problem = std::string(name_of(res.algo)) + " / " + name_of(res.policy) + ", " + rr.first_problem;
    }
    bad_kept += kept, bad_out += out, bad_dx += dx, bad_dw += dw;
    worst_dw = std::max(worst_dw, worst);
    auto const verdict = [](int64_t bad, char const* good) {
      return bad == 0 ? std::string(good) : std::to_string(bad) + " bad";
    };
    std::printf("   %-16s %-12s %-11s %-10s %-10s %s\n", name_of(res.algo), name_of(res.policy),
                verdict(kept, "same").c_str(), verdict(out, "bit-exact").c_str(), verdict(dx, "bit-exact").c_str(),
                dw == 0 ? format("ok (worst error %.2g of the tolerance)", worst).c_str()
                        : (std::to_string(dw) + " bad").c_str());
  }
  all_ok = all_ok && bad_kept == 0 && bad_out == 0 && bad_dx == 0 && bad_dw == 0;
  std::printf("\n   output matches oracle: %s (%" PRId64 " tokens, bit-exact, in each of %zu runs)\n",
              bad_out == 0 && bad_kept == 0 ? "yes" : "NO", p.total_tokens, results.size());
  std::printf("   gradients match oracle: %s (d_x bit-exact; d_weights within tolerance, worst error %.2g of it)\n",
              bad_dx == 0 && bad_dw == 0 && bad_kept == 0 ? "yes" : "NO", worst_dw);
  if (!capacity_ok) std::printf("   the agreed capacity C differs from this program's C = %" PRId64 "\n", p.capacity);
  if (!replay_ok) std::printf("   note: the all-to-all replay of section 5 sent other bytes than the step did\n");
  if (!first_problem.empty()) std::printf("   first problem: %s\n", first_problem.c_str());
  return all_ok;
}

}  // namespace example_support
