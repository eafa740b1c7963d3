// SPDX-License-Identifier: Apache-2.0
//! @file
//! The exchange adviser (`models/exchange_adviser.hpp`) against the simulation: over a grid of
//! routing steps on one platform, the adviser ranks `flat`, `hierarchical_2d`, `dedup_per_rank<flat>`
//! and `dedup_per_node` from the cluster's links alone; each is then simulated (the dispatcher's
//! `route`, `dispatch` and `combine`, dropless). Reported per step: whether the adviser's first
//! choice is the simulated fastest, and when it is not, how much slower the choice is.
//!
//!     bench_exchange_adviser [--platform=deepep-h800] [--grid=main|holdout]   the grid on that platform
//!     bench_exchange_adviser --platform=P --advise [--ranks=N --tokens=T --experts=E --top_k=K
//!         --hidden=H --bytes=B --zipf=S --max_nodes=M]     the ranking alone (no simulation)
//!
//! Grid: 2 and 4 nodes of the platform (as many as it has), two models (DeepSeek-V3-like: top-8 of
//! 256 experts, H = 7168 bf16; GShard-like: top-2 of 4 experts per rank, H = 2048 bf16), routed
//! uniformly, with Zipf skew over experts, or node-limited; `main`: 4096 and 512 tokens per rank,
//! Zipf(1.2), 2 nodes per token; `holdout`: 2048 and 256 tokens, Zipf(0.8), 3 nodes, another seed. Counters: `agree` (1 when the first choice is the simulated best),
//! `loss_pct` (the choice's simulated time over the best's, minus 1), `advise_us` (host time of the
//! ranking), and per algorithm `<name>_sim_ms` / `<name>_pred_ms` (route + dispatch + combine).
//! Times are simulated seconds (SimGrid 3.32, CM02): a model of the platform, not a measurement.

#include <moecomm/moecomm.hpp>
#include <moecomm/models/exchange_adviser.hpp>

#include "sim_harness.hpp"

#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace {

using backend = moecomm::simulated_backend<>;
constexpr std::int64_t real_hidden = 4;

struct step_case {
  std::int32_t ranks, experts, top_k;
  std::int64_t tokens;
  double hidden, element_bytes, zipf;
  std::int32_t max_nodes;  //!< > 0: node-limited routing over that many nodes per token
  std::string routing_name;
  std::uint32_t seed = 11;
};

//! The grid's free parameters: `main` (the one the model was checked on while it was written) and
//! `holdout` (other token counts, skew, node limit and seed, run only after the model was fixed).
struct grid {
  std::int64_t tokens[2];
  double zipf;
  std::int32_t max_nodes;
  std::uint32_t seed;
};
constexpr grid main_grid{{4096, 512}, 1.2, 2, 11}, holdout_grid{{2048, 256}, 0.8, 3, 23};

std::vector<moecomm_bench::rank_routing> make_routing(step_case const& c, std::int32_t gpus_per_node) {
  std::int32_t const nodes = c.ranks / gpus_per_node;
  if (c.max_nodes > 0) return moecomm_bench::node_limited_routing(c.ranks, c.tokens, c.top_k, c.experts, nodes, c.max_nodes, c.seed);
  return moecomm_bench::skewed_routing(c.ranks, c.tokens, c.top_k, c.experts, c.zipf, c.seed);
}

std::vector<moecomm::routing_view> views(std::vector<moecomm_bench::rank_routing> const& routing) {
  std::vector<moecomm::routing_view> v;
  for (auto const& r : routing) v.push_back(r.view());
  return v;
}

moecomm::topology first_gpus_topology(moecomm::cluster_spec const& spec, std::int32_t ranks) {
  return moecomm::topology(ranks, spec.gpus_per_node, std::min(spec.nodes_per_domain, ranks / spec.gpus_per_node));
}

//! Each algorithm's simulated route, dispatch and combine, by name.
std::map<std::string, moecomm_bench::exchange_times> simulate_all(moecomm::simulated_platform const& platform, step_case const& c,
                                                                  std::vector<moecomm_bench::rank_routing> const& routing) {
  backend const be(moecomm::host_backend{}, moecomm_bench::model_scale(c.hidden, 1, c.element_bytes, real_hidden, 1, sizeof(float)));
  std::map<std::string, moecomm_bench::exchange_times> sim;
  sim["flat"] = moecomm_bench::simulate_exchange<moecomm::flat>(platform, c.ranks, routing, c.experts, be, real_hidden);
  if (c.ranks > platform.gpus_per_node() && platform.gpus_per_node() > 1)
    sim["hierarchical_2d"] = moecomm_bench::simulate_exchange<moecomm::hierarchical_2d>(platform, c.ranks, routing, c.experts, be, real_hidden);
  sim["dedup_per_rank"] =
      moecomm_bench::simulate_exchange<moecomm::dedup_per_rank<moecomm::flat>>(platform, c.ranks, routing, c.experts, be, real_hidden);
  if (c.ranks > platform.gpus_per_node())
    sim["dedup_per_node"] = moecomm_bench::simulate_exchange<moecomm::dedup_per_node>(platform, c.ranks, routing, c.experts, be, real_hidden);
  return sim;
}

//! The adviser's byte counts equal what the dispatcher moved (scaled to the model's rows): between
//! nodes for every algorithm, inside nodes but for `hierarchical_2d` (which forwards inside them).
bool same_bytes(moecomm::exchange_prediction const& p, moecomm_bench::exchange_times const& t, double model_row) {
  double const scale = model_row / (real_hidden * sizeof(float));
  auto close = [](double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); };
  return close(p.inter_node_bytes, t.inter_bytes * scale) && (p.algorithm == "hierarchical_2d" || close(p.intra_node_bytes, t.intra_bytes * scale));
}

struct outcome {
  std::string name, chosen, best;
  double loss = 0;
};
std::vector<outcome> outcomes;

void register_grid(moecomm::simulated_platform const& platform, grid const& g) {
  moecomm::cluster_spec const& spec = platform.spec();
  std::int32_t const gpn = spec.gpus_per_node, gpus = spec.num_gpus();
  for (std::int32_t nodes : {2, 4}) {
    std::int32_t const ranks = nodes * gpn;
    if (ranks > gpus) continue;
    for (std::int64_t tokens : g.tokens)
      for (bool deepseek : {true, false})
        for (int routing = 0; routing < 3; ++routing) {
          if (routing == 2 && nodes <= g.max_nodes) continue;  // the node limit limits nothing
          step_case c{ranks, deepseek ? 256 : 4 * ranks, deepseek ? 8 : 2, tokens, deepseek ? 7168.0 : 2048.0, 2.0,
                      routing == 1 ? g.zipf : 0.0, routing == 2 ? g.max_nodes : 0,
                      routing == 0 ? "uniform" : routing == 1 ? "zipf" : "node_limited", g.seed};
          std::string const name = "advise/R:" + std::to_string(ranks) + "/T:" + std::to_string(tokens) +
                                   (deepseek ? "/top8of256/H:7168" : "/top2of" + std::to_string(c.experts) + "/H:2048") +
                                   "/routing:" + c.routing_name;
          moecomm_bench::register_simulated(name, benchmark::kMillisecond, [&platform, c, name](benchmark::State& state) {
            auto const routing = make_routing(c, platform.gpus_per_node());
            moecomm::exchange_adviser const adviser(platform.spec(), first_gpus_topology(platform.spec(), c.ranks));
            auto const start = std::chrono::steady_clock::now();
            auto const ranking = adviser.rank(views(routing), c.experts, c.hidden * c.element_bytes);
            double const advise_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
            std::map<std::string, moecomm_bench::exchange_times> times;
            for (auto _ : state) {
              times = simulate_all(platform, c, routing);
              state.SetIterationTime(times.at(ranking.front().algorithm).dispatch + times.at(ranking.front().algorithm).combine);
            }
            std::map<std::string, double> sim;
            for (auto const& p : ranking) {
              moecomm_bench::exchange_times const& t = times.at(p.algorithm);
              sim[p.algorithm] = t.dispatch + t.combine;
              if (!same_bytes(p, t, c.hidden * c.element_bytes))
                return moecomm_bench::fail(state, name + ": the adviser's bytes for " + p.algorithm + " differ from the dispatcher's");
            }
            std::string best = sim.begin()->first;
            for (auto const& [algorithm, seconds] : sim)
              if (seconds < sim.at(best)) best = algorithm;
            double const loss = sim.at(ranking.front().algorithm) / sim.at(best) - 1;
            state.counters["agree"] = ranking.front().algorithm == best ? 1 : 0;
            state.counters["loss_pct"] = 100 * loss;
            state.counters["advise_us"] = advise_us;
            for (auto const& p : ranking) {
              state.counters[p.algorithm + "_pred_ms"] = p.seconds() * 1e3;
              state.counters[p.algorithm + "_sim_ms"] = sim.at(p.algorithm) * 1e3;
            }
            state.SetLabel("chose " + ranking.front().algorithm + ", best " + best);
            outcomes.push_back({name, ranking.front().algorithm, best, loss});
          });
        }
  }
}

void print_summary(std::string const& platform) {
  int agree = 0;
  double mean_loss = 0, worst = 0;
  for (outcome const& o : outcomes) {
    agree += o.chosen == o.best ? 1 : 0;
    mean_loss += o.loss / static_cast<double>(outcomes.size());
    worst = std::max(worst, o.loss);
  }
  std::printf("\nexchange adviser on %s: first choice = simulated best in %d of %zu steps; "
              "loss when not, mean over all steps %.2f %%, worst %.2f %%\n",
              platform.c_str(), agree, outcomes.size(), 100 * mean_loss, 100 * worst);
  for (outcome const& o : outcomes)
    if (o.chosen != o.best) std::printf("  %s: chose %s, best %s (+%.2f %%)\n", o.name.c_str(), o.chosen.c_str(), o.best.c_str(), 100 * o.loss);
}

//! The most (token, expert) slots `--advise` draws a routing of (tokens x top_k x ranks): 16 Mi,
//! the default's 16 times; a few seconds, up to a minute with top_k 64 and a steep skew.
constexpr std::int64_t max_advise_slots = std::int64_t{1} << 24;

//! `--advise`: the ranking for one step described by flags, without simulating it. Every flag is
//! range-checked, and the flags are checked against each other and the platform before any work: a
//! bad one is a line naming it, its value and its range, and exit code 2.
int advise(moecomm::cluster_spec const& spec, int argc, char** argv) {
  char const* const program = "bench_exchange_adviser --advise";
  step_case c{};
  c.ranks = std::min(spec.num_gpus(), 4 * spec.gpus_per_node);
  c.tokens = 4096;
  c.experts = 256;
  c.top_k = 8;
  c.hidden = 7168;
  c.element_bytes = 2;
  c.zipf = 0;
  c.max_nodes = 0;
  moecomm_bench::flag_set flags(program, "bench_exchange_adviser [--platform=P] --advise [flags]",
                                "Ranks the dispatcher's all-to-all exchanges for one routing step on the platform's first\n"
                                "--ranks GPUs (models/exchange_adviser.hpp), without simulating them.");
  flags.add("--ranks", "R", "the platform's first R GPUs, whole nodes", c.ranks, 1, spec.num_gpus())
      .add("--tokens", "T", "tokens per rank", c.tokens, 1, 1 << 20)
      .add("--experts", "E", "experts, a multiple of R", c.experts, 1, 1 << 16)
      .add("--top_k", "K", "distinct experts per token, K <= E", c.top_k, 1, 64)
      .add("--hidden", "H", "elements per token row", c.hidden, 1, 1 << 20)
      .add("--bytes", "B", "bytes per element", c.element_bytes, 0.125, 16)
      .add("--zipf", "s", "skew over experts: P(i-th most popular) ~ 1/(i+1)^s; 0 is uniform", c.zipf, 0, 16)
      .add("--max_nodes", "M", "> 0: node-limited routing, each token on M of the R / GPUs-per-node nodes", c.max_nodes, 0, 1 << 16);
  flags.parse(argc, argv);
  auto const str = [](auto v) { return std::to_string(v); };
  std::int32_t const gpn = spec.gpus_per_node;
  if (c.ranks % gpn != 0)
    moecomm_bench::usage_error(program, "--ranks = " + str(c.ranks) + " is not a multiple of " + spec.name + "'s " + str(gpn) +
                                            " GPUs per node (the ranks are whole nodes)");
  if (c.experts % c.ranks != 0)
    moecomm_bench::usage_error(program, "--experts = " + str(c.experts) + " is not a multiple of --ranks = " + str(c.ranks));
  if (c.top_k > c.experts)
    moecomm_bench::usage_error(program, "--top_k = " + str(c.top_k) + " must be in [1, --experts = " + str(c.experts) +
                                            "]: each token picks distinct experts");
  std::int32_t const nodes = c.ranks / gpn;
  if (c.max_nodes > nodes)
    moecomm_bench::usage_error(program, "--max_nodes = " + str(c.max_nodes) + " must be in [0, the " + str(nodes) + " nodes of --ranks = " +
                                            str(c.ranks) + "]");
  if (c.max_nodes > 0 && c.top_k > c.max_nodes * (c.experts / nodes))
    moecomm_bench::usage_error(program, "--top_k = " + str(c.top_k) + " must be in [1, --max_nodes x experts per node = " +
                                            str(c.max_nodes * (c.experts / nodes)) + "]: each token picks distinct experts on its nodes");
  if (c.tokens * c.top_k * c.ranks > max_advise_slots)
    moecomm_bench::usage_error(program, "--tokens x --top_k x --ranks = " + str(c.tokens * c.top_k * c.ranks) + " slots must be in [1, " +
                                            str(max_advise_slots) + "]");
  std::vector<moecomm::exchange_prediction> ranking;
  try {
    moecomm::exchange_adviser const adviser(spec, first_gpus_topology(spec, c.ranks));
    auto const routing = make_routing(c, spec.gpus_per_node);
    ranking = adviser.rank(views(routing), c.experts, c.hidden * c.element_bytes);
  } catch (moecomm::error const& e) {
    moecomm_bench::usage_error(program, e.what());  // a combination the checks above let through
  }
  char routing_text[64];
  if (c.max_nodes > 0) std::snprintf(routing_text, sizeof routing_text, "node-limited to %d nodes per token", c.max_nodes);
  else std::snprintf(routing_text, sizeof routing_text, "Zipf(%g) over experts", c.zipf);
  std::printf("exchange adviser: %s (%s), first %d GPUs; %lld tokens per rank, top-%d of %d experts, rows of %.0f B;\n"
              "routing %s. Predicted from the links alone (a model, not a measurement):\n\n",
              spec.name.c_str(), spec.source.c_str(), c.ranks, static_cast<long long>(c.tokens), c.top_k, c.experts,
              c.hidden * c.element_bytes, routing_text);
  std::printf("  %-16s %10s %10s %10s %10s %14s %14s\n", "algorithm", "total", "route", "dispatch", "combine", "inter-node MB", "intra-node MB");
  for (auto const& p : ranking)
    std::printf("  %-16s %7.3f ms %7.3f ms %7.3f ms %7.3f ms %14.1f %14.1f\n", p.algorithm.c_str(), p.seconds() * 1e3, p.route_seconds * 1e3,
                p.dispatch_seconds * 1e3, p.combine_seconds * 1e3, p.inter_node_bytes / 1e6, p.intra_node_bytes / 1e6);
  std::printf("\n  use: %s\n", ranking.front().algorithm.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  moecomm_bench::take_contention_flag(argc, argv);
  std::string const name = moecomm_bench::take_flag(argc, argv, "--platform=", "deepep-h800");
  if (moecomm_bench::take_flag(argc, argv, "--advise", "no") != "no") return advise(moecomm_bench::platform_spec(name), argc, argv);
  std::string const grid_name = moecomm_bench::take_choice_flag(argc, argv, "--grid", {"main", "holdout"});
  if (!moecomm_bench::start(argc, argv)) return 1;
  moecomm::simulated_platform const& platform = moecomm_bench::use_platform(name);
  register_grid(platform, grid_name == "holdout" ? holdout_grid : main_grid);
  return moecomm_bench::finish("bench_exchange_adviser", [&] { print_summary(platform.name()); });
}
