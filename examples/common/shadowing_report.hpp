// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 03's comparison of the shadowed layer with plain expert parallelism, one step at a
//! time: what each rank found, and the tables of the shadow set, the rows per rank, the bytes moved
//! and saved, the model's times beside the measured ones, and the checks.

#include "format.hpp"
#include "inputs.hpp"
#include "mlp_experts.hpp"
#include "shadowing_problem.hpp"
#include "timing.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

using std::int32_t;
using std::int64_t;

//! How far the shadowed layer's gradient of one owned expert is from plain EP's.
struct gradient_gap {
  bool same = true;    //!< bit for bit
  double max_abs = 0;  //!< max |shadowed - plain|
  double largest = 0;  //!< max |plain|, the scale of the gradient
};

//! What one rank found in one step.
struct rank_record {
  int64_t plain_rows = 0, shadowed_rows = 0, home_rows = 0;
  int64_t plain_bytes = 0, shadowed_bytes = 0;
  bool out_same = false, d_x_same = false, d_w_same = false;
  std::vector<gradient_gap> gradients;  //!< per local expert
};

template <class LayerStep>
rank_record compare(LayerStep const& plain, LayerStep const& shadowed, int32_t local_experts) {
  rank_record r;
  r.plain_rows = plain.rows;
  r.shadowed_rows = shadowed.rows;
  r.home_rows = shadowed.home_rows;
  r.plain_bytes = plain.sent_bytes;
  r.shadowed_bytes = shadowed.sent_bytes;
  r.out_same = same_bits(shadowed.out, plain.out);
  r.d_x_same = same_bits(shadowed.d_x, plain.d_x);
  r.d_w_same = same_bits(shadowed.d_w, plain.d_w);
  int64_t const n = plain.experts.parameter_count();
  for (int32_t l = 0; l < local_experts; ++l) {
    gradient_gap g;
    for (int64_t i = l * n; i < (l + 1) * n; ++i) {
      float const a = shadowed.experts.grads[static_cast<std::size_t>(i)];
      float const b = plain.experts.grads[static_cast<std::size_t>(i)];
      g.same = g.same && std::memcmp(&a, &b, sizeof a) == 0;
      g.max_abs = std::max(g.max_abs, std::fabs(static_cast<double>(a) - b));
      g.largest = std::max(g.largest, std::fabs(static_cast<double>(b)));
    }
    r.gradients.push_back(g);
  }
  return r;
}

//! One step, every rank: what the ranks found, and the shadowing decision (the same on every rank).
struct step_record {
  std::vector<rank_record> ranks;
  moecomm::shadow_decision decision;
  std::vector<int64_t> counts;  //!< [R][E] rows each rank routed to each expert
  std::vector<std::vector<double>> plain_s, shadowed_s;  //!< [iteration][rank]: the layers' times
};

inline double max_of(std::vector<int64_t> const& v) { return static_cast<double>(*std::max_element(v.begin(), v.end())); }
inline double mean_of(std::vector<int64_t> const& v) {
  return static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) / static_cast<double>(v.size());
}

//! Per rank: rows computed with and without shadowing (the layers' reports), beside the model's B_w.
//! Returns whether the layers computed what the model assumed.
inline bool print_rows_table(problem const& p, step_record const& rec) {
  int32_t const L = p.local_experts;
  std::vector<int64_t> before, after;
  for (auto const& r : rec.ranks) {
    before.push_back(r.plain_rows);
    after.push_back(r.shadowed_rows);
  }
  bool const as_modelled = before == rec.decision.tokens_unshadowed && after == rec.decision.tokens;
  double const widest = max_of(before);
  std::printf(
      "   rows computed per rank: report().received_rows + home_rows, a row = one (token, expert) pair;\n"
      "   home_rows, in brackets, are the rank's own rows of shadowed experts\n");
  std::printf("     %-4s %-4s %-7s %7s %-16s %9s %-16s %s\n", "rank", "node", "experts", "plain", "", "shadowed", "",
              "(home)");
  for (int32_t w = 0; w < p.o.ranks; ++w) {
    auto const& r = rec.ranks[static_cast<std::size_t>(w)];
    std::string const held = experts_held(w, L);
    std::printf("     %4d %4d %-7s %7" PRId64 " %-16s %9" PRId64 " %-16s (%" PRId64 ")\n", w, w / p.per_node,
                held.c_str(), r.plain_rows, bar(static_cast<double>(r.plain_rows), widest, 16).c_str(), r.shadowed_rows,
                bar(static_cast<double>(r.shadowed_rows), widest, 16).c_str(), r.home_rows);
  }
  std::printf("     max %.0f -> %.0f rows, mean %.0f -> %.0f, max/mean %.2f -> %.2f%s\n", max_of(before), max_of(after),
              mean_of(before), mean_of(after), max_of(before) / mean_of(before), max_of(after) / mean_of(after),
              as_modelled ? " (= the model's B_w and B'_w)" : " (DIFFERS from the model's B_w / B'_w!)");
  return as_modelled;
}

//! Parameter bytes broadcast against token bytes no longer sent, from the gathered counts; and the
//! all-to-all bytes the layers' reports measured, which must differ by the latter.
inline void print_traffic(problem const& p, step_record const& rec, int64_t parameter_bytes) {
  options const& o = p.o;
  int64_t saved_rows = 0;
  for (int32_t e : rec.decision.shadowed)
    for (int32_t s = 0; s < o.ranks; ++s)
      if (s != e / p.local_experts) saved_rows += rec.counts[static_cast<std::size_t>(s) * o.experts + e];
  auto const shadowed = static_cast<int64_t>(rec.decision.shadowed.size());
  int64_t const broadcast = shadowed * parameter_bytes * (o.ranks - 1);
  int64_t const row_bytes = o.hidden * static_cast<int64_t>(sizeof(float));
  int64_t const saved = saved_rows * row_bytes * 4;
  int64_t plain_sent = 0, shadowed_sent = 0;
  for (auto const& r : rec.ranks) plain_sent += r.plain_bytes, shadowed_sent += r.shadowed_bytes;
  std::printf("   bytes, all ranks:\n");
  std::printf("     parameters broadcast  %10s = %" PRId64
              " expert%s x %s x (R-1 = %d), and as many gradient\n"
              "                                        bytes reduced to the owners\n",
              format_bytes(static_cast<double>(broadcast)).c_str(), shadowed, shadowed == 1 ? "" : "s",
              format_bytes(static_cast<double>(parameter_bytes)).c_str(), o.ranks - 1);
  std::printf("     token rows not sent   %10s = %" PRId64 " rows of non-owner ranks x %" PRId64
              " B x 4 (dispatch, combine; fwd, bwd)\n",
              format_bytes(static_cast<double>(saved)).c_str(), saved_rows, row_bytes);
  std::printf(
      "     all-to-alls measured  %10s sent by plain EP, %s shadowed (report().exchange):\n"
      "                                        %s less%s\n",
      format_bytes(static_cast<double>(plain_sent)).c_str(), format_bytes(static_cast<double>(shadowed_sent)).c_str(),
      format_bytes(static_cast<double>(plain_sent - shadowed_sent)).c_str(),
      plain_sent - shadowed_sent == saved ? ", exactly the token rows not sent" : " (DIFFERS from the rows not sent!)");
}

//! The measured layer times of a step, plain and shadowed: the slowest rank's in each run, over the runs.
inline std::pair<spread, spread> measured_times(step_record const& rec) {
  auto const slowest = [](std::vector<std::vector<double>> const& runs) {
    std::vector<double> max_over_ranks;
    for (auto const& ranks : runs) max_over_ranks.push_back(*std::max_element(ranks.begin(), ranks.end()));
    return spread_of(max_over_ranks);
  };
  return {slowest(rec.plain_s), slowest(rec.shadowed_s)};
}

//! The model's prediction, the compute the CPUs of this machine allow, and the measured time.
inline void print_times(problem const& p, step_record const& rec, moecomm::fastermoe_cost_model const& model, unsigned cpus) {
  auto const [plain, shadowed] = measured_times(rec);
  auto const& d = rec.decision;
  // The ranks' threads share the CPUs: no layer computes faster than all its rows on all CPUs.
  int64_t const cores = std::min<int64_t>(p.o.ranks, cpus);
  auto const compute_floor = [&](std::vector<int64_t> const& rows) {
    int64_t const total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    return model.training_compute_time(
        std::max(*std::max_element(rows.begin(), rows.end()), (total + cores - 1) / cores));
  };
  double const floor_plain = compute_floor(d.tokens_unshadowed), floor_shadowed = compute_floor(d.tokens);
  auto const line = [](std::string const& what, std::string const& a, std::string const& b, double speed_up) {
    std::printf("     %-40s %24s %24s %8.2fx\n", what.c_str(), a.c_str(), b.c_str(), speed_up);
  };
  auto const times = [&](std::string const& what, double a, double b) { line(what, format_time(a), format_time(b), a / b); };
  std::printf("   %-42s %24s %24s %9s\n", "layer time, forward + backward", "plain", "shadowed", "speed-up");
  times("model: Lat(none), Lat(shadow set)", d.latency_unshadowed, d.latency);
  times("compute alone, " + std::to_string(p.o.ranks) + " ranks sharing " + std::to_string(cores) + " CPUs",
        floor_plain, floor_shadowed);
  line("measured: slowest rank, median (min-max)", format_spread(plain), format_spread(shadowed),
       plain.median / shadowed.median);
}

//! Prints the checks of one step; returns whether outputs and input / weight gradients agree bit for bit.
inline bool print_checks(problem const& p, step_record const& rec) {
  bool out = true, d_x = true, d_w = true;
  int32_t shadowed_same = 0, shadowed_count = 0, others_differ = 0;
  double max_abs = 0, max_rel = 0;
  auto const& set = rec.decision.shadowed;
  for (int32_t w = 0; w < p.o.ranks; ++w) {
    auto const& r = rec.ranks[static_cast<std::size_t>(w)];
    out = out && r.out_same, d_x = d_x && r.d_x_same, d_w = d_w && r.d_w_same;
    for (int32_t l = 0; l < p.local_experts; ++l) {
      gradient_gap const& g = r.gradients[static_cast<std::size_t>(l)];
      if (std::find(set.begin(), set.end(), w * p.local_experts + l) == set.end()) {
        others_differ += g.same ? 0 : 1;
        continue;
      }
      ++shadowed_count;
      shadowed_same += g.same ? 1 : 0;
      max_abs = std::max(max_abs, g.max_abs);
      max_rel = std::max(max_rel, g.largest > 0 ? g.max_abs / g.largest : 0.0);
    }
  }
  auto const verdict = [](bool same) { return same ? "bit for bit" : "DIFFERENT"; };
  std::printf("   shadowed vs plain EP: output %s, input gradient %s, routing-weight gradient %s\n", verdict(out),
              verdict(d_x), verdict(d_w));
  std::printf("     owners' parameter gradients after the reduction: unshadowed experts %s",
              others_differ == 0 ? "bit for bit" : (std::to_string(others_differ) + " DIFFERENT").c_str());
  if (shadowed_count > 0)
    std::printf(";\n     shadowed experts %d of %d bit for bit, max |diff| %.2g = %.2g x the largest |gradient|",
                shadowed_same, shadowed_count, max_abs, max_rel);
  std::printf("\n");
  return out && d_x && d_w;
}

//! Rows routed to expert e, in all and from ranks other than its owner.
inline std::pair<int64_t, int64_t> rows_of_expert(problem const& p, step_record const& rec, int32_t e) {
  int64_t total = 0, from_others = 0;
  for (int32_t s = 0; s < p.o.ranks; ++s) {
    int64_t const c = rec.counts[static_cast<std::size_t>(s) * p.o.experts + e];
    total += c;
    from_others += s == e / p.local_experts ? 0 : c;
  }
  return {total, from_others};
}

//! The shadow set, and the expert whose shadowing the model rejected (which ends Algorithm 1's search).
inline void print_shadow_set(problem const& p, step_record const& rec, moecomm::fastermoe_cost_model const& model) {
  int32_t const L = p.local_experts;
  auto const& d = rec.decision;
  std::printf("   shadow set%s\n", d.shadowed.empty() ? ": none" : ", in Algorithm 1's order (descending rows):");
  for (int32_t e : d.shadowed) {
    auto const [total, from_others] = rows_of_expert(p, rec, e);
    std::printf("     expert %2d, owner rank %d (node %d): %5" PRId64 " rows routed to it, %5" PRId64
                " of them from other ranks\n",
                e, e / L, e / L / p.per_node, total, from_others);
  }
  // The next expert by load (ties: smaller id) is the one the model turned down.
  std::vector<int32_t> order;
  for (int32_t e = 0; e < p.o.experts; ++e)
    if (rows_of_expert(p, rec, e).first > 0 && std::find(d.shadowed.begin(), d.shadowed.end(), e) == d.shadowed.end())
      order.push_back(e);
  if (order.empty()) return;
  int32_t const next = *std::min_element(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    int64_t const ra = rows_of_expert(p, rec, a).first, rb = rows_of_expert(p, rec, b).first;
    return ra != rb ? ra > rb : a < b;
  });
  std::vector<int32_t> with_next = d.shadowed;
  with_next.push_back(next);
  double const latency =
      moecomm::predicted_latency(model, moecomm::topology(p.o.ranks, p.per_node),
                                 moecomm::contiguous_placement(p.o.experts, p.o.ranks), rec.counts, with_next);
  std::printf("     next by rows: expert %d (owner rank %d, %" PRId64
              " rows); shadowing it too, the model predicts\n"
              "     %s, not below %s, so Algorithm 1 stopped there\n",
              next, next / L, rows_of_expert(p, rec, next).first, format_time(latency).c_str(),
              format_time(d.latency).c_str());
}

}  // namespace example_support
