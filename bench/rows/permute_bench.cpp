// SPDX-License-Identifier: Apache-2.0
//! @file
//! Host-backend throughput of `permute`, `unpermute<weighted>` and `make_permute_plan`, on one
//! thread, over E x T x H x K x dtype, reported as bytes moved and as a fraction of `std::memcpy`
//! of the same byte count, measured in the same run just before the case (`memcpy<dtype>/T/H/K`,
//! its fastest copy).
//!
//! Bytes are counted as read + written:
//!   permute   : T*H*sizeof(T) read + P*H*sizeof(T) written            (P = plan.num_rows() = T*K:
//!               each token row is read once and written to its K rows)
//!   unpermute : P*H*sizeof(T) read + T*K*4 (weights) + T*H*sizeof(T) written
//!   memcpy    : 2 * size per copy (read + write), the same convention; a case's copy moves
//!               (T + P)*H*sizeof(T) bytes, what its permute moves.
//!
//! Every benchmark checks its result after the timed loop (sampled rows against a direct
//! computation) and fails with SkipWithError on a mismatch; main() then returns non-zero.

#include <moecomm/moecomm.hpp>

#include "../support/harness.hpp"
#include "../support/memcpy_reference.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace moecomm_bench;

constexpr std::int32_t kPlanExperts = 16;  // the plan and capacity benchmarks

moecomm::host_backend const be{1};

//! memcpy's read + write bytes per second for the case being run (set by its `memcpy<…>` benchmark).
double g_case_memcpy_bytes_per_s = 0.0;
//! The 512 MiB reference measured before any benchmark (the context block's `memcpy_GBps`).
double g_memcpy_reference_bytes_per_s = 0.0;

template <class T>
void fill_random(T* p, std::int64_t n, std::uint64_t seed) {
  splitmix64 rng{seed};
  std::int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    std::uint64_t const bits = rng.next();
    p[i] = moecomm::dtype_traits<T>::from_float(splitmix64::symmetric(static_cast<std::uint32_t>(bits)));
    p[i + 1] = moecomm::dtype_traits<T>::from_float(splitmix64::symmetric(static_cast<std::uint32_t>(bits >> 32)));
  }
  if (i < n) p[i] = moecomm::dtype_traits<T>::from_float(splitmix64::symmetric(static_cast<std::uint32_t>(rng.next())));
}

// ---- routing and its reference row map -------------------------------------------------------

//! Uniform random routing (each token picks K distinct experts of E), fixed seed, with the row
//! map computed directly: rows ordered by (expert, token, slot).
struct routing_data {
  std::int64_t tokens = 0;
  std::int32_t top_k = 0;
  std::int32_t experts = 0;
  std::vector<std::int32_t> idx;      // [T][K]
  std::vector<float> weights;         // [T][K], positive, each token's sum is 1
  std::vector<std::int32_t> row_of;   // [T][K] reference
  std::vector<std::int32_t> token_of; // [P] reference
  std::vector<std::int32_t> slot_of;  // [P] reference
  std::vector<std::int32_t> offsets;  // [E + 1] reference

  [[nodiscard]] moecomm::routing_view view() const { return {idx.data(), weights.data(), tokens, top_k}; }
  [[nodiscard]] std::int64_t rows() const { return tokens * top_k; }
};

routing_data make_routing(std::int64_t tokens, std::int32_t top_k, std::int32_t experts) {
  routing_data d;
  d.tokens = tokens;
  d.top_k = top_k;
  d.experts = experts;
  std::int64_t const slots = tokens * top_k;
  splitmix64 rng{kSeed ^ static_cast<std::uint64_t>(tokens * 131 + top_k) ^ (static_cast<std::uint64_t>(experts) << 40)};
  uniform_routing(rng, tokens, top_k, experts, d.idx, d.weights);
  // Counting sort by expert, stable in (token, slot): the plan's documented order.
  d.offsets.assign(static_cast<std::size_t>(experts) + 1, 0);
  for (std::int32_t e : d.idx) ++d.offsets[static_cast<std::size_t>(e) + 1];
  for (std::int32_t e = 0; e < experts; ++e) d.offsets[static_cast<std::size_t>(e) + 1] += d.offsets[static_cast<std::size_t>(e)];
  std::vector<std::int32_t> next(d.offsets.begin(), d.offsets.end() - 1);
  d.row_of.resize(static_cast<std::size_t>(slots));
  d.token_of.resize(static_cast<std::size_t>(slots));
  d.slot_of.resize(static_cast<std::size_t>(slots));
  for (std::int64_t s = 0; s < slots; ++s) {
    std::int32_t const r = next[static_cast<std::size_t>(d.idx[static_cast<std::size_t>(s)])]++;
    d.row_of[static_cast<std::size_t>(s)] = r;
    d.token_of[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(s / top_k);
    d.slot_of[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(s % top_k);
  }
  return d;
}

routing_data const& routing_for(std::int64_t tokens, std::int32_t top_k, std::int32_t experts) {
  static std::map<std::tuple<std::int64_t, std::int32_t, std::int32_t>, std::unique_ptr<routing_data>> cache;
  auto& slot = cache[{tokens, top_k, experts}];
  if (!slot) slot = std::make_unique<routing_data>(make_routing(tokens, top_k, experts));
  return *slot;
}

//! Compares a plan with the reference row map; returns an empty string when they agree.
std::string compare_plan(moecomm::permute_plan<moecomm::host_backend> const& plan, routing_data const& ref) {
  if (plan.num_rows() != ref.rows())
    return "plan.num_rows() = " + std::to_string(plan.num_rows()) + ", expected " + std::to_string(ref.rows());
  for (std::int32_t e = 0; e <= ref.experts; ++e)
    if (plan.expert_offsets()[e] != ref.offsets[static_cast<std::size_t>(e)])
      return "plan.expert_offsets()[" + std::to_string(e) + "] differs from the reference";
  for (std::int64_t s = 0; s < ref.rows(); ++s)
    if (plan.row_of()[s] != ref.row_of[static_cast<std::size_t>(s)])
      return "plan.row_of()[" + std::to_string(s) + "] differs from the reference";
  for (std::int64_t r = 0; r < ref.rows(); ++r)
    if (plan.token_of()[r] != ref.token_of[static_cast<std::size_t>(r)] ||
        plan.slot_of()[r] != ref.slot_of[static_cast<std::size_t>(r)])
      return "plan.token_of()/slot_of()[" + std::to_string(r) + "] differs from the reference";
  return {};
}

// ---- data sets: one (dtype, T, H, K) case at a time, shared by its memcpy and every E's ops ------

struct dataset_base {
  virtual ~dataset_base() = default;
};

//! The buffers of a case; P = T*K for every E (each token picks K distinct experts).
template <class T>
struct dataset final : dataset_base {
  std::int64_t tokens, hidden, rows;
  moecomm::host_backend::buffer_type<T> x;         // [T][H] token rows (permute input)
  moecomm::host_backend::buffer_type<T> permuted;  // [P][H] permute output = unpermute input y
  moecomm::host_backend::buffer_type<T> combined;  // [T][H] unpermute output
  std::vector<char> copy;                          // the memcpy reference's destination

  dataset(std::int64_t t, std::int64_t h, std::int32_t k)
      : tokens(t),
        hidden(h),
        rows(t * k),
        x(be.allocate<T>(t * h)),
        permuted(be.allocate<T>(rows * h)),
        combined(be.allocate<T>(t * h)),
        copy(copy_bytes(), 1) {
    // Finite random inputs; every page of every buffer is touched here, outside the timed loops.
    fill_random(x.data(), x.size(), kSeed + 1);
    fill_random(permuted.data(), permuted.size(), kSeed + 2);
    std::memset(static_cast<void*>(combined.data()), 0, combined.bytes());
  }

  //! Half of what permute moves (read + write), taken from the start of `permuted`.
  [[nodiscard]] std::size_t copy_bytes() const { return static_cast<std::size_t>((tokens + rows) * hidden) * sizeof(T) / 2; }
};

template <class T>
dataset<T>& dataset_for(std::int64_t tokens, std::int64_t hidden, std::int32_t top_k) {
  static std::unique_ptr<dataset_base> current;
  static std::string current_key;
  std::string const key = std::string(moecomm::dtype_traits<T>::name) + "/" + std::to_string(tokens) + "/" +
                          std::to_string(hidden) + "/" + std::to_string(top_k);
  if (key != current_key || !current) {
    current.reset();  // free the previous case first: the largest needs ~6.6 GB
    current_key.clear();
    current = std::make_unique<dataset<T>>(tokens, hidden, top_k);
    current_key = key;
  }
  return static_cast<dataset<T>&>(*current);
}

//! Rows to verify: the first and last, each expert's first row, and a few random ones.
std::vector<std::int64_t> sample_indices(std::int64_t n, std::vector<std::int32_t> const* offsets, std::uint64_t seed) {
  std::vector<std::int64_t> s{0, n - 1};
  if (offsets != nullptr)
    for (std::int32_t first : *offsets)
      if (first < n) s.push_back(first);
  splitmix64 rng{seed};
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<std::int64_t>((rng.next() >> 11) % static_cast<std::uint64_t>(n)));
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

template <class T>
void poison_rows(T* data, std::int64_t hidden, std::vector<std::int64_t> const& rows) {
  for (std::int64_t r : rows) std::memset(static_cast<void*>(data + r * hidden), 0xFF, static_cast<std::size_t>(hidden) * sizeof(T));
}

//! `GBps` and, against the case's memcpy, `of_memcpy`.
void set_counters(benchmark::State& state, double bytes_per_iteration, double memcpy_bytes_per_s) {
  double const bytes = bytes_per_iteration * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsRate);
  if (memcpy_bytes_per_s > 0)
    state.counters["of_memcpy"] = benchmark::Counter(bytes / memcpy_bytes_per_s, benchmark::Counter::kIsRate);
}

// ---- benchmarks --------------------------------------------------------------------------------

//! The case's reference: `std::memcpy` of half the bytes its permute moves, from `permuted` into
//! a buffer of its own (both touched before timing). Its fastest copy sets the case's ratios, so
//! that a copy slowed by other work on the machine does not flatter them.
template <class T>
void bm_case_memcpy(benchmark::State& state, std::int64_t tokens, std::int64_t hidden, std::int32_t top_k) {
  dataset<T>& d = dataset_for<T>(tokens, hidden, top_k);
  std::size_t const bytes = d.copy_bytes();
  double best = 1e30;
  for (auto _ : state) {
    auto const start = std::chrono::steady_clock::now();
    std::memcpy(d.copy.data(), d.permuted.data(), bytes);
    benchmark::ClobberMemory();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  set_counters(state, 2.0 * static_cast<double>(bytes), 0.0);
  g_case_memcpy_bytes_per_s = 0.0;
  if (std::memcmp(d.copy.data(), d.permuted.data(), bytes) != 0) return fail(state, "memcpy: destination differs");
  g_case_memcpy_bytes_per_s = 2.0 * static_cast<double>(bytes) / best;
  state.counters["best_GBps"] = g_case_memcpy_bytes_per_s / 1e9;
}

template <class T>
void bm_permute(benchmark::State& state, std::int64_t tokens, std::int64_t hidden, std::int32_t top_k, std::int32_t experts) {
  dataset<T>& d = dataset_for<T>(tokens, hidden, top_k);
  routing_data const& ref = routing_for(tokens, top_k, experts);
  auto const plan = moecomm::make_permute_plan(be, ref.view(), experts);
  std::int64_t const rows = plan.num_rows();
  moecomm::matrix_view<T const> const x{d.x.data(), tokens, hidden};
  moecomm::matrix_view<T> const out{d.permuted.data(), rows, hidden};
  std::vector<std::int64_t> const sample = sample_indices(rows, &ref.offsets, kSeed + 3);
  poison_rows(d.permuted.data(), hidden, sample);

  for (auto _ : state) {
    moecomm::permute(be, plan, x, out);
    benchmark::ClobberMemory();
  }

  set_counters(state, static_cast<double>(tokens + rows) * static_cast<double>(hidden) * sizeof(T), g_case_memcpy_bytes_per_s);
  if (std::string const e = compare_plan(plan, ref); !e.empty()) return fail(state, e);
  for (std::int64_t r : sample) {
    std::int64_t const t = ref.token_of[static_cast<std::size_t>(r)];
    if (std::memcmp(d.permuted.data() + r * hidden, d.x.data() + t * hidden, static_cast<std::size_t>(hidden) * sizeof(T)) != 0)
      return fail(state, "permute: out[" + std::to_string(r) + "] != x[" + std::to_string(t) + "]");
  }
}

template <class T>
void bm_unpermute(benchmark::State& state, std::int64_t tokens, std::int64_t hidden, std::int32_t top_k, std::int32_t experts) {
  dataset<T>& d = dataset_for<T>(tokens, hidden, top_k);
  routing_data const& ref = routing_for(tokens, top_k, experts);
  auto const plan = moecomm::make_permute_plan(be, ref.view(), experts);
  std::int64_t const rows = plan.num_rows();
  moecomm::matrix_view<T const> const y{d.permuted.data(), rows, hidden};
  moecomm::matrix_view<T> const out{d.combined.data(), tokens, hidden};
  std::vector<std::int64_t> const sample = sample_indices(tokens, nullptr, kSeed + 4);
  poison_rows(d.combined.data(), hidden, sample);

  for (auto _ : state) {
    moecomm::unpermute<moecomm::weighted>(be, plan, y, out);
    benchmark::ClobberMemory();
  }

  set_counters(state, static_cast<double>(rows) * static_cast<double>(hidden) * sizeof(T) +
                          static_cast<double>(tokens * top_k) * sizeof(float) +
                          static_cast<double>(tokens) * static_cast<double>(hidden) * sizeof(T),
               g_case_memcpy_bytes_per_s);
  using traits = moecomm::dtype_traits<T>;
  for (std::int64_t t : sample) {
    for (std::int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (std::int32_t k = 0; k < top_k; ++k) {
        std::int64_t const slot = t * top_k + k;
        std::int64_t const r = ref.row_of[static_cast<std::size_t>(slot)];
        acc = std::fma(ref.weights[static_cast<std::size_t>(slot)], traits::to_float(d.permuted.data()[r * hidden + h]), acc);
      }
      T const expected = traits::from_float(acc);
      T const got = d.combined.data()[t * hidden + h];
      if (std::memcmp(&expected, &got, sizeof(T)) != 0) {
        char values[96];
        std::snprintf(values, sizeof values, " (expected %a, got %a)", static_cast<double>(traits::to_float(expected)),
                      static_cast<double>(traits::to_float(got)));
        return fail(state, "unpermute: out[" + std::to_string(t) + "][" + std::to_string(h) +
                               "] differs from the fp32 fma reference" + values);
      }
    }
  }
}

void bm_plan(benchmark::State& state, std::int64_t tokens, std::int32_t top_k) {
  routing_data const& ref = routing_for(tokens, top_k, kPlanExperts);
  for (auto _ : state) {
    auto plan = moecomm::make_permute_plan(be, ref.view(), kPlanExperts);
    benchmark::DoNotOptimize(plan.row_of());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * tokens * top_k);
  auto const plan = moecomm::make_permute_plan(be, ref.view(), kPlanExperts);  // checked outside the loop
  if (std::string const e = compare_plan(plan, ref); !e.empty()) fail(state, e);
}

//! A capacity step's plans, as the dispatcher builds them each step (workspaces kept): the dropless
//! plan, the drops (`drop_by_position`, C = T·K / E), then the kept plan, either derived from the
//! dropless one (`build_kept_permute_plan` without the masking check, as the dispatcher calls it) or sorted again from the kept
//! routing (what it did before). Both kept plans are compared after the loop.
void bm_capacity_plan(benchmark::State& state, std::int64_t tokens, std::int32_t top_k, bool derived) {
  routing_data const& ref = routing_for(tokens, top_k, kPlanExperts);
  std::int64_t const slots = tokens * top_k, capacity = slots / kPlanExperts;
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> dropless, kept, sorted;
  std::vector<std::int32_t> kept_idx(static_cast<std::size_t>(slots));
  moecomm::routing_view kept_routing = ref.view();
  kept_routing.topk_idx = kept_idx.data();
  auto step = [&](moecomm::permute_plan<moecomm::host_backend>& out, bool derive) {
    moecomm::build_permute_plan(be, ref.view(), kPlanExperts, dropless, scratch);
    (void)moecomm::drop_to_capacity(be, dropless, capacity, moecomm::array_view<std::int32_t>{kept_idx.data(), slots}, scratch);
    if (derive) moecomm::build_kept_permute_plan(be, dropless, kept_routing, out, scratch, moecomm::unchecked_routing);
    else moecomm::build_permute_plan(be, kept_routing, kPlanExperts, out, scratch, moecomm::unchecked_routing);
  };
  for (auto _ : state) {
    step(kept, derived);
    benchmark::DoNotOptimize(kept.row_of());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * slots);
  step(sorted, !derived);  // the other way, once: the two plans must be equal
  bool const same = kept.num_rows() == sorted.num_rows() &&
                    std::equal(kept.row_of(), kept.row_of() + slots, sorted.row_of()) &&
                    std::equal(kept.token_of(), kept.token_of() + kept.num_rows(), sorted.token_of()) &&
                    std::equal(kept.expert_offsets(), kept.expert_offsets() + kPlanExperts + 1, sorted.expert_offsets());
  if (!same) fail(state, "capacity plan: the derived and the sorted kept plans differ");
}

//! `drop_to_capacity` alone, C = T·K / E, on the routing's dropless plan (checked after the loop:
//! every expert keeps min(its slots, C)).
template <class Rule>
void bm_drop(benchmark::State& state, std::int64_t tokens, std::int32_t top_k, Rule rule) {
  routing_data const& ref = routing_for(tokens, top_k, kPlanExperts);
  std::int64_t const slots = tokens * top_k, capacity = slots / kPlanExperts;
  moecomm::workspace<moecomm::host_backend> scratch;
  moecomm::permute_plan<moecomm::host_backend> dropless;
  moecomm::build_permute_plan(be, ref.view(), kPlanExperts, dropless, scratch);
  std::vector<std::int32_t> kept_idx(static_cast<std::size_t>(slots));
  moecomm::capacity_result result;
  for (auto _ : state) {
    result = moecomm::drop_to_capacity(be, dropless, capacity, moecomm::array_view<std::int32_t>{kept_idx.data(), slots},
                                       scratch, rule, 0);
    benchmark::DoNotOptimize(kept_idx.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * slots);
  std::vector<std::int64_t> kept(kPlanExperts, 0);
  for (std::int32_t e : kept_idx)
    if (e >= 0) ++kept[static_cast<std::size_t>(e)];
  std::int64_t total = 0;
  for (std::int32_t e = 0; e < kPlanExperts; ++e) {
    std::int64_t const n = dropless.expert_offsets()[e + 1] - dropless.expert_offsets()[e];
    if (kept[static_cast<std::size_t>(e)] != std::min(n, capacity)) return fail(state, "drop: expert " + std::to_string(e) + " keeps the wrong count");
    total += kept[static_cast<std::size_t>(e)];
  }
  if (total != result.kept_slots) fail(state, "drop: kept_slots differs from the kept routing");
}

void bm_memcpy(benchmark::State& state, std::size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // both touched before timing
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * static_cast<double>(bytes), g_memcpy_reference_bytes_per_s);
  if (std::memcmp(dst.data(), src.data(), bytes) != 0) fail(state, "memcpy: destination differs");
}

// ---- registration ------------------------------------------------------------------------------

constexpr std::int32_t kExperts[] = {8, 64, 256};
constexpr std::int64_t kTokens[] = {4096, 16384};
constexpr std::int64_t kHidden[] = {1024, 4096, 7168};
constexpr std::int32_t kTopK[] = {1, 2, 8};

//! One (dtype, T, H, K) case: its memcpy, then permute and unpermute for each E, on one data set.
template <class T>
void register_case(std::int64_t tokens, std::int64_t hidden, std::int32_t top_k) {
  std::string const args = "<" + std::string(moecomm::dtype_traits<T>::name) + ">/T:" + std::to_string(tokens) +
                           "/H:" + std::to_string(hidden) + "/K:" + std::to_string(top_k);
  benchmark::RegisterBenchmark(("memcpy" + args).c_str(), bm_case_memcpy<T>, tokens, hidden, top_k)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (std::int32_t experts : kExperts) {
    std::string const name = args + "/E:" + std::to_string(experts);
    benchmark::RegisterBenchmark(("permute" + name).c_str(), bm_permute<T>, tokens, hidden, top_k, experts)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("unpermute" + name).c_str(), bm_unpermute<T>, tokens, hidden, top_k, experts)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

//! The grid, then the same ops on data that fits in a core's L2 (512 KiB of permuted rows, H =
//! 4096): with memory out of the way, what their instructions allow (docs/performance.md).
template <class T>
void register_ops() {
  for (std::int64_t tokens : kTokens)
    for (std::int64_t hidden : kHidden)
      for (std::int32_t top_k : kTopK) register_case<T>(tokens, hidden, top_k);
  constexpr std::int64_t in_cache_hidden = 4096, in_cache_rows_bytes = std::int64_t{512} << 10;
  for (std::int32_t top_k : kTopK)
    register_case<T>(in_cache_rows_bytes / (top_k * in_cache_hidden * std::int64_t{sizeof(T)}), in_cache_hidden, top_k);
}

void register_all() {
  benchmark::RegisterBenchmark("memcpy/MiB:256", bm_memcpy, std::size_t{256} << 20)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (std::int64_t tokens : kTokens)
    for (std::int32_t top_k : kTopK)
      benchmark::RegisterBenchmark(("plan/T:" + std::to_string(tokens) + "/K:" + std::to_string(top_k)).c_str(), bm_plan,
                                   tokens, top_k)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
  for (std::int64_t tokens : kTokens)
    for (std::int32_t top_k : kTopK)
      for (bool derived : {false, true})
        benchmark::RegisterBenchmark(("capacity_plan/" + std::string(derived ? "derived" : "sorted_twice") +
                                      "/T:" + std::to_string(tokens) + "/K:" + std::to_string(top_k))
                                         .c_str(),
                                     bm_capacity_plan, tokens, top_k, derived)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  for (std::int64_t tokens : kTokens)
    for (std::int32_t top_k : kTopK) {
      std::string const args = "/T:" + std::to_string(tokens) + "/K:" + std::to_string(top_k);
      benchmark::RegisterBenchmark(("drop/position" + args).c_str(), bm_drop<moecomm::drop_by_position>, tokens, top_k,
                                   moecomm::drop_by_position{})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("drop/probability" + args).c_str(), bm_drop<moecomm::drop_by_probability>, tokens, top_k,
                                   moecomm::drop_by_probability{})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("drop/random" + args).c_str(), bm_drop<moecomm::drop_random>, tokens, top_k,
                                   moecomm::drop_random{7, 0})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  register_ops<float>();
#if MOECOMM_HAS_CUDA_FP16()
  register_ops<__nv_bfloat16>();
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (!moecomm_bench::start(argc, argv, {{"host_threads", std::to_string(be.num_threads())}})) return 1;
  g_memcpy_reference_bytes_per_s = moecomm_bench::use_memcpy_reference().rw_bytes_per_s;
#if !MOECOMM_HAS_CUDA_FP16()
  benchmark::AddCustomContext("bf16", "not built (CUDA headers not found)");
#endif

  register_all();
  return finish("bench_permute");
}
