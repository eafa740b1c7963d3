// SPDX-License-Identifier: Apache-2.0
#pragma once
// The router oracle (docs/semantics.md §15), written from the formulas with whole-row vectors and
// std::stable_sort for every top-k (the library picks in place without sorting): fp32 with the
// documented operation order, so it matches the library bit for bit on the host. A third,
// double-precision version of the loss with the selection held fixed (`router_loss_in_double`)
// lets the tests check both backwards against central finite differences.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace oracle {

struct router_options {
  int32_t top_k = 2;
  bool sigmoid = false;
  bool pre_softmax = false;
  int32_t num_groups = 0, group_top_k = 0;
  std::vector<float> bias;  // empty: none
  bool renormalize = false;
  float scaling = 1.0f;
  float aux_coeff = 0.0f, z_coeff = 0.0f;
};

struct router_forward_result {
  std::vector<int32_t> idx;          // [T][K]
  std::vector<float> w;              // [T][K]
  std::vector<int32_t> counts;       // [E], of idx
  std::vector<int32_t> aux_counts;   // [E], of the aux loss's own top-k
  float aux = 0.0f, z = 0.0f;
};

namespace router_detail {

constexpr float eps = 1e-20f;

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The first `n` of `ids`, ordered by larger key, ties to the lower id (stable sort of ascending ids).
inline std::vector<int32_t> top(std::vector<int32_t> ids, std::vector<float> const& key, int32_t n) {
  std::sort(ids.begin(), ids.end());
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
  ids.resize(static_cast<std::size_t>(n));
  return ids;
}

inline std::vector<int32_t> iota(int32_t first, int32_t count) {
  std::vector<int32_t> v(static_cast<std::size_t>(count));
  std::iota(v.begin(), v.end(), first);
  return v;
}

// A token's sum over its experts: blocks of 16 experts, ascending within each, then the blocks'
// partials ascending (docs/semantics.md §15).
template <class F>
float blocked_sum(std::vector<float> const& v, F const& term) {
  float sum = 0.0f;
  for (std::size_t b = 0; b < v.size(); b += 16) {
    float part = 0.0f;
    for (std::size_t e = b; e < std::min(v.size(), b + 16); ++e) part = part + term(v[e]);
    sum = sum + part;
  }
  return sum;
}

// One token's quantities, fp32.
struct token {
  std::vector<float> l, p, sig, q;  // logits, softmax, sigmoid, aux scores
  float max = 0, sum = 0, lse = 0, sum_sig = 0;

  token(float const* row, int32_t E, bool sigmoid_scores) : l(row, row + E) {
    max = -std::numeric_limits<float>::infinity();
    for (float x : l) max = std::max(max, x);
    sum = blocked_sum(l, [&](float x) { return std::exp(x - max); });
    lse = max + std::log(sum);
    for (float x : l) {
      p.push_back(std::exp(x - max) / sum);
      sig.push_back(sigmoid(x));
    }
    if (sigmoid_scores) sum_sig = blocked_sum(sig, [](float s) { return s; });
    for (int32_t e = 0; e < E; ++e) q.push_back(sigmoid_scores ? sig[e] / (sum_sig + eps) : p[e]);
  }
};

inline std::vector<int32_t> select(token const& tk, router_options const& o) {
  auto const E = static_cast<int32_t>(tk.l.size());
  std::vector<float> key(static_cast<std::size_t>(E));
  for (int32_t e = 0; e < E; ++e) {
    if (!o.sigmoid && !o.pre_softmax) key[e] = tk.l[e];
    else key[e] = (o.sigmoid ? tk.sig[e] : tk.p[e]) + (o.bias.empty() ? 0.0f : o.bias[e]);
  }
  if (o.num_groups == 0) return top(iota(0, E), key, o.top_k);
  int32_t const size = E / o.num_groups;
  std::vector<float> group_score;
  for (int32_t g = 0; g < o.num_groups; ++g) {
    float sum = 0.0f;
    for (int32_t e : top(iota(g * size, size), key, o.top_k / o.group_top_k)) sum = sum + key[e];
    group_score.push_back(sum);
  }
  std::vector<int32_t> candidates;
  for (int32_t g : top(iota(0, o.num_groups), group_score, o.group_top_k))
    for (int32_t e = g * size; e < (g + 1) * size; ++e) candidates.push_back(e);
  return top(candidates, key, o.top_k);
}

// s_k before renormalisation and scaling.
inline std::vector<float> raw_weights(token const& tk, std::vector<int32_t> const& sel, router_options const& o) {
  std::vector<float> s;
  if (o.sigmoid || o.pre_softmax) {
    for (int32_t e : sel) s.push_back(o.sigmoid ? tk.sig[e] : tk.p[e]);
    return s;
  }
  float m = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  for (int32_t e : sel) m = std::max(m, tk.l[e]);
  for (int32_t e : sel) sum = sum + std::exp(tk.l[e] - m);
  for (int32_t e : sel) s.push_back(std::exp(tk.l[e] - m) / sum);
  return s;
}

inline float renormaliser(std::vector<float> const& s, router_options const& o) {
  if (!o.renormalize) return 1.0f;
  float sum = 0.0f;
  for (float x : s) sum = sum + x;
  return sum + eps;
}

}  // namespace router_detail

inline router_forward_result router_forward(std::vector<float> const& logits, int64_t T, int32_t E,
                                            router_options const& o) {
  using namespace router_detail;
  router_forward_result r;
  r.counts.assign(static_cast<std::size_t>(E), 0);
  r.aux_counts.assign(static_cast<std::size_t>(E), 0);
  // The losses' token sums in blocks of 64 tokens (docs/semantics.md §15): within a block ascending,
  // then the blocks' partials ascending.
  int64_t const block = 64;
  std::vector<float> column(static_cast<std::size_t>(E), 0.0f), column_block(column);
  float z = 0.0f, z_block = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    token const tk(logits.data() + t * E, E, o.sigmoid);
    auto const sel = select(tk, o);
    auto const s = raw_weights(tk, sel, o);
    float const d = renormaliser(s, o);
    for (int32_t k = 0; k < o.top_k; ++k) {
      r.idx.push_back(sel[k]);
      r.w.push_back(s[k] / d * o.scaling);
      ++r.counts[sel[k]];
    }
    for (int32_t e : top(iota(0, E), tk.q, o.top_k)) ++r.aux_counts[e];
    for (int32_t e = 0; e < E; ++e) column_block[e] = column_block[e] + tk.q[e];
    z_block = std::fma(tk.lse, tk.lse, z_block);
    if ((t + 1) % block == 0 || t + 1 == T) {
      for (int32_t e = 0; e < E; ++e) column[e] = column[e] + column_block[e];
      z = z + z_block;
      std::fill(column_block.begin(), column_block.end(), 0.0f);
      z_block = 0.0f;
    }
  }
  if (T > 0) {
    float aux = 0.0f;
    for (int32_t e = 0; e < E; ++e) aux = std::fma(column[e], static_cast<float>(r.aux_counts[e]), aux);
    r.aux = aux * static_cast<float>(double(E) / (double(o.top_k) * double(T) * double(T)));
    r.z = z / static_cast<float>(T);
  }
  return r;
}

// d_logits [T][E] for upstream `g` [T][K], fp32, by the formulas of §15.
inline std::vector<float> router_backward(std::vector<float> const& logits, int64_t T, int32_t E,
                                          router_options const& o, std::vector<float> const& g) {
  using namespace router_detail;
  auto const fwd = router_forward(logits, T, E, o);
  std::vector<float> dl;
  if (T == 0) return dl;
  float const aux_scale =
      o.aux_coeff > 0 ? static_cast<float>(double(o.aux_coeff) * E / (double(o.top_k) * double(T) * double(T))) : 0.0f;
  float const z_scale = static_cast<float>(2.0 * double(o.z_coeff) / double(T));
  for (int64_t t = 0; t < T; ++t) {
    token const tk(logits.data() + t * E, E, o.sigmoid);
    std::vector<int32_t> const sel(fwd.idx.begin() + t * o.top_k, fwd.idx.begin() + (t + 1) * o.top_k);
    auto const s = raw_weights(tk, sel, o);
    float const d = renormaliser(s, o);
    std::vector<float> ga, ds;
    float dot = 0.0f;
    for (int32_t k = 0; k < o.top_k; ++k) ga.push_back(g[t * o.top_k + k] * o.scaling);
    for (int32_t k = 0; k < o.top_k; ++k) dot = std::fma(ga[k], s[k], dot);
    for (int32_t k = 0; k < o.top_k; ++k) ds.push_back(o.renormalize ? (ga[k] - dot / d) / d : ga[k]);
    float inner = 0.0f;
    for (int32_t k = 0; k < o.top_k; ++k) inner = std::fma(ds[k], s[k], inner);
    std::vector<float> gamma;
    float aux_inner = 0.0f;
    for (int32_t e = 0; e < E; ++e) gamma.push_back(aux_scale * static_cast<float>(fwd.aux_counts[e]));
    for (int32_t e = 0; e < E; ++e) aux_inner = std::fma(gamma[e], tk.q[e], aux_inner);
    for (int32_t e = 0; e < E; ++e) {
      auto const at = std::find(sel.begin(), sel.end(), e);
      bool const chosen = at != sel.end();
      auto const k = static_cast<std::size_t>(at - sel.begin());
      float const slope = sigmoid(tk.l[e]) * sigmoid(-tk.l[e]);
      float v = 0.0f;
      if (!o.sigmoid && o.pre_softmax) v = tk.p[e] * ((chosen ? ds[k] : 0.0f) - inner);
      else if (chosen) v = o.sigmoid ? ds[k] * slope : s[k] * (ds[k] - inner);
      if (o.aux_coeff > 0)
        v = v + (o.sigmoid ? (gamma[e] - aux_inner) / (tk.sum_sig + eps) * slope : tk.p[e] * (gamma[e] - aux_inner));
      if (z_scale != 0.0f) v = v + (z_scale * tk.lse) * tk.p[e];
      dl.push_back(v);
    }
  }
  return dl;
}

// sum_{t,k} g·w + aux_coeff·aux + z_coeff·z in double, with the selection `idx` and the aux
// counts held fixed: the function whose gradient `router_backward` is.
inline double router_loss_in_double(std::vector<double> const& logits, int64_t T, int32_t E, router_options const& o,
                                    std::vector<int32_t> const& idx, std::vector<int32_t> const& aux_counts,
                                    std::vector<float> const& g) {
  double loss = 0.0, aux = 0.0, z = 0.0;
  int32_t const K = o.top_k;
  for (int64_t t = 0; t < T; ++t) {
    double const* l = logits.data() + t * E;
    double m = -std::numeric_limits<double>::infinity(), sum = 0.0, sum_sig = 0.0;
    for (int32_t e = 0; e < E; ++e) m = std::max(m, l[e]);
    for (int32_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
    auto const sig = [&](int32_t e) { return 1.0 / (1.0 + std::exp(-l[e])); };
    for (int32_t e = 0; e < E; ++e) sum_sig += sig(e);
    auto const softmax = [&](int32_t e) { return std::exp(l[e] - m) / sum; };
    double sel_sum = 0.0;  // softmax after the top-k: over the selected logits
    for (int32_t k = 0; k < K; ++k) sel_sum += std::exp(l[idx[t * K + k]]);
    std::vector<double> s;
    for (int32_t k = 0; k < K; ++k) {
      int32_t const e = idx[t * K + k];
      s.push_back(o.sigmoid ? sig(e) : o.pre_softmax ? softmax(e) : std::exp(l[e]) / sel_sum);
    }
    double total = 0.0;
    for (double x : s) total += x;
    for (int32_t k = 0; k < K; ++k) loss += g[t * K + k] * (o.renormalize ? s[k] / total : s[k]) * o.scaling;
    for (int32_t e = 0; e < E; ++e)
      aux += aux_counts[e] * (o.sigmoid ? sig(e) / sum_sig : softmax(e));
    double const lse = m + std::log(sum);
    z += lse * lse;
  }
  if (T == 0) return 0.0;
  return loss + o.aux_coeff * aux * E / (double(K) * T * T) + o.z_coeff * z / double(T);
}

}  // namespace oracle
