// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Routing input: which experts each token goes to (`topk_idx`) and with what weight.

#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! A non-owning view of one rank's routing decision (semantics §2).
//!
//! `topk_idx` is `[num_tokens][top_k]` row-major `int32`: an expert id in `[0, E)`, or `-1` for a
//! masked slot. `topk_weights`, when given, is `[num_tokens][top_k]` `float`; weights of masked
//! slots are never read. Both live where the back-end reads (host memory for `host_backend`,
//! device memory for `cuda_backend`).
struct routing_view {
  std::int32_t const* topk_idx = nullptr;  //!< `[num_tokens][top_k]` expert ids, -1 = masked
  float const* topk_weights = nullptr;     //!< `[num_tokens][top_k]` routing weights, or null
  std::int64_t num_tokens = 0;             //!< T, tokens on this rank
  std::int32_t top_k = 0;                  //!< K, slots per token
};

//! Which value scans run when routing is consumed. The O(1) shape checks always run.
struct routing_checks {
  //! Scan every slot: expert ids must be in `[0, E)` or -1, weights of valid slots not NaN.
  //! With the scan off, an out-of-range id is treated as a masked slot (never an out-of-bounds
  //! access) and counted in the plan's `num_invalid_slots()`.
  bool scan_values = true;
  //! Strict mode: reject a token that names the same expert in two slots. By default duplicates
  //! are two distinct slots (semantics §2.3).
  bool reject_duplicates = false;
};

//! Checks off: for callers who validated the routing themselves and want the last microsecond.
inline constexpr routing_checks unchecked_routing{false, false};

MOECOMM_NAMESPACE_END
