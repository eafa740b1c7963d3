// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Routing validation: the O(1) shape checks and the value scan over every slot (semantics §2,
//! reliability checklist items 1–5). Errors name the argument, the token and the slot, and are
//! raised before anything is written.

#include <moecomm/config.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/error.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

MOECOMM_HOST_DEVICE inline bool is_nan(float x) {
#if MOECOMM_DEVICE_PASS()
  return isnan(x);
#else
  return std::isnan(x);
#endif
}

//! True for an expert id that addresses an expert (masked slots and out-of-range ids do not).
MOECOMM_HOST_DEVICE inline bool is_valid_expert(std::int32_t e, std::int32_t num_experts) {
  return e >= 0 && e < num_experts;
}

//! True when slot `i` breaks the routing contract: an id outside `[-1, E)`, a NaN weight in a
//! valid slot, or (strict mode) an expert the token already named in an earlier slot.
struct slot_problem {
  std::int32_t const* idx;
  float const* weights;
  std::int32_t top_k;
  std::int32_t num_experts;
  bool reject_duplicates;

  MOECOMM_HOST_DEVICE bool operator()(std::int64_t i) const {
    std::int32_t const e = idx[i];
    if (e == -1) return false;
    if (!is_valid_expert(e, num_experts)) return true;
    if (weights != nullptr && is_nan(weights[i])) return true;
    if (reject_duplicates) {
      std::int64_t const first = i - i % top_k;
      for (std::int64_t j = first; j < i; ++j)
        if (idx[j] == e) return true;
    }
    return false;
  }
};

//! Whether `checks` scan every slot's values (ids, weights, duplicates).
inline bool scans_values(routing_checks const& checks) { return checks.scan_values || checks.reject_duplicates; }

//! `i` for a slot that breaks the contract, else the number of slots: minimised, the first bad slot.
inline first_index_where<slot_problem> first_bad_slot(routing_view const& routing, std::int32_t num_experts,
                                                      routing_checks const& checks) {
  return {slot_problem{routing.topk_idx, routing.topk_weights, routing.top_k, num_experts, checks.reject_duplicates},
          routing.num_tokens * routing.top_k};
}

//! The O(1) checks: shapes and pointers.
inline void check_routing_shape(routing_view const& routing, std::int32_t num_experts, char const* op) {
  require(num_experts > 0, op, "num_experts = ", num_experts, " must be positive");
  require(routing.num_tokens >= 0, op, "routing.num_tokens = ", routing.num_tokens, " is negative");
  require(routing.top_k > 0, op, "routing.top_k = ", routing.top_k, " must be positive");
  require(routing.top_k <= num_experts, op, "routing.top_k = ", routing.top_k, " exceeds num_experts = ", num_experts);
  char const* const slots = "routing.num_tokens * routing.top_k";
  (void)checked_int32(checked_mul(routing.num_tokens, routing.top_k, op, slots), op, slots,
                      "every slot needs an int32 row id");
  require(routing.num_tokens == 0 || routing.topk_idx != nullptr, op, "routing.topk_idx is null with num_tokens = ",
          routing.num_tokens);
}

//! Builds the message for the first bad slot, reading that token's ids and weights back.
template <class Backend>
[[noreturn]] void report_slot_problem(Backend const& be, routing_view const& routing, std::int32_t num_experts,
                                      std::int64_t slot, char const* op) {
  std::int32_t const k_count = routing.top_k;
  std::int64_t const t = slot / k_count;
  std::int32_t const k = static_cast<std::int32_t>(slot % k_count);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(k_count));
  std::vector<float> w(static_cast<std::size_t>(k_count));
  be.copy(ids.data(), routing.topk_idx + t * k_count, k_count);
  if (routing.topk_weights != nullptr) be.copy(w.data(), routing.topk_weights + t * k_count, k_count);
  be.synchronize();
  std::int32_t const e = ids[static_cast<std::size_t>(k)];
  auto const where = concat(" (token ", t, ", slot ", k, ")");
  if (!is_valid_expert(e, num_experts))
    fail(status::invalid_argument, op, "topk_idx[", t, "][", k, "] = ", e, " is out of range: experts are [0, ",
         num_experts, "), or -1 for a masked slot", where);
  if (routing.topk_weights != nullptr && std::isnan(w[static_cast<std::size_t>(k)]))
    fail(status::invalid_argument, op, "topk_weights[", t, "][", k, "] is NaN in a valid slot (expert ", e, ")",
         where);
  for (std::int32_t j = 0; j < k; ++j)
    if (ids[static_cast<std::size_t>(j)] == e)
      fail(status::invalid_argument, op, "topk_idx[", t, "][", k, "] = ", e, " repeats topk_idx[", t, "][", j,
           "]: token ", t, " names expert ", e, " twice, which strict mode (reject_duplicates) rejects", where);
  fail(status::internal_error, op, "slot ", slot, " was flagged but no problem was found on re-reading it");
}

}  // namespace detail

//! Validates `routing` for `num_experts` experts: always the shape checks, and the value scan of
//! every slot when `checks.scan_values` or `checks.reject_duplicates` (semantics §2).
//! @param op the operation named in an error message.
//! @throws error (invalid_argument) naming the argument, and for a bad slot the token and slot.
template <class Backend>
void validate_routing(Backend const& be, routing_view const& routing, std::int32_t num_experts,
                      routing_checks const& checks, char const* op = "validate_routing") {
  detail::check_routing_shape(routing, num_experts, op);
  if (!detail::scans_values(checks)) return;
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  std::int64_t const first_bad = be.reduce(slots, slots, detail::first_bad_slot(routing, num_experts, checks), detail::minimum{});
  if (first_bad < slots) detail::report_slot_problem(be, routing, num_experts, first_bad, op);
}

namespace detail {

//! `validate_routing`'s value scan without its host wait: `*first_bad` (the back-end's memory)
//! becomes the first slot that breaks the contract, or the number of slots when none does or the
//! scan is off. The caller reads it back with other values and, when it is a slot, raises the
//! error with `report_slot_problem`.
template <class Backend>
void scan_routing_into(Backend const& be, routing_view const& routing, std::int32_t num_experts, routing_checks const& checks,
                       std::int64_t* first_bad) {
  std::int64_t const slots = routing.num_tokens * routing.top_k;
  if (scans_values(checks)) be.reduce_into(first_bad, slots, slots, first_bad_slot(routing, num_experts, checks), minimum{});
  else be.for_each_index(1, fill_value<std::int64_t>{first_bad, slots});
}

}  // namespace detail

MOECOMM_NAMESPACE_END
