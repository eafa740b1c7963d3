// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What every moecomm benchmark shares: the start and the end of `main`, failing a benchmark when
//! its correctness check fails (and the process with it), a deterministic generator and the
//! routings and count matrices drawn from it, and for the benchmarks over in-process ranks their
//! node layouts, the run of every rank, the rank-0-driven timed loop and its barrier floor.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace moecomm_bench {

//! One line of the output's context block: (key, value).
using context_line = std::pair<std::string, std::string>;

//! The start of `main`: takes Google Benchmark's flags out of argv, then records `context`. False
//! when argv holds a flag that nobody took out (Google Benchmark reports it): `main` returns 1.
inline bool start(int& argc, char** argv, std::initializer_list<context_line> context = {}) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return false;
  for (context_line const& line : context) benchmark::AddCustomContext(line.first, line.second);
  return true;
}

//! Set by `fail`; `finish` turns it into a non-zero exit code.
inline std::atomic<bool> g_failed{false};

//! Marks the benchmark as failed with `message` (kept alive: SkipWithError keeps the pointer on
//! some versions of Google Benchmark).
inline void fail(benchmark::State& state, std::string message) {
  static std::deque<std::string> messages;
  g_failed = true;
  messages.push_back(std::move(message));
  std::fprintf(stderr, "CHECK FAILED: %s\n", messages.back().c_str());
  state.SkipWithError(messages.back().c_str());
}

//! Runs the registered benchmarks, then `after_run()` (a summary table, a CSV) when any ran;
//! returns `main`'s exit code: non-zero when the filter matched nothing or a correctness check failed.
template <class AfterRun>
int finish(char const* program, AfterRun&& after_run) {
  std::size_t const ran = benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (ran == 0) {
    std::fprintf(stderr, "%s: no benchmark matched the filter\n", program);
    return 1;
  }
  after_run();
  if (g_failed) {
    std::fprintf(stderr, "%s: a correctness check failed\n", program);
    return 1;
  }
  return 0;
}
inline int finish(char const* program) {
  return finish(program, [] {});
}

//! The whole `main` of a benchmark that prints no summary: `start` with `context`,
//! `register_benchmarks()`, then `finish`.
template <class Register>
int run(int& argc, char** argv, char const* program, std::initializer_list<context_line> context,
        Register&& register_benchmarks) {
  if (!start(argc, argv, context)) return 1;
  register_benchmarks();
  return finish(program);
}

//! The seed of every benchmark's generator: the same inputs in every run.
inline constexpr std::uint64_t kSeed = 0x6d6f65636f6d6dULL;  // "moecomm"

//! splitmix64: deterministic inputs, the same on every machine.
struct splitmix64 {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  //! Uniform in [-1, 1) from the top 24 of 32 random bits.
  static float symmetric(std::uint32_t bits) {
    return static_cast<float>(static_cast<std::int32_t>(bits >> 8) - (1 << 23)) * 0x1p-23f;
  }
  float symmetric() { return symmetric(static_cast<std::uint32_t>(next() >> 32)); }
  //! Uniform in (0, 1].
  float unit() { return static_cast<float>((next() >> 40) + 1) * 0x1p-24f; }
  std::uint32_t below(std::uint32_t n) { return static_cast<std::uint32_t>((next() >> 32) * n >> 32); }
};

//! Uniform routing, `[T][K]` into `idx` and `weights` (resized): each of `tokens` tokens picks
//! `top_k` distinct experts of `experts` (a partial Fisher-Yates shuffle) and a weight in (0, 1]
//! for each, then its weights are divided by their sum.
inline void uniform_routing(splitmix64& rng, std::int64_t tokens, std::int32_t top_k, std::int32_t experts,
                            std::vector<std::int32_t>& idx, std::vector<float>& weights) {
  idx.resize(static_cast<std::size_t>(tokens * top_k));
  weights.resize(idx.size());
  std::vector<std::int32_t> order(static_cast<std::size_t>(experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    float sum = 0.0f;
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::uint32_t const j = static_cast<std::uint32_t>(k) + rng.below(static_cast<std::uint32_t>(experts - k));
      std::swap(order[static_cast<std::size_t>(k)], order[j]);
      idx[static_cast<std::size_t>(t * top_k + k)] = order[static_cast<std::size_t>(k)];
      float const w = rng.unit();
      weights[static_cast<std::size_t>(t * top_k + k)] = w;
      sum += w;
    }
    for (std::int32_t k = 0; k < top_k; ++k) weights[static_cast<std::size_t>(t * top_k + k)] /= sum;
  }
}

//! `[R][E]` token counts: each of `ranks` ranks routes `tokens_per_rank` tokens to 2 distinct
//! experts of `experts`, drawn from Zipf(`zipf`) over a popularity order that is a shuffle of the
//! experts (so the hot experts sit on different ranks). The order is drawn first, all from `rng`.
inline std::vector<std::int64_t> zipf_top2_counts(std::int32_t ranks, std::int32_t experts, std::int32_t tokens_per_rank,
                                                  double zipf, splitmix64& rng) {
  auto const E = static_cast<std::size_t>(experts);
  std::vector<std::int32_t> expert_at_rank(E);  // the popularity order
  std::iota(expert_at_rank.begin(), expert_at_rank.end(), 0);
  for (std::size_t i = E - 1; i > 0; --i) std::swap(expert_at_rank[i], expert_at_rank[rng.below(static_cast<std::uint32_t>(i + 1))]);
  std::vector<double> cdf(E);
  double total = 0;
  for (std::size_t i = 0; i < E; ++i) cdf[i] = total += 1.0 / std::pow(static_cast<double>(i + 1), zipf);
  for (double& p : cdf) p /= total;
  auto const draw = [&] {
    auto const i = static_cast<std::size_t>(std::lower_bound(cdf.begin(), cdf.end(), rng.unit()) - cdf.begin());
    return expert_at_rank[std::min(i, E - 1)];  // unit() may round above the last cdf entry
  };

  std::vector<std::int64_t> counts(static_cast<std::size_t>(ranks) * E, 0);
  for (std::int32_t s = 0; s < ranks; ++s) {
    std::int64_t* row = counts.data() + static_cast<std::size_t>(s) * E;
    for (std::int32_t t = 0; t < tokens_per_rank; ++t) {
      std::int32_t const first = draw();
      std::int32_t second = draw();
      while (second == first) second = draw();
      ++row[first];
      ++row[second];
    }
  }
  return counts;
}

//! R in-process ranks as `nodes` x `per_node` (node-major: rank r is on node r / per_node).
struct layout {
  std::int32_t nodes, per_node;
  [[nodiscard]] std::int32_t ranks() const { return nodes * per_node; }
  [[nodiscard]] std::string name() const {
    return "R:" + std::to_string(ranks()) + "/" + std::to_string(nodes) + "x" + std::to_string(per_node);
  }
};

//! The node layouts of the benchmarks of one collective over in-process ranks: one node, and two
//! nodes of two and of four ranks.
inline constexpr layout kCollectiveLayouts[] = {{1, 2}, {2, 2}, {2, 4}};

//! The context line of the benchmarks whose ranks are threads of this process.
inline context_line const in_process_ranks{"ranks", "in-process (inproc_world): one thread per rank"};

//! Runs `per_rank(comm)` on every rank of a `World` of `ranks` ranks (`moecomm::inproc_world`: one
//! thread each), which waits at most `timeout` in a collective. Fails the benchmark, and returns
//! false, when a rank throws or leaves a message in its entry of `errors`.
template <class World, class PerRank>
bool run_ranks(benchmark::State& state, std::int32_t ranks, std::chrono::seconds timeout,
               std::vector<std::string> const& errors, PerRank&& per_rank) {
  try {
    World const world(ranks, timeout);
    world.run(std::forward<PerRank>(per_rank));
  } catch (std::exception const& e) {
    fail(state, std::string("exception: ") + e.what());
    return false;
  }
  for (std::string const& e : errors)
    if (!e.empty()) {
      fail(state, e);
      return false;
    }
  return true;
}

//! Runs `step()` on every rank once per benchmark iteration, between two barriers. Rank 0 owns
//! `state`, times each iteration on its clock and records it in `seconds`; when its loop ends it
//! sets `stop`, which the other ranks see after the next barrier.
template <class Comm, class Step>
void timed_loop(benchmark::State& state, Comm& comm, std::atomic<bool>& stop, std::vector<double>& seconds,
                Step&& step) {
  if (comm.rank() == 0) {
    for (auto _ : state) {
      comm.barrier();
      auto const start = std::chrono::steady_clock::now();
      step();
      comm.barrier();
      double const t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      state.SetIterationTime(t);
      seconds.push_back(t);
    }
    stop.store(true, std::memory_order_relaxed);  // published to the others by the barrier below
    comm.barrier();
  } else {
    for (;;) {
      comm.barrier();
      if (stop.load(std::memory_order_relaxed)) break;
      step();
      comm.barrier();
    }
  }
}

//! The mean of `seconds` (0 when empty): `timed_loop`'s mean iteration.
inline double mean(std::vector<double> const& seconds) {
  double s = 0.0;
  for (double x : seconds) s += x;
  return seconds.empty() ? 0.0 : s / static_cast<double>(seconds.size());
}

//! The synchronisation floor: a `timed_loop` iteration with both barriers and no operation, on
//! `ranks` ranks of a `World`.
template <class World>
void bm_barrier(benchmark::State& state, std::int32_t ranks) {
  std::vector<double> seconds;
  std::atomic<bool> stop{false};
  run_ranks<World>(state, ranks, std::chrono::seconds(120), {},
                   [&](auto comm) { timed_loop(state, comm, stop, seconds, [] {}); });
}

//! Registers `barrier/R:n` (`bm_barrier`) for the ranks of each of `layouts`.
template <class World, std::size_t N>
void register_barriers(layout const (&layouts)[N]) {
  for (layout const& lay : layouts)
    benchmark::RegisterBenchmark(("barrier/R:" + std::to_string(lay.ranks())).c_str(), bm_barrier<World>, lay.ranks())
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
}

}  // namespace moecomm_bench
