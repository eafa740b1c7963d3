// SPDX-License-Identifier: Apache-2.0
#pragma once
// The shared part of the fuzz targets: the run loop, seeded argument generators and the checks.
//
// Each target calls `fuzz::main_loop(name, one_case)`. Run i draws its arguments from a generator
// seeded with (MOECOMM_FUZZ_SEED, i), so a failing run is reproduced alone with
//   MOECOMM_FUZZ_SEED=<seed> MOECOMM_FUZZ_FIRST=<i> MOECOMM_FUZZ_RUNS=1 build/host/tests/fuzz/<target>
// A case returns true when its arguments were valid (and the result equalled the oracle) and
// false when the call was rejected as expected. Anything else fails the target: a result that
// differs from the oracle, a valid call rejected, a bad call accepted, an error of another status
// or another operation, a non-moecomm exception. A crash or an ASan report kills the process.

#include "../support/oracle.hpp"

#include <moecomm/moecomm.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

namespace fuzz {

using std::int32_t;
using std::int64_t;

inline constexpr int32_t int32_max = std::numeric_limits<int32_t>::max();
inline constexpr int64_t int64_max = std::numeric_limits<int64_t>::max();

// A check that failed; the loop prints it with the run's arguments and seed.
struct mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void expect(bool ok, std::string const& what) {
  if (!ok) throw mismatch(what);
}

// One run: its random source and the arguments it chose, printed if it fails.
struct run {
  std::mt19937_64 rng;
  std::string args;

  // Uniform in [lo, hi].
  int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng); }
  // Mostly small sizes with an occasional large one: the large ones find size bugs, the small ones
  // keep the oracle (O(E T K)) fast enough for 10^6 runs.
  int64_t size(int64_t small, int64_t large) { return chance(0.03) ? uniform(0, large) : uniform(0, small); }
  template <class T>
  T pick(std::initializer_list<T> values) {
    return values.begin()[uniform(0, static_cast<int64_t>(values.size()) - 1)];
  }
  template <class... Parts>
  void note(Parts const&... parts) {
    args += moecomm::detail::concat(parts..., " ");
  }
};

inline int64_t env_or(char const* name, int64_t fallback) {
  char const* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::strtoll(value, nullptr, 10) : fallback;
}

// Runs `one_case(run&)` MOECOMM_FUZZ_RUNS times (default `default_runs`) and prints the counts.
// Returns the process exit code.
template <class Case>
int main_loop(char const* target, int64_t default_runs, Case const& one_case) {
  int64_t const runs = env_or("MOECOMM_FUZZ_RUNS", default_runs);
  int64_t const first = env_or("MOECOMM_FUZZ_FIRST", 0);
  auto const seed = static_cast<std::uint64_t>(env_or("MOECOMM_FUZZ_SEED", 1));
  int64_t valid = 0, rejected = 0;
  auto const start = std::chrono::steady_clock::now();
  for (int64_t i = first; i < first + runs; ++i) {
    std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                      static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(static_cast<std::uint64_t>(i) >> 32)};
    run r{std::mt19937_64(seq), {}};
    std::string failure;
    try {
      (one_case(r) ? valid : rejected) += 1;
    } catch (mismatch const& m) {
      failure = m.what();
    } catch (moecomm::error const& e) {
      failure = std::string("a valid call was rejected: ") + e.what();
    } catch (std::exception const& e) {
      failure = std::string("a non-moecomm exception escaped (") + typeid(e).name() + "): " + e.what();
    }
    if (!failure.empty()) {
      std::printf("%s: FAILED at run %lld (MOECOMM_FUZZ_SEED=%llu MOECOMM_FUZZ_FIRST=%lld MOECOMM_FUZZ_RUNS=1)\n"
                  "  arguments: %s\n  %s\n",
                  target, static_cast<long long>(i), static_cast<unsigned long long>(seed), static_cast<long long>(i),
                  r.args.c_str(), failure.c_str());
      return 1;
    }
  }
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %lld runs (seed %llu): %lld valid and equal to the oracle, %lld rejected with a clean "
              "moecomm::error, 0 crashes, %.1f s\n",
              target, static_cast<long long>(runs), static_cast<unsigned long long>(seed), static_cast<long long>(valid),
              static_cast<long long>(rejected), seconds);
  return 0;
}

// Calls `f`, which must throw moecomm::error with `code` from operation `op` (a prefix such as
// "moecomm::permute:"); anything else is a mismatch. `why` says what made the call bad.
template <class F>
void expect_rejected(F&& f, char const* op, std::string const& why,
                     moecomm::status code = moecomm::status::invalid_argument) {
  try {
    f();
  } catch (moecomm::error const& e) {
    expect(e.code() == code, "expected " + std::string(moecomm::to_string(code)) + " for " + why + ", got " +
                                 moecomm::to_string(e.code()) + ": " + e.what());
    expect(std::strncmp(e.what(), op, std::strlen(op)) == 0,
           "the error for " + why + " does not start with '" + op + "': " + e.what());
    return;
  }
  throw mismatch("expected a moecomm::error for " + why + ", but the call was accepted");
}

// The first `want.size()` elements of `got` equal `want` bit for bit.
template <class T>
void expect_bitwise(std::vector<T> const& got, std::vector<T> const& want, char const* what) {
  expect(got.size() >= want.size(), std::string(what) + ": output too small");
  for (std::size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      throw mismatch(moecomm::detail::concat(what, ": element ", i, " differs from the oracle (got ", got[i], ", want ",
                                             want[i], ")"));
}

// A quiet NaN with a payload: output that must not be written keeps exactly these bits.
inline float poison() {
  std::uint32_t const bits = 0x7FC0DEADu;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Elements from `from` on still hold the poison.
inline void expect_untouched(std::vector<float> const& v, std::size_t from, char const* what) {
  float const p = poison();
  for (std::size_t i = from; i < v.size(); ++i)
    if (std::memcmp(&v[i], &p, sizeof p) != 0)
      throw mismatch(moecomm::detail::concat(what, ": element ", i, " was written but should not have been"));
}

// Distinct finite values with full mantissas (arithmetic shows every rounding).
inline std::vector<float> finite_values(run& r, int64_t n) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = value(r.rng);
  return v;
}

// A host back-end with 1 or 2 threads, tiled or portable (the GPU's per-lane loop) row kernels.
inline moecomm::host_backend any_backend(run& r) {
  int const threads = r.chance(0.5) ? 1 : 2;
  bool const portable = r.chance(0.5);
  r.note("threads=", threads, portable ? " portable" : " tiled");
  return moecomm::host_backend{threads, portable ? moecomm::host_kernels::portable : moecomm::host_kernels::tiled};
}

// What is wrong with a routing's values, as the checked scan sees it.
struct routing_faults {
  bool out_of_range = false;  // an id outside [-1, E)
  bool nan_weight = false;    // a NaN weight in a valid slot
  bool duplicate = false;     // a token naming one expert twice
};

// Random routing values for T tokens, K slots and E experts: masked slots (with a NaN weight,
// which must never be read), duplicates, and, when `hostile`, ids outside [-1, E) and NaN weights
// in valid slots.
inline oracle::routing random_routing(run& r, int64_t tokens, int32_t top_k, int32_t experts, bool hostile,
                                      routing_faults& faults) {
  double const masked = r.pick({0.0, 0.1, 0.5, 1.0});
  double const bad = hostile ? r.pick({0.001, 0.05}) : 0.0;
  int32_t const hot = static_cast<int32_t>(r.uniform(1, experts));  // a few hot experts make duplicates likely
  r.note("masked=", masked, " bad=", bad, " hot=", hot);
  oracle::routing out;
  out.tokens = tokens;
  out.top_k = top_k;
  std::uniform_real_distribution<float> weight(0.001f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t k = 0; k < top_k; ++k) {
      int32_t e = static_cast<int32_t>(r.chance(0.5) ? r.uniform(0, hot - 1) : r.uniform(0, experts - 1));
      float w = weight(r.rng);
      if (r.chance(masked)) {
        e = -1;
        w = std::numeric_limits<float>::quiet_NaN();
      } else if (r.chance(bad)) {
        e = r.pick({experts, experts + 1, -2, std::numeric_limits<int32_t>::min(), int32_max});
        faults.out_of_range = true;
      } else if (r.chance(bad)) {
        w = std::numeric_limits<float>::quiet_NaN();
        faults.nan_weight = true;
      }
      for (int32_t j = 0; j < k && e >= 0 && e < experts; ++j)
        faults.duplicate = faults.duplicate || out.at(t, j) == e;
      out.idx.push_back(e);
      out.w.push_back(w);
    }
  return out;
}

// Why the routing scan must reject `faults` under `checks` (the scan runs in either mode and then
// flags bad ids and, when weights are given, NaN weights; duplicates only in strict mode), or "".
inline std::string scan_rejection(moecomm::routing_checks const& checks, routing_faults const& faults,
                                  bool with_weights) {
  bool const scans = checks.scan_values || checks.reject_duplicates;
  if (scans && faults.out_of_range) return "an expert id out of range";
  if (scans && faults.nan_weight && with_weights) return "a NaN weight in a valid slot";
  if (checks.reject_duplicates && faults.duplicate) return "a duplicate in strict mode";
  return "";
}

// Replaces one routing argument by one that must be rejected before any slot is read (a size the
// exactly-sized arrays cannot back, or a null topk_idx) and returns why; "" when the change is
// harmless (a null topk_idx with no tokens).
inline std::string spoil_routing_shape(run& r, moecomm::routing_view& view, int32_t experts) {
  switch (r.uniform(0, 2)) {
    case 0:
      view.num_tokens = r.pick<int64_t>({-1, std::numeric_limits<int64_t>::min(), int64_t{1} << 31, int64_t{1} << 62,
                                         int64_max});
      return "num_tokens = " + std::to_string(view.num_tokens);
    case 1:
      view.top_k = r.pick<int32_t>({0, -1, experts + 1, int32_max});
      return "top_k = " + std::to_string(view.top_k);
    default:
      view.topk_idx = nullptr;
      return view.num_tokens > 0 ? "a null topk_idx" : "";
  }
}

// A copy of `n` elements (host back-end memory).
template <class T>
std::vector<T> host_copy(T const* data, int64_t n) {
  return std::vector<T>(data, data + n);
}

// The view of `routing` the library takes; the arrays are sized exactly T * K, so ASan sees any overrun.
inline moecomm::routing_view view_of(oracle::routing const& routing, bool with_weights) {
  return {routing.idx.empty() ? nullptr : routing.idx.data(),
          with_weights && !routing.w.empty() ? routing.w.data() : nullptr, routing.tokens, routing.top_k};
}

// ---- matrix arguments, valid or with one fault --------------------------------------------

// What is wrong with the matrix arguments of a call.
enum class fault { none, short_input, short_output, null_input, null_output, overlap, other_hidden, huge_hidden };

inline char const* to_string(fault f) {
  switch (f) {
    case fault::none: return "none";
    case fault::short_input: return "short_input";
    case fault::short_output: return "short_output";
    case fault::null_input: return "null_input";
    case fault::null_output: return "null_output";
    case fault::overlap: return "overlap";
    case fault::other_hidden: return "other_hidden";
    case fault::huge_hidden: return "huge_hidden";
  }
  return "unknown";
}

// No fault 70 % of the time, else one of them.
inline fault random_fault(run& r) {
  return r.chance(0.3) ? r.pick({fault::short_input, fault::short_output, fault::null_input, fault::null_output,
                                 fault::overlap, fault::other_hidden, fault::huge_hidden})
                       : fault::none;
}

// The input and output matrices of one call, allocated exactly to the rows their views state.
struct matrices {
  std::vector<float> in, out;          // separate storage, or `shared` when they overlap
  std::vector<float> shared;
  moecomm::matrix_view<float const> in_view;
  moecomm::matrix_view<float> out_view;
  std::string why;  // non-empty: the call must be rejected
};

inline matrices make_matrices(run& r, fault f, int64_t in_rows, int64_t out_rows, int64_t hidden) {
  // A fault that cannot apply to these sizes (an empty matrix cannot be null or overlap) is none.
  bool const both_nonempty = in_rows > 0 && out_rows > 0 && hidden > 0;
  if ((f == fault::null_input && (in_rows == 0 || hidden == 0)) ||
      (f == fault::null_output && (out_rows == 0 || hidden == 0)) || (f == fault::overlap && !both_nonempty))
    f = fault::none;
  r.note("fault=", to_string(f));
  matrices m;
  int64_t const slack = f == fault::none ? r.uniform(0, 2) : 0;
  int64_t const in_have = in_rows - (f == fault::short_input ? 1 : 0);
  int64_t const out_have = out_rows + slack - (f == fault::short_output ? 1 : 0);
  int64_t const out_hidden = hidden + (f == fault::other_hidden ? 1 : 0);
  m.in = finite_values(r, std::max<int64_t>(in_have, 0) * hidden);
  m.out.assign(static_cast<std::size_t>(std::max<int64_t>(out_have, 0) * out_hidden), poison());
  m.in_view = {m.in.data(), in_have, hidden};
  m.out_view = {m.out.data(), out_have, out_hidden};
  switch (f) {
    case fault::none: break;
    case fault::short_input: m.why = "an input one row short"; break;
    case fault::short_output: m.why = "an output one row short"; break;
    case fault::null_input: m.in_view.data = nullptr; m.why = "a null input"; break;
    case fault::null_output: m.out_view.data = nullptr; m.why = "a null output"; break;
    case fault::other_hidden: m.why = "rows of different widths"; break;
    case fault::overlap:  // the input's last row is the output's first
      m.shared = finite_values(r, (in_rows + out_rows - 1) * hidden);
      m.in_view = {m.shared.data(), in_rows, hidden};
      m.out_view = {m.shared.data() + (in_rows - 1) * hidden, out_rows, hidden};
      m.why = "overlapping input and output";
      break;
    case fault::huge_hidden:  // 2^61 floats a row: the byte size overflows int64
      m.in_view = {m.in.data(), std::max<int64_t>(in_rows, 1), int64_t{1} << 61};
      m.out_view = {m.out.data(), std::max<int64_t>(out_rows, 1), int64_t{1} << 61};
      m.why = "a row width whose byte size overflows";
      break;
  }
  return m;
}

// Checks that `call` is rejected for `m.why` by operation `op` and writes nothing: outputs keep
// their poison and an overlapping buffer its values. Returns false (a rejected case).
template <class Call>
bool rejected(Call const& call, char const* op, matrices const& m, std::vector<float> const& weights_out) {
  auto const before = m.shared;
  expect_rejected(call, op, m.why);
  expect_untouched(m.out, 0, "output after a rejected call");
  expect_untouched(weights_out, 0, "weights output after a rejected call");
  expect(m.shared == before, "a rejected call wrote to the overlapping buffer");
  return false;
}

// The host data of a view's rows (the oracle's input).
inline std::vector<float> rows_of(moecomm::matrix_view<float const> v) {
  return std::vector<float>(v.data, v.data + v.rows * v.hidden);
}

}  // namespace fuzz
