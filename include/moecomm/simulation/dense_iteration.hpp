// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `simulate_dense_iteration`: the calling simulated rank runs what `iteration_model`
//! (`<moecomm/plan/iteration_model.hpp>`) prices outside the MoE layers, so that a simulated step
//! becomes a simulated iteration:
//! - the forward and backward outside the MoE layers, charged as large GEMMs to the rank's device;
//! - the all-reduce of the dense gradients on `comm`: a real all-reduce of a few floats per rank,
//!   priced at the gradients' bytes (a payload scope, as the layers' rows);
//! - the optimizer's memory pass over the dense parameters and the rank's experts'.
//!
//! Call it on every rank of a `simgrid_world`, after the MoE layers' steps; a bench whose blocks
//! already charge their dense compute calls `simulate_gradient_step` alone.

#include <moecomm/comm/simgrid.hpp>
#include <moecomm/config.hpp>
#include <moecomm/plan/iteration_model.hpp>
#include <moecomm/simulation/device_time.hpp>

#include <cmath>
#include <cstddef>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! Charges this rank with the forward and backward outside `shape`'s MoE layers, every micro-batch's.
//! @throws error (invalid_argument) from `shape.validate()`.
inline void simulate_dense_compute(transformer_shape const& shape) {
  shape.validate();
  detail::charge_flops(shape.micro_batches * 3 * shape.dense_forward_flops());
}

//! The end of an iteration on this rank: the all-reduce of `shape`'s dense gradients on `comm`,
//! then the optimizer over the dense parameters and `expert_parameters` (the experts this rank holds).
//! @throws error (invalid_argument) from `shape.validate()` or naming `expert_parameters`, before any
//!   collective; what `comm.allreduce` throws.
inline void simulate_gradient_step(simgrid_communicator& comm, transformer_shape const& shape, double expert_parameters) {
  shape.validate();
  detail::require(std::isfinite(expert_parameters) && expert_parameters >= 0, "simulate_gradient_step",
                  "expert_parameters = ", expert_parameters, " must be finite and >= 0");
  // 64 real floats per rank stand for the dense gradients: the ring moves 1/R of them a step.
  std::vector<float> gradients(static_cast<std::size_t>(64 * comm.size()), 1.0f), sum(gradients.size());
  {
    double const real_bytes = static_cast<double>(gradients.size() * sizeof(float));
    detail::actor_payload_scope const scale(shape.dense_parameters() * shape.gradient_bytes / real_bytes);
    comm.allreduce(gradients.data(), sum.data(), static_cast<std::int64_t>(gradients.size()), reduce_op::sum);
  }
  detail::charge_memory((shape.dense_parameters() + expert_parameters) * shape.optimizer_bytes_per_parameter);
}

//! Both: this rank's iteration outside its MoE layers (see the file comment).
inline void simulate_dense_iteration(simgrid_communicator& comm, transformer_shape const& shape, double expert_parameters) {
  simulate_dense_compute(shape);
  simulate_gradient_step(comm, shape, expert_parameters);
}

MOECOMM_NAMESPACE_END
