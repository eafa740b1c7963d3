// SPDX-License-Identifier: Apache-2.0
//! @file
//! The pattern adviser (`models/pattern_adviser.hpp`) against the simulation: over a grid of models and
//! routing steps on one platform, the adviser ranks every pattern and setting from the platform's
//! figures alone; each candidate is then run as a layer step (forward and backward, after a warm-up
//! step) on the simulated ranks, and the replicated layouts' gradient sync after it. Reported per
//! step: whether the adviser's first choice is the simulated fastest, how much slower it is when
//! not, and each candidate's predicted and simulated layer step and sync.
//!
//!     bench_pattern_adviser [--platform=fastermoe-v100-pcie] [--grid=main|holdout|parm|hybridep] [--ranks=16]
//!     bench_pattern_adviser --platform=P --advise [--ranks=N --model=MoE-GPT --tokens=4096
//!         --experts_per_rank=16 --slots_per_rank=32 --micro_batches=8 --top_k=2 --zipf=1.2 --model_parallel=1]
//!                                                   the ranking alone (no simulation)
//!
//! Models (FasterMoE's, §5): MoE-GPT-S / MoE-GPT / MoE-GPT-L, H = 1024 / 2048 / 4096, experts
//! H -> 2H -> H in fp32, 12 blocks every one MoE, sequences of 1024, GPT-2's vocabulary, fp32 Adam,
//! 8 micro-batches an iteration; every GPU gives each layer room for twice its share of experts
//! (S = 2E / R slots). Grid `main`: MoE-GPT-S and MoE-GPT, 16 and 2 experts per rank, top-1 and
//! top-2, routing uniform or Zipf(1.2), 4096 tokens per rank, seed 5; `holdout` (run only after the
//! model was fixed): MoE-GPT-L, 4 experts per rank, top-2 and top-4, Zipf(0.8) and Zipf(1.6), 2048
//! tokens, seed 17. The ranks are the platform's first `--ranks` GPUs (default 16). Rows hold 4 real
//! floats and the experts are MLPs 4 -> 8 -> 4 that `simulation_scale` makes the model's.
//! The simulated best is the candidate whose iteration is shortest when its layer steps and syncs are
//! the simulated ones (the rest of the iteration, the same for all but the optimizer's share, from
//! the adviser's model).
//! Checks: every candidate's outputs and input gradients, summed over the ranks, equal plain `flat`'s
//! within 1e-6 of their magnitude (the deduplicated exchanges sum a token's slots in another order);
//! the shadowing patterns replicate the experts the adviser predicted; every predicted layer step
//! and gradient sync is within 25 % of the simulated one.
//! Times are simulated seconds (SimGrid 3.32, CM02): a model of the platform, not a measurement.

#include <moecomm/moecomm.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/patterns/parm.hpp>
#include <moecomm/models/pattern_adviser.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
using comm_t = moecomm::simgrid_communicator;
using moecomm_bench::mlp_experts;

constexpr std::int64_t real_hidden = 4, real_ffn = 8;  // α = 2, as the models
constexpr double fp32 = 4;

struct model_size {
  char const* name;
  std::int64_t hidden;
};
constexpr model_size models[] = {{"MoE-GPT-S", 1024}, {"MoE-GPT", 2048}, {"MoE-GPT-L", 4096}};

struct step_case {
  model_size model;
  std::int32_t ranks, experts_per_rank, top_k;
  std::int64_t tokens;
  double zipf;
  std::uint32_t seed;
  std::int32_t slots_per_rank = 0;  //!< expert slots of memory per rank (0: E / R)
  std::int32_t micro_batches = 8;   //!< per iteration (gradient accumulation)
  std::int32_t model_parallel = 1;  //!< M: MP groups of M consecutive ranks (Parm's layouts)
  [[nodiscard]] std::int32_t experts() const { return ranks * experts_per_rank; }
};

moecomm::transformer_shape transformer(step_case const& c) {
  moecomm::transformer_shape s;
  s.layers = s.moe_layers = 12;
  s.hidden = c.model.hidden;
  s.sequence = 1024;
  s.tokens_per_rank = c.tokens;
  s.vocabulary = 50257;
  s.gradient_bytes = fp32;
  s.optimizer_bytes_per_parameter = 28;  // fp32 Adam
  s.micro_batches = c.micro_batches;
  s.model_parallel = c.model_parallel;
  return s;
}

//! Every rank's routing: each MP group's tokens drawn once (every rank's, without model
//! parallelism), the same on the group's ranks.
std::vector<moecomm_bench::rank_routing> routing_of(step_case const& c) {
  auto const groups = moecomm_bench::skewed_routing(c.ranks / c.model_parallel, c.tokens, c.top_k, c.experts(), c.zipf, c.seed);
  std::vector<moecomm_bench::rank_routing> routing;
  for (std::int32_t r = 0; r < c.ranks; ++r) routing.push_back(groups[static_cast<std::size_t>(r / c.model_parallel)]);
  return routing;
}

//! The platform's first `ranks` GPUs: their nodes, and their data centres when it has several.
moecomm::topology topology_of(moecomm::cluster_spec const& spec, std::int32_t ranks) {
  return moecomm::topology(ranks, spec.gpus_per_node, spec.domains > 1 ? spec.nodes_per_domain : 0);
}

moecomm::pattern_adviser adviser_for(moecomm::cluster_spec const& spec, step_case const& c) {
  return moecomm::pattern_adviser(spec, topology_of(spec, c.ranks), transformer(c), {c.experts(), 2 * c.model.hidden, fp32, c.slots_per_rank});
}

std::vector<moecomm::routing_view> views(std::vector<moecomm_bench::rank_routing> const& routing) {
  std::vector<moecomm::routing_view> v;
  for (auto const& r : routing) v.push_back(r.view());
  return v;
}

//! One candidate's simulated step: its span over the ranks, its results' checksum and magnitude,
//! the experts its layer chose to replicate (the shadowing layers; the other layouts hold the
//! adviser's), and the span of the replicas' gradients' sync.
struct simulated_step {
  double seconds = 0, checksum = 0, magnitude = 0;
  std::optional<std::int32_t> replicated;
  double sync_seconds = 0;
};

//! The bytes of one expert's gradient.
double expert_gradient_bytes(step_case const& c) { return 2.0 * double(c.model.hidden) * 2.0 * double(c.model.hidden) * fp32; }

//! One step on every simulated rank: `body(comm, be, span, synced, o)` runs this rank's part on a
//! back-end whose real experts stand for the model's (`simulation_scale`), timing its layer step
//! into `span`, its gradient sync (`sync`) into `synced`, and adding its results to `o`.
template <class Body>
simulated_step simulate_ranks(moecomm::simulated_platform const& platform, step_case const& c, bool sync, Body&& body) {
  backend const be(moecomm::host_backend{},
                   moecomm_bench::model_scale(double(c.model.hidden), 2.0 * double(c.model.hidden), fp32, real_hidden, real_ffn, fp32));
  moecomm_bench::step_span span(c.ranks), synced(c.ranks);
  simulated_step o;
  moecomm::simgrid_world world = moecomm_bench::first_gpus(platform, c.ranks);
  world.run([&](comm_t comm) { body(comm, be, span, synced, o); });
  o.seconds = span.seconds();
  if (sync) o.sync_seconds = synced.seconds();
  return o;
}

//! One layer step on every rank, `make(be, groups)` building the layer over EP groups of `ep`
//! consecutive ranks (each group its own communicator; `ep` = R: the world), rank r's slot l
//! holding expert `expert_of(r, l)`'s parameters; `replicated(layer)` counts the experts the layer
//! chose to replicate, if it chooses. Then, `sync`, the trainer's reduction of the replicas'
//! gradients (`sync_replica_gradients`, as the adviser prices it).
template <class ExpertOf, class Make, class Replicated>
simulated_step run_layer(moecomm::simulated_platform const& platform, step_case const& c, std::vector<moecomm_bench::rank_routing> const& routing,
                         std::int32_t ep, std::int32_t slots, ExpertOf expert_of, Make&& make, Replicated&& replicated, bool sync) {
  return simulate_ranks(platform, c, sync, [&](comm_t& comm, backend const& be, auto& span, auto& synced, simulated_step& o) {
    std::int32_t const me = comm.rank();
    comm_t group = ep < c.ranks ? comm.split(me / ep, me) : comm;
    moecomm::exchange_groups<comm_t> groups(group, moecomm::topology(ep, std::min(platform.gpus_per_node(), ep)));
    auto layer = make(be, groups);
    mlp_experts mlp = moecomm_bench::experts_by_id(slots, real_hidden, real_ffn, [&](std::int32_t l) { return expert_of(me, l); });
    moecomm_bench::step_result const r =
        moecomm_bench::warm_then_timed_step(layer, comm, routing[static_cast<std::size_t>(me)], real_hidden, mlp, span);
    o.checksum += r.checksum;  // actors run one at a time
    o.magnitude += r.magnitude;
    if (me == 0) o.replicated = replicated(layer);
    if (sync)
      moecomm_bench::sync_replica_gradients(comm, slots, c.experts(), expert_gradient_bytes(c), [&](std::int32_t l) { return expert_of(me, l); },
                                            synced);
  });
}

template <class Algorithm, class Shadowing = moecomm::no_shadowing>
using layer_t = moecomm::expert_parallel_layer<float, backend, comm_t, moecomm::dropless, Algorithm, moecomm::weighted, Shadowing>;
using shadowing_t = moecomm::fastermoe_shadowing<moecomm::collective_path>;
using prophet_t = moecomm::fastermoe_shadowing<moecomm::collective_path, moecomm::proprophet_planner<>>;

//! Plain EP (or a shadowing pattern) over EP groups of `ep` ranks (0: all), expert e of a group on
//! its rank e / (E / ep).
template <class Algorithm, class Shadowing = moecomm::no_shadowing>
simulated_step run(moecomm::simulated_platform const& platform, step_case const& c, std::vector<moecomm_bench::rank_routing> const& routing,
                   Algorithm algorithm, Shadowing shadowing = {}, std::int32_t ep = 0) {
  std::int32_t const P = ep > 0 ? ep : c.ranks, L = c.experts() / P;
  return run_layer(
      platform, c, routing, P, L, [P, L](std::int32_t r, std::int32_t l) { return (r % P) * L + l; },
      [&](backend const& be, moecomm::exchange_groups<comm_t>& g) {
        return layer_t<Algorithm, Shadowing>(be, g, c.experts(), real_hidden, {}, algorithm, {}, shadowing);
      },
      [](auto& layer) {
        std::optional<std::int32_t> chosen;
        if constexpr (Shadowing::shadows) chosen = static_cast<std::int32_t>(layer.shadow_state().decision().shadowed.size());
        return chosen;
      },
      P < c.ranks);
}

//! A replicated layout (`replicated_expert_layer`, static `placement`, `Split`'s split), its
//! replicas' gradients left to the trainer as the adviser prices them.
template <class Split, class Algorithm>
simulated_step run_replicated(moecomm::simulated_platform const& platform, step_case const& c,
                              std::vector<moecomm_bench::rank_routing> const& routing, moecomm::replica_placement const& placement,
                              Algorithm algorithm) {
  using layer = moecomm::replicated_expert_layer<float, backend, comm_t, Split, moecomm::weighted, moecomm::static_placement, Algorithm>;
  return run_layer(
      platform, c, routing, c.ranks, placement.slots_per_rank(), [&](std::int32_t r, std::int32_t l) { return placement.expert_at(r, l); },
      [&](backend const& be, moecomm::exchange_groups<comm_t>& g) {
        return layer(be, g, placement, real_hidden, Split{}, {}, {}, moecomm::replica_gradients::left_to_trainer, algorithm);
      },
      [](auto&) { return std::optional<std::int32_t>(); },
      true);
}

//! A Parm layout (`parm_layer`, DP 1: EP over the R / M MP groups, `Schedule` on slices of G of
//! the experts by id); PauseMP's replicas' gradients left to the trainer, and their sync after it
//! (each local expert's slice over the M / G ranks holding it), as the adviser prices it.
template <class Schedule>
simulated_step run_parm(moecomm::simulated_platform const& platform, step_case const& c, std::vector<moecomm_bench::rank_routing> const& routing,
                        Schedule schedule, std::int32_t G) {
  std::int32_t const M = c.model_parallel, P = c.ranks / M, L = c.experts() / P;
  bool const sync = !std::is_same_v<Schedule, moecomm::deepspeed_mp> && M / G > 1;
  return simulate_ranks(platform, c, sync, [&](comm_t& comm, backend const& be, auto& span, auto& synced, simulated_step& o) {
    std::int32_t const me = comm.rank();
    moecomm::parallel_groups<comm_t> groups(comm, {M, P, G}, moecomm::topology(c.ranks, platform.gpus_per_node()));
    auto const at = groups.coordinates();
    moecomm::parm_layer<float, backend, comm_t, Schedule> layer(be, groups, c.experts(), real_hidden, schedule);
    moecomm_bench::sliced_mlp mlp =
        moecomm_bench::slices_by_id(L, real_hidden, real_ffn, at.esp, G, [&](std::int32_t l) { return at.ep * L + l; });
    moecomm_bench::step_result const r =
        moecomm_bench::warm_then_timed_step(layer, comm, routing[static_cast<std::size_t>(me)], real_hidden, mlp, span, me - me % M);
    o.checksum += r.checksum;  // actors run one at a time
    o.magnitude += r.magnitude;
    if (sync)
      moecomm_bench::sync_replica_gradients(comm, L, c.experts() * G, expert_gradient_bytes(c) / G,
                                            [&](std::int32_t l) { return (at.ep * L + l) * G + at.esp; }, synced);
  });
}

//! HybridEP (`hybridep_layer`, `flat`) with expert domains of `S` ranks spread as `spread`, rank r
//! owning experts [r·L, (r+1)·L): each step begins the gather, then charges the block's attention
//! (`attention_forward_flops`), under which the gather runs, then the layer. The span less the
//! attention is the step the adviser prices.
simulated_step run_hybridep(moecomm::simulated_platform const& platform, step_case const& c, std::vector<moecomm_bench::rank_routing> const& routing,
                            std::int32_t S, moecomm::expert_domain_spread spread) {
  std::int32_t const L = c.experts() / c.ranks;
  double const attention = transformer(c).attention_forward_flops();
  simulated_step o = simulate_ranks(platform, c, false, [&](comm_t& comm, backend const& be, auto& span, auto&, simulated_step& sum) {
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<comm_t> groups(comm, topology_of(platform.spec(), c.ranks));
    moecomm::hybridep_layer<float, backend, comm_t> layer(be, groups, c.experts(), real_hidden, moecomm::hybridep{S, spread});
    mlp_experts mlp = moecomm_bench::experts_by_id(L, real_hidden, real_ffn, [&](std::int32_t l) { return me * L + l; });
    moecomm_bench::step_result const r =
        moecomm_bench::warm_then_timed_step(layer, comm, routing[static_cast<std::size_t>(me)], real_hidden, mlp, span, -1, [&] {
          layer.begin_expert_gather(mlp);
          be.charge_flops(attention / be.simulated_scale().flops);
        });
    sum.checksum += r.checksum;  // actors run one at a time
    sum.magnitude += r.magnitude;
  });
  o.seconds -= attention / platform.spec().gemm_flops();
  return o;
}

//! `f` called with the exchange algorithm named `setting`.
template <class F>
simulated_step by_exchange(std::string const& setting, F&& f) {
  if (setting == "flat") return f(moecomm::flat{});
  if (setting == "hierarchical_2d") return f(moecomm::hierarchical_2d{});
  if (setting == "dedup_per_rank") return f(moecomm::dedup_per_rank<moecomm::flat>{});
  if (setting == "dedup_per_node") return f(moecomm::dedup_per_node{});
  moecomm::detail::fail(moecomm::status::invalid_argument, "bench_pattern_adviser", "no exchange named ", setting);
}

//! The adviser's candidate `p`, simulated.
simulated_step simulate(moecomm::simulated_platform const& platform, step_case const& c, std::vector<moecomm_bench::rank_routing> const& routing,
                        moecomm::pattern_adviser const& adviser, moecomm::pattern_prediction const& p) {
  std::int32_t group = 0;
  if (std::sscanf(p.setting.c_str(), "smart_schedule{%d}", &group) == 1) {
    moecomm::smart_schedule const smart{group};
    if (p.pattern == "fastermoe") return run(platform, c, routing, smart, shadowing_t{adviser.fastermoe_params(), {}, {}});
    return run(platform, c, routing, smart);
  }
  if (p.pattern == "fastermoe") return run(platform, c, routing, moecomm::flat{}, shadowing_t{adviser.fastermoe_params(), {}, {}});
  if (p.pattern == "pro_prophet") {
    prophet_t policy{{}, {}, {}};
    policy.planner.model = moecomm::proprophet_cost_model(adviser.proprophet_params());
    policy.planner.options = moecomm::pattern_adviser::proprophet_options();
    return run(platform, c, routing, moecomm::flat{}, policy);
  }
  int G = 1, W = 1;
  if (std::sscanf(p.setting.c_str(), "ESP %d, %d pieces", &G, &W) >= 1) {
    auto const left = moecomm::replica_gradients::left_to_trainer;
    if (p.pattern == "deepspeed_mp") return run_parm(platform, c, routing, moecomm::deepspeed_mp{}, G);
    if (p.pattern == "drop_tokens" || p.pattern == "parm_s1") return run_parm(platform, c, routing, moecomm::parm_s1{left}, G);
    if (p.pattern == "parm_s2") return run_parm(platform, c, routing, moecomm::parm_s2{W, left}, G);
  }
  if (p.pattern == "hybridep") {
    bool const across = p.placement == "across data centres";
    return run_hybridep(platform, c, routing, std::stoi(p.setting.substr(2)),
                        across ? moecomm::expert_domain_spread::across_data_centres : moecomm::expert_domain_spread::within_data_centres);
  }
  if (p.pattern == "expert_parallel" || p.pattern == "expert_data_parallel")
    return by_exchange(p.setting, [&](auto a) { return run(platform, c, routing, a, moecomm::no_shadowing{}, p.ep_size); });
  auto const slots = static_cast<std::int32_t>(p.slot_experts.size()) / c.ranks;
  moecomm::replica_placement const placement(c.experts(), c.ranks, slots, p.slot_experts);
  if (p.pattern == "finemoe")
    return by_exchange(p.setting, [&](auto a) { return run_replicated<moecomm::finemoe_split>(platform, c, routing, placement, a); });
  if (p.pattern == "flexmoe")
    return by_exchange(p.setting, [&](auto a) { return run_replicated<moecomm::even_split>(platform, c, routing, placement, a); });
  moecomm::detail::fail(moecomm::status::invalid_argument, "bench_pattern_adviser", "no simulation for ", p.pattern, " ", p.setting);
}

std::string label(moecomm::pattern_prediction const& p) {
  return p.pattern + " " + p.setting + (p.placement.empty() ? "" : " (" + p.placement + ")");
}

//! The largest |predicted / simulated - 1| of a layer step the bench accepts (docs/performance.md
//! reports the errors themselves: a few per cent).
constexpr double max_error = 0.25;

struct outcome {
  std::string name, chosen, best;
  double loss = 0;              //!< the choice's simulated MoE part of the iteration over the best's, minus 1
  std::vector<double> errors;  //!< predicted over simulated layer step, minus 1, per candidate
  std::vector<double> sync_errors;  //!< predicted over simulated gradient sync, minus 1, per replicated layout
};
std::vector<outcome> outcomes;

struct grid {
  model_size const* models[2];
  std::int32_t experts_per_rank[2], top_k[2];
  double zipf[2];
  std::int64_t tokens;
  std::uint32_t seed;
};
grid const main_grid{{&models[0], &models[1]}, {16, 2}, {1, 2}, {0.0, 1.2}, 4096, 5};
grid const holdout_grid{{&models[2], nullptr}, {4, 0}, {2, 4}, {0.8, 1.6}, 2048, 17};

//! One step of a grid: the adviser's ranking, every candidate simulated, and the checks.
void register_step(moecomm::simulated_platform const& platform, step_case const& c) {
  char name[160];
  std::string const mp = c.model_parallel > 1 ? "/MP:" + std::to_string(c.model_parallel) : "";
  std::snprintf(name, sizeof name, "advise/R:%d/%s%s/E:%d/S:%d/top%d/zipf:%g/T:%lld", c.ranks, c.model.name, mp.c_str(), c.experts(),
                c.slots_per_rank, c.top_k, c.zipf, static_cast<long long>(c.tokens));
  moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, c, n = std::string(name)](benchmark::State& state) {
    auto const routing = routing_of(c);
    moecomm::pattern_adviser const adviser = adviser_for(platform.spec(), c);
    auto const start = std::chrono::steady_clock::now();
    auto const ranking = adviser.rank(views(routing));
    double const advise_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    std::map<std::string, simulated_step> sim;
    for (auto _ : state) {
      for (auto const& p : ranking) sim[label(p)] = simulate(platform, c, routing, adviser, p);
      state.SetIterationTime(sim.at(label(ranking.front())).seconds);
    }
    // The reference: plain flat, or with model parallelism DeepSpeed-MoE's layout on the MP
    // group's slices (ESP = MP), which every layout's results equal up to the order of the
    // slices' partial sums.
    std::string const reference = c.model_parallel > 1 ? "deepspeed_mp ESP " + std::to_string(c.model_parallel) + " (MP " +
                                                             std::to_string(c.model_parallel) + " x EP " +
                                                             std::to_string(c.ranks / c.model_parallel) + ")"
                                                       : "expert_parallel flat";
    double const tolerance = c.model_parallel > 1 ? 1e-5 : 1e-6;
    simulated_step const& plain = sim.at(reference);
    // What the candidates differ by per iteration: the MoE layers' steps and gradient syncs
    // (simulated), and the optimizer over the rank's experts (the adviser's model: the rest
    // of the iteration, the same for every candidate, left out).
    moecomm::iteration_model const& it = adviser.iteration();
    double const layers = it.shape().moe_layers, micro = it.shape().micro_batches;
    double const common = it.compute_seconds() + it.tensor_parallel_seconds() + it.allreduce_seconds();
    auto const simulated_part = [&](moecomm::pattern_prediction const& p) {
      simulated_step const& s = sim.at(label(p));
      return p.iteration_seconds - layers * (micro * p.layer_seconds + p.gradient_sync_seconds) - common +
             layers * (micro * s.seconds + s.sync_seconds);
    };
    outcome o{n, label(ranking.front()), label(ranking.front()), 0, {}, {}};
    double best = simulated_part(ranking.front());
    for (auto const& p : ranking) {
      simulated_step const& s = sim.at(label(p));
      if (std::fabs(s.checksum - plain.checksum) > tolerance * plain.magnitude)
        return moecomm_bench::fail(state, n + ": " + label(p) + "'s results differ from " + reference + "'s");
      if (s.replicated && *s.replicated != p.replicated)
        return moecomm_bench::fail(state, n + ": " + label(p) + " replicated " + std::to_string(*s.replicated) +
                                              " experts; the adviser predicted " + std::to_string(p.replicated));
      if (simulated_part(p) < best) {
        best = simulated_part(p);
        o.best = label(p);
      }
      // A predicted part against its simulation: its error kept, its counters set; false past 25 %.
      auto const within = [&](char const* what, std::string const& key, double predicted, double simulated, std::vector<double>& errors) {
        errors.push_back(predicted / simulated - 1);
        state.counters[label(p) + " " + key + "pred_ms"] = predicted * 1e3;
        state.counters[label(p) + " " + key + "sim_ms"] = simulated * 1e3;
        if (std::fabs(errors.back()) <= max_error) return true;
        moecomm_bench::fail(state, n + ": " + label(p) + "'s predicted " + what + " " + std::to_string(predicted) +
                                       " s is not within 25 % of the simulated " + std::to_string(simulated) + " s");
        return false;
      };
      if (!within("step", "", p.layer_seconds, s.seconds, o.errors)) return;
      bool const syncs = s.sync_seconds > 0 || p.gradient_sync_seconds > 0;
      if (syncs && !within("gradient sync", "sync_", p.gradient_sync_seconds, s.sync_seconds, o.sync_errors)) return;
    }
    o.loss = simulated_part(ranking.front()) / best - 1;
    state.counters["agree"] = o.chosen == o.best ? 1 : 0;
    state.counters["loss_pct"] = 100 * o.loss;
    state.counters["advise_us"] = advise_us;
    state.counters["reference_sim_ms"] = plain.seconds * 1e3;
    state.SetLabel("chose " + o.chosen + ", best " + o.best);
    outcomes.push_back(o);
  });
}

void register_grid(moecomm::simulated_platform const& platform, grid const& g, std::int32_t ranks) {
  for (model_size const* m : g.models)
    for (std::int32_t per_rank : g.experts_per_rank)
      for (std::int32_t top_k : g.top_k)
        for (double zipf : g.zipf)
          if (m != nullptr && per_rank > 0) register_step(platform, {*m, ranks, per_rank, top_k, g.tokens, zipf, g.seed, 2 * per_rank});
}

//! Grid `parm`: Parm's layouts under tensor parallelism, MP 2 and 4 (inside a node), one expert
//! per rank (E = R, as Parm's grid), top-2, 2048 tokens per MP group, uniform and Zipf(1.2) routing,
//! MoE-GPT-S and MoE-GPT; memory for the slices of ESP = MP only (S = E / R), or for whole experts.
void register_parm_grid(moecomm::simulated_platform const& platform, std::int32_t ranks) {
  for (model_size const* m : {&models[0], &models[1]})
    for (std::int32_t M : {2, 4})
      for (double zipf : {0.0, 1.2})
        for (std::int32_t slots : {1, M}) {
          step_case c{*m, ranks, 1, 2, 2048, zipf, 5, slots};
          c.model_parallel = M;
          register_step(platform, c);
        }
}

//! Grid `hybridep`: HybridEP's platforms (data centres of one node joined by slow links), the ranks
//! their first data centres; MoE-GPT-S, 1 and 2 experts per rank, 4096 and 16384 tokens per rank,
//! top-2, uniform and Zipf(1.2) routing, one micro-batch an iteration (as HybridEP's iterations);
//! memory for a data centre's share of every expert (E·D / R slots for D data centres): EP inside
//! each data centre with the experts data-parallel across them fits, as do expert domains of up to D.
void register_hybridep_grid(moecomm::simulated_platform const& platform, std::int32_t ranks) {
  std::int32_t const D = topology_of(platform.spec(), ranks).num_domains();
  for (std::int32_t per_rank : {1, 2})
    for (std::int64_t tokens : {4096, 16384})
      for (double zipf : {0.0, 1.2}) {
        step_case c{models[0], ranks, per_rank, 2, tokens, zipf, 5, per_rank * D};
        c.micro_batches = 1;
        register_step(platform, c);
      }
}

//! Median and worst of |e| over `errors`.
std::pair<double, double> median_worst(std::vector<double> errors) {
  for (double& e : errors) e = std::fabs(e);
  std::sort(errors.begin(), errors.end());
  return errors.empty() ? std::pair{0.0, 0.0} : std::pair{errors[errors.size() / 2], errors.back()};
}

void print_summary(std::string const& platform) {
  int agree = 0;
  double mean_loss = 0, worst = 0;
  std::vector<double> errors, sync_errors;
  for (outcome const& o : outcomes) {
    agree += o.chosen == o.best ? 1 : 0;
    mean_loss += o.loss / static_cast<double>(outcomes.size());
    worst = std::max(worst, o.loss);
    errors.insert(errors.end(), o.errors.begin(), o.errors.end());
    sync_errors.insert(sync_errors.end(), o.sync_errors.begin(), o.sync_errors.end());
  }
  auto const [median, worst_error] = median_worst(errors);
  auto const [sync_median, sync_worst] = median_worst(sync_errors);
  std::printf("\npattern adviser on %s: first choice = simulated best in %d of %zu steps; loss (the iteration's MoE part), mean over "
              "all steps %.2f %%, worst %.2f %%; |predicted / simulated - 1| of %zu layer steps: median %.1f %%, worst %.1f %%; of %zu "
              "gradient syncs: median %.1f %%, worst %.1f %%\n",
              platform.c_str(), agree, outcomes.size(), 100 * mean_loss, 100 * worst, errors.size(), 100 * median, 100 * worst_error,
              sync_errors.size(), 100 * sync_median, 100 * sync_worst);
  for (outcome const& o : outcomes)
    if (o.chosen != o.best) std::printf("  %s: chose %s, best %s (+%.2f %%)\n", o.name.c_str(), o.chosen.c_str(), o.best.c_str(), 100 * o.loss);
}

//! The most (token, expert) slots `--advise` draws a routing of (tokens x top_k x MP groups):
//! 16 Mi; a few seconds, up to a minute with top_k 64 and a steep skew.
constexpr std::int64_t max_advise_slots = std::int64_t{1} << 24;

//! `--advise`: the ranking for one model and step described by flags, without simulating it. Every
//! flag is range-checked, and the flags are checked against each other and the platform before any
//! work: a bad one is a line naming it, its value and its range, and exit code 2.
int advise(moecomm::cluster_spec const& spec, int argc, char** argv) {
  char const* const program = "bench_pattern_adviser --advise";
  std::string model = "MoE-GPT";
  step_case c{models[1], std::min(spec.num_gpus(), 16), 16, 2, 4096, 1.2, 5};
  c.slots_per_rank = 0;  // twice --experts_per_rank unless given
  std::int32_t const sequence = transformer(c).sequence;
  moecomm_bench::flag_set flags(program, "bench_pattern_adviser [--platform=P] --advise [flags]",
                                "Ranks the expert-parallel patterns and their settings for one model and routing step on the\n"
                                "platform's first --ranks GPUs by predicted iteration time (models/pattern_adviser.hpp),\n"
                                "without simulating them.");
  flags.add("--model", "M", "MoE-GPT-S, MoE-GPT or MoE-GPT-L (FasterMoE's)", model, {"MoE-GPT-S", "MoE-GPT", "MoE-GPT-L"})
      .add("--ranks", "R", "the platform's first R GPUs, whole nodes", c.ranks, 1, spec.num_gpus())
      .add("--tokens", "T", "tokens per rank (per MP group), a multiple of the sequence, " + std::to_string(sequence), c.tokens, sequence,
           1 << 20)
      .add("--experts_per_rank", "L", "experts per rank: E = R x L", c.experts_per_rank, 1, 1 << 16)
      .add("--slots_per_rank", "S", "expert slots of memory per GPU, in [L, E]; 0: twice L", c.slots_per_rank, 0, 1 << 16)
      .add("--micro_batches", "N", "micro-batches per iteration", c.micro_batches, 1, 1 << 16)
      .add("--top_k", "K", "distinct experts per token, K <= E", c.top_k, 1, 64)
      .add("--zipf", "s", "skew over experts: P(i-th most popular) ~ 1/(i+1)^s; 0 is uniform", c.zipf, 0, 16)
      .add("--model_parallel", "M", "tensor-parallel group size (> 1: Parm's layouts), dividing R", c.model_parallel, 1, 1 << 16);
  flags.parse(argc, argv);
  for (model_size const& m : models)
    if (model == m.name) c.model = m;
  auto const str = [](auto v) { return std::to_string(v); };
  std::int32_t const gpn = spec.gpus_per_node;
  if (c.ranks % gpn != 0)
    moecomm_bench::usage_error(program, "--ranks = " + str(c.ranks) + " is not a multiple of " + spec.name + "'s " + str(gpn) +
                                            " GPUs per node (the ranks are whole nodes)");
  if (c.tokens % sequence != 0)
    moecomm_bench::usage_error(program, "--tokens = " + str(c.tokens) + " is not a multiple of the sequence, " + str(sequence) + " tokens");
  if (std::int64_t{c.ranks} * c.experts_per_rank > (1 << 16))
    moecomm_bench::usage_error(program, "--ranks x --experts_per_rank = " + str(std::int64_t{c.ranks} * c.experts_per_rank) +
                                            " experts must be in [1, " + str(1 << 16) + "]");
  if (c.slots_per_rank == 0) c.slots_per_rank = std::min(2 * c.experts_per_rank, c.experts());
  if (c.slots_per_rank < c.experts_per_rank || c.slots_per_rank > c.experts())
    moecomm_bench::usage_error(program, "--slots_per_rank = " + str(c.slots_per_rank) + " must be in [--experts_per_rank = " +
                                            str(c.experts_per_rank) + ", experts = " + str(c.experts()) + "]");
  if (c.top_k > c.experts())
    moecomm_bench::usage_error(program, "--top_k = " + str(c.top_k) + " must be in [1, experts = " + str(c.experts()) +
                                            "]: each token picks distinct experts");
  if (c.ranks % c.model_parallel != 0)
    moecomm_bench::usage_error(program, "--model_parallel = " + str(c.model_parallel) + " does not divide --ranks = " + str(c.ranks));
  if (c.tokens * c.top_k * (c.ranks / c.model_parallel) > max_advise_slots)
    moecomm_bench::usage_error(program, "--tokens x --top_k x MP groups = " + str(c.tokens * c.top_k * (c.ranks / c.model_parallel)) +
                                            " slots must be in [1, " + str(max_advise_slots) + "]");
  std::optional<moecomm::pattern_adviser> adviser;
  std::vector<moecomm::pattern_prediction> ranking;
  double host_us = 0;
  try {
    adviser.emplace(adviser_for(spec, c));  // first: it refuses what the model cannot run (Parm's groups, say)
    auto const routing = routing_of(c);
    auto const start = std::chrono::steady_clock::now();
    ranking = adviser->rank(views(routing));
    host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  } catch (moecomm::error const& e) {
    moecomm_bench::usage_error(program, e.what());  // a combination the checks above let through
  }
  moecomm::iteration_model const& it = adviser->iteration();
  std::printf("pattern adviser: %s (%s), first %d GPUs;\n%s (12 blocks, all MoE, H %lld, experts H->2H->H fp32), %d experts, "
              "%d expert slots of memory per GPU, top-%d, Zipf(%g), %d micro-batches of %lld tokens per %s.\nPredicted from the platform's figures alone "
              "(a model, not a measurement; %.0f us of host time). Per iteration, the rest of the model: %.2f ms.\n\n",
              spec.name.c_str(), spec.source.c_str(), c.ranks, c.model.name, static_cast<long long>(c.model.hidden), c.experts(),
              adviser->slots(), c.top_k, c.zipf, c.micro_batches, static_cast<long long>(c.tokens),
              c.model_parallel > 1 ? ("MP group of " + std::to_string(c.model_parallel) + " GPUs").c_str() : "rank", host_us,
              1e3 * it.dense_seconds(c.experts_per_rank * 4.0 * double(c.model.hidden) * double(c.model.hidden)));
  std::printf("  %-20s %-18s %-14s %8s %11s %11s %11s %11s %11s %12s %8s\n", "pattern", "setting", "placement", "replicas", "layer step",
              "exchange", "experts", "replicas", "grad sync", "iteration", "speedup");
  // The strongest baseline: plain expert parallelism (Megatron's EP x EDP included) with its
  // fastest exchange and EP size, no smart schedule; with model parallelism DeepSpeed-MoE's
  // fastest layout (`drop_tokens` when whole experts fit).
  auto const is_baseline = [&](moecomm::pattern_prediction const& p) {
    if (c.model_parallel > 1) return p.pattern == "drop_tokens" || p.pattern == "deepspeed_mp";
    return (p.pattern == "expert_parallel" || p.pattern == "expert_data_parallel") && p.setting.rfind("smart_schedule", 0) != 0;
  };
  moecomm::pattern_prediction const* baseline = nullptr;
  for (auto const& p : ranking)
    if (is_baseline(p) && baseline == nullptr) baseline = &p;
  for (auto const& p : ranking)
    std::printf("  %-20s %-18s %-14s %8d %8.2f ms %8.2f ms %8.2f ms %8.2f ms %8.2f ms %9.2f ms %7.2fx\n", p.pattern.c_str(), p.setting.c_str(),
                p.placement.empty() ? "-" : p.placement.c_str(), p.replicated, 1e3 * p.layer_seconds, 1e3 * p.exchange_seconds,
                1e3 * p.compute_seconds, 1e3 * p.replica_seconds, 1e3 * p.gradient_sync_seconds, 1e3 * p.iteration_seconds,
                baseline->iteration_seconds / p.iteration_seconds);
  std::printf("\n  use: %s; speedup per iteration over the strongest baseline, %s (%s)\n", label(ranking.front()).c_str(),
              label(*baseline).c_str(), c.model_parallel > 1 ? "DeepSpeed-MoE's fastest layout" : "plain EP, its fastest exchange and EP size");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  moecomm_bench::take_contention_flag(argc, argv);
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "fastermoe-v100-pcie");
  if (moecomm_bench::take_flag(argc, argv, "--advise", "no") != "no") return advise(moecomm_bench::platform_spec(name), argc, argv);
  std::string const grid_name = moecomm_bench::take_choice_flag(argc, argv, "--grid", {"main", "holdout", "parm", "hybridep"});
  auto const ranks = static_cast<std::int32_t>(moecomm_bench::take_int_flag(argc, argv, "--ranks", 16, 1, moecomm::cluster_spec::max_gpus));
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  std::int32_t const R = std::min(ranks, platform.spec().num_gpus());
  if (grid_name == "parm") register_parm_grid(platform, R);
  else if (grid_name == "hybridep") register_hybridep_grid(platform, R);
  else register_grid(platform, grid_name == "holdout" ? holdout_grid : main_grid, R);
  return moecomm_bench::finish("bench_pattern_adviser", [&] { print_summary(platform.name()); });
}
