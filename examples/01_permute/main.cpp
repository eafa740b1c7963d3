// SPDX-License-Identifier: Apache-2.0
//! Example 01: permute -> experts -> unpermute on the host back-end.
//!
//! 1. A skewed gate routes every token to K distinct experts (Zipf-distributed popularity).
//! 2. `make_dispatch_layout` counts tokens per expert and per (notional) rank.
//! 3. `make_permute_plan` decides the expert-major row of every (token, slot).
//! 4. `permute` groups the token rows by expert; the "experts" are the identity; `unpermute`
//!    combines each token's rows with its routing weights. Both results are checked bit for bit.
//! 5. Both ops are timed and set beside a memcpy of the same bytes, the bound a pure
//!    data-movement op can hope for.
//!
//! Run with --help for the flags. Everything runs on one CPU thread.

#include "../common/dispatch_tables.hpp"
#include "../common/exit_code.hpp"
#include "../common/flags.hpp"
#include "../common/format.hpp"
#include "../common/inputs.hpp"
#include "../common/timing.hpp"
#include "../common/zipf_gate.hpp"

#include <moecomm/moecomm.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace example_support;  // flag checks, formatting, timing, the Zipf gate (examples/common/)

// ---- options ------------------------------------------------------------------------------------

#if MOECOMM_HAS_CUDA_FP16()
constexpr char const* default_dtype = "bf16";
constexpr char const* dtype_choices = "float|bf16";
#else
constexpr char const* default_dtype = "float";
constexpr char const* dtype_choices = "float (bf16 needs the CUDA headers on the include path)";
#endif

struct options {
  std::int64_t tokens = 8192;
  std::int64_t hidden = 4096;
  std::int32_t experts = 16;
  std::int32_t topk = 2;
  double zipf = 1.2;
  std::uint64_t seed = 1;
  std::string dtype = default_dtype;
  int iters = 10;
};

constexpr char const* program = "example_01_permute";
//! What `--help` says the example does.
constexpr char const* about = R"(Routes tokens with a skewed (Zipf) gate, permutes them into expert-major order, combines
them back with the routing weights, checks both results bit for bit and times them
against memcpy. Host back-end, one thread.)";

options parse_options(int argc, char** argv) {
  options const o = parse_flags<options>(program, about, argc, argv, [](flag_set& flags, options& o) {
    flags.add("--tokens", "T", "tokens on this rank", o.tokens, 0, std::numeric_limits<std::int32_t>::max())
        .add("--hidden", "H", "elements per token row", o.hidden, 1, std::int64_t{1} << 24)
        .add("--experts", "E", "number of experts", o.experts, 1, 1 << 16)
        .add("--topk", "K", "distinct experts per token, K <= E", o.topk, 1, 1 << 16)
        .add("--zipf", "s", "gate skew: P(expert e) ~ 1/(e+1)^s; 0 is uniform", o.zipf, 0.0, 16.0)
        .add("--seed", "N", "seed of the std::mt19937_64 generator", o.seed)
        .add("--dtype", "D", std::string("element type: ") + dtype_choices, o.dtype, {"float", "bf16"})
        .add("--iters", "N", "timing repetitions; the median and min-max are shown", o.iters, 1, 100000);
  });
  if (o.dtype == "bf16" && !MOECOMM_HAS_CUDA_FP16())
    usage_error(program, "--dtype '" + o.dtype + "' is not available; choose " + dtype_choices);
  if (o.topk > o.experts)
    usage_error(program, "--topk " + std::to_string(o.topk) + " exceeds --experts " + std::to_string(o.experts) +
                ": every token picks K distinct experts");
  if (o.tokens * o.topk > std::numeric_limits<std::int32_t>::max())
    usage_error(program, "--tokens x --topk = " + std::to_string(o.tokens * o.topk) +
                " slots exceed moecomm's int32 row ids (2^31 - 1)");
  return o;
}

void copy_bytes(void* dst, void const* src, std::size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// ---- the example --------------------------------------------------------------------------------

template <class Elem>
int run(options const& o) {
  using traits = moecomm::dtype_traits<Elem>;
  std::int64_t const T = o.tokens, H = o.hidden;
  std::int32_t const E = o.experts, K = o.topk;
  std::int32_t const R = std::gcd(E, 4);  // 4 notional ranks when E allows it
  double const row_bytes = static_cast<double>(H) * sizeof(Elem);

  std::printf("moecomm %d.%d.%d - example 01: permute -> experts -> unpermute\n", MOECOMM_VERSION_MAJOR,
              MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH);
  std::printf("=====================================================================\n");
  std::printf("  tokens T = %" PRId64 ", hidden H = %" PRId64 ", dtype %s (x is %s)\n", T, H, traits::name,
              format_bytes(static_cast<double>(T) * row_bytes).c_str());
  std::printf("  experts E = %d, top-K = %d, gate: Zipf(s = %.2f), seed %" PRIu64 "\n", E, K, o.zipf, o.seed);
  std::printf("  backend: host, 1 thread\n\n");

  moecomm::host_backend be;  // one thread; its memory is ordinary host memory
  std::mt19937_64 rng(o.seed);
  routing_data const gate = route_tokens(T, E, K, o.zipf, rng);
  moecomm::routing_view const routing{gate.idx.data(), gate.weights.data(), T, K};

  // -- 1. dispatch layout -------------------------------------------------------------------------
  auto const placement = moecomm::contiguous_placement(E, R);
  auto const layout = moecomm::make_dispatch_layout(be, routing, placement);
  std::int32_t const L = placement.num_local_experts();
  std::printf("1. Dispatch layout\n");
  std::printf("   contiguous placement: E / R = %d consecutive expert%s on each of R = %d notional rank%s\n\n", L,
              L == 1 ? "" : "s", R, R == 1 ? "" : "s");
  print_dispatch_layout(layout, placement, T * static_cast<std::int64_t>(K));

  // -- 2. permute plan ----------------------------------------------------------------------------
  auto const plan = moecomm::make_permute_plan(be, routing, E);
  std::int64_t const P = plan.num_rows();
  std::printf("2. Permute plan\n");
  std::printf("   P = %" PRId64 " permuted rows (%" PRId64 " token%s x %d slot%s, none masked), grouped by expert\n", P,
              T, T == 1 ? "" : "s", K, K == 1 ? "" : "s");
  std::printf("   expert offsets (first row of each expert's block, then P):\n  ");
  int column = 3;
  for (std::int32_t e = 0; e <= E; ++e) {
    std::string const item = " " + std::to_string(plan.expert_offsets()[e]);
    if (column + static_cast<int>(item.size()) > 100) {
      std::printf("\n  ");
      column = 3;
    }
    std::printf("%s", item.c_str());
    column += static_cast<int>(item.size());
  }
  std::printf("\n   where the first tokens go:\n");
  if (T == 0) std::printf("     (no tokens)\n");
  for (std::int64_t t = 0; t < std::min<std::int64_t>(T, 3); ++t) {
    std::string line = "     token " + std::to_string(t) + " ->";
    std::size_t const indent = line.size();
    for (std::int32_t k = 0; k < K; ++k) {
      auto const slot = static_cast<std::size_t>(t * K + k);
      std::string item = " expert " + std::to_string(gate.idx[slot]) + " row " + std::to_string(plan.row_of()[slot]) +
                         format(" (weight %.2f)", static_cast<double>(gate.weights[slot])) + (k + 1 < K ? "," : "");
      if (line.size() > indent && line.size() + item.size() > 100) {  // wrap long top-k lists
        std::printf("%s\n", line.c_str());
        line = std::string(indent, ' ');
      }
      line += item;
    }
    std::printf("%s\n", line.c_str());
  }
  std::printf("\n");

  // -- 3. permute, identity experts, unpermute: check bit for bit ----------------------------------
  auto x_buf = be.allocate<Elem>(T * H);
  auto perm_buf = be.allocate<Elem>(P * H);
  auto out_buf = be.allocate<Elem>(T * H);
  Elem* const x = x_buf.data();
  Elem* const perm = perm_buf.data();
  Elem* const out = out_buf.data();
  fill_random_rows(x, T * H, rng);
  moecomm::matrix_view<Elem const> const x_view{x, T, H};
  moecomm::matrix_view<Elem> const perm_view{perm, P, H};
  moecomm::matrix_view<Elem const> const y_view = perm_view;  // experts = identity: y is the permuted rows
  moecomm::matrix_view<Elem> const out_view{out, T, H};

  std::printf("3. Round trip: permute -> experts (identity) -> weighted unpermute\n");
  moecomm::permute(be, plan, x_view, perm_view);
  for (std::int64_t r = 0; r < P; ++r) {
    std::int32_t const t = plan.token_of()[r];
    std::int32_t const k = plan.slot_of()[r];
    std::int32_t const e = gate.idx[static_cast<std::size_t>(t) * K + k];
    bool const mapped = plan.row_of()[static_cast<std::int64_t>(t) * K + k] == r &&
                        plan.expert_offsets()[e] <= r && r < plan.expert_offsets()[e + 1];
    bool const copied = std::memcmp(perm + r * H, x + static_cast<std::int64_t>(t) * H, H * sizeof(Elem)) == 0;
    if (!mapped || !copied) {
      std::printf("   permute: FAILED at row %" PRId64 " (token %d, slot %d, expert %d): %s\n", r, t, k, e,
                  mapped ? "the row is not a bit copy of its token" : "the row is outside its expert's block");
      std::printf("   round trip: FAILED\n");
      return 1;
    }
  }
  std::printf("   permute:    OK  %" PRId64 " rows, each a bit copy of its token's row, in its expert's block\n", P);

  moecomm::unpermute<moecomm::weighted>(be, plan, y_view, out_view);
  std::int64_t equal_to_x = 0;
  std::vector<float> acc(static_cast<std::size_t>(H));
  std::vector<Elem> expected(static_cast<std::size_t>(H));
  for (std::int64_t t = 0; t < T; ++t) {
    Elem const* xt = x + t * H;
    Elem const* got = out + t * H;
    // y[row_of[t][k]] = x[t] (identity experts), so the reference reads x directly:
    // acc = fma(w[K-1], x, ... fma(w[0], x, 0)), fp32, ascending k, then one rounding to the element type.
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int32_t k = 0; k < K; ++k) {
      if (plan.row_of()[t * K + k] < 0) continue;  // a masked slot adds nothing (there are none here)
      float const w = gate.weights[static_cast<std::size_t>(t * K + k)];
      for (std::int64_t h = 0; h < H; ++h)
        acc[static_cast<std::size_t>(h)] = std::fma(w, traits::to_float(xt[h]), acc[static_cast<std::size_t>(h)]);
    }
    for (std::int64_t h = 0; h < H; ++h)
      expected[static_cast<std::size_t>(h)] = traits::from_float(acc[static_cast<std::size_t>(h)]);
    if (std::memcmp(expected.data(), got, H * sizeof(Elem)) != 0) {
      std::int64_t h = 0;
      while (std::memcmp(&expected[static_cast<std::size_t>(h)], got + h, sizeof(Elem)) == 0) ++h;
      std::printf("   unpermute:  FAILED at token %" PRId64 ", h = %" PRId64 ": got %.9g, expected %.9g\n", t, h,
                  static_cast<double>(traits::to_float(got[h])),
                  static_cast<double>(traits::to_float(expected[static_cast<std::size_t>(h)])));
      std::printf("   round trip: FAILED\n");
      return 1;
    }
    for (std::int64_t h = 0; h < H; ++h) equal_to_x += std::memcmp(got + h, xt + h, sizeof(Elem)) == 0;
  }
  std::printf("   unpermute:  OK  out[t] = round(sum_k w[t][k] * x[t]), fp32 fma in ascending k\n");
  if (T > 0 && equal_to_x == T * H)
    std::printf("                   (a token's weights sum to 1, so out ~ x: here every value equals x)\n");
  else if (T > 0)
    std::printf("                   (a token's weights sum to 1, so out ~ x: %.2f%% of values equal x)\n",
                100.0 * static_cast<double>(equal_to_x) / static_cast<double>(T * H));
  std::printf("   round trip: OK (all %" PRId64 " x %" PRId64 " values bit-exact)\n\n", T, H);

  // -- 4. timing ----------------------------------------------------------------------------------
  // Both ops only move data, so a memcpy that reads and writes as many bytes bounds them: that
  // memcpy's time is the model's prediction for the op. The memcpy runs inside the permuted buffer,
  // between its two halves (its contents are checked already; they stay values of x), so the
  // baseline costs no extra memory.
  double const permute_bytes = 2.0 * static_cast<double>(P) * row_bytes;   // read P rows of x, write P rows
  double const unpermute_bytes = static_cast<double>(P + T) * row_bytes;  // read P rows, write T rows
  auto* const perm_bytes = reinterpret_cast<unsigned char*>(perm);
  std::size_t const half = static_cast<std::size_t>(P * H) * sizeof(Elem) / 2;
  auto memcpy_bytes = [&](double bytes) {  // copies bytes / 2 (read once, written once): lower half -> upper, back
    auto const n = static_cast<std::size_t>(bytes / 2);  // <= 2 * half, since P >= T (K >= 1, nothing masked)
    copy_bytes(perm_bytes + half, perm_bytes, n / 2);
    copy_bytes(perm_bytes, perm_bytes + half, n - n / 2);
  };

  std::printf("4. Timing (median (min-max) of %d call%s, steady_clock; bytes = read + written)\n", o.iters,
              o.iters == 1 ? "" : "s");
  if (P == 0) {
    std::printf("   nothing to time: no rows to move\n\n");
    return 0;
  }
  std::vector<double> t_permute, t_unpermute, t_copy_p, t_copy_u;
  for (int i = 0; i < o.iters; ++i) {  // interleaved, so drifts in clock speed hit all four alike
    t_permute.push_back(seconds_of([&] { moecomm::permute(be, plan, x_view, perm_view); }));
    t_copy_p.push_back(seconds_of([&] { memcpy_bytes(permute_bytes); }));
    t_unpermute.push_back(seconds_of([&] { moecomm::unpermute<moecomm::weighted>(be, plan, y_view, out_view); }));
    t_copy_u.push_back(seconds_of([&] { memcpy_bytes(unpermute_bytes); }));
  }

  struct row {
    char const* name;
    double bytes;
    spread measured;
    double predicted;
  };
  row const results[] = {{"permute", permute_bytes, spread_of(t_permute), spread_of(t_copy_p).median},
                         {"unpermute", unpermute_bytes, spread_of(t_unpermute), spread_of(t_copy_u).median}};
  std::printf("   %-9s  %11s  %26s  %7s  %17s   %s\n", "op", "bytes", "time", "GB/s", "memcpy same bytes",
              "vs memcpy");
  for (row const& r : results) {
    double const measured = r.measured.median;
    std::string const gbs = measured > 0 ? format("%.2f", r.bytes / measured / 1e9) : "-";
    std::string const ratio = measured > 0 ? format("%.2fx memcpy", r.predicted / measured) : "-";
    std::printf("   %-9s  %11s  %26s  %7s  %17s   %s\n", r.name, format_bytes(r.bytes).c_str(),
                format_spread(r.measured).c_str(), gbs.c_str(), format_time(r.predicted).c_str(), ratio.c_str());
  }
  if (permute_bytes < 64.0 * 1024 * 1024)
    std::printf("   (a working set this small can stay in the CPU caches: these are not DRAM numbers)\n");
  std::printf("\n   model: both ops only move bytes, so a memcpy of the same bytes, timed in this run, predicts them\n");
  for (row const& r : results)
    std::printf("   %-10s predicted (memcpy-bound): %s, measured: %s\n", (std::string(r.name) + ":").c_str(),
                format_time(r.predicted).c_str(), format_time(r.measured.median).c_str());
  if (permute_bytes >= 64.0 * 1024 * 1024 && results[1].predicted < 0.5 * results[1].measured.median)
    std::printf("   (unpermute misses the bound: on one core, converting and FMA-ing each element costs more\n"
                "    than moving it, so this op is limited by arithmetic, not by memory)\n");
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  options const o = parse_options(argc, argv);
  return exit_code_of(program, "fewer --tokens or a smaller --hidden", [&] {
#if MOECOMM_HAS_CUDA_FP16()
    if (o.dtype == "bf16") return run<__nv_bfloat16>(o);
#endif
    return run<float>(o);
  });
}
