// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `permute_plan`: where every slot's row goes when tokens are grouped by expert (semantics §4).
//!
//! Built once per routing decision and shared by permute, unpermute and their backward passes,
//! like DeepEP's dispatch handle or TransformerEngine's row map.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/read_back.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/rows/validate_routing.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The sort key of the slot at position `i` of the sort's input: its expert id, or `E` for masked
//! and out-of-range slots, so they sort after every expert (the unsigned-key rule of semantics
//! §2.4). The input holds the slots token by token, in token order or in `token_order` (`[T]`, a
//! permutation of the tokens), which the stable sort keeps within each expert.
struct slot_sort_key {
  std::int32_t const* idx;
  std::int32_t num_experts;
  std::int32_t top_k;
  std::int32_t const* token_order;  //!< null: ascending tokens
  std::uint32_t* keys;
  std::int32_t* slots;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int64_t const slot = token_order == nullptr ? i : std::int64_t{token_order[i / top_k]} * top_k + i % top_k;
    std::int32_t const e = idx[slot];
    keys[i] = static_cast<std::uint32_t>(is_valid_expert(e, num_experts) ? e : num_experts);
    slots[i] = static_cast<std::int32_t>(slot);
  }
};

//! Row r of a plan moves to row `new_row[r]` (`move_plan_rows`), reading the old row maps.
struct move_rows_to {
  std::int32_t const* new_row;
  std::int32_t top_k;
  std::int32_t const* old_token_of;
  std::int32_t const* old_slot_of;
  std::int32_t* token_of;
  std::int32_t* slot_of;
  std::int32_t* row_of;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    std::int64_t const moved = new_row[r];
    token_of[moved] = old_token_of[r];
    slot_of[moved] = old_slot_of[r];
    if (old_token_of[r] >= 0) row_of[std::int64_t{old_token_of[r]} * top_k + old_slot_of[r]] = static_cast<std::int32_t>(moved);
  }
};

//! `expert_offsets[e]` = the first sorted position whose key is `>= e` (a lower bound), for
//! `e` in `[0, E]`; the last entry is the number of kept rows.
struct expert_offsets_from_sorted_keys {
  std::uint32_t const* sorted_keys;
  std::int64_t count;
  std::int32_t* expert_offsets;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t e) const {
    std::int64_t lo = 0, hi = count;
    while (lo < hi) {
      std::int64_t const mid = lo + (hi - lo) / 2;
      if (sorted_keys[mid] < static_cast<std::uint32_t>(e)) lo = mid + 1; else hi = mid;
    }
    expert_offsets[e] = static_cast<std::int32_t>(lo);
  }
};

//! Fills `row_of` (slot -> row) and `token_of`/`slot_of` (row -> slot) from the sorted order;
//! slots that sorted into the masked bucket get `row_of = -1`. Unpadded, a slot's row is its sorted
//! position; padded to `capacity` C, expert e's block starts at `e * C` (its tail rows, pre-filled
//! with -1, are padding).
struct row_maps_from_sorted_slots {
  std::uint32_t const* sorted_keys;
  std::int32_t const* sorted_slots;
  std::int32_t const* unpadded_offsets;  //!< `[E + 1]`
  std::int64_t capacity;                 //!< 0: unpadded
  std::int32_t num_experts;
  std::int32_t top_k;
  std::int32_t* row_of;
  std::int32_t* token_of;
  std::int32_t* slot_of;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t position) const {
    std::int32_t const slot = sorted_slots[position];
    std::uint32_t const e = sorted_keys[position];
    if (e >= static_cast<std::uint32_t>(num_experts)) {
      row_of[slot] = -1;
      if (capacity == 0) token_of[position] = slot_of[position] = -1;
      return;
    }
    std::int64_t const row = capacity == 0 ? position : e * capacity + (position - unpadded_offsets[e]);
    row_of[slot] = static_cast<std::int32_t>(row);
    token_of[row] = slot / top_k;
    slot_of[row] = slot % top_k;
  }
};

//! `expert_offsets[e] = e * C` for a padded plan.
struct padded_offsets {
  std::int64_t capacity;
  std::int32_t* expert_offsets;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t e) const { expert_offsets[e] = static_cast<std::int32_t>(e * capacity); }
};

//! The block that holds row r: the last b in `[0, blocks)` with `bounds[b] <= r` (so an empty block,
//! whose bound equals the next one's, is never chosen for a row of the next).
MOECOMM_HOST_DEVICE inline std::int32_t block_holding(std::int32_t const* bounds, std::int32_t blocks, std::int64_t r) {
  std::int32_t lo = 0, hi = blocks;
  while (hi - lo > 1) {
    std::int32_t const mid = lo + (hi - lo) / 2;
    if (bounds[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

//! `out[i]` = the expert whose block holds slot i's row in a plan, -1 for a slot without a row:
//! the ids of the routing a relabeled plan stands for.
struct slot_experts_from_plan {
  std::int32_t const* row_of;
  std::int32_t const* expert_offsets;  //!< `[E + 1]`
  std::int32_t num_experts;
  std::int32_t* out;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = row_of[i] < 0 ? -1 : block_holding(expert_offsets, num_experts, row_of[i]);
  }
};

//! Row `r` of block b moves to the same place in the block of expert `label[b]`
//! (`relabel_permute_plan`): rows keep their order within a block, as a stable sort would.
struct move_row_blocks {
  std::int32_t const* old_bounds;    //!< `[B + 1]`: block b is rows `[old_bounds[b], old_bounds[b + 1])`
  std::int32_t const* new_offsets;   //!< `[E' + 1]`, by new expert id
  std::int32_t const* label;         //!< `[B]`
  std::int32_t num_blocks;
  std::int32_t top_k;
  std::int32_t const* old_token_of;  //!< `[rows]`
  std::int32_t const* old_slot_of;
  std::int32_t* token_of;
  std::int32_t* slot_of;
  std::int32_t* row_of;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    std::int32_t const b = block_holding(old_bounds, num_blocks, r);
    std::int64_t const moved = new_offsets[label[b]] + (r - old_bounds[b]);
    token_of[moved] = old_token_of[r];
    slot_of[moved] = old_slot_of[r];
    if (old_token_of[r] >= 0) row_of[std::int64_t{old_token_of[r]} * top_k + old_slot_of[r]] = static_cast<std::int32_t>(moved);
  }
};

//! `flags[r]` = 1 when row r of a dropless plan is still in the kept routing (`r < rows`), else 0;
//! `flags[rows]` = 0, so the exclusive sum's last entry is the number of kept rows.
struct kept_row_flags {
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t const* kept_idx;
  std::int32_t top_k;
  std::int64_t rows;
  std::int32_t* flags;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    flags[r] = r < rows && token_of[r] >= 0 && kept_idx[std::int64_t{token_of[r]} * top_k + slot_of[r]] >= 0 ? 1 : 0;
  }
};

//! True for a slot whose kept id is neither -1 nor its id in the dropless plan: a kept routing
//! may only mask slots.
struct not_a_masking {
  std::int32_t const* idx;
  std::int32_t const* row_of;  //!< dropless plan: -1 for masked and invalid slots
  std::int32_t const* kept_idx;
  MOECOMM_HOST_DEVICE bool operator()(std::int64_t i) const {
    return kept_idx[i] != -1 && (row_of[i] < 0 || kept_idx[i] != idx[i]);
  }
};

//! `kept_offsets[e]` = the kept rows before expert e's block: the exclusive sum at its first row.
struct kept_offsets_from_positions {
  std::int32_t const* offsets;    //!< dropless plan's `[E + 1]`
  std::int32_t const* positions;  //!< `[rows + 1]`: kept rows before each row
  std::int32_t* kept_offsets;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t e) const { kept_offsets[e] = positions[offsets[e]]; }
};

//! Each kept row of the dropless plan to its row in the kept plan: its position among the kept rows,
//! or, padded to C, `e * C` + its place in expert e's kept rows. Order within a block is kept.
struct move_kept_rows {
  std::int32_t const* old_token_of;
  std::int32_t const* old_slot_of;
  std::int32_t const* idx;           //!< the dropless routing's: a row's expert, valid whatever the kept id
  std::int32_t const* kept_idx;
  std::int32_t const* positions;     //!< `[rows + 1]`
  std::int32_t const* kept_offsets;  //!< `[E + 1]`, unpadded
  std::int64_t capacity;             //!< 0: unpadded
  std::int32_t top_k;
  std::int32_t* token_of;
  std::int32_t* slot_of;
  std::int32_t* row_of;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    if (old_token_of[r] < 0) return;  // a filler row (`permute_plan::row_bound`)
    std::int64_t const slot = std::int64_t{old_token_of[r]} * top_k + old_slot_of[r];
    if (kept_idx[slot] < 0) return;
    std::int32_t const e = idx[slot];
    std::int64_t const row = capacity == 0 ? positions[r] : e * capacity + (positions[r] - kept_offsets[e]);
    token_of[row] = old_token_of[r];
    slot_of[row] = old_slot_of[r];
    row_of[slot] = static_cast<std::int32_t>(row);
  }
};

//! True for a slot whose id is neither a valid expert nor -1.
struct out_of_range_slot {
  std::int32_t const* idx;
  std::int32_t num_experts;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t i) const {
    return idx[i] != -1 && !is_valid_expert(idx[i], num_experts) ? 1 : 0;
  }
};

//! Bits needed for keys in `[0, E]`.
inline int key_bits(std::int32_t num_experts) {
  int bits = 1;
  while ((std::int64_t{1} << bits) <= num_experts) ++bits;
  return bits;
}

}  // namespace detail

template <class Backend>
class permute_plan;

namespace detail {

//! `move_plan_blocks`' scratch, in int32 elements, for a plan of `rows` rows in `blocks` blocks
//! over `num_experts` new ids: host tables (the blocks' bounds, the new offsets, each id's block)
//! and device tables (the old row maps, and the host tables' copies).
constexpr std::int64_t relabel_host_ints(std::int64_t blocks, std::int64_t num_experts) { return blocks + 1 + 2 * (num_experts + 1); }
constexpr std::int64_t relabel_device_ints(std::int64_t rows, std::int64_t blocks, std::int64_t num_experts) {
  return 2 * rows + (blocks + 1 + num_experts + 1) + blocks;
}

//! `relabel_permute_plan`'s work: `tables` is host memory of `(B + 1) + (E' + 1) + E'` entries whose
//! first `B + 1` are the block bounds (the rest is its own scratch).
template <class Backend>
void move_plan_blocks(Backend const& be, permute_plan<Backend>& plan, routing_view const& relabeled, std::int32_t* tables,
                      std::int32_t num_blocks, std::int32_t const* labels, std::int32_t num_experts,
                      workspace<Backend>& scratch, char const* op);
template <class Backend>
void relabel_padded_plan(Backend const&, permute_plan<Backend>&, routing_view const&, std::int32_t const*, workspace<Backend>&);
template <class Backend>
void enqueue_permute_plan(Backend const&, routing_view const&, std::int32_t, permute_plan<Backend>&, workspace<Backend>&,
                          routing_checks const&, std::int64_t*, std::int32_t const* = nullptr);
template <class Backend>
void build_ordered_permute_plan(Backend const&, routing_view const&, std::int32_t, permute_plan<Backend>&, workspace<Backend>&,
                                routing_checks const&, std::int64_t, std::int32_t const*);
template <class Backend>
void move_plan_rows(Backend const&, permute_plan<Backend>&, std::int32_t const*, std::int64_t, workspace<Backend>&);
template <class Backend>
void complete_permute_plan(Backend const&, permute_plan<Backend>&, std::int64_t const*, std::int64_t, std::int64_t);
template <class Backend>
void enqueue_plan_arrays(Backend const&, routing_view const&, std::int32_t, permute_plan<Backend>&, workspace<Backend>&,
                         std::int64_t, char const*, std::int32_t const*);
template <class Backend>
void check_kept_arguments(permute_plan<Backend> const&, routing_view const&, permute_plan<Backend>&, std::int64_t, char const*);
template <class Backend>
void enqueue_kept_permute_plan(Backend const&, permute_plan<Backend> const&, routing_view const&, permute_plan<Backend>&,
                               workspace<Backend>&, std::int64_t);
template <class Backend>
std::int32_t const* enqueue_kept_plan_arrays(Backend const&, permute_plan<Backend> const&, routing_view const&, permute_plan<Backend>&,
                                             workspace<Backend>&, std::int64_t, char const*);
}  // namespace detail

//! The row map of one routing decision: slot `(t, k)` of expert `e` goes to row `row_of[t][k]`,
//! rows ordered by `(e, t, k)` (expert-major, ascending token, ascending slot). Arrays live in the
//! back-end's memory; `num_rows()` is on the host. Move-only.
//!
//! The plan keeps the `routing_view` it was built from: the routing arrays must stay alive and
//! unchanged while the plan is used (unpermute reads the weights through it).
template <class Backend>
class permute_plan {
  template <class T>
  using buffer_t = typename Backend::template buffer_type<T>;

 public:
  //! An empty plan (no tokens, no rows), to be filled by `build_permute_plan`.
  permute_plan() = default;

  //! `[T][K]` destination row of each slot; -1 for masked (and, in unchecked mode, invalid) slots.
  [[nodiscard]] std::int32_t const* row_of() const { return row_of_.data(); }
  //! `[num_rows()]` source token of each row; -1 for a padding row.
  [[nodiscard]] std::int32_t const* token_of() const { return token_of_.data(); }
  //! `[num_rows()]` top-k slot of each row.
  [[nodiscard]] std::int32_t const* slot_of() const { return slot_of_.data(); }
  //! `[E + 1]` first row of each expert's block; the last entry equals `num_rows()`.
  //! Padded to C: `e * C`.
  [[nodiscard]] std::int32_t const* expert_offsets() const { return expert_offsets_.data(); }
  //! The same `[E + 1]` offsets in host memory, read back with `num_rows()` (no further wait).
  [[nodiscard]] array_view<std::int32_t const> host_expert_offsets() const {
    return {host_offsets_.data(), static_cast<std::int64_t>(host_offsets_.size())};
  }
  //! P, rows of the permuted buffer: the number of kept slots, or `E * C` when padded.
  [[nodiscard]] std::int64_t num_rows() const { return num_rows_; }
  //! The rows its device arrays hold: `num_rows()`, or, while the host side of an unpadded plan
  //! from `detail::enqueue_permute_plan` is not completed (a captured step never completes it), one
  //! per slot: the rows after the kept ones are fillers (`token_of` -1), which the kernels that take
  //! this bound skip.
  [[nodiscard]] std::int64_t row_bound() const {
    return host_offsets_.empty() && padded_capacity_ == 0 ? routing_.num_tokens * routing_.top_k : num_rows_;
  }
  //! Slots whose id was out of range and were treated as masked (non-zero only with the value scan off).
  [[nodiscard]] std::int64_t num_invalid_slots() const { return num_invalid_slots_; }
  [[nodiscard]] std::int32_t num_experts() const { return num_experts_; }
  //! C when every block is padded to C rows, else 0.
  [[nodiscard]] std::int64_t padded_capacity() const { return padded_capacity_; }
  [[nodiscard]] routing_view const& routing() const { return routing_; }

 private:
  template <class B>
  friend void detail::move_plan_blocks(B const&, permute_plan<B>&, routing_view const&, std::int32_t*, std::int32_t,
                                       std::int32_t const*, std::int32_t, workspace<B>&, char const*);
  template <class B>
  friend void detail::relabel_padded_plan(B const&, permute_plan<B>&, routing_view const&, std::int32_t const*, workspace<B>&);
  template <class B>
  friend void build_kept_permute_plan(B const&, permute_plan<B> const&, routing_view const&, permute_plan<B>&, workspace<B>&,
                                      routing_checks const&, std::int64_t);
  template <class B>
  friend void detail::enqueue_permute_plan(B const&, routing_view const&, std::int32_t, permute_plan<B>&, workspace<B>&,
                                           routing_checks const&, std::int64_t*, std::int32_t const*);
  template <class B>
  friend void detail::build_ordered_permute_plan(B const&, routing_view const&, std::int32_t, permute_plan<B>&, workspace<B>&,
                                                 routing_checks const&, std::int64_t, std::int32_t const*);
  template <class B>
  friend void detail::move_plan_rows(B const&, permute_plan<B>&, std::int32_t const*, std::int64_t, workspace<B>&);
  template <class B>
  friend void detail::complete_permute_plan(B const&, permute_plan<B>&, std::int64_t const*, std::int64_t, std::int64_t);
  template <class B>
  friend void detail::enqueue_plan_arrays(B const&, routing_view const&, std::int32_t, permute_plan<B>&, workspace<B>&,
                                          std::int64_t, char const*, std::int32_t const*);
  template <class B>
  friend void detail::check_kept_arguments(permute_plan<B> const&, routing_view const&, permute_plan<B>&, std::int64_t, char const*);
  template <class B>
  friend void detail::enqueue_kept_permute_plan(B const&, permute_plan<B> const&, routing_view const&, permute_plan<B>&,
                                                workspace<B>&, std::int64_t);
  template <class B>
  friend std::int32_t const* detail::enqueue_kept_plan_arrays(B const&, permute_plan<B> const&, routing_view const&, permute_plan<B>&,
                                                              workspace<B>&, std::int64_t, char const*);

  //! The plan is now one of `routing` over `num_experts`: reads its expert offsets back to the host.
  void take_routing(Backend const& be, routing_view const& routing, std::int32_t num_experts) {
    host_offsets_.resize(static_cast<std::size_t>(num_experts) + 1);
    detail::read_back(be, host_offsets_.data(), expert_offsets_.data(), num_experts + 1);
    routing_ = routing;
    num_experts_ = num_experts;
  }

  routing_view routing_;
  std::int32_t num_experts_ = 0;
  buffer_t<std::int32_t> row_of_, token_of_, slot_of_, expert_offsets_;
  std::vector<std::int32_t> host_offsets_;  //!< expert_offsets_ on the host (capacity kept)
  std::int64_t num_rows_ = 0;
  std::int64_t num_invalid_slots_ = 0;
  std::int64_t padded_capacity_ = 0;
};

//! Validates `routing` and computes its row map into `plan` (semantics §4, §9): a stable sort of
//! the slots by expert id, then the expert offsets and both directions of the row map. The plan's
//! arrays and the sort's scratch only grow, so rebuilding a plan every step allocates nothing once
//! the sizes have been seen. Blocks until `num_rows()` is known on the host.
//! @param be the back-end that runs the work and owns the plan's memory.
//! @param routing `[T][K]` ids (and weights, used later by `unpermute`), in the back-end's memory.
//! @param num_experts E, the global number of experts.
//! @param plan the plan to (re)build; whatever it held before is replaced.
//! @param scratch the sort's keys and scratch, kept between calls.
//! @param checks the value scans to run (on by default).
//! @param padded_capacity if > 0, every expert block has exactly this many rows: its kept rows,
//!        then padding rows (`token_of = -1`, written as zeros by `permute`).
//! @throws error (invalid_argument) for bad routing, naming the argument, token and slot; or for an
//!         expert with more slots than `padded_capacity`. After an error the plan is empty.
template <class Backend>
void build_permute_plan(Backend const& be, routing_view const& routing, std::int32_t num_experts,
                        permute_plan<Backend>& plan, workspace<Backend>& scratch, routing_checks const& checks = {},
                        std::int64_t padded_capacity = 0) {
  detail::build_ordered_permute_plan(be, routing, num_experts, plan, scratch, checks, padded_capacity, nullptr);
}

namespace detail {

//! `build_permute_plan`, with each expert's rows in the order of `token_order` (`[T]`, a permutation
//! of the tokens; null: ascending tokens) instead of ascending tokens.
template <class Backend>
void build_ordered_permute_plan(Backend const& be, routing_view const& routing, std::int32_t num_experts, permute_plan<Backend>& plan,
                                workspace<Backend>& scratch, routing_checks const& checks, std::int64_t padded_capacity,
                                std::int32_t const* token_order) {
  char const* op = "make_permute_plan";
  plan.routing_ = {};
  plan.num_rows_ = plan.num_invalid_slots_ = plan.padded_capacity_ = 0;
  validate_routing(be, routing, num_experts, checks, op);
  require(padded_capacity >= 0, op, "padded_capacity = ", padded_capacity, " is negative");
  enqueue_plan_arrays(be, routing, num_experts, plan, scratch, padded_capacity, op, token_order);
  std::int64_t invalid = 0;
  if (!checks.scan_values)
    invalid = be.reduce(routing.num_tokens * routing.top_k, std::int64_t{0}, out_of_range_slot{routing.topk_idx, num_experts}, plus{});
  plan.take_routing(be, routing, num_experts);
  plan.padded_capacity_ = padded_capacity;
  plan.num_invalid_slots_ = invalid;
  plan.num_rows_ = plan.host_offsets_.back();
}

//! Moves row r of `plan` to row `new_row[r]` for every r below `rows` (`new_row`: a permutation of
//! them, in the back-end's memory; `plan.row_bound()` covers every row); the row maps follow, the
//! offsets do not change, so a permutation within blocks keeps the plan whole.
template <class Backend>
void move_plan_rows(Backend const& be, permute_plan<Backend>& plan, std::int32_t const* new_row, std::int64_t rows,
                    workspace<Backend>& scratch) {
  std::int32_t* const old_token_of = scratch.template get<std::int32_t>(be, 2 * rows);
  std::int32_t* const old_slot_of = old_token_of + rows;
  be.copy(old_token_of, plan.token_of_.data(), rows);
  be.copy(old_slot_of, plan.slot_of_.data(), rows);
  be.for_each_index(rows, move_rows_to{new_row, plan.routing_.top_k, old_token_of, old_slot_of, plan.token_of_.data(),
                                       plan.slot_of_.data(), plan.row_of_.data()});
}

template <class Backend>
void enqueue_permute_plan(Backend const& be, routing_view const& routing, std::int32_t num_experts, permute_plan<Backend>& plan,
                          workspace<Backend>& scratch, routing_checks const& checks, std::int64_t* status,
                          std::int32_t const* token_order) {
  char const* op = "make_permute_plan";
  plan.routing_ = {};
  plan.num_rows_ = plan.num_invalid_slots_ = plan.padded_capacity_ = 0;
  plan.host_offsets_.clear();
  check_routing_shape(routing, num_experts, op);
  scan_routing_into(be, routing, num_experts, checks, status);
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  if (checks.scan_values) be.for_each_index(1, fill_value<std::int64_t>{status + 1, 0});
  else be.reduce_into(status + 1, slots, std::int64_t{0}, out_of_range_slot{routing.topk_idx, num_experts}, plus{});
  enqueue_plan_arrays(be, routing, num_experts, plan, scratch, 0, op, token_order);
  plan.routing_ = routing;
  plan.num_experts_ = num_experts;
}

//! Completes an `enqueue_permute_plan` plan from what was read back: `counts[e]`, the slots of each
//! expert (host), the first bad slot (-1: none) and the ids out of range. Raises the value scan's
//! error, naming the token and slot (it reads that token back); otherwise the plan is whole.
//! @throws error (invalid_argument) for a bad slot; the plan is empty after it.
template <class Backend>
void complete_permute_plan(Backend const& be, permute_plan<Backend>& plan, std::int64_t const* counts, std::int64_t first_bad,
                           std::int64_t invalid) {
  if (first_bad >= 0) {
    routing_view const routing = plan.routing_;
    plan.routing_ = {};
    report_slot_problem(be, routing, plan.num_experts_, first_bad, "make_permute_plan");
  }
  plan.host_offsets_.resize(static_cast<std::size_t>(plan.num_experts_) + 1);  // capacity kept between steps
  plan.host_offsets_[0] = 0;
  for (std::size_t e = 0; e + 1 < plan.host_offsets_.size(); ++e)
    plan.host_offsets_[e + 1] = plan.host_offsets_[e] + static_cast<std::int32_t>(counts[e]);
  plan.num_rows_ = plan.host_offsets_.back();
  plan.num_invalid_slots_ = invalid;
}

//! The device arrays of a plan (the sort, the offsets, both row maps), as `build_permute_plan`
//! builds them; a padded plan reads its counts back to check them against the capacity.
template <class Backend>
void enqueue_plan_arrays(Backend const& be, routing_view const& routing, std::int32_t num_experts, permute_plan<Backend>& plan,
                         workspace<Backend>& scratch, std::int64_t padded_capacity, char const* op, std::int32_t const* token_order) {
  (void)checked_int32(std::int64_t{num_experts} + 1, op, "num_experts + 1",
                      "the plan's expert offsets [E + 1] are indexed by int32 expert ids");
  std::int64_t const slots = routing.num_tokens * routing.top_k;  // fits int32: check_routing_shape checked it
  char const* const padded = "padded_capacity * num_experts";
  std::int64_t const padded_rows = checked_int32(checked_mul(padded_capacity, num_experts, op, padded), op, padded,
                                                 "the plan's row ids are int32");
  std::int64_t const max_rows = padded_capacity > 0 ? padded_rows : slots;
  grow(be, plan.row_of_, slots);
  grow(be, plan.token_of_, max_rows);
  grow(be, plan.slot_of_, max_rows);
  grow(be, plan.expert_offsets_, std::int64_t{num_experts} + 1);
  // Scratch: keys and slot ids (unsorted | sorted), the unpadded offsets, the sort's own scratch.
  std::size_t const sort_bytes = be.stable_sort_scratch_bytes(slots);
  std::int64_t const words = 4 * slots + num_experts + 1;
  auto* const base = scratch.template get<std::int32_t>(be, words + static_cast<std::int64_t>(sort_bytes / 4 + 1));
  auto* const keys = reinterpret_cast<std::uint32_t*>(base);
  std::uint32_t* const sorted_keys = keys + slots;
  std::int32_t* const slot_ids = base + 2 * slots;
  std::int32_t* const sorted_slots = slot_ids + slots;
  std::int32_t* const unpadded = base + 4 * slots;
  void* const sort_scratch = base + words;
  be.for_each_index(slots, slot_sort_key{routing.topk_idx, num_experts, routing.top_k, token_order, keys, slot_ids});
  be.stable_sort_by_key(keys, sorted_keys, slot_ids, sorted_slots, slots, key_bits(num_experts), sort_scratch, sort_bytes);
  be.for_each_index(num_experts + 1, expert_offsets_from_sorted_keys{sorted_keys, slots, plan.expert_offsets_.data()});
  if (padded_capacity > 0) {
    std::int32_t* const counts = scratch.template host<std::int32_t>(std::int64_t{num_experts} + 1);
    read_back(be, counts, plan.expert_offsets_.data(), num_experts + 1);
    for (std::int32_t e = 0; e < num_experts; ++e) {
      std::int64_t const n = counts[e + 1] - counts[e];
      require(n <= padded_capacity, op, "expert ", e, " has ", n, " slots, more than padded_capacity = ", padded_capacity,
              " (drop to capacity first)");
    }
    be.for_each_index(padded_rows, fill_value<std::int32_t>{plan.token_of_.data(), -1});
    be.for_each_index(padded_rows, fill_value<std::int32_t>{plan.slot_of_.data(), -1});
    be.copy(unpadded, plan.expert_offsets_.data(), num_experts + 1);
  }
  be.for_each_index(slots, row_maps_from_sorted_slots{sorted_keys, sorted_slots, unpadded, padded_capacity, num_experts,
                                                      routing.top_k, plan.row_of_.data(), plan.token_of_.data(),
                                                      plan.slot_of_.data()});
  if (padded_capacity > 0) be.for_each_index(num_experts + 1, padded_offsets{padded_capacity, plan.expert_offsets_.data()});
}

}  // namespace detail

namespace detail {

template <class Backend>
void move_plan_blocks(Backend const& be, permute_plan<Backend>& plan, routing_view const& relabeled, std::int32_t* tables,
                      std::int32_t num_blocks, std::int32_t const* labels, std::int32_t num_experts,
                      workspace<Backend>& scratch, char const* op) {
  std::int64_t const rows = plan.num_rows_, capacity = plan.padded_capacity_;
  std::int32_t const* const bounds = tables;                // [B + 1]
  std::int32_t* const new_offsets = tables + num_blocks + 1;  // [E' + 1]
  std::int32_t* const block_named = new_offsets + num_experts + 1;  // [E']: the block that takes new id j
  require(relabeled.num_tokens == plan.routing_.num_tokens && relabeled.top_k == plan.routing_.top_k, op,
          "argument 'relabeled' has ", relabeled.num_tokens, " x ", relabeled.top_k, " slots; the plan's routing ",
          plan.routing_.num_tokens, " x ", plan.routing_.top_k);
  std::fill(block_named, block_named + num_experts, -1);
  for (std::int32_t b = 0; b < num_blocks; ++b) {
    std::int32_t const j = labels[b];
    require(j >= 0 && j < num_experts && block_named[j] < 0, op, "label[", b, "] = ", j,
            j >= 0 && j < num_experts ? " is given to two blocks" : " is not an expert id", " (new ids are distinct, in [0, ",
            num_experts, "))");
    block_named[j] = b;
  }
  if (capacity > 0)  // padded: every new expert is one whole block of C rows
    for (std::int32_t j = 0; j < num_experts; ++j) {
      std::int32_t const b = block_named[j];
      require(b >= 0 && bounds[b + 1] - bounds[b] == capacity, op, "the plan is padded to ", capacity,
              " rows per expert, so every new expert id must take one block of exactly that many rows; id ", j,
              b < 0 ? " takes none" : " takes a block of another length");
    }
  std::int32_t next = 0;  // the new blocks in new-id order; ids without a block are empty
  for (std::int32_t j = 0; j < num_experts; ++j) {
    std::int32_t const b = block_named[j];
    new_offsets[j] = next;
    if (b >= 0) next += bounds[b + 1] - bounds[b];
  }
  new_offsets[num_experts] = next;
  // Device scratch: the old row maps, the bounds, the new offsets and the labels.
  std::int64_t const tables_size = std::int64_t{num_blocks} + 1 + num_experts + 1;
  std::int32_t* const old_token_of = scratch.template get<std::int32_t>(be, relabel_device_ints(rows, num_blocks, num_experts));
  std::int32_t* const old_slot_of = old_token_of + rows;
  std::int32_t* const device_tables = old_slot_of + rows;
  std::int32_t* const device_labels = device_tables + tables_size;
  be.copy(old_token_of, plan.token_of_.data(), rows);
  be.copy(old_slot_of, plan.slot_of_.data(), rows);
  be.copy(device_tables, tables, tables_size);
  be.copy(device_labels, labels, num_blocks);
  grow(be, plan.expert_offsets_, std::int64_t{num_experts} + 1);
  be.for_each_index(rows, move_row_blocks{device_tables, device_tables + num_blocks + 1, device_labels, num_blocks,
                                          relabeled.top_k, old_token_of, old_slot_of, plan.token_of_.data(),
                                          plan.slot_of_.data(), plan.row_of_.data()});
  be.copy(plan.expert_offsets_.data(), device_tables + num_blocks + 1, std::int64_t{num_experts} + 1);
  plan.take_routing(be, relabeled, num_experts);
}

//! `relabel_permute_plan` of a padded plan on the device alone (a captured step's: no host table,
//! no read back): every expert's block is C rows, so expert e's rows move to `label[e] * C` and the
//! offsets stay. `label` is `[E]` in the back-end's memory, a permutation of `[0, E)` (unchecked).
template <class Backend>
void relabel_padded_plan(Backend const& be, permute_plan<Backend>& plan, routing_view const& relabeled, std::int32_t const* label,
                         workspace<Backend>& scratch) {
  std::int64_t const rows = plan.num_rows_;
  std::int32_t* const old_token_of = scratch.template get<std::int32_t>(be, relabel_device_ints(rows, plan.num_experts_, plan.num_experts_));
  std::int32_t* const old_slot_of = old_token_of + rows;
  be.copy(old_token_of, plan.token_of_.data(), rows);
  be.copy(old_slot_of, plan.slot_of_.data(), rows);
  std::int32_t const* const offsets = plan.expert_offsets_.data();  // the old bounds and the new offsets alike: e * C
  be.for_each_index(rows, move_row_blocks{offsets, offsets, label, plan.num_experts_, relabeled.top_k, old_token_of, old_slot_of,
                                          plan.token_of_.data(), plan.slot_of_.data(), plan.row_of_.data()});
  plan.routing_ = relabeled;
}

}  // namespace detail

//! `plan` becomes the plan of `relabeled`, the same routing with expert e renamed `label[e]` (a
//! permutation of `[0, E)`), without sorting again: each expert's block of rows moves, in order, to
//! its new expert's place (padded plans keep their capacity). Equal to `build_permute_plan` on
//! `relabeled` with the same padding, array for array; the routing checks already ran on the
//! original. Blocks until done.
//! @param label `[E]` in host memory (not in `scratch`).
//! @throws error (invalid_argument) naming `label` when it is not a permutation of `[0, E)` or
//!         `relabeled` when its shape is not the plan's; the plan is unchanged then.
template <class Backend>
void relabel_permute_plan(Backend const& be, permute_plan<Backend>& plan, routing_view const& relabeled,
                          array_view<std::int32_t const> label, workspace<Backend>& scratch) {
  char const* op = "relabel_permute_plan";
  std::int32_t const experts = plan.num_experts();
  detail::check_elements(label, experts, op, "label", "one new id per expert of the plan");
  std::int32_t* const tables = scratch.template host<std::int32_t>(detail::relabel_host_ints(experts, experts));
  detail::read_back(be, tables, plan.expert_offsets(), experts + 1);  // the blocks are the experts' blocks
  detail::move_plan_blocks(be, plan, relabeled, tables, experts, label.data, experts, scratch, op);
}

//! Runs of a plan's rows, each given a new expert id (`relabel_permute_plan`).
struct row_blocks {
  array_view<std::int32_t const> ends;    //!< `[B]` ascending row ends: block b is rows `[ends[b-1], ends[b])`
  array_view<std::int32_t const> labels;  //!< `[B]` the new expert id of each block, distinct
};

//! `plan` becomes the plan of `relabeled` over `num_experts` new ids, where the plan's rows, cut
//! into `blocks`, each take one new id: a finer relabeling than the experts' own (the replicated
//! layer gives each replica's share of an expert's rows the replica's slot id). Each block moves in
//! order, so the result equals `build_permute_plan` on `relabeled` whenever each block lies in one
//! expert's rows; ids without a block are empty. A padded plan stays padded: every new id must take
//! one block of exactly C rows. Blocks until done.
//! @param blocks host memory; the last end is the plan's `num_rows()`.
//! @throws error (invalid_argument) naming `blocks` (ends not ascending or not covering the rows; a
//!         label out of `[0, num_experts)` or given twice) or `relabeled`; the plan is unchanged then.
template <class Backend>
void relabel_permute_plan(Backend const& be, permute_plan<Backend>& plan, routing_view const& relabeled,
                          row_blocks const& blocks, std::int32_t num_experts, workspace<Backend>& scratch) {
  char const* op = "relabel_permute_plan";
  detail::require(num_experts > 0, op, "num_experts = ", num_experts, " must be positive");
  std::int64_t const B = blocks.ends.size;
  detail::require(blocks.labels.size == B, op, "argument 'blocks' has ", B, " ends and ", blocks.labels.size,
                  " labels; needs one label per block");
  detail::require(B <= std::int64_t{plan.num_rows()} + num_experts, op, "argument 'blocks' has ", B,
                  " blocks, more than rows + num_experts (each non-empty block takes a row, each empty one an id)");
  detail::check_elements(blocks.ends, B, op, "blocks.ends", "one end per block");
  detail::check_elements(blocks.labels, B, op, "blocks.labels", "one label per block");
  std::int32_t* const tables = scratch.template host<std::int32_t>(detail::relabel_host_ints(B, num_experts));
  tables[0] = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int32_t const end = blocks.ends.data[b];
    detail::require(end >= tables[b] && end <= plan.num_rows(), op, "blocks.ends[", b, "] = ", end,
                    end < tables[b] ? " is below the end before it" : " is past the plan's rows ", plan.num_rows());
    tables[b + 1] = end;
  }
  detail::require(tables[B] == plan.num_rows(), op, "blocks.ends ends at ", tables[B], "; the plan has ", plan.num_rows(),
                  " rows, and every row needs a block");
  detail::move_plan_blocks(be, plan, relabeled, tables, static_cast<std::int32_t>(B), blocks.labels.data, num_experts,
                           scratch, op);
}

//! `kept` becomes the plan of `kept_routing`, the routing of `dropless` with some slots masked (a
//! capacity's kept routing: `drop_to_capacity`, a receiver budget), without sorting again: the
//! dropless rows that survive keep their order (an exclusive sum over the rows gives each its new
//! row). Equal to `build_permute_plan` on `kept_routing` with the same padding, array for array.
//! Blocks until `num_rows()` is known on the host.
//! @param dropless the routing's unpadded plan (`build_permute_plan`); not `kept`.
//! @param kept_routing the same shape; each id is -1 or the slot's id in `dropless`'s routing.
//! @param checks `scan_values` checks that `kept_routing` is such a masking (one pass over the
//!        slots); with it off, as for a kept routing the caller made itself, a negative id is
//!        dropped and any other keeps its slot under the dropless routing's id (never an
//!        out-of-bounds access).
//! @param padded_capacity if > 0, every expert block of `kept` has exactly this many rows.
//! @throws error (invalid_argument) naming `kept_routing`'s first slot that is not a masking of the
//!         dropless routing, or an expert with more kept slots than `padded_capacity`. After an
//!         error `kept` is empty.
template <class Backend>
void build_kept_permute_plan(Backend const& be, permute_plan<Backend> const& dropless, routing_view const& kept_routing,
                             permute_plan<Backend>& kept, workspace<Backend>& scratch, routing_checks const& checks = {},
                             std::int64_t padded_capacity = 0) {
  char const* op = "build_kept_permute_plan";
  detail::check_kept_arguments(dropless, kept_routing, kept, padded_capacity, op);
  routing_view const& routing = dropless.routing_;
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  if (checks.scan_values) {
    std::int64_t const bad =
        be.reduce(slots, slots,
                  detail::first_index_where<detail::not_a_masking>{{routing.topk_idx, dropless.row_of(), kept_routing.topk_idx}, slots},
                  detail::minimum{});
    if (bad < slots) {
      std::int32_t ids[2] = {0, 0};
      be.copy(&ids[0], kept_routing.topk_idx + bad, 1);
      be.copy(&ids[1], routing.topk_idx + bad, 1);
      be.synchronize();
      detail::fail(status::invalid_argument, op, "argument 'kept_routing' has expert ", ids[0], " at token ",
                   bad / routing.top_k, ", slot ", bad % routing.top_k, " where the dropless routing has ", ids[1],
                   " (a kept routing only masks slots, to -1)");
    }
  }
  std::int32_t const* const kept_offsets = detail::enqueue_kept_plan_arrays(be, dropless, kept_routing, kept, scratch, padded_capacity, op);
  if (padded_capacity > 0) {
    std::int32_t const experts = dropless.num_experts_;
    std::int32_t* const counts = scratch.template host<std::int32_t>(std::int64_t{experts} + 1);
    detail::read_back(be, counts, kept_offsets, experts + 1);
    for (std::int32_t e = 0; e < experts; ++e) {
      std::int64_t const n = counts[e + 1] - counts[e];
      detail::require(n <= padded_capacity, op, "expert ", e, " keeps ", n, " slots, more than padded_capacity = ",
                      padded_capacity);
    }
  }
  kept.take_routing(be, kept_routing, dropless.num_experts_);
  kept.padded_capacity_ = padded_capacity;
  kept.num_rows_ = kept.host_offsets_.back();
}

namespace detail {

//! `build_kept_permute_plan`'s O(1) checks; `kept` is empty after them.
template <class Backend>
void check_kept_arguments(permute_plan<Backend> const& dropless, routing_view const& kept_routing, permute_plan<Backend>& kept,
                          std::int64_t padded_capacity, char const* op) {
  require(&kept != &dropless, op, "argument 'kept' is 'dropless': the kept plan needs arrays of its own");
  kept.routing_ = {};
  kept.num_rows_ = kept.num_invalid_slots_ = kept.padded_capacity_ = 0;
  kept.host_offsets_.clear();
  require(dropless.padded_capacity_ == 0, op, "argument 'dropless' is padded to ", dropless.padded_capacity_,
          " rows per expert; it must be the routing's unpadded plan");
  routing_view const& routing = dropless.routing_;
  require(kept_routing.num_tokens == routing.num_tokens && kept_routing.top_k == routing.top_k, op, "argument 'kept_routing' has ",
          kept_routing.num_tokens, " x ", kept_routing.top_k, " slots; the dropless plan's routing ", routing.num_tokens, " x ",
          routing.top_k);
  require(padded_capacity >= 0, op, "padded_capacity = ", padded_capacity, " is negative");
  require(routing.num_tokens * routing.top_k == 0 || kept_routing.topk_idx != nullptr, op, "argument 'kept_routing' has null topk_idx");
}

//! `build_kept_permute_plan` for a kept routing that keeps at most `padded_capacity` slots per
//! expert by construction (a drop to that capacity: `enqueue_drop_to_capacity`), without a host
//! wait: padded, the plan is whole at once (its offsets are `e * C`); unpadded, its host side waits
//! for `complete_permute_plan` with the kept counts (which a count exchange brings).
template <class Backend>
void enqueue_kept_permute_plan(Backend const& be, permute_plan<Backend> const& dropless, routing_view const& kept_routing,
                               permute_plan<Backend>& kept, workspace<Backend>& scratch, std::int64_t padded_capacity) {
  char const* op = "build_kept_permute_plan";
  check_kept_arguments(dropless, kept_routing, kept, padded_capacity, op);
  (void)enqueue_kept_plan_arrays(be, dropless, kept_routing, kept, scratch, padded_capacity, op);
  std::int32_t const experts = dropless.num_experts_;
  kept.routing_ = kept_routing;
  kept.num_experts_ = experts;
  kept.padded_capacity_ = padded_capacity;
  if (padded_capacity > 0) {
    kept.host_offsets_.resize(static_cast<std::size_t>(experts) + 1);  // capacity kept between steps
    for (std::int32_t e = 0; e <= experts; ++e) kept.host_offsets_[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(e * padded_capacity);
    kept.num_rows_ = kept.host_offsets_.back();
  }
}

//! The kept plan's device arrays; returns the unpadded kept offsets (`[E + 1]`, in the scratch).
template <class Backend>
std::int32_t const* enqueue_kept_plan_arrays(Backend const& be, permute_plan<Backend> const& dropless, routing_view const& kept_routing,
                                             permute_plan<Backend>& kept, workspace<Backend>& scratch, std::int64_t padded_capacity,
                                             char const* op) {
  routing_view const& routing = dropless.routing_;
  std::int32_t const experts = dropless.num_experts_;
  std::int64_t const slots = routing.num_tokens * routing.top_k, rows = dropless.row_bound();
  char const* const padded = "padded_capacity * num_experts";
  std::int64_t const padded_rows = checked_int32(checked_mul(padded_capacity, experts, op, padded), op, padded,
                                                 "the plan's row ids are int32");
  std::int64_t const max_rows = padded_capacity > 0 ? padded_rows : rows;
  grow(be, kept.row_of_, slots);
  grow(be, kept.token_of_, max_rows);
  grow(be, kept.slot_of_, max_rows);
  grow(be, kept.expert_offsets_, std::int64_t{experts} + 1);
  // Scratch: each row's kept flag, scanned in place to its kept position; the unpadded kept offsets; the scan's scratch.
  std::size_t const scan_bytes = be.exclusive_sum_scratch_bytes(rows + 1);
  std::int64_t const words = rows + 1 + experts + 1;
  std::int32_t* const positions = scratch.template get<std::int32_t>(be, words + static_cast<std::int64_t>(scan_bytes / 4 + 1));
  std::int32_t* const kept_offsets = positions + rows + 1;
  void* const scan_scratch = positions + words;
  be.for_each_index(rows + 1, kept_row_flags{dropless.token_of(), dropless.slot_of(), kept_routing.topk_idx, routing.top_k, rows,
                                             positions});
  be.exclusive_sum(positions, positions, rows + 1, scan_scratch, scan_bytes);
  be.for_each_index(std::int64_t{experts} + 1, kept_offsets_from_positions{dropless.expert_offsets(), positions, kept_offsets});
  if (padded_capacity > 0) {
    be.for_each_index(padded_rows, fill_value<std::int32_t>{kept.token_of_.data(), -1});
    be.for_each_index(padded_rows, fill_value<std::int32_t>{kept.slot_of_.data(), -1});
    be.for_each_index(std::int64_t{experts} + 1, padded_offsets{padded_capacity, kept.expert_offsets_.data()});
  } else {
    be.copy(kept.expert_offsets_.data(), kept_offsets, experts + 1);
  }
  be.for_each_index(slots, fill_value<std::int32_t>{kept.row_of_.data(), -1});
  be.for_each_index(rows, move_kept_rows{dropless.token_of(), dropless.slot_of(), routing.topk_idx, kept_routing.topk_idx, positions,
                                         kept_offsets, padded_capacity, routing.top_k, kept.token_of_.data(), kept.slot_of_.data(),
                                         kept.row_of_.data()});
  return kept_offsets;
}

}  // namespace detail

//! `build_permute_plan` into a new plan, with scratch of its own: for a one-off routing. A loop
//! that routes every step keeps a plan and a workspace and rebuilds.
template <class Backend>
[[nodiscard]] permute_plan<Backend> make_permute_plan(Backend const& be, routing_view const& routing,
                                                      std::int32_t num_experts, routing_checks const& checks = {},
                                                      std::int64_t padded_capacity = 0) {
  permute_plan<Backend> plan;
  workspace<Backend> scratch;
  build_permute_plan(be, routing, num_experts, plan, scratch, checks, padded_capacity);
  return plan;
}

namespace detail {

//! A routing of `tokens` x `top_k` slots over every expert in turn, weights 1/K, in the back-end's
//! memory: what a `reserve` builds its plans on once, so that their arrays and scratch have the size
//! of the largest step.
template <class Backend>
class largest_routing {
 public:
  largest_routing(Backend const& be, std::int64_t tokens, std::int32_t top_k, std::int32_t num_experts)
      : idx_(be.template allocate<std::int32_t>(tokens * top_k)), weights_(be.template allocate<float>(tokens * top_k)),
        view_{idx_.data(), weights_.data(), tokens, top_k} {
    std::int64_t const slots = tokens * top_k;
    std::vector<std::int32_t> host_idx(static_cast<std::size_t>(slots));
    for (std::int64_t i = 0; i < slots; ++i) host_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % num_experts);
    be.copy(idx_.data(), host_idx.data(), slots);
    be.for_each_index(slots, fill_value<float>{weights_.data(), 1.0f / static_cast<float>(top_k)});
    be.synchronize();  // host_idx goes
  }
  [[nodiscard]] routing_view const& view() const { return view_; }

 private:
  typename Backend::template buffer_type<std::int32_t> idx_;
  typename Backend::template buffer_type<float> weights_;
  routing_view view_;
};

}  // namespace detail

MOECOMM_NAMESPACE_END
