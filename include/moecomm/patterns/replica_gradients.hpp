// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `replica_gradients`: who sums an expert's gradient when several ranks compute different tokens
//! of the same expert (Parm's MP / ESP peers under PauseMP, the replicas of a replicated expert).

#include <moecomm/config.hpp>

MOECOMM_NAMESPACE_BEGIN

enum class replica_gradients {
  //! The layer, in ascending rank (`ordered_allreduce`), in every backward: each rank ends with the
  //! whole expert's gradient (plain expert parallelism's owner's), so the trainer's reduction is
  //! the same as without replicas.
  summed_here,
  //! Each rank keeps its own tokens' share, and the trainer sums it with the expert's data-parallel
  //! reduction, once per iteration rather than once per micro-batch: for Parm over
  //! `parallel_groups::expert_dp()` (as Megatron-LM's expert data-parallel group with expert tensor
  //! parallel size 1, and as Parm folds the sum into the DP/EDP all-reduce); for replicated experts
  //! over the layer's `replica_group(l)`, then the data-parallel peers. Saves the layer one
  //! all-reduce of its experts' gradients per step.
  left_to_trainer,
};

MOECOMM_NAMESPACE_END
