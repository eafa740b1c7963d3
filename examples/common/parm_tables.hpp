// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Parm's schedules side by side (example 05): what one schedule's run on a simulated cluster
//! leaves, and the tables that compare them: rows and traffic, simulated times beside the cost
//! model, parm_auto's pick, and the check against deepspeed_mp.

#include "format.hpp"
#include "inputs.hpp"

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/parm.hpp>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

//! One schedule's run: a fresh layer on a fresh world, a warm-up step and a measured one.
struct schedule_result {
  schedule_result(std::string n, std::size_t ranks) : name(std::move(n)), out(ranks), d_x(ranks), d_w(ranks) {}
  std::string name;
  double predicted_s = 0;                //!< the cost model's step
  double forward_s = 0, backward_s = 0;  //!< the measured step's, slowest rank
  std::int64_t rows_dispatched = 0, rows_computed = 0;  //!< per rank, the largest
  moecomm::alltoall_stats traffic;                 //!< forward, every collective, all ranks (real bytes)
  moecomm::parm_report auto_report;                //!< rank 0's, for parm_auto
  std::vector<std::vector<float>> out, d_x, d_w;   //!< [rank]
};

//! Section 2: the rows the busiest rank dispatched and computed, and every collective's messages and
//! bytes inside and between nodes (model-sized bytes).
inline void print_rows_and_traffic(std::vector<schedule_result> const& results, moecomm::parallel_sizes const& sizes, double payload_scale) {
  std::printf("2. Work and traffic of the measured forward (rows: the busiest rank; traffic: all ranks, every collective,\n"
              "   simulated bytes = real bytes x %g)\n", payload_scale);
  std::printf("   %-14s %12s %12s %11s %12s %11s %12s\n", "schedule", "dispatched", "computed", "intra msgs", "intra bytes",
              "inter msgs", "inter bytes");
  for (auto const& r : results)
    std::printf("   %-14s %12" PRId64 " %12" PRId64 " %11" PRId64 " %12s %11" PRId64 " %12s\n", r.name.c_str(), r.rows_dispatched,
                r.rows_computed, r.traffic.intra_messages, format_bytes(static_cast<double>(r.traffic.intra_bytes) * payload_scale).c_str(),
                r.traffic.inter_messages, format_bytes(static_cast<double>(r.traffic.inter_bytes) * payload_scale).c_str());
  std::printf("   PauseMP dispatches each MP group's rows once instead of once on each of its %d ranks; a slice\n"
              "   computes MP / ESP = %d times fewer rows (with ESP = MP the ESP all-gather gives it back the rows\n"
              "   the MP split took away); PauseMP adds the MP all-gather of the output.\n\n",
              sizes.model, sizes.model / sizes.expert_slicing);
}

//! Every result's speed-up over deepspeed_mp and over the strongest baseline, DeepSpeed-MoE with drop_tokens.
inline void print_schedule_times(std::vector<schedule_result> const& results) {
  auto const total_of = [](schedule_result const& r) { return r.forward_s + r.backward_s; };
  double const base = total_of(results[0]), strongest = total_of(results[1]);
  std::printf("3. Simulated time of the measured step (slowest rank) beside the cost model's prediction\n");
  std::printf("   %-14s %11s %11s %11s %9s %13s %11s\n", "schedule", "forward", "backward", "total", "speed-up", "vs drop_tok.",
              "model");
  for (auto const& r : results)
    std::printf("   %-14s %11s %11s %11s %8.2fx %12.2fx %11s\n", r.name.c_str(), format_time(r.forward_s).c_str(),
                format_time(r.backward_s).c_str(), format_time(total_of(r)).c_str(), base / total_of(r), strongest / total_of(r),
                format_time(r.predicted_s).c_str());
  std::printf("   ds_drop_tokens is DeepSpeed-MoE with drop_tokens: each MP rank dispatches its share of the tokens to\n"
              "   whole experts, replicated on the MP ranks (MP / ESP times a slice's parameters), and their gradients\n"
              "   are summed in the trainer's expert-DP all-reduce; it needs no ESP collectives. Parm's schedules are for\n"
              "   when the experts must be sliced.\n");
  std::printf("   model: models/parm_cost_model.hpp with the platform's figures (parm_cost_params::from_cluster): an\n"
              "   alpha-beta cost per collective and link class, balanced experts; not the gate, the permutations or\n"
              "   the memory kernels other than the collectives' copies.\n\n");
}

//! Section 4: the schedule parm_auto picked, the predictions it picked on, and whether the simulation
//! agrees that it was the faster one.
inline void print_choice(schedule_result const& automatic, schedule_result const& s1, schedule_result const& s2) {
  moecomm::parm_report const& r = automatic.auto_report;
  bool const s2_faster = s2.forward_s + s2.backward_s < s1.forward_s + s1.backward_s;
  std::printf("4. parm_auto picked %s: predicted step S1 %s, S2 %s (the smaller wins); simulated S1 %s, S2 %s,\n"
              "   so the pick was %s\n\n",
              r.schedule, format_time(r.choice.s1.step_total).c_str(), format_time(r.choice.s2.step_total).c_str(),
              format_time(s1.forward_s + s1.backward_s).c_str(), format_time(s2.forward_s + s2.backward_s).c_str(),
              (std::string(r.schedule) == "parm_s2") == s2_faster ? "the faster one" : "NOT the faster one");
}

//! Every schedule's outputs and gradients against deepspeed_mp's, every rank: bit for bit on the
//! same sliced experts, within `1e-5` of the largest value on unsliced ones.
inline bool identical_to_baseline(std::vector<schedule_result> const& results, std::string const& unsliced_name) {
  schedule_result const& base = results.front();
  bool same = true;
  for (auto const& r : results)
    for (std::size_t i = 0; i < base.out.size(); ++i) {
      bool const here = r.name == unsliced_name
                            ? normwise_difference(r.out[i], base.out[i]) <= 1e-5 &&
                                  normwise_difference(r.d_x[i], base.d_x[i]) <= 1e-5 &&
                                  normwise_difference(r.d_w[i], base.d_w[i]) <= 1e-5
                            : same_bits(r.out[i], base.out[i]) && same_bits(r.d_x[i], base.d_x[i]) && same_bits(r.d_w[i], base.d_w[i]);
      if (!here) std::printf("   %s differs from deepspeed_mp on rank %zu\n", r.name.c_str(), i);
      same = same && here;
    }
  return same;
}

}  // namespace example_support
