// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! FlexMoE (SIGMOD'23, arXiv 2304.03946; reference/systems.md §3, reconstructed: the paper has no
//! public code) as one policy of the layer: each rank's tokens of an expert shared evenly among its
//! replicas, and the replicas themselves moved as the load drifts.
//!
//! ```cpp
//! moecomm::flexmoe_planner_options planner;   // threshold, interval, costs (planners/flexmoe_planner.hpp)
//! auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, E, H, moecomm::flexmoe{placement, {}, {planner}});
//! for (int step = 0; ...; ++step) {
//!   layer.forward(...); layer.backward(...); optimizer.step();
//!   if (step % planner.interval_steps == planner.interval_steps - 1) layer.rebalance(experts, optimizer_state);
//! }
//! ```
//!
//! `rebalance` plans on the mean expert loads since the last call (they are all-gathered every
//! forward, so every rank plans the same moves) and makes the moves that pay off within the
//! interval: expanded and migrated replicas receive the parameters and the optimizer state
//! (`collectives/replica_migration.hpp`). The layer is a `replicated_expert_layer<T, Backend, Comm,
//! even_split, weighted, dynamic_placement>`: outputs and gradients equal plain expert
//! parallelism's bit for bit, before and after any move.

#include <moecomm/patterns/replicated_experts.hpp>

MOECOMM_NAMESPACE_BEGIN

//! Dynamic placement, even split: `flexmoe{placement, {}, {planner_options}}`.
using flexmoe = replicated<even_split, dynamic_placement>;

MOECOMM_NAMESPACE_END
