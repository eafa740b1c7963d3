// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FineMoE / MicroMoE (arXiv 2511.16947; reference/systems.md §4) as one policy of the layer:
//! replicas placed up front (`replica_placement::cyclic`, the symmetric placement, or
//! `from_loads`, the asymmetric one), and every step each expert's tokens split over its replicas
//! by the exact min-max schedule (`schedule_replicas`, eq. 3) and assigned by Algorithm 1.
//!
//! ```cpp
//! auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, E, H, moecomm::finemoe{placement});
//! ```
//!
//! The layer is a `replicated_expert_layer<T, Backend, Comm, finemoe_split>` (patterns/replicated_experts.hpp):
//! outputs and gradients equal plain expert parallelism's bit for bit. The paper's adaptive
//! re-placement (every ~50 steps) is `layer.move_replicas(new_placement, experts, optimizer_state)`.

#include <moecomm/patterns/replicated_experts.hpp>

MOECOMM_NAMESPACE_BEGIN

//! Static placement, per-step exact min-max split: `finemoe{placement}`.
using finemoe = replicated<finemoe_split, static_placement>;

MOECOMM_NAMESPACE_END
