// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The memcpy reference every host benchmark compares against: this machine's own single-thread
//! `std::memcpy` bandwidth, measured in the same process before any benchmark runs, so that ratios
//! taken against it do not depend on how busy or fast the machine happened to be that day.
//!
//! Measurement: `std::memcpy` of 512 MiB into another 512 MiB buffer, both written beforehand
//! (no page faults in the timed copies), one warm-up copy, then the best of 5 copies. The result
//! counts 2 x size bytes per copy (read + write), the convention `bench_permute` uses for its own
//! byte counts. Benchmarks that count bytes *delivered* (each byte once, as nccl-tests' algbw and
//! busbw do) compare with `copy_bytes_per_s()`, half of it: the bytes one memcpy thread delivers
//! per second.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace moecomm_bench {

struct memcpy_reference {
  double rw_bytes_per_s = 0.0;  //!< read + write bytes per second (2 x size per copy)

  //! Bytes one memcpy thread delivers per second (each byte counted once).
  [[nodiscard]] double copy_bytes_per_s() const { return rw_bytes_per_s / 2.0; }
};

//! Best of 5 `std::memcpy` of `bytes` (512 MiB by default) into a pre-touched buffer.
inline memcpy_reference measure_memcpy_reference(std::size_t bytes = std::size_t{512} << 20) {
  std::vector<std::uint64_t> src(bytes / sizeof(std::uint64_t)), dst(bytes / sizeof(std::uint64_t));
  std::uint64_t s = 0x6d656d637079ULL;  // splitmix64: every page of src gets distinct, non-zero data
  for (std::uint64_t& w : src) {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    w = z ^ (z >> 31);
  }
  std::size_t const n = src.size() * sizeof(std::uint64_t);
  std::memset(dst.data(), 0, n);
  std::memcpy(dst.data(), src.data(), n);  // warm-up
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    auto const start = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), n);
    benchmark::ClobberMemory();
    double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::min(best, seconds);
  }
  benchmark::DoNotOptimize(dst.data());
  return {2.0 * static_cast<double>(n) / best};
}

//! Records the reference in the benchmark's context block (`memcpy_GBps`, `memcpy_method`).
inline void add_memcpy_context(memcpy_reference const& ref) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", ref.rw_bytes_per_s / 1e9);
  benchmark::AddCustomContext("memcpy_GBps", buf);
  benchmark::AddCustomContext("memcpy_method", "std::memcpy 512 MiB, best of 5, 2 x size bytes (read + write)");
}

//! Measures the reference and records it in the context block: what `main` does before it
//! registers the benchmarks that compare with it.
inline memcpy_reference use_memcpy_reference() {
  memcpy_reference const ref = measure_memcpy_reference();
  add_memcpy_context(ref);
  return ref;
}

}  // namespace moecomm_bench
