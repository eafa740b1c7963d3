// SPDX-License-Identifier: Apache-2.0
//! @file
//! One MoE layer step of `expert_parallel_layer` over in-process ranks (`inproc_world`: one thread
//! per rank): the forward (route + dispatch + experts + combine) and the forward plus backward,
//! for T = 4096 tokens per rank, H = 4096, K = 2, E = 16, float, on R = 4 (2 nodes x 2) and
//! R = 8 (2 x 4), with identity experts (each expert copies its rows, and its backward copies the
//! gradient), dropless and `capacity<drop_by_position>{1.0}`, for each all-to-all algorithm and
//! the smart schedule.
//!
//! Timing is that of bench_alltoall (see bench/collectives/alltoall_bench.cpp): the ranks' threads start
//! once per run and rank 0 drives Google Benchmark's loop; each iteration is
//! barrier; step on every rank; barrier, timed on rank 0 with steady_clock (`UseManualTime`).
//! Untimed steps run first (one, or two with the cache on). Nothing is hoisted out of the step:
//! `route` (capacity, plan, count exchange) runs every iteration. Two allocators (see "an optional
//! caching host allocator"):
//!   layer<malloc>  the default allocation functions. The layer and dispatcher keep their row
//!                  buffers between steps (since the FasterMoE work), so only what is still made per
//!                  step (the plan's arrays, hierarchical_2d's staging) is mmap'ed and faulted in;
//!   layer<cached>  freed blocks of >= 1 MiB are kept and reused for the same size, as a caching
//!                  allocator would: no page faults in steady state.
//!
//! Bytes: "payload" is what a rank's all-to-alls deliver per step, its own block included (as
//! nccl-tests' all-to-all "size"): rows it dispatches (kept slots) plus rows it returns in the
//! combine (rows its experts received), times H * 4 bytes; the backward repeats both. It is the
//! mean over ranks. GBps = payload / step time, and of_memcpy compares that with the bytes one
//! memcpy thread delivers per second (bench/support/memcpy_reference.hpp). The step moves more
//! than that locally (permute, sort_chunks, the expert copies, unpermute and their backward).
//!
//! Correctness: after the timed loop every rank checks its whole output, bit for bit, against
//! out[t] = fma over kept k (ascending, from +0.0) of w[t][k] * x[t] (identity experts), its input
//! gradient against d_x[t] = fp32 sum over kept k of (w[t][k] * d_out[t]) and its weight gradient
//! against <x[t], d_out[t]> (0 for a dropped slot) within fp32 tolerance; and the dropped-slot
//! count against a direct count (first C slots of each expert in (t, k) order survive). Outputs
//! are poisoned after the untimed steps. A mismatch fails the benchmark and main() returns non-zero.

#include <moecomm/moecomm.hpp>

#include "../support/inproc_ranks.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

// ---- an optional caching host allocator ------------------------------------------------------
//
// `host_backend` allocates through `host_allocator`, i.e. `::operator new(bytes, align_val_t{64})`,
// and before the layer kept its row buffers it allocated them per call (128 MiB each here; the plan
// and hierarchical_2d's staging still are). glibc serves blocks above
// its mmap threshold (which it caps at 32 MiB) with mmap and unmaps them when they are freed, so
// every step faults every page of them in again. This binary replaces the aligned `operator new` /
// `operator delete` (the only allocation functions host_allocator uses) so that the `layer<cached>`
// benchmarks can keep freed blocks of 1 MiB or more and hand them out again for the same (size,
// alignment): what a framework's caching allocator, or a reused workspace, would give. With the
// cache off (`layer<malloc>`, and everything outside the cached benchmarks) they behave as the
// default ones: `std::aligned_alloc` and `std::free`, plus a header that records the size.

namespace {

struct block_cache {
  std::mutex mutex;
  bool enabled = false;                                            // guarded by mutex
  std::multimap<std::pair<std::size_t, std::size_t>, void*> free;  // (size, alignment) -> user pointer
};

block_cache& the_cache() {
  static auto* cache = new block_cache;  // never destroyed: deletes may run during static destruction
  return *cache;
}

constexpr std::size_t kCacheMinBytes = std::size_t{1} << 20;

std::size_t header_bytes(std::align_val_t al) {  // keeps the user pointer aligned
  return std::max(static_cast<std::size_t>(al), sizeof(std::size_t));
}

void release(void* user, std::align_val_t al) {
  std::free(static_cast<char*>(user) - header_bytes(al));
}

//! Turns the cache on or off; off also frees every cached block.
void set_caching(bool on) {
  block_cache& c = the_cache();
  std::multimap<std::pair<std::size_t, std::size_t>, void*> drop;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.enabled = on;
    if (!on) drop.swap(c.free);
  }
  for (auto const& [key, user] : drop) release(user, static_cast<std::align_val_t>(key.second));
}

}  // namespace

void* operator new(std::size_t size, std::align_val_t al) {
  std::size_t const header = header_bytes(al);
  if (size >= kCacheMinBytes) {
    block_cache& c = the_cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.enabled) {
      auto const it = c.free.find({size, static_cast<std::size_t>(al)});
      if (it != c.free.end()) {
        void* const user = it->second;
        c.free.erase(it);
        return user;
      }
    }
  }
  std::size_t const a = static_cast<std::size_t>(al);
  std::size_t const total = (size + header + a - 1) / a * a;
  void* const raw = std::aligned_alloc(a, total);
  if (raw == nullptr) throw std::bad_alloc();
  char* const user = static_cast<char*>(raw) + header;
  std::memcpy(user - sizeof(std::size_t), &size, sizeof size);
  return user;
}

void operator delete(void* p, std::align_val_t al) noexcept {
  if (p == nullptr) return;
  std::size_t size;
  std::memcpy(&size, static_cast<char*>(p) - sizeof(std::size_t), sizeof size);
  if (size >= kCacheMinBytes) {
    block_cache& c = the_cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.enabled) {
      try {
        c.free.emplace(std::make_pair(size, static_cast<std::size_t>(al)), p);
        return;
      } catch (...) {  // no memory for the map node: free the block instead
      }
    }
  }
  release(p, al);
}

void* operator new[](std::size_t size, std::align_val_t al) { return ::operator new(size, al); }
void operator delete[](void* p, std::align_val_t al) noexcept { ::operator delete(p, al); }
void operator delete(void* p, std::size_t, std::align_val_t al) noexcept { ::operator delete(p, al); }
void operator delete[](void* p, std::size_t, std::align_val_t al) noexcept { ::operator delete(p, al); }

namespace {

using namespace moecomm_bench;

constexpr std::int64_t kTokens = 4096;  // per rank
constexpr std::int64_t kHidden = 4096;
constexpr std::int32_t kTopK = 2;
constexpr std::int32_t kNumExperts = 16;
constexpr double kCapacityFactor = 1.0;

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// ---- cases and data ----------------------------------------------------------------------------

constexpr layout kLayouts[] = {{2, 2}, {2, 4}};

using rows_t = moecomm::host_backend::buffer_type<float>;

//! One rank's inputs (routing, x, d_out), its outputs (pre-touched), and which slots survive the
//! capacity policy.
struct rank_data {
  std::vector<std::int32_t> idx;  // [T][K] uniform: K distinct experts of E
  std::vector<float> weights;     // [T][K] positive, each token's sum is 1
  std::vector<std::uint8_t> kept_at_capacity;  // [T][K] 1 when the slot survives capacity<drop_by_position>
  std::int64_t dropped_at_capacity = 0;
  rows_t x, d_out, out, d_x;  // [T][H]
  std::vector<float> d_w;     // [T][K]

  rank_data() : x(be.allocate<float>(kTokens * kHidden)), d_out(be.allocate<float>(kTokens * kHidden)),
                out(be.allocate<float>(kTokens * kHidden)), d_x(be.allocate<float>(kTokens * kHidden)),
                d_w(static_cast<std::size_t>(kTokens * kTopK)) {}
};

void make_rank(rank_data& d, std::int32_t rank, std::int64_t capacity) {
  splitmix64 rng{kSeed ^ (static_cast<std::uint64_t>(rank + 1) * 0x100000001b3ULL)};
  std::int64_t const slots = kTokens * kTopK;
  uniform_routing(rng, kTokens, kTopK, kNumExperts, d.idx, d.weights);
  // drop_by_position: the first C slots of each expert, in (t, k) order, survive.
  std::vector<std::int64_t> seen(kNumExperts, 0);
  d.kept_at_capacity.resize(static_cast<std::size_t>(slots));
  d.dropped_at_capacity = 0;
  for (std::int64_t s = 0; s < slots; ++s) {
    bool const kept = seen[static_cast<std::size_t>(d.idx[static_cast<std::size_t>(s)])]++ < capacity;
    d.kept_at_capacity[static_cast<std::size_t>(s)] = kept ? 1 : 0;
    d.dropped_at_capacity += kept ? 0 : 1;
  }
  for (std::int64_t i = 0; i < d.x.size(); ++i) d.x.data()[i] = rng.symmetric();
  for (std::int64_t i = 0; i < d.d_out.size(); ++i) d.d_out.data()[i] = rng.symmetric();
  std::memset(static_cast<void*>(d.out.data()), 0, d.out.bytes());  // touched before any timing
  std::memset(static_cast<void*>(d.d_x.data()), 0, d.d_x.bytes());
}

//! The data of every rank for one R, kept while consecutive benchmarks use the same R.
std::vector<std::unique_ptr<rank_data>>& data_for(std::int32_t ranks) {
  static std::vector<std::unique_ptr<rank_data>> data;
  if (static_cast<std::int32_t>(data.size()) != ranks) {
    data.clear();  // free the previous R's buffers first
    // C = ceil((T·K / E) · factor), the same on every rank (equal T), so the agreed maximum too.
    auto const capacity = static_cast<std::int64_t>(std::ceil(static_cast<double>(kTokens * kTopK) / kNumExperts * kCapacityFactor));
    for (std::int32_t r = 0; r < ranks; ++r) {
      data.push_back(std::make_unique<rank_data>());
      make_rank(*data.back(), r, capacity);
    }
  }
  return data;
}

// ---- the check -----------------------------------------------------------------------------------

//! Empty when rank `me`'s outputs are right.
std::string check_rank(rank_data const& d, std::int32_t me, bool drops, bool backward) {
  auto const kept = [&](std::int64_t slot) { return !drops || d.kept_at_capacity[static_cast<std::size_t>(slot)] != 0; };
  auto const where = [&](char const* what, std::int64_t t, std::int64_t h) {
    return std::string(what) + ": rank " + std::to_string(me) + " [" + std::to_string(t) + "][" + std::to_string(h) + "]";
  };
  for (std::int64_t t = 0; t < kTokens; ++t) {
    float const* x = d.x.data() + t * kHidden;
    float const* g = d.d_out.data() + t * kHidden;
    float const* w = d.weights.data() + t * kTopK;
    for (std::int64_t h = 0; h < kHidden; ++h) {
      float acc = 0.0f;
      for (std::int32_t k = 0; k < kTopK; ++k)
        if (kept(t * kTopK + k)) acc = std::fma(w[k], x[h], acc);
      if (bits_of(acc) != bits_of(d.out.data()[t * kHidden + h]))
        return where("output", t, h) + " differs from the fma reference";
    }
    if (!backward) continue;
    for (std::int64_t h = 0; h < kHidden; ++h) {
      float acc = 0.0f;
      for (std::int32_t k = 0; k < kTopK; ++k)
        if (kept(t * kTopK + k)) {
          float const p = w[k] * g[h];  // one rounding (the target is built with -ffp-contract=off)
          acc = acc + p;
        }
      if (bits_of(acc) != bits_of(d.d_x.data()[t * kHidden + h]))
        return where("input gradient", t, h) + " differs from the fp32 reference";
    }
    double dot = 0.0, magnitude = 0.0;
    for (std::int64_t h = 0; h < kHidden; ++h) {
      dot += static_cast<double>(x[h]) * g[h];
      magnitude += std::fabs(static_cast<double>(x[h]) * g[h]);
    }
    for (std::int32_t k = 0; k < kTopK; ++k) {
      double const want = kept(t * kTopK + k) ? dot : 0.0;
      double const got = d.d_w[static_cast<std::size_t>(t * kTopK + k)];
      if (!(std::fabs(got - want) <= 1e-5 * magnitude + 1e-6))  // fp32 accumulation over H = 4096
        return "weight gradient: rank " + std::to_string(me) + " [" + std::to_string(t) + "][" + std::to_string(k) +
               "] = " + std::to_string(got) + ", expected " + std::to_string(want);
    }
  }
  return {};
}

// ---- the benchmark -------------------------------------------------------------------------------

struct rank_report {
  std::int64_t kept = 0, received = 0, dropped = 0, messages = 0, rounds = 0;
};

//! Turns the block cache on for one benchmark run; off (and emptied) at the end, however it ends.
struct caching_scope {
  explicit caching_scope(bool on) { set_caching(on); }
  ~caching_scope() { set_caching(false); }
  caching_scope(caching_scope const&) = delete;
  caching_scope& operator=(caching_scope const&) = delete;
};

template <class Capacity, class Algorithm>
void bm_layer(benchmark::State& state, layout lay, Capacity capacity, Algorithm algorithm, bool backward, bool cached) {
  constexpr bool drops = !moecomm::detail::is_dropless_v<Capacity>;
  std::int32_t const ranks = lay.ranks();
  auto& data = data_for(ranks);  // before the cache is on: the inputs are not the layer's buffers
  caching_scope const caching(cached);
  moecomm::topology const topo(ranks, lay.per_node);
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  std::vector<rank_report> reports(static_cast<std::size_t>(ranks));
  std::vector<double> seconds;
  std::atomic<bool> stop{false};

  bool const ran = run_ranks<world_t>(state, ranks, std::chrono::seconds(600), errors, [&](comm_t comm) {
    std::int32_t const me = comm.rank();
    rank_data& d = *data[static_cast<std::size_t>(me)];
    moecomm::exchange_groups<comm_t> groups(comm, topo);
    moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t, Capacity, Algorithm> layer(
        be, groups, kNumExperts, kHidden, capacity, algorithm);
    layer.set_training(backward);  // forward-only runs are inference: no backward expected
    moecomm::routing_view const routing{d.idx.data(), d.weights.data(), kTokens, kTopK};
    auto const identity = [](std::int32_t, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) {
      if (in.rows > 0) std::memcpy(out.data, in.data, static_cast<std::size_t>(in.rows * in.row_bytes()));
    };
    auto const identity_backward = [](std::int32_t, moecomm::matrix_view<float const>,
                                      moecomm::matrix_view<float const> d_out, moecomm::matrix_view<float> d_in) {
      if (d_out.rows > 0) std::memcpy(d_in.data, d_out.data, static_cast<std::size_t>(d_out.rows * d_out.row_bytes()));
    };
    auto const step = [&] {
      layer.forward(routing, {d.x.data(), kTokens, kHidden}, {d.out.data(), kTokens, kHidden}, identity);
      if (backward)
        layer.backward({d.d_out.data(), kTokens, kHidden}, {d.d_x.data(), kTokens, kHidden}, d.d_w,
                       identity_backward);
    };
    // Untimed steps first: with the cache on, two of them leave it holding every block a step
    // needs (`expert_in_` and the combine's returned rows are replaced while the previous step's
    // are still alive). Then the outputs are poisoned.
    for (int warm_up = 0; warm_up < (cached ? 2 : 1); ++warm_up) step();
    std::memset(static_cast<void*>(d.out.data()), 0xFF, d.out.bytes());
    std::memset(static_cast<void*>(d.d_x.data()), 0xFF, d.d_x.bytes());
    std::fill(d.d_w.begin(), d.d_w.end(), -1.0f);
    timed_loop(state, comm, stop, seconds, step);

    auto const& report = layer.dispatch_state().report();  // of the last step
    reports[static_cast<std::size_t>(me)] = {report.kept_slots, report.received_rows, report.dropped_slots,
                                             report.exchange.messages(), report.exchange.rounds};
    std::string& error = errors[static_cast<std::size_t>(me)];
    std::int64_t const want_dropped = drops ? d.dropped_at_capacity : 0;
    if (report.dropped_slots != want_dropped)
      error = "rank " + std::to_string(me) + " dropped " + std::to_string(report.dropped_slots) + " slots, expected " +
              std::to_string(want_dropped);
    if (error.empty()) error = check_rank(d, me, drops, backward);
  });
  if (!ran) return;

  double const t = mean(seconds);
  double rows = 0.0, dropped = 0.0, messages = 0.0, rounds = 0.0;
  for (rank_report const& r : reports) {
    rows += static_cast<double>(r.kept + r.received);
    dropped += static_cast<double>(r.dropped);
    messages += static_cast<double>(r.messages);
    rounds += static_cast<double>(r.rounds);
  }
  double const payload = (backward ? 2.0 : 1.0) * rows / ranks * kHidden * sizeof(float);  // per rank, per step
  double const rate = t > 0 ? payload / t : 0.0;
  double const copy = g_memcpy.copy_bytes_per_s();
  state.counters["payload_MiB"] = payload / (1 << 20);
  state.counters["GBps"] = rate / 1e9;
  state.counters["of_memcpy"] = copy > 0 ? rate / copy : 0.0;
  state.counters["all_ranks_of_memcpy"] = copy > 0 ? ranks * rate / copy : 0.0;
  state.counters["msgs"] = messages / ranks;
  state.counters["rounds"] = rounds / ranks;
  state.counters["dropped_pct"] = 100.0 * dropped / (static_cast<double>(ranks) * kTokens * kTopK);
}

// ---- registration ------------------------------------------------------------------------------

template <class Capacity, class Algorithm>
void register_case(layout lay, Capacity capacity, std::string const& capacity_name, Algorithm algorithm,
                   std::string const& algorithm_name) {
  for (bool cached : {false, true})
    for (bool backward : {false, true})
      benchmark::RegisterBenchmark((std::string(cached ? "layer<cached>/" : "layer<malloc>/") + lay.name() + "/" +
                                    capacity_name + "/" + algorithm_name + (backward ? "/fwd_bwd" : "/fwd")).c_str(),
                                   bm_layer<Capacity, Algorithm>, lay, capacity, algorithm, backward, cached)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
}

template <class Capacity>
void register_algorithms(layout lay, Capacity capacity, std::string const& capacity_name) {
  register_case(lay, capacity, capacity_name, moecomm::flat{}, "flat");
  register_case(lay, capacity, capacity_name, moecomm::hierarchical_2d{}, "hierarchical_2d");
  register_case(lay, capacity, capacity_name, moecomm::pairwise{1}, "pairwise1");
  register_case(lay, capacity, capacity_name, moecomm::smart_schedule{1}, "smart_schedule1");
}

void register_all() {
  for (layout const& lay : kLayouts) {  // grouped by R, so each R's data is built once
    register_algorithms(lay, moecomm::dropless{}, "dropless");
    moecomm::capacity<moecomm::drop_by_position> capacity{};
    capacity.factor = kCapacityFactor;
    register_algorithms(lay, capacity, "capacity1.0");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!moecomm_bench::start(argc, argv,
                            {moecomm_bench::in_process_ranks,
                             {"shape", "T = 4096 tokens per rank, H = 4096, K = 2, E = 16, float, identity experts"},
                             {"capacity1.0", "moecomm::capacity<drop_by_position>{1.0}"},
                             {"pairwise1", "moecomm::pairwise{1}"},
                             {"smart_schedule1", "moecomm::smart_schedule{1}: pairwise1, experts on a worker thread"}}))
    return 1;
  g_memcpy = moecomm_bench::use_memcpy_reference();

  register_all();
  return moecomm_bench::finish("bench_layer");
}
