// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! What every moecomm benchmark shares: failing a benchmark when its correctness check fails (and
//! the process with it), a deterministic generator, the node layouts of the in-process benchmarks,
//! the rank-0-driven timed loop, and the end of `main`.

#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace moecomm_bench {

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

//! Runs the registered benchmarks; returns `main`'s exit code: non-zero when the filter matched
//! nothing or a correctness check failed.
inline int finish(char const* program) {
  std::size_t const ran = benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (ran == 0) {
    std::fprintf(stderr, "%s: no benchmark matched the filter\n", program);
    return 1;
  }
  if (g_failed) {
    std::fprintf(stderr, "%s: a correctness check failed\n", program);
    return 1;
  }
  return 0;
}

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

//! R in-process ranks as `nodes` x `per_node` (node-major: rank r is on node r / per_node).
struct layout {
  std::int32_t nodes, per_node;
  [[nodiscard]] std::int32_t ranks() const { return nodes * per_node; }
  [[nodiscard]] std::string name() const {
    return "R:" + std::to_string(ranks()) + "/" + std::to_string(nodes) + "x" + std::to_string(per_node);
  }
};

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

}  // namespace moecomm_bench
