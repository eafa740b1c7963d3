// SPDX-License-Identifier: Apache-2.0
#pragma once
// The capacity policy that the Python arguments name, and the call with it as a C++ type.

#include <moecomm/rows/capacity.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <string>

namespace moecomm_python {

// drop = "none" (dropless), "position", "probs", "random" (capacity<rule> with `factor`,
// `min_capacity`, `pad`) or "rank" (receiver_budget of `rows_per_rank`).
struct capacity_spec {
  std::string drop = "none";
  double factor = 1.0;
  std::int64_t min_capacity = 0;
  bool pad = false;
  std::uint64_t seed = 0;
  std::uint32_t layer = 0;
  std::int64_t rows_per_rank = 0;
};

template <class Rule>
moecomm::capacity<Rule> capacity_of(capacity_spec const& c, Rule rule) {
  moecomm::capacity<Rule> policy;
  policy.factor = c.factor;
  policy.min_capacity = c.min_capacity;
  policy.pad_to_capacity = c.pad;
  policy.rule = rule;
  return policy;
}

// Calls `f(policy)` with the capacity policy `c` names: the layers and dispatchers are instantiated
// for each.
template <class F>
decltype(auto) with_capacity(capacity_spec const& c, char const* op, F&& f) {
  moecomm::detail::require(c.drop == "none" || c.drop == "position" || c.drop == "probs" || c.drop == "random" || c.drop == "rank",
                           op, "drop policy '", c.drop, "' is not one of position, probs, random");
  if (c.drop == "position") return f(capacity_of(c, moecomm::drop_by_position{}));
  if (c.drop == "probs") return f(capacity_of(c, moecomm::drop_by_probability{}));
  if (c.drop == "random") return f(capacity_of(c, moecomm::drop_random{c.seed, c.layer}));
  if (c.drop == "rank") return f(moecomm::receiver_budget{c.rows_per_rank});
  return f(moecomm::dropless{});
}

}  // namespace moecomm_python
