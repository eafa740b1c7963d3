// SPDX-License-Identifier: Apache-2.0
#pragma once
// The test oracle: a plain, serial, obviously correct implementation of
// ../shared/reference/semantics.md §3–§6 and §10. It shares nothing with the library but the
// element-type conversions; the library never uses it.

#include <moecomm/core/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace oracle {

using std::int32_t;
using std::int64_t;

struct routing {
  std::vector<int32_t> idx;  // [T][K]
  std::vector<float> w;      // [T][K]
  int64_t tokens = 0;
  int32_t top_k = 0;
  int32_t at(int64_t t, int32_t k) const { return idx[static_cast<std::size_t>(t * top_k + k)]; }
  float weight(int64_t t, int32_t k) const { return w[static_cast<std::size_t>(t * top_k + k)]; }
};

// §3: dispatch layout counts.
struct layout {
  std::vector<int32_t> tokens_per_expert, tokens_per_rank, tokens_per_node, slots_per_rank;
  std::vector<bool> is_token_in_rank;  // [T][R]
};

inline layout dispatch_layout(routing const& r, int32_t experts, int32_t ranks, int32_t ranks_per_node) {
  int32_t const per_rank = experts / ranks;
  layout out;
  out.tokens_per_expert.assign(static_cast<std::size_t>(experts), 0);
  out.tokens_per_rank.assign(static_cast<std::size_t>(ranks), 0);
  out.tokens_per_node.assign(static_cast<std::size_t>(ranks / ranks_per_node), 0);
  out.slots_per_rank.assign(static_cast<std::size_t>(ranks), 0);
  out.is_token_in_rank.assign(static_cast<std::size_t>(r.tokens * ranks), false);
  for (int64_t t = 0; t < r.tokens; ++t) {
    for (int32_t k = 0; k < r.top_k; ++k) {
      int32_t const e = r.at(t, k);
      if (e < 0 || e >= experts) continue;
      ++out.tokens_per_expert[static_cast<std::size_t>(e)];
      ++out.slots_per_rank[static_cast<std::size_t>(e / per_rank)];
      out.is_token_in_rank[static_cast<std::size_t>(t * ranks + e / per_rank)] = true;
    }
    for (int32_t n = 0; n < ranks / ranks_per_node; ++n) {
      bool in_node = false;
      for (int32_t g = 0; g < ranks_per_node; ++g) {
        bool const in = out.is_token_in_rank[static_cast<std::size_t>(t * ranks + n * ranks_per_node + g)];
        out.tokens_per_rank[static_cast<std::size_t>(n * ranks_per_node + g)] += in ? 1 : 0;
        in_node = in_node || in;
      }
      out.tokens_per_node[static_cast<std::size_t>(n)] += in_node ? 1 : 0;
    }
  }
  return out;
}

// §4: rows in (e, t, k) order, built by the definition: for each expert, scan tokens and slots.
struct row_map {
  std::vector<int32_t> row_of;          // [T][K]
  std::vector<int32_t> token_of, slot_of;  // [P]
  std::vector<int32_t> expert_offsets;  // [E + 1]
  int64_t rows() const { return static_cast<int64_t>(token_of.size()); }
};

inline row_map permute_map(routing const& r, int32_t experts) {
  row_map m;
  m.row_of.assign(static_cast<std::size_t>(r.tokens * r.top_k), -1);
  for (int32_t e = 0; e < experts; ++e) {
    m.expert_offsets.push_back(static_cast<int32_t>(m.token_of.size()));
    for (int64_t t = 0; t < r.tokens; ++t)
      for (int32_t k = 0; k < r.top_k; ++k)
        if (r.at(t, k) == e) {
          m.row_of[static_cast<std::size_t>(t * r.top_k + k)] = static_cast<int32_t>(m.token_of.size());
          m.token_of.push_back(static_cast<int32_t>(t));
          m.slot_of.push_back(k);
        }
  }
  m.expert_offsets.push_back(static_cast<int32_t>(m.token_of.size()));
  return m;
}

template <class T>
float f32(T v) { return moecomm::dtype_traits<T>::to_float(v); }
template <class T>
T from32(float v) { return moecomm::dtype_traits<T>::from_float(v); }

// §4: out[r] = x[token_of[r]].
template <class T>
std::vector<T> permute(std::vector<T> const& x, int64_t hidden, row_map const& m) {
  std::vector<T> out;
  for (int32_t t : m.token_of)
    for (int64_t h = 0; h < hidden; ++h) out.push_back(x[static_cast<std::size_t>(t * hidden + h)]);
  return out;
}

// §5: fp32 accumulation from +0.0, ascending k, explicit FMA when weighted, one rounding.
// With weighted = false this is also the permute backward of §6.
template <class T>
std::vector<T> unpermute(std::vector<T> const& y, int64_t hidden, routing const& r, row_map const& m, bool weighted) {
  std::vector<T> out(static_cast<std::size_t>(r.tokens * hidden));
  for (int64_t t = 0; t < r.tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int32_t k = 0; k < r.top_k; ++k) {
        int32_t const row = m.row_of[static_cast<std::size_t>(t * r.top_k + k)];
        if (row < 0) continue;
        float const v = f32(y[static_cast<std::size_t>(row * hidden + h)]);
        acc = weighted ? std::fma(r.weight(t, k), v, acc) : acc + v;
      }
      out[static_cast<std::size_t>(t * hidden + h)] = from32<T>(acc);
    }
  return out;
}

// §10a: the combine of a deduplicated exchange. `levels[0][t * K + k]` names the group slot k's row
// is summed in at the outermost level (per node: its expert's node; per rank: its expert's rank), or
// -1 for a slot summed directly at the source (a home slot); `levels[1]`, when given, the group
// inside that (its expert's rank). Each group is summed in slot order from +0.0 and rounded to T
// where it is summed; the level above adds, in the order of their first slots, each group's
// rounded sum (weight 1) and each direct slot (its own weight), rounded once. With weighted = false
// this is also dispatch_backward's sum.
template <class T>
std::vector<T> grouped_unpermute(std::vector<T> const& y, int64_t hidden, routing const& r, row_map const& m, bool weighted,
                                 std::vector<std::vector<int32_t>> const& levels) {
  std::vector<T> out(static_cast<std::size_t>(r.tokens * hidden));
  auto row_of = [&](int64_t t, int32_t k) { return m.row_of[static_cast<std::size_t>(t * r.top_k + k)]; };
  auto term = [&](float acc, int64_t t, int32_t k, int64_t h) {
    float const v = f32(y[static_cast<std::size_t>(row_of(t, k) * hidden + h)]);
    return weighted ? std::fma(r.weight(t, k), v, acc) : acc + v;
  };
  // The sum, at `level`, of token t's sent slots in `member` (ascending k).
  std::function<float(int64_t, int64_t, std::size_t, std::vector<int32_t> const&)> sum =
      [&](int64_t t, int64_t h, std::size_t level, std::vector<int32_t> const& member) {
        float acc = 0.0f;
        for (std::size_t i = 0; i < member.size(); ++i) {
          int32_t const k = member[i];
          int32_t const g = level < levels.size() ? levels[level][static_cast<std::size_t>(t * r.top_k + k)] : -1;
          if (g < 0) {
            acc = term(acc, t, k, h);
            continue;
          }
          bool first = true;
          std::vector<int32_t> group;
          for (std::size_t j = 0; j < member.size(); ++j)
            if (levels[level][static_cast<std::size_t>(t * r.top_k + member[j])] == g) {
              first = first && j >= i;
              group.push_back(member[j]);
            }
          if (first) acc = acc + f32(from32<T>(sum(t, h, level + 1, group)));
        }
        return acc;
      };
  for (int64_t t = 0; t < r.tokens; ++t) {
    std::vector<int32_t> sent;
    for (int32_t k = 0; k < r.top_k; ++k)
      if (row_of(t, k) >= 0) sent.push_back(k);
    for (int64_t h = 0; h < hidden; ++h) out[static_cast<std::size_t>(t * hidden + h)] = from32<T>(sum(t, h, 0, sent));
  }
  return out;
}

// §6: unpermute backward, d_y[r] = w[t][k] * d_out[t] (weighted) or d_out[t] (a bit copy).
template <class T>
std::vector<T> unpermute_backward(std::vector<T> const& d_out, int64_t hidden, routing const& r, row_map const& m,
                                  bool weighted) {
  std::vector<T> d_y;
  for (int64_t row = 0; row < m.rows(); ++row) {
    int32_t const t = m.token_of[static_cast<std::size_t>(row)];
    float const w = r.weight(t, m.slot_of[static_cast<std::size_t>(row)]);
    for (int64_t h = 0; h < hidden; ++h) {
      T const g = d_out[static_cast<std::size_t>(t * hidden + h)];
      d_y.push_back(weighted ? from32<T>(w * f32(g)) : g);
    }
  }
  return d_y;
}

// §6: d_w[t][k] = sum_h y[row_of[t][k]][h] * d_out[t][h], ascending h, fp32.
template <class T>
std::vector<float> weight_grad(std::vector<T> const& y, std::vector<T> const& d_out, int64_t hidden,
                               routing const& r, row_map const& m) {
  std::vector<float> dw(static_cast<std::size_t>(r.tokens * r.top_k), 0.0f);
  for (int64_t s = 0; s < r.tokens * r.top_k; ++s) {
    int32_t const row = m.row_of[static_cast<std::size_t>(s)];
    if (row < 0) continue;
    double acc = 0.0;  // a more accurate sum: the library's fp32 result is compared with a tolerance
    for (int64_t h = 0; h < hidden; ++h)
      acc += double(f32(y[static_cast<std::size_t>(row * hidden + h)])) *
             double(f32(d_out[static_cast<std::size_t>(s / r.top_k * hidden + h)]));
    dw[static_cast<std::size_t>(s)] = static_cast<float>(acc);
  }
  return dw;
}

// §10: chunks (s, l) of a rank-major buffer, concatenated in expert-major order (or back).
template <class T>
std::vector<T> sort_chunks(std::vector<T> const& in, int64_t hidden, std::vector<int32_t> const& counts,
                           int32_t ranks, int32_t locals, bool to_expert_major) {
  // Cut the input into its chunks, in its own order.
  std::vector<std::vector<T>> chunk(static_cast<std::size_t>(ranks * locals));
  std::size_t at = 0;
  auto take = [&](int32_t s, int32_t l) {
    auto& c = chunk[static_cast<std::size_t>(s * locals + l)];
    std::size_t const n = static_cast<std::size_t>(counts[static_cast<std::size_t>(s * locals + l)] * hidden);
    c.assign(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  };
  std::vector<T> out;
  auto put = [&](int32_t s, int32_t l) {
    auto const& c = chunk[static_cast<std::size_t>(s * locals + l)];
    out.insert(out.end(), c.begin(), c.end());
  };
  for (int32_t a = 0; a < (to_expert_major ? ranks : locals); ++a)
    for (int32_t b = 0; b < (to_expert_major ? locals : ranks); ++b) to_expert_major ? take(a, b) : take(b, a);
  for (int32_t a = 0; a < (to_expert_major ? locals : ranks); ++a)
    for (int32_t b = 0; b < (to_expert_major ? ranks : locals); ++b) to_expert_major ? put(b, a) : put(a, b);
  return out;
}

}  // namespace oracle

#include <algorithm>
#include <moecomm/core/philox.hpp>

namespace oracle {

enum class drop_rule { position, probability, random, receiver_budget };

// §7: per-source-rank capacity, division first, in double.
inline int64_t capacity(int64_t tokens, int32_t top_k, int32_t experts, double factor) {
  return static_cast<int64_t>(std::ceil((static_cast<double>(tokens * top_k) / experts) * factor));
}

// §8: the routing with dropped slots masked. For each expert, candidates in (t, k) order, ranked
// by the rule (stable, so ties keep (t, k) order), the first C kept. `first_token` is t_global of
// token 0 (random rule). The Philox generator itself is checked against Random123's known answers.
inline routing drop_to_capacity(routing const& r, int32_t experts, int64_t cap, drop_rule rule, std::uint64_t seed = 0,
                                std::uint32_t layer = 0, int64_t first_token = 0) {
  auto score = [&](int64_t t, int32_t k) -> float {
    if (rule == drop_rule::position) return 0.0f;
    if (rule == drop_rule::probability) return r.weight(t, k);
    moecomm::detail::philox_block const c{{static_cast<std::uint32_t>(first_token + t), static_cast<std::uint32_t>(k), layer, 0u}};
    return static_cast<float>(moecomm::detail::philox4x32_10(seed, c).x[0] >> 8) / 16777216.0f;
  };
  routing out = r;
  for (int32_t e = 0; e < experts; ++e) {
    std::vector<std::pair<int64_t, int32_t>> candidates;
    for (int64_t t = 0; t < r.tokens; ++t)
      for (int32_t k = 0; k < r.top_k; ++k)
        if (r.at(t, k) == e) candidates.emplace_back(t, k);
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](auto const& a, auto const& b) { return score(a.first, a.second) > score(b.first, b.second); });
    for (std::size_t i = static_cast<std::size_t>(cap); i < candidates.size(); ++i)
      out.idx[static_cast<std::size_t>(candidates[i].first * r.top_k + candidates[i].second)] = -1;
  }
  return out;
}

// §7, receiver budget: rank d accepts `budget` rows; the rank-major stream (source ascending, then
// the source's permuted order: d's experts ascending, tokens ascending) is kept up to the budget.
inline std::vector<routing> drop_to_receiver_budget(std::vector<routing> const& all, int32_t experts, int64_t budget) {
  auto const ranks = static_cast<int32_t>(all.size());
  int32_t const local = experts / ranks;
  std::vector<routing> kept = all;
  for (int32_t d = 0; d < ranks; ++d) {
    int64_t left = budget;
    for (int32_t s = 0; s < ranks; ++s)
      for (int32_t e = d * local; e < (d + 1) * local; ++e)
        for (int64_t t = 0; t < all[s].tokens; ++t)
          for (int32_t k = 0; k < all[s].top_k; ++k)
            if (all[s].at(t, k) == e) {
              if (left > 0) --left;
              else kept[s].idx[static_cast<std::size_t>(t * all[s].top_k + k)] = -1;
            }
  }
  return kept;
}

}  // namespace oracle
