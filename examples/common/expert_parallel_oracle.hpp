// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Example 02's problem and its oracle: every rank's tokens, gate and rows, made once; experts that
//! scale their rows (global expert e by e + 1), so that every output has a closed form; and the
//! check of one rank's output and gradients with plain loops that share no code with the library
//! but the element-type conversions.

#include "expert_parallel_options.hpp"
#include "format.hpp"
#include "inputs.hpp"
#include "zipf_gate.hpp"

#include <moecomm/moecomm.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace example_support {

using std::int32_t;
using std::int64_t;

// ---- the problem: every rank's inputs, made once on the main thread ------------------------------

//! Tokens on rank r: a little fewer on higher ranks (up to 1/16 fewer), so blocks differ in size.
inline int64_t tokens_of_rank(options const& o, int32_t r) { return o.tokens - (r * o.tokens) / (16 * o.ranks); }

template <class T>
struct problem {
  options o;
  int32_t per_node = 1, local_experts = 1;
  std::vector<int64_t> tokens, first_token;  //!< per rank; first_token = t_global of its token 0
  int64_t total_tokens = 0;
  std::vector<routing_data> gate;
  std::vector<moecomm::host_backend::buffer_type<T>> x, d_out;
  int64_t capacity = 0;  //!< C by the rule of semantics §7, computed here (0 when dropless)
};

template <class T>
problem<T> make_problem(options const& o) {
  moecomm::host_backend const be;
  problem<T> p;
  p.o = o;
  p.per_node = o.ranks / o.nodes;
  p.local_experts = o.experts / o.ranks;
  for (int32_t r = 0; r < o.ranks; ++r) {
    int64_t const tokens = tokens_of_rank(o, r);
    p.tokens.push_back(tokens);
    p.first_token.push_back(p.total_tokens);
    p.total_tokens += tokens;
    std::seed_seq seq{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(o.seed >> 32),
                      static_cast<std::uint32_t>(r)};
    std::mt19937_64 rng(seq);
    p.gate.push_back(route_tokens(tokens, o.experts, o.topk, o.zipf, rng));
    for (auto* rows : {&p.x, &p.d_out}) {
      rows->push_back(be.allocate<T>(tokens * o.hidden));
      fill_random_rows(rows->back().data(), tokens * o.hidden, rng);
    }
    if (o.capacity_factor > 0) {  // division first, in double (semantics §7); agreed as the maximum
      auto const c =
          static_cast<int64_t>(std::ceil((static_cast<double>(tokens * o.topk) / o.experts) * o.capacity_factor));
      p.capacity = std::max(p.capacity, c);
    }
  }
  return p;
}

// ---- the experts --------------------------------------------------------------------------------

template <class T>
float f32(T v) {
  return moecomm::dtype_traits<T>::to_float(v);
}
template <class T>
T from32(float v) {
  return moecomm::dtype_traits<T>::from_float(v);
}

//! Global expert e multiplies its rows by (e + 1), rounded once to T.
template <class T>
T scaled(T v, int32_t expert) {
  return from32<T>(f32(v) * static_cast<float>(expert + 1));
}

//! Rank r's experts: local expert l is global expert r * E / R + l. The backward of a scaling is
//! the same scaling of the gradient.
template <class T>
struct scale_experts {
  int32_t first_expert;
  void operator()(int32_t l, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    for (int64_t i = 0; i < in.rows * in.hidden; ++i) out.data[i] = scaled(in.data[i], first_expert + l);
  }
  void operator()(int32_t l, moecomm::matrix_view<T const>, moecomm::matrix_view<T const> d_out,
                  moecomm::matrix_view<T> d_in) const {
    for (int64_t i = 0; i < d_out.rows * d_out.hidden; ++i) d_in.data[i] = scaled(d_out.data[i], first_expert + l);
  }
};

// ---- the oracle: plain loops, no library code ---------------------------------------------------

//! Philox4x32-10 (Salmon et al., SC'11), the first output word, written out again here so that the
//! drop_random oracle does not borrow the library's generator. Key words: the seed's low, high half.
inline std::uint32_t philox_word0(std::uint64_t key, std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    std::uint64_t const p0 = std::uint64_t{0xD2511F53u} * c0;
    std::uint64_t const p1 = std::uint64_t{0xCD9E8D57u} * c2;
    std::uint32_t const n0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ k0;
    std::uint32_t const n1 = static_cast<std::uint32_t>(p1);
    std::uint32_t const n2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ k1;
    std::uint32_t const n3 = static_cast<std::uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

//! The routing with the slots the capacity rule drops set to -1 (semantics §8): for each expert,
//! its slots in (t, k) order, stably sorted by score, descending; the first C survive.
inline std::vector<int32_t> kept_by_rule(routing_data const& g, int64_t tokens, options const& o, policy_id policy,
                                  int64_t capacity, int64_t first_token) {
  std::vector<int32_t> kept = g.idx;
  if (policy == policy_id::dropless) return kept;
  int32_t const K = o.topk;
  auto const score = [&](int64_t slot) -> float {
    switch (policy) {
      case policy_id::probability:
        return g.weights[static_cast<std::size_t>(slot)];
      case policy_id::random: {
        std::uint32_t const x0 = philox_word0(o.seed, static_cast<std::uint32_t>(first_token + slot / K),
                                              static_cast<std::uint32_t>(slot % K), 0u /* layer */, 0u);
        return static_cast<float>(x0 >> 8) / 16777216.0f;
      }
      default:
        return 0.0f;  // position: (t, k) order alone
    }
  };
  std::vector<std::vector<int64_t>> slots_of(static_cast<std::size_t>(o.experts));
  for (int64_t s = 0; s < tokens * K; ++s)
    slots_of[static_cast<std::size_t>(g.idx[static_cast<std::size_t>(s)])].push_back(s);
  for (auto& slots : slots_of) {
    if (static_cast<int64_t>(slots.size()) <= capacity) continue;
    std::vector<std::pair<float, int64_t>> ranked;
    for (int64_t s : slots) ranked.emplace_back(score(s), s);
    std::stable_sort(ranked.begin(), ranked.end(), [](auto const& a, auto const& b) { return a.first > b.first; });
    for (std::size_t i = static_cast<std::size_t>(capacity); i < ranked.size(); ++i)
      kept[static_cast<std::size_t>(ranked[i].second)] = -1;
  }
  return kept;
}

//! What one rank found in the checked step.
struct rank_result {
  moecomm::dispatch_report report;  //!< after forward + backward: all 4 all-to-alls of the step
  int64_t kept_disagree = 0;        //!< slots the plan kept (dropped) but the oracle's rule dropped (kept)
  int64_t bad_out_tokens = 0, bad_dx_tokens = 0, bad_dw_slots = 0;
  double dw_worst = 0;  //!< the largest |d_weights error| / tolerance
  int64_t tokens_partly_dropped = 0, tokens_fully_dropped = 0;
  bool replay_same_stats = true;  //!< the timed replay of the 4 all-to-alls sent what the step sent
  std::string first_problem;
};

template <class T>
bool same_value_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

//! Compares one rank's output, input gradient and weight gradient with plain loops over the kept
//! slots of the oracle's own capacity decision (which must equal the plan's).
template <class T, class Dispatcher>
rank_result check_rank(problem<T> const& p, int32_t me, policy_id policy, Dispatcher const& ds, T const* out,
                       T const* d_x, float const* d_w) {
  options const& o = p.o;
  int32_t const K = o.topk;
  int64_t const H = o.hidden, tokens = p.tokens[static_cast<std::size_t>(me)];
  routing_data const& g = p.gate[static_cast<std::size_t>(me)];
  T const* const x = p.x[static_cast<std::size_t>(me)].data();
  T const* const d_out = p.d_out[static_cast<std::size_t>(me)].data();
  rank_result res;
  res.report = ds.report();
  auto const kept = kept_by_rule(g, tokens, o, policy, p.capacity, p.first_token[static_cast<std::size_t>(me)]);
  int32_t const* const row_of = ds.plan().row_of();  // host memory: host_backend
  auto note = [&](std::string const& what) {
    if (res.first_problem.empty()) res.first_problem = "rank " + std::to_string(me) + ": " + what;
  };
  for (int64_t s = 0; s < tokens * K; ++s)
    if ((row_of[s] >= 0) != (kept[static_cast<std::size_t>(s)] >= 0)) {
      if (res.kept_disagree++ == 0)
        note("slot (" + std::to_string(s / K) + ", " + std::to_string(s % K) + ") is " +
             (row_of[s] >= 0 ? "kept" : "dropped") + " by the layer but not by the oracle's rule");
    }

  std::vector<float> acc(static_cast<std::size_t>(H)), dacc(static_cast<std::size_t>(H));
  for (int64_t t = 0; t < tokens; ++t) {
    T const* const xt = x + t * H;
    T const* const gt = d_out + t * H;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(dacc.begin(), dacc.end(), 0.0f);
    int32_t dropped = 0;
    for (int32_t k = 0; k < K; ++k) {
      auto const slot = static_cast<std::size_t>(t * K + k);
      int32_t const e = kept[slot];
      if (e < 0) {
        ++dropped;
        if (d_w[slot] != 0.0f && res.bad_dw_slots++ == 0) note("d_weights of a dropped slot is not 0");
        continue;
      }
      float const w = g.weights[slot];
      double dot = 0.0;  // d_w = y . d_out, in double: the library's fp32 sum is compared with a tolerance
      for (int64_t h = 0; h < H; ++h) {
        T const y = scaled(xt[h], e);                        // the expert's output row
        acc[h] = std::fma(w, f32(y), acc[h]);                // combine: fp32 FMA, ascending k
        T const d_y = scaled(from32<T>(w * f32(gt[h])), e);  // combine backward, then the expert's
        dacc[h] = dacc[h] + f32(d_y);                        // dispatch backward: fp32 sum, ascending k
        dot += static_cast<double>(f32(y)) * static_cast<double>(f32(gt[h]));
      }
      double const err = std::fabs(static_cast<double>(d_w[slot]) - dot);
      double const tolerance = 1e-5 * std::fabs(dot) + 1e-6 * static_cast<double>(H);
      res.dw_worst = std::max(res.dw_worst, err / tolerance);
      if (!(err <= tolerance) && res.bad_dw_slots++ == 0)
        note("d_weights[" + std::to_string(t) + "][" + std::to_string(k) + "] = " + format("%.9g", d_w[slot]) +
             ", oracle " + format("%.9g", dot));
    }
    res.tokens_partly_dropped += dropped > 0 ? 1 : 0;
    res.tokens_fully_dropped += dropped == K ? 1 : 0;
    for (int64_t h = 0; h < H; ++h)
      if (!same_value_bits(out[t * H + h], from32<T>(acc[static_cast<std::size_t>(h)]))) {
        if (res.bad_out_tokens++ == 0)
          note("out[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + format("%.9g", f32(out[t * H + h])) +
               ", oracle " + format("%.9g", acc[static_cast<std::size_t>(h)]));
        break;
      }
    for (int64_t h = 0; h < H; ++h)
      if (!same_value_bits(d_x[t * H + h], from32<T>(dacc[static_cast<std::size_t>(h)]))) {
        if (res.bad_dx_tokens++ == 0)
          note("d_x[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + format("%.9g", f32(d_x[t * H + h])) +
               ", oracle " + format("%.9g", dacc[static_cast<std::size_t>(h)]));
        break;
      }
  }
  return res;
}

//! What one configuration's run found: each rank's check, and rank 0's times.
struct run_result {
  algo_id algo;
  policy_id policy;
  std::vector<rank_result> ranks;
  std::vector<double> step_s;      //!< rank 0's wall clock per step (forward + backward), between barriers
  std::vector<double> exchange_s;  //!< the same step's 4 all-to-alls replayed alone
};

}  // namespace example_support
