// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The router's per-token arithmetic (docs/semantics.md §15), written once as `MOECOMM_HOST_DEVICE`
//! functors for the host and CUDA back-ends: row statistics, scores, the top-k with its tie rule,
//! group-limited selection, the weights, and the backward to the logits.
//!
//! Everything is fp32 with one rounding per written operation (`add32`, `mul32`, `fma32`,
//! `div32`) and sums in ascending index order from +0.0, so a serial oracle can reproduce the bits.
//! Values the backward needs are recomputed from the saved logits by the same functions, so they
//! are the forward's bits.

#include <moecomm/config.hpp>
#include <moecomm/core/atomic.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/rows/router/router_config.hpp>
#include <moecomm/rows/validate_routing.hpp>

#include <cmath>
#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

// ---- fp32 primitives --------------------------------------------------------------------------

inline constexpr float router_infinity = __builtin_huge_valf();
//! Megatron-LM's guard in the sigmoid renormalisations: `s / (sum + 1e-20)`.
inline constexpr float router_epsilon = 1e-20f;

MOECOMM_HOST_DEVICE inline float exp32(float x) {
#if MOECOMM_DEVICE_PASS()
  return expf(x);
#else
  return std::exp(x);
#endif
}

MOECOMM_HOST_DEVICE inline float log32(float x) {
#if MOECOMM_DEVICE_PASS()
  return logf(x);
#else
  return std::log(x);
#endif
}

MOECOMM_HOST_DEVICE inline float sigmoid32(float x) { return div32(1.0f, add32(1.0f, exp32(-x))); }

//! `d sigmoid / dx` as `sigmoid(x) * sigmoid(-x)`: accurate in both tails, 0 at +-inf.
MOECOMM_HOST_DEVICE inline float sigmoid_slope(float x) { return mul32(sigmoid32(x), sigmoid32(-x)); }

// ---- ranking: larger key first, ties to the lower id ----------------------------------------

//! NaN ranks as -inf (reachable only with `check_values` off), which keeps the order total.
MOECOMM_HOST_DEVICE inline float rank_key(float x) { return is_nan(x) ? -router_infinity : x; }

MOECOMM_HOST_DEVICE inline bool ranks_before(float key_a, std::int32_t a, float key_b, std::int32_t b) {
  return key_a > key_b || (key_a == key_b && a < b);
}

//! Calls `pick(rank, id, rank_key(key(id)))` for the `count` best ids of `[first, last)` whose
//! group (`id / group_size`) has its bit set in `groups`, best first. Each round takes the best id
//! ranked after the previous pick, so no scratch is needed; `count` ids are found whenever that
//! many are eligible.
template <class Key, class Pick>
MOECOMM_HOST_DEVICE void pick_top(std::int32_t first, std::int32_t last, std::int32_t count, std::int32_t group_size,
                                  std::uint64_t groups, Key const& key, Pick&& pick) {
  bool const every_group = groups == ~std::uint64_t{0};  // spares the division per id
  std::int32_t previous = -1;
  float previous_key = 0.0f;
  for (std::int32_t rank = 0; rank < count; ++rank) {
    std::int32_t best = -1;
    float best_key = 0.0f;
    for (std::int32_t id = first; id < last; ++id) {
      if (!every_group && ((groups >> (id / group_size)) & 1u) == 0u) continue;
      float const k = rank_key(key(id));
      if (previous >= 0 && !ranks_before(previous_key, previous, k, id)) continue;  // picked already
      if (best < 0 || ranks_before(k, id, best_key, best)) {
        best = id;
        best_key = k;
      }
    }
    pick(rank, best, best_key);
    previous = best;
    previous_key = best_key;
  }
}

// ---- one token's row ----------------------------------------------------------------------------

//! Per-token values kept from the forward for the losses and the backward.
struct router_row_stats {
  float max;          //!< max_e l[e]
  float sum_exp;      //!< sum_e exp(l[e] - max), blocked (expert_blocked_sum)
  float lse;          //!< max + log(sum_exp)
  float sum_sigmoid;  //!< sum_e sigmoid(l[e]), blocked (sigmoid only; else 0)
};

//! A token's sums over its experts run in blocks of this many experts: ascending within a block,
//! then the blocks' partials ascending (docs/semantics.md §15). Fixed, so every back-end gets the
//! same bits; the rounding error grows with 16 + E/16 terms instead of E.
inline constexpr std::int32_t router_expert_block = 16;

//! `sum_{e < experts} term(e)` in the blocked order above.
template <class Term>
MOECOMM_HOST_DEVICE float expert_blocked_sum(std::int32_t experts, Term const& term) {
  float sum = 0.0f;
  for (std::int32_t b = 0; b < experts; b += router_expert_block) {
    std::int32_t const end = experts - b < router_expert_block ? experts : b + router_expert_block;
    float part = 0.0f;
    for (std::int32_t e = b; e < end; ++e) part = add32(part, term(e));
    sum = add32(sum, part);
  }
  return sum;
}

MOECOMM_HOST_DEVICE inline router_row_stats make_row_stats(float const* l, std::int32_t experts, bool sigmoid) {
  router_row_stats s{-router_infinity, 0.0f, 0.0f, 0.0f};
  for (std::int32_t e = 0; e < experts; ++e) s.max = l[e] > s.max ? l[e] : s.max;
  s.sum_exp = expert_blocked_sum(experts, [&](std::int32_t e) { return exp32(add32(l[e], -s.max)); });
  s.lse = add32(s.max, log32(s.sum_exp));
  if (sigmoid) s.sum_sigmoid = expert_blocked_sum(experts, [&](std::int32_t e) { return sigmoid32(l[e]); });
  return s;
}

//! The config's fields the kernels read.
struct router_rule {
  std::int32_t experts;
  std::int32_t top_k;
  std::int32_t num_groups;
  std::int32_t group_top_k;
  bool sigmoid;
  bool pre_softmax;
  bool renormalize;
  float scaling_factor;

  [[nodiscard]] static router_rule from(router_config const& c, std::int64_t experts) {
    return {static_cast<std::int32_t>(experts), c.top_k,         c.num_groups,    c.group_top_k,
            c.score == score_function::sigmoid, c.pre_softmax, c.renormalize, c.scaling_factor};
  }
};

//! One token: its logits and statistics, and the scores the config derives from them.
struct router_row {
  float const* l;  //!< `[E]`
  router_row_stats stats;
  router_rule const& rule;

  MOECOMM_HOST_DEVICE float softmax(std::int32_t e) const {
    return div32(exp32(add32(l[e], -stats.max)), stats.sum_exp);
  }
  //! The probability the weights are made of: softmax over all experts, or sigmoid.
  MOECOMM_HOST_DEVICE float score(std::int32_t e) const { return rule.sigmoid ? sigmoid32(l[e]) : softmax(e); }
  //! What the top-k ranks: the logit (softmax after the top-k), else the score plus the bias.
  MOECOMM_HOST_DEVICE float selection_key(std::int32_t e, float const* bias) const {
    if (!rule.sigmoid && !rule.pre_softmax) return l[e];
    return bias == nullptr ? score(e) : add32(score(e), bias[e]);
  }
  //! The load-balancing loss's probability: softmax, or sigmoid normalised over all experts.
  MOECOMM_HOST_DEVICE float aux_score(std::int32_t e) const {
    return rule.sigmoid ? div32(sigmoid32(l[e]), add32(stats.sum_sigmoid, router_epsilon)) : softmax(e);
  }
};

//! The K selected experts of a token, best first, through `out(k, e)`, ranked by `key(e)`;
//! group-limited when the config has groups.
template <class Key, class Out>
MOECOMM_HOST_DEVICE void select_experts(router_rule const& r, Key const& key, Out&& out) {
  std::uint64_t groups = ~std::uint64_t{0};
  std::int32_t group_size = r.experts;
  if (r.num_groups > 0) {
    group_size = r.experts / r.num_groups;
    // A group's score: the sum of its top (K / group_top_k) keys, best first.
    auto const group_score = [&](std::int32_t g) {
      float sum = 0.0f;
      pick_top(g * group_size, (g + 1) * group_size, r.top_k / r.group_top_k, group_size, ~std::uint64_t{0}, key,
               [&](std::int32_t, std::int32_t, float k) { sum = add32(sum, k); });
      return sum;
    };
    groups = 0;
    pick_top(0, r.num_groups, r.group_top_k, r.num_groups, 1u, group_score,
             [&](std::int32_t, std::int32_t g, float) { groups |= std::uint64_t{1} << g; });
  }
  pick_top(0, r.experts, r.top_k, group_size, groups, key, [&](std::int32_t k, std::int32_t e, float) { out(k, e); });
}

//! The selected experts' scores before renormalisation and scaling: the score of each, or for
//! softmax after the top-k the softmax over the K selected logits.
struct selected_scores {
  router_row const& row;
  std::int32_t const* selected;  //!< `[K]`
  float max = 0.0f;
  float sum_exp = 0.0f;

  MOECOMM_HOST_DEVICE selected_scores(router_row const& row_, std::int32_t const* selected_)
      : row(row_), selected(selected_) {
    if (row.rule.sigmoid || row.rule.pre_softmax) return;
    max = -router_infinity;
    for (std::int32_t k = 0; k < row.rule.top_k; ++k) max = row.l[selected[k]] > max ? row.l[selected[k]] : max;
    for (std::int32_t k = 0; k < row.rule.top_k; ++k) sum_exp = add32(sum_exp, exp32(add32(row.l[selected[k]], -max)));
  }
  MOECOMM_HOST_DEVICE float operator()(std::int32_t k) const {
    if (row.rule.sigmoid || row.rule.pre_softmax) return row.score(selected[k]);
    return div32(exp32(add32(row.l[selected[k]], -max)), sum_exp);
  }
  //! `sum_k s_k + 1e-20` when renormalising, else 1.
  MOECOMM_HOST_DEVICE float renormaliser() const {
    if (!row.rule.renormalize) return 1.0f;
    float sum = 0.0f;
    for (std::int32_t k = 0; k < row.rule.top_k; ++k) sum = add32(sum, (*this)(k));
    return add32(sum, router_epsilon);
  }
};

// ---- the kernels ------------------------------------------------------------------------------

//! The first bad logit as `t * (E + 1) + e` (NaN or +inf at `e`), `t * (E + 1) + E` for a token
//! whose every logit is -inf, or `none`; a `minimum` reduction over tokens finds the first.
struct first_bad_logit {
  float const* logits;
  std::int64_t experts;
  std::int64_t none;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t t) const {
    bool finite = false;
    for (std::int64_t e = 0; e < experts; ++e) {
      float const x = logits[t * experts + e];
      if (is_nan(x) || x == router_infinity) return t * (experts + 1) + e;
      finite = finite || x != -router_infinity;
    }
    return finite ? none : t * (experts + 1) + experts;
  }
};

//! True where a value is NaN or infinite.
struct not_finite {
  float const* values;
  MOECOMM_HOST_DEVICE bool operator()(std::int64_t i) const {
    return is_nan(values[i]) || values[i] == router_infinity || values[i] == -router_infinity;
  }
};

//! Per token: statistics, selection, weights, and the counts (integer atomics, exact in any order).
struct router_forward_kernel {
  router_rule rule;
  float const* logits;  //!< `[T][E]`, the state's copy
  float const* bias;    //!< `[E]` or null
  router_row_stats* stats;
  //! `[T][E]` scratch: each key computed once (the top-k reads it K times); then the aux scores.
  float* scores;
  std::int32_t* selected;  //!< `[T][K]`, the state's copy
  std::int32_t* topk_idx;
  float* topk_weights;
  std::int32_t* tokens_per_expert;  //!< `[E]`, zeroed, or null
  std::int32_t* aux_counts;         //!< `[E]`, zeroed, or null: counts of the load-balancing loss's own top-k

  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int64_t const first = t * rule.top_k;
    stats[t] = make_row_stats(logits + t * rule.experts, rule.experts, rule.sigmoid);
    router_row const row{logits + t * rule.experts, stats[t], rule};
    float* const score = scores + t * rule.experts;
    auto const saved = [&](std::int32_t e) { return score[e]; };
    for (std::int32_t e = 0; e < rule.experts; ++e) score[e] = row.selection_key(e, bias);
    select_experts(rule, saved, [&](std::int32_t k, std::int32_t e) {
      selected[first + k] = e;
      topk_idx[first + k] = e;
      if (tokens_per_expert != nullptr) atomic_add(tokens_per_expert + e, 1);
    });
    selected_scores const s(row, selected + first);
    float const renormaliser = s.renormaliser();
    for (std::int32_t k = 0; k < rule.top_k; ++k)
      topk_weights[first + k] = mul32(div32(s(k), renormaliser), rule.scaling_factor);
    if (aux_counts == nullptr) return;
    // Megatron's aux-loss map: a plain top-k of the aux scores (no groups, no bias).
    for (std::int32_t e = 0; e < rule.experts; ++e) score[e] = row.aux_score(e);
    pick_top(0, rule.experts, rule.top_k, rule.experts, ~std::uint64_t{0}, saved,
             [&](std::int32_t, std::int32_t e, float) { atomic_add(aux_counts + e, 1); });
  }
};

//! The losses' sums over tokens run in blocks of this many consecutive tokens: each block's partial
//! sum in ascending order, in parallel, then the partials in ascending block order. The shape is
//! fixed (not the device's), so every back-end gets the same bits, and the rounding error grows
//! with 64 + T/64 terms instead of T.
inline constexpr std::int64_t router_sum_block = 64;

//! Per (block b, column e), over index `b * columns + e`: `sums[b][e] = sum of m[t][e]` over the
//! block's rows `[b * block, min(rows, (b + 1) * block))`, ascending t. With `block >= rows`: one
//! block, the column sums.
struct block_column_sums {
  float const* m;  //!< `[rows][columns]`
  std::int64_t rows;
  std::int64_t columns;
  std::int64_t block;
  float* sums;  //!< `[ceil(rows / block)][columns]`
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int64_t const b = i / columns, e = i % columns, end = (b + 1) * block < rows ? (b + 1) * block : rows;
    float sum = 0.0f;
    for (std::int64_t t = b * block; t < end; ++t) sum = add32(sum, m[t * columns + e]);
    sums[i] = sum;
  }
};

//! Per block b of `router_sum_block` tokens: `sums[b] = sum of lse_t^2` over its tokens (FMA, ascending t).
struct block_lse_squares {
  router_row_stats const* stats;
  std::int64_t tokens;
  float* sums;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t b) const {
    std::int64_t const end = (b + 1) * router_sum_block < tokens ? (b + 1) * router_sum_block : tokens;
    float z = 0.0f;
    for (std::int64_t t = b * router_sum_block; t < end; ++t) z = fma32(stats[t].lse, stats[t].lse, z);
    sums[b] = z;
  }
};

//! One thread: `aux = scale * sum_e P[e] * n[e]` (FMA, ascending e) and `z = sum_b z_b / T`
//! (ascending block), both 0 when T = 0. E and T / 64 terms: short loops.
struct router_loss_values {
  float const* aux_sums;
  std::int32_t const* aux_counts;
  float const* z_blocks;
  std::int32_t experts;
  std::int64_t tokens;
  float aux_scale;  //!< fp32(E / (K T^2))
  router_losses* out;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t) const {
    float aux = 0.0f, z = 0.0f;
    for (std::int32_t e = 0; e < experts; ++e) aux = fma32(aux_sums[e], static_cast<float>(aux_counts[e]), aux);
    for (std::int64_t b = 0; b * router_sum_block < tokens; ++b) z = add32(z, z_blocks[b]);
    out->aux = tokens > 0 ? mul32(aux, aux_scale) : 0.0f;
    out->z = tokens > 0 ? div32(z, static_cast<float>(tokens)) : 0.0f;
  }
};

//! Per token: `d_logits[t][e]`, the gradient of `sum_k w·g + coeff_aux·aux + coeff_z·z` with the
//! selection (and the aux-loss counts) held fixed. Every element of the row is written.
struct router_backward_kernel {
  router_rule rule;
  float const* logits;
  router_row_stats const* stats;
  std::int32_t const* selected;
  std::int32_t const* aux_counts;  //!< null without the aux term
  float const* d_weights;          //!< `[T][K]`
  float* d_logits;                 //!< `[T][E]`
  float aux_scale;                 //!< fp32(coeff_aux E / (K T^2))
  float z_scale;                   //!< fp32(2 coeff_z / T), or 0 without the z term

  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int64_t const first = t * rule.top_k;
    router_row const row{logits + t * rule.experts, stats[t], rule};
    selected_scores const s(row, selected + first);
    float const* g = d_weights + first;
    // Through the scaling and the renormalisation: d s_k = (g_k a - sum_j g_j a s_j / D) / D.
    float const renormaliser = s.renormaliser();
    float dot = 0.0f;
    if (rule.renormalize)
      for (std::int32_t k = 0; k < rule.top_k; ++k) dot = fma32(mul32(g[k], rule.scaling_factor), s(k), dot);
    auto const d_score = [&](std::int32_t k) {
      float const scaled = mul32(g[k], rule.scaling_factor);
      return rule.renormalize ? div32(add32(scaled, -div32(dot, renormaliser)), renormaliser) : scaled;
    };
    // The softmax Jacobian's inner products: sum_k ds_k s_k, and sum_e gamma_e q_e for the aux loss.
    float inner = 0.0f, aux_inner = 0.0f;
    if (!rule.sigmoid)
      for (std::int32_t k = 0; k < rule.top_k; ++k) inner = fma32(d_score(k), s(k), inner);
    auto const gamma = [&](std::int32_t e) { return mul32(aux_scale, static_cast<float>(aux_counts[e])); };
    if (aux_counts != nullptr)
      for (std::int32_t e = 0; e < rule.experts; ++e) aux_inner = fma32(gamma(e), row.aux_score(e), aux_inner);
    float const z_factor = mul32(z_scale, stats[t].lse);
    for (std::int32_t e = 0; e < rule.experts; ++e) {
      std::int32_t slot = -1;
      for (std::int32_t k = 0; k < rule.top_k; ++k) slot = selected[first + k] == e ? k : slot;
      float d = 0.0f;
      if (!rule.sigmoid && rule.pre_softmax) {
        d = mul32(row.softmax(e), add32(slot >= 0 ? d_score(slot) : 0.0f, -inner));
      } else if (slot >= 0) {
        d = rule.sigmoid ? mul32(d_score(slot), sigmoid_slope(row.l[e])) : mul32(s(slot), add32(d_score(slot), -inner));
      }
      if (aux_counts != nullptr) {
        float const centred = add32(gamma(e), -aux_inner);
        d = add32(d, rule.sigmoid ? mul32(div32(centred, add32(stats[t].sum_sigmoid, router_epsilon)),
                                          sigmoid_slope(row.l[e]))
                                  : mul32(row.softmax(e), centred));
      }
      if (z_scale != 0.0f) d = add32(d, mul32(z_factor, row.softmax(e)));
      d_logits[t * rule.experts + e] = d;
    }
  }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
