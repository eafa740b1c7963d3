// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Capacity policies (semantics §7–§9): how many slots each source rank may send each expert, and
//! which slots survive when more want to. Dropped slots become masked slots (-1) of a "kept"
//! routing, so everything downstream (permute, combine, backward) treats them as absent: zero
//! output and zero gradient from the dropped slot.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/core/philox.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/rows/validate_routing.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! Every slot is kept; no capacity.
struct dropless {
  static constexpr char const* name = "dropless";
};

//! Keeps the first C slots of each expert in `(t, k)` order (first come; DeepSpeed's cumsum rule).
struct drop_by_position {
  static constexpr char const* name = "drop_by_position";
};
//! Keeps the C slots with the largest weight; ties go to the lower token, then the lower slot.
struct drop_by_probability {
  static constexpr char const* name = "drop_by_probability";
};
//! Keeps the C slots with the largest Philox priority `u = (x0 >> 8) * 2^-24`, `x0` the first word
//! of `philox4x32_10(seed, (t_global, k, layer, 0))`; ties go to the lower token.
struct drop_random {
  static constexpr char const* name = "drop_random";
  std::uint64_t seed = 0;
  std::uint32_t layer = 0;
};

//! Per-source-rank capacity `C = max(ceil((double(T·K) / E) · factor), min_capacity)` (division
//! first: that order is part of the contract), agreed across ranks as the maximum, and the rule
//! that picks the survivors. With `pad_to_capacity` every expert block has exactly C rows, the
//! kept rows then zero rows, so the all-to-all has a fixed size.
template <class Rule>
struct capacity {
  static constexpr char const* name = Rule::name;
  double factor = 1.0;
  std::int64_t min_capacity = 0;
  bool pad_to_capacity = false;
  Rule rule{};
};

//! The receiver-budget variant (semantics §7): every rank accepts at most `rows_per_rank` rows over
//! all its local experts; the longest prefix of its rank-major receive stream (source rank
//! ascending, then the sender's permuted order) that fits is kept. Needs the count matrix of every
//! rank before any data moves (one extra all-gather). Cf. Megatron-LM's
//! `moe_expert_rank_capacity_factor`, NCCL EP's `max_recv_tokens_per_rank`.
struct receiver_budget {
  static constexpr char const* name = "receiver_budget";
  std::int64_t rows_per_rank = 0;
};

namespace detail {

template <class Policy>
inline constexpr bool is_dropless_v = std::is_same_v<Policy, dropless>;
template <class Policy>
inline constexpr bool is_receiver_budget_v = std::is_same_v<Policy, receiver_budget>;

//! Keeps slot i when its row falls in the first `allowed[d]` rows of this rank's block for its
//! destination rank d (the block is the experts `[d * L, (d + 1) * L)` of the plan).
struct keep_receiver_prefix {
  std::int32_t const* idx;
  std::int32_t const* row_of;  //!< dropless plan
  std::int32_t const* expert_offsets;
  std::int64_t const* allowed;  //!< `[R]`
  std::int32_t local_experts;
  std::int32_t* kept_idx;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const row = row_of[i];
    if (row < 0) {
      kept_idx[i] = -1;
      return;
    }
    std::int32_t const d = idx[i] / local_experts;
    kept_idx[i] = row - expert_offsets[d * local_experts] < allowed[d] ? idx[i] : -1;
  }
};

//! 1 for a slot the kept routing still sends somewhere.
struct is_kept_slot {
  std::int32_t const* idx;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t i) const { return idx[i] >= 0 ? 1 : 0; }
};

//! The score a slot competes with; larger survives.
struct weight_score {
  float const* weights;
  std::int32_t top_k;
  MOECOMM_HOST_DEVICE float operator()(std::int64_t t, std::int32_t k) const {
    float const w = weights[t * top_k + k];
    return is_nan(w) ? -INFINITY : w + 0.0f;  // -0.0 == +0.0; NaN ranks lowest
  }
};
struct random_score {
  std::uint64_t seed;
  std::uint32_t layer;
  std::int64_t first_token;  //!< t_global of this rank's token 0
  MOECOMM_HOST_DEVICE float operator()(std::int64_t t, std::int32_t k) const {
    std::int64_t const tg = first_token + t;
    philox_block const counter{{static_cast<std::uint32_t>(tg), static_cast<std::uint32_t>(k), layer, 0u}};
    return static_cast<float>(philox4x32_10(seed, counter).x[0] >> 8) * (1.0f / 16777216.0f);
  }
};

//! `scores[i]`: the score of slot i (computed once, so the selection compares stored values).
template <class Score>
struct score_slots {
  Score score;
  std::int32_t top_k;
  float* scores;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    scores[i] = score(i / top_k, static_cast<std::int32_t>(i % top_k));
  }
};

//! `drop_by_position`: slot i survives when its row is among the first C of its expert's block (the
//! dropless plan's rows are in (t, k) order).
struct keep_first_capacity {
  std::int32_t const* idx;
  std::int32_t const* row_of;  //!< dropless plan
  std::int32_t const* expert_offsets;
  std::int64_t capacity;
  std::int32_t* kept_idx;  //!< out: idx, or -1 where dropped or masked
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const row = row_of[i];
    kept_idx[i] = row >= 0 && row - expert_offsets[idx[i]] < capacity ? idx[i] : -1;
  }
};

//! A sort key that orders scores from the largest down: the float's bits made monotone, inverted.
//! Scores are never NaN (`weight_score` ranks NaN as -inf) and -0.0 is already +0.0.
MOECOMM_HOST_DEVICE inline std::uint32_t descending_score_key(float score) {
  std::uint32_t bits;
  memcpy(&bits, &score, sizeof bits);
  std::uint32_t const ascending = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return ~ascending;
}

//! Row r of the dropless plan with its score's descending key (the first sort: by score).
struct rows_by_score {
  std::int32_t const* token_of;  //!< dropless plan
  std::int32_t const* slot_of;
  float const* scores;           //!< `[T][K]`
  std::int32_t top_k;
  std::uint32_t* keys;
  std::int32_t* rows;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    // A filler row (`permute_plan::row_bound`) ranks after every score.
    keys[r] = token_of[r] < 0 ? ~std::uint32_t{0} : descending_score_key(scores[std::int64_t{token_of[r]} * top_k + slot_of[r]]);
    rows[r] = static_cast<std::int32_t>(r);
  }
};

//! The rows in score order keyed by their expert (the second sort, stable: by expert, then score,
//! then row, which is (t, k) order).
struct rows_by_expert {
  std::int32_t const* idx;
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t top_k;
  std::int32_t const* rows_in_score_order;
  std::int32_t num_experts;  //!< a filler row's key: after every expert, with the masked slots
  std::uint32_t* keys;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t p) const {
    std::int32_t const r = rows_in_score_order[p];
    keys[p] = static_cast<std::uint32_t>(token_of[r] < 0 ? num_experts : idx[std::int64_t{token_of[r]} * top_k + slot_of[r]]);
  }
};

//! Position p of the ranked rows: expert e's rows occupy its dropless block `[offsets[e],
//! offsets[e + 1])`, best first, so the row survives when `p - offsets[e] < C`.
struct keep_ranked_rows {
  std::int32_t const* idx;
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t const* expert_offsets;
  std::int32_t top_k;
  std::int32_t const* ranked_rows;
  std::int64_t capacity;
  std::int32_t* kept_idx;  //!< pre-filled with -1
  MOECOMM_HOST_DEVICE void operator()(std::int64_t p) const {
    std::int32_t const r = ranked_rows[p];
    if (token_of[r] < 0) return;  // a filler row
    std::int64_t const slot = std::int64_t{token_of[r]} * top_k + slot_of[r];
    std::int32_t const e = idx[slot];
    if (p - expert_offsets[e] < capacity) kept_idx[slot] = e;
  }
};

}  // namespace detail

//! This rank's capacity before agreement (semantics §7): `C = max(ceil((double(T·K) / E) ·
//! factor), min_capacity)`, IEEE double, division first. Ranks agree on the maximum of theirs.
//! @throws error (invalid_argument) for a factor that is NaN, infinite or negative, a negative
//!         `min_capacity`, or a capacity of 2^62 rows or more, naming the argument and its value.
[[nodiscard]] inline std::int64_t expert_capacity(std::int64_t num_tokens, std::int32_t top_k, std::int32_t num_experts,
                                                  double factor, std::int64_t min_capacity) {
  char const* op = "expert_capacity";
  detail::require(num_tokens >= 0 && top_k > 0 && num_experts > 0, op, "num_tokens = ", num_tokens, ", top_k = ", top_k,
                  ", num_experts = ", num_experts, ": need num_tokens >= 0, top_k > 0 and num_experts > 0");
  detail::require(std::isfinite(factor) && factor >= 0.0, op, "capacity factor = ", factor,
                  " must be a finite number >= 0");
  detail::require(min_capacity >= 0, op, "min_capacity = ", min_capacity, " must be >= 0");
  detail::require(num_tokens <= std::numeric_limits<std::int64_t>::max() / top_k, op, "num_tokens * top_k = ", num_tokens,
                  " * ", top_k, " overflows int64");
  double const c = std::ceil((static_cast<double>(num_tokens * top_k) / num_experts) * factor);
  detail::require(c < 0x1p62, op, "capacity factor = ", factor, " gives a capacity of ", c,
                  " rows per expert, at or beyond the limit of 2^62 (", num_tokens, " tokens, top_k = ", top_k, ", ", num_experts,
                  " experts)");
  auto const rows = static_cast<std::int64_t>(c);
  return rows > min_capacity ? rows : min_capacity;
}

//! The checks of a capacity policy's fields, before any communication.
template <class Rule>
void validate_capacity_policy(capacity<Rule> const& policy, char const* op) {
  detail::require(std::isfinite(policy.factor) && policy.factor >= 0.0, op, "capacity.factor = ", policy.factor,
                  " must be a finite number >= 0");
  detail::require(policy.min_capacity >= 0, op, "capacity.min_capacity = ", policy.min_capacity, " must be >= 0");
}

//! What `drop_to_capacity` kept.
struct capacity_result {
  std::int64_t kept_slots = 0;     //!< valid slots within capacity
  std::int64_t dropped_slots = 0;  //!< valid slots dropped
};

//! Capacity as a standalone step (semantics §8): for every expert, keeps the `capacity` slots that
//! rank first under `rule` and writes the kept routing's ids, `kept_topk_idx[t][k]` = the expert,
//! or -1 where the slot is dropped or was masked. Everything downstream takes the kept routing
//! (`routing_view` with `topk_idx = kept_topk_idx`, the same weights) as an ordinary one; with
//! `pad_to_capacity`, build its plan with `padded_capacity = capacity`.
//! @param plan the dropless plan of the routing (`make_permute_plan`): its per-expert (t, k) order
//!        is the competition.
//! @param capacity C, rows per expert (agree it across ranks first, e.g. `allreduce(max)`).
//! @param kept_topk_idx `[>= T * K]` output.
//! @param scratch the slots' scores, kept between calls.
//! @param rule `drop_by_position`, `drop_by_probability` (needs weights) or `drop_random`.
//! @param first_token for `drop_random`: the global index of this rank's token 0 (Philox counter).
namespace detail {
template <class Backend, class Rule>
void enqueue_drop_to_capacity(Backend const& be, permute_plan<Backend> const& plan, std::int64_t capacity,
                              array_view<std::int32_t> kept_topk_idx, workspace<Backend>& scratch, Rule const& rule,
                              std::int64_t first_token);
}  // namespace detail

template <class Backend, class Rule = drop_by_position>
capacity_result drop_to_capacity(Backend const& be, permute_plan<Backend> const& plan, std::int64_t capacity,
                                 array_view<std::int32_t> kept_topk_idx, workspace<Backend>& scratch, Rule const& rule = {},
                                 std::int64_t first_token = 0) {
  detail::enqueue_drop_to_capacity(be, plan, capacity, kept_topk_idx, scratch, rule, first_token);
  routing_view const& routing = plan.routing();
  capacity_result result;
  result.kept_slots = be.reduce(routing.num_tokens * routing.top_k, std::int64_t{0}, detail::is_kept_slot{kept_topk_idx.data},
                                detail::plus{});
  result.dropped_slots = plan.num_rows() - result.kept_slots;
  return result;
}

namespace detail {

//! `drop_to_capacity`'s work without counting what it kept (no host wait): every rule keeps
//! `min(n_e, C)` of expert e's `n_e` slots, which a caller that knows the counts adds up itself.
template <class Backend, class Rule>
void enqueue_drop_to_capacity(Backend const& be, permute_plan<Backend> const& plan, std::int64_t capacity,
                              array_view<std::int32_t> kept_topk_idx, workspace<Backend>& scratch, Rule const& rule,
                              std::int64_t first_token) {
  char const* op = "drop_to_capacity";
  routing_view const& routing = plan.routing();
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  detail::require(capacity >= 0, op, "capacity = ", capacity, " must be >= 0");
  detail::require(plan.padded_capacity() == 0, op, "the plan must be the routing's dropless plan, not a padded one");
  detail::check_elements(kept_topk_idx, slots, op, "kept_topk_idx", "one per slot: num_tokens * top_k");
  // Scored rules: two stable radix sorts of the plan's rows (by score, then by expert) rank each
  // expert's rows best first, ties in (t, k) order; O(rows) work, not O(rows x C).
  auto survivors = [&](auto score) {
    std::int64_t const rows = plan.row_bound();
    std::size_t const sort_bytes = be.stable_sort_scratch_bytes(rows);
    std::int64_t const words = slots + 4 * rows;
    float* const scores = scratch.template get<float>(be, words + static_cast<std::int64_t>(sort_bytes / 4 + 1));
    auto* const keys = reinterpret_cast<std::uint32_t*>(scores + slots);
    std::uint32_t* const sorted_keys = keys + rows;
    auto* const ranked = reinterpret_cast<std::int32_t*>(sorted_keys + rows);
    std::int32_t* const sorted = ranked + rows;
    void* const sort_scratch = sorted + rows;
    be.for_each_index(slots, detail::score_slots<decltype(score)>{score, routing.top_k, scores});
    be.for_each_index(rows, detail::rows_by_score{plan.token_of(), plan.slot_of(), scores, routing.top_k, keys, ranked});
    be.stable_sort_by_key(keys, sorted_keys, ranked, sorted, rows, 32, sort_scratch, sort_bytes);
    be.for_each_index(rows, detail::rows_by_expert{routing.topk_idx, plan.token_of(), plan.slot_of(), routing.top_k, sorted,
                                                   plan.num_experts(), keys});
    be.stable_sort_by_key(keys, sorted_keys, sorted, ranked, rows, detail::key_bits(plan.num_experts()), sort_scratch,
                          sort_bytes);
    be.for_each_index(slots, detail::fill_value<std::int32_t>{kept_topk_idx.data, -1});
    be.for_each_index(rows, detail::keep_ranked_rows{routing.topk_idx, plan.token_of(), plan.slot_of(), plan.expert_offsets(),
                                                     routing.top_k, ranked, capacity, kept_topk_idx.data});
  };
  if constexpr (std::is_same_v<Rule, drop_by_position>) {
    be.for_each_index(slots, detail::keep_first_capacity{routing.topk_idx, plan.row_of(), plan.expert_offsets(), capacity,
                                                         kept_topk_idx.data});
  } else if constexpr (std::is_same_v<Rule, drop_by_probability>) {
    detail::require(routing.num_tokens == 0 || routing.topk_weights != nullptr, op,
                    "drop_by_probability needs topk_weights in the plan's routing");
    survivors(detail::weight_score{routing.topk_weights, routing.top_k});
  } else {
    static_assert(std::is_same_v<Rule, drop_random>, "moecomm::drop_to_capacity: unknown drop rule");
    detail::require(first_token >= 0, op, "first_token = ", first_token, " must be >= 0");
    survivors(detail::random_score{rule.seed, rule.layer, first_token});
  }
}

//! What ranks compare to agree on a capacity: C, the factor (bit for bit), min_capacity, the padding.
inline constexpr std::int32_t capacity_fields = 4;
template <class Rule>
void write_capacity_fields(capacity<Rule> const& policy, std::int64_t mine, std::int64_t* fields) {
  fields[0] = mine;
  std::memcpy(&fields[1], &policy.factor, sizeof(double));  // compared bit for bit
  fields[2] = policy.min_capacity;
  fields[3] = policy.pad_to_capacity ? 1 : 0;
}

//! The largest rank's C from every rank's `capacity_fields` at `all + r * stride`, once every
//! rank's policy equals rank 0's; otherwise the same invalid_usage on every rank, naming two.
inline std::int64_t agreed_capacity(std::int64_t const* all, std::int64_t stride, std::int32_t ranks, char const* op) {
  std::int64_t c = 0;
  for (std::int32_t r = 0; r < ranks; ++r) {
    std::int64_t const* theirs = all + stride * r;
    if (!std::equal(theirs + 1, theirs + capacity_fields, all + 1)) {
      double factor = 0, first = 0;
      std::memcpy(&factor, &theirs[1], sizeof(double));
      std::memcpy(&first, &all[1], sizeof(double));
      fail(status::invalid_usage, op, "ranks disagree on the capacity policy: rank 0 has factor ", first, ", min_capacity ",
           all[2], ", pad_to_capacity ", all[3] != 0, "; rank ", r, " has factor ", factor, ", min_capacity ", theirs[2],
           ", pad_to_capacity ", theirs[3] != 0);
    }
    c = theirs[0] > c ? theirs[0] : c;
  }
  return c;
}

//! The capacity every rank of `comm` uses: the largest rank's `mine` (DeepSpeed's and Tutel's rule).
//! The same all-gather compares the policies: ranks whose factor, min_capacity or padding differ
//! would each drop differently, so every rank throws the same invalid_usage naming two of them.
//! Collective over `comm` (the ranks that exchange rows).
template <class Comm, class Rule, class Backend>
std::int64_t agree_on_capacity(Comm& comm, capacity<Rule> const& policy, std::int64_t mine, workspace<Backend>& scratch,
                               char const* op) {
  std::int32_t const ranks = comm.size();
  std::int64_t* const all = scratch.template host<std::int64_t>(std::int64_t{capacity_fields} * (ranks + 1));
  std::int64_t* const sent = all + std::int64_t{capacity_fields} * ranks;
  write_capacity_fields(policy, mine, sent);
  allgather_host(comm, sent, all, capacity_fields * static_cast<std::int64_t>(sizeof(std::int64_t)));
  return agreed_capacity(all, capacity_fields, ranks, op);
}

//! The global index of this rank's token 0 over `comm`, for `drop_random`'s Philox counter (one
//! all-gather); 0 for the other rules, which need no agreement.
template <class Comm, class Rule, class Backend>
std::int64_t first_token(Comm& comm, capacity<Rule> const&, std::int64_t num_tokens, workspace<Backend>& scratch) {
  if constexpr (!std::is_same_v<Rule, drop_random>) {
    return 0;
  } else {
    std::int32_t const ranks = comm.size();
    std::int64_t* const tokens = scratch.template host<std::int64_t>(ranks + 1);
    tokens[ranks] = num_tokens;
    allgather_host(comm, tokens + ranks, tokens, sizeof(std::int64_t));
    std::int64_t first = 0;
    for (std::int32_t s = 0; s < comm.rank(); ++s) first += tokens[s];
    return first;
  }
}

}  // namespace detail

MOECOMM_NAMESPACE_END
