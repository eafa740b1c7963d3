// SPDX-License-Identifier: Apache-2.0
//! @file
//! Load balancing by replicated experts, in simulated time (issue: FineMoE and FlexMoE; systems.md
//! §3, §4): one MoE layer trained for 200 steps under a skewed routing trace, for
//!   `megatron`  plain expert parallelism in EP groups of E / S ranks (Megatron-LM: EP × expert-DP
//!               on the same GPUs, so every pattern holds S expert slots per GPU),
//!   `fastermoe` the same groups with FasterMoE's shadowing (Algorithm 1 on the platform's figures),
//!   `flexmoe`   all ranks, S slots each, replicas moved by FlexMoE's planner every `--interval`
//!               steps (parameters and Adam state move; the move's time counts in its step),
//!   `finemoe`   all ranks, S slots each, the exact min-max split every step; placed symmetrically
//!               (`cyclic`) at first, then every 50 steps re-placed from the loads seen
//!               (`from_loads`: FineMoE's asymmetric placement and adaptive re-placement, §6; the
//!               move's time counts in its step);
//!   `megatron_dedup`, `finemoe_dedup`  the same with the deduplicated exchange (`dedup_per_rank`:
//!               a token crosses once to each rank that holds one of its experts or slots);
//! under two traces: `zipf` (Zipf 1.2 popularity, fixed) and `drift` (the same, the popularity order
//! rotating by one expert every 25 steps).
//!
//!     bench_load_balancing --platform=finemoe-h100   (one node of FineMoE's 4 x 8 H100: its FineEP group, d = 2)
//!     bench_load_balancing --platform=flexmoe-a100   (SYMI's FlexMoE cluster: 16 x 1 A100)
//!     ... --csv=FILE --steps=N --interval=N          (per-step rows; scripts/plot-load-balancing draws them)
//!
//! Configuration (ours where the papers are silent, stated in docs/performance.md):
//! - finemoe-h100: 8 ranks, GPT 32×1.3B's MoE layer (E = 32, H = 2048, F = 8192, bf16), top-2
//!   (assumed), 4096 tokens per GPU per micro-batch (assumed); S = 8 (EP 4 × d 2, as the paper).
//! - flexmoe-a100: 16 ranks, GPT-350M-like (E = 16, H = 1024, F = 4096, bf16), top-1, 8192 tokens
//!   per GPU (assumed); S = 4 (SYMI: 16 experts × 4 slots per GPU).
//! - Replica gradients are left to the trainer's once-per-iteration reduction in every pattern
//!   (Megatron's expert-DP all-reduce runs once per iteration as well), so no step pays it; each
//!   iteration pays it once per MoE layer, for every pattern alike: after the run,
//!   every slot row's replica groups all-reduce an expert's bf16 gradient side by side, on the
//!   placement the run ends with (`sync_replica_gradients`, as `pattern_adviser` prices it).
//!   Megatron's and FasterMoE's replicas are their expert-DP groups (E / S ranks apart).
//! - Iterations: the model's transformer (finemoe-h100: GPT 1.3B's 24 blocks, H 2048, sequences of
//!   2048; flexmoe-a100: GPT-350M's 24 blocks, H 1024, sequences of 1024; both an MoE FFN every
//!   other block, as DeepSpeed-MoE and the papers' GPT-MoE models, GPT-2's vocabulary, bf16): 12
//!   mean layer steps and 12 replica syncs plus the rest (`simulate_dense_iteration`, simulated
//!   once), per pattern; one micro-batch per iteration.
//! - Real rows of 4 floats (MLP 4 -> 16 -> 4) stand for the model's (`simulation_scale`).
//! Measured per step: simulated time (forward + backward, plus FlexMoE's moves), max/mean rows per
//! rank, bytes of tokens, parameters and optimizer state moved (model-sized). Check: every pattern's
//! outputs and input gradients, summed over ranks, equal megatron's bit for bit at every step (the
//! deduplicated ones within 1e-5 of their magnitude: they sum per rank first).
//!
//! Times are simulated seconds (SimGrid 3.32, CM02): a model of the platform, not a measurement.

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/layer_policies.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;

constexpr std::int64_t real_hidden = 4, real_ffn = 16, real_tokens = 1024;
constexpr double bf16 = 2.0, fp32 = 4.0;
//! Adam in mixed precision: fp32 master weights and two moments, 12 B per parameter beside the
//! 2 B bf16 weights; real state = 6 × the real (fp32) parameters keeps that ratio after scaling.
constexpr std::int64_t state_per_parameter = 6;

struct workload {
  char const* model;
  std::int32_t ranks, experts, slots, top_k;
  double hidden, ffn, tokens;  //!< the model's; tokens per GPU per step
  char const* papers;
  std::int64_t sequence;  //!< the transformer's (see the file comment)
};

//! The transformer around the MoE layers (see the file comment).
moecomm::transformer_shape transformer(workload const& w) {
  moecomm::transformer_shape s;
  s.layers = 24;
  s.moe_layers = 12;
  s.hidden = std::int64_t(w.hidden);
  s.dense_ffn = std::int64_t(w.ffn);
  s.sequence = w.sequence;
  s.tokens_per_rank = std::int64_t(w.tokens);
  s.vocabulary = 50257;
  return s;
}

workload g_work;
std::int32_t g_steps = 200, g_interval = 10;
constexpr std::int32_t replace_every = 50;  //!< FineMoE's adaptive re-placement (§6: every ~50 iterations)
char const* const traces[] = {"zipf", "drift"};
char const* const patterns[] = {"megatron", "megatron_dedup", "fastermoe", "flexmoe", "finemoe", "finemoe_dedup"};

workload workload_for(std::string const& platform) {
  if (platform == "flexmoe-a100")
    return {"GPT-350M-like, E 16, top-1", 16, 16, 4, 1, 1024, 4096, 8192,
            "FlexMoE: 1.70x avg over DeepSpeed, 1.30x over FasterMoE (its hardware); SYMI's re-implementation: rebalancing "
            "steps 2.46-4.10x slower", 1024};
  return {"GPT 32x1.3B, E 32, top-2", 8, 32, 8, 2, 2048, 8192, 4096,
          "FineMoE: +36.9% avg (up to +47.6%) throughput over Megatron-LM, +13.9% avg over FlexMoE", 2048};
}

moecomm::simulation_scale scale() {
  moecomm::simulation_scale s = moecomm_bench::model_scale(g_work.hidden, g_work.ffn, bf16, real_hidden, real_ffn, fp32);
  double const rows = g_work.tokens / real_tokens;
  s.payload *= rows;
  s.flops *= rows;
  return s;
}

//! The experts of `slots` slots whose slot l holds expert `expert_of(l)`'s parameters
//! (`experts_by_id`), and an Adam-sized state.
struct slot_experts : moecomm_bench::mlp_experts {
  std::vector<float> state;
  template <class ExpertOf>
  slot_experts(std::int32_t slots, ExpertOf expert_of) : mlp_experts(moecomm_bench::experts_by_id(slots, real_hidden, real_ffn, expert_of)) {
    state.assign(static_cast<std::size_t>(slots * parameter_count() * state_per_parameter), 0.0f);
  }
  [[nodiscard]] std::int64_t state_count() const { return parameter_count() * state_per_parameter; }
  float* state_of(std::int32_t l) { return state.data() + l * state_count(); }
};
//! The optimizer state interface over `slot_experts::state`.
struct adam_state {
  slot_experts* experts;
  [[nodiscard]] std::int64_t state_count() const { return experts->state_count(); }
  float* state(std::int32_t l) const { return experts->state_of(l); }
};

//! Every rank's routing at `step`: Zipf(1.2) over a popularity order, rotated every 25 steps under `drift`.
moecomm_bench::rank_routing routing_at(char const* trace, std::int32_t step, std::int32_t rank) {
  std::int32_t const E = g_work.experts;
  std::mt19937 order_rng(2511);
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), order_rng);
  std::int32_t const shift = std::string(trace) == "drift" ? (step / 25) % E : 0;
  auto pick = moecomm_bench::zipf_popularity(E, 1.2);
  std::mt19937 rng(static_cast<std::uint32_t>(step * 7919 + rank * 104729 + 17));
  return moecomm_bench::zipf_routing(real_tokens, g_work.top_k, order, shift, pick, rng);
}

struct step_result {
  double seconds = 0, move_seconds = 0, imbalance = 0, token_bytes = 0, parameter_bytes = 0, state_bytes = 0, checksum = 0,
         magnitude = 0;
};
//! One pattern's run under one trace: every step, and the replicas' gradient sync after the last.
struct run_record {
  std::vector<step_result> steps;
  double sync_seconds = 0;
};
//! Per (trace, pattern).
std::map<std::string, run_record> g_runs;

std::string key(char const* trace, char const* pattern) { return std::string(trace) + "/" + pattern; }

//! Simulated run of one pattern under one trace; `make` builds the layer on each rank.
void run(moecomm::simulated_platform const& platform, char const* trace, char const* pattern, run_record& record) {
  std::vector<step_result>& steps = record.steps;
  std::int32_t const R = g_work.ranks, E = g_work.experts, S = g_work.slots, ep = E / S;
  std::string const name = pattern;
  backend const be(moecomm::host_backend{}, scale());
  moecomm::simulation_scale const sc = be.simulated_scale();
  steps.assign(static_cast<std::size_t>(g_steps), {});
  std::vector<double> start(static_cast<std::size_t>(R)), end(start.size()), move_start(start.size()), move_end(start.size());
  std::vector<double> rows(start.size()), tokens(start.size()), params(start.size()), states(start.size()), sums(start.size()),
      magnitudes(start.size());
  std::int32_t const per_node = platform.gpus_per_node();
  // The platform's figures for the models of FasterMoE and FlexMoE's planner.
  auto const& spec = platform.spec();
  double const link = per_node > 1 ? spec.intra_node.bytes_per_second : spec.nic.bytes_per_second;
  double const row_flops = 4.0 * g_work.hidden * g_work.ffn;  // one row through the MLP, forward
  double const expert_bytes = 2.0 * g_work.hidden * g_work.ffn * bf16;  // its parameters, and its bf16 gradient
  moecomm_bench::step_span synced(R);

  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, R);
  world.run([&](comm_t comm) {
    std::int32_t const me = comm.rank();
    auto const at = static_cast<std::size_t>(me);
    // Megatron and FasterMoE: EP groups of E / S ranks (each rank S experts), the groups side by side.
    comm_t ep_comm = comm.split(me / ep, me);
    moecomm::exchange_groups<comm_t> ep_groups(ep_comm, moecomm::topology(ep, std::min(per_node, ep)));
    moecomm::exchange_groups<comm_t> all(comm, moecomm::topology(R, per_node));
    moecomm::fastermoe_cost_params shadow;
    shadow.alpha = g_work.ffn / g_work.hidden;
    shadow.bytes_per_element = bf16;
    shadow.gemm_flops = spec.gemm_flops();
    shadow.net_bandwidth = shadow.local_bandwidth = link;
    moecomm::flexmoe_planner_options planner;
    planner.interval_steps = g_interval;
    // The loads it sees are real rows, each standing for tokens / real_tokens model rows.
    planner.seconds_per_row = (3 * row_flops / spec.gemm_flops() + 4 * g_work.hidden * bf16 / link) * g_work.tokens / real_tokens;
    planner.bytes_per_replica = expert_bytes * (1 + 6);  // bf16 weights + 12 B/parameter of Adam state
    planner.move_bytes_per_second = link;
    moecomm::replica_placement const cyclic = moecomm::replica_placement::cyclic(R, S, R * S / E);
    moecomm::replica_placement const even_start =
        moecomm::replica_placement::from_loads(R, S, std::vector<double>(static_cast<std::size_t>(E), 1.0), 1);
    using dedup = moecomm::dedup_per_rank<moecomm::flat>;
    using plain_t = moecomm::expert_parallel_layer<float, backend, comm_t>;
    using plain_dedup_t = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, dedup>;
    using shadowing = moecomm::fastermoe_shadowing<moecomm::collective_path>;
    using shadow_t = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, moecomm::flat, moecomm::weighted, shadowing>;
    using flex_t = moecomm::expert_parallel_layer_of<float, backend, comm_t, moecomm::flexmoe>;
    using fine_t = moecomm::expert_parallel_layer_of<float, backend, comm_t, moecomm::finemoe>;
    using fine_dedup_t = moecomm::expert_parallel_layer_of<float, backend, comm_t, moecomm::finemoe, dedup>;
    auto const left = moecomm::replica_gradients::left_to_trainer;
    std::unique_ptr<plain_t> plain;
    std::unique_ptr<plain_dedup_t> plain_dedup;
    std::unique_ptr<shadow_t> shadowed;
    std::unique_ptr<flex_t> flex;
    std::unique_ptr<fine_t> fine;
    std::unique_ptr<fine_dedup_t> fine_dedup;
    std::int32_t const rank_in_ep = me % ep;
    auto slot = [&](moecomm::replica_placement const* p) {
      return [=](std::int32_t l) { return p ? p->expert_at(me, l) : rank_in_ep * S + l; };
    };
    std::unique_ptr<slot_experts> experts;
    if (name == "megatron" || name == "megatron_dedup") {
      if (name == "megatron") plain = std::make_unique<plain_t>(be, ep_groups, E, real_hidden);
      else plain_dedup = std::make_unique<plain_dedup_t>(be, ep_groups, E, real_hidden, moecomm::dropless{}, dedup{});
      experts = std::make_unique<slot_experts>(S, slot(nullptr));
    } else if (name == "fastermoe") {
      shadowed = std::make_unique<shadow_t>(be, ep_groups, E, real_hidden, moecomm::dropless{}, moecomm::flat{},
                                            moecomm::routing_checks{}, shadowing{shadow, {}, {}});
      experts = std::make_unique<slot_experts>(S, slot(nullptr));
    } else if (name == "flexmoe") {
      flex = std::make_unique<flex_t>(be, all, even_start, real_hidden, moecomm::even_split{}, moecomm::routing_checks{},
                                      moecomm::dynamic_placement{planner}, left);
      experts = std::make_unique<slot_experts>(S, slot(&even_start));
    } else {
      if (name == "finemoe")
        fine = std::make_unique<fine_t>(be, all, cyclic, real_hidden, moecomm::finemoe_split{}, moecomm::routing_checks{},
                                        moecomm::static_placement{}, left);
      else
        fine_dedup = std::make_unique<fine_dedup_t>(be, all, cyclic, real_hidden, moecomm::finemoe_split{}, moecomm::routing_checks{},
                                                    moecomm::static_placement{}, left, dedup{});
      experts = std::make_unique<slot_experts>(S, slot(&cyclic));
    }
    std::vector<double> seen(static_cast<std::size_t>(E), 0.0);  // FineMoE: loads since the last re-placement
    std::vector<float> const x = moecomm_bench::random_rows(real_tokens * real_hidden, 200 + at);
    std::vector<float> const d_out = moecomm_bench::random_rows(real_tokens * real_hidden, 300 + at);
    std::vector<float> out(x.size()), d_x(x.size()), d_w(static_cast<std::size_t>(real_tokens * g_work.top_k));
    moecomm::matrix_view<float const> const xv{x.data(), real_tokens, real_hidden}, dv{d_out.data(), real_tokens, real_hidden};
    for (std::int32_t step = 0; step < g_steps; ++step) {
      moecomm_bench::rank_routing const r = routing_at(trace, step, me);
      comm.barrier();
      start[at] = moecomm::simulated_seconds{}();
      auto const train = [&](auto& layer) {
        layer.forward(r.view(), xv, {out.data(), real_tokens, real_hidden}, *experts);
        layer.backward(dv, moecomm::matrix_view<float>{d_x.data(), real_tokens, real_hidden},
                       moecomm::array_view<float>{d_w.data(), static_cast<std::int64_t>(d_w.size())}, *experts);
      };
      // Megatron and FasterMoE: rows each rank computes, its own included.
      auto const train_expert_parallel = [&](auto& layer) {
        train(layer);
        auto const& d = layer.dispatch_state();
        rows[at] = double(d.received_rows() + d.home_rows());
        tokens[at] = double(d.report().exchange.bytes()) * sc.payload;
      };
      auto const train_replicated = [&](auto& layer) {
        train(layer);
        rows[at] = double(layer.report().rank_rows[at]);
        tokens[at] = double(layer.dispatch_state().report().exchange.bytes()) * sc.payload;
      };
      params[at] = states[at] = 0;
      if (plain) train_expert_parallel(*plain);
      if (plain_dedup) train_expert_parallel(*plain_dedup);
      if (shadowed) {
        train_expert_parallel(*shadowed);  // each shadowed expert: a broadcast to and a reduce from the group's other ranks
        params[at] = me % ep == 0 ? double(shadowed->shadow_state().decision().shadowed.size()) * (ep - 1) * 2 * expert_bytes : 0;
      }
      if (flex) train_replicated(*flex);
      if (fine) train_replicated(*fine);
      if (fine_dedup) train_replicated(*fine_dedup);
      end[at] = moecomm::simulated_seconds{}();
      move_start[at] = move_end[at] = 0;
      if (flex && step % g_interval == g_interval - 1) {
        comm.barrier();
        move_start[at] = moecomm::simulated_seconds{}();
        adam_state optimizer{experts.get()};
        moecomm::placement_decision const& d = flex->rebalance(*experts, optimizer);
        move_end[at] = moecomm::simulated_seconds{}();
        if (!d.moves.empty()) {
          double const sent = double(flex->migration().bytes_sent) * sc.parameters;  // real bytes -> model bytes
          params[at] = sent / (1 + state_per_parameter);
          states[at] = sent - params[at];
        }
      }
      auto const replace_fine = [&](auto& layer) {  // FineMoE's adaptive re-placement from the loads seen
        for (std::int32_t e = 0; e < E; ++e) seen[static_cast<std::size_t>(e)] += double(layer.expert_loads().data[e]);
        if (step % replace_every != replace_every - 1) return;
        comm.barrier();
        move_start[at] = moecomm::simulated_seconds{}();
        adam_state optimizer{experts.get()};
        auto const& moved = layer.move_replicas(moecomm::replica_placement::from_loads(R, S, seen, std::uint64_t(step)), *experts,
                                                optimizer);
        move_end[at] = moecomm::simulated_seconds{}();
        double const sent = double(moved.bytes_sent) * sc.parameters;
        params[at] = sent / (1 + state_per_parameter);
        states[at] = sent - params[at];
        std::fill(seen.begin(), seen.end(), 0.0);
      };
      if (fine) replace_fine(*fine);
      if (fine_dedup) replace_fine(*fine_dedup);
      sums[at] = moecomm_bench::checksum(out, d_x);
      magnitudes[at] = moecomm_bench::magnitude(out, d_x);
      comm.barrier();
      if (me == 0) {
        step_result& s = steps[static_cast<std::size_t>(step)];
        s.seconds = *std::max_element(end.begin(), end.end()) - *std::min_element(start.begin(), start.end());
        s.move_seconds = *std::max_element(move_end.begin(), move_end.end()) - *std::min_element(move_start.begin(), move_start.end());
        s.seconds += s.move_seconds;
        double const mean = std::accumulate(rows.begin(), rows.end(), 0.0) / R;
        s.imbalance = mean > 0 ? *std::max_element(rows.begin(), rows.end()) / mean : 1.0;
        s.token_bytes = std::accumulate(tokens.begin(), tokens.end(), 0.0);
        s.parameter_bytes = std::accumulate(params.begin(), params.end(), 0.0);
        s.state_bytes = std::accumulate(states.begin(), states.end(), 0.0);
        s.checksum = std::accumulate(sums.begin(), sums.end(), 0.0);
        s.magnitude = std::accumulate(magnitudes.begin(), magnitudes.end(), 0.0);
      }
    }
    moecomm::replica_placement const* const placed = flex ? &flex->placement() : fine ? &fine->placement() : fine_dedup ? &fine_dedup->placement() : nullptr;
    moecomm_bench::sync_replica_gradients(comm, S, E, expert_bytes, slot(placed), synced);
  });
  record.sync_seconds = synced.seconds();
}

double mean_of(std::vector<step_result> const& steps, double step_result::*field) {
  double sum = 0;
  for (step_result const& s : steps) sum += s.*field;
  return steps.empty() ? 0 : sum / double(steps.size());
}

void register_run(moecomm::simulated_platform const& platform, char const* trace, char const* pattern) {
  std::string const name = std::string("load_balancing/") + trace + "/" + pattern;
  moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, trace, pattern](benchmark::State& state) {
    run_record& record = g_runs[key(trace, pattern)];
    std::vector<step_result> const& steps = record.steps;
    for (auto _ : state) {
      run(platform, trace, pattern, record);
      state.SetIterationTime(mean_of(steps, &step_result::seconds));
    }
    auto const base = g_runs.find(key(trace, "megatron"));
    if (base == g_runs.end() || base->second.steps.size() != steps.size())
      return moecomm_bench::fail(state, "megatron must run before the other patterns");
    // Bit for bit; with dedup_per_rank a token's partial sums per rank change the last bits
    // (semantics §10a), so within 1e-5 of the results' magnitude.
    bool const deduplicated = std::string(pattern).find("_dedup") != std::string::npos;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      double const allowed = deduplicated ? 1e-5 * base->second.steps[i].magnitude : 0.0;
      if (!(std::fabs(steps[i].checksum - base->second.steps[i].checksum) <= allowed))
        return moecomm_bench::fail(state, std::string(pattern) + ": outputs differ from megatron's at step " + std::to_string(i));
    }
    state.counters["step_ms"] = mean_of(steps, &step_result::seconds) * 1e3;
    state.counters["imbalance"] = mean_of(steps, &step_result::imbalance);
    state.counters["vs_megatron"] = mean_of(base->second.steps, &step_result::seconds) / mean_of(steps, &step_result::seconds);
    state.counters["sync_ms"] = record.sync_seconds * 1e3;
  });
}

void print_summary(moecomm::simulated_platform const& platform) {
  moecomm::transformer_shape const shape = transformer(g_work);
  double const experts = g_work.slots * 2 * g_work.hidden * g_work.ffn;  // a rank's slots, no biases
  moecomm_bench::dense_times const dense = moecomm_bench::simulate_dense(platform, g_work.ranks, shape, experts);
  std::printf("\n%s, %d ranks, %s: %d steps, simulated (SimGrid 3.32, CM02), FlexMoE rebalancing every %d steps, FineMoE re-placing every 50\n",
              platform.name().c_str(), g_work.ranks, g_work.model, g_steps, g_interval);
  std::printf("An iteration: %d mean steps, %d replica gradient syncs and the rest of the model (%d blocks: attention, dense "
              "FFNs, LM head, the dense gradients' all-reduce, Adam), %.1f ms simulated (model: %.1f ms)\n",
              shape.moe_layers, shape.moe_layers, shape.layers, dense.simulated * 1e3, dense.predicted * 1e3);
  std::printf("%-6s %-14s %10s %9s %10s %11s %12s %12s %12s %10s %10s %9s\n", "trace", "pattern", "step (ms)", "vs Megat.", "max/mean",
              "moves (ms)", "tokens (GB)", "params (GB)", "state (GB)", "sync (ms)", "iter (ms)", "vs Megat.");
  auto const iteration = [&](run_record const& r) {
    return shape.moe_layers * (mean_of(r.steps, &step_result::seconds) + r.sync_seconds) + dense.simulated;
  };
  for (char const* trace : traces) {
    auto const base = g_runs.find(key(trace, "megatron"));
    for (char const* pattern : patterns) {
      auto const it = g_runs.find(key(trace, pattern));
      if (it == g_runs.end() || base == g_runs.end()) continue;
      auto const& s = it->second.steps;
      double total_moves = 0, tokens = 0, params = 0, states = 0;
      for (step_result const& r : s) {
        total_moves += r.move_seconds;
        tokens += r.token_bytes;
        params += r.parameter_bytes;
        states += r.state_bytes;
      }
      std::printf("%-6s %-14s %10.3f %8.3fx %10.3f %11.2f %12.1f %12.2f %12.2f %10.3f %10.1f %8.3fx\n", trace, pattern,
                  mean_of(s, &step_result::seconds) * 1e3,
                  mean_of(base->second.steps, &step_result::seconds) / mean_of(s, &step_result::seconds),
                  mean_of(s, &step_result::imbalance), total_moves * 1e3, tokens / 1e9, params / 1e9, states / 1e9,
                  it->second.sync_seconds * 1e3, iteration(it->second) * 1e3, iteration(base->second) / iteration(it->second));
    }
  }
  std::printf("(papers, whole training iterations on their own hardware: %s)\n", g_work.papers);
}

void write_csv(std::string const& path, moecomm::simulated_platform const& platform) {
  std::ofstream f(path);
  f << "platform,trace,pattern,step,seconds,move_seconds,imbalance,token_bytes,parameter_bytes,state_bytes\n";
  for (char const* trace : traces)
    for (char const* pattern : patterns) {
      auto const it = g_runs.find(key(trace, pattern));
      if (it == g_runs.end()) continue;
      for (std::size_t i = 0; i < it->second.steps.size(); ++i) {
        step_result const& s = it->second.steps[i];
        f << platform.name() << ',' << trace << ',' << pattern << ',' << i << ',' << s.seconds << ',' << s.move_seconds << ','
          << s.imbalance << ',' << s.token_bytes << ',' << s.parameter_bytes << ',' << s.state_bytes << '\n';
      }
    }
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "finemoe-h100");
  moecomm_bench::take_contention_flag(argc, argv);
  std::string const csv = moecomm_bench::take_flag(argc, argv, "--csv=", "");
  g_steps = static_cast<std::int32_t>(moecomm_bench::take_int_flag(argc, argv, "--steps", 200, 1, 1 << 20));
  g_interval = static_cast<std::int32_t>(moecomm_bench::take_int_flag(argc, argv, "--interval", 10, 1, 1 << 20));
  if (!moecomm_bench::start(argc, argv)) return 1;
  if (g_steps < 1 || g_interval < 1) {
    std::fprintf(stderr, "bench_load_balancing: --steps and --interval must be positive\n");
    return 1;
  }
  g_work = workload_for(name);
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  benchmark::AddCustomContext("workload", std::string(g_work.model) + ", " + std::to_string(g_work.ranks) + " ranks, " +
                                              std::to_string(g_work.slots) + " expert slots per rank, " +
                                              std::to_string(g_steps) + " steps");
  for (char const* trace : traces)
    for (char const* pattern : patterns) register_run(platform, trace, pattern);
  return moecomm_bench::finish("bench_load_balancing", [&] {
    print_summary(platform);
    if (!csv.empty()) write_csv(csv, platform);
  });
}
