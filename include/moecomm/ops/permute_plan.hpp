// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `permute_plan`: where every slot's row goes when tokens are grouped by expert (semantics §4).
//!
//! Built once per routing decision and shared by permute, unpermute and their backward passes,
//! like DeepEP's dispatch handle or TransformerEngine's row map.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/ops/matrix_checks.hpp>
#include <moecomm/ops/validate_routing.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The sort key of slot `i`: its expert id, or `E` for masked and out-of-range slots, so they sort
//! after every expert (the unsigned-key rule of semantics §2.4).
struct slot_sort_key {
  std::int32_t const* idx;
  std::int32_t num_experts;
  std::uint32_t* keys;
  std::int32_t* slots;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int32_t const e = idx[i];
    keys[i] = static_cast<std::uint32_t>(is_valid_expert(e, num_experts) ? e : num_experts);
    slots[i] = static_cast<std::int32_t>(i);
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

//! Row `r` of expert e's block moves to the same place in the block of expert `label[e]`
//! (`relabel_permute_plan`): rows keep their order within a block, as a stable sort would.
struct move_expert_blocks {
  std::int32_t const* old_offsets;   //!< `[E + 1]`
  std::int32_t const* new_offsets;   //!< `[E + 1]`, by new expert id
  std::int32_t const* label;         //!< `[E]`
  std::int32_t num_experts;
  std::int32_t top_k;
  std::int32_t const* old_token_of;  //!< `[rows]`
  std::int32_t const* old_slot_of;
  std::int32_t* token_of;
  std::int32_t* slot_of;
  std::int32_t* row_of;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    std::int32_t lo = 0, hi = num_experts;  // the expert whose block holds r: the last e with offsets[e] <= r
    while (hi - lo > 1) {
      std::int32_t const mid = lo + (hi - lo) / 2;
      if (old_offsets[mid] <= r) lo = mid; else hi = mid;
    }
    std::int64_t const moved = new_offsets[label[lo]] + (r - old_offsets[lo]);
    token_of[moved] = old_token_of[r];
    slot_of[moved] = old_slot_of[r];
    if (old_token_of[r] >= 0) row_of[std::int64_t{old_token_of[r]} * top_k + old_slot_of[r]] = static_cast<std::int32_t>(moved);
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
  //! P, rows of the permuted buffer: the number of kept slots, or `E * C` when padded.
  [[nodiscard]] std::int64_t num_rows() const { return num_rows_; }
  //! Slots whose id was out of range and were treated as masked (non-zero only with the value scan off).
  [[nodiscard]] std::int64_t num_invalid_slots() const { return num_invalid_slots_; }
  [[nodiscard]] std::int32_t num_experts() const { return num_experts_; }
  //! C when every block is padded to C rows, else 0.
  [[nodiscard]] std::int64_t padded_capacity() const { return padded_capacity_; }
  [[nodiscard]] routing_view const& routing() const { return routing_; }

 private:
  template <class B>
  friend void relabel_permute_plan(B const&, permute_plan<B>&, routing_view const&, array_view<std::int32_t const>,
                                   workspace<B>&);
  template <class B>
  friend void build_permute_plan(B const&, routing_view const&, std::int32_t, permute_plan<B>&, workspace<B>&,
                                 routing_checks const&, std::int64_t);

  routing_view routing_;
  std::int32_t num_experts_ = 0;
  buffer_t<std::int32_t> row_of_, token_of_, slot_of_, expert_offsets_;
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
  char const* op = "make_permute_plan";
  plan.routing_ = {};
  plan.num_rows_ = plan.num_invalid_slots_ = plan.padded_capacity_ = 0;
  validate_routing(be, routing, num_experts, checks, op);
  detail::require(padded_capacity >= 0, op, "padded_capacity = ", padded_capacity, " is negative");
  (void)detail::checked_int32(std::int64_t{num_experts} + 1, op, "num_experts + 1",
                              "the plan's expert offsets [E + 1] are indexed by int32 expert ids");
  std::int64_t const slots = routing.num_tokens * routing.top_k;  // fits int32: validate_routing checked it
  char const* const padded = "padded_capacity * num_experts";
  std::int64_t const padded_rows = detail::checked_int32(detail::checked_mul(padded_capacity, num_experts, op, padded),
                                                         op, padded, "the plan's row ids are int32");
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
  be.for_each_index(slots, detail::slot_sort_key{routing.topk_idx, num_experts, keys, slot_ids});
  be.stable_sort_by_key(keys, sorted_keys, slot_ids, sorted_slots, slots, detail::key_bits(num_experts), sort_scratch,
                        sort_bytes);
  be.for_each_index(num_experts + 1, detail::expert_offsets_from_sorted_keys{sorted_keys, slots, plan.expert_offsets_.data()});
  if (padded_capacity > 0) {
    std::int32_t* const counts = scratch.template host<std::int32_t>(std::int64_t{num_experts} + 1);
    be.copy(counts, plan.expert_offsets_.data(), num_experts + 1);
    be.synchronize();
    for (std::int32_t e = 0; e < num_experts; ++e) {
      std::int64_t const n = counts[e + 1] - counts[e];
      detail::require(n <= padded_capacity, op, "expert ", e, " has ", n, " slots, more than padded_capacity = ",
                      padded_capacity, " (drop to capacity first)");
    }
    be.for_each_index(padded_rows, detail::fill_value<std::int32_t>{plan.token_of_.data(), -1});
    be.for_each_index(padded_rows, detail::fill_value<std::int32_t>{plan.slot_of_.data(), -1});
    be.copy(unpadded, plan.expert_offsets_.data(), num_experts + 1);
  }
  be.for_each_index(slots, detail::row_maps_from_sorted_slots{sorted_keys, sorted_slots, unpadded, padded_capacity,
                                                              num_experts, routing.top_k, plan.row_of_.data(),
                                                              plan.token_of_.data(), plan.slot_of_.data()});
  if (padded_capacity > 0)
    be.for_each_index(num_experts + 1, detail::padded_offsets{padded_capacity, plan.expert_offsets_.data()});
  std::int32_t num_rows = 0;
  be.copy(&num_rows, plan.expert_offsets_.data() + num_experts, 1);
  std::int64_t invalid = 0;
  if (!checks.scan_values)
    invalid = be.reduce(slots, std::int64_t{0}, detail::out_of_range_slot{routing.topk_idx, num_experts}, detail::plus{});
  be.synchronize();
  plan.routing_ = routing;
  plan.num_experts_ = num_experts;
  plan.padded_capacity_ = padded_capacity;
  plan.num_invalid_slots_ = invalid;
  plan.num_rows_ = num_rows;
}

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
  std::int32_t const experts = plan.num_experts_;
  std::int64_t const rows = plan.num_rows_;
  detail::check_elements(label, experts, op, "label", "one new id per expert of the plan");
  detail::require(relabeled.num_tokens == plan.routing_.num_tokens && relabeled.top_k == plan.routing_.top_k, op,
                  "argument 'relabeled' has ", relabeled.num_tokens, " x ", relabeled.top_k, " slots; the plan's routing ",
                  plan.routing_.num_tokens, " x ", plan.routing_.top_k);
  std::int32_t* const offsets = scratch.template host<std::int32_t>(3 * (std::int64_t{experts} + 1));
  std::int32_t* const moved_offsets = offsets + experts + 1;
  std::int32_t* const expert_named = moved_offsets + experts + 1;  // [E]: the old expert that takes new id j
  std::fill(expert_named, expert_named + experts, -1);
  for (std::int32_t e = 0; e < experts; ++e) {
    std::int32_t const j = label.data[e];
    detail::require(j >= 0 && j < experts && expert_named[j] < 0, op, "label[", e, "] = ", j,
                    j >= 0 && j < experts ? " is given to two experts" : " is not an expert id",
                    " (label must be a permutation of [0, ", experts, "))");
    expert_named[j] = e;
  }
  be.copy(offsets, plan.expert_offsets_.data(), experts + 1);
  be.synchronize();
  std::int32_t next = 0;  // the new blocks in new-id order, each as long as its old one
  for (std::int32_t j = 0; j < experts; ++j) {
    std::int32_t const e = expert_named[j];
    std::int32_t const length = offsets[e + 1] - offsets[e];
    moved_offsets[j] = next;
    next += length;
  }
  moved_offsets[experts] = next;
  // Device scratch: the old row maps, both offset tables and the label.
  std::int32_t* const old_maps = scratch.template get<std::int32_t>(be, 2 * rows + 3 * (std::int64_t{experts} + 1));
  std::int32_t* const old_slot_of = old_maps + rows;
  std::int32_t* const device_offsets = old_slot_of + rows;
  std::int32_t* const device_label = device_offsets + 2 * (experts + 1);
  be.copy(old_maps, plan.token_of_.data(), rows);
  be.copy(old_slot_of, plan.slot_of_.data(), rows);
  be.copy(device_offsets, offsets, 2 * (std::int64_t{experts} + 1));
  be.copy(device_label, label.data, experts);
  be.for_each_index(rows, detail::move_expert_blocks{device_offsets, device_offsets + experts + 1, device_label, experts,
                                                     relabeled.top_k, old_maps, old_slot_of, plan.token_of_.data(),
                                                     plan.slot_of_.data(), plan.row_of_.data()});
  be.copy(plan.expert_offsets_.data(), device_offsets + experts + 1, experts + 1);
  be.synchronize();
  plan.routing_ = relabeled;
}

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

MOECOMM_NAMESPACE_END
